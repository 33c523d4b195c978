"""What the computing code is, for the keys of results kept between runs (exports, verifications, activations,
whole-model costs, converted functions, decide's evidence).

A result cached under the anelab version alone outlives the code that computed it: in a working tree the version
stays put while the reference, the exporter or the verifier change, and a cached verification computed by an older
reference is then reused as if fresh (a figure drew such stale numbers once). ``code_identity`` names the version,
a digest of every source file of the package, and the versions of the libraries that compute the numbers, so any
change to them starts the cached results afresh.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path

import anelab

# the libraries whose versions can change a cached number (NumPy: the reference; coremltools: the packages)
COMPUTING_LIBRARIES = ("numpy", "coremltools")


def source_digest(root: Path | None = None) -> str:
    """SHA-256 (16 hex digits) of every ``*.py`` file under ``root`` (default: the anelab package), each by its path
    relative to ``root`` and its bytes, in sorted order."""
    root = Path(root) if root is not None else Path(anelab.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(f"{path.relative_to(root).as_posix()}\0".encode())
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _library_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


@functools.cache
def code_identity() -> str:
    """``anelab <version> (source <digest>); numpy <v>; coremltools <v>``: read once per process."""
    libraries = "; ".join(f"{name} {_library_version(name)}" for name in COMPUTING_LIBRARIES)
    return f"anelab {anelab.__version__} (source {source_digest()}); {libraries}"
