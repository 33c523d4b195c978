"""One export and one verification per model, design and weight mode, shared by every study through a cache keyed by
content.

An export is keyed by what its packages depend on: the geometry, the digests of every exported layer's attention
tensors (``Checkpoint.attention_digests``: the stored bytes, under any path), the export request (design, chunk,
histories, weight mode, options) and the code (``core.code_identity``). Its packages live in ``<cache>/exports/<key>/`` with an
``entry.json`` written last (the entry is complete only then) that records each package's content hash; an entry
whose packages no longer hash to it is exported again. A verification is keyed by the package's content hash, the
checkpoint's digests of its layer, the verify options (seed, precision, fp16, functions) and the digest of its real
inputs (``activations``); its ``VerifyReport`` is stored as JSON in ``<cache>/verify/<key>.json``.

Two studies asking for the same entry at once (``reproduce`` runs two notebooks at a time) take turns on an
``flock`` of the entry: the second finds it complete and reuses it. Nothing here decides what to export or
verify; callers ask, and ``CacheUse`` says what was reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from anelab.checkpoints.checkpoint import Checkpoint
from anelab.core.code_identity import code_identity
from anelab.core.files import entry_lock
from anelab.core.records import atomic_write_text
from anelab.sidecar.checks.comparison import Comparison
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.checks.verify_cases import VerifyReport
from anelab.sidecar.export import ExportResult, export_sidecars
from anelab.sidecar.format import package_content_hash, read_sidecar_metadata, weight_bytes

CACHE_DIR = "cache"  # under the build directory
ENTRY_FILE = "entry.json"
FUNCTIONS_DIR = "functions"  # converted fp16 functions, shared by every export's weight modes (sidecar.function_cache)


@dataclass
class CacheUse:
    """What a study's calls reused and what they computed (counts per kind: ``export``, ``verify``)."""

    reused: dict[str, int] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)

    def count(self, kind: str, reused: bool) -> None:
        side = self.reused if reused else self.computed
        side[kind] = side.get(kind, 0) + 1

    def line(self) -> str:
        kinds = sorted(set(self.reused) | set(self.computed))
        return "; ".join(f"{k}: {self.reused.get(k, 0)} reused, {self.computed.get(k, 0)} computed" for k in kinds)


def content_key(parts: dict) -> str:
    """SHA-256 (24 hex digits) of ``parts`` as sorted JSON (any value JSON cannot spell is written with str)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def export_key(checkpoint: Checkpoint, layers: list[int], request: dict) -> dict:
    """What an export's packages depend on (see the module docstring)."""
    return {
        "code": code_identity(),
        "geometry": dataclasses.asdict(checkpoint.geometry),
        "layers": {str(layer): checkpoint.attention_digests(layer) for layer in layers},
        "request": request,
    }


def _result(package: Path) -> ExportResult:
    meta = read_sidecar_metadata(package)
    return ExportResult(package, meta, weight_bytes(package), list(meta.functions))


def _complete(entry: Path, layers: list[int]) -> list[ExportResult] | None:
    """The entry's results when its ``ENTRY_FILE`` exists and every package still hashes to what it records."""
    try:
        recorded = json.loads((entry / ENTRY_FILE).read_text())["packages"]
    except (OSError, ValueError, KeyError):
        return None
    packages = [entry / f"layer_{layer}.mlpackage" for layer in layers]
    if any(not p.is_dir() or recorded.get(p.name) != package_content_hash(p) for p in packages):
        return None
    return [_result(p) for p in packages]


def cached_export(
    checkpoint: Checkpoint,
    cache_root: str | os.PathLike,
    chunk: int,
    histories: list[int] | None,
    layers: list[int] | None = None,
    *,
    use: CacheUse | None = None,
    **request,
) -> list[ExportResult]:
    """``export_sidecars(checkpoint, <entry>, chunk, histories, layers, **request)`` unless an entry with the same
    content key is complete in ``cache_root/exports`` (``request``: graph, weights_mode and the design's options); its
    functions are converted once per program in ``cache_root/functions``, whatever the weight mode.
    ``checkpoint``: opened; ``layers``: default every attention layer (full and sliding)."""
    g = checkpoint.geometry
    layers = [int(x) for x in (layers if layers is not None else sorted({*g.full_attention_layers, *g.sliding_layers}))]
    spelt = {"chunk": int(chunk), "histories": None if histories is None else [int(h) for h in histories], **request}
    key = content_key(export_key(checkpoint, layers, spelt))
    entry = Path(cache_root) / "exports" / key
    with entry_lock(entry.with_suffix(".lock")):
        done = _complete(entry, layers)
        if use is not None:
            use.count("export", done is not None)
        if done is not None:
            return done
        results = export_sidecars(
            checkpoint, entry, int(chunk), histories, layers, function_cache=Path(cache_root) / FUNCTIONS_DIR, **request
        )
        record = {"request": spelt, "source": str(checkpoint.path),
                  "packages": {r.package.name: package_content_hash(r.package) for r in results}}  # fmt: skip
        atomic_write_text(entry / ENTRY_FILE, json.dumps(record, indent=1, sort_keys=True))
    return results


def activations_digest(activations: np.ndarray | None) -> str | None:
    """SHA-256 (24 hex digits) of real attention inputs' dtype, shape and bytes (None: random rows)."""
    if activations is None:
        return None
    a = np.ascontiguousarray(activations)
    digest = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    digest.update(a.tobytes())
    return digest.hexdigest()[:24]


def report_from_dict(data: dict) -> VerifyReport:
    """A ``VerifyReport`` back from its ``to_dict`` (what the cache stores)."""
    fields = {f.name for f in dataclasses.fields(Comparison)}
    comparisons = [Comparison(**{k: v for k, v in c.items() if k in fields}) for c in data["comparisons"]]
    return VerifyReport(
        data["package"], data["checkpoint"], data["layer"], data["threshold"], data["evaluator"], comparisons,
        data["reference_precision"], data["reference_checks"], data["seconds"],
        [tuple(d) for d in data["declared_controls"]], data["inputs"],
    )  # fmt: skip


def cached_verify(
    package: str | os.PathLike,
    checkpoint: Checkpoint,
    cache_root: str | os.PathLike,
    *,
    use: CacheUse | None = None,
    activations: np.ndarray | None = None,
    **options,
) -> VerifyReport:
    """``verify_package(package, checkpoint, activations=..., **options)`` (no progress bar) unless the same
    package content, checkpoint layer, options and inputs were verified before (``cache_root/verify``); ``checkpoint``:
    opened."""
    meta = read_sidecar_metadata(package)
    options.setdefault("progress", False)
    parts = {
        "code": code_identity(),
        "package": package_content_hash(package),
        "checkpoint": checkpoint.attention_digests(meta.layer),
        "options": {k: v for k, v in options.items() if k != "progress"},
        "activations": activations_digest(activations),
    }
    path = Path(cache_root) / "verify" / f"{content_key(parts)}.json"
    with entry_lock(path.with_suffix(".lock")):
        if path.is_file():
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                report = report_from_dict(json.loads(path.read_text()))
                if use is not None:
                    use.count("verify", True)
                return report
        report = verify_package(package, checkpoint, activations=activations, **options)
        atomic_write_text(path, json.dumps(report.to_dict(), indent=1))
    if use is not None:
        use.count("verify", False)
    return report
