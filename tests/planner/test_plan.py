"""The prefill planner: chunk and variant enumeration, the cost arithmetic, the seed's verdicts.

Expected values are hand-computed from the module's documented cost model or typed from the seed
(shared/seeds/ane-prefill-research.txt); each check has a negative control.
"""

import json

import pytest

from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.planner.catalogue import FAMILIES, chunk_schedule
from anelab.planner.fit import fit_load_power
from anelab.planner.plan import plan, predicted_vs_recorded

DENSE_FAMILIES = [
    "qwen3.5-2b-4bit",
    "qwen3.5-2b-8bit",
    "qwen3.5-4b-4bit",
    "qwen3.5-4b-8bit",
    "qwen3.5-9b-4bit",
    "qwen3.5-9b-8bit",
    "agentworld-35b-a3b-4bit",
]
SPARSE_FAMILIES = ["qwen3.8-125b-a6b-4bit", "qwen3.8-125b-a6b-8bit"]
SEED_TOKENS, SEED_CHUNK = 4333, 4096
SEED_SETUP_38 = 245.0  # "24 variant loads ~ 245 s"
SEED_GPU_PREFILL_38 = 185.0  # "against a ~185 s GPU prefill"
SEED_GPU_38_RECORDED = (175.1, 197.5)  # v5.5 matrix and v5.6 record, same model
SEED_LOADS_38 = {0: 6.7, 4096: 13.6, 8192: 37.5}
SEED_38_ROWS = {4: (197.5, 273.5), 8: (428.3, 491.8)}
SEED_H0_ANE = 0.43
SEED_RATIOS = {
    ("qwen3.5-2b-4bit", 4096): 1.38,
    ("qwen3.5-2b-4bit", 1024): 1.30,
    ("qwen3.5-2b-8bit", 4096): 1.14,
    ("qwen3.5-4b-4bit", 4096): 1.38,
    ("qwen3.5-4b-8bit", 4096): 1.26,
    ("qwen3.5-9b-4bit", 4096): 1.25,
    ("qwen3.5-9b-8bit", 4096): 1.13,
    ("agentworld-35b-a3b-4bit", 4096): 1.68,
    ("qwen3.8-125b-a6b-4bit", 4096): 0.72,
    ("qwen3.8-125b-a6b-8bit", 4096): 0.87,
}
IN_SAMPLE_TOLERANCE = 0.10  # relative ratio error the fit must reach on every recorded row
CUSTOM = dict(chunk=4096, num_layers=4, full_attention_layers=[1, 3], num_heads=8)
FLAG_COSTS = dict(load_seconds=1.0, gpu_attention_seconds=2.0, ane_attention_seconds=0.5, non_attention_seconds=10.0)


# ---- chunks and variants ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "tokens, chunk, starts, sizes, device",
    [
        (4333, 4096, [0, 4096], [4096, 237], "ane"),
        (2500, 1024, [0, 1024, 2048], [1024, 1024, 452], "ane"),
        (8192, 4096, [0, 4096], [4096, 4096], "ane"),
        (4096, 4096, [0], [4096], "ane"),  # one full chunk: offloaded
        (4095, 4096, [0], [4095], "gpu"),  # one partial chunk: a short prompt stays on the GPU
    ],
)
def test_chunk_schedule(tokens, chunk, starts, sizes, device):
    chunks = chunk_schedule(tokens, chunk)
    assert [c.start for c in chunks] == starts
    assert [c.tokens for c in chunks] == sizes
    assert {c.device for c in chunks} == {device}


def test_variants_are_layer_by_history():
    p = plan(9000, **CUSTOM, **FLAG_COSTS)
    assert p.variants == [[1, 0], [1, 4096], [1, 8192], [3, 0], [3, 4096], [3, 8192]]
    assert p.variants_visited == 6
    assert (p.histories, p.coverage, p.coverage_needed, p.fits) == ([0, 4096, 8192], 12288, 12288, True)
    assert plan(8192, **CUSTOM, **FLAG_COSTS).variants_visited == 4  # negative control: one chunk fewer


def test_short_prompt_stays_on_the_gpu():
    p = plan(4000, **CUSTOM, **FLAG_COSTS)
    assert (p.decision, p.variants_visited, p.setup_seconds) == ("gpu", 0, 0.0)
    assert "short prompt" in p.reason
    assert p.predicted_ratio == pytest.approx(1.0)
    p = plan(2000, family="qwen3.5-2b-4bit")  # a dense family that wins at 4,333 tokens
    assert p.decision == "gpu" and "short prompt" in p.reason


# ---- the cost arithmetic ----------------------------------------------------------------------
def test_costs_two_full_chunks_by_hand():
    # per layer: GPU 2.0 (h0) + 4.0 (h4096: twice the keys); ANE 0.5 + 1.0; 4 loads of 1 s
    p = plan(8192, **CUSTOM, **FLAG_COSTS)
    assert p.gpu_prefill_seconds == pytest.approx(10 + 2 * (2.0 + 4.0))
    assert p.ane_prefill_seconds == pytest.approx(10 + 2 * (0.5 + 1.0) + 4 * 1.0)
    assert p.predicted_ratio == pytest.approx(22 / 17)
    assert p.decision == "ane"
    heavy = plan(8192, **CUSTOM, **{**FLAG_COSTS, "load_seconds": 5.0})  # setup 20 s > 9 s saved
    assert heavy.decision == "gpu" and heavy.reason.startswith("setup 20 s")


def test_a_continuation_is_padded_on_the_ane_but_not_on_the_gpu():
    p = plan(4333, **CUSTOM, **FLAG_COSTS)
    gpu_continuation = 2.0 * 237 * (4096 + 237) / (4096 * 4096)
    assert p.gpu_attention_seconds == pytest.approx(2 * (2.0 + gpu_continuation))
    assert p.ane_attention_seconds == pytest.approx(2 * (0.5 + 1.0))  # the 237 rows cost a full h4096 chunk


def test_load_seconds_per_history():
    p = plan(8192, **CUSTOM, **{**FLAG_COSTS, "load_seconds": [1.0, 3.0]})
    assert p.setup_seconds == pytest.approx(2 * (1.0 + 3.0))
    with pytest.raises(AnelabInputError, match="one per history"):
        plan(8192, **CUSTOM, **{**FLAG_COSTS, "load_seconds": [1.0, 3.0, 5.0]})


def test_sparse_gpu_path_scales_with_the_budget():
    p = plan(8192, **CUSTOM, sparse_budget=1024, **FLAG_COSTS)
    # the GPU gathers 1,024 keys per query in both chunks; the ANE still scores all of them
    assert p.gpu_attention_seconds == pytest.approx(2 * (2.0 + 2.0))
    assert p.ane_attention_seconds == pytest.approx(2 * (0.5 + 1.0))
    assert p.keys_per_query == {"ane": 8192, "gpu": 1024}
    dense = plan(8192, **CUSTOM, **FLAG_COSTS)
    assert dense.gpu_attention_seconds == pytest.approx(12.0)  # control: dense grows with history


# ---- the seed's verdicts ----------------------------------------------------------------------
def test_qwen38_stays_on_the_gpu_for_the_seeds_reasons():
    p = plan(SEED_TOKENS, family="qwen3.8-125b-a6b-4bit")
    assert p.variants_visited == 24
    assert p.setup_seconds == pytest.approx(12 * (SEED_LOADS_38[0] + SEED_LOADS_38[4096]))
    assert p.setup_seconds == pytest.approx(SEED_SETUP_38, rel=0.10)
    assert SEED_GPU_38_RECORDED[0] <= p.gpu_prefill_seconds <= SEED_GPU_38_RECORDED[1]
    assert p.gpu_prefill_seconds == pytest.approx(SEED_GPU_PREFILL_38, rel=0.05)
    assert p.decision == "gpu" and p.predicted_ratio < 1
    assert "setup" in p.reason and "sparse GPU path" in p.reason and "4.0x" in p.reason


def test_qwen38_fit_by_hand():
    # ANE attention: 12 layers x (h0 0.43 s + h4096 twice the entries)
    ane_attention = 12 * (SEED_H0_ANE + 2 * SEED_H0_ANE)
    setup = 12 * (SEED_LOADS_38[0] + SEED_LOADS_38[4096])
    # each 3.8 row: gpu - ane + ane_attention + setup = sparse GPU attention; weighted by 1/ane
    y = {b: g - a + ane_attention + setup for b, (g, a) in SEED_38_ROWS.items()}
    w2 = {b: 1 / SEED_38_ROWS[b][1] ** 2 for b in SEED_38_ROWS}
    sparse_attention = sum(w2[b] * y[b] for b in y) / sum(w2.values())
    p = plan(SEED_TOKENS, family="qwen3.8-125b-a6b-4bit")
    assert p.ane_attention_seconds == pytest.approx(ane_attention)
    assert p.gpu_attention_seconds == pytest.approx(sparse_attention)
    # non-attention: mean residual of the family's three recorded arms at this workload
    residuals = [
        SEED_GPU_38_RECORDED[0] - sparse_attention,
        SEED_GPU_38_RECORDED[1] - sparse_attention,
        SEED_38_ROWS[4][1] - ane_attention - setup,
    ]
    assert p.non_attention_seconds == pytest.approx(sum(residuals) / 3)


@pytest.mark.parametrize("family", DENSE_FAMILIES + SPARSE_FAMILIES)
def test_every_family_decides_its_recorded_side_at_the_recorded_prompt(family):
    # issue 30: at 4,333 tokens the planner's central cost lands on the side the seed recorded
    p = plan(SEED_TOKENS, family=family)
    recorded = SEED_RATIOS[(family, SEED_CHUNK)]
    assert (p.predicted_ratio > 1) == (recorded > 1) and p.decision == ("ane" if recorded > 1 else "gpu")
    assert p.protocol == "machine"
    if family in DENSE_FAMILIES:  # the OS keeps their specializations: the arm holds reloads only
        assert not p.pays_specialization
        assert all(v["source"].startswith("fitted (reload") for v in p.load_seconds.values())
        assert p.setup_seconds == pytest.approx(p.reload_seconds)
        assert 0 < p.setup_seconds < p.specialization_seconds
    else:  # 29 GB of visited arenas on the 24 GB M3: the 3.8 pays its recorded cold loads
        assert p.pays_specialization and "exceed" in p.protocol_reason
        assert p.setup_seconds == pytest.approx(12 * (SEED_LOADS_38[0] + SEED_LOADS_38[4096]))
    # control: every prompt paying specialization turns the dense families' wins into losses
    if family in DENSE_FAMILIES[:6]:
        assert plan(SEED_TOKENS, family=family, protocol="prompt").decision == "gpu"


def test_the_chunk_1024_row_decides_the_recorded_side():
    p = plan(2500, family="qwen3.5-2b-4bit", chunk=1024)
    assert p.decision == "ane" and p.variants_visited == 18
    # control: a flat ~0.5 s reload per layer-chunk (the note taken per function) loses this row
    flat = plan(2500, family="qwen3.5-2b-4bit", chunk=1024, load_seconds=0.5)
    assert flat.decision == "gpu"


def test_qwen38_coverage_cap():
    p = plan(12288, family="qwen3.8-125b-a6b-4bit")
    assert p.variants_visited == 36
    assert p.setup_seconds == pytest.approx(12 * sum(SEED_LOADS_38.values()))
    with pytest.raises(AnelabInputError, match="16,384"):
        plan(12289, family="qwen3.8-125b-a6b-4bit")
    past = plan(12289, family="qwen3.8-125b-a6b-4bit", allow_past_coverage=True)
    assert (past.fits, past.decision, past.variants_visited) == (False, "gpu", 0)


def test_histories_must_cover_every_chunk():
    with pytest.raises(AnelabInputError, match="4096"):
        plan(9000, histories=[0, 8192], **CUSTOM, **FLAG_COSTS)
    assert plan(9000, histories=[0, 4096, 8192], **CUSTOM, **FLAG_COSTS).fits


# ---- how well the fit recovers the records ----------------------------------------------------
def test_predicted_vs_recorded_covers_every_recorded_ratio():
    rows = predicted_vs_recorded()
    assert {(r["family"], r["chunk"]): r["recorded_ratio"] for r in rows} == SEED_RATIOS
    for r in rows:
        wins = r["recorded_ratio"] > 1
        for key in ("in_sample_ratio", "leave_one_out_ratio", "plan_ratio"):
            assert (r[key] > 1) == wins, (r["family"], key)  # every prediction gets the side right
        assert abs(r["in_sample_error"]) < IN_SAMPLE_TOLERANCE, r
        assert r["in_sample_error"] == pytest.approx(r["in_sample_ratio"] / r["recorded_ratio"] - 1)


def test_load_power_fit():
    import math

    xs = [math.log(24 * 4096 * (h + 4096) * 2 / 1e9) for h in SEED_LOADS_38]
    ys = [math.log(s) for s in SEED_LOADS_38.values()]
    mx, my = sum(xs) / 3, sum(ys) / 3
    exp = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    coef, fitted_exp = fit_load_power([24 * 4096 * (h + 4096) * 2 for h in SEED_LOADS_38], list(SEED_LOADS_38.values()))
    assert fitted_exp == pytest.approx(exp)
    assert coef == pytest.approx(math.exp(my - exp * mx))
    assert fit_load_power([1e9, 2e9, 4e9], [3.0, 6.0, 12.0])[1] == pytest.approx(1.0)  # control: linear data


# ---- the command line -------------------------------------------------------------------------
def test_cli_json_reproduces_the_qwen38_verdict(capsys):
    assert main(["plan", "--family", "qwen3.8-125b-a6b-4bit", "--prompt-tokens", "4333", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["decision"], d["variants_visited"]) == ("gpu", 24)
    assert d["setup_seconds"] == pytest.approx(SEED_SETUP_38, rel=0.10)
    assert d["predicted_ratio"] < 1 and "setup" in d["reason"]


def test_cli_lists_families(capsys):
    assert main(["plan", "--list-families", "--json"]) == 0
    table = {f["name"]: f for f in json.loads(capsys.readouterr().out)}
    assert set(table) == set(DENSE_FAMILIES + SPARSE_FAMILIES)
    assert table["qwen3.8-125b-a6b-4bit"]["facts"]["num_heads"]["status"] == "recorded"
    assert table["qwen3.5-4b-4bit"]["facts"]["num_heads"]["status"] == "assumed"
    assert all(f["unknown"] for f in table.values())
    assert main(["plan", "--list-families"]) == 0
    assert "qwen3.8-125b-a6b-8bit" in capsys.readouterr().out


def test_cli_text_and_fit_report(capsys):
    assert main(["plan", "--family", "qwen3.5-2b-4bit", "--prompt-tokens", "2500", "--chunk", "1024"]) == 0
    out = capsys.readouterr().out
    assert "decision: ane" in out and "verdict: " in out and "load per layer" in out and "reload" in out
    assert main(["plan", "--fit-report"]) == 0
    assert "ane-chunk1024-2b-4bit.json" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--family", "qwen3.8-125b-a6b-4bit", "--prompt-tokens", "13000"], "coverage 16,384"),
        (["--family", "qwen3.8-125b-a6b-4bit", "--prompt-tokens", "4333", "--max-history", "12288"], "cap 8192"),
        (["--family", "qwen9", "--prompt-tokens", "4333"], "known: qwen3.5-2b-4bit"),
        (["--family", "qwen3.5-2b-4bit", "--prompt-tokens", "0"], "--prompt-tokens must be a positive"),
        (["--family", "qwen3.5-2b-4bit", "--prompt-tokens", "-5"], "--prompt-tokens must be a positive"),
        (["--family", "qwen3.5-2b-4bit", "--prompt-tokens", "100", "--chunk", "0"], "--chunk must be a positive"),
        (["--family", "qwen3.5-2b-4bit", "--prompt-tokens", "100", "--heads", "-8"], "--heads must be a positive"),
        (["--family", "qwen3.5-2b-4bit", "--prompt-tokens", "5000", "--load-seconds", "-1"], "--load-seconds"),
        (
            [
                "--prompt-tokens",
                "5000",
                "--chunk",
                "4096",
                "--layers",
                "4",
                "--full-attention-layers",
                "1,3",
                "--heads",
                "8",
            ],
            "--load-seconds",
        ),
        (["--family", "qwen3.5-2b-4bit", "--prompt-tokens", "9000", "--max-history", "4096"], "needs coverage 12,288"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_cli_good_input_is_not_refused(capsys):
    # control for the bad-input cases: the same commands within range succeed
    assert main(["plan", "--family", "qwen3.8-125b-a6b-4bit", "--prompt-tokens", "12288"]) == 0
    assert main(["plan", "--family", "qwen3.5-2b-4bit", "--prompt-tokens", "9000", "--max-history", "8192"]) == 0
    assert capsys.readouterr().err == ""


def test_family_names_are_the_seeds_rows():
    assert list(FAMILIES) == DENSE_FAMILIES + SPARSE_FAMILIES
