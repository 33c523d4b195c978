"""decide's ``evidence.json``: what it may reuse, and the seal that makes a recorded verification evidence.

A layer's entry holds its package's content hash and its verification summary, written by the process that ran
``verify_package`` on those very bytes, and a ``seal``: an HMAC-SHA256 of the entry and its context (design,
request, checkpoint, code (``core.code_identity``), layer) under this checkout's evidence key (``core.paths.EVIDENCE_KEY_FILE``,
made once, readable by its owner only). decide reuses a package only when its bytes hash to the entry's hash and
the seal checks out: a note in ``evidence.json`` — a hash written there by hand or by a tool, an entry copied
from another layer — is not a verification, so that package is set aside and exported and verified again.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

from anelab.core.code_identity import code_identity
from anelab.core.errors import AnelabInputError
from anelab.core.paths import EVIDENCE_KEY_FILE
from anelab.core.records import atomic_write_text
from anelab.sidecar.checks.verify import verify_package

EVIDENCE_KEY_BYTES = 32  # HMAC-SHA256's block-strength key


def evidence_key(path: Path = EVIDENCE_KEY_FILE) -> bytes:
    """This checkout's evidence key, made on first use (owner-only; published with a hard link, so two processes
    making it at once agree on one)."""
    with contextlib.suppress(FileNotFoundError):
        key = path.read_bytes()
        if len(key) == EVIDENCE_KEY_BYTES:
            return key
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(EVIDENCE_KEY_BYTES))
    try:
        os.link(tmp, path)
    except FileExistsError:  # another process made it first (or a malformed one is there: replace it)
        if len(path.read_bytes()) != EVIDENCE_KEY_BYTES:
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return path.read_bytes()


def _seal(context: dict, layer: str, entry: dict) -> str:
    message = json.dumps({"context": context, "layer": layer, "sha256": entry.get("sha256"),
                          "verify": entry.get("verify")}, sort_keys=True)  # fmt: skip
    return hmac.new(evidence_key(), message.encode(), hashlib.sha256).hexdigest()


class EvidenceFile:
    """``DIR/evidence.json``: per design, the export request and each layer's package hash, verification and
    seal; the whole-model arms' summary under ``ARMS``."""

    ARMS = "whole-model arms"  # the key of the arms' entry (never a design's name)

    def __init__(self, path: Path, checkpoint: dict | None = None):
        self.path, self.checkpoint = path, checkpoint or {}
        try:
            self.data = json.loads(path.read_text())
        except FileNotFoundError:
            self.data = {}
        except (json.JSONDecodeError, OSError, UnicodeDecodeError):
            raise AnelabInputError(f"{path} is not readable JSON; remove it to start the evidence afresh") from None
        if not isinstance(self.data, dict):
            raise AnelabInputError(f"{path} is not a JSON object; remove it to start the evidence afresh")

    def _wanted(self, request, gated: bool) -> dict:
        return {"request": request.to_dict(), "code": code_identity(), "gated": gated, "checkpoint": self.checkpoint}

    def layers(self, design: str, request, gated: bool = False) -> dict:
        """The layers kept for ``design`` exported as ``request`` by this code (``core.code_identity``), through the ANE gate or
        not (``gated``; a new request: none)."""
        kept = self.data.get(design)
        wanted = self._wanted(request, gated)
        if (
            not isinstance(kept, dict)
            or {k: kept.get(k) for k in wanted} != wanted
            or not isinstance(kept.get("layers"), dict)
        ):
            kept = self.data[design] = {**wanted, "layers": {}}
        return kept["layers"]

    def sealed(self, design: str, request, gated: bool, layer: int, entry: dict) -> dict:
        """``entry`` (a layer's hash and verification) with its seal: call only with what verify returned."""
        return {**entry, "seal": _seal({"design": design, **self._wanted(request, gated)}, str(layer), entry)}

    def trusted(self, design: str, request, gated: bool, layer: int, entry) -> bool:
        """Whether ``entry`` is a verification this checkout sealed for this layer, design, request and checkpoint."""
        if not isinstance(entry, dict) or not isinstance(entry.get("seal"), str) or "verify" not in entry:
            return False
        want = _seal({"design": design, **self._wanted(request, gated)}, str(layer), entry)
        return hmac.compare_digest(want, entry["seal"])

    def arms(self, key: dict) -> dict | None:
        """The arms' summary recorded under ``key`` (``arms_key``), or None (none recorded, or another key)."""
        kept = self.data.get(self.ARMS)
        if isinstance(kept, dict) and kept.get("key") == key and isinstance(kept.get("result"), dict):
            return kept["result"]
        return None

    def record_arms(self, key: dict, result: dict) -> None:
        self.data[self.ARMS] = {"key": key, "result": result}
        self.write()

    def write(self) -> None:
        atomic_write_text(self.path, json.dumps(self.data, indent=2, sort_keys=True))


def verify_summary(report) -> dict:
    """Per package: passed, vacuous, cases and controls, the worst relative error of a judged case (against the
    weights the package stores) and, compressed, the worst against the uncompressed weights (reported, not judged)."""
    cases = [c for c in report.comparisons if not c.control and not c.cost]
    controls = [c for c in report.comparisons if c.control]
    return {
        "passed": bool(report.passed),
        "vacuous": bool(report.vacuous),
        "cases": len(cases),
        "controls": len(controls),
        "max_relative_error": max((float(c.worst) for c in cases), default=None),
        "compression_error": max((float(c.worst) for c in report.comparisons if c.cost), default=None),
        "threshold": report.threshold,
    }


def reverify_when_the_arms_disagree(opened, verified: dict, arms) -> None:
    """Each reused package verified again here when the arms diverge from the reference (a layer above the noise),
    its summary replaced in ``verified``: a reused verification never stands against its own arms. ``opened``: decide's
    ``Opened`` (its checkpoint); ``arms``: its ``ArmsSummary``."""
    if arms.first_divergent_layer is None:
        return

    for layer, summary in verified.items():
        if summary.get("reused"):
            report = verify_package(summary["package"], opened.checkpoint, progress=False)
            verified[layer] = {**summary, **verify_summary(report), "reverified": "the arms diverged"}
