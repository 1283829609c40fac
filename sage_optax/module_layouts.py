"""What a layer's own attributes say about its kernel, shared by the nnx and linen readers.

:mod:`sage_optax.routing` (nnx and Equinox modules) and :mod:`sage_optax.linen_evidence`
(linen modules) both read an einsum layer's equation and both refuse a transposed
convolution's kernel the same way; this module holds those two readings once, below both.
"""

from __future__ import annotations

from sage_optim import routing as core
from sage_optim.routing import Route, RoutingError


def einsum_route(einsum_str: str, kernel_ndim: int, what: str) -> Route:
    """The route of an einsum layer's kernel from its equation (flax's ``Einsum``, both APIs).

    A kernel letter in the output only is fan-out, in the input only fan-in, in both a batch
    axis; leading kernel axes the equation does not name (a stack) are batch axes.  An
    equation this cannot read raises a one-line :class:`RoutingError` naming ``what``.
    """
    spec = einsum_str.replace(" ", "")
    if "->" not in spec or spec.count(",") != 1 or "." in spec:
        raise RoutingError(
            f"{what}: cannot read the axes of einsum {einsum_str!r} (one input, one kernel, "
            "no ellipsis); give them with an override Route('dense', fan_in=..., fan_out=...)"
        )
    lhs, out = spec.split("->")
    inp, ker = lhs.split(",")
    extra = kernel_ndim - len(ker)
    fan_in, fan_out, batch = [], [], list(range(extra))
    for i, letter in enumerate(ker):
        axis = extra + i
        if letter in out and letter in inp:
            batch.append(axis)
        elif letter in out:
            fan_out.append(axis)
        elif letter in inp:
            fan_in.append(axis)
        else:
            raise RoutingError(
                f"{what}: kernel letter {letter!r} of einsum {einsum_str!r} is in neither the "
                "input nor the output; give the axes with an override"
            )
    if not fan_in or not fan_out:
        return Route("vector", batch=tuple(batch), evidence=f"module nnx.Einsum {einsum_str!r}")
    return Route(
        "dense", tuple(fan_in), tuple(fan_out), tuple(batch),
        evidence=f"module nnx.Einsum {einsum_str!r}",
    )


def conv_transpose_refusal(full: str, shape: tuple[int, ...], conv: Route, what: str,
                            when: str) -> RoutingError:
    """The refusal of a transposed convolution's kernel, ``what``: its fan-in is a choice.

    The first option, ``conv`` (right ``when``), reads it as the library's own convolution
    reads its kernel; the other gives it the element-wise rules.
    """
    return RoutingError(
        f"cannot place {full!r} of shape {shape}: {what} has no layout this router knows "
        "(which axes are its fan-in is a modelling choice); give it, e.g. "
        + core.override_advice(full, conv),
        leaf=full, shape=shape,
        options=[(conv, when), ("vector", "element-wise rules are wanted")],
    )
