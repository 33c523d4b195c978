"""A QSA-shaped block indexer: which keys each query row of a chunk keeps.

Keys are grouped into blocks of ``compress_ratio`` consecutive positions. Query row i of a chunk
starting at absolute position ``start`` sees the n_i = start + i + 1 keys 0 .. start + i; of those,
n_i // compress_ratio blocks are complete and n_i % compress_ratio keys form an incomplete tail.
The row keeps

- the ``kept_blocks`` highest-scoring complete blocks (all of them if there are no more), and
- the incomplete tail, always (it holds the row's own position unless n_i is a multiple of the
  ratio, in which case the row's own key sits in the last complete block and competes on score).

So a row keeps at most ``budget = kept_blocks * compress_ratio + compress_ratio - 1`` keys, and a row
seeing at most that many keys (``anelab.core.masks.dense_exact_window``) keeps every visible key.

Block score (``score="qk"``): head-summed q . k against the block's mean-pooled ("compressed") key,
    score[i, b] = sum_h  q[i, h] . mean_{t in block b} k[t, kv(h)],   kv(h) = h // (Hq // Hkv),
the compressed-key scoring of native-sparse-attention style indexers. Because it is linear in k it
equals the mean over the block's keys of the head-summed q . k, and it costs one
[C, Hkv*d] x [Hkv*d, blocks] matmul. The 1/sqrt(d) softmax scale is omitted: it does not change
a ranking. ``score="random"`` draws seeded uniform scores instead — a control selection with the same
shape and budget but no relation to the data.

Ties are broken towards the earlier block (stable sort), so a selection is a pure function of its
inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.masks import dense_exact_window, fold_with_causal
from anelab.core.matmul import matmul

SCORES = ("qk", "random")
INDEXER_NAME = "qsa_block_topk"
BLOCK_SCORE_QK = "head-summed q.k against the mean-pooled key of each complete block"


@dataclass(frozen=True, eq=False)
class Selection:
    """The keys kept by each query row of one chunk.

    keep_indices: int32 [C, budget] — row i's kept key positions (absolute, 0 .. start + i) in its first
        keep_counts[i] entries, ascending and unique; the unused entries are 0.
    keep_counts:  int32 [C] — kept keys per row, 1 .. budget.
    """

    keep_indices: np.ndarray
    keep_counts: np.ndarray
    kept_blocks: int
    compress_ratio: int
    start: int = 0
    score: str = "qk"
    seed: int | None = None

    @property
    def budget(self) -> int:
        """Most keys any row can keep: kept_blocks * compress_ratio + compress_ratio - 1."""
        return dense_exact_window(self.kept_blocks, self.compress_ratio)

    @property
    def chunk(self) -> int:
        return int(self.keep_indices.shape[0])

    @property
    def total(self) -> int:
        """Keys in the chunk's attention: start (history) + chunk."""
        return self.start + self.chunk

    def mask(self, chunk: int | None = None) -> np.ndarray:
        """Folded additive mask float16 [chunk, start + chunk] for the sidecar function h<start>.

        ``chunk`` > rows pads a partial chunk (see ``anelab.core.masks.fold_with_causal``).
        """
        return fold_with_causal(self.keep_indices, self.keep_counts, self.start, chunk)

    def to_dict(self) -> dict:
        """Indexer parameters (no per-row data), for a sidecar's ``selectionIndexer`` metadata."""
        d = {
            "indexer": INDEXER_NAME,
            "kept_blocks": int(self.kept_blocks),
            "compress_ratio": int(self.compress_ratio),
            "budget": self.budget,
            "dense_exact_window": self.budget,
            "score": self.score,
            "block_score": BLOCK_SCORE_QK if self.score == "qk" else "seeded uniform random",
            "tail": "incomplete tail block always kept",
        }
        if self.score == "random":
            d["seed"] = self.seed
        return d


def _check_block_params(kept_blocks: int, compress_ratio: int, start: int) -> None:
    dense_exact_window(kept_blocks, compress_ratio)  # validates both >= 1
    if int(start) < 0:
        raise AnelabInputError(f"start (the chunk's history) must be >= 0, got {start}")


def block_scores_qk(q: np.ndarray, k: np.ndarray, compress_ratio: int) -> np.ndarray:
    """Score every complete block of k against every query row.

    q: [C, Hq, d] projected queries (normed, rotated), k: [T, Hkv, d] keys of positions 0 .. T-1,
    Hq a multiple of Hkv. Returns float32 [C, T // compress_ratio]; visibility is applied later
    (``select_blocks``), so a row's score for a block it cannot see is computed and ignored.
    """
    q, k = np.asarray(q), np.asarray(k)
    if q.ndim != 3 or k.ndim != 3:
        raise AnelabInputError(
            f"q must be [chunk, heads, head_dim] and k [keys, kv_heads, head_dim]; got {q.shape} and {k.shape}"
        )
    chunk, heads, head_dim = q.shape
    keys, kv_heads, k_dim = k.shape
    if k_dim != head_dim or heads % kv_heads:
        raise AnelabInputError(
            f"q {q.shape} and k {k.shape} disagree: head_dim must match and heads must be a multiple of kv_heads"
        )
    ratio = int(compress_ratio)
    if ratio < 1:
        raise AnelabInputError(f"compress_ratio must be >= 1, got {compress_ratio}")
    n_blocks = keys // ratio
    group = heads // kv_heads
    # query heads of one KV group share its key, so summing q over the group first is exact
    q_group = q.astype(np.float32).reshape(chunk, kv_heads, group, head_dim).sum(axis=2)  # [C, Hkv, d]
    k_block = k[: n_blocks * ratio].astype(np.float32).reshape(n_blocks, ratio, kv_heads, head_dim).mean(axis=1)
    return matmul(q_group.reshape(chunk, kv_heads * head_dim), k_block.reshape(n_blocks, kv_heads * head_dim).T)


def block_scores_random(chunk: int, n_blocks: int, seed: int) -> np.ndarray:
    """Seeded uniform block scores float32 [chunk, n_blocks], a control with no relation to the data."""
    return np.random.default_rng(int(seed)).random((int(chunk), int(n_blocks)), dtype=np.float32)


def select_blocks(
    block_scores: np.ndarray, start: int, kept_blocks: int, compress_ratio: int
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``kept_blocks`` complete blocks per row plus the incomplete tail, as a compacted selection.

    block_scores: float [C, n_blocks] with n_blocks >= (start + C) // compress_ratio; row i
        (position start + i) considers only blocks 0 .. (start + i + 1) // compress_ratio - 1.
    Returns (keep_indices int32 [C, budget], keep_counts int32 [C]) as in ``Selection``.
    """
    _check_block_params(kept_blocks, compress_ratio, start)
    scores = np.asarray(block_scores)
    if scores.ndim != 2:
        raise AnelabInputError(f"block_scores must be [chunk, n_blocks], got shape {scores.shape}")
    chunk, n_blocks = scores.shape
    start, kb, ratio = int(start), int(kept_blocks), int(compress_ratio)
    if chunk < 1:
        raise AnelabInputError("the chunk has no rows; pass at least one query row")
    if n_blocks < (start + chunk) // ratio:
        raise AnelabInputError(
            f"block_scores has {n_blocks} blocks; the last row sees {(start + chunk) // ratio} complete blocks"
        )
    if not np.isfinite(scores).all():
        raise AnelabInputError("block_scores contains NaN or inf; check q and k for non-finite values")
    budget = dense_exact_window(kb, ratio)

    visible = start + np.arange(chunk, dtype=np.int64) + 1  # [C] keys row i sees
    complete = visible // ratio  # [C] complete blocks row i sees
    tail = visible - complete * ratio  # [C] 0 .. ratio-1
    kept = np.minimum(complete, kb)  # [C] blocks row i keeps

    out = np.zeros((chunk, budget), dtype=np.int32)
    if kb > 0 and n_blocks > 0:
        # rank blocks by descending score; blocks a row cannot see rank last (+inf)
        key = np.where(np.arange(n_blocks)[None, :] < complete[:, None], -scores.astype(np.float64), np.inf)
        width = min(kb, n_blocks)
        if width < n_blocks:
            order = np.argsort(key, axis=1, kind="stable")[:, :width]  # [C, width]
        else:
            order = np.broadcast_to(np.arange(n_blocks), (chunk, n_blocks))
        in_use = np.arange(width)[None, :] < kept[:, None]
        chosen = np.sort(np.where(in_use, order, n_blocks), axis=1)  # kept blocks ascending, unused last
        keys = chosen[:, :, None] * ratio + np.arange(ratio)  # [C, width, ratio]
        keys = keys.reshape(chunk, width * ratio)
        key_in_use = np.arange(width * ratio)[None, :] < (kept * ratio)[:, None]
        out[:, : width * ratio] = np.where(key_in_use, keys, 0)
    # tail keys come after every complete block, so appending them keeps each row ascending
    for j in range(ratio - 1):
        rows = np.flatnonzero(tail > j)
        out[rows, kept[rows] * ratio + j] = complete[rows] * ratio + j
    counts = (kept * ratio + tail).astype(np.int32)
    return out, counts


def select(
    q: np.ndarray,
    k: np.ndarray,
    start: int,
    kept_blocks: int,
    compress_ratio: int,
    score: str = "qk",
    seed: int = 0,
) -> Selection:
    """Run the block indexer on one chunk.

    q: [C, Hq, d] queries of positions start .. start+C-1; k: [start + C, Hkv, d] keys of positions
    0 .. start+C-1 (as ``anelab.core.reference.project`` produces them: normed, rotated).
    score: "qk" (compressed-key scores) or "random" (seeded control; q and k give only the shapes).
    """
    if score not in SCORES:
        raise AnelabInputError(f"unknown score {score!r}; use one of {', '.join(SCORES)}")
    _check_block_params(kept_blocks, compress_ratio, start)
    q, k = np.asarray(q), np.asarray(k)
    if q.ndim != 3 or k.ndim != 3:
        raise AnelabInputError(
            f"q must be [chunk, heads, head_dim] and k [keys, kv_heads, head_dim]; got {q.shape} and {k.shape}"
        )
    if k.shape[0] != int(start) + q.shape[0]:
        raise AnelabInputError(
            f"k has {k.shape[0]} keys; a chunk of {q.shape[0]} rows at start {start} needs start + chunk = {int(start) + q.shape[0]}"
        )
    n_blocks = k.shape[0] // int(compress_ratio)
    if score == "qk":
        scores = block_scores_qk(q, k, compress_ratio)
    else:
        scores = block_scores_random(q.shape[0], n_blocks, seed)
    keep_indices, keep_counts = select_blocks(scores, start, kept_blocks, compress_ratio)
    return Selection(
        keep_indices=keep_indices,
        keep_counts=keep_counts,
        kept_blocks=int(kept_blocks),
        compress_ratio=int(compress_ratio),
        start=int(start),
        score=score,
        seed=int(seed) if score == "random" else None,
    )
