"""``sage-train export``: a run's checkpoint as a Hugging Face ``LlamaForCausalLM`` directory.

The newest verified checkpoint (or ``--step N``) is read without touching the run (a
training process may hold it), and written with :func:`sage_train.hf.convert.save_pretrained`:
``config.json``, ``model.safetensors`` and the run's tokenizer (``tokenizer.json`` and
``tokenizer_config.json``), which ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``
and ``AutoTokenizer.from_pretrained(DIR)`` load offline; ``sage_export.json`` says where it
came from.  ``sage-train --init-from-hf DIR`` starts a run from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from sage_train.data import pipeline as data_lib
from sage_train.hf import convert as hf_convert
from sage_train.job.errors import ConfigError, RunDirError, require, write_error
from sage_train.model.shapes import get_model_config
from sage_train.model.sharding import make_mesh, state_shardings
from sage_train.run.config import TrainConfig
from sage_train.run.steps import build, holds_no_peak
from sage_train.store import rundir
from sage_train.store.checkpoints import Checkpoints
from sage_train.store.report import say

PROVENANCE = "sage_export.json"
"""The file of an exported directory naming the run and step it came from."""

REPLACED_NAMES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
    "generation_config.json", hf_convert.WEIGHTS_INDEX,
})
"""Files of an earlier export (or of a Hugging Face save into it) that an export replaces
as a whole: the weights (also ``*.safetensors`` shards, ``pytorch_model*``) and the
tokenizer.  Those the new export does not write are removed."""


def _replaced(name: str) -> bool:
    return (name in REPLACED_NAMES or name.endswith((".safetensors", ".index.json"))
            or name.startswith("pytorch_model"))


def export_target(out: pathlib.Path) -> list[pathlib.Path]:
    """Check that ``out`` may receive an export; return the files an export there replaces.

    ``out`` must not exist, be empty, or be an earlier export (it holds
    :data:`PROVENANCE`): its weights and tokenizer files are then replaced as a whole.

    Raises:
      RunDirError: ``out`` is a file, or a folder holding something else (named).
    """
    if not out.exists():
        return []
    if not out.is_dir():
        raise RunDirError(f"--hf {out} exists and is not a directory")
    entries = sorted(out.iterdir())
    if not entries:
        return []
    if not (out / PROVENANCE).is_file():
        names = ", ".join(p.name for p in entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise RunDirError(f"--hf {out} is neither empty nor an earlier export of sage-train "
                          f"(no {PROVENANCE}; it holds {names}): give a new or empty "
                          "directory, its files would be mixed with the export's")
    return [p for p in entries if p.is_file() and _replaced(p.name)]


def run_settings(run_dir: pathlib.Path) -> dict[str, Any]:
    """The recorded settings of a run: ``config.json``, its history, else a checkpoint's.

    Raises:
      RunDirError: ``run_dir`` is not a run's own directory (the runs below it named).
    """
    if not run_dir.is_dir():
        raise RunDirError(f"--run-dir {run_dir} does not exist")
    settings = rundir.read_settings(run_dir)
    if settings is None:
        found = Checkpoints(run_dir / "checkpoints").recorded_settings()
        settings = found[1] if found is not None else None
    if settings is None:
        runs = sorted(p.name for p in run_dir.iterdir() if (p / rundir.CONFIG).is_file())
        below = f" (the runs in it: {', '.join(runs)})" if runs else ""
        raise RunDirError(f"{run_dir} holds no run ({rundir.CONFIG}): give a run's own "
                          f"directory, RUN_DIR/MODEL-OPTIMIZER{below}")
    return settings


def _config(settings: dict[str, Any], run_dir: pathlib.Path) -> TrainConfig:
    """The run's configuration, for one device and the reference implementations."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in settings.items() if k in names})
    return dataclasses.replace(cfg, sharding="none", attention="xla",
                               sinkgd_kernel="jnp", progress=False, tensorboard=False,
                               wandb=None, run_dir=str(run_dir))


def _tokenizer_json(run_dir: pathlib.Path, settings: dict[str, Any]
                    ) -> tuple[str | None, str]:
    """The run's tokenizer as JSON (``None`` where it has none) and where it came from.

    ``run_dir/tokenizer.json`` (kept by every run on text since it was introduced); for an
    older run, the tokenizer of its data where the data is still the same (its recorded
    fingerprint).
    """
    kept = run_dir / hf_convert.TOKENIZER_FILE
    if kept.is_file():
        return kept.read_text(), str(kept)
    data = settings.get("data")
    if data not in (None, "stdlib") and pathlib.Path(data).suffix.lower() in \
            data_lib.PRETOKENIZED_SUFFIXES:
        return None, f"none: the run was trained on the token ids of {data}"
    try:
        tokens = data_lib.load_data(None if data == "stdlib" else data,
                                    vocab_size=get_model_config(settings["model"]).vocab_size,
                                    exclude=[run_dir])
    except (OSError, ValueError) as e:
        return None, f"none: the run keeps no tokenizer and its data cannot be read ({e})"
    if settings.get("data_fingerprint") not in (None, data_lib.fingerprint(tokens)):
        return None, f"none: the run keeps no tokenizer and its data {data} has changed"
    assert tokens.tokenizer is not None
    return tokens.tokenizer.to_str(), f"retrained from the run's data {data}"


def _read_model(run_dir: pathlib.Path, settings: dict[str, Any], step: int | None,
                log: Callable[[str], None]) -> tuple[Any, int]:
    """The model of the run's checkpoint of ``step`` (default: the newest that verifies).

    Raises:
      RunDirError: no readable checkpoint (of ``step``), or checkpoints older than the
        optimizer state's peak learning rate (:func:`~sage_train.run.steps.holds_no_peak`).
    """
    cfg = _config(settings, run_dir)
    vocab = get_model_config(cfg.model).vocab_size
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build(cfg, vocab)))
    shardings = state_shardings(abstract, make_mesh("none"), "none")
    like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract, shardings)
    ckpts = Checkpoints(run_dir / "checkpoints", log=log)
    try:
        if holds_no_peak(ckpts):
            raise RunDirError(
                f"the checkpoints of {ckpts.root} were written by a sage-train older than "
                "issue 46 (their optimizer state holds no peak learning rate) and cannot be "
                "read by this one: export them with the version that wrote them")
        restored = ckpts.read(like, step)
    finally:
        ckpts.close()
    model, _ = nnx.merge(graphdef, restored.state)
    return model, restored.step


def generate(model: Any, prompt: list[int], tokens: int, *, temperature: float = 0.8,
             seed: int = 0, stop: int | None = None) -> list[int]:
    """``prompt`` continued by ``model`` for up to ``tokens`` token ids (ending at ``stop``).

    Each step feeds one fixed-length window (the prompt, what was generated, padding after
    it, which a causal model does not see), so the forward pass compiles once; the next
    token is the likeliest (``temperature`` 0) or drawn from the softmax of the logits
    over ``temperature``.
    """
    import jax.numpy as jnp

    length = len(prompt) + tokens
    window = jnp.zeros((1, length), jnp.int32).at[0, :len(prompt)].set(jnp.asarray(prompt))

    @nnx.jit
    def next_token(model: Any, window: jax.Array, at: jax.Array, key: jax.Array) -> jax.Array:
        logits = model(window)[0, at - 1]
        if temperature == 0:
            return jnp.argmax(logits).astype(jnp.int32)
        return jax.random.categorical(key, logits / temperature).astype(jnp.int32)

    out: list[int] = []
    key = jax.random.key(seed)
    for at in range(len(prompt), length):
        key, sub = jax.random.split(key)
        token = int(next_token(model, window, jnp.int32(at), sub))
        out.append(token)
        if token == stop:
            break
        window = window.at[0, at].set(token)
    return out


def sample(run_dir: os.PathLike[str] | str, prompt: str, *, tokens: int = 64,
           temperature: float = 0.8, seed: int = 0, step: int | None = None) -> str:
    """The prompt and its continuation by the model of a run's checkpoint (:func:`generate`).

    Raises:
      RunDirError: ``run_dir`` is no run, holds no readable checkpoint (of ``step``), or
        keeps no tokenizer (a run on token ids).
      ConfigError: the prompt is empty, or prompt and ``tokens`` exceed the context.
    """
    from tokenizers import Tokenizer

    run_dir = pathlib.Path(run_dir).expanduser().absolute()
    settings = run_settings(run_dir)
    tokenizer_json, source = _tokenizer_json(run_dir, settings)
    if tokenizer_json is None:
        raise RunDirError(f"--run-dir {run_dir}: no tokenizer to read the prompt with "
                          f"({source})")
    tokenizer = Tokenizer.from_str(tokenizer_json)
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise ConfigError("--prompt is empty: give some text to continue")
    context = get_model_config(settings["model"]).max_position_embeddings
    if len(ids) + tokens > context:
        raise ConfigError(f"--prompt ({len(ids)} tokens) and --tokens {tokens} exceed the "
                          f"model's context of {context} positions: ask for fewer tokens")
    model, _ = _read_model(run_dir, settings, step, lambda _: None)
    new = generate(model, ids, tokens, temperature=temperature, seed=seed,
                   stop=data_lib.EOT_ID)
    if new and new[-1] == data_lib.EOT_ID:
        new = new[:-1]
    return prompt + tokenizer.decode(new)


def export_hf(run_dir: os.PathLike[str] | str, out_dir: os.PathLike[str] | str, *,
              step: int | None = None, log: Callable[[str], None] = say) -> list[pathlib.Path]:
    """Write a checkpoint of ``run_dir`` to ``out_dir`` as a Hugging Face checkpoint.

    The checkpoint of ``step`` (default: the newest that verifies), with the run's tokenizer.

    Returns:
      The files written.

    Raises:
      RunDirError: ``run_dir`` is no run, holds no readable checkpoint (of ``step``), or
        ``out_dir`` is inside a run directory, or neither new, empty nor an earlier export
        (:func:`export_target`; an earlier export's weights and tokenizer are replaced as
        a whole: those files the new export does not write are removed).
      ConfigError: ``out_dir`` is empty, or ``transformers`` is not installed.
      RunFileError: a file could not be written.
    """
    if not os.fspath(out_dir).strip():
        raise ConfigError("--hf is empty: give the directory to write the export to")
    run_dir = pathlib.Path(run_dir).expanduser().absolute()
    out = pathlib.Path(out_dir).expanduser().absolute()
    settings = run_settings(run_dir)
    if out == run_dir or run_dir in out.parents or (out / rundir.LOCK).exists():
        raise RunDirError(f"--hf {out} is inside a run directory (its config.json would be "
                          "overwritten): give a directory of its own")
    stale = export_target(out)
    require("transformers", "sage-train export")
    require("safetensors", "sage-train export")
    model, restored_step = _read_model(run_dir, settings, step, log)
    tokenizer, source = _tokenizer_json(run_dir, settings)
    special: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None}
    if tokenizer is not None:
        special = {"bos_token_id": data_lib.EOT_ID, "eos_token_id": data_lib.EOT_ID}
    files = hf_convert.save_pretrained(model, out, tokenizer_json=tokenizer,
                                       eos_token=data_lib.EOT if tokenizer else None, **special)
    provenance = {"run_dir": str(run_dir), "step": restored_step, "settings": settings}
    rundir.atomic_write_text(out / PROVENANCE, json.dumps(provenance, indent=2))
    removed = [p for p in stale if p not in files]
    for path in removed:  # the earlier export's weights and tokenizer, replaced as a whole
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise write_error(path, e) from e
    if removed:
        log(f"removed from {out}, of an earlier export: {', '.join(p.name for p in removed)}")
    log(f"exported step {restored_step} of {run_dir} to {out}: "
        f"{', '.join(p.name for p in files)} (tokenizer: {source})")
    return [*files, out / PROVENANCE]
