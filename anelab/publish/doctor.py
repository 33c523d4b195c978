"""``anelab doctor``: what this machine can do — the Core ML runtime, versions, which sidecar formats
(Core ML, Core AI) can be measured here, fresh vs replayed studies (the studies from ``publish.studies.STUDIES``).

Every study has parts that run anywhere (numerics, sizing, the planner, replay of recorded data)
and parts that need the Core ML runtime on a Mac (loads, predictions, the compute plan). Off-Mac
the latter are replayed from the records in ``data/``, labelled as recorded.
"""

from __future__ import annotations

import platform
import sys

import anelab
from anelab.core.records import machine_description
from anelab.publish.studies import STUDIES
from anelab.runtimes.coreml.coreml_runtime import default_runtime
from anelab.runtimes.interface import CoreMLRuntime
from anelab.sidecar.backends import BACKENDS, COREAI, COREML
from anelab.sidecar.coreai.coreai_import import coreai_version


def study_mode(anywhere: str | None, needs_runtime: str | None, available: bool) -> str:
    """ "runs here" (every part runs on this machine), "partly" (the runtime part is replayed from
    recorded data) or "replay" (nothing of it runs here)."""
    if needs_runtime is None or available:
        return "runs here" if anywhere is not None or available else "replay"
    return "partly" if anywhere is not None else "replay"


def _version(module: str) -> str:
    try:
        if module == "coremltools":
            import contextlib
            import io

            with contextlib.redirect_stderr(io.StringIO()):
                import coremltools as mod
        else:
            mod = __import__(module)
        return str(mod.__version__)
    except Exception as e:  # report, don't crash the doctor
        return f"unavailable ({type(e).__name__})"


def backends_here(runtimes: dict | None = None) -> dict:
    """Per sidecar back-end (``sidecar.backends.BACKENDS``): whether it exports and verifies here (its Python
    package imports) and whether its runtime can measure here, with the one-line reason when not.
    ``runtimes``: back-end name -> runtime (default: each back-end's own, from ``Backend.runtime``)."""
    import importlib

    out = {}
    for name, backend in BACKENDS.items():
        if runtimes and name in runtimes:
            runtime = runtimes[name]
        else:
            module, _, factory = backend.runtime.partition(":")
            runtime = getattr(importlib.import_module(module), factory)()
        reason = runtime.unavailable_reason()
        out[name] = {"suffix": backend.suffix, "exports_here": True, "measures_here": reason == "", "reason": reason}
    return out


def diagnose(runtime: CoreMLRuntime | None = None, coreai_runtime=None) -> dict:
    """This machine's capabilities as a dict (what ``anelab doctor --json`` prints). ``coreai_runtime``: the
    Core AI runtime (default: this machine's)."""

    runtime = runtime if runtime is not None else default_runtime()
    available = runtime.available()
    studies = {}
    for study in STUDIES:
        anywhere, needs_runtime = study.runs_here, study.needs_mac
        parts = [p for p in (anywhere, needs_runtime) if p is not None]
        studies[study.name] = {
            "notebook": study.notebook,
            "mode": study_mode(anywhere, needs_runtime, available),
            "runs_here": parts if available else [p for p in parts if p is not needs_runtime],
            "replayed_here": [] if available or needs_runtime is None else [needs_runtime],
        }
    engine = runtime.neural_engine_reason() if available else runtime.unavailable_reason()
    return {
        "runtime": {
            "name": runtime.name,
            "available": available,
            "reason": runtime.unavailable_reason(),
            "neural_engine": engine == "",
            "neural_engine_reason": engine,
        },
        "machine": machine_description(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "versions": {
            "anelab": anelab.__version__,
            "coremltools": _version("coremltools"),
            "numpy": _version("numpy"),
            "coreai-core": coreai_version(),
        },  # fmt: skip
        "studies": studies,
        "backends": backends_here(
            {COREML: runtime, **({COREAI: coreai_runtime} if coreai_runtime is not None else {})}
        ),
    }


def format_report(report: dict) -> str:
    """The human-readable doctor report."""
    rt, m, v = report["runtime"], report["machine"], report["versions"]
    lines = [
        f"Core ML runtime: {'available' if rt['available'] else 'unavailable'}"
        + ("" if rt["available"] else f" — {rt['reason']}"),
        f"Neural Engine:   {'available' if rt['neural_engine'] else 'unavailable'}"
        + ("" if rt["neural_engine"] or not rt["available"] else f" — {rt['neural_engine_reason']}")
        + ("" if rt["available"] else " (no Core ML runtime, above)"),
        f"machine:         {m['machine_model']}, chip {m['chip']}, {m['os_version']}",
        f"python:          {report['python']} ({report['python_executable']})",
        f"versions:        anelab {v['anelab']}, coremltools {v['coremltools']}, coreai-core {v.get('coreai-core')}, "
        f"numpy {v['numpy']}",
        "probe:           'anelab doctor --probe' checks, on a tiny package, every Core ML behaviour anelab relies on"
        + ("" if rt["available"] else " (on a Mac)"),
        "sidecar formats (anelab export --backend):",
    ]
    for name, b in report.get("backends", {}).items():
        why = "the Core ML runtime, above" if b["reason"] == rt["reason"] else b["reason"]  # said once
        measured = "measures here" if b["measures_here"] else f"measures on a Mac only — {why}"
        lines.append(f"  {name:<7} {b['suffix']:<11} exports and verifies here; {measured}")
    lines.append("studies:")
    for name, s in report["studies"].items():
        lines.append(f"  {name:<17} {s['mode']:<9} {s['notebook']}")
        for part in s["runs_here"]:
            lines.append(f"      runs here: {part}")
        for part in s["replayed_here"]:
            lines.append(f"      replayed:  {part} (recorded data in data/; measuring it needs the Core ML runtime)")
    return "\n".join(lines)
