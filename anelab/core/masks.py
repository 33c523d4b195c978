"""Additive attention masks, fp16, shape [C, H + C] (C = chunk rows, H = history keys).

0 means "attend", MASKED (-30000) means "drop": exp(-30000 + s) underflows to exactly 0 in fp16
and fp32 softmax, the same as omitting the key.

``causal`` builds the dense prefill mask; ``fold`` / ``fold_with_causal`` write a sparse indexer's
selection (keep_indices / keep_counts) into the same mask shape, so one graph serves both.
"""

from __future__ import annotations

import numpy as np

from anelab.core.errors import AnelabInputError

MASKED = np.float16(-30000.0)


def causal(chunk: int, history: int, valid_rows: int | None = None, *, window: int | None = None) -> np.ndarray:
    """Causal additive mask for a chunk starting at absolute position ``history``.

    Returns float16 [chunk, history + chunk]: row i (absolute position p = history + i) sees keys
    0 .. p, or with a sliding ``window`` W only keys j with ``0 <= p - j < W`` (W keys including
    itself: transformers' sliding_window_overlay ``kv_idx > q_idx - W``). With ``valid_rows`` = n <
    chunk (a partial chunk padded to the sidecar's width), rows >= n are padding: they keep the
    pattern (finite output, ignored by the caller) and no real row can see a padded key, because
    padded keys lie after every real row.
    """
    if valid_rows is not None and not 0 < valid_rows <= chunk:
        raise ValueError(f"valid_rows must be in 1..{chunk}, got {valid_rows}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1):
        raise AnelabInputError(f"window must be a positive integer (tokens) or None, got {window!r}")
    total = history + chunk
    key = np.arange(total)[None, :]
    row = history + np.arange(chunk)[:, None]
    visible = key <= row
    if window is not None:
        visible &= key > row - int(window)
    return np.where(visible, np.float16(0.0), MASKED).astype(np.float16)


# ---- folding a sparse indexer's selection --------------------------------------------------------
# A sparse indexer (see anelab.core.selection) keeps, per query row, a compacted list of key positions:
# keep_indices [C, budget] whose first keep_counts[i] entries are valid for row i. Folding writes
# that list into an additive mask, so the unchanged dense graph computes the sparse attention:
# kept keys get 0, every other key MASKED, and a MASKED key's softmax weight is exactly 0.


def dense_exact_window(kept_blocks: int, compress_ratio: int) -> int:
    """Largest number of visible keys for which a block indexer keeps every visible key.

    A row that sees n keys has n // compress_ratio complete blocks plus an always-kept tail of
    n % compress_ratio <= compress_ratio - 1 keys; all blocks are kept while n // compress_ratio <=
    kept_blocks, i.e. while n <= kept_blocks * compress_ratio + compress_ratio - 1. Inside this
    window the causal mask and the selection agree; past it, a causal-only mask attends to keys the
    model drops. (512 blocks x 4 -> 2,051 keys, the Qwen 3.8 figure in the ANE prefill research seed.)
    """
    kept_blocks, compress_ratio = int(kept_blocks), int(compress_ratio)
    if kept_blocks < 1 or compress_ratio < 1:
        raise AnelabInputError(f"kept_blocks ({kept_blocks}) and compress_ratio ({compress_ratio}) must both be >= 1")
    return kept_blocks * compress_ratio + (compress_ratio - 1)


def _check_selection(keep_indices, keep_counts, total: int, allow_empty_rows: bool):
    """Validate a compacted selection; return (keep_indices int64 [C, budget], keep_counts int64 [C])."""
    keep_indices = np.asarray(keep_indices)
    keep_counts = np.asarray(keep_counts)
    if keep_indices.ndim != 2:
        raise AnelabInputError(f"keep_indices must be 2-D [chunk, budget], got shape {keep_indices.shape}")
    rows, budget = keep_indices.shape
    if keep_counts.shape != (rows,):
        raise AnelabInputError(
            f"keep_counts must have shape [{rows}] (one count per keep_indices row), got {keep_counts.shape}"
        )
    for name, arr in (("keep_indices", keep_indices), ("keep_counts", keep_counts)):
        if not np.issubdtype(arr.dtype, np.integer):
            raise AnelabInputError(f"{name} must be an integer array (int32), got dtype {arr.dtype}")
    if int(total) < 1:
        raise AnelabInputError(f"total keys must be >= 1, got {total}")
    keep_indices = keep_indices.astype(np.int64)
    keep_counts = keep_counts.astype(np.int64)
    low = 0 if allow_empty_rows else 1
    bad = np.flatnonzero((keep_counts < low) | (keep_counts > budget))
    if bad.size:
        i = int(bad[0])
        hint = "" if allow_empty_rows else " (a row keeping no key softmaxes to a uniform average of every value)"
        raise AnelabInputError(f"keep_counts[{i}] = {int(keep_counts[i])} is outside {low}..{budget}{hint}")
    valid = np.arange(budget)[None, :] < keep_counts[:, None]  # [C, budget]
    out_of_range = valid & ((keep_indices < 0) | (keep_indices >= total))
    if out_of_range.any():
        i, j = (int(x) for x in np.argwhere(out_of_range)[0])
        raise AnelabInputError(
            f"keep_indices[{i}, {j}] = {int(keep_indices[i, j])} is outside the key range 0..{int(total) - 1}"
        )
    # valid entries strictly increasing along each row (sorted and unique)
    not_increasing = valid[:, 1:] & (np.diff(keep_indices, axis=1) <= 0)
    if not_increasing.any():
        i, j = (int(x) for x in np.argwhere(not_increasing)[0])
        raise AnelabInputError(
            f"keep_indices row {i} is not sorted and unique at entries {j}, {j + 1} "
            f"({int(keep_indices[i, j])}, {int(keep_indices[i, j + 1])}); sort each row's kept keys ascending"
        )
    return keep_indices, keep_counts, valid


def fold(keep_indices, keep_counts, total: int, *, allow_empty_rows: bool = False) -> np.ndarray:
    """Fold a compacted key selection into an additive fp16 mask.

    keep_indices: int [C, budget] — row i's kept key positions in its first keep_counts[i] entries,
        ascending and unique; entries past the count are ignored (anelab.core.selection fills them with 0).
    keep_counts:  int [C] — valid entries per row, 1..budget (0 allowed with allow_empty_rows, which
        leaves the row fully MASKED: its softmax is a uniform average, so the caller must ignore it).
    total:        keys per row of the mask (history + chunk).
    Returns float16 [C, total]: 0 at kept keys, MASKED elsewhere.
    """
    keep_indices, keep_counts, valid = _check_selection(keep_indices, keep_counts, total, allow_empty_rows)
    rows = keep_indices.shape[0]
    mask = np.full((rows, int(total)), MASKED, dtype=np.float16)
    r, j = np.nonzero(valid)
    mask[r, keep_indices[r, j]] = np.float16(0.0)
    return mask


def fold_with_causal(
    keep_indices, keep_counts, history: int, chunk: int | None = None, *, window: int | None = None
) -> np.ndarray:
    """Fold a selection into the mask of a sidecar function with this ``history``, causality checked.

    keep_indices: int [n, budget], keep_counts: int [n] — the selection of the chunk's n real rows;
        row i is absolute position history + i and may keep only keys 0 .. history + i (a kept
        future key is refused, not silently dropped).
    chunk:        the sidecar's chunk width (default n). Rows n .. chunk-1 are padding of a partial
        chunk: they take the causal pattern of ``causal`` (finite, ignored by the caller), and no
        real row can see their keys, because those lie after every real row.
    window:       a sliding-window layer's W: the fold composes with it — a kept key outside the
        row's window (p - j >= W) is dropped, as the model's window drops it.
    Returns float16 [chunk, history + chunk].
    """
    keep_indices = np.asarray(keep_indices)
    if keep_indices.ndim != 2:
        raise AnelabInputError(f"keep_indices must be 2-D [rows, budget], got shape {keep_indices.shape}")
    rows = keep_indices.shape[0]
    chunk = rows if chunk is None else int(chunk)
    if int(history) < 0:
        raise AnelabInputError(f"history must be >= 0, got {history}")
    if not 0 < rows <= chunk:
        raise AnelabInputError(f"the selection has {rows} rows; it needs 1..chunk ({chunk}) rows")
    total = int(history) + chunk
    keep_indices, keep_counts, valid = _check_selection(keep_indices, keep_counts, total, False)
    position = int(history) + np.arange(rows)[:, None]  # [n, 1] absolute position of each real row
    future = valid & (keep_indices > position)
    if future.any():
        i, j = (int(x) for x in np.argwhere(future)[0])
        raise AnelabInputError(
            f"keep_indices[{i}, {j}] = {int(keep_indices[i, j])} is a future key for row {i} "
            f"(position {int(history) + i}); the indexer must keep only keys <= the row's position"
        )
    mask = causal(chunk, int(history), window=window)
    mask[:rows] = np.minimum(fold(keep_indices, keep_counts, total), mask[:rows])  # dropped by either: dropped
    require_visible_key(mask[:rows], int(history))
    return mask


def require_visible_key(mask: np.ndarray, history: int) -> None:
    """Refuse a mask [rows, T] in which a real row sees no key (a selection that keeps nothing
    inside the row's sliding window): its softmax would be a uniform average, not attention."""
    empty = np.flatnonzero(np.all(mask <= MASKED, axis=1))
    if empty.size:
        i = int(empty[0])
        raise AnelabInputError(
            f"row {i} (position {history + i}) keeps no key inside its sliding window; the indexer must keep a recent key"
        )
