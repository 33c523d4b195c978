"""The arms' decoder weights: kept resident (float32) when they fit a memory budget, else streamed from the files.

A run of the arms reads every decoder layer's weights once in the prefill and again at every decoded step
(``arms.arm_runs``). Streamed (``ModelCheckpoint`` as it is) each read converts the layer from its file again —
right for an 8B model on 24 GB, wasteful for a 135M one, whose Q4_1 layers and LM head are dequantized 24
times over for 24 decoded tokens. Resident (:class:`ResidentModel`) each layer's float32 weights are kept
from their first read, and the embedding / LM head is converted once and then served from memory in the
same row blocks the streamed head is read in, so a resident run makes the very products a streamed one
makes: the results are equal bit for bit.

float32, not the checkpoint's dtype: NumPy has no fast half-precision or bfloat16 matmul (a float16 product
is several times slower than float32), and a quantized checkpoint's blocks (Q4_1, MLX 4-bit) cannot be
multiplied at all without dequantizing them first.

The budget: ``RESIDENT_BUDGET_BYTES`` unless the caller passes another (``compare-arms --resident-budget``;
0 streams), and never more than half of what this process may allocate (``core.limits.memory_limit``); the
float32 size is counted from the checkpoint's tensor shapes before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from anelab.checkpoints.whole_model import ModelCheckpoint
from anelab.core.decoder import DecoderLayerWeights, HeadWeights
from anelab.core.errors import AnelabInputError
from anelab.core.limits import human_bytes, memory_limit
from anelab.core.weights import AttentionWeights

RESIDENT_BUDGET_BYTES = 4 * 2**30  # float32 weights kept in memory by default (a ~1B-parameter model fits)
RESIDENT, STREAMED = "resident", "streamed"


def float32_bytes(model: ModelCheckpoint) -> int:
    """Bytes of every tensor of the checkpoint as float32 (what keeping the whole model resident costs; a tied
    LM head is the embedding itself)."""
    tensors = model.checkpoint.tensors
    return sum(4 * int(np.prod(tensors.shape(name))) for name in tensors.names())


@dataclass(frozen=True)
class WeightsPlan:
    """How a run holds the decoder weights: ``mode`` resident or streamed, the float32 bytes resident costs
    (on mlx-lm: the bytes its parameter arrays hold), the budget it was held against (None: no budget applies,
    mlx-lm holds the whole model), and why (one phrase)."""

    mode: str
    float32_bytes: int
    budget_bytes: int | None
    reason: str

    def describe(self) -> str:
        return f"weights {self.mode} ({self.reason})"

    def to_dict(self) -> dict:
        return {"mode": self.mode, "float32_bytes": self.float32_bytes, "budget_bytes": self.budget_bytes,
                "reason": self.reason}  # fmt: skip


def plan_weights(model: ModelCheckpoint, budget_bytes: int | None = None) -> WeightsPlan:
    """Resident when the model's float32 bytes fit ``budget_bytes`` (default ``RESIDENT_BUDGET_BYTES``) and half
    this process's memory limit; streamed otherwise."""
    budget = RESIDENT_BUDGET_BYTES if budget_bytes is None else int(budget_bytes)
    if budget < 0:
        raise AnelabInputError(f"the resident-weights budget must be >= 0 bytes (0 streams), got {budget}")
    limit, source = memory_limit()
    size = float32_bytes(model)
    if size > limit // 2:
        return WeightsPlan(STREAMED, size, budget, f"float32 {human_bytes(size)} > half of {source}")
    if size > budget:
        return WeightsPlan(STREAMED, size, budget, f"float32 {human_bytes(size)} > budget {human_bytes(budget)}")
    return WeightsPlan(RESIDENT, size, budget, f"float32 {human_bytes(size)} <= budget {human_bytes(budget)}")


@dataclass(frozen=True)
class ResidentRows:
    """A 2-D float32 array [N, K] served as a file-backed tensor is (``tensor[rows]`` -> rows), so the LM head's
    products are made in the same row blocks as the streamed head's (``core.decoder.linear_each``)."""

    array: np.ndarray

    ndim = 2
    dtype = np.dtype(np.float32)

    @property
    def shape(self) -> tuple[int, int]:
        return self.array.shape

    def __getitem__(self, rows) -> np.ndarray:
        return self.array[rows]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self.array if dtype is None else self.array.astype(dtype)


def _resident(tensor):
    """A head tensor in memory: a float32 array stays; a file-backed one is read whole once into ``ResidentRows``."""
    return tensor if isinstance(tensor, np.ndarray) else ResidentRows(np.asarray(tensor, np.float32))


class ResidentModel:
    """A ``ModelCheckpoint`` whose layers' weights are kept from their first read and whose embedding / LM head
    is in memory; everything else is the wrapped model's (``model``)."""

    def __init__(self, model: ModelCheckpoint):
        self.model = model
        self._attention: dict[int, AttentionWeights] = {}
        self._layers: dict[int, DecoderLayerWeights] = {}
        self._head: HeadWeights | None = None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def attention(self, layer: int) -> AttentionWeights:
        if layer not in self._attention:
            self._attention[layer] = self.model.attention(layer)
        return self._attention[layer]

    def layer(self, layer: int) -> DecoderLayerWeights:
        if layer not in self._layers:
            self._layers[layer] = self.model.layer(layer)
        return self._layers[layer]

    def head(self) -> HeadWeights:
        if self._head is None:
            head = self.model.head()
            embed = _resident(head.embed_tokens)
            lm_head = embed if head.lm_head is head.embed_tokens else _resident(head.lm_head)
            self._head = replace(head, embed_tokens=embed, lm_head=lm_head)
        return self._head


def weights_for_run(model, budget_bytes: int | None = None):
    """(the model a run reads its weights from, its ``WeightsPlan``): a ``ResidentModel`` when resident."""
    if isinstance(model, ResidentModel):
        return model, plan_weights(model.model, budget_bytes)
    plan = plan_weights(model, budget_bytes)
    return (ResidentModel(model) if plan.mode == RESIDENT else model), plan
