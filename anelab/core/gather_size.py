"""Gather-graph sizing: bytes of the dense score matrix against a gather graph's gathered keys and values,
and the budgets and totals where one overtakes the other (``anelab size``, study 3)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import FP16_BYTES


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise AnelabInputError(f"{name} must be a positive integer, got {value!r}")
    if int(value) <= 0:
        raise AnelabInputError(f"{name} must be a positive integer, got {value}")
    return int(value)


def _gather_heads(heads: int, kv_heads) -> int:
    if kv_heads is None:
        return heads
    kv_heads = positive_int("kv_heads", kv_heads)
    if heads % kv_heads:
        raise AnelabInputError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    return kv_heads


@dataclass(frozen=True)
class GatherSizing:
    """Memory of the dense score matrix against a gather graph's gathered keys and values.

    heads: query heads; head_dim; chunk: query rows; total: keys per row (history + chunk);
    budget: keys gathered per row (anelab.core.selection's budget).
    kv_heads: None (default) — every query head materialises its own gathered keys, as the seed
        sizes it; an integer — the selection is shared by each GQA group, so keys are gathered once
        per KV head.
    """

    heads: int
    head_dim: int
    chunk: int
    total: int
    budget: int
    kv_heads: int | None = None
    dtype_bytes: int = FP16_BYTES

    def __post_init__(self):
        for name in ("heads", "head_dim", "chunk", "total", "budget", "dtype_bytes"):
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        _gather_heads(self.heads, self.kv_heads)
        if self.total < self.chunk:
            raise AnelabInputError(
                f"total ({self.total}) is history + chunk, so it cannot be below the chunk ({self.chunk})"
            )
        if self.budget > self.total:
            raise AnelabInputError(
                f"budget ({self.budget}) exceeds the {self.total} keys a row can see; use a budget <= total"
            )

    @property
    def gather_heads(self) -> int:
        """Heads whose keys are materialised by the gather: kv_heads if given, else heads."""
        return _gather_heads(self.heads, self.kv_heads)

    @property
    def dense_score_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.chunk, self.total)

    @property
    def gather_key_shape(self) -> tuple[int, int, int, int]:
        return (self.gather_heads, self.chunk, self.budget, self.head_dim)

    @property
    def dense_score_bytes(self) -> int:
        """[heads, chunk, total] scores."""
        return self.heads * self.chunk * self.total * self.dtype_bytes

    @property
    def gather_key_bytes(self) -> int:
        """[gather_heads, chunk, budget, head_dim] gathered keys."""
        return self.gather_heads * self.chunk * self.budget * self.head_dim * self.dtype_bytes

    @property
    def gather_value_bytes(self) -> int:
        """[gather_heads, chunk, budget, head_dim] gathered values (same shape as the keys)."""
        return self.gather_key_bytes

    @property
    def gather_score_bytes(self) -> int:
        """[heads, chunk, budget] scores of the gathered keys (small beside the keys)."""
        return self.heads * self.chunk * self.budget * self.dtype_bytes

    @property
    def ratio(self) -> float:
        """gather_key_bytes / dense_score_bytes."""
        return self.gather_key_bytes / self.dense_score_bytes

    @property
    def gather_keys_smaller(self) -> bool:
        """True when the gathered keys alone take fewer bytes than the dense score matrix."""
        return self.gather_key_bytes < self.dense_score_bytes

    def to_dict(self) -> dict:
        return {
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "gather_heads": self.gather_heads,
            "head_dim": self.head_dim,
            "chunk": self.chunk,
            "total": self.total,
            "budget": self.budget,
            "dtype_bytes": self.dtype_bytes,
            "dense_score_bytes": self.dense_score_bytes,
            "gather_key_bytes": self.gather_key_bytes,
            "gather_value_bytes": self.gather_value_bytes,
            "gather_score_bytes": self.gather_score_bytes,
            "ratio": self.ratio,
            "gather_keys_smaller": self.gather_keys_smaller,
            "crossover_budget": crossover_budget(self.heads, self.head_dim, self.total, kv_heads=self.kv_heads),
        }


def size(heads: int, head_dim: int, chunk: int, total: int, budget: int, kv_heads: int | None = None) -> dict:
    """``GatherSizing(...).to_dict()``: exact byte counts and the gathered-key / dense-score ratio."""
    return GatherSizing(heads, head_dim, chunk, total, budget, kv_heads=kv_heads).to_dict()


def crossover_budget(
    heads: int, head_dim: int, total: int, kv_heads: int | None = None, include_values: bool = False
) -> int:
    """Largest budget for which gathering takes fewer bytes than the dense score matrix (0: none).

    Keys only: gather_heads * chunk * budget * head_dim < heads * chunk * total
               <=> budget < heads * total / (gather_heads * head_dim)
               <=> budget <= (heads * total - 1) // (gather_heads * head_dim)     (integers)
    include_values doubles the gathered side (keys and values). Independent of chunk and dtype.
    """
    heads, head_dim, total = (
        positive_int(n, v) for n, v in (("heads", heads), ("head_dim", head_dim), ("total", total))
    )
    per_key = _gather_heads(heads, kv_heads) * head_dim * (2 if include_values else 1)
    return (heads * total - 1) // per_key


def crossover_total(
    heads: int, head_dim: int, budget: int, kv_heads: int | None = None, include_values: bool = False
) -> int:
    """Smallest total (history + chunk) at which gathering ``budget`` keys takes fewer bytes than dense.

    Same inequality solved for total: total > gather_heads * budget * head_dim / heads
    <=> total >= (gather_heads * budget * head_dim * factor) // heads + 1.
    """
    heads, head_dim, budget = (
        positive_int(n, v) for n, v in (("heads", heads), ("head_dim", head_dim), ("budget", budget))
    )
    per_key = _gather_heads(heads, kv_heads) * head_dim * (2 if include_values else 1)
    return (per_key * budget) // heads + 1


def sizing_table(
    chunks,
    budgets,
    *,
    heads: int,
    head_dim: int,
    history: int | None = None,
    total: int | None = None,
    kv_heads: int | None = None,
) -> list[dict]:
    """One ``size`` row per (chunk, budget), for plotting.

    Give exactly one of ``history`` (total = history + chunk per row) or ``total`` (fixed). A budget
    above a row's total is clipped to the total (a row cannot keep more keys than it sees) and the
    row records ``budget_clipped``.
    """
    if (history is None) == (total is None):
        raise AnelabInputError("give exactly one of history (total = history + chunk) or total")
    if history is not None and (isinstance(history, bool) or int(history) < 0):
        raise AnelabInputError(f"history must be >= 0, got {history}")
    rows = []
    for chunk in chunks:
        chunk = positive_int("chunk", chunk)
        row_total = positive_int("total", int(history) + chunk if history is not None else total)
        for budget in budgets:
            requested = positive_int("budget", budget)
            row = size(heads, head_dim, chunk, row_total, min(requested, row_total), kv_heads=kv_heads)
            row["budget_requested"] = requested
            row["budget_clipped"] = requested > row_total
            rows.append(row)
    return rows
