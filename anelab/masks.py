"""Additive attention masks, fp16, shape [C, H + C] (C = chunk rows, H = history keys).

0 means "attend", MASKED (-30000) means "drop": exp(-30000 + s) underflows to exactly 0 in fp16
and fp32 softmax, the same as omitting the key.
"""

from __future__ import annotations

import numpy as np

MASKED = np.float16(-30000.0)


def causal(chunk: int, history: int, valid_rows: int | None = None) -> np.ndarray:
    """Causal additive mask for a chunk starting at absolute position ``history``.

    Returns float16 [chunk, history + chunk]: row i (absolute position history + i) sees keys
    0 .. history + i. With ``valid_rows`` = n < chunk (a partial chunk padded to the sidecar's width),
    rows >= n are padding: they keep the causal pattern (finite output, ignored by the caller) and
    no real row can see a padded key, because padded keys lie after every real row.
    """
    if valid_rows is not None and not 0 < valid_rows <= chunk:
        raise ValueError(f"valid_rows must be in 1..{chunk}, got {valid_rows}")
    total = history + chunk
    key = np.arange(total)[None, :]
    row = history + np.arange(chunk)[:, None]
    return np.where(key <= row, np.float16(0.0), MASKED).astype(np.float16)
