"""Commands and factories refuse what they cannot do, in one line, before working (issue 34).

``--seq-len`` beyond the model's context, unknown model names in every command, a module
passed as a schedule under ``optax.inject_hyperparams``.  (``import sage_optax`` /
``sage_torch`` without their framework: tests/docs/test_docs_install.py.)
"""

from __future__ import annotations

import pytest

from sage_train.model.shapes import get_model_config


def one_line(text: str) -> bool:
    return text.count("\n") == 1 and text.endswith("\n")


def test_seq_len_beyond_the_context_is_refused():
    pytest.importorskip("flax")
    from sage_train.job.errors import ConfigError
    from sage_train.run.train import TrainConfig, check_config

    assert get_model_config("tiny").max_position_embeddings == 256
    check_config(TrainConfig(model="tiny", seq_len=256))
    with pytest.raises(ConfigError) as e:
        check_config(TrainConfig(model="tiny", seq_len=512))
    msg = str(e.value)
    assert "\n" not in msg
    assert "--seq-len" in msg and "512" in msg and "256 positions" in msg and "tiny" in msg


def test_sage_train_seq_len_beyond_the_context_exits_2(tmp_path, capsys):
    pytest.importorskip("flax")
    from sage_train.cli import main

    code = main(["--model", "tiny", "--seq-len", "512", "--steps", "1",
                 "--run-dir", str(tmp_path / "runs"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and one_line(err) and "256 positions" in err, err
    assert not (tmp_path / "runs").exists()


def test_sage_memory_refuses_an_unknown_model(capsys):
    pytest.importorskip("jax")
    from sage_repro.memory_report import main

    with pytest.raises(SystemExit) as e:
        main(["--models", "270m", "foo"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and one_line(err)
    assert "'foo'" in err and "--models" in err and "tiny" in err


def test_a_module_called_as_a_schedule_is_refused_with_the_remedy():
    """optax.inject_hyperparams calls every callable argument with the step count, a module
    included: what it returns reaches model=, which names static_args.  ``sage_hybrid``
    itself keeps ``model=`` static (issue 42: tests/optax/test_optax_inject_model.py), so
    the case is a factory of the user's own that passes ``model`` on."""
    nnx = pytest.importorskip("flax.nnx")
    import jax.numpy as jnp
    import optax

    import sage_optax

    class Scalar(nnx.Module):  # a module that happens to accept a step count
        def __init__(self):
            self.embed = nnx.Embed(16, 4, rngs=nnx.Rngs(0))
            self.out = nnx.Linear(4, 4, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return jnp.sum(self.out.kernel[...]) * x

    def factory(learning_rate, model=None):
        return sage_optax.sage_hybrid(learning_rate, model=model)

    m = Scalar()
    params = nnx.state(m, nnx.Param)
    tx = optax.inject_hyperparams(factory)(learning_rate=1e-3, model=m)
    with pytest.raises(TypeError) as e:
        tx.init(params)
    msg = str(e.value)
    assert "\n" not in msg and "static_args=('model',)" in msg and "inject_hyperparams" in msg
    # the remedy works
    fixed = optax.inject_hyperparams(factory, static_args=("model",))(
        learning_rate=1e-3, model=m)
    state = fixed.init(params)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(1e-3)
    # sage_hybrid itself needs no static_args
    state = optax.inject_hyperparams(sage_optax.sage_hybrid)(learning_rate=1e-3, model=m).init(
        params)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(1e-3)
