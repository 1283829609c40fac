"""The paper's eight optimizer configurations as Optax transformations (Table 2).

:func:`make_optimizer` builds any of them from the shared table in
:mod:`sage_optim.presets`: the router (:func:`~sage_optax.route_params`) labels every leaf
``embedding``/``dense``/``vector`` and ``optax.partition`` sends each kind to its rule.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax

from sage_optax import axes as axes_lib
from sage_optax import logical, memory, registry, routing, state_tree, validation
from sage_optax.finite_rate import skip_nonfinite_rate
from sage_optax.sinkgd import IMPLS
from sage_optim import rates
from sage_optim.hyperparams import AdamWHyperparams, SageHyperparams, SinkGDHyperparams
from sage_optim.presets import CONFIG_NAMES, PRESETS, RuleSpec
from sage_optim.presets import resolve_preset as resolve_preset  # noqa: F401 (read here)
from sage_optim.settings import KindSettings, Settings, parse_settings
from sage_optim.table import RoutingRow, RoutingTable

OPTION_KEYS: tuple[str, ...] = (
    "route_overrides", "vocab_size", "layout", "model", "params", "mask", "skip_nonfinite",
    "impl", "strict", "axis_names", "axis_roles",
)
"""Keyword options of :func:`make_optimizer` that are not hyperparameters."""

INJECTABLE: tuple[str, ...] = ("b1", "b2", "eps", "weight_decay", "alpha")
"""Numeric hyperparameters :func:`make_optimizer` names in its signature, so that
``optax.inject_hyperparams(make_optimizer, static_args="name")`` can inject them (with the
learning rate); each applies to every rule of the configuration that has it, except in a kind
that gives its own (``<kind>_<hp>``, static)."""


def build_rule(
    rule: RuleSpec | KindSettings,
    learning_rate: optax.ScalarOrSchedule,
    axes: Any,
    mask: Any | None = None,
    impl: str = "auto",
) -> optax.GradientTransformation:
    """The Optax transformation of one rule with its hyperparameters.

    The rule's builder comes from :mod:`sage_optax.registry`, where its module registered
    it: this function knows no rule by name.  The builder gets the rule's typed
    hyperparameters (``rule.hp``, :data:`sage_optim.hyperparams.RULE_HYPERPARAMS`) and
    reads them by name.

    Args:
      rule: which update rule and its hyperparameters (a kind's
        :class:`~sage_optim.settings.KindSettings`, or a
        :class:`~sage_optim.presets.RuleSpec`).
      learning_rate: float or schedule.
      axes: per-leaf :class:`~sage_optax.Route` (pytree or callable of the params).
      mask: weight-decay mask (pytree of bools or callable), as ``optax.adamw``.
      impl: SinkGD's implementation of its scales (:data:`sage_optax.sinkgd.IMPLS`).
    """
    build = registry.builder(rule.name)
    return build(learning_rate, rule.hp, registry.RuleContext(axes, mask, impl))


def make_optimizer(
    name: str,
    learning_rate: optax.ScalarOrSchedule | None = None,
    *,
    b1: Any = None,
    b2: Any = None,
    eps: Any = None,
    weight_decay: Any = None,
    alpha: Any = None,
    **overrides: Any,
) -> optax.GradientTransformation:
    """Build one of the paper's eight configurations by name.

    Args:
      name: one of ``adamw``, ``lion``, ``apollo``, ``sinkgd-pure``, ``sinkgd-hybrid``,
        ``lion-hybrid``, ``sage-pure``, ``sage-hybrid`` (:data:`sage_optim.CONFIG_NAMES`).
      learning_rate: float or optax schedule; defaults to the configuration's paper value
        (2e-3 SAGE-based and Lion-Hybrid, 1e-4 AdamW/Lion/APOLLO, 2e-2 SinkGD-based).
      b1: β1 of every rule that has one (``None``: each rule's default).
      b2: β2 of every rule that has one.
      eps: ε of every rule that has one.
      weight_decay: decoupled decay of every rule.
      alpha: SinkGD's update scale α (every SinkGD kind).
      **overrides: any of

        * ``embedding=``/``dense=``/``vector=``: a rule name (``"adamw"``, ``"lion"``,
          ``"sage"``, ``"sinkgd"``, ``"apollo"``, ``"unit_norm"``) or a
          :class:`sage_optim.RuleSpec` to swap, e.g. ``vector="adamw"`` for the paper's
          SAGE-Hybrid variant with AdamW on 1-D parameters;
        * ``<kind>_<hp>=``: one hyperparameter of one kind's rule, e.g. ``dense_alpha=5.0``;
        * ``<kind>_learning_rate=``: one kind's own learning rate (a float or a schedule),
          e.g. ``dense_learning_rate=2e-2`` when swapping from AdamW keeps the program's
          rate for the others (:mod:`sage_optim.rates`; a rate whose effective step is far
          from the configuration's gets a one-time
          :class:`~sage_optim.rates.LearningRateNotice`);
        * ``<hp>=``: any other hyperparameter for every rule that has it, e.g.
          ``num_iters=3``; a kind's own ``<kind>_<hp>`` wins over a global ``<hp>``
          (``weight_decay=0.1, vector_weight_decay=0.0`` decays all but the vectors;
          ``docs/configurations.md``, "Which value wins");
        * for the router (:func:`~sage_optax.route_params`): ``route_overrides={glob: kind
          or Route(kind, fan_in=..., fan_out=...)}``, ``vocab_size=``, ``layout=`` (``None``:
          each leaf's name says its convention; ``"flax"`` or ``"torch"`` declares one for
          the whole tree), ``model=`` (the ``nnx.Module`` or Equinox model whose module
          types are evidence: recommended for models with ``nnx.Conv``,
          ``nnx.LinearGeneral``, ``nnx.MultiHeadAttention`` or ``nnx.Einsum``) and
          ``strict=True`` (refuse a leaf with no layout evidence, a bare array in a list or
          tuple, instead of giving it the element-wise rule with a
          :class:`~sage_optax.routing.NoLayoutEvidenceWarning`), ``axis_names=`` (the
          logical axis names of unboxed params) and ``axis_roles={name: role}`` (extends
          :data:`sage_optax.logical.AXIS_ROLES`), ``params=`` (the whole params tree,
          arrays or ``jax.ShapeDtypeStruct``: the routing of a tree that reaches the
          optimizer with ``optax.MaskedNode`` placeholders, inside ``optax.masked`` or
          ``optax.multi_transform``, is taken from it; without it, from ``model=``'s
          parameters or the first tree without placeholders routed, else refused: the
          placeholders are not evidence, and an untied head is found by the token table's
          shape);
        * ``mask=``: weight-decay mask (pytree of bools or callable);
        * ``impl=``: how SinkGD computes its scales, ``"auto"`` (default: jnp, until
          ``scripts/gpu-check`` validates the Pallas kernel on a GPU), ``"pallas"`` (the
          kernel, on CUDA arrays; opt-in) or ``"jnp"`` (:func:`~sage_optax.scale_by_sinkhorn`;
          ``SAGE_KERNELS=off`` in the environment turns the kernel off);
        * ``skip_nonfinite=N``: an integer in ``[0, 2**31 - 1]`` (optax counts in an
          ``int32``); wrap in
          ``optax.apply_if_finite(tx, max_consecutive_errors=N)`` so a step with a NaN/Inf
          gradient is skipped (zero update, state untouched), at most ``N`` in a row: the
          ``(N + 1)``-th consecutive non-finite step (and any after it) is applied, so a
          persistent failure surfaces; a finite step resets the run; 0 (default): off.

    A learning rate that is a schedule (or an array) is checked at every step: a step whose
    rate is NaN or Inf is skipped (zero update, state untouched) and counted in the
    state's ``notfinite_lr_count`` (:func:`~sage_optax.finite_rate.skip_nonfinite_rate`).

    ``optax.inject_hyperparams(make_optimizer, static_args="name")(name="sage-hybrid",
    learning_rate=schedule, b1=0.9)`` injects the learning rate and the named numeric
    hyperparameters (:data:`INJECTABLE`); options and ``<kind>_<hp>`` overrides stay static.

    Returns:
      An ``optax.GradientTransformation`` (an ``optax.partition`` over the kinds).

    Raises:
      ValueError: unknown name (the message lists the valid ones), unknown override,
        negative learning rate, ``skip_nonfinite`` not an integer in ``[0, 2**31 - 1]``.

    Examples:
      SAGE-Hybrid on a small tree: the router places each leaf by its name (``embedding``
      a table, ``kernel`` a Flax ``(in, out)`` matrix, the 1-D ``bias`` a vector), and only
      SAGE keeps state (``M`` and ``S``: 272 bytes for the table, 64 for the bias, plus the
      step counts); SinkGD on the kernel keeps none:

      >>> import jax, jax.numpy as jnp, optax, sage_optax
      >>> params = {"embed": {"embedding": jnp.ones((16, 4))},
      ...           "mlp": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
      >>> tx = sage_optax.make_optimizer("sage-hybrid")  # the paper's defaults, lr 2e-3
      >>> state = tx.init(params)
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> updates, state = jax.jit(tx.update)(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> print(sage_optax.route_params(params).labels)
      {'embed': {'embedding': 'embedding'}, 'mlp': {'bias': 'vector', 'kernel': 'dense'}}
      >>> print(sage_optax.state_bytes(state))
      344

      AdamW's two moments per entry, counted without allocating them; overrides swap a
      kind's rule or set one kind's hyperparameter:

      >>> adamw = sage_optax.make_optimizer("adamw")
      >>> print(sage_optax.state_bytes(jax.eval_shape(adamw.init, params)))
      844
      >>> tx = sage_optax.make_optimizer("sage-hybrid", vector="adamw", dense_alpha=5.0)

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Table 2: the eight configurations; the hybrid structure).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD and its hybrid with AdamW).

      Chen et al., `Symbolic Discovery of Optimization Algorithms
      <https://arxiv.org/abs/2302.06675>`_, 2023 (Lion).

      Zhu et al., `APOLLO: SGD-like Memory, AdamW-level Performance
      <https://arxiv.org/abs/2412.05270>`_, 2024 (APOLLO).

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019 (AdamW).
    """
    overrides = _merge_injected(overrides)
    named = {"b1": b1, "b2": b2, "eps": eps, "weight_decay": weight_decay, "alpha": alpha}
    overrides.update({k: v for k, v in named.items() if v is not None})
    settings = parse_settings(name, learning_rate, overrides, OPTION_KEYS)
    return _build(settings, overrides)


def _build(settings: Settings, options: dict[str, Any],
           stacklevel: int = 4) -> optax.GradientTransformation:
    """The optimizer of parsed ``settings``, with the :data:`OPTION_KEYS` in ``options``.

    Consumes ``options``.  ``stacklevel``: where a
    :class:`~sage_optim.rates.LearningRateNotice` points, counted from this function's
    caller's caller (the user's line).
    """
    lr = settings.learning_rate
    validation.check_learning_rate(lr)
    own_rates = settings.own_rates
    for rate in own_rates.values():
        validation.check_learning_rate(rate)
    rates.notice_far_rates(settings.name, settings.preset,
                           {k.kind: k.rate(lr) for k in settings.kinds},
                           per_kind=bool(own_rates), stacklevel=stacklevel)
    router = _Router(options)
    mask = options.pop("mask", None)
    impl = options.pop("impl", "auto")
    validation.check_choice("impl", impl, IMPLS)
    skip_nonfinite = validation.check_skip_nonfinite(options.pop("skip_nonfinite", 0))
    assert not options, options  # every key was consumed

    def axes_fn(params: Any) -> Any:
        return router.axes_of(params)

    def labels_fn(params: Any) -> Any:
        return router(params, warn=True).labels  # the full tree: routed (and warned) once

    def build(rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
        # a kind given its own rate (<kind>_learning_rate=) keeps it; the others take `rate`
        return optax.partition(
            {k.kind: state_tree.without_boxed_placeholders(
                build_rule(k, k.rate(rate), axes_fn, mask, impl))
             for k in settings.kinds},
            labels_fn,
        )

    tx: optax.GradientTransformation = skip_nonfinite_rate(build, lr)  # a NaN rate: skipped
    if skip_nonfinite:
        tx = optax.apply_if_finite(tx, max_consecutive_errors=skip_nonfinite)
    return with_tree_checks(tx)


def _merge_injected(overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` with a nested ``overrides=`` dict unpacked.

    ``optax.inject_hyperparams`` binds ``make_optimizer``'s signature and passes the
    ``**overrides`` it collected as one keyword named ``overrides``.
    """
    overrides = dict(overrides)
    nested = overrides.pop("overrides", None)
    if nested is not None:
        if not isinstance(nested, Mapping):
            raise ValueError(f"unknown override 'overrides' ({nested!r})")
        clash = set(nested) & set(overrides)
        if clash:
            raise ValueError(f"overrides given twice: {sorted(clash)}")
        overrides.update(nested)
    return overrides


def _refuse_called_module(model: Any) -> None:
    """Refuse a ``model=`` that is a value: a module ``optax.inject_hyperparams`` called.

    ``optax.inject_hyperparams`` calls every callable argument not in ``static_args`` with
    the step count, as a schedule, and passes on what it returns; a module is callable.

    Raises:
      TypeError: ``model`` is an array or a number, with the remedy.
    """
    if isinstance(model, jax.Array | np.ndarray | numbers.Number) or (
            hasattr(model, "shape") and hasattr(model, "dtype")):
        raise TypeError(
            f"model= got a {type(model).__name__}, not a module: optax.inject_hyperparams "
            "calls every callable argument with the step count as a schedule, and a module "
            "is callable; pass static_args=('model',) to optax.inject_hyperparams (a "
            "module that cannot take a step count fails inside its own __call__ first)")


class _Router:
    """The routing of one optimizer: computed once per parameter tree, shared by its kinds.

    ``optax.partition`` routes the full tree for its labels, then hands each kind's
    transform the tree with the other kinds' leaves masked; those look their axes up here
    (:meth:`axes_of`) instead of routing again, so :func:`~sage_optax.route_params` runs
    once per tree structure (and shapes), not once per kind and per trace.  The module
    evidence of ``model=`` is read once, when the optimizer is built.
    """

    def __init__(self, overrides: dict[str, Any]) -> None:
        self.route_overrides = overrides.pop("route_overrides", None)
        self.vocab_size = overrides.pop("vocab_size", None)
        layout = overrides.pop("layout", None)
        model = overrides.pop("model", None)
        self.strict = overrides.pop("strict", False)
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be True or False, got {self.strict!r}")
        if layout == "auto":
            layout = None
        if layout is not None and layout not in routing.PARAM_LAYOUTS:
            raise ValueError(
                f"layout must be one of {routing.PARAM_LAYOUTS} or None, got {layout!r}")
        self.layout = layout
        if model is not None:
            _refuse_called_module(model)
        self.evidence = routing.module_routes(model) if model is not None else None
        # logical axis names, remembered across calls: nnx.Optimizer inits on nnx.Param
        # boxes (their names) and updates on bare arrays
        self.axis_roles = logical.check_axis_roles(overrides.pop("axis_roles", None))
        self.names = logical.names_of(model) if routing.is_nnx_module(model) else {}
        self.given_names = logical.names_of(overrides.pop("axis_names", None))
        self.names.update(self.given_names)
        self.routed: dict[Any, routing.ParamRouting] = {}
        self.last: dict[str, tuple[tuple[int, ...], Any]] = {}  # path -> (shape, axes)
        # The whole model, whose routing decides the leaves of a tree that arrives with
        # placeholders (optax.masked, multi_transform): params= given, else model=, else
        # the first tree without placeholders routed here.
        given = overrides.pop("params", None)
        self.model = model
        self.whole: Any = None if given is None else _shapes_only(given)
        self.whole_from = "params=" if given is not None else None
        self.whole_routes: dict[str, tuple[tuple[int, ...], Any, Any, Any]] | None = None

    def __call__(self, params: Any, warn: bool = False) -> routing.ParamRouting:
        """The routing of ``params`` (a full tree), computed at its first call.

        A tree with ``optax.MaskedNode`` placeholders (the optimizer inside
        ``optax.masked``/``optax.multi_transform``) takes each leaf's route from the
        routing of the whole model (:meth:`_from_whole`): the placeholders are not evidence.
        """
        leaves, treedef = jax.tree.flatten(params, is_leaf=axes_lib.is_masked)
        key = (treedef, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", "")))
                              for x in leaves))
        if key not in self.routed and any(isinstance(x, optax.MaskedNode) for x in leaves):
            self.routed[key] = self._from_whole(params, warn)
        if key not in self.routed:
            paths = {p for p, _ in _all_paths(params)}  # masked leaves too: optax.partition
            logical.check_matched(self.given_names, sorted(paths))  # axis_names= name them
            self.names.update(logical.names_of(params))
            self.routed[key] = routing.route_params(
                params, self.route_overrides, vocab_size=self.vocab_size, layout=self.layout,
                module_evidence=self.evidence, strict=self.strict, warn=warn,
                axis_names={k: v for k, v in self.names.items() if k in paths},
                axis_roles=self.axis_roles,
            )
            if self.whole is None and self.whole_from is None:
                self.whole, self.whole_from = _shapes_only(params), "the first tree routed"
        result = self.routed[key]
        self.last = {path: (tuple(x.shape), axes) for (path, x), (_, axes) in zip(
            routing.iter_leaves(params), routing.iter_leaves(result.axes), strict=True)}
        return result

    def _whole_routes(self, warn: bool) -> dict[str, tuple[tuple[int, ...], Any, Any, Any]]:
        """``{path: (shape, label, axes, route)}`` of the whole model, routed once."""
        if self.whole_routes is None:
            whole = self(self.whole, warn=warn)
            self.whole_routes = {
                path: (tuple(x.shape), label, axes, route) for (path, x), (_, label),
                (_, axes), (_, route) in zip(
                    routing.iter_leaves(self.whole), routing.iter_leaves(whole.labels),
                    routing.iter_leaves(whole.axes), routing.iter_leaves(whole.routes),
                    strict=True)}
        return self.whole_routes

    def _from_whole(self, params: Any, warn: bool) -> routing.ParamRouting:
        """The routing of a tree with placeholders: each leaf's, in the whole model.

        Raises:
          RoutingError: no whole model to take the routes from (neither ``params=`` nor
            ``model=`` given, nor a tree without placeholders routed before), or a leaf
            that is not in it with the same shape.
        """
        masked = [path for path, x in _all_paths(params) if isinstance(x, optax.MaskedNode)]
        if self.whole is None and self.model is not None:
            self.whole = _params_of_model(self.model)
            self.whole_from = None if self.whole is None else "model="
        if self.whole is None:
            raise routing.RoutingError(
                f"the params reach the optimizer with {len(masked)} placeholder(s) "
                f"(optax.MaskedNode at {_listed(masked)}: optax.masked, optax.multi_transform "
                "or optax.partition around it), and a leaf's route depends on the whole model "
                "(an untied head is found by the token table's shape); pass the whole params "
                "tree when building the optimizer: make_optimizer(name, params=params) (arrays "
                "or jax.ShapeDtypeStruct; or model= an nnx or Equinox model, or "
                "sage_optax.linen_model(module, *inputs))")
        routes = self._whole_routes(warn)
        with_path, treedef = jax.tree_util.tree_flatten_with_path(
            params, is_leaf=axes_lib.is_masked)
        out: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
        for p, x in with_path:
            path = routing.leaf_name_path(p)
            if axes_lib.is_masked(x):
                for part in out:
                    part.append(x)
                continue
            hit = routes.get(path)
            shape = tuple(getattr(x, "shape", ()))
            if hit is None or hit[0] != shape:
                said = "is not in it" if hit is None else f"has shape {hit[0]} there"
                raise routing.RoutingError(
                    f"parameter {path!r} of shape {shape} (in a tree with placeholders, routed "
                    f"as part of the whole model given by {self.whole_from}) {said}; pass "
                    "the params this optimizer trains as make_optimizer(name, params=params)")
            for part, value in zip(out, hit[1:], strict=True):
                part.append(value)
        unflat = jax.tree_util.tree_unflatten
        return routing.ParamRouting(*(unflat(treedef, part) for part in out))

    def axes_of(self, params: Any) -> Any:
        """The axes of ``params``, a kind's subtree, from the last full tree routed."""
        with_path, treedef = jax.tree_util.tree_flatten_with_path(
            params, is_leaf=axes_lib.is_masked)
        out = []
        for path, x in with_path:
            if axes_lib.is_masked(x):
                out.append(x)
                continue
            hit = self.last.get(axes_lib.path_str(path))
            if hit is None or hit[0] != tuple(getattr(x, "shape", ())):
                return self(params).axes  # not a subtree of the last tree: route it
            out.append(hit[1])
        return jax.tree_util.tree_unflatten(treedef, out)


def _shapes_only(tree: Any) -> Any:
    """``tree`` with every array a ``jax.ShapeDtypeStruct`` (boxes and metadata kept)."""
    return jax.tree.map(
        lambda x: x if axes_lib.is_masked(x) or not hasattr(x, "shape")
        else jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), tree, is_leaf=axes_lib.is_masked)


def _params_of_model(model: Any) -> Any:
    """The parameters of an nnx, Equinox or linen ``model`` (shapes only), else ``None``."""
    from sage_optax import linen_evidence

    if isinstance(model, linen_evidence.LinenModel):
        return _shapes_only(linen_evidence.abstract_params(model))
    if routing.is_nnx_module(model):
        from flax import nnx

        return _shapes_only(nnx.state(model, nnx.Param))
    adapter = routing.model_adapter(model)
    if adapter is not None and adapter.params is not None:
        return _shapes_only(adapter.params(model, None, None)[0])
    return None


def _listed(paths: list[str], most: int = 3) -> str:
    """``'a', 'b', 'c' and 2 more``."""
    shown = ", ".join(repr(p) for p in paths[:most])
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")


def _all_paths(params: Any) -> list[tuple[str, Any]]:
    """``(dotted path, leaf)`` of every leaf of ``params``, masked ones included."""
    with_path, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=axes_lib.is_masked)
    return [(routing.leaf_name_path(p), x) for p, x in with_path]


def with_tree_checks(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Wrap ``tx`` so gradients or a state that do not match the params fail readably.

    ``update`` refuses gradients whose tree or shapes differ from the params', and a state
    that ``tx.init`` built for other params (:func:`sage_optax.state_tree.check_state`:
    one line naming the parameter and the two shapes), before any arithmetic.  The checks
    run at trace time only (structure and shapes are static; the state ``init`` would
    build is found with ``jax.eval_shape``), add no state and no runtime cost: the wrapped
    transformation's state is ``tx``'s own.
    """
    inner = optax.with_extra_args_support(tx)
    expected: dict[Any, Any] = {}  # the state init builds, per tree structure and shapes

    def update_fn(
        updates: optax.Updates, state: Any, params: optax.Params | None = None, **extra: Any
    ) -> tuple[optax.Updates, Any]:
        if params is not None:
            check_matching_trees(updates, params)
        tree = updates if params is None else params
        leaves, treedef = jax.tree.flatten(tree, is_leaf=axes_lib.is_masked)
        key = (treedef, tuple((np.shape(x), str(getattr(x, "dtype", ""))) for x in leaves))
        if key not in expected:
            expected.clear()  # one entry: a new structure is a new model
            expected[key] = jax.eval_shape(inner.init, tree)
        state_tree.check_state(state, expected[key], tree)
        return inner.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def check_matching_trees(updates: Any, params: Any) -> None:
    """Raise a ``ValueError`` naming the first path where ``updates`` and ``params`` differ."""
    u_def: Any = jax.tree.structure(updates, is_leaf=axes_lib.is_masked)
    p_def: Any = jax.tree.structure(params, is_leaf=axes_lib.is_masked)
    if u_def != p_def:
        raise ValueError(
            axes_lib.tree_mismatch_message(p_def, updates, "the gradients", "the params")
        )
    u_leaves = [x for _, x in routing.iter_leaves(updates)]
    p_named = routing.iter_leaves(params)
    axes_lib.check_same_shapes(
        [n for n, _ in p_named], [x for _, x in p_named], u_leaves, "the gradient", "the param"
    )


_HYBRID = PRESETS["sage-hybrid"]


def _hybrid_rules() -> tuple[SageHyperparams, SinkGDHyperparams]:
    """The ``sage-hybrid`` preset's SAGE (embedding) and SinkGD (dense) hyperparameters."""
    sage_hp, sinkgd_hp = _HYBRID.embedding.hp, _HYBRID.dense.hp
    assert isinstance(sage_hp, SageHyperparams) and isinstance(sinkgd_hp, SinkGDHyperparams)
    return sage_hp, sinkgd_hp


_HYBRID_SAGE, _HYBRID_SINKGD = _hybrid_rules()


def sage_hybrid(
    learning_rate: optax.ScalarOrSchedule = _HYBRID.learning_rate,
    b1: float = _HYBRID_SAGE.b1,
    b2: float = _HYBRID_SAGE.b2,
    eps: float = _HYBRID_SAGE.eps,
    weight_decay: float = _HYBRID_SAGE.weight_decay,
    alpha: float = _HYBRID_SINKGD.alpha,
    num_iters: int = _HYBRID_SINKGD.num_iters,
    *,
    vector_rule: str = "sage",
    route_overrides: Mapping[str, Any] | None = None,
    vocab_size: int | None = None,
    layout: str | None = None,
    model: Any | None = None,
    mask: Any | None = None,
    strict: bool = False,
    params: Any | None = None,
) -> optax.GradientTransformation:
    """SAGE-Hybrid, the paper's method: SAGE on embeddings and vectors, Unit-Norm SinkGD on dense.

    An ``optax.partition`` over the router's labels (Table ``tab:hybrid_structure``):
    ``embedding`` → :func:`~sage_optax.sage` (``O(Vd) + O(d)`` state), ``dense`` →
    :func:`~sage_optax.sinkgd` with ``normalization="unit"`` (stateless), ``vector`` →
    SAGE (or ``vector_rule="adamw"``, the variant the paper found equivalent).

    Works with ``optax.inject_hyperparams(sage_hybrid)(learning_rate=schedule)``, also with
    ``model=`` and a callable ``mask=``: optax calls every callable argument not in
    ``static_args`` with the step count, as a schedule, but binding this function's
    signature keeps those two static (naming them in ``static_args``, as the README does,
    is the same), so the state is the uninjected optimizer's, in ``inner_state``.

    Every default is the ``sage-hybrid`` preset's (:data:`sage_optim.presets.PRESETS`), read
    from it, so the alias and :func:`make_optimizer` cannot drift apart.

    Args:
      learning_rate: float or schedule (paper: 2e-3, cosine with 10% warmup).
      b1: SAGE β1.
      b2: SAGE β2.
      eps: ε of SAGE's dampers and of the Sinkhorn norms.
      weight_decay: decoupled decay for every parameter.
      alpha: SinkGD update scale α.
      num_iters: Sinkhorn iterations.
      vector_rule: ``"sage"`` or ``"adamw"`` for 1-D/0-D parameters.
      route_overrides: router overrides, see :func:`~sage_optax.route_params`.
      vocab_size: the vocabulary size, for heads of a tree without a token table.
      layout: ``None`` (each leaf's name says its convention), ``"flax"`` or ``"torch"``
        (:func:`~sage_optax.route_params`).
      model: the ``nnx.Module`` or Equinox model whose module types are routing evidence
        (static under ``optax.inject_hyperparams``, ``static_args`` or not).
      mask: weight-decay mask.
      strict: refuse leaves with no layout evidence instead of the element-wise fallback.
      params: the whole params tree, whose routing a tree with ``optax.MaskedNode``
        placeholders (inside ``optax.masked``, ``optax.multi_transform``) takes
        (:func:`make_optimizer`).

    Returns:
      An ``optax.GradientTransformation``.

    Examples:
      The same optimizer as ``make_optimizer("sage-hybrid")``, with named arguments:

      >>> import jax, jax.numpy as jnp, optax, sage_optax
      >>> params = {"embedding": jnp.ones((16, 4)), "kernel": jnp.ones((4, 8))}
      >>> tx = sage_optax.sage_hybrid(learning_rate=1e-3, alpha=5.0)
      >>> state = tx.init(params)
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> updates, state = tx.update(grads, state, params)
      >>> print({k: f"{float(abs(u).max()):.4f}" for k, u in updates.items()})
      {'embedding': '0.0010', 'kernel': '0.0018'}

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (SAGE-Hybrid: Table 2 and the hybrid structure).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD).
    """
    validation.check_choice("vector_rule", vector_rule, ("sage", "adamw"))
    model, mask = _unwrap_static(model), _unwrap_static(mask)
    b1, b2 = _given(b1, _HYBRID_SAGE.b1), _given(b2, _HYBRID_SAGE.b2)
    eps = _given(eps, _HYBRID_SAGE.eps)
    weight_decay = _given(weight_decay, _HYBRID_SAGE.weight_decay)
    sage_hp = SageHyperparams(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                              damper=_HYBRID_SAGE.damper)
    dense_hp = SinkGDHyperparams(alpha=alpha, num_iters=num_iters, eps=eps,
                                 weight_decay=weight_decay,
                                 normalization=_HYBRID_SINKGD.normalization)
    vector_hp: SageHyperparams | AdamWHyperparams = sage_hp
    if vector_rule == "adamw":
        vector_hp = AdamWHyperparams(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    settings = Settings(
        "sage-hybrid", _given(learning_rate, _HYBRID.learning_rate),
        embedding=KindSettings("embedding", sage_hp.rule, sage_hp),
        dense=KindSettings("dense", dense_hp.rule, dense_hp),
        vector=KindSettings("vector", vector_hp.rule, vector_hp),
    )
    return _build(settings, {
        "route_overrides": route_overrides, "vocab_size": vocab_size, "layout": layout,
        "model": model, "mask": mask, "strict": strict, "params": params})


def _given(value: Any, default: Any) -> Any:
    """``value``, or ``default`` where it is ``None`` (as :func:`make_optimizer` reads it)."""
    return default if value is None else value


class _Static:
    """An argument ``optax.inject_hyperparams`` must not call: wrapped so it is not callable."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _unwrap_static(value: Any) -> Any:
    return value.value if isinstance(value, _Static) else value


class _StaticOptionsSignature(inspect.Signature):
    """The signature of :func:`sage_hybrid`: binding it keeps ``model`` and ``mask`` static.

    ``optax.inject_hyperparams`` binds the factory's signature and calls every callable
    argument not in ``static_args`` with the step count, as a schedule: an ``nnx.Module``
    given as ``model=`` (or a callable weight-decay ``mask``) would be called, and fail
    inside its own ``__call__`` before :func:`sage_hybrid` runs.  This signature's ``bind``
    hands such an argument on wrapped in a non-callable :class:`_Static` (which
    :func:`sage_hybrid` unwraps), so ``inject_hyperparams(sage_hybrid)(model=model)`` builds
    the same optimizer as ``sage_hybrid(model=model)``, with or without ``static_args``.
    """

    def bind(self, /, *args: Any, **kwargs: Any) -> inspect.BoundArguments:
        """``inspect.Signature.bind``, with a callable ``model``/``mask`` made static."""
        bound = super().bind(*args, **kwargs)
        for name in ("model", "mask"):
            value = bound.arguments.get(name)
            if callable(value):
                bound.arguments[name] = _Static(value)
        return bound


sage_hybrid.__signature__ = _StaticOptionsSignature.from_callable(  # type: ignore[attr-defined]
    sage_hybrid)


def routing_table(
    name: str, params: Any, /, *, wrt: Any = None, **overrides: Any
) -> RoutingTable:
    """Route ``params`` as configuration ``name`` would and count each leaf's state bytes.

    Each row gives the leaf's kind, rule, fan-in and fan-out axes (with sizes), the
    evidence that placed it and its state bytes.  Nothing is allocated: the state comes
    from ``jax.eval_shape(tx.init, params)``.

    Args:
      name: a configuration name (see :func:`make_optimizer`).
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``), or an ``nnx.Module``
        (the state ``nnx.state(model, wrt)`` selects, routed with its module types as
        evidence), or an Equinox model (its leaves ``eqx.filter(model, wrt)`` keeps,
        likewise).
      wrt: for a module, which leaves are trained: the filter given to ``nnx.Optimizer``
        (default ``nnx.Param``; ``jax.Array`` for a model holding plain arrays) or to
        ``eqx.filter`` (default ``eqx.is_inexact_array``).  For a tree of parameters,
        leave it out (the tree is what is routed).
      **overrides: as for :func:`make_optimizer` (``learning_rate``,
        ``<kind>_learning_rate``, rule swaps, router options...).

    Returns:
      A :class:`RoutingTable`; ``print`` it.

    Raises:
      ValueError: nothing to route (the filter selects no array; the message says which
        ``wrt`` to try), or ``wrt`` given with a tree of parameters.

    Examples:
      ``print(table)`` shows every column; here, a few of them:

      >>> import jax.numpy as jnp, sage_optax
      >>> params = {"embed": {"embedding": jnp.ones((16, 4))},
      ...           "mlp": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
      >>> table = sage_optax.routing_table("sage-hybrid", params)
      >>> for row in table.rows:
      ...     print(row.path, row.kind, row.rule, row.fan_out, row.state_bytes)
      embed.embedding embedding sage 0 (16) 272
      mlp.bias vector sage - 64
      mlp.kernel dense sinkgd(unit, alpha=10) 1 (8) 0
      >>> print(table.total_bytes, table.row("mlp.kernel").evidence)
      344 name 'kernel' (Flax (in, out))

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (the embedding layer dilemma: why the kind and the axes of each leaf matter).
    """
    if routing.is_nnx_module(params):
        from flax import nnx

        overrides.setdefault("model", params)
        what = f"nnx.state(model, {'nnx.Param' if wrt is None else _filter_name(wrt)})"
        params = nnx.state(params, nnx.Param if wrt is None else wrt)
    elif (adapter := routing.model_adapter(params)) is not None and adapter.params is not None:
        overrides.setdefault("model", params)
        params, what = adapter.params(params, wrt, None if wrt is None else _filter_name(wrt))
    elif wrt is not None:
        raise ValueError(
            "routing_table: wrt= selects the trained leaves of an nnx.Module or Equinox "
            f"model, but params is a {type(params).__name__}; pass the model, or leave wrt "
            "out and pass the selected parameters"
        )
    else:
        what = "params"
    if not routing.iter_leaves(params):
        hint = (
            "; a model whose parameters are plain arrays needs the filter nnx.Optimizer "
            "is given, e.g. routing_table(name, model, wrt=jax.Array)"
            if what.startswith("nnx") else ""
        )
        raise ValueError(f"routing_table: {what} holds no arrays to route{hint}")
    settings = parse_settings(name, overrides.pop("learning_rate", None), overrides,
                              OPTION_KEYS)
    tx = _build(settings, dict(overrides))
    route = _Router(dict(overrides))(params)
    state = jax.eval_shape(tx.init, params)
    per_leaf, shared = memory.state_bytes_by_leaf(state, params)
    routes = dict(routing.iter_leaves(route.routes))
    rows = []
    for path, leaf in routing.iter_leaves(params):
        r = routes[path]
        kind = settings.kind(r.kind)
        rows.append(RoutingRow(
            path, tuple(leaf.shape), r.kind, kind.describe(),
            r.describe_fan_in(), r.describe_fan_out(), r.evidence, per_leaf[path],
            rates.describe_step(kind, kind.rate(settings.learning_rate)),
        ))
    return RoutingTable(name, tuple(rows), shared)


def _filter_name(wrt: Any) -> str:
    """A short name of a filter, for messages."""
    return getattr(wrt, "__name__", None) or repr(wrt)


__all__ = ["CONFIG_NAMES", "RoutingTable", "make_optimizer", "routing_table", "sage_hybrid"]
