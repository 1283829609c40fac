"""The trainer's layout (issue 32): one resolved run, a parser generated from the config.

One ``sage-train`` call checks each configuration once (:func:`check_config`,
:func:`check_init_from_hf`, :func:`implementations` each run once per configuration, where
they ran three or four times before); every :class:`TrainConfig` field with an option is a
flag of the parser, whose defaults are the fields'; a run directory missing a recorded
setting is a changed setting, not a silently migrated one.
"""

from __future__ import annotations

import collections
import dataclasses
import sys

import pytest

pytest.importorskip("flax")

from sage_train.cli import build_parser, configs, main, parse_args  # noqa: E402
from sage_train.run import config as config_mod  # noqa: E402
from sage_train.run import resolve as run_mod  # noqa: E402
from sage_train.store import rundir  # noqa: E402

COUNTED = {f.__code__: f.__name__ for f in (
    config_mod.check_config, run_mod.check_init_from_hf, run_mod.implementations)}


def test_one_call_checks_each_configuration_once(train_corpus, tmp_path):
    """Counted by the functions' code objects, however they are imported or called."""
    calls: collections.Counter[str] = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in COUNTED:
            calls[COUNTED[frame.f_code]] += 1

    argv = ["--model", "tiny", "--optimizer", "sage-hybrid", "lion", "--steps", "1",
            "--batch-size", "8", "--seq-len", "32", "--eval-batches", "1",
            "--data", str(train_corpus), "--run-dir", str(tmp_path), "--no-progress"]
    sys.setprofile(profile)
    try:
        code = main(argv)
    finally:
        sys.setprofile(None)
    assert code == 0
    assert calls == {"check_config": 2, "check_init_from_hf": 2, "implementations": 2}


def test_the_parser_is_the_config_fields():
    """Every field with an option is a flag whose default is the field's (a new setting is
    one field of TrainConfig); the command line's configuration is the default one."""
    parser = build_parser()
    flags = set(parser._option_string_actions)
    for name, option in config_mod.options().items():
        flag = option.flag or "--" + name.replace("_", "-")
        assert (flag in flags) == option.cli, name
    (cfg,) = configs(parse_args([]))
    default = config_mod.TrainConfig()
    assert dataclasses.replace(cfg, run_dir=default.run_dir) == default
    given = configs(parse_args(["--lr", "0.5", "--no-progress", "--b1", "0.8",
                                "--loss-chunk", "auto", "--deterministic"]))[0]
    assert (given.learning_rate, given.progress, given.b1, given.loss_chunk,
            given.deterministic) == (0.5, False, 0.8, None, True)
    fields = set(config_mod.options())
    assert set(config_mod.STEP_FIELDS) < fields and set(rundir.MATH_FIELDS) < fields


def test_every_checked_field_refuses_the_same_way_in_python_and_on_the_command_line(capsys):
    """SETTING_CHECKS is the fields' checks: check_config and the flag say the same words."""
    assert set(config_mod.SETTING_CHECKS) == {
        n for n, o in config_mod.options().items() if o.check is not None}
    with pytest.raises(config_mod.ConfigError, match=r"steps must be an integer in \[1, "):
        config_mod.check_config(config_mod.TrainConfig(steps=0))
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])
    assert "--steps: must be an integer in [1, " in capsys.readouterr().err


def test_a_setting_missing_from_the_record_is_a_change():
    """No migration of unreleased run directories: a recorded config.json without a field
    differs from one with it (refused unless allowed), as any other change."""
    assert rundir.differences({"seed": 0}, {"attention": "cudnn", "seed": 0}) == {
        "attention": (None, "cudnn")}
