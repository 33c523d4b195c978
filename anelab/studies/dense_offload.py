"""Study 1's back-end: recorded A/B rows, offload shares, ratio sweeps (the fresh block A/B is ``runtimes.coreml.block_ab``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.paths import DATA_DIR
from anelab.core.records import read_records
from anelab.planner.backtest import PROVENANCE, backtest
from anelab.planner.catalogue import REFERENCE_CHUNK, REFERENCE_TOKENS, get_family
from anelab.planner.chip_map import family_verdict_map
from anelab.planner.chips import SEED_CHIP, get_chip, plan_bounds
from anelab.planner.gpu_runtimes import modelled_runtimes
from anelab.planner.mlx_lm_rates import fit_mlx_lm
from anelab.planner.plan import plan


# ---- recorded rows ------------------------------------------------------------------------------
def recorded_ab_rows(data_dir: str | os.PathLike | None = None) -> list[dict]:
    """Every recorded GPU-vs-ANE prefill row (records of kind ``prefill_ab``), one dict each.

    Keys: record (file name), family, model, bits (4 or 8), prompt_tokens, chunk, gpu_seconds,
    ane_seconds (None where the ANE arm was not recorded), ratio (as recorded, GPU / ANE).
    """
    rows = []
    for rec in read_records(Path(data_dir or DATA_DIR), kind="prefill_ab"):
        workload = rec["parameters"]["workload"]
        for r in rec["results"]["rows"]:
            rows.append(
                {
                    "record": rec["_file"],
                    "family": r["family"],
                    "model": r["model"],
                    "bits": int(r["family"].rsplit("-", 1)[1].removesuffix("bit")),
                    "prompt_tokens": workload["prompt_tokens_approx"],
                    "chunk": workload["chunk"],
                    "gpu_seconds": r["gpu_seconds"],
                    "ane_seconds": r["ane_seconds"],
                    "ratio": r["ratio"],
                }
            )
    if not rows:
        raise AnelabInputError(f"no prefill_ab records in {data_dir or DATA_DIR}; restore data/v5.5-ane-matrix-3.json")
    return rows


# ---- explanation 1: the full-attention share ----------------------------------------------------
def amdahl_ratio(share: float, speedup: float) -> float:
    """Prefill ratio when a ``share`` of the GPU prefill runs ``speedup`` times faster (Amdahl's law).

    ``1 / ((1 - share) + share / speedup)``; ``speedup`` counts the setup against the offloaded part.
    """
    if not 0.0 <= share <= 1.0:
        raise AnelabInputError(f"share must lie in [0, 1], got {share}")
    if not speedup > 0:
        raise AnelabInputError(f"speedup must be positive, got {speedup}")
    return 1.0 / ((1.0 - share) + share / speedup)


def offload_shares(data_dir: str | os.PathLike | None = None) -> list[dict]:
    """Each family with a recorded ANE arm at the seed's workload, with its two full-attention shares.

    - ``layer_share``: offloaded (full-attention) layers / all layers — the seed's "10 of 40", "6 of 24";
    - ``time_share``: the planner's offloaded GPU attention seconds / GPU prefill seconds at the
      reference prompt (4,333 tokens, chunk 4,096) — inferred by the fit, not measured;
    - ``speedup``: offloaded GPU attention / (ANE attention + setup) — the offloaded part's speed-up;
    - ``predicted_ratio`` (= ``amdahl_ratio(time_share, speedup)``) and ``recorded_ratio``.
    """
    out = []
    for row in recorded_ab_rows(data_dir):
        if row["ane_seconds"] is None or (row["prompt_tokens"], row["chunk"]) != (REFERENCE_TOKENS, REFERENCE_CHUNK):
            continue
        family = get_family(row["family"])
        p = plan(REFERENCE_TOKENS, family=row["family"], chunk=REFERENCE_CHUNK, data_dir=data_dir)
        offloaded = p.gpu_attention_seconds  # every chunk of the reference prompt runs on the ANE
        g = family.geometry
        out.append(
            {
                "family": row["family"],
                "model": row["model"],
                "bits": row["bits"],
                "record": row["record"],
                "layers": g.num_layers,
                "full_attention_layers": len(g.full_attention_layers),
                "layer_share": len(g.full_attention_layers) / g.num_layers,
                "time_share": offloaded / p.gpu_prefill_seconds,
                "speedup": offloaded / (p.ane_attention_seconds + p.setup_seconds),
                "predicted_ratio": p.predicted_ratio,
                "recorded_ratio": row["ratio"],
            }
        )
    return out


# ---- explanation 2: the prompt length -----------------------------------------------------------
SWEEP_KEYS = (
    "predicted_ratio",
    "decision",
    "fits",
    "variants_visited",
    "setup_seconds",
    "attention_saved_seconds",
    "gpu_attention_seconds",
    "ane_attention_seconds",
    "non_attention_seconds",
    "gpu_prefill_seconds",
    "ane_prefill_seconds",
    "coverage",
)


def ratio_sweep(family: str | None, prompt_tokens: Sequence[int], **plan_args) -> list[dict]:
    """The planner at each prompt length: one dict per length with ``prompt_tokens``, ``chunk`` and ``SWEEP_KEYS``.

    ``plan_args`` go to :func:`anelab.planner.plan` (chunk, histories, costs, geometry overrides). A
    prompt past coverage is not refused here: it is planned with ``allow_past_coverage`` (``fits``
    False, everything on the GPU, ratio 1).
    """
    tokens = list(prompt_tokens)
    if not tokens:
        raise AnelabInputError("ratio_sweep needs at least one prompt length")
    rows = []
    for n in tokens:
        p = plan(int(n), family=family, allow_past_coverage=True, **plan_args)
        rows.append({"prompt_tokens": p.prompt_tokens, "chunk": p.chunk, **{k: getattr(p, k) for k in SWEEP_KEYS}})
    return rows


def backtest_and_bound(
    prompt_tokens: Sequence[int], *, family: str = "qwen3.5-2b-4bit", chip: str = "M3", data_dir=None
) -> dict:
    """What notebook 01's backtest figure draws: every recorded A/B row against the planner's ratio in
    sample and with its family held out (``planner.backtest``), and ``family``'s two planned arms at each
    prompt length beside the fastest ``chip`` could run them (``planner.chips``). Numbers are the seed's
    records and fits on them (``provenance``), never fresh measurements."""

    rows = backtest(data_dir)
    bounds = []
    for n in prompt_tokens:
        p = plan(int(n), family=family, data_dir=data_dir, allow_past_coverage=True).to_dict()
        b = plan_bounds(p, chip)
        bounds.append({"prompt_tokens": int(n), **{k: b[k] for k in ("gpu_seconds", "ane_seconds", "bound")},
                       "estimate_gpu_seconds": b["estimate_gpu_seconds"],
                       "estimate_ane_seconds": b["estimate_ane_seconds"]})  # fmt: skip
    off_side = [r for r in rows if not r["recorded_side"] == r["in_sample_side"] == r["leave_one_family_out_side"]]
    return {"rows": rows, "bounds": bounds, "family": family, "chip": get_chip(chip).name,
            "rows_off_side": len(off_side), "provenance": PROVENANCE}  # fmt: skip


def gpu_runtime_arms(prompt_tokens: Sequence[int], *, family: str = "qwen3.5-2b-4bit", chip: str = "M3",
                     data_dir=None) -> dict:  # fmt: skip
    """What notebook 01's runtime figure draws: ``family``'s GPU arm on TinyTitan's recorded path and on mlx-lm
    (``planner.mlx_lm_rates``, on ``chip``), each beside the ANE arm planned against it (the ANE's costs are the
    recorded ones either way), and the public mlx-lm records' fraction of peak. Seconds per prompt length."""

    rows = []
    for n in prompt_tokens:
        row = {"prompt_tokens": int(n)}
        for runtime in modelled_runtimes():
            p = plan(int(n), family=family, data_dir=data_dir, allow_past_coverage=True, gpu_runtime=runtime,
                     chip=chip)  # fmt: skip
            row[runtime] = {"gpu_seconds": p.gpu_prefill_seconds, "ane_seconds": p.ane_prefill_seconds,
                            "ratio": p.predicted_ratio, "decision": p.decision}  # fmt: skip
        rows.append(row)
    fit = fit_mlx_lm()
    return {"rows": rows, "family": family, "chip": get_chip(chip).name, "mlx_lm": fit.to_dict()}


def chip_verdict_maps(prompt_tokens: Sequence[int], *, family: str = "qwen3.5-2b-4bit", data_dir=None) -> dict:
    """What notebook 01's chip figure draws: ``family``'s verdict map (chip x prompt length -> ratio and verdict,
    ``planner.chip_map``) against each GPU runtime the planner prices, the seed's M3 row marked, and counts of
    what it shows (chips priced, chips whose row names a missing figure, prompts the ANE wins)."""

    maps = {r: family_verdict_map(family, prompt_tokens, gpu_runtime=r, mark=SEED_CHIP, data_dir=data_dir)
            for r in modelled_runtimes()}  # fmt: skip
    facts = {}
    for runtime, m in maps.items():
        priced = [r for r in m["rows"] if not r["refused"]]
        facts[runtime] = {"chips_priced": len(priced), "chips_refused": len(m["rows"]) - len(priced),
                          "ane_cells": sum(c["decision"] == "ane" for r in priced for c in r["cells"]),
                          "chips_with_an_ane_cell": sum(any(c["decision"] == "ane" for c in r["cells"]) for r in priced)}  # fmt: skip
    return {"family": family, "maps": maps, "facts": facts}
