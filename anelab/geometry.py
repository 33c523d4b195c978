"""Geometry of one full-attention block, and the sizes derived from it.

Three attention variants follow the Hugging Face transformers conventions:

- ``llama``:      no q/k norm; RoPE with ``rotate_half`` pairing.
- ``qwen3``:      per-head RMSNorm over head_dim on q and k (weights used as ``w``).
- ``qwen3_next``: gated full attention of hybrid models — ``q_proj`` emits query and gate per
  head (``[heads, 2 * head_dim]``, query first), ``sigmoid(gate)`` scales the attention output
  before ``o_proj``; zero-centred q/k norm weights (applied as ``1 + w``); partial RoPE.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from anelab.errors import AnelabInputError

ATTENTION_VARIANTS = ("llama", "qwen3", "qwen3_next")
FP16_BYTES = 2
FP32_BYTES = 4
GB = 10**9  # decimal gigabyte: sizes in the seeds are quoted in GB = 1e9 bytes


@dataclass(frozen=True)
class AttentionGeometry:
    """Shapes and constants of one full-attention block (one layer of a model)."""

    variant: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    num_layers: int = 1
    full_attention_layers: tuple[int, ...] = field(default=(0,))
    has_qkv_bias: bool = False
    has_o_bias: bool = False

    def __post_init__(self):
        if self.variant not in ATTENTION_VARIANTS:
            raise AnelabInputError(
                f"unknown attention variant {self.variant!r}; supported: {', '.join(ATTENTION_VARIANTS)}"
            )
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "num_layers"):
            if int(getattr(self, name)) <= 0:
                raise AnelabInputError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise AnelabInputError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise AnelabInputError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim % 2:
            raise AnelabInputError(f"rotary dim head_dim*partial_rotary_factor = {self.rotary_dim} must be even")
        bad = [layer for layer in self.full_attention_layers if not 0 <= layer < self.num_layers]
        if bad or not self.full_attention_layers:
            raise AnelabInputError(
                f"full-attention layers {list(self.full_attention_layers)} must be within 0..{self.num_layers - 1}"
            )

    # -- derived shapes -------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates (transformers: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def has_qk_norm(self) -> bool:
        return self.variant in ("qwen3", "qwen3_next")

    @property
    def is_gated(self) -> bool:
        return self.variant == "qwen3_next"

    @property
    def q_out_features(self) -> int:
        """Rows of q_proj.weight: heads*head_dim, doubled when the projection also emits the gate."""
        return self.num_heads * self.head_dim * (2 if self.is_gated else 1)

    @property
    def kv_out_features(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_features(self) -> int:
        """Columns of o_proj.weight."""
        return self.num_heads * self.head_dim

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter of the block, by its Hugging Face name after ``self_attn.``.

        q_proj.weight [q_out, D], k_proj/v_proj.weight [Hkv*d, D], o_proj.weight [D, Hq*d]; biases
        [out] where the geometry has them; q_norm/k_norm.weight [d] for per-head q/k norms.
        """
        shapes = {
            "q_proj.weight": (self.q_out_features, self.hidden_size),
            "k_proj.weight": (self.kv_out_features, self.hidden_size),
            "v_proj.weight": (self.kv_out_features, self.hidden_size),
            "o_proj.weight": (self.hidden_size, self.attn_features),
        }
        if self.has_qkv_bias:
            shapes.update(
                {
                    "q_proj.bias": (self.q_out_features,),
                    "k_proj.bias": (self.kv_out_features,),
                    "v_proj.bias": (self.kv_out_features,),
                }
            )
        if self.has_o_bias:
            shapes["o_proj.bias"] = (self.hidden_size,)
        if self.has_qk_norm:
            shapes.update({"q_norm.weight": (self.head_dim,), "k_norm.weight": (self.head_dim,)})
        return shapes

    def parameter_count(self) -> int:
        """Parameters of one block: projections, q/k norms and biases (what a sidecar stores)."""
        return sum(int(np.prod(shape)) for shape in self.parameter_shapes().values())

    def score_arena_bytes(self, chunk: int, history: int, dtype_bytes: int = FP16_BYTES) -> int:
        """Bytes of the dense score matrix [heads, chunk, history + chunk]."""
        return score_arena_bytes(self.num_heads, chunk, history, dtype_bytes)

    def block_flops(self, chunk: int, history: int) -> int:
        """Multiply-add FLOPs (2 per MAC) of the block for one chunk: projections + QK^T + PV."""
        total = history + chunk
        proj = 2 * chunk * self.hidden_size * (self.q_out_features + 2 * self.kv_out_features)
        proj += 2 * chunk * self.attn_features * self.hidden_size
        attn = 2 * 2 * self.num_heads * chunk * total * self.head_dim
        return proj + attn

    def to_dict(self) -> dict:
        d = asdict(self)
        d["full_attention_layers"] = list(self.full_attention_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> AttentionGeometry:
        d = dict(d)
        d["full_attention_layers"] = tuple(d.get("full_attention_layers", (0,)))
        return cls(**d)


def score_arena_bytes(heads: int, chunk: int, history: int, dtype_bytes: int = FP16_BYTES) -> int:
    """Bytes of one function's dense score matrix [heads, chunk, history + chunk] (the working set
    that the seed found the load time to track)."""
    return int(heads) * int(chunk) * (int(history) + int(chunk)) * int(dtype_bytes)


def coverage(histories: list[int] | tuple[int, ...], chunk: int) -> int:
    """Largest absolute position + 1 that a set of per-history functions can serve."""
    return max(histories) + chunk


def validate_chunk_and_histories(chunk: int, histories: list[int]) -> list[int]:
    """Check a chunk width and a history list; return the histories sorted ascending."""
    if chunk <= 0:
        raise AnelabInputError(f"--chunk must be a positive integer, got {chunk}")
    if not histories:
        raise AnelabInputError("--histories must list at least one history, e.g. 0,C,2C")
    if len(set(histories)) != len(histories):
        dup = sorted({h for h in histories if histories.count(h) > 1})
        raise AnelabInputError(f"duplicate histories {dup}; list each history once")
    for h in histories:
        if h < 0 or h % chunk:
            raise AnelabInputError(
                f"history {h} is not a non-negative multiple of the chunk {chunk}; use 0,{chunk},{2 * chunk},..."
            )
    return sorted(histories)


def chunk_starts(prompt_tokens: int, chunk: int) -> list[int]:
    """Start position (history) of each chunk of a prompt: 0, C, 2C, ... < prompt_tokens.

    The last chunk may be partial (prompt_tokens - start < C real rows)."""
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, (int, np.integer)) or prompt_tokens < 1:
        raise AnelabInputError(f"--prompt-tokens must be a positive integer, got {prompt_tokens!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise AnelabInputError(f"--chunk must be a positive integer, got {chunk!r}")
    return list(range(0, int(prompt_tokens), int(chunk)))
