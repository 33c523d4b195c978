"""The backtest: each recorded A/B row against the planner's prediction, in-sample and leave-one-family-out.

For every recorded row with both arms (the nine at 4,333 tokens and the chunk-1,024 2B row), the ANE
arm is predicted from the row's recorded GPU seconds (as a user's ``--gpu-prefill-seconds``) and the
fitted costs (``planner.fit``), two ways:

- ``in_sample``: the fit saw every record;
- ``leave_one_family_out``: the fit saw none of the row's *model* (both precisions and every
  workload of it: its A/B rows and its load records). What it keeps: the ANE rate per score entry
  (one recorded prediction of Qwen 3.8's h0: held out with the 3.8 it would leave no ANE rate) and
  TinyTitan's reload note (the runtime's, not a family's). Held out, the 3.8 leaves no sparse rows:
  its gather is priced at the dense rate per entry, and its specialization by the 35B's total alone.

Every row is planned under the default protocol ("machine", ``planner.loads``), which puts Qwen 3.8's
specializations in its arm (its visited arenas exceed the M3's memory) and only reloads elsewhere.
All numbers are the seed's recorded times and fits on them; nothing here is a fresh measurement.
"""

from __future__ import annotations

from pathlib import Path

from anelab.planner.catalogue import FAMILIES
from anelab.planner.fit import cached_fit, ratio_under, timed_ab_rows

PROVENANCE = (
    "recorded A/B times (seed 000, Apple M3, TinyTitan) against costs fitted on the records; replayed, not measured"
)


def side(ratio: float) -> str:
    return "ane" if ratio > 1.0 else "gpu"


def backtest(data_dir: str | Path | None = None) -> list[dict]:
    """One dict per recorded row: recorded, in-sample and leave-one-family-out ratios, their errors and sides."""
    directory, fit, rows = timed_ab_rows(data_dir)
    out = []
    for row in rows:
        model = FAMILIES[row.family].model
        recorded = row.gpu_seconds / row.ane_seconds
        r_in, r_out = ratio_under(row, fit), ratio_under(row, cached_fit(directory, None, model))
        out.append(
            {
                **row.identity(),
                "recorded_side": side(recorded),
                "in_sample_ratio": r_in,
                "in_sample_error": r_in / recorded - 1,
                "leave_one_family_out_ratio": r_out,
                "leave_one_family_out_error": r_out / recorded - 1,
                "held_out": model,
                "in_sample_side": side(r_in),
                "leave_one_family_out_side": side(r_out),
            }
        )
    return out


def format_backtest(rows: list[dict]) -> str:
    """The backtest as a text table, with its provenance."""
    out = [
        f"backtest ({PROVENANCE})",
        f"{'family':<26} {'tokens':>6} {'chunk':>5} {'recorded':>8} {'in-sample':>9} {'err':>6} "
        f"{'held out':>8} {'err':>6}  side (recorded / in / out)",
    ]
    for r in rows:
        out.append(
            f"{r['family']:<26} {r['prompt_tokens']:>6} {r['chunk']:>5} {r['recorded_ratio']:>7.2f}x "
            f"{r['in_sample_ratio']:>8.2f}x {r['in_sample_error']:>+6.1%} {r['leave_one_family_out_ratio']:>7.2f}x "
            f"{r['leave_one_family_out_error']:>+6.1%}  {r['recorded_side']} / {r['in_sample_side']} / "
            f"{r['leave_one_family_out_side']}"
        )
    worst_in = max(abs(r["in_sample_error"]) for r in rows)
    worst_out = max(abs(r["leave_one_family_out_error"]) for r in rows)
    agree = sum(r["recorded_side"] == r["in_sample_side"] == r["leave_one_family_out_side"] for r in rows)
    out.append(f"{agree}/{len(rows)} rows on the recorded side both ways; worst |error| {worst_in:.1%} in-sample, "
               f"{worst_out:.1%} held out")  # fmt: skip
    return "\n".join(out)
