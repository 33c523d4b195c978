"""Stress: execute every widget notebook many times through papermill, headless; count hangs.

A widget notebook is one with an explore cell (``explore.show(``). Each run is a quick papermill run
with the project's per-cell timeout (``anelab.publish.notebooks.run_notebook``): a cell that hangs
becomes a ``CellTimeoutError`` after the timeout and is counted as a hang, never waited on for ever.
Before issue 24, notebook 02's ``widgets.interact`` cell hung a headless run for 7 minutes (nteract/
papermill#723). Prints per notebook: runs, ok, failed, hangs, median and slowest seconds.

``--screenshot DIR`` also renders notebook 02's executed HTML in headless Chromium with the vendored
widget manager (``anelab.publish.widget_manager``; needs npm once and ``chromium``, run by
``anelab.publish.browser``): the DOM after the scripts ran must hold the rendered slider, and a PNG
of the explore cell is written to DIR. The same check, with controls, is a test:
``tests/publish/test_browser.py``.

    python benchmarks/bench_widget_stress.py --repeats 20 [--jobs 2] [--screenshot build/widget-shots]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

from anelab.publish import notebooks


def widget_notebooks() -> list[Path]:
    """Study notebooks with an explore cell."""
    out = []
    for path in notebooks.discover_notebooks():
        cells = notebooks.read_notebook(path)["cells"]
        if any("explore.show(" in "".join(c.get("source", "")) for c in cells if c.get("cell_type") == "code"):
            out.append(path)
    return out


def one_run(path: Path, build: str, threads: int) -> dict:
    with notebooks.thread_limits(threads):
        run = notebooks.run_notebook(path, quick=True, build=build, html=False)
    return {"notebook": path.name, "ok": run.ok, "timed_out": run.timed_out, "seconds": run.seconds, "error": run.error}


def stress(repeats: int, jobs: int, root: Path) -> list[dict]:
    from anelab.core.parallel import threads_per_run

    todo = [(nb, str(root / f"{nb.stem}-{i}")) for i in range(repeats) for nb in widget_notebooks()]
    results = []
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(one_run, nb, build, threads_per_run(jobs)) for nb, build in todo]
        for done, future in enumerate(as_completed(futures), 1):
            r = future.result()
            results.append(r)
            state = "ok" if r["ok"] else ("HANG (timed out)" if r["timed_out"] else f"failed: {r['error']}")
            print(f"[{done}/{len(todo)}] {r['notebook']}: {state} in {r['seconds']:.1f} s", flush=True)
    return results


def table(results: list[dict]) -> str:
    lines = [f"{'notebook':<24} {'runs':>4} {'ok':>4} {'failed':>6} {'hangs':>5} {'median s':>8} {'max s':>6}"]
    for name in sorted({r["notebook"] for r in results}):
        rs = [r for r in results if r["notebook"] == name]
        secs = [r["seconds"] for r in rs]
        hangs = sum(r["timed_out"] for r in rs)
        failed = sum(not r["ok"] and not r["timed_out"] for r in rs)
        lines.append(
            f"{name:<24} {len(rs):>4} {sum(r['ok'] for r in rs):>4} {failed:>6} {hangs:>5} "
            f"{statistics.median(secs):>8.1f} {max(secs):>6.1f}"
        )
    return "\n".join(lines)


def screenshot(out: Path) -> str:
    """Render notebook 02's explore cell (executed headless) in Chromium with the vendored manager."""
    import nbformat

    from anelab.core.errors import AnelabInputError
    from anelab.publish import browser, widget_manager

    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    bundle, why_not = widget_manager.vendor(out)
    if bundle is None:
        return f"screenshot: widget manager not vendored ({why_not})"
    run = notebooks.run_notebook(notebooks.resolve_notebook("02"), quick=True, build=out / "build")
    nb = nbformat.read(str(run.executed), as_version=4)
    nb.cells = [c for c in nb.cells if "explore.show(" in c.source]  # the explore cell; widget state kept
    (out / "notebooks").mkdir(exist_ok=True)
    nbformat.write(nb, str(out / "explore.ipynb"))
    page = notebooks.export_html(out / "explore.ipynb", out / "notebooks" / "02_explore.html")
    full = out / "notebooks" / "02_mask_fold.html"
    shutil.copyfile(run.html, full)
    try:
        dom = browser.dump_dom(full)
        png = browser.screenshot(page, out / "02_explore.png", window=(1000, 700))
    except AnelabInputError as e:
        return f"screenshot: {e}"
    classes = ("widget-slider", "widget-html")  # elements carrying the class, not the CSS rules naming it
    rendered = [len(re.findall(rf'class="[^"]*\b{c}(?=[\s"])', dom)) for c in classes]
    return (
        f"screenshot: {png} ({png.stat().st_size} B); rendered DOM of the full page: "
        f"{rendered[0]} slider element(s), {rendered[1]} HTML widget element(s) (0 means the manager did not run)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="runs of each widget notebook (default 20)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks at once (default 1)")
    parser.add_argument("--quick", action="store_true", help="3 repeats (run_all.py passes it)")
    parser.add_argument("--screenshot", type=Path, default=None, help="also render notebook 02's widgets here")
    args, _ = parser.parse_known_args(argv)
    repeats = 3 if args.quick and args.repeats == 20 else args.repeats
    names = ", ".join(p.name for p in widget_notebooks())
    print(f"widget notebooks: {names}; {repeats} quick runs each, {args.jobs} at once")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="anelab-widget-stress-") as root:
        results = stress(repeats, args.jobs, Path(root))
    print(table(results))
    hangs = sum(r["timed_out"] for r in results)
    print(f"{len(results)} runs in {time.perf_counter() - started:.0f} s: {hangs} hang(s)")
    print(json.dumps({"runs": len(results), "hangs": hangs, "ok": sum(r["ok"] for r in results)}))
    if args.screenshot is not None:
        print(screenshot(args.screenshot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
