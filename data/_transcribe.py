"""Transcribe the seed's measured tables into ``anelab.core.records`` JSON files (run once).

Usage: ``.venv/bin/python data/_transcribe.py [OUT_DIR]`` (default: this folder). Every file is
written with ``write_record``, which refuses to overwrite: recorded data is written once. The
numbers below were typed from ``shared/seeds/ane-prefill-research.txt`` (the ANE prefill research
page, measured on an M3 by its author — not by anelab); ``tests/test_data_records.py`` checks the
committed files against the same numbers typed again, independently of this script.

Conventions:
- ``ratio`` is GPU seconds / ANE seconds as the seed prints it (2 decimals): above 1, the ANE
  arm was faster.
- Anything the seed does not state is ``"unknown"`` in provenance and listed in ``unknown``.
- Values computed here from the seed's numbers (not printed by it) sit under ``results["derived"]``
  with the formula in ``results["derived"]["note"]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from anelab.core.records import make_record, write_record

SEED = "shared/seeds/ane-prefill-research.txt"
FP16_BYTES = 2
HEADS_38 = 24  # the seed: "the 24-head h12288 variant"

PROVENANCE = {
    "machine_model": "Mac15,3",
    "chip": "Apple M3",
    "memory": "24 GB",
    "os_version": "macOS 27.0",
    "swift": "6.4",
    "python": "unknown",
    "coremltools": "9.0",
    "numpy": "unknown",
    "anelab": "n/a (recorded from source)",
    "git_revision": "n/a (recorded from source)",
    "date": "unknown",
}

WORKLOAD_4333 = {
    "prompt_characters": 23000,
    "prompt_tokens_approx": 4333,
    "chunk": 4096,
    "measured_runs_per_arm": 2,
    "warmup_runs_per_arm": 1,
}

COMMON_UNKNOWN = [
    "record date",
    "python and numpy versions of the measuring environment",
]
AB_UNKNOWN = COMMON_UNKNOWN + [
    "whether each time is the mean, median or minimum of the measured runs",
    "run-to-run spread of the measured runs",
    "whether the ANE arm's time includes loading the sidecar variants (setup)",
    "exact prompt token count (the seed says ~4,333)",
]


def _source(record: str, section: str) -> dict:
    return {"document": SEED, "record": record, "section": section}


def _arena(history: int, chunk: int = 4096, heads: int = HEADS_38) -> int:
    return heads * chunk * (history + chunk) * FP16_BYTES


def records() -> dict[str, dict]:
    """All transcribed records, keyed by file name."""
    out: dict[str, dict] = {}

    def rec(name, kind, parameters, results, source, unknown):
        out[name] = make_record(kind, parameters, results, origin="recorded", provenance_override=dict(PROVENANCE),
                                source=source, unknown=unknown)

    matrix_rows = [
        ("Qwen 3.5 2B 4-bit", "qwen3.5-2b-4bit", 49.8, 36.0, 1.38),
        ("Qwen 3.5 2B 8-bit", "qwen3.5-2b-8bit", 104.1, 91.6, 1.14),
        ("Qwen 3.5 4B 4-bit", "qwen3.5-4b-4bit", 140.6, 102.2, 1.38),
        ("Qwen 3.5 4B 8-bit", "qwen3.5-4b-8bit", 275.6, 218.1, 1.26),
        ("Qwen 3.5 9B 4-bit", "qwen3.5-9b-4bit", 210.7, 168.2, 1.25),
        ("Qwen 3.5 9B 8-bit", "qwen3.5-9b-8bit", 442.4, 392.9, 1.13),
        ("AgentWorld 35B-A3B 4-bit", "agentworld-35b-a3b-4bit", 106.5, 63.3, 1.68),
        ("Qwen 3.8 125B-A6B 4-bit", "qwen3.8-125b-a6b-4bit", 175.1, None, None),
    ]
    rec(
        "v5.5-ane-matrix-3.json", "prefill_ab",
        {"workload": dict(WORKLOAD_4333), "arms": ["gpu", "ane"], "benchmark": "benchmark/ane_prefill_ab_matrix.py"},
        {"rows": [{"model": m, "family": f, "gpu_seconds": g, "ane_seconds": a, "ratio": r,
                   **({"note": "ANE arm not in this record; see v5.6-ane-38-4bit.json"} if a is None else {})}
                  for m, f, g, a, r in matrix_rows]},
        _source("benchmark/ane-prefill/v5.5-ane-matrix-3.json", "What worked / 1. Offloading dense attention"),
        AB_UNKNOWN + ["the Qwen 3.8 4-bit ANE arm (the table prints '—', see below)"],
    )
    rec(
        "ane-chunk1024-2b-4bit.json", "prefill_ab",
        {"workload": {"prompt_tokens_approx": 2500, "chunk": 1024}, "arms": ["gpu", "ane"]},
        {"rows": [{"model": "Qwen 3.5 2B 4-bit", "family": "qwen3.5-2b-4bit", "gpu_seconds": 23.33,
                   "ane_seconds": 17.88, "ratio": 1.30}]},
        _source("ane-chunk1024-2b-4bit.json", "What worked / 1. Offloading dense attention (narrower sidecar)"),
        AB_UNKNOWN[:-1] + [
            "exact prompt token count and characters (the seed says ~2,500 tokens)",
            "number of measured and warm-up runs for this record",
            "the sidecar's histories (max-history) for chunk 1024",
        ],
    )
    for bits, gpu, ane, ratio in ((4, 197.5, 273.5, 0.72), (8, 428.3, 491.8, 0.87)):
        rec(
            f"v5.6-ane-38-{bits}bit.json", "prefill_ab",
            {"workload": {"prompt_tokens_approx": 4333, "chunk": 4096,
                          "note": "workload inferred from the section text ('At 4,333 tokens'); not printed with the table"},
             "arms": ["gpu", "ane"]},
            {"rows": [{"model": f"Qwen 3.8 125B-A6B {bits}-bit", "family": f"qwen3.8-125b-a6b-{bits}bit",
                       "gpu_seconds": gpu, "ane_seconds": ane, "ratio": ratio}]},
            _source(f"v5.6-ane-38-{bits}bit.json", "What didn't / 1. Qwen 3.8: the ANE loses"),
            AB_UNKNOWN + ["prompt characters, measured and warm-up runs for this record"]
            + (["why the GPU arm (197.5 s) differs from v5.5-ane-matrix-3.json's 175.1 s for the same model; "
                "the seed's '~185 s GPU prefill' lies between the two"] if bits == 4 else []),
        )
    rec(
        "seed-38-variant-loads.json", "load_timing",
        {"family": "qwen3.8-125b-a6b", "chunk": 4096, "heads": HEADS_38, "api": "MLModel(contentsOf:)",
         "what": "one sidecar function (variant) loaded per history"},
        {"loads": [{"history": 0, "seconds": 6.7}, {"history": 4096, "seconds": 13.6},
                   {"history": 8192, "seconds": 37.5}],
         "comparison": {"text": "~0.5 s per layer-chunk the runtime's own note records for the 35B",
                        "see": "seed-35b-setup-note.json"},
         "derived": {"score_arena_bytes": {"0": _arena(0), "4096": _arena(4096), "8192": _arena(8192)},
                     "note": "heads * chunk * (history + chunk) * 2 bytes (fp16), heads = 24 from the seed"}},
        _source("not named in the seed (text of 'What didn't / 1. Qwen 3.8', per-variant setup)",
                "What didn't / 1. Qwen 3.8: Per-variant setup dominates"),
        COMMON_UNKNOWN + [
            "weight precision of the measured 3.8 sidecar (4-bit or 8-bit model)",
            "number of repeats and whether the times are cold or warm loads",
            "which function was the package's default when each was loaded",
        ],
    )
    rec(
        "seed-38-package-composition-loads.json", "load_timing",
        {"family": "qwen3.8-125b-a6b", "chunk": 4096, "function": "h0", "api": "MLModel(contentsOf:)"},
        {"loads": [
            {"package": "h0 alone", "seconds": 6.68},
            {"package": "h0 beside h4096", "seconds": 6.94},
            {"package": "h0 beside a variant that cannot load", "seconds": 6.84},
        ], "conclusion": "the load tracks the function's score arena, not the package composition"},
        _source("not named in the seed (text of 'What didn't / 1. Qwen 3.8', package compositions)",
                "What didn't / 1. Qwen 3.8: The load tracks the score arena, not the package"),
        COMMON_UNKNOWN + ["number of repeats", "which variant could not load"],
    )
    rec(
        "seed-38-h0-ane-vs-cpu.json", "predict_timing",
        {"family": "qwen3.8-125b-a6b", "function": "h0", "chunk": 4096, "history": 0, "heads": HEADS_38,
         "what": "one prediction of one layer's sidecar (one layer-chunk)"},
        {"ane_seconds": 0.43, "cpu_seconds": 0.65,
         "comparison": {"text": "the 35B's blocks measured 26.7x the GPU's cost (recorded in the v4.5 design note)",
                        "factor": 26.7},
         "derived": {"cpu_over_ane": round(0.65 / 0.43, 2), "note": "cpu_seconds / ane_seconds"}},
        _source("not named in the seed (text of 'What didn't / 1. Qwen 3.8', per-FLOP edge)",
                "What didn't / 1. Qwen 3.8: The ANE's per-FLOP edge on this graph is small"),
        COMMON_UNKNOWN + [
            "number of repeats",
            "the GPU's time for the same layer-chunk",
            "what the 35B's 26.7x compares (which device's cost over which) — the sentence is ambiguous",
        ],
    )
    rec(
        "seed-35b-setup-note.json", "load_timing",
        {"family": "agentworld-35b-a3b-4bit", "what": "per layer-chunk setup, from the runtime's own note"},
        {"seconds_per_layer_chunk_approx": 0.5},
        _source("not named in the seed (the runtime's own note, quoted in 'What didn't / 1. Qwen 3.8')",
                "What didn't / 1. Qwen 3.8: Per-variant setup dominates"),
        COMMON_UNKNOWN + ["whether 0.5 s is a measurement or an estimate", "which histories it covers",
                          "chunk and heads of the 35B's sidecar"],
    )
    rec(
        "ane-gather-probe.json", "gather_probe",
        {"benchmark": "benchmark/ane_gather_probe.py --chunk 32 --repeats 3",
         "sizing_document": "docs/ane-gather-graph-sizing.md", "what": "dense vs gather graph at probe-sized chunks"},
        {"rows": [
            {"chunk": 32, "graph": "dense", "ane_ops": 13, "load_seconds": 0.133, "predict_seconds": 0.042},
            {"chunk": 32, "graph": "gather", "ane_ops": 9, "load_seconds": 0.186, "predict_seconds": 0.238,
             "predict_over_dense": 5.70},
            {"chunk": 64, "graph": "dense", "ane_ops": 13, "load_seconds": 0.144, "predict_seconds": 0.043},
            {"chunk": 64, "graph": "gather", "ane_ops": 12, "load_seconds": 2.883, "predict_seconds": None,
             "predict": "fails"},
        ],
         "load_over_dense": {"32": 1.4, "64": 20},
         "sizing_at_chunk_4096": {"gathered_keys_gb": 103, "dense_score_matrix_gb": 1.6, "data_factor": 64,
                                  "gathered_keys_at_predict_failure_gb": 1.6},
         "derived": {"note": "0.238 / 0.042 = 5.67 from the rounded seconds; the seed prints 5.70x, "
                             "presumably from unrounded times"}},
        _source("benchmark/ane_gather_probe.py output and docs/ane-gather-graph-sizing.md",
                "What didn't / 2. The gather graph: sized, rejected"),
        COMMON_UNKNOWN + ["the probe's heads, head_dim and budget", "the unrounded timings",
                          "the error message when the chunk-64 gather predict fails"],
    )
    rec(
        "seed-op-assignment-counts.json", "op_assignment",
        {"api": "MLComputePlan per-operation device assignment", "total_ops": 173},
        {"rows": [
            {"family": "qwen3.8-125b-a6b", "variant": "h12288", "ane_ops": 0, "total_ops": 173,
             "note": "silent CPU fallback; needs a 3.2 GB arena; refused at export"},
            {"family": "healthy variants", "variant": "various", "ane_ops_min": 64, "ane_ops_max": 74,
             "total_ops": 173},
            {"family": "qwen3.5-2b", "variant": "standalone (default function)", "ane_ops": 74, "total_ops": 173},
            {"family": "qwen3.5-2b", "variant": "same graph as a non-default function of the merge", "ane_ops": 0,
             "total_ops": 173, "note": "the compute plan reports assignments only for the default function"},
        ],
         "cpu_fallback_cost_vs_gpu_approx": 38,
         "h12288_score_arena_gb": 3.2,
         "practical_cap": {"max_history": 8192, "coverage": 12288, "family": "qwen3.8-125b-a6b"}},
        _source("not named in the seed (issue #7 text, 'Making verified mean something')",
                "What worked / 3. Making 'verified' mean something; What didn't / 3. Wide coverage"),
        COMMON_UNKNOWN + ["which healthy variants gave 64 and which 74", "chip-specific: other chips may differ"],
    )
    rec(
        "seed-qsa-fold-correctness.json", "correctness",
        {"family": "qwen3.8-125b-a6b", "what": "sparse-indexer selection folded into the additive mask (-30000)",
         "dense_visible_keys": 2051, "qsa_budget": 2048},
        {"rows": [
            {"check": "graph vs NumPy reference under a QSA-shaped mask, both widths", "relative_error_percent": 0.47},
            {"check": "causal-only mask against the same reference", "moved_percent": 7.6, "off_percent": 7.9,
             "over_fp16_noise": 16},
            {"check": "32-token greedy continuation, folded vs GPU", "result": "textually identical"},
            {"check": "causal control's prefill_logits vs the folded arm", "apart_percent_min": 13.6, "apart_percent_max": 17.8},
            {"check": "QSA budget 2,048 -> 8, folded arm", "l3_after_moved_percent": 10.2, "logits_moved_percent": 69},
        ],
         "layer_diff": {"dense_2b_ane_vs_gpu_l3_after_percent": 0.94}},
        _source("not named in the seed (correctness table of 'Folding a sparse indexer's selection')",
                "What worked / 2. Folding a sparse indexer's selection into the mask"),
        COMMON_UNKNOWN + ["the norm used for 'relative error' and 'moved'", "prompt of the correctness runs"],
    )
    return out


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0]) if argv else Path(__file__).resolve().parent
    for name, record in records().items():
        print(write_record(out_dir, record, name=name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
