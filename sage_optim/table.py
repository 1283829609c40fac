"""Plain-text tables, shared by both frameworks so their printouts have one form."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Render ``rows`` under ``headers`` as an aligned text table.

    Numbers are right-aligned, everything else left-aligned; cells are converted with
    ``str``.  The result has no trailing newline.
    """
    cells = [[str(c) for c in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"row {row} has {len(row)} cells, expected {len(headers)}")
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    numeric = [
        all(isinstance(row[i], int | float) for row in rows) and bool(rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        out = []
        for v, w, num in zip(values, widths, numeric, strict=True):
            out.append(v.rjust(w) if num else v.ljust(w))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(list(headers)), sep, *(line(r) for r in cells)])


def format_markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Render ``rows`` under ``headers`` as a GitHub markdown table (numbers right-aligned).

    A column is numeric when every cell of it is an ``int`` or ``float``.  No trailing newline.
    """
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)} has {len(row)} cells, expected {len(headers)}")
    numeric = [
        bool(rows) and all(isinstance(row[i], int | float) for row in rows)
        for i in range(len(headers))
    ]
    align = ["---:" if num else "---" for num in numeric]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def format_bytes(n: int) -> str:
    """Human-readable byte count (``12.0 KiB``, ``1.53 GiB``)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


class RoutingRow(NamedTuple):
    """One parameter in a :class:`RoutingTable`.

    Attributes:
      path: the parameter's dotted name.
      shape: its shape.
      kind: ``embedding``, ``dense`` or ``vector``.
      rule: the update rule its kind gets under the configuration (``sinkgd(unit, alpha=10)``).
      fan_in: the fan-in axes with sizes (``"1 (768)"``, ``"0,1,2 (3x3x64=576)"``, ``"-"``).
      fan_out: the fan-out axes with sizes (the vocab axis of a vocabulary matrix).
      evidence: what placed it (``override``, ``model API: ...``, ``module nn.Linear``, ...).
      state_bytes: its optimizer-state bytes.
      step: its kind's effective step, the learning rate times the rule's scale
        (``"0.02 (0.002 x 10)"`` for SinkGD with ``alpha=10``: :mod:`sage_optim.rates`).

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Table 2, the rule of each kind; Table 4, optimizer-state memory).
    """

    path: str
    shape: tuple[int, ...]
    kind: str
    rule: str
    fan_in: str
    fan_out: str
    evidence: str
    state_bytes: int
    step: str = "-"


@dataclasses.dataclass(frozen=True)
class RoutingTable:
    """Printable routing of a model's parameters under one configuration.

    Both frameworks return this (``sage_optax.routing_table``, ``sage_torch.routing_table``),
    so their printouts have one form: per parameter its kind, rule, effective step (the
    learning rate times the rule's scale), fan-in and fan-out axes (with sizes), the
    evidence that placed it and its state bytes (:class:`RoutingRow`);
    ``shared_bytes`` counts state that belongs to no single parameter (step counts).

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Table 2, the rule of each kind; Table 4, optimizer-state memory).
    """

    config: str
    rows: tuple[RoutingRow, ...]
    shared_bytes: int

    HEADERS: ClassVar[tuple[str, ...]] = (
        "path", "shape", "kind", "rule", "step", "fan-in", "fan-out", "evidence", "state bytes"
    )

    @property
    def total_bytes(self) -> int:
        """Total optimizer-state bytes (per-parameter rows plus shared)."""
        return sum(r.state_bytes for r in self.rows) + self.shared_bytes

    def row(self, path: str) -> RoutingRow:
        """The row of parameter ``path`` (``KeyError`` lists a few known paths)."""
        for r in self.rows:
            if r.path == path:
                return r
        raise KeyError(f"no parameter {path!r}; known: {[r.path for r in self.rows[:5]]}...")

    def __str__(self) -> str:
        body: list[tuple[Any, ...]] = [
            (r.path, "x".join(map(str, r.shape)) or "()", r.kind, r.rule, r.step, r.fan_in,
             r.fan_out, r.evidence, r.state_bytes) for r in self.rows
        ]
        body.append(("(shared: step counts)", "", "", "", "", "", "", "", self.shared_bytes))
        footer = f"{self.config}: optimizer state {format_bytes(self.total_bytes)}"
        return format_table(self.HEADERS, body) + "\n" + footer
