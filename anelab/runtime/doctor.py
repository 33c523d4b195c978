"""``anelab doctor``: what this machine can do — the Core ML runtime, versions, fresh vs replayed studies.

Every study has parts that run anywhere (numerics, sizing, the planner, replay of recorded data)
and parts that need the Core ML runtime on a Mac (loads, predictions, the compute plan). Off-Mac
the latter are replayed from the records in ``data/``, labelled as recorded.
"""

from __future__ import annotations

import platform
import sys

from anelab.records import machine_description
from anelab.runtime.interface import CoreMLRuntime
from anelab.runtime.mac import default_runtime

# The one table of the studies: study -> (notebook, part that runs anywhere, part that needs the Core ML
# runtime or None when nothing does). tests/test_front_door.py checks it against notebooks/, so a new
# notebook without a row fails the tests.
STUDIES: dict[str, tuple[str, str, str | None]] = {
    "dense_offload": (
        "notebooks/01_dense_offload.ipynb",
        "planner sweeps (offload share, prompt length) over the recorded GPU/ANE matrix",
        "attention-block predict per compute-units setting (CPU+GPU vs CPU+Neural Engine)",
    ),
    "mask_fold": (
        "notebooks/02_mask_fold.ipynb",
        "everything: saved graph vs fp64 reference under folded, causal and swept masks, vacuity guard, greedy vs raw",
        None,
    ),
    "gather_sizing": (
        "notebooks/03_gather_sizing.ipynb",
        "dense vs gather sizing, probe graphs built, saved and evaluated from disk",
        "probe load/predict timing and ANE operation counts",
    ),
    "setup_cost": (
        "notebooks/04_setup_cost.ipynb",
        "fit of recorded load times against score-arena bytes, break-even prompt lengths",
        "cold/warm loads and package compositions through anelab.runtime.timing",
    ),
    "tiled_stateful": (
        "notebooks/05_tiled_stateful.ipynb",
        "tiled and stateful graphs verified from disk, largest intermediates, quantization error",
        "load and predict per chunk size and compute-units setting",
    ),
    "one_function": (
        "notebooks/06_one_function.ipynb",
        "planner per design, saved packages' op counts and intermediates, verification, NumPy prefill",
        "cold loads and predictions (through the state) of c<C> against h<H>",
    ),
    "whole_model_arms": (
        "notebooks/07_whole_model_arms.ipynb",
        "the whole dense model on its sidecars: chunked prefill, greedy decode, per-layer and logits differences",
        "Core ML numerics of the same arms (anelab compare-arms --compute-units)",
    ),
}


def notebooks_without_a_row(notebook_names: list[str]) -> list[str]:
    """The notebooks (file names) that ``STUDIES`` does not list: each is a study doctor would forget."""
    listed = {notebook.rsplit("/", 1)[-1] for notebook, _, _ in STUDIES.values()}
    return [name for name in notebook_names if name not in listed]


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


def diagnose(runtime: CoreMLRuntime | None = None) -> dict:
    """This machine's capabilities as a dict (what ``anelab doctor --json`` prints)."""
    import anelab

    runtime = runtime if runtime is not None else default_runtime()
    available = runtime.available()
    studies = {}
    for name, (notebook, anywhere, needs_runtime) in STUDIES.items():
        parts = [p for p in (anywhere, needs_runtime) if p is not None]
        studies[name] = {
            "notebook": notebook,
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
        "versions": {"anelab": anelab.__version__, "coremltools": _version("coremltools"), "numpy": _version("numpy")},
        "studies": studies,
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
        f"versions:        anelab {v['anelab']}, coremltools {v['coremltools']}, numpy {v['numpy']}",
        "probe:           'anelab doctor --probe' checks, on a tiny package, every Core ML behaviour anelab relies on"
        + ("" if rt["available"] else " (on a Mac)"),
        "studies:",
    ]
    for name, s in report["studies"].items():
        lines.append(f"  {name:<17} {s['mode']:<9} {s['notebook']}")
        for part in s["runs_here"]:
            lines.append(f"      runs here: {part}")
        for part in s["replayed_here"]:
            lines.append(f"      replayed:  {part} (recorded data in data/; measuring it needs the Core ML runtime)")
    return "\n".join(lines)
