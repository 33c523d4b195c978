"""Upper bounds on every size a config, a header or a flag sets, checked before anything is allocated.

Each bound is a named constant with its reason. ``require_at_most`` refuses a number past its bound in one
line that names the number and the limit; ``require_memory`` compares what a step is about to allocate (at
least) with what this process may allocate: the machine's physical memory, or a lower address-space or data
limit set on the process (``ulimit -v``), so a run that cannot fit is refused before it starts, not killed
after an hour.
"""

from __future__ import annotations

import math
import resource

from anelab.core.errors import AnelabInputError

MAX_LAYERS = 4096  # decoder layers in one config.json (the largest released models have about 130)
MAX_WIDTH = 1 << 20  # hidden_size, intermediate_size, vocab_size (the largest real ones are ~256k)
MAX_HEADS = 4096  # query or KV heads of one attention layer
MAX_HEAD_DIM = 4096  # one head's width (real heads are 64..512)
MAX_EXPERTS = 4096  # routed experts of one MoE layer (the largest released models have a few hundred)
MAX_POSITIONS = 1 << 21  # token positions one command handles: a prompt plus its decode, a package's coverage
MAX_FUNCTIONS = 1024  # functions in one package: each is converted on its own (seconds each at tiny size)
MAX_CHUNKS = 1 << 16  # chunks of one planned prompt: the plan lists each chunk and the histories it visits
MAX_DECODE_TOKENS = 4096  # greedy tokens compare-arms decodes (the comparison's agreement needs tens)


def require_at_most(what: str, value: int, limit: int, fix: str) -> int:
    """``value`` when it is at most ``limit``; else one line naming both and the fix."""
    if value > limit:
        raise AnelabInputError(f"{what} is {value:,}; the limit is {limit:,}; {fix}")
    return value


def require_prompt_lengths(prompt_tokens, flag: str = "--prompt-tokens") -> list[int]:
    """Prompt lengths, each a positive integer of at most ``MAX_POSITIONS`` tokens (one line naming the flag)."""
    lengths = [int(n) for n in prompt_tokens]
    if not lengths or min(lengths) < 1:
        raise AnelabInputError(f"{flag} must list positive lengths, got {list(prompt_tokens)}")
    require_at_most(flag, max(lengths), MAX_POSITIONS, "use a shorter prompt")
    return lengths


def require_finite_positive(flag: str, value, unit: str) -> float:
    """``value`` as a float when it is a finite number above 0 (``unit`` names what it counts: "seconds",
    "tokens per second"); NaN, infinity, zero and negatives are refused naming the flag and the unit."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise AnelabInputError(f"{flag} must be a finite number of {unit} above 0, got {value}")
    return float(value)


def memory_limit() -> tuple[int, str]:
    """(bytes this process may allocate, where that limit comes from): the physical memory, or a lower
    RLIMIT_AS / RLIMIT_DATA soft limit."""
    import psutil

    limit, source = psutil.virtual_memory().total, "the machine's memory"
    for name in ("RLIMIT_AS", "RLIMIT_DATA"):
        soft = resource.getrlimit(getattr(resource, name))[0] if hasattr(resource, name) else resource.RLIM_INFINITY
        if soft != resource.RLIM_INFINITY and 0 < soft < limit:
            limit, source = soft, f"this process's {name} limit"
    return int(limit), source


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units (1.5 GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def require_memory(what: str, nbytes: int, fix: str) -> int:
    """``nbytes`` when it fits in ``memory_limit()``; else one line naming the bytes, the limit and the fix."""
    limit, source = memory_limit()
    if nbytes > limit:
        raise AnelabInputError(f"{what} needs at least {human_bytes(nbytes)}; {source} is {human_bytes(limit)}; {fix}")
    return nbytes
