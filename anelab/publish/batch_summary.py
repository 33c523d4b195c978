"""The end of a batch: one table of every run's headline numbers (Markdown + CSV) and, per study,
one figure of a headline across the grid (mean with min-max spread over the other parameters).

Files go to ``<runs>/batch-<grid stem>/``: ``summary.md``, ``summary.csv`` and
``summary_<study>.png/.svg`` with their ``MANIFEST.json`` (``anelab.publish.figures.save_figure``).
They are derived from the run directories and rewritten by each batch.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from anelab.core.records import atomic_write_text
from anelab.publish import figures
from anelab.publish.studies import headlines_for, run_headlines, summary_plot

BASE_COLUMNS = ("study", "run_id", "status", "seconds", "parameters")


def summary_rows(results: dict[Path, dict]) -> list[dict]:
    """One row per run: study, run id, status (with the error of a failed run), seconds, the
    parameters as compact JSON, then the study's headline values (None when not recorded)."""
    rows = []
    for run_dir, result in results.items():
        study = result.get("study") or Path(run_dir).parent.name
        status = result.get("status", "failed")
        row = {
            "study": study,
            "run_id": Path(run_dir).name,
            "status": status if status == "ok" else f"failed: {result.get('error', '')}",
            "seconds": result.get("seconds"),
            "parameters": json.dumps(result.get("parameters", {}), sort_keys=True, separators=(",", ":")),
        }
        row.update(run_headlines(study, run_dir) if status == "ok" else {h.name: None for h in headlines_for(study)})
        rows.append(row)
    return rows


def _columns(rows: list[dict]) -> list[str]:
    columns = list(BASE_COLUMNS)
    for row in rows:
        columns += [k for k in row if k not in columns]
    return columns


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict]) -> str:
    """The rows as a GitHub Markdown table (missing values as "—")."""
    columns = _columns(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def csv_table(rows: list[dict]) -> str:
    """The rows as CSV (csv module; missing values empty, numbers at full precision)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=_columns(rows), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return buf.getvalue()


def _plot_points(rows: list[dict], study: str) -> tuple[str, str, dict[float, list[float]]] | None:
    if summary_plot(study) is None:
        return None
    x_name, y_name = summary_plot(study)
    points: dict[float, list[float]] = {}
    for row in rows:
        params = json.loads(row["parameters"])
        if row["study"] == study and row["status"] == "ok" and x_name in params and row.get(y_name) is not None:
            points.setdefault(params[x_name], []).append(row[y_name])
    return (x_name, y_name, points) if len(points) >= 2 else None  # one x value: the table says it all


def summary_figure(rows: list[dict], study: str, out_dir: str | os.PathLike, grid_name: str) -> Path | None:
    """``summary_<study>``: the declared headline against the declared parameter, each run a dot,
    mean and min-max spread over the grid's other parameters; None when the grid has fewer than two
    values of that parameter with results."""
    found = _plot_points(rows, study)
    if found is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_name, y_name, points = found
    headline = next(h for h in headlines_for(study) if h.name == y_name)
    xs = sorted(points)
    figures.use_style()
    fig, ax = plt.subplots(figsize=(5.6, 3.4))
    for x in xs:
        ax.plot([x] * len(points[x]), points[x], "o", color="grey", alpha=0.5, ms=4)
    means = [sum(points[x]) / len(points[x]) for x in xs]
    low = [m - min(points[x]) for m, x in zip(means, xs, strict=True)]
    high = [max(points[x]) - m for m, x in zip(means, xs, strict=True)]
    ax.errorbar(xs, means, yerr=[low, high], fmt="s-", capsize=3, label="mean, min-max over the other parameters")
    ax.set_xlabel(x_name)
    ax.set_ylabel(f"{y_name} ({headline.unit})")
    ax.set_title(f"{study}: {headline.label}")
    ax.legend()
    note = figures.label_measured(ax)
    runs = sum(len(v) for v in points.values())
    figures.save_figure(
        fig,
        f"summary_{study}",
        figures_dir=out_dir,
        notebook=f"{study}.ipynb",
        parameters={"grid": grid_name, "x": x_name, "y": y_name},
        provenance_note=note,
        caption=f"{headline.label} against {x_name} over {runs} runs of the grid {grid_name}; measured here.",
        alt=f"Dots per run and a line of the mean {y_name} with min-max bars at each {x_name} value.",
    )
    plt.close(fig)
    return Path(out_dir) / f"summary_{study}.png"


def write_summary(results: dict[Path, dict], out_dir: str | os.PathLike, grid_name: str) -> dict[str, Path]:
    """Write summary.md, summary.csv and the per-study figures; returns {what: path}."""

    out_dir = Path(out_dir)
    rows = summary_rows(results)
    written = {
        "markdown": atomic_write_text(out_dir / "summary.md", f"# batch {grid_name}\n\n" + markdown_table(rows)),
        "csv": atomic_write_text(out_dir / "summary.csv", csv_table(rows)),
    }
    for study in dict.fromkeys(r["study"] for r in rows):
        path = summary_figure(rows, study, out_dir, grid_name)
        if path is not None:
            written[f"figure {study}"] = path
    return written
