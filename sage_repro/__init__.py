"""sage_repro: what needs both frameworks, or the paper itself.

The optimizer packages depend one way: :mod:`sage_optim` (framework-neutral: presets,
defaults, routing grammar, tables) is imported by :mod:`sage_optax` (JAX only) and
:mod:`sage_torch` (PyTorch only); neither imports the other framework.  This package sits
above both:

* :mod:`sage_repro.parity`: the cross-framework parity check (``sage-parity``), which steps
  ``sage_optax`` and ``sage_torch`` side by side (and the Flax and Hugging Face LLaMA);
* :mod:`sage_repro.memory_report`: the paper's Appendix memory table recomputed from
  ``jax.eval_shape`` (``sage-memory``);
* :mod:`sage_repro.llama_shapes`: the LLaMA parameter shapes of the paper's models;
* :mod:`sage_repro.traffic`: the bytes-moved model of both step benchmarks;
* :mod:`sage_repro.paper`: the figures printed in the paper, for side-by-side reports;
* :mod:`sage_repro.sweep`: the paper's comparison as configurations x seeds x learning
  rates, each run a resumable ``sage-train`` process (``sage-repro sweep``), and
  :mod:`sage_repro.sweep_report`, its results table (effective throughput included) and
  plots.

Importing this package imports neither framework; each module imports what it needs.
"""

from sage_repro.paper import PAPER_LR_GRID, PAPER_MEMORY_GIB, PAPER_TEST_PPL

__all__ = ["PAPER_LR_GRID", "PAPER_MEMORY_GIB", "PAPER_TEST_PPL"]
