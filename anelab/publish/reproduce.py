"""The main job (``make reproduce``): export and verify the embedded default sidecar, run the
study notebooks, write figures and a short report under the build directory.
"""

from __future__ import annotations

from pathlib import Path

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.default import default_checkpoint_dir
from anelab.core.parallel import available_cores
from anelab.core.records import atomic_write_text
from anelab.publish.fresh import figures_with_fresh_data
from anelab.publish.notebooks import run_parameters
from anelab.runtimes.coreml.coreml_runtime import default_runtime
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.export import export_sidecars

DEFAULT_CHUNK = 64


QUICK_CHUNK = 16


def export_and_verify_default(build: Path, quick: bool) -> tuple[bool, str]:
    """Export every full-attention layer of the embedded default checkpoint and verify each
    package from disk. Returns (passed, report text)."""

    checkpoint = load_checkpoint(default_checkpoint_dir(build / "checkpoints"))
    chunk = QUICK_CHUNK if quick else DEFAULT_CHUNK
    histories = [0, chunk] if quick else [0, chunk, 2 * chunk]
    results = export_sidecars(checkpoint, build / "sidecars", chunk, histories)
    lines = [
        "# anelab: default sidecar export and verification",
        "",
        f"checkpoint: {checkpoint.path}",
        f"chunk {chunk}, histories {histories}",
        "",
    ]
    passed = True
    for r in results:
        report = verify_package(r.package, checkpoint)
        passed &= report.passed
        ratio = r.weight_bytes / max(1, r.metadata.single_function_weight_bytes)
        lines += [
            f"## layer {r.metadata.layer}: {r.package.name}",
            f"weights {r.weight_bytes:,} B = {ratio:.3f}x one function's; coverage {r.metadata.coverage}; "
            f"aneCompileVerified {str(r.metadata.ane_verified).lower()} ({r.metadata.ane_reason})",
            "",
            "```",
            report.table(),
            "```",
            "",
        ]
    return passed, "\n".join(lines)


MAX_JOBS = 2  # notebooks run at once by reproduce off a Mac (fewer on a one-core machine)


def reproduce_jobs(device_available: bool | None = None) -> int:
    """Notebooks ``reproduce`` runs at once. With the Core ML runtime (``device_available``; default:
    asked of ``anelab.runtimes.coreml.coreml_runtime.default_runtime``) the notebooks time loads and predictions on the
    device, so they run one at a time and no study disturbs another's timings. Without it, nothing is
    timed on a device: ``MAX_JOBS`` at once, or every core when there are fewer (each study is one
    kernel running its cells in order, so two keep two cores busy)."""

    if device_available is None:
        device_available = default_runtime().available()
    return 1 if device_available else min(MAX_JOBS, available_cores())


def reproduce(quick: bool = False, build: str | Path = "build", jobs: int | None = None) -> int:
    """Export and verify the default sidecar (``build/report.md``), then run every study notebook,
    ``jobs`` at a time (default ``reproduce_jobs()``). Returns the exit code: 0 when all passed."""
    build = Path(build)
    passed, text = export_and_verify_default(build, quick)
    atomic_write_text(build / "report.md", text)
    print(text)
    print(f"report written to {build / 'report.md'}")
    try:
        from anelab.publish.notebooks import run_all_notebooks  # inside: optional (papermill, nbconvert)
    except ImportError:
        return 0 if passed else 1
    ok = run_all_notebooks(quick=quick, build=build, jobs=reproduce_jobs() if jobs is None else jobs)
    print(fresh_figures_line(quick, build))
    return 0 if (passed and ok) else 1


def fresh_figures_line(quick: bool, build: Path) -> str:
    """Which figures drew fresh Mac data (records from ``anelab measure``), as one line."""

    names = figures_with_fresh_data(run_parameters(quick, build)["figures_dir"])
    if not names:
        return "fresh Mac data: none of the figures (no Mac records in the records directory; run 'anelab measure' on a Mac)"
    return f"fresh Mac data: {', '.join(names)}"
