"""The planner's catalogue: recorded model families and the plan geometry of one model."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry, chunk_starts, score_arena_bytes
from anelab.core.limits import MAX_CHUNKS, MAX_POSITIONS, require_at_most

# how each figure in a plan is known
RECORDED, DERIVED, ASSUMED, FITTED, UNKNOWN, FLAG = "recorded", "derived", "assumed", "fitted", "unknown", "flag"
# a fitted law used outside the range (geometry, arena, prompt length or chunk) its records cover
EXTRAPOLATED = "extrapolated"


REFERENCE_TOKENS = 4333  # the seed's workload: 23,000-character prompt, ~4,333 tokens


REFERENCE_CHUNK = 4096  # the seed's sidecar width


# ---- geometry ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanGeometry:
    """What the planner needs of a model: its full-attention layers and their heads.

    ``num_kv_heads`` and ``head_dim`` are carried for the record (None = unknown); the cost model
    uses ``num_heads`` (score entries scale with it). ``sparse_budget`` is the most keys a query
    attends on the GPU's sparse path (None: the GPU path is dense).
    """

    num_layers: int
    full_attention_layers: tuple[int, ...]
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    sparse_budget: int | None = None

    def __post_init__(self):
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "sparse_budget"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, np.integer)) or value <= 0):
                raise AnelabInputError(f"--{_flag(name)} must be a positive integer, got {value}")
        layers = tuple(self.full_attention_layers)
        if not layers:
            raise AnelabInputError("--full-attention-layers must list at least one layer index, e.g. 3,7,11")
        if len(set(layers)) != len(layers):
            raise AnelabInputError(f"--full-attention-layers lists a layer twice: {list(layers)}")
        bad = [i for i in layers if not 0 <= i < self.num_layers]
        if bad:
            raise AnelabInputError(
                f"full-attention layers {bad} are outside 0..{self.num_layers - 1}; fix --full-attention-layers or --layers"
            )
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise AnelabInputError(f"--heads ({self.num_heads}) must be a multiple of --kv-heads ({self.num_kv_heads})")
        object.__setattr__(self, "full_attention_layers", tuple(sorted(layers)))

    def score_arena_bytes(self, chunk: int, history: int) -> int:
        """Bytes of the fp16 dense score matrix ``[heads, chunk, history + chunk]`` of one variant."""
        return score_arena_bytes(self.num_heads, chunk, history)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["full_attention_layers"] = list(self.full_attention_layers)
        return d


def _flag(name: str) -> str:
    return {"num_layers": "layers", "num_heads": "heads", "num_kv_heads": "kv-heads"}.get(name, name.replace("_", "-"))


def every_fourth(num_layers: int) -> tuple[int, ...]:
    """Full-attention layer indices of a hybrid model with one full-attention layer in four (3, 7, ...)."""
    return tuple(range(3, num_layers, 4))


# ---- score entries ----------------------------------------------------------------------------
def ane_score_entries(geometry: PlanGeometry, chunk: int, history: int) -> int:
    """Score entries of one ANE layer-chunk: the padded dense arena ``heads x chunk x (history+chunk)``."""
    return geometry.num_heads * chunk * (history + chunk)


def gpu_score_entries(geometry: PlanGeometry, rows: int, history: int) -> int:
    """Score entries of one GPU layer-chunk of ``rows`` real tokens (sparse: at most budget keys/query)."""
    keys = history + rows
    if geometry.sparse_budget is not None:
        keys = min(geometry.sparse_budget, keys)
    return geometry.num_heads * rows * keys


# ---- chunks -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chunk:
    """One prefill chunk: ``tokens`` real tokens at absolute ``start``; ``device`` is "ane" or "gpu"."""

    index: int
    start: int
    tokens: int
    device: str

    @property
    def history(self) -> int:
        """Tokens before the chunk, which names the sidecar function (``h<history>``)."""
        return self.start


def chunk_schedule(prompt_tokens: int, chunk: int) -> list[Chunk]:
    """Chunks of a prompt and their device: a prompt shorter than one chunk stays on the GPU."""
    require_plannable(prompt_tokens, chunk)
    on_ane = prompt_tokens >= chunk  # a full first chunk; every later chunk is a continuation
    return [
        Chunk(i, start, min(chunk, prompt_tokens - start), "ane" if on_ane else "gpu")
        for i, start in enumerate(chunk_starts(prompt_tokens, chunk))
    ]


def require_plannable(prompt_tokens: int, chunk: int) -> None:
    """A prompt and chunk width the planner can list: both positive integers, the prompt at most
    ``MAX_POSITIONS`` tokens and at most ``MAX_CHUNKS`` chunks (a plan lists every chunk)."""
    require_positive("--prompt-tokens", prompt_tokens)
    require_positive("--chunk", chunk)
    require_at_most("--prompt-tokens", int(prompt_tokens), MAX_POSITIONS, "plan a shorter prompt")
    chunks = -(-int(prompt_tokens) // int(chunk))
    require_at_most(f"a {int(prompt_tokens):,}-token prompt in chunks of {int(chunk):,}: the chunk count", chunks,
                    MAX_CHUNKS, f"use --chunk {-(-int(prompt_tokens) // MAX_CHUNKS):,} or more")  # fmt: skip


def require_positive(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise AnelabInputError(f"{flag} must be a positive integer, got {value}")


def positive_seconds(flag: str, value) -> float:
    if value is None or not math.isfinite(float(value)) or float(value) < 0:
        raise AnelabInputError(f"{flag} must be a non-negative number of seconds, got {value}")
    return float(value)


# ---- families ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """One model family of the seed: geometry, what is recorded vs assumed, and what is unknown.

    ``facts`` maps a geometry field to ``(status, note)`` with status recorded / derived / assumed /
    unknown. ``max_history`` is the largest history known to load on the ANE (None: not recorded).
    """

    name: str
    label: str
    geometry: PlanGeometry
    facts: dict
    max_history: int | None = None
    setup_note_seconds: float | None = None  # a family-specific per-variant setup from a record
    records: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()

    @property
    def model(self) -> str:
        return self.name.rsplit("-", 1)[0]

    @property
    def sparse(self) -> bool:
        return self.geometry.sparse_budget is not None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "label": self.label,
            "geometry": self.geometry.to_dict(),
            "facts": {k: {"status": s, "note": n} for k, (s, n) in self.facts.items()},
            "max_history": self.max_history,
            "coverage_cap": None if self.max_history is None else self.max_history + REFERENCE_CHUNK,
            "setup_note_seconds": self.setup_note_seconds,
            "records": list(self.records),
            "unknown": list(self.unknown),
        }


_QWEN35_CONFIG = "public Qwen 3.5 config; not stated in the seed"


_DENSE_UNKNOWN = (
    "per-variant load time (not measured: fitted from the A/B rows)",
    "largest history that still lands on the ANE",
    "split of the GPU prefill into attention and non-attention (fitted)",
)


def _qwen35(size: str, bits: int, layers: int, layers_status: str, fa_status: str, heads: int, kv: int) -> Family:
    n_fa = len(every_fourth(layers))
    return Family(
        name=f"qwen3.5-{size.lower()}-{bits}bit",
        label=f"Qwen 3.5 {size} {bits}-bit",
        geometry=PlanGeometry(layers, every_fourth(layers), heads, kv, 256),
        facts={
            "num_layers": (
                layers_status,
                "seed: 'the dense 2B only 6 of 24'" if layers_status == RECORDED else _QWEN35_CONFIG,
            ),
            "full_attention_layers": (fa_status, f"{n_fa} layers; indices assume one full-attention layer in four"),
            "num_heads": (ASSUMED, _QWEN35_CONFIG),
            "num_kv_heads": (ASSUMED, _QWEN35_CONFIG),
            "head_dim": (ASSUMED, _QWEN35_CONFIG),
            "sparse_budget": (RECORDED, "dense attention (seed: 'dense Qwen 3.5')"),
        },
        records=("v5.5-ane-matrix-3.json",) + (("ane-chunk1024-2b-4bit.json",) if (size, bits) == ("2B", 4) else ()),
        unknown=_DENSE_UNKNOWN
        + (
            ("head counts and layer count (assumed from public configs)",)
            if layers_status != RECORDED
            else ("head counts (assumed from the public config)",)
        ),
    )


def _qwen38(bits: int) -> Family:
    return Family(
        name=f"qwen3.8-125b-a6b-{bits}bit",
        label=f"Qwen 3.8 125B-A6B {bits}-bit",
        geometry=PlanGeometry(48, every_fourth(48), 24, None, 256, sparse_budget=2051),
        facts={
            "num_layers": (ASSUMED, "not in the seed; 48 with one full-attention layer in four"),
            "full_attention_layers": (
                DERIVED,
                "12: 24 (layer, history) variants at 4,333 tokens / 2 chunks; indices assumed",
            ),
            "num_heads": (RECORDED, "seed: 'the 24-head h12288 variant'"),
            "num_kv_heads": (UNKNOWN, "not in the seed; unused by the cost model"),
            "head_dim": (DERIVED, "256: 103 GB of gathered keys = 24 x 4,096 x 2,051 x head_dim x 2 B"),
            "sparse_budget": (RECORDED, "seed: 2,051 visible keys per query (QSA indexer)"),
        },
        max_history=8192,
        records=(("v5.5-ane-matrix-3.json",) if bits == 4 else ())
        + (
            f"v5.6-ane-38-{bits}bit.json",
            "seed-38-variant-loads.json",
            "seed-38-h0-ane-vs-cpu.json",
            "seed-op-assignment-counts.json",
        ),
        unknown=(
            "number of layers (assumed 48)",
            "kv heads",
            "split of the GPU prefill into sparse attention and non-attention (fitted)",
            "which precision's sidecar the load times were measured on (the sidecar is fp16 either way)",
        ),
    )


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _qwen35("2B", 4, 24, RECORDED, RECORDED, 8, 2),
        _qwen35("2B", 8, 24, RECORDED, RECORDED, 8, 2),
        _qwen35("4B", 4, 32, ASSUMED, ASSUMED, 16, 4),
        _qwen35("4B", 8, 32, ASSUMED, ASSUMED, 16, 4),
        _qwen35("9B", 4, 32, ASSUMED, ASSUMED, 16, 4),
        _qwen35("9B", 8, 32, ASSUMED, ASSUMED, 16, 4),
        Family(
            name="agentworld-35b-a3b-4bit",
            label="AgentWorld 35B-A3B 4-bit",
            geometry=PlanGeometry(40, every_fourth(40), 16, 2, 256),
            facts={
                "num_layers": (RECORDED, "seed: 'the 35B offloads 10 of 40 layers'"),
                "full_attention_layers": (RECORDED, "10 layers; indices assume one full-attention layer in four"),
                "num_heads": (ASSUMED, "public Qwen 3.5 35B-A3B config; not stated in the seed"),
                "num_kv_heads": (ASSUMED, "public Qwen 3.5 35B-A3B config; not stated in the seed"),
                "head_dim": (ASSUMED, "public Qwen 3.5 35B-A3B config; not stated in the seed"),
                "sparse_budget": (ASSUMED, "dense attention (the seed calls it a win alongside the dense models)"),
            },
            setup_note_seconds=0.5,
            records=("v5.5-ane-matrix-3.json", "seed-35b-setup-note.json"),
            unknown=(
                "head counts (assumed)",
                "whether the ~0.5 s setup note is measured, and at which histories",
                "largest history that still lands on the ANE",
                "split of the GPU prefill (fitted)",
            ),
        ),
        _qwen38(4),
        _qwen38(8),
    )
}


def get_family(name: str) -> Family:
    """The family called ``name``; an unknown name lists the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise AnelabInputError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}") from None


def family_table() -> list[dict]:
    """Every family with its geometry, the status of each fact, its records and its unknowns."""
    return [f.to_dict() for f in FAMILIES.values()]


# What the seed does not record about Qwen 3.8's full-attention layer; both move only the weight bytes
ASSUMED_HIDDEN_SIZE = 2048
ASSUMED_KV_HEADS = 2


def family_attention_geometry(name: str) -> AttentionGeometry:
    """One full-attention layer of a recorded family as an ``AttentionGeometry`` (the geometry its
    load records were measured on): heads, head_dim and layers from the catalogue; the hidden size
    (``ASSUMED_HIDDEN_SIZE``) and KV heads (the family's, else ``ASSUMED_KV_HEADS``) are assumed."""
    g = get_family(name).geometry
    return AttentionGeometry(
        variant="qwen3_next",
        hidden_size=ASSUMED_HIDDEN_SIZE,
        num_heads=g.num_heads,
        num_kv_heads=g.num_kv_heads or ASSUMED_KV_HEADS,
        head_dim=g.head_dim,
        num_layers=g.num_layers,
        full_attention_layers=g.full_attention_layers,
    )
