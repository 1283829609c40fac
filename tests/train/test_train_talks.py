"""What the trainer says: the start header, plain log lines, TensorBoard and W&B scalars,
the optimizer flags and gradient accumulation.

Every run is the tiny model on a few standard-library modules, a few steps; W&B is a stub
module in ``sys.modules`` (never installed, never contacted).
"""

from __future__ import annotations

import json
import math
import sys
import types

import jax
import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

from train_helpers import config, quiet  # noqa: E402

import sage_optax  # noqa: E402
from sage_optim.table import format_bytes  # noqa: E402
from sage_train.cli import configs, main, parse_args  # noqa: E402
from sage_train.job.errors import ConfigError, RunDirError  # noqa: E402
from sage_train.run import loop as train_mod  # noqa: E402
from sage_train.run import steps as steps_mod  # noqa: E402
from sage_train.run import train as train_api  # noqa: E402
from sage_train.run.train import TrainConfig, check_config  # noqa: E402
from sage_train.store import report, rundir  # noqa: E402

pytestmark = pytest.mark.usefixtures("token_cache")


@pytest.fixture(scope="module")
def logged(train_corpus, tmp_path_factory):
    """A 4-step run logging every 2 steps with TensorBoard: (result, log, run directory)."""
    pytest.importorskip("tensorboardX")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SAGE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "token-cache"))
        run = tmp_path_factory.mktemp("logged") / "run"
        result, messages = quiet(config(train_corpus, run, steps=4, log_every=2, eval_every=4,
                                        tensorboard=True))
    return result, messages, run


def fields(messages):
    """The ``key: value`` lines of the header, as a dict."""
    title = next(i for i, m in enumerate(messages) if m.startswith("training "))
    out = {}
    for line in messages[title + 1:]:
        key, sep, value = line.partition(": ")
        if not sep or key.startswith("step ") or key.startswith("initial weights from"):
            break
        out[key] = value.strip()
    return out


# ---------------------------------------------------------------------------
# the start header
# ---------------------------------------------------------------------------


def test_header_shows_the_values_used(logged):
    result, messages, run = logged
    title = messages.index("training tiny with sage-hybrid")
    assert all(m.startswith(("tokenizer: ", "tokens: ")) for m in messages[:title])  # the data
    h = fields(messages)
    settings = json.loads((run / "config.json").read_text())
    assert h["run"] == str(run)
    assert h["learning rate"] == "0.002 peak (sage-hybrid's default)"  # not None
    assert settings["learning_rate"] == 0.002
    assert h["schedule"] == "1 warmup step, then cosine decay to 0.1 x the peak at step 4"
    assert h["tokens per step"] == "256 (8 x 32)"
    model = steps_mod.build_model(config("x", run), 1024)
    n = sum(int(x.size) for x in jax.tree.leaves(steps_mod.nnx.state(model, steps_mod.nnx.Param)))
    assert h["model"].startswith(f"tiny, {n:,} parameters (2 layers, hidden 96, 4 heads, 2 kv")
    assert h["optimizer"] == (f"sage-hybrid, state {format_bytes(result.opt_state_bytes)} "
                              "(b1 0.9, b2 0.99, weight decay 0.01)")
    assert h["dtype"] == "float32 compute, float32 parameters"
    assert h["layers"] == "loop (remat none; loss unchunked)"
    assert h["attention"].startswith("xla (auto: ")
    assert h["sinkgd kernel"].startswith("jnp (auto: ")
    assert h["data"].startswith(f"{settings['data']}: ")
    assert " train and " in h["data"] and h["data"].endswith(" test tokens")
    assert h["outputs"] == ("metrics.jsonl every 2 steps, test loss every 4, checkpoint every 4, "
                            "TensorBoard")
    # aligned: every value starts in the same column
    lines = messages[title + 1:title + 1 + len(h)]
    assert len({len(line) - len(line.split(": ", 1)[1].lstrip()) for line in lines}) == 1


# ---------------------------------------------------------------------------
# plain log lines
# ---------------------------------------------------------------------------


def test_step_line_format():
    line = report.step_line(40, 300, 5.43214, 1.2e-3, 0.87312, 12345.6, 83.4)
    assert line == "step 40/300  loss 5.4321  lr 1.20e-03  gnorm 0.8731  tok/s 12,346  eta 0:01:23"
    assert report.STEP_LINE.match(line)["tok_s"] == "12,346"
    evaluated = report.step_line(300, 300, 5.0, 1e-4, 1.0, 0.0, None, eval_loss=math.log(150.0))
    assert evaluated.endswith("eta -  eval_loss 5.0106  ppl 150.00")
    assert report.STEP_LINE.match(evaluated)["ppl"] == "150.00"
    assert report.format_duration(3 * 3600 + 61.4) == "3:01:01"
    assert report.format_duration(None) == report.format_duration(math.inf) == "-"


def test_log_lines_every_log_every_steps_off_a_terminal(logged):
    """progress=False (and a stderr that is no terminal): one flushed line per metrics row,
    with the row's numbers; evaluations add the test loss."""
    result, messages, run = logged
    lines = [m for m in messages if m.startswith("step ")]
    rows = list(rundir.iter_metrics(run))
    assert [r["step"] for r in rows] == [2, 4]
    assert len(lines) == 2
    for line, row in zip(lines, rows, strict=True):
        m = report.STEP_LINE.match(line)
        assert m, line
        assert int(m["step"]) == row["step"] and int(m["steps"]) == 4
        assert float(m["loss"]) == pytest.approx(row["loss"], abs=1e-4)
        assert float(m["lr"]) == pytest.approx(row["lr"], rel=1e-2)
        assert float(m["gnorm"]) == pytest.approx(row["grad_norm"], rel=1e-3)
        assert row["grad_norm"] > 0
    last = report.STEP_LINE.match(lines[-1])
    assert float(last["eval_loss"]) == pytest.approx(rows[-1]["test_loss"], abs=1e-4)
    assert rows[-1]["test_ppl"] == pytest.approx(math.exp(rows[-1]["test_loss"]))
    assert float(last["ppl"]) == pytest.approx(result.final_test_ppl, abs=0.01)
    assert last["eta"] == "0:00:00"


def test_the_log_says_compiling_before_the_first_step(logged):
    """Issue 34: minutes of silence while XLA compiles; the log now says so first."""
    _, messages, _ = logged
    first = next(i for i, m in enumerate(messages) if m.startswith("step "))
    assert train_mod.COMPILING in messages[:first]


def test_a_console_of_width_0_gets_log_lines(monkeypatch):
    """A terminal that reports 0 columns (some IDE consoles) drew nothing for minutes."""
    class Tty:
        def isatty(self):
            return True

        def fileno(self):
            raise ValueError("no descriptor")

    monkeypatch.setattr(sys, "stderr", Tty())
    monkeypatch.setenv("COLUMNS", "0")
    assert train_mod.terminal_width() == 0 and not train_mod.is_terminal()
    monkeypatch.setenv("COLUMNS", "120")
    assert train_mod.is_terminal()
    monkeypatch.delenv("COLUMNS")
    assert not train_mod.is_terminal()  # no width known: log lines


def test_the_bar_says_compiling_until_the_first_step(monkeypatch):
    bars = []

    class Bar:
        def __init__(self, **kwargs):
            self.desc, self.n = kwargs.get("desc", ""), kwargs["initial"]
            bars.append(self)

        def set_description_str(self, text):
            self.desc = text

        def update(self, n):
            self.n += n

        def set_postfix(self, **kwargs):
            pass

        def close(self):
            pass

    monkeypatch.setattr(train_mod, "is_terminal", lambda: True)
    monkeypatch.setattr(report, "progress_bar", lambda **kw: Bar(**kw))
    update = train_mod._progress(0, 10, True)
    assert bars[0].desc == train_mod.COMPILING_BAR
    update(1, 2.0, 100.0)
    assert bars[0].desc == "" and bars[0].n == 1


def test_a_terminal_gets_the_bar_and_the_cli_lines_are_flushed(train_corpus, tmp_path,
                                                               monkeypatch, capsys):
    monkeypatch.setattr(train_mod, "is_terminal", lambda: True)
    _, messages = quiet(config(train_corpus, tmp_path / "bar", steps=2, progress=True))
    assert not [m for m in messages if m.startswith("step ")]  # tqdm's bar instead
    _, messages = quiet(config(train_corpus, tmp_path / "off", steps=2, progress=False))
    assert len([m for m in messages if m.startswith("step ")]) == 2  # --no-progress: lines
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # tqdm not installed: lines
    _, messages = quiet(config(train_corpus, tmp_path / "no-tqdm", steps=2, progress=True))
    assert len([m for m in messages if m.startswith("step ")]) == 2
    monkeypatch.setattr(train_mod, "is_terminal", lambda: False)
    _, messages = quiet(config(train_corpus, tmp_path / "pipe", steps=2, progress=True))
    assert len([m for m in messages if m.startswith("step ")]) == 2  # not a terminal: lines
    flushed = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: flushed.append(k.get("flush")))
    train_api.say("x")
    assert flushed == [True]


# ---------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------


def test_tensorboard_scalars_are_the_metrics_rows(logged):
    _, _, run = logged
    scalars = report.read_scalars(run)
    assert set(scalars) == {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s",
                            "eval/loss", "eval/ppl"}
    rows = list(rundir.iter_metrics(run))
    assert scalars["train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in rows]
    assert scalars["train/grad_norm"] == [(r["step"], pytest.approx(r["grad_norm"]))
                                          for r in rows]
    assert scalars["eval/ppl"] == [(4, pytest.approx(rows[-1]["test_ppl"], rel=1e-6))]
    assert len(report.event_files(run)) == 1


def test_a_resumed_run_hides_the_tensorboard_steps_it_repeats(train_corpus, tmp_path):
    """Resumed from step 4 after steps 5-6 were logged: TensorBoard shows each step once,
    the values of the resumed segment (as metrics.jsonl)."""
    pytest.importorskip("tensorboardX")
    import shutil

    run = tmp_path / "run"
    cfg = config(train_corpus, run, steps=8, log_every=2, tensorboard=True)
    quiet(cfg, stop_after=6)
    shutil.rmtree(run / "checkpoints" / "6")
    quiet(cfg)
    scalars = report.read_scalars(run)
    rows = list(rundir.iter_metrics(run))
    assert [s for s, _ in scalars["train/loss"]] == [2, 4, 6, 8] == [r["step"] for r in rows]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in rows])
    assert len(report.event_files(run)) == 2


def test_tensorboard_without_tensorboardx_is_one_line(train_corpus, tmp_path, monkeypatch,
                                                      capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails
    code = main(["--model", "tiny", "--steps", "2", "--data", str(train_corpus), "--run-dir",
                 str(tmp_path / "runs"), "--tensorboard", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--tensorboard needs the tensorboardX package" in err
    assert "pip install tensorboardX" in err and "sage-optim[train]" in err
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------
# Weights & Biases (a stub: wandb is never installed nor contacted here)
# ---------------------------------------------------------------------------


def test_wandb_missing_is_one_line_saying_pip_install_wandb(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    code = main(["--model", "tiny", "--steps", "2", "--run-dir", str(tmp_path / "runs"),
                 "--wandb", "proj", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "pip install wandb" in err
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ConfigError, match="--wandb needs the wandb package"):
        check_config(TrainConfig(wandb="proj"))


class FakeWandb(types.ModuleType):
    """``wandb`` as far as the trainer uses it: ``init`` -> a run with ``log`` and ``finish``."""

    def __init__(self):
        super().__init__("wandb")
        self.calls: list[tuple] = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        calls = self.calls

        class Run:
            def log(self, data, step=None):
                calls.append(("log", step, dict(data)))

            def finish(self):
                calls.append(("finish",))

        return Run()


def test_wandb_gets_the_metrics_rows_and_a_resume_continues_its_run(train_corpus, tmp_path,
                                                                    monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = tmp_path / "run"
    cfg = config(train_corpus, run, steps=4, log_every=2, eval_every=4, wandb="proj")
    quiet(cfg, stop_after=2)
    quiet(cfg)
    kinds = [c[0] for c in fake.calls]
    assert kinds == ["init", "log", "finish", "init", "log", "finish"]
    first, second = fake.calls[0][1], fake.calls[3][1]
    run_id = (run / report.WANDB_ID).read_text().strip()
    for init in (first, second):
        assert init["project"] == "proj" and init["name"] == "run" and init["id"] == run_id
        assert init["resume"] == "allow" and init["dir"] == str(run)
    assert second["config"] == json.loads((run / "config.json").read_text())
    logs = [c for c in fake.calls if c[0] == "log"]
    rows = list(rundir.iter_metrics(run))
    assert [c[1] for c in logs] == [r["step"] for r in rows] == [2, 4]
    assert logs[-1][2]["train/loss"] == rows[-1]["loss"]
    assert logs[-1][2]["eval/ppl"] == rows[-1]["test_ppl"]
    assert set(logs[-1][2]) <= set(report.SCALAR_TAGS.values())


# ---------------------------------------------------------------------------
# optimizer flags and gradient accumulation
# ---------------------------------------------------------------------------


def test_optimizer_flags_reach_the_optimizer_config_json_and_header(train_corpus, tmp_path,
                                                                   monkeypatch):
    args = parse_args(["--model", "tiny", "--weight-decay", "0.05", "--b1", "0.8", "--b2",
                       "0.95", "--grad-accum", "2", "--batch-size", "8"])
    (cfg,) = configs(args)
    assert (cfg.weight_decay, cfg.b1, cfg.b2, cfg.grad_accum) == (0.05, 0.8, 0.95, 2)
    seen = []
    real = sage_optax.make_optimizer
    monkeypatch.setattr(sage_optax, "make_optimizer",
                        lambda *a, **k: seen.append(k) or real(*a, **k))
    run = tmp_path / "run"
    _, messages = quiet(config(train_corpus, run, steps=1, learning_rate=3e-3,
                               weight_decay=0.05, b1=0.8, b2=0.95, grad_accum=2))
    assert {k: seen[0][k] for k in ("weight_decay", "b1", "b2")} == {
        "weight_decay": 0.05, "b1": 0.8, "b2": 0.95}
    settings = json.loads((run / "config.json").read_text())
    assert (settings["weight_decay"], settings["b1"], settings["b2"]) == (0.05, 0.8, 0.95)
    assert settings["grad_accum"] == 2
    assert {"weight_decay", "b1", "b2", "grad_accum"} <= set(rundir.MATH_FIELDS)
    h = fields(messages)
    assert h["learning rate"] == "0.003 peak (--lr)"
    assert h["optimizer"].endswith("(b1 0.8, b2 0.95, weight decay 0.05)")
    assert h["tokens per step"] == "256 (8 x 32, accumulated over 2 micro-batches of 4)"


def test_optimizer_flags_are_checked_on_resume(train_corpus, tmp_path):
    """Unset means the configuration's value (recorded resolved: 0.9 for sage-hybrid's b1),
    so giving that value is no change; another value, or another --grad-accum, is refused
    unless allowed."""
    run = tmp_path / "run"
    quiet(config(train_corpus, run), stop_after=1)
    settings = json.loads((run / "config.json").read_text())
    assert (settings["weight_decay"], settings["b1"], settings["b2"]) == (0.01, 0.9, 0.99)
    result, _ = quiet(config(train_corpus, run, b1=0.9, weight_decay=0.01), stop_after=2)
    assert result.start_step == 1 and result.steps_done == 2
    for change, text in (({"b1": 0.95}, "b1 0.9 -> 0.95"), ({"b2": 0.9}, "b2 0.99 -> 0.9"),
                         ({"weight_decay": 0.0}, "weight_decay 0.01 -> 0.0"),
                         ({"grad_accum": 2}, "grad_accum 1 -> 2")):
        with pytest.raises(RunDirError, match=text):
            quiet(config(train_corpus, run, **change))


@pytest.mark.parametrize("args,option", [
    (["--b1", "1"], "--b1"), (["--b2", "-0.1"], "--b2"), (["--weight-decay", "-1"],
                                                          "--weight-decay"),
    (["--grad-accum", "0"], "--grad-accum"), (["--grad-accum", "1.5"], "--grad-accum"),
    (["--wandb", ""], "--wandb"), (["--init-from-hf", " "], "--init-from-hf"),
])
def test_cli_refuses_bad_flags_in_one_line(tmp_path, capsys, args, option):
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--run-dir", str(tmp_path / "runs"), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {option}" in err
    assert not (tmp_path / "runs").exists()


def test_settings_that_do_not_fit_are_refused_naming_the_flag(tmp_path, capsys):
    assert main(["--model", "tiny", "--batch-size", "8", "--grad-accum", "3", "--run-dir",
                 str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--grad-accum" in err and "--batch-size" in err
    assert main(["--model", "tiny", "--optimizer", "sinkgd-pure", "--b1", "0.8", "--run-dir",
                 str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--b1" in err and "sinkgd-pure" in err
    assert not (tmp_path / "runs").exists()


def saved_floats(run, step):
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ck:
        leaves = jax.tree.leaves(ck.restore(run / "checkpoints" / str(step)))
    return [np.asarray(x) for x in leaves if np.issubdtype(np.asarray(x).dtype, np.floating)]


def test_grad_accumulation_gives_the_update_of_the_whole_batch(train_corpus, tmp_path):
    """4 micro-batches of 2 sequences vs one batch of 8, 3 steps of sage-hybrid: the same
    losses and the same parameters and optimizer state, up to float32 rounding.

    Only the order of the sums differs (a mean over 4 x 2 sequences instead of 8), which
    moves a gradient by ~1e-7 of its size; after 3 steps of lr 2e-3 the parameters (of
    order 0.02 to 1) then differ by ~6e-8 (measured), far below 1e-6, while one step of
    the optimizer moves them by ~2e-3.
    """
    runs = {k: tmp_path / f"k{k}" for k in (1, 4)}
    losses = {k: quiet(config(train_corpus, run, grad_accum=k), stop_after=3)[0].losses
              for k, run in runs.items()}
    np.testing.assert_allclose(losses[4], losses[1], rtol=1e-6)
    one, four = saved_floats(runs[1], 3), saved_floats(runs[4], 3)
    assert len(one) == len(four) > 10
    for a, b in zip(one, four, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert json.loads((runs[4] / "config.json").read_text())["grad_accum"] == 4
