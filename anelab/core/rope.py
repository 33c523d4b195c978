"""RoPE inverse frequencies and the cos/sin attention factor, for every RoPE type transformers models.

Ported (float64 NumPy, no torch) from transformers' ``modeling_rope_utils.py`` (the RoPE table in
``docs/conventions.md`` gives the function and lines per type): ``default``, ``linear``, ``dynamic``, ``llama3``,
``yarn``, ``longrope``; anything else is refused, never approximated. ``rope_frequencies`` returns
``(inv_freq [rotary_dim // 2], attention_factor)``; ``rope_cos_sin`` builds the table. The two length-dependent
types take the sidecar's ``coverage`` for transformers' ``seq_len`` (anelab's choice, derived in
docs/derivations.md); everything is in the half-rotated layout (``interleaved_to_half`` converts GLM's pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from anelab.core.errors import AnelabInputError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# Keys a rope dict may hold for every type (transformers: RotaryEmbeddingConfigMixin.standardize_rope_params
# and _check_received_keys). "type" is the legacy spelling of "rope_type".
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})

# Per type: keys that must be in the dict, and keys that may be. From transformers'
# _validate_<type>_rope_parameters, except that original_max_position_embeddings is optional here
# because standardize_rope_params fills it in (top-level config attribute, else max_position_embeddings).
_REQUIRED: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor"}),
    "yarn": frozenset({"factor"}),
    "longrope": frozenset({"short_factor", "long_factor"}),
}
_OPTIONAL: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset(),
    "dynamic": frozenset(),
    "llama3": frozenset({"original_max_position_embeddings"}),
    "yarn": frozenset(
        {
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
    "longrope": frozenset({"original_max_position_embeddings", "attention_factor", "factor"}),
}
# Types for which transformers' standardize_rope_params resolves original_max_position_embeddings.
_USES_ORIGINAL_MAX = frozenset({"llama3", "yarn", "longrope"})

YARN_DEFAULT_BETA_FAST = 32  # transformers: rope_parameters_dict.get("beta_fast") or 32
YARN_DEFAULT_BETA_SLOW = 1  # transformers: rope_parameters_dict.get("beta_slow") or 1
YARN_DEFAULT_TRUNCATE = True  # transformers: config.rope_parameters.get("truncate", True)


@dataclass(frozen=True)
class RopeScaling:
    """The RoPE options of a config that change the frequency table (transformers' rope_parameters / rope_scaling).

    ``None`` means "absent from the config"; ``rope_frequencies`` applies transformers' defaults.
    ``rope_theta`` and ``partial_rotary_factor`` are kept only when the dict carries them (transformers 5
    moves them into ``rope_parameters``): ``rope_frequencies`` refuses a ``theta`` that disagrees with
    ``rope_theta``; the caller derives ``rotary_dim = int(head_dim * partial_rotary_factor)`` itself.
    ``original_max_position_embeddings`` is, for llama3 / yarn / longrope, the value transformers
    resolves (``from_config`` applies the same precedence).
    """

    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn; absent (or 0) -> 32
    beta_slow: float | None = None  # yarn; absent (or 0) -> 1
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool | None = None  # yarn; absent -> True (floor/ceil the correction range)
    attention_factor: float | None = None  # yarn / longrope explicit cos/sin factor
    short_factor: tuple[float, ...] | None = None  # longrope
    long_factor: tuple[float, ...] | None = None  # longrope
    rope_theta: float | None = None  # transformers 5 keeps theta inside rope_parameters
    partial_rotary_factor: float | None = None  # likewise

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise AnelabInputError(
                f"unsupported rope_type {self.rope_type!r}: anelab models {', '.join(ROPE_TYPES)}; "
                "use a checkpoint with one of those or add the type to anelab/core/rope.py"
            )
        allowed = _REQUIRED[self.rope_type] | _OPTIONAL[self.rope_type] | {"rope_theta", "partial_rotary_factor"}
        for f in fields(self):
            if f.name != "rope_type" and getattr(self, f.name) is not None and f.name not in allowed:
                raise AnelabInputError(
                    f"RopeScaling field {f.name!r} does not apply to rope_type {self.rope_type!r}; "
                    f"remove it (allowed: {', '.join(sorted(allowed))})"
                )
        needed = {
            "linear": ("factor",),
            "dynamic": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
            "longrope": ("short_factor", "long_factor"),
        }.get(self.rope_type, ())
        for name in needed:
            if getattr(self, name) is None:
                raise AnelabInputError(f"rope_type {self.rope_type!r} needs {name!r}; set it in rope_scaling")

    @classmethod
    def from_config(
        cls,
        rope_dict: dict | None,
        *,
        max_position_embeddings: int | None,
        original_max_position_embeddings: int | None = None,
    ) -> RopeScaling:
        """Parse a config's ``rope_scaling`` / ``rope_parameters`` dict (None or {} means default RoPE).

        ``max_position_embeddings`` is the config's top-level value. ``original_max_position_embeddings``
        is the config's *top-level* attribute of that name (Phi-3 style), which transformers lets override
        the dict's value. For llama3 / yarn / longrope the resolved value is: top-level attribute, else the
        dict's, else ``max_position_embeddings`` (transformers' ``standardize_rope_params``).

        Refuses (AnelabInputError) an unknown rope_type, a missing required key, a key this type does not
        use, and a value of the wrong kind. transformers only warns about unknown keys; anelab refuses.
        """
        rope_type = _checked_rope_type(rope_dict if rope_dict is not None else {})
        values = _RopeDict(rope_dict or {}, rope_type)
        kwargs: dict[str, Any] = {"rope_type": rope_type, **values.common(), **values.type_values()}
        if rope_type in _USES_ORIGINAL_MAX:
            kwargs["original_max_position_embeddings"] = _resolved_original_max(
                rope_type,
                original_max_position_embeddings,
                (rope_dict or {}).get("original_max_position_embeddings"),
                max_position_embeddings,
            )
        return cls(**kwargs)


def _checked_rope_type(rope_dict: dict) -> str:
    """The dict's RoPE type (``rope_type``, legacy ``type``, else default), its keys checked: a
    per-layer nested dict, an unknown type, a key the type does not use or a missing one is refused."""
    if not isinstance(rope_dict, dict):
        raise AnelabInputError(
            f"rope_scaling / rope_parameters must be a dict or null, got {type(rope_dict).__name__}; fix config.json"
        )
    if any(isinstance(v, dict) for v in rope_dict.values()):
        raise AnelabInputError(
            "rope_parameters is nested per layer type (" + ", ".join(map(str, rope_dict)) + "); "
            "pass the dict of the layer type you export"
        )
    rope_type, legacy = rope_dict.get("rope_type"), rope_dict.get("type")
    if rope_type is not None and legacy is not None and rope_type != legacy:
        raise AnelabInputError(f"rope dict has rope_type={rope_type!r} and type={legacy!r}; keep one of them")
    rope_type = rope_type if rope_type is not None else (legacy if legacy is not None else "default")
    if rope_type not in ROPE_TYPES:
        raise AnelabInputError(
            f"unsupported rope_type {rope_type!r}: anelab models {', '.join(ROPE_TYPES)}; "
            "use a checkpoint with one of those or add the type to anelab/core/rope.py"
        )
    required, optional = _REQUIRED[rope_type], _OPTIONAL[rope_type]
    unknown = sorted(set(rope_dict) - required - optional - _COMMON_KEYS)
    if unknown:
        raise AnelabInputError(
            f"rope_type {rope_type!r} does not use key(s) {', '.join(map(repr, unknown))}; "
            f"remove them or model them in anelab/core/rope.py (allowed: {', '.join(sorted(required | optional))})"
        )
    missing = sorted(required - set(rope_dict))
    if missing:
        raise AnelabInputError(
            f"rope_type {rope_type!r} needs key(s) {', '.join(map(repr, missing))} in rope_scaling; add them"
        )
    return rope_type


@dataclass(frozen=True)
class _RopeDict:
    """A checked rope dict's values, read with their kinds checked (one line naming the key)."""

    values: dict
    rope_type: str

    def number(self, key: str, *, positive: bool = True, allow_none: bool = True) -> float | None:
        value = self.values.get(key)
        if value is None:
            if allow_none:
                return None
            raise AnelabInputError(f"rope_scaling[{key!r}] is null for rope_type {self.rope_type!r}; give a number")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise AnelabInputError(f"rope_scaling[{key!r}] must be a finite number, got {value!r}")
        if positive and value <= 0:
            raise AnelabInputError(f"rope_scaling[{key!r}] must be > 0, got {value!r}")
        return float(value)

    def factors(self, key: str) -> tuple[float, ...]:
        value = self.values.get(key)
        if not isinstance(value, (list, tuple)) or not value:
            raise AnelabInputError(f"rope_scaling[{key!r}] must be a non-empty list of numbers, got {value!r}")
        for x in value:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
                raise AnelabInputError(f"rope_scaling[{key!r}] must hold positive numbers, got {x!r}")
        return tuple(float(x) for x in value)

    def common(self) -> dict:
        """rope_theta and partial_rotary_factor (transformers 5 keeps them in rope_parameters)."""
        prf = self.number("partial_rotary_factor")
        if prf is not None and prf > 1.0:
            raise AnelabInputError(f"rope_scaling['partial_rotary_factor'] must be in (0, 1], got {prf}")
        return {"rope_theta": self.number("rope_theta"), "partial_rotary_factor": prf}

    def type_values(self) -> dict:
        """The fields this RoPE type reads."""
        kind, out = self.rope_type, {}
        if kind in ("linear", "dynamic", "llama3"):
            out["factor"] = self.number("factor", allow_none=False)
        elif kind in ("yarn", "longrope"):
            out["factor"] = self.number("factor")  # null: transformers uses max_position_embeddings / original
        if kind == "llama3":
            out["low_freq_factor"] = self.number("low_freq_factor", allow_none=False)
            out["high_freq_factor"] = self.number("high_freq_factor", allow_none=False)
        if kind == "yarn":
            for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
                out[key] = self.number(key, positive=False)
            truncate = self.values.get("truncate")
            if truncate is not None and not isinstance(truncate, bool):
                raise AnelabInputError(f"rope_scaling['truncate'] must be true or false, got {truncate!r}")
            out["truncate"] = truncate
        if kind in ("yarn", "longrope"):
            out["attention_factor"] = self.number("attention_factor", positive=False)
        if kind == "longrope":
            out["short_factor"] = self.factors("short_factor")
            out["long_factor"] = self.factors("long_factor")
        return out


def _resolved_original_max(rope_type: str, top_level, in_dict, max_position_embeddings) -> int:
    """original_max_position_embeddings as transformers resolves it: the config's top-level value,
    else the dict's, else max_position_embeddings (``standardize_rope_params``)."""
    for name, value in (
        ("original_max_position_embeddings (top-level)", top_level),
        ("rope_scaling['original_max_position_embeddings']", in_dict),
        ("max_position_embeddings", max_position_embeddings),
    ):
        if value is not None:
            return _positive_int(value, name)
    raise AnelabInputError(
        f"rope_type {rope_type!r} needs original_max_position_embeddings (or max_position_embeddings); "
        "add it to the config"
    )


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise AnelabInputError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _original_max(scaling: RopeScaling, max_position_embeddings: int | None) -> int:
    if scaling.original_max_position_embeddings is not None:
        return _positive_int(scaling.original_max_position_embeddings, "original_max_position_embeddings")
    if max_position_embeddings is None:
        raise AnelabInputError(
            f"rope_type {scaling.rope_type!r} needs original_max_position_embeddings or max_position_embeddings; "
            "pass max_position_embeddings from the config"
        )
    return _positive_int(max_position_embeddings, "max_position_embeddings")


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' get_mscale inside _compute_yarn_parameters."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(
    theta: float,
    rotary_dim: int,
    scaling: RopeScaling,
    *,
    coverage: int,
    max_position_embeddings: int | None,
) -> tuple[np.ndarray, float]:
    """inv_freq [rotary_dim // 2] float64 and the attention factor that multiplies cos and sin.

    coverage = the largest position + 1 the sidecar will see (used by dynamic and longrope to pick,
    exactly as transformers does with seq_len; ignored by the other types).
    max_position_embeddings = the config's top-level value (needed by dynamic, and by yarn / longrope
    when ``factor`` is absent, or when ``original_max_position_embeddings`` is unset).
    """
    if not isinstance(scaling, RopeScaling):
        raise AnelabInputError(
            f"scaling must be a RopeScaling, got {type(scaling).__name__}; use RopeScaling.from_config"
        )
    if (
        isinstance(theta, bool)
        or not isinstance(theta, (int, float, np.floating))
        or not theta > 0
        or not math.isfinite(theta)
    ):
        raise AnelabInputError(f"rope theta must be a finite number > 0, got {theta!r}")
    theta = float(theta)
    dim = _even_rotary_dim(rotary_dim)
    coverage = _positive_int(coverage, "coverage")
    if scaling.rope_theta is not None and scaling.rope_theta != theta:
        raise AnelabInputError(
            f"theta {theta} disagrees with rope_parameters['rope_theta'] {scaling.rope_theta}; pass the config's rope_theta"
        )

    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim  # transformers: arange(0, dim, 2) / dim
    table = _RopeTable(theta, dim, exponents, scaling, coverage, max_position_embeddings)
    return _FREQUENCIES[scaling.rope_type](table)


@dataclass(frozen=True)
class _RopeTable:
    """The inputs every RoPE type's frequency function reads (validated by ``rope_frequencies``)."""

    theta: float
    dim: int
    exponents: np.ndarray  # [dim // 2]: arange(0, dim, 2) / dim
    scaling: RopeScaling
    coverage: int
    max_position_embeddings: int | None

    def factor_or_ratio(self) -> tuple[float, int]:
        """(factor, original context) of yarn / longrope: ``factor`` defaults to max / original."""
        original = _original_max(self.scaling, self.max_position_embeddings)
        if self.scaling.factor is not None:
            return self.scaling.factor, original
        if self.max_position_embeddings is None:
            raise AnelabInputError(
                f"rope_type {self.scaling.rope_type!r} without 'factor' uses max_position_embeddings / original; "
                "pass max_position_embeddings"
            )
        return _positive_int(self.max_position_embeddings, "max_position_embeddings") / original, original


def _default_frequencies(t: _RopeTable) -> tuple[np.ndarray, float]:
    return 1.0 / t.theta**t.exponents, 1.0


def _linear_frequencies(t: _RopeTable) -> tuple[np.ndarray, float]:
    return (1.0 / t.theta**t.exponents) / t.scaling.factor, 1.0


def _dynamic_frequencies(t: _RopeTable) -> tuple[np.ndarray, float]:
    """Dynamic NTK at seq_len = max(coverage, max_position_embeddings): static for a package."""
    if t.max_position_embeddings is None:
        raise AnelabInputError("rope_type 'dynamic' needs max_position_embeddings; pass it from the config")
    mpe = _positive_int(t.max_position_embeddings, "max_position_embeddings")
    if t.dim < 4:
        raise AnelabInputError(f"rope_type 'dynamic' needs rotary_dim >= 4 (exponent d/(d-2)), got {t.dim}")
    seq_len, factor = max(t.coverage, mpe), t.scaling.factor
    base = t.theta * ((factor * seq_len / mpe) - (factor - 1)) ** (t.dim / (t.dim - 2))
    return 1.0 / base**t.exponents, 1.0


def _llama3_frequencies(t: _RopeTable) -> tuple[np.ndarray, float]:
    """Llama 3: long wavelengths divided by ``factor``, short ones kept, the band between smoothed."""
    inv_freq = 1.0 / t.theta**t.exponents
    factor, low, high = t.scaling.factor, t.scaling.low_freq_factor, t.scaling.high_freq_factor
    if not high > low:
        raise AnelabInputError(
            f"llama3 rope needs high_freq_factor > low_freq_factor, got {high} and {low}; fix rope_scaling"
        )
    old_context_len = _original_max(t.scaling, t.max_position_embeddings)
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled), 1.0


def _yarn_frequencies(t: _RopeTable) -> tuple[np.ndarray, float]:
    """YaRN: a ramp between extrapolated and interpolated frequencies, and an attention factor."""
    s = t.scaling
    factor, original = t.factor_or_ratio()
    if s.attention_factor is not None:
        attention_factor = float(s.attention_factor)
    elif s.mscale and s.mscale_all_dim:  # truthiness, as transformers
        attention_factor = _yarn_get_mscale(factor, s.mscale) / _yarn_get_mscale(factor, s.mscale_all_dim)
    else:
        attention_factor = _yarn_get_mscale(factor)
    beta_fast = s.beta_fast or YARN_DEFAULT_BETA_FAST
    beta_slow = s.beta_slow or YARN_DEFAULT_BETA_SLOW
    truncate = YARN_DEFAULT_TRUNCATE if s.truncate is None else s.truncate

    def correction_dim(num_rotations: float) -> float:
        return (t.dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(t.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, t.dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent singularity
    ramp = np.clip((np.arange(t.dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    pos_freqs = t.theta**t.exponents
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1.0 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor, attention_factor


def _longrope_frequencies(t: _RopeTable) -> tuple[np.ndarray, float]:
    """LongRoPE (Phi-3): per-dimension short or long factors, chosen by coverage."""
    s = t.scaling
    factor, original = t.factor_or_ratio()
    if s.attention_factor is not None:
        attention_factor = float(s.attention_factor)
    elif factor <= 1.0:
        attention_factor = 1.0
    else:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    name = "long_factor" if t.coverage > original else "short_factor"
    chosen = getattr(s, name)
    if chosen is None or len(chosen) != t.dim // 2:
        raise AnelabInputError(
            f"longrope {name} must have rotary_dim // 2 = {t.dim // 2} entries, got "
            f"{None if chosen is None else len(chosen)}; fix rope_scaling or rotary_dim"
        )
    return 1.0 / (np.asarray(chosen, dtype=np.float64) * t.theta**t.exponents), attention_factor


# rope_type -> its frequency function (transformers: ROPE_INIT_FUNCTIONS)
_FREQUENCIES = {
    "default": _default_frequencies,
    "linear": _linear_frequencies,
    "dynamic": _dynamic_frequencies,
    "llama3": _llama3_frequencies,
    "yarn": _yarn_frequencies,
    "longrope": _longrope_frequencies,
}


def rope_cos_sin(
    positions: np.ndarray, inv_freq: np.ndarray, attention_factor: float, dtype=np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, rotary_dim] in transformers' half-rotated layout (freqs concatenated twice) times the factor.

    Computed in float64 (``freqs = positions * inv_freq``; ``emb = cat(freqs, freqs)``;
    ``cos = cos(emb) * attention_factor``, same for sin), then cast to ``dtype``.
    """
    pos = np.asarray(positions)
    inv = np.asarray(inv_freq, dtype=np.float64)
    if pos.ndim != 1:
        raise AnelabInputError(f"positions must be 1-D [T], got shape {pos.shape}")
    if inv.ndim != 1 or inv.size == 0:
        raise AnelabInputError(f"inv_freq must be 1-D and non-empty, got shape {inv.shape}")
    freqs = pos.astype(np.float64)[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    factor = float(attention_factor)
    return (np.cos(emb) * factor).astype(dtype), (np.sin(emb) * factor).astype(dtype)


def _even_rotary_dim(rotary_dim) -> int:
    """``rotary_dim`` as an int, refused in one line unless it is an even integer >= 2."""
    if (
        isinstance(rotary_dim, bool)
        or not isinstance(rotary_dim, (int, np.integer))
        or rotary_dim < 2
        or rotary_dim % 2
    ):
        raise AnelabInputError(f"rotary_dim must be an even integer >= 2, got {rotary_dim!r}")
    return int(rotary_dim)


def _interleave_permutation(size: int, rotary_dim: int) -> np.ndarray:
    rotary_dim = _even_rotary_dim(rotary_dim)
    if rotary_dim > size:
        raise AnelabInputError(f"rotary_dim {rotary_dim} exceeds the last axis ({size})")
    return np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2), np.arange(rotary_dim, size)])


def interleaved_to_half(x: np.ndarray, rotary_dim: int) -> np.ndarray:
    """Reorder the last axis from the interleaved rotary layout (GLM, GLM-4) to the half-rotated one.

    Channels ``[0, 2, 4, ..., rotary_dim - 2, 1, 3, ..., rotary_dim - 1]`` then the pass-through
    channels ``rotary_dim ..`` unchanged. For the same cos/sin table, half-layout RoPE of
    ``interleaved_to_half(x)`` equals ``interleaved_to_half`` of interleaved RoPE of ``x``, and q.k is
    unchanged when q and k are both reordered, so permuting the rows of W_q and W_k (and q/k biases or
    norm weights over head_dim) per head lets a half-layout graph run an interleaved model.
    """
    x = np.asarray(x)
    return x[..., _interleave_permutation(x.shape[-1], rotary_dim)]


def half_to_interleaved(x: np.ndarray, rotary_dim: int) -> np.ndarray:
    """Inverse of ``interleaved_to_half``."""
    x = np.asarray(x)
    perm = _interleave_permutation(x.shape[-1], rotary_dim)
    return x[..., np.argsort(perm)]
