"""The recorded data in data/: every number against the seed's text, typed again here.

The expected values below were typed from shared/seeds/ane-prefill-research.txt independently of
data/_transcribe.py (which wrote the files). Each comparison helper has a negative control: a
record with one number changed must fail it.
"""

import copy
import importlib.util
import json
import math
from pathlib import Path

import pytest

from anelab.core.errors import AnelabInputError
from anelab.core.records import read_record, read_records, validate_record

DATA = Path(__file__).resolve().parents[2] / "data"
SEED_DOCUMENT = "shared/seeds/ane-prefill-research.txt"

# seed, "Offloading dense attention": Model, GPU s, ANE s, Ratio
SEED_MATRIX = {
    "qwen3.5-2b-4bit": (49.8, 36.0, 1.38),
    "qwen3.5-2b-8bit": (104.1, 91.6, 1.14),
    "qwen3.5-4b-4bit": (140.6, 102.2, 1.38),
    "qwen3.5-4b-8bit": (275.6, 218.1, 1.26),
    "qwen3.5-9b-4bit": (210.7, 168.2, 1.25),
    "qwen3.5-9b-8bit": (442.4, 392.9, 1.13),
    "agentworld-35b-a3b-4bit": (106.5, 63.3, 1.68),
    "qwen3.8-125b-a6b-4bit": (175.1, None, None),
}
SEED_CHUNK1024 = ("qwen3.5-2b-4bit", 2500, 1024, 23.33, 17.88, 1.30)
SEED_38 = {4: (197.5, 273.5, 0.72), 8: (428.3, 491.8, 0.87)}
SEED_38_LOADS = {0: 6.7, 4096: 13.6, 8192: 37.5}
SEED_38_ARENA_BYTES = {0: 805_306_368, 4096: 1_610_612_736, 8192: 2_415_919_104}  # 24*4096*(h+4096)*2
SEED_COMPOSITION = {"h0 alone": 6.68, "h0 beside h4096": 6.94, "h0 beside a variant that cannot load": 6.84}
SEED_H0 = (0.43, 0.65)  # ANE, CPU
SEED_GATHER = [  # chunk, graph, ANE ops, load s, predict s
    (32, "dense", 13, 0.133, 0.042),
    (32, "gather", 9, 0.186, 0.238),
    (64, "dense", 13, 0.144, 0.043),
    (64, "gather", 12, 2.883, None),
]
SEED_GATHER_PREDICT_RATIO = 5.70
SEED_GATHER_LOAD_RATIOS = {32: 1.4, 64: 20}
SEED_OPS_TOTAL = 173
SEED_MACHINE = {
    "machine_model": "Mac15,3",
    "chip": "Apple M3",
    "memory": "24 GB",
    "os_version": "macOS 27.0",
    "coremltools": "9.0",
}

EXPECTED_FILES = {
    "v5.5-ane-matrix-3.json",
    "ane-chunk1024-2b-4bit.json",
    "v5.6-ane-38-4bit.json",
    "v5.6-ane-38-8bit.json",
    "seed-38-variant-loads.json",
    "seed-38-package-composition-loads.json",
    "seed-38-h0-ane-vs-cpu.json",
    "seed-35b-setup-note.json",
    "ane-gather-probe.json",
    "seed-op-assignment-counts.json",
    "seed-qsa-fold-correctness.json",
}


def load(name: str) -> dict:
    return read_record(DATA / name)


def ab_rows(record: dict) -> dict:
    return {r["family"]: (r["gpu_seconds"], r["ane_seconds"], r["ratio"]) for r in record["results"]["rows"]}


def assert_ratio_recomputes(gpu: float, ane: float, ratio: float) -> None:
    """The printed 2-decimal ratio is GPU / ANE rounded to 2 decimals."""
    assert round(gpu / ane, 2) == pytest.approx(ratio, abs=1e-9), (gpu, ane, ratio)


def ratio_interval(num: float, den: float, half_unit: float) -> tuple[float, float]:
    """Range of num/den when both were rounded to +-half_unit."""
    return (num - half_unit) / (den + half_unit), (num + half_unit) / (den - half_unit)


# ---- every file -------------------------------------------------------------------------------
def test_every_expected_record_is_present_and_valid():
    present = {p.name for p in DATA.glob("*.json")}
    assert EXPECTED_FILES <= present, EXPECTED_FILES - present
    for rec in read_records(DATA):  # validates each one
        assert rec["origin"] == "recorded"


@pytest.mark.parametrize("name", sorted(EXPECTED_FILES))
def test_record_names_source_machine_and_unknowns(name):
    rec = load(name)
    assert rec["source"]["document"] == SEED_DOCUMENT
    assert rec["source"]["record"] and rec["source"]["section"]
    for key, value in SEED_MACHINE.items():
        assert rec["provenance"][key] == value, key
    assert rec["provenance"]["date"] == "unknown"  # the seed gives no date
    assert rec["provenance"]["python"] == "unknown"
    assert "record date" in rec["unknown"]


def test_a_record_without_its_source_is_refused():
    rec = copy.deepcopy(load("v5.5-ane-matrix-3.json"))
    rec["source"] = None
    with pytest.raises(AnelabInputError, match="source"):
        validate_record(rec, "negative control")


def test_files_match_the_transcription_script(tmp_path):
    """The committed JSON is exactly what data/_transcribe.py writes (no hand edits since)."""
    spec = importlib.util.spec_from_file_location("transcribe", DATA / "_transcribe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([str(tmp_path)]) == 0
    for name in EXPECTED_FILES:
        assert json.loads((tmp_path / name).read_text()) == json.loads((DATA / name).read_text()), name
    with pytest.raises(AnelabInputError, match="never overwritten"):
        module.main([str(tmp_path)])  # recorded data is written once


# ---- prefill A/B tables -----------------------------------------------------------------------
def test_dense_offload_matrix_equals_the_seed():
    rec = load("v5.5-ane-matrix-3.json")
    assert rec["source"]["record"] == "benchmark/ane-prefill/v5.5-ane-matrix-3.json"
    workload = rec["parameters"]["workload"]
    assert (workload["prompt_characters"], workload["prompt_tokens_approx"], workload["chunk"]) == (23000, 4333, 4096)
    assert (workload["measured_runs_per_arm"], workload["warmup_runs_per_arm"]) == (2, 1)
    assert ab_rows(rec) == SEED_MATRIX


def test_matrix_comparison_catches_a_changed_number():
    rec = copy.deepcopy(load("v5.5-ane-matrix-3.json"))
    rec["results"]["rows"][3]["ane_seconds"] = 218.2
    assert ab_rows(rec) != SEED_MATRIX


def test_chunk1024_and_qwen38_rows_equal_the_seed():
    family, tokens, chunk, gpu, ane, ratio = SEED_CHUNK1024
    rec = load("ane-chunk1024-2b-4bit.json")
    assert (rec["parameters"]["workload"]["prompt_tokens_approx"], rec["parameters"]["workload"]["chunk"]) == (
        tokens,
        chunk,
    )
    assert ab_rows(rec) == {family: (gpu, ane, ratio)}
    for bits, expected in SEED_38.items():
        rec = load(f"v5.6-ane-38-{bits}bit.json")
        assert rec["source"]["record"] == f"v5.6-ane-38-{bits}bit.json"
        assert ab_rows(rec) == {f"qwen3.8-125b-a6b-{bits}bit": expected}


def test_every_ab_ratio_recomputes_from_its_seconds():
    checked = 0
    for rec in read_records(DATA, kind="prefill_ab"):
        for gpu, ane, ratio in ab_rows(rec).values():
            if ane is None:
                assert ratio is None
                continue
            assert_ratio_recomputes(gpu, ane, ratio)
            checked += 1
    assert checked == 10  # 7 dense-offload rows, the chunk-1024 point, two 3.8 rows


def test_ratio_check_fails_on_a_wrong_ratio():
    with pytest.raises(AssertionError):
        assert_ratio_recomputes(49.8, 36.0, 1.39)
    with pytest.raises(AssertionError):
        assert_ratio_recomputes(197.5, 273.5, 0.87)  # the 8-bit ratio on the 4-bit seconds


# ---- loads, predictions, probes ---------------------------------------------------------------
def test_variant_loads_equal_the_seed_and_their_arenas():
    rec = load("seed-38-variant-loads.json")
    assert (rec["parameters"]["chunk"], rec["parameters"]["heads"]) == (4096, 24)
    assert {x["history"]: x["seconds"] for x in rec["results"]["loads"]} == SEED_38_LOADS
    assert {int(k): v for k, v in rec["results"]["derived"]["score_arena_bytes"].items()} == SEED_38_ARENA_BYTES
    # 24 variants = 12 layers x (h0 + h4096): the seed's "24 variant loads ~ 245 s"
    assert 12 * (SEED_38_LOADS[0] + SEED_38_LOADS[4096]) == pytest.approx(245, rel=0.01)


def test_package_composition_loads_and_h0_prediction_equal_the_seed():
    rec = load("seed-38-package-composition-loads.json")
    assert {x["package"]: x["seconds"] for x in rec["results"]["loads"]} == SEED_COMPOSITION
    rec = load("seed-38-h0-ane-vs-cpu.json")
    assert (rec["results"]["ane_seconds"], rec["results"]["cpu_seconds"]) == SEED_H0
    assert rec["results"]["comparison"]["factor"] == 26.7
    assert rec["results"]["derived"]["cpu_over_ane"] == round(SEED_H0[1] / SEED_H0[0], 2)
    assert load("seed-35b-setup-note.json")["results"]["seconds_per_layer_chunk_approx"] == 0.5


def test_gather_probe_equals_the_seed_and_its_ratios_fit_the_rounding():
    rec = load("ane-gather-probe.json")
    rows = [
        (r["chunk"], r["graph"], r["ane_ops"], r["load_seconds"], r["predict_seconds"]) for r in rec["results"]["rows"]
    ]
    assert rows == SEED_GATHER
    assert rec["results"]["rows"][1]["predict_over_dense"] == SEED_GATHER_PREDICT_RATIO
    assert rec["results"]["rows"][3]["predict"] == "fails"
    # 5.70x is not 0.238/0.042 = 5.67, but lies within what the 3-decimal seconds allow
    low, high = ratio_interval(0.238, 0.042, 0.0005)
    assert low <= SEED_GATHER_PREDICT_RATIO <= high
    assert not low <= 6.0 <= high  # negative control: a ratio the seconds cannot give
    for chunk, ratio in SEED_GATHER_LOAD_RATIOS.items():
        dense = next(r for r in SEED_GATHER if r[:2] == (chunk, "dense"))
        gather = next(r for r in SEED_GATHER if r[:2] == (chunk, "gather"))
        assert rec["results"]["load_over_dense"][str(chunk)] == ratio
        assert gather[3] / dense[3] == pytest.approx(ratio, rel=0.05)
    sizing = rec["results"]["sizing_at_chunk_4096"]
    assert (sizing["gathered_keys_gb"], sizing["dense_score_matrix_gb"], sizing["data_factor"]) == (103, 1.6, 64)


def test_op_assignment_counts_equal_the_seed():
    rec = load("seed-op-assignment-counts.json")
    rows = rec["results"]["rows"]
    assert all(r["total_ops"] == SEED_OPS_TOTAL for r in rows)
    h12288 = next(r for r in rows if r["variant"] == "h12288")
    assert h12288["ane_ops"] == 0
    healthy = next(r for r in rows if r["family"] == "healthy variants")
    assert (healthy["ane_ops_min"], healthy["ane_ops_max"]) == (64, 74)
    two_b = {r["variant"].split(" ")[0]: r["ane_ops"] for r in rows if r["family"] == "qwen3.5-2b"}
    assert two_b == {"standalone": 74, "same": 0}
    assert rec["results"]["h12288_score_arena_gb"] == 3.2
    assert rec["results"]["practical_cap"] == {"max_history": 8192, "coverage": 12288, "family": "qwen3.8-125b-a6b"}
    assert rec["results"]["cpu_fallback_cost_vs_gpu_approx"] == 38
    # the 3.2 GB arena is the 24-head fp16 score matrix at h12288
    assert math.isclose(24 * 4096 * (12288 + 4096) * 2 / 1e9, 3.2, rel_tol=0.01)


def test_fold_correctness_equals_the_seed():
    rows = load("seed-qsa-fold-correctness.json")["results"]["rows"]
    assert rows[0]["relative_error_percent"] == 0.47
    assert (rows[1]["moved_percent"], rows[1]["off_percent"], rows[1]["over_fp16_noise"]) == (7.6, 7.9, 16)
    assert rows[2]["result"] == "textually identical"
    assert (rows[3]["apart_percent_min"], rows[3]["apart_percent_max"]) == (13.6, 17.8)
    assert (rows[4]["l3_after_moved_percent"], rows[4]["logits_moved_percent"]) == (10.2, 69)
    assert load("seed-qsa-fold-correctness.json")["results"]["layer_diff"] == {
        "dense_2b_ane_vs_gpu_l3_after_percent": 0.94
    }
