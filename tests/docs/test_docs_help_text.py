"""Help and reference text in plain words with the defaults shown (issue 34).

No reStructuredText markup in any command's ``--help`` (it came from docstrings), every
option with a help text and its default, ``export`` in ``sage-train``'s usage line, the
API reference rendering default values (not ``_DEFAULTS['b1']``), docs/README.md listing
every page, and ``sage-repro report`` naming the files it wrote.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARKUP = re.compile(r"``|:(mod|func|class|data|attr|meth|obj|exc):`|%%")


def parsers():
    pytest.importorskip("flax")
    from sage_repro import memory_report, sweep
    from sage_train import cli

    found = {"sage-train": cli.build_parser(), "sage-train export": cli.build_export_parser(),
             "sage-train sample": cli.build_sample_parser(),
             "sage-memory": memory_report.build_parser()}
    repro = sweep.build_parser()
    found["sage-repro"] = repro
    (sub,) = [a for a in repro._actions if isinstance(a, argparse._SubParsersAction)]
    for name, p in sub.choices.items():
        found[f"sage-repro {name}"] = p
    try:
        from sage_repro import parity
    except ImportError:
        pass
    else:
        found["sage-parity"] = parity.build_parser()
    return found


def test_help_is_plain_text_with_every_default():
    for name, p in parsers().items():
        text = p.format_help()
        assert not MARKUP.search(text), (name, MARKUP.search(text).group(0))
        formatter = p._get_formatter()
        for action in p._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            assert action.help, (name, action.option_strings)
            if action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0:
                continue
            assert "default" in formatter._get_help_string(action), (name, action.dest)


def test_parity_options_have_help_and_defaults():
    pytest.importorskip("torch")
    from sage_repro import parity

    text = " ".join(parity.build_parser().format_help().split())
    for words in ("--steps STEPS optimizer steps taken by both frameworks (default: 100)",
                  "(default: float64)", "(default: sage-hybrid)"):
        assert words in text, words


def test_sage_train_usage_names_its_subcommand():
    pytest.importorskip("flax")
    from sage_train import cli

    usage = cli.build_parser().format_usage()
    assert "sage-train export --hf DIR" in usage and "sage-train sample --run-dir" in usage


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name not in ("README.md", "index.md"):
            assert f"]({page.name})" in index, page.name


def test_api_reference_renders_values_not_source():
    from sphinx.util.inspect import stringify_signature

    spec = importlib.util.spec_from_file_location("docs_conf", ROOT / "docs" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    assert conf.autodoc_preserve_defaults is False  # True showed _DEFAULTS['b1']
    sage_optax = pytest.importorskip("sage_optax")
    sig = stringify_signature(inspect.signature(sage_optax.sage))
    assert "b1: float = 0.9" in sig and "_DEFAULTS" not in sig
    sig = stringify_signature(inspect.signature(sage_optax.sage_hybrid))
    assert "learning_rate" in sig and "0.002" in sig and "PRESETS" not in sig


def test_report_names_the_files_it_wrote(tmp_path):
    from sage_repro import sweep_report

    (tmp_path / "results.json").write_text(
        '{"figures": ["%s"]}' % (tmp_path / "loss_vs_tokens.png"))
    line = sweep_report.files_line(tmp_path)
    assert str(tmp_path / "results.md") in line and str(tmp_path / "loss_vs_tokens.png") in line


# --------------------------------------------------------------------------------------------
# Help wrapped once, at the terminal's width (issue 45)

COLUMNS = 80


def premature_breaks(text: str, width: int) -> list[str]:
    """Lines of ``text`` broken before they had to be: the next line, a continuation of the
    same paragraph (same indentation, not a new item or option), starts with a word that
    would have fitted (``writes a\\nHugging Face\\nLlamaForCausalLM`` from a text wrapped at
    its source's width, then again at the terminal's)."""
    lines = text.splitlines()
    found = []
    for line, after in zip(lines, lines[1:], strict=False):
        if not line.strip() or not after.strip() or line.rstrip().endswith(":"):
            continue
        indent = len(line) - len(line.lstrip())
        if len(after) - len(after.lstrip()) != indent or indent not in (0, 24):
            continue  # a new option, an example, or help after an option's own line
        word = after.split()[0]
        if word.startswith(("-", "*", "usage:")) or re.match(r"\d+[.)]$", word):
            continue
        if line.lstrip().startswith("-") and indent == 0:
            continue
        if len(line.rstrip()) + 1 + len(word) <= width:
            found.append(f"{line!r} + {word!r}")
    return found


def test_premature_breaks_finds_a_double_wrap():
    import textwrap

    source = textwrap.fill("sage-train export writes a run's checkpoint as a Hugging Face "
                           "LlamaForCausalLM directory with its tokenizer, offline.", 60)
    twice = "\n".join(textwrap.fill(line, 40) for line in source.splitlines())
    assert premature_breaks(twice, 40)
    assert not premature_breaks(textwrap.fill(" ".join(source.split()), 40), 40)


def test_help_is_wrapped_once_at_the_terminal_width(monkeypatch):
    """Every command's ``--help`` at ``COLUMNS=80``: no line wider than the terminal, and
    no line broken mid-phrase (argparse fills to ``COLUMNS - 2``)."""
    monkeypatch.setenv("COLUMNS", str(COLUMNS))
    found = parsers()
    assert {"sage-train", "sage-repro", "sage-memory"} <= set(found)
    for name, p in found.items():
        text = p.format_help()
        wide = [line for line in text.splitlines() if len(line) > COLUMNS]
        assert not wide, (name, wide)
        body = text.split("\n\n", 1)[1]  # argparse wraps the usage by whole option groups
        assert not premature_breaks(body, COLUMNS - 2), (name, premature_breaks(body,
                                                                                COLUMNS - 2))
