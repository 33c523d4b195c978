"""The load protocol: when a sidecar function's specialization and reload are paid, and what each costs.

Two costs, both functions of the score arena only (same arena, same price, in every family):

- **specialization**: the ANE compiler's one-time work per function. TinyTitan's design record
  (Pummelchen/NVMAI ``docs/v4.5-ane-prefill.md``, the 35B on an M3): "the first request per machine
  pays a one-time ANE specialization per function (~130 s across all variants), cached by the OS
  thereafter". Priced by a power law in score-arena bytes fitted on every cold load on record
  (``fit_specialization``): Qwen 3.8's three ``MLModel(contentsOf:)`` times and its three package
  compositions (each less its reload), and the 35B's ~130 s over its 40 functions as one total.
- **reload**: loading an already-specialized function again. "At most one Core ML model is resident
  at a time ... the reload costs ~0.5 s per layer-chunk, already included in the numbers above"
  (the same record). Priced in proportion to the arena, at the note's 0.5 s for the 35B's mean
  visited arena (``RELOAD_NOTE_SECONDS`` / ``reload_anchor_bytes``). The A/B rows say it scales:
  a flat 0.5 s per layer-chunk puts the chunk-1,024 2B row (18 layer-chunks) on the GPU side.

The protocol (``PROTOCOLS``) says when specialization is paid: ``machine`` (once per machine and OS;
the default: TinyTitan's record, and the only one under which the Qwen 3.5 and 35B rows — fresh
server per run, one discarded warm-up — are reproduced), ``process`` (every new process, e.g. no
persistent OS cache: a plan prices the process's first prompt), ``prompt`` (every prompt). A
prompt whose visited arenas exceed the machine's memory cannot keep its specializations
(``cache_holds``): the one contrast in the records — Qwen 3.8's 29 GB of visited arenas on the 24 GB
M3, whose A/B arm must hold its ~245 s of cold loads to lose by 76 s, against the 35B's 16 GB,
whose arm holds reloads only — is what this rule is fitted on (an assumption, stated in every plan).

Reload policy (``RELOAD_POLICIES``): ``serialized`` (as measured: each reload waits for the
previous block) or ``preloaded`` (the record's unbuilt idea: the next function loads on a background
thread while the GPU runs the rest of the layer; "worth ~15-20 % of the remaining prefill"): a
reload is then hidden up to the GPU time between two offloaded blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.geometry import GB, score_arena_bytes

PROTOCOLS = ("machine", "process", "prompt")
DEFAULT_PROTOCOL = "machine"
RELOAD_POLICIES = ("serialized", "preloaded")
DEFAULT_RELOAD_POLICY = "serialized"

TINYTITAN_NOTE = "TinyTitan docs/v4.5-ane-prefill.md (github.com/Pummelchen/NVMAI), 35B-A3B on an M3 24 GB"
RELOAD_NOTE_SECONDS = 0.5  # "~0.5 s per layer-chunk", the 35B, serialized with compute
SPECIALIZATION_NOTE_SECONDS = 130.0  # "~130 s across all variants", once per machine
NOTE_HISTORIES = (0, 4096, 8192, 12288)  # the record's functions h0/h4096/h8192/h12288, chunk 4,096
NOTE_AB = {"prompt_tokens": 6103, "gpu_seconds": 132.90, "ane_seconds": 57.52}  # measured, warm OS cache
NOTE_VISITED = (0, 4096)  # a 6,103-token prompt in chunks of 4,096 visits h0 and h4096
REFERENCE_MEMORY_BYTES = 24 * 2**30  # the recorded M3's 24 GB


def require_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise AnelabInputError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    return protocol


def require_reload_policy(policy: str) -> str:
    if policy not in RELOAD_POLICIES:
        raise AnelabInputError(f"--reload-policy must be one of {', '.join(RELOAD_POLICIES)}, got {policy!r}")
    return policy


def reload_anchor_bytes(note_heads: int, chunk: int = 4096) -> float:
    """Mean score arena of the functions the record's 6,103-token prompt reloads (h0, h4096)."""
    return float(np.mean([score_arena_bytes(note_heads, chunk, h) for h in NOTE_VISITED]))


def note_arenas(note_heads: int, layers: int, chunk: int = 4096) -> list[int]:
    """Score arenas of every function the record's ~130 s specialized: each layer's h0..h12288."""
    return [score_arena_bytes(note_heads, chunk, h) for h in NOTE_HISTORIES] * layers


def fit_specialization(
    points: Sequence[tuple[float, float]], totals: Sequence[tuple[Sequence[float], float]] = ()
) -> tuple[float, float]:
    """(coef, exp) of ``seconds = coef * (arena / GB) ** exp`` minimising the squared log misses of
    single loads ``points`` (arena bytes, seconds) and of summed loads ``totals`` (arenas, seconds).
    For a fixed exp the best log(coef) is the mean miss, so exp is searched on a grid (0.25 .. 3)."""
    if len(points) + len(totals) < 1:
        raise AnelabInputError("a specialization fit needs at least one load record")
    distinct = {a for a, _ in points} | {tuple(a) for a, _ in totals}
    grid = np.arange(0.25, 3.0001, 0.005) if len(distinct) > 1 else np.array([1.0])
    # logs[i, j]: record j's log miss at exponent grid[i] before the mean, every exponent at once (the same
    # operations per element as one exponent at a time: the fit is the same bit for bit, ~50x faster)
    columns = [np.log(s) - grid * np.log(a / GB) for a, s in points]
    for a, s in totals:
        scaled = np.asarray(a, dtype=float) / GB
        columns.append(np.log(s) - np.log([np.sum(scaled**exp) for exp in grid]))
    logs = np.stack(columns, axis=1)
    log_coefs = np.mean(logs, axis=1)
    misses = np.sum((logs - log_coefs[:, None]) ** 2, axis=1)
    best = None
    for exp, log_coef, miss in zip(grid, log_coefs, misses, strict=True):
        if best is None or miss < best[0] - 1e-12:
            best = (float(miss), float(np.exp(float(log_coef))), float(exp))
    return best[1], best[2]


def cache_holds(visited_arena_bytes: float, memory_bytes: float = REFERENCE_MEMORY_BYTES) -> bool:
    """Whether the OS keeps a prompt's specializations: its visited arenas fit in the machine's memory."""
    return visited_arena_bytes <= memory_bytes


def pays_specialization(protocol: str, visited_arena_bytes: float, memory_bytes: float = REFERENCE_MEMORY_BYTES):
    """(True if this prompt pays specialization, why) under ``protocol``."""
    require_protocol(protocol)
    if protocol == "prompt":
        return True, "protocol 'prompt': every prompt specializes the functions it visits"
    if protocol == "process":
        return True, "protocol 'process': the process's first prompt specializes the functions it visits"
    if not cache_holds(visited_arena_bytes, memory_bytes):
        return True, (
            f"protocol 'machine', but the visited arenas ({visited_arena_bytes / 2**30:.1f} GiB) exceed the "
            f"{memory_bytes / 2**30:.0f} GiB of memory: the cache cannot hold them (assumed; Qwen 3.8's A/B shows it)"
        )
    return False, "protocol 'machine': specialized once per machine and OS (cached), reloaded per prompt"


def hidden_reload(reload_seconds: float, gap_seconds: float, policy: str) -> float:
    """Seconds of one reload the GPU hides: none when serialized; up to the GPU's time between two
    offloaded blocks (``gap_seconds``) when preloaded on a background thread."""
    require_reload_policy(policy)
    return 0.0 if policy == "serialized" else min(reload_seconds, max(gap_seconds, 0.0))
