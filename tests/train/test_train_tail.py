"""Training a finished run longer (issue 45): a defined schedule, never a silent jump.

``--steps 16`` on a run trained for 8 used to recompute the cosine schedule (with
``--allow-config-change``): the rate jumped from the decayed 2e-4 back up the new curve.  Now
such a change is refused, with the ways to continue, and ``--tail-from 8`` continues on a
tail that starts at the rate the finished schedule reached: ``constant`` holds it,
``rewarm`` climbs from it back to the peak, then decays.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from train_helpers import config, quiet

from sage_train.job.errors import ConfigError, RunDirError
from sage_train.run.config import TrainConfig, check_config
from sage_train.run.steps import describe_schedule, lr_schedule

PEAK = 2e-3  # sage-hybrid's preset rate


def rates(cfg: TrainConfig, steps: range) -> list[float]:
    schedule = lr_schedule(cfg)
    return [float(schedule(i)) for i in steps]


def test_the_tail_starts_where_the_finished_schedule_ended():
    old = TrainConfig(model="tiny", steps=60)
    end = rates(old, range(60, 61))[0]
    assert end == pytest.approx(0.1 * PEAK, rel=1e-6)  # cosine to final_lr_frac 0.1
    plain = TrainConfig(model="tiny", steps=120)  # what --steps 120 alone would train on
    assert rates(plain, range(60, 61))[0] > 5 * end  # the jump: 1.26e-3 at step 60
    constant = dataclasses.replace(plain, tail_from=60)
    assert rates(constant, range(60)) == rates(old, range(60))  # the trained steps unchanged
    assert rates(constant, range(60, 121)) == [end] * 61
    rewarm = dataclasses.replace(plain, tail_from=60, tail="rewarm")
    assert rates(rewarm, range(60)) == rates(old, range(60))
    climb = rates(rewarm, range(60, 67))
    assert climb[0] == end and climb == sorted(climb) and climb[-1] == pytest.approx(PEAK)
    assert rates(rewarm, range(120, 121))[0] == pytest.approx(0.1 * PEAK, rel=1e-6)
    assert "from step 60 (--tail-from): constant 0.0002 to step 120" in describe_schedule(
        constant)
    assert "rewarm from 0.0002 to the peak 0.002 by step 66" in describe_schedule(rewarm)


def test_a_tail_is_checked():
    with pytest.raises(ConfigError, match="--tail-from"):
        check_config(TrainConfig(model="tiny", steps=60, tail_from=60))
    with pytest.raises(ConfigError, match="needs --tail-from"):
        check_config(TrainConfig(model="tiny", steps=60, tail="rewarm"))


def test_a_finished_run_is_trained_longer_on_its_tail(train_corpus, tmp_path):
    run = tmp_path / "run"
    first, _ = quiet(config(train_corpus, run))
    assert first.steps_done == 8
    longer = config(train_corpus, run, steps=16)
    with pytest.raises(RunDirError) as refused:  # without --allow-config-change
        quiet(longer)
    assert str(refused.value).startswith("to train ") and "--tail-from 8" in str(refused.value)
    with pytest.raises(RunDirError) as jump:  # allowed, but the rate would jump at step 8
        quiet(longer, allow_config_change=True)
    text = str(jump.value)
    assert "\n" not in text and text.startswith("to train longer, add --tail-from 8 --tail")
    assert "at step 8 from 0.0002 to" in text
    done, messages = quiet(dataclasses.replace(longer, tail_from=8), allow_config_change=True)
    assert done.steps_done == 16 and done.start_step == 8
    assert any("from step 8 (--tail-from): constant 0.0002 to step 16" in m for m in messages)
    rows = [json.loads(line) for line in (run / "sage-hybrid" / "metrics.jsonl").read_text()
            .splitlines()] if (run / "sage-hybrid").exists() else [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in rows}
    # the rate at the boundary: the first step after 8 takes the rate the schedule ended at
    assert lr[9] == pytest.approx(0.1 * PEAK, rel=1e-6)
    assert {lr[s] for s in range(9, 17)} == {lr[9]}
