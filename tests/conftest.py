"""Test setup: 8 virtual CPU devices for the sharding tests (must precede importing jax), and a
persistent compilation cache for the session so identical programs (a resumed training run,
the same optimizer step in several tests) are compiled once."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

_cache = os.environ.get("SAGE_TEST_JAX_CACHE") or os.path.join(
    tempfile.gettempdir(), "sage-test-jax-cache"
)
jax.config.update("jax_compilation_cache_dir", _cache)
# Tests compare float32 matmuls with references: on a GPU, XLA would run them as TF32 by
# default (about 1e-3 relative).  On the CPU this changes nothing.
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def torch_one_thread():
    """One intra-op thread for a PyTorch test module (restored after it).

    The tensors are tiny: intra-op threads only add contention on the 2-core machines.
    """
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def train_corpus(tmp_path_factory):
    """A small text corpus for the trainer tests: a few standard-library modules."""
    import pathlib
    import sysconfig

    root = tmp_path_factory.mktemp("corpus")
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "dataclasses.py", "textwrap.py", "json/decoder.py"):
        (root / name.replace("/", "_")).write_text((stdlib / name).read_text())
    return root


@pytest.fixture
def token_cache(tmp_path_factory, monkeypatch):
    """A token cache private to the test session (the trainer tests share its entries)."""
    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "token-cache"))
