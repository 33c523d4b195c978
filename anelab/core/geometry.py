"""Geometry of one softmax-attention block (full or sliding-window), its declared options, and the sizes derived from it.

Three variants follow transformers: ``llama`` (no q/k norm), ``qwen3`` (per-head RMSNorm on q and k) and
``qwen3_next`` (gated full attention of hybrid models). Every other family is one of these plus *options*:
fields whose defaults leave the block unchanged (``to_dict`` omits a field at its default), set from a
config.json by ``anelab.checkpoints.config.MODEL_FAMILIES`` — RoPE scaling, query scale, soft-cap, q/k norm
kind, RoPE layout, sliding windows, NoPE layers, local RoPE base, and what the caller applies around the sidecar
(each described in docs/derivations.md). Chunk starts, coverage, score-arena bytes and parameter counts are
defined here once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.rope import RopeScaling, rope_frequencies

ATTENTION_VARIANTS = ("llama", "qwen3", "qwen3_next")
QK_NORM_KINDS = ("none", "per_head", "projection")
ROPE_LAYOUTS = ("half", "interleaved")
INPUT_ROWS = ("post_input_norm", "residual")
FP16_BYTES = 2
FP32_BYTES = 4
GB = 10**9  # decimal gigabyte: sizes in the seeds are quoted in GB = 1e9 bytes


@dataclass(frozen=True)
class AttentionGeometry:
    """Shapes, constants and declared options of a model's softmax-attention blocks.

    ``full_attention_layers`` lists every layer with softmax attention (full or sliding window:
    what a sidecar can serve); ``sliding_layers`` is the subset that slides (``sliding_window`` keys).
    """

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
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int | None = None
    rope_layout: str = "half"
    query_scale: float | None = None
    logit_softcap: float | None = None
    qk_norm: str | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    no_rope_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    input_rows: str = "post_input_norm"
    after_o_proj: str = ""

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
        self._check_options()

    def _check_options(self) -> None:
        for name in ("sliding_layers", "no_rope_layers"):  # lists from callers compare equal after this
            object.__setattr__(self, name, tuple(sorted(int(i) for i in getattr(self, name))))
        for name, value, allowed in (
            ("rope_layout", self.rope_layout, ROPE_LAYOUTS),
            ("qk_norm", "none" if self.qk_norm is None else self.qk_norm, QK_NORM_KINDS),
            ("input_rows", self.input_rows, INPUT_ROWS),
        ):
            if value not in allowed:
                raise AnelabInputError(f"{name} {value!r} is not one of {', '.join(allowed)}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise AnelabInputError("rope_scaling must be an anelab.core.rope.RopeScaling; use RopeScaling.from_config")
        for name in ("query_scale", "logit_softcap", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
                raise AnelabInputError(f"{name} must be a positive number or null, got {value!r}")
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise AnelabInputError(
                f"sliding_window must be a positive integer (tokens) or null, got {self.sliding_window!r}"
            )
        if self.sliding_layers and self.sliding_window is None:
            raise AnelabInputError("sliding layers are listed but sliding_window is null; set the window (tokens)")
        for name in ("sliding_layers", "no_rope_layers"):
            stray = sorted(set(getattr(self, name)) - set(self.full_attention_layers))
            if stray:
                raise AnelabInputError(f"{name} {stray} are not attention layers {list(self.full_attention_layers)}")

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
    def qk_norm_kind(self) -> str:
        """``none``, ``per_head`` (RMSNorm over head_dim, weight [d]) or ``projection`` (OLMo 2:
        RMSNorm over the whole projection, weights [Hq*d] and [Hkv*d])."""
        if self.qk_norm is not None:
            return self.qk_norm
        return "per_head" if self.variant in ("qwen3", "qwen3_next") else "none"

    @property
    def has_qk_norm(self) -> bool:
        return self.qk_norm_kind != "none"

    @property
    def attention_scale(self) -> float:
        """The factor on q.k: ``query_scale`` when declared, else 1 / sqrt(head_dim)."""
        return float(self.query_scale) if self.query_scale is not None else 1.0 / np.sqrt(self.head_dim)

    def window_of(self, layer: int) -> int | None:
        """The layer's sliding window in tokens (0 <= i - j < W), or None for full attention."""
        return self.sliding_window if layer in self.sliding_layers else None

    def uses_rope(self, layer: int) -> bool:
        return layer not in self.no_rope_layers

    def rope_frequencies(self, layer: int, coverage: int | None = None) -> tuple[np.ndarray, float]:
        """The layer's RoPE table: (inv_freq [rotary_dim / 2] float64, attention factor on cos and sin).

        The one definition the reference and every graph use. Sliding layers with a
        ``local_rope_theta`` (Gemma 3) use that base and no scaling. ``coverage`` (the largest
        position + 1 a package serves) picks the table of the sequence-length-dependent types,
        statically per package: ``dynamic`` is transformers' table at seq_len = coverage,
        ``longrope`` uses long_factor iff coverage > original_max_position_embeddings (anelab.core.rope);
        they refuse a missing coverage, the other types ignore it.
        """
        scaling = self.rope_scaling or RopeScaling()
        theta = self.rope_theta
        if self.local_rope_theta is not None and layer in self.sliding_layers:
            scaling, theta = RopeScaling(), self.local_rope_theta
        if scaling.rope_type in ("dynamic", "longrope") and coverage is None:
            raise AnelabInputError(
                f"rope_type {scaling.rope_type!r} depends on the sequence length; pass the package coverage"
            )
        if scaling.rope_theta is not None:  # transformers 5 carries theta inside rope_parameters too
            scaling = RopeScaling(**{**_scaling_dict(scaling), "rope_theta": None})
        return rope_frequencies(
            theta,
            self.rotary_dim,
            scaling,
            coverage=int(coverage or 1),
            max_position_embeddings=self.max_position_embeddings,
        )

    @property
    def rope_depends_on_coverage(self) -> bool:
        return self.rope_scaling is not None and self.rope_scaling.rope_type in ("dynamic", "longrope")

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
        if self.qk_norm_kind == "per_head":
            shapes.update({"q_norm.weight": (self.head_dim,), "k_norm.weight": (self.head_dim,)})
        elif self.qk_norm_kind == "projection":
            shapes.update({"q_norm.weight": (self.attn_features,), "k_norm.weight": (self.kv_out_features,)})
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
        """JSON-ready dict; an option at its default is omitted (older dicts stay byte-identical)."""
        d = asdict(self)
        d["full_attention_layers"] = list(self.full_attention_layers)
        for f in fields(self):
            if f.name in _OPTION_FIELDS and getattr(self, f.name) == f.default:
                del d[f.name]
        for name in ("sliding_layers", "no_rope_layers"):
            if name in d:
                d[name] = list(d[name])
        if self.rope_scaling is not None:
            d["rope_scaling"] = _scaling_dict(self.rope_scaling)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> AttentionGeometry:
        d = dict(d)
        d["full_attention_layers"] = tuple(d.get("full_attention_layers", (0,)))
        for name in ("sliding_layers", "no_rope_layers"):
            d[name] = tuple(d.get(name, ()))
        if d.get("rope_scaling") is not None:
            scaling = dict(d["rope_scaling"])
            for name in ("short_factor", "long_factor"):
                if scaling.get(name) is not None:
                    scaling[name] = tuple(scaling[name])
            d["rope_scaling"] = RopeScaling(**scaling)
        return cls(**d)


def _scaling_dict(scaling: RopeScaling) -> dict:
    """A RopeScaling's set fields as a JSON-ready dict (factor lists as lists)."""
    out = {}
    for f in fields(scaling):
        value = getattr(scaling, f.name)
        if value is not None:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


# Fields added as declared options of the block: omitted from to_dict at their defaults.
_OPTION_FIELDS = frozenset(
    {
        "rope_scaling",
        "max_position_embeddings",
        "rope_layout",
        "query_scale",
        "logit_softcap",
        "qk_norm",
        "sliding_window",
        "sliding_layers",
        "no_rope_layers",
        "local_rope_theta",
        "input_rows",
        "after_o_proj",
    }
)


def score_bytes(heads: int, query_rows: int, keys: int, dtype_bytes: int = FP16_BYTES) -> int:
    """Bytes of a score matrix [heads, query_rows, keys] (a whole function's, or one tile's)."""
    return int(heads) * int(query_rows) * int(keys) * int(dtype_bytes)


def score_arena_bytes(heads: int, chunk: int, history: int, dtype_bytes: int = FP16_BYTES) -> int:
    """Bytes of one function's dense score matrix [heads, chunk, history + chunk] (the working set
    that the seed found the load time to track)."""
    return score_bytes(heads, chunk, int(history) + int(chunk), dtype_bytes)


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
