"""Issue 46: one compiled train and eval step per configuration, across rates and seeds.

The peak learning rate is a float32 scalar of the optimizer state (``hyperparams``) that
multiplies the unit-peak schedule, not a constant of the compiled step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_helpers import config

from sage_train.run import steps as steps_mod
from sage_train.run.config import TrainConfig
from sage_train.run.train import train

pytestmark = pytest.mark.usefixtures("token_cache")


def _quiet(_: str) -> None:
    pass


def test_two_rates_and_two_seeds_compile_one_train_and_one_eval_step(train_corpus, tmp_path):
    steps_mod._STEP_CACHE.clear()
    results = {}
    for lr in (1e-3, 4e-3):
        for seed in (0, 1):
            results[lr, seed] = train(config(train_corpus, tmp_path / f"{lr}-{seed}", steps=3,
                                             seed=seed, learning_rate=lr), log=_quiet)
    assert len(steps_mod._STEP_CACHE) == 1  # main: one entry per rate
    (train_step, eval_step), = steps_mod._STEP_CACHE.values()
    assert train_step._cache_size() == 1 and eval_step._cache_size() == 1
    # the rate is live: the runs at the two rates differ (and the seeds too)
    assert results[1e-3, 0].losses[1:] != results[4e-3, 0].losses[1:]
    assert results[1e-3, 0].losses != results[1e-3, 1].losses
    # the last run of the process (a step compiled by the first run at another rate and
    # seed) trains exactly as a step compiled for it alone
    steps_mod._STEP_CACHE.clear()
    alone = train(config(train_corpus, tmp_path / "alone", steps=3, seed=1,
                         learning_rate=4e-3), log=_quiet)
    assert alone.losses == results[4e-3, 1].losses
    assert alone.final_test_ppl == results[4e-3, 1].final_test_ppl


@pytest.mark.parametrize("name", ["adamw", "lion", "sage-hybrid", "sinkgd-hybrid",
                                  "lion-hybrid", "apollo"])
def test_every_kind_scales_with_the_state_peak(name):
    """Doubling the peak doubles every kind's update: the kinds keep their ratios."""
    cfg = TrainConfig(optimizer=name, model="tiny", steps=10, learning_rate=2e-3)
    model = steps_mod.build_model(cfg, 64)
    from flax import nnx

    params = nnx.state(model, nnx.Param)
    grads = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size, dtype=jnp.float32)
                                           ).reshape(p.shape).astype(p.dtype), params)
    tx = steps_mod.make_tx(cfg, model)
    state = tx.init(params)
    assert [float(x) for x in steps_mod.peak_leaves(state)] == [np.float32(2e-3)]
    for _ in range(2):  # into the warmup: a nonzero rate
        one, state1 = tx.update(grads, state, params)
        state = state1
    doubled = steps_mod.set_peak(state, 4e-3)
    a, _ = tx.update(grads, state, params)
    b, _ = tx.update(grads, doubled, params)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.any(np.asarray(x) != 0)
        # APOLLO: 2e-5 apart (its rounding), the others to 1e-7
        np.testing.assert_allclose(np.asarray(y), 2 * np.asarray(x), rtol=1e-4, atol=1e-12)


def test_the_logged_rate_is_the_peak_times_the_unit_schedule():
    cfg = TrainConfig(steps=20, learning_rate=3e-3, tail_from=10, tail="rewarm")
    unit, lr = steps_mod.unit_schedule(cfg), steps_mod.lr_schedule(cfg)
    for t in range(20):
        assert float(lr(t)) == float(np.float32(3e-3) * np.float32(unit(t)))


def test_set_peak_refuses_a_state_without_one():
    with pytest.raises(ValueError, match="holds no peak learning rate"):
        steps_mod.set_peak({"mu": jnp.zeros(2)}, 1e-3)


def test_a_resumed_run_trains_at_its_own_rate_not_the_checkpoints(train_corpus, tmp_path):
    """The checkpoint holds the peak it was saved with; ``--lr`` changed on resume wins."""
    kept, moved = tmp_path / "kept", tmp_path / "moved"
    for run in (kept, moved):
        train(config(train_corpus, run, learning_rate=1e-3), stop_after=4, log=_quiet)
    same = train(config(train_corpus, kept, learning_rate=1e-3), log=_quiet)
    other = train(config(train_corpus, moved, learning_rate=4e-3), allow_config_change=True,
                  log=_quiet)
    assert same.start_step == other.start_step == 4
    assert same.losses[0] == other.losses[0]  # step 5's loss: before the first update
    assert same.losses[1:] != other.losses[1:]  # the restored peak (1e-3) was replaced


def test_checkpoints_without_the_peak_are_refused_in_one_line(train_corpus, tmp_path,
                                                              monkeypatch):
    import optax

    import sage_optax
    from sage_train.job.errors import RunDirError
    from sage_train.run import train as train_mod

    def old_make_tx(cfg, model=None):  # before issue 46: the peak a constant of the step
        tx = sage_optax.make_optimizer(cfg.optimizer, steps_mod.lr_schedule(cfg), model=model)
        return optax.chain(optax.clip_by_global_norm(cfg.clip), tx)

    run = tmp_path / "old"
    with monkeypatch.context() as m:
        m.setattr(steps_mod, "make_tx", old_make_tx)
        m.setattr(train_mod, "set_peak", lambda state, peak: state)
        m.setattr(steps_mod, "_STEP_CACHE", {})
        train(config(train_corpus, run), stop_after=4, log=_quiet)
    with pytest.raises(RunDirError, match="older than issue 46") as e:
        train(config(train_corpus, run), log=_quiet)
    assert "\n" not in str(e.value) and "--restart" in str(e.value)
    from sage_train.run.export import export_hf  # export reads the whole state too
    with pytest.raises(RunDirError, match="older than issue 46") as e:
        export_hf(run, tmp_path / "hf", log=_quiet)
    assert "\n" not in str(e.value) and "the version that wrote them" in str(e.value)
    result = train(config(train_corpus, run), restart=True, log=_quiet)
    assert result.start_step == 0 and result.steps_done == 8
