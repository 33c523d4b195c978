"""The chip table, the ANE arm carried to each chip, joules, cold start, chip validation and the GPU-runtime table."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.planner import chip_figures as cf
from anelab.planner.chip_map import family_verdict_map
from anelab.planner.chip_validation import PUBLIC_PAIRS, predict, validate_chips
from anelab.planner.chips import CHIPS, get_chip, resolve_chip
from anelab.planner.cold_start import cold_start
from anelab.planner.gpu_runtimes import GPU_RUNTIMES, default_gpu_runtime, require_gpu_runtime
from anelab.planner.plan import plan

TWO_B, N = "qwen3.5-2b-4bit", 4333

# every sourced figure the chip model reads: (what, figure, expected value, a piece of its source) — typed out here
# from the public pages, so dropping or changing a value or its source fails
ANEFORGE, MADERIX, PLACEMENT = "sbryngelson/ANEForge", "maderix.substack.com", "erwinzhang7/coreml-compute-placement"
FIGURES = [
    ("M1 ANE GEMM low", lambda: cf.ANE_GEMM_TFLOPS["M1"].low, 2.7, lambda: cf.ANE_GEMM_TFLOPS["M1"].source, ANEFORGE),
    ("M1 ANE GEMM high", lambda: cf.ANE_GEMM_TFLOPS["M1"].high, 4.3, lambda: cf.ANE_GEMM_TFLOPS["M1"].source, ANEFORGE),
    ("M1 Max ANE GEMM", lambda: cf.ANE_GEMM_TFLOPS["M1 Max"].value, 4.6, lambda: cf.ANE_GEMM_TFLOPS["M1 Max"].source, ANEFORGE),
    ("M2 Pro ANE GEMM", lambda: cf.ANE_GEMM_TFLOPS["M2 Pro"].value, 3.4, lambda: cf.ANE_GEMM_TFLOPS["M2 Pro"].source, ANEFORGE),
    ("M4 ANE GEMM", lambda: cf.ANE_GEMM_TFLOPS["M4"].value, 5.4, lambda: cf.ANE_GEMM_TFLOPS["M4"].source, ANEFORGE),
    ("M5 ANE GEMM", lambda: cf.ANE_GEMM_TFLOPS["M5"].value, 8.7, lambda: cf.ANE_GEMM_TFLOPS["M5"].source, ANEFORGE),
    ("M5 Pro ANE GEMM", lambda: cf.ANE_GEMM_TFLOPS["M5 Pro"].value, 10.0, lambda: cf.ANE_GEMM_TFLOPS["M5 Pro"].source, ANEFORGE),
    ("M3 ANE GEMM low (1.6 x M1 2.7)", lambda: cf.ANE_GEMM_TFLOPS["M3"].low, 4.32, lambda: cf.ANE_GEMM_TFLOPS["M3"].source, "ocworkbench"),
    ("M4 cliff MB", lambda: cf.ANE_CLIFF_MB.value, 32.0, lambda: cf.ANE_CLIFF_MB.source, MADERIX),
    ("M4 cliff factor", lambda: cf.ANE_CLIFF_FACTOR.value, 4.0 / 5.7, lambda: cf.ANE_CLIFF_FACTOR.source, MADERIX),
    ("M4 dispatch ms", lambda: cf.ANE_DISPATCH_MS["M4"].value, 0.095, lambda: cf.ANE_DISPATCH_MS["M4"].source, MADERIX),
    ("M1 dispatch ms", lambda: cf.ANE_DISPATCH_MS["M1"].value, 0.23, lambda: cf.ANE_DISPATCH_MS["M1"].source, ANEFORGE),
    ("M4 Pro GPU matmul", lambda: cf.GPU_MATMUL_TFLOPS["M4 Pro"].value, 6.4, lambda: cf.GPU_MATMUL_TFLOPS["M4 Pro"].source, PLACEMENT),
    ("M5 Max GPU matmul", lambda: cf.GPU_MATMUL_TFLOPS["M5 Max"].value, 39.2, lambda: cf.GPU_MATMUL_TFLOPS["M5 Max"].source, PLACEMENT),
    ("M5 Max GPU cores", lambda: cf.GPU_CORES["M5 Max"].value, 40, lambda: cf.GPU_CORES["M5 Max"].source, PLACEMENT),
    ("M5 Pro GPU cores", lambda: cf.GPU_CORES["M5 Pro"].value, 20, lambda: cf.GPU_CORES["M5 Pro"].source, ANEFORGE),
    ("M5 Max ANE W", lambda: cf.ANE_WATTS["M5 Max"].value, 4.8, lambda: cf.ANE_WATTS["M5 Max"].source, PLACEMENT),
    ("M5 Max GPU W", lambda: cf.GPU_WATTS["M5 Max"].value, 39.4, lambda: cf.GPU_WATTS["M5 Max"].source, PLACEMENT),
    ("M1 ANE W", lambda: cf.ANE_WATTS["M1"].value, 4.4, lambda: cf.ANE_WATTS["M1"].source, "ane-guide"),
    ("M1 GPU W", lambda: cf.GPU_WATTS["M1"].value, 32.5, lambda: cf.GPU_WATTS["M1"].source, "ane-guide"),
    ("CPU W driving", lambda: cf.CPU_WATTS_DRIVING.value, 4.0, lambda: cf.CPU_WATTS_DRIVING.source, PLACEMENT),
    ("M5 Max bandwidth", lambda: CHIPS["M5 Max"].bandwidth_gbs.value, 614.0, lambda: CHIPS["M5 Max"].bandwidth_gbs.source, PLACEMENT),
    ("Core AI model floor", lambda: cf.CORE_AI_MODEL_FLOOR_S.value, 10.0, lambda: cf.CORE_AI_MODEL_FLOOR_S.source, "forums/thread/857290"),
    ("M4 Pro placement ratio", lambda: PUBLIC_PAIRS[0].published_ratio, 204.4 / 178.8, lambda: PUBLIC_PAIRS[0].source, PLACEMENT),
    ("M5 Max placement ratio", lambda: PUBLIC_PAIRS[1].published_ratio, 233.0 / 1085.7, lambda: PUBLIC_PAIRS[1].source, PLACEMENT),
    ("M5 Pro prefill ratio", lambda: PUBLIC_PAIRS[2].published_ratio, 9.3 / 12.5, lambda: PUBLIC_PAIRS[2].source, "mobius/pull/77"),
]  # fmt: skip


@pytest.mark.parametrize("what,value,expected,source,cited", FIGURES, ids=[f[0] for f in FIGURES])
def test_every_chip_figure_keeps_its_value_and_source(what, value, expected, source, cited):
    assert value() == pytest.approx(expected, rel=1e-9), what
    assert cited in (source() or ""), what


def test_the_figure_check_fails_on_a_dropped_source_or_value():
    """Negative control of the table above: an unsourced figure and a changed value are caught."""
    bare = cf.Figure(5.4, None)
    assert bare.kind == cf.UNSOURCED and ANEFORGE not in (bare.source or "")
    assert cf.Figure(5.5, cf.ANEFORGE).value != pytest.approx(5.4, rel=1e-9)


def test_the_ane_arm_moves_with_each_chips_sourced_gemm_figure():
    """2B at 4,333 tokens: the 4,096-token chunk is compute-bound past the cliff on every chip, so the ANE attention
    scales as the inverse of the chips' measured GEMM figures (dispatch is < 0.1 % of it)."""
    ane = {c: plan(N, family=TWO_B, chip=c).ane_attention_seconds for c in ("m3", "m4", "m5")}
    m3, m4, m5 = (cf.ANE_GEMM_TFLOPS[c].value for c in ("M3", "M4", "M5"))
    assert ane["m4"] / ane["m3"] == pytest.approx(m3 / m4, rel=2e-3)
    assert ane["m5"] / ane["m3"] == pytest.approx(m3 / m5, rel=2e-3)
    assert len({round(v, 6) for v in ane.values()}) == 3  # negative control: three different prices
    carried = plan(N, family=TWO_B, chip="m5")
    assert carried.provenance["ane_attention"] == "extrapolated" and carried.ane_chip["band"] > 1.0
    assert plan(N, family=TWO_B, chip="m3").ane_chip["scale"] == 1.0


def test_a_small_chunk_is_bound_by_a_different_term_than_a_large_one():
    """Not one ratio per chip: the M5 / M3 scale at chunk 256 (under the cliff) differs from chunk 4,096's."""
    from anelab.planner.ane_chips import carry_ane
    from anelab.planner.catalogue import get_family

    g = get_family(TWO_B).geometry
    small, large = carry_ane("M5", g, 256, [0]), carry_ane("M5", g, 4096, [0])
    assert "cliff" in large.bound and "cliff" not in small.bound
    assert small.scale != pytest.approx(large.scale, rel=0.01)


def test_on_an_m5_max_against_mlx_lm_the_2b_decides_gpu():
    from anelab.planner.verdict import plan_arm_costs, verdict_for

    p = plan(N, family=TWO_B, chip="m5-max", gpu_runtime="mlx-lm")
    assert p.decision == "gpu" and verdict_for(plan_arm_costs(p)).decision == "gpu"
    assert plan(N, family=TWO_B, chip="m3").decision == "ane"  # negative control: the seed's chip and path


def test_every_chip_gets_a_verdict_or_one_line_naming_the_missing_figure():
    m = family_verdict_map(TWO_B, (N,))
    assert {r["chip"] for r in m["rows"]} == set(CHIPS)
    for r in m["rows"]:
        if r["refused"]:
            assert "\n" not in r["refused"] and re.search(r"unknown|no .* figure", r["refused"]), r
        else:
            assert r["cells"][0]["decision"] in ("ane", "gpu", "depends")
    assert sum(not r["refused"] for r in m["rows"]) >= 14


def test_an_unknown_ane_figure_refuses_the_arm_in_one_line(capsys):
    with pytest.raises(AnelabInputError, match="M1 Ultra: ANE fp16 matmul throughput unknown"):
        plan(N, family=TWO_B, chip="m1-ultra")
    assert main(["plan", "--family", TWO_B, "--prompt-tokens", str(N), "--chip", "m1-ultra"]) == 2
    assert "unknown" in capsys.readouterr().err


def test_the_m5_family_is_priced_on_mlx_lm():
    for chip in ("m5", "m5-pro", "m5-max"):
        p = plan(N, family=TWO_B, chip=chip, gpu_runtime="mlx-lm")
        assert p.gpu_chip == get_chip(chip).name and p.gpu_prefill_seconds > 0
    assert plan(N, family=TWO_B, chip="m5-max", gpu_runtime="mlx-lm").gpu_prefill_seconds < plan(
        N, family=TWO_B, chip="m4-max", gpu_runtime="mlx-lm").gpu_prefill_seconds  # fmt: skip


def test_joules_of_both_arms_and_the_energy_objective():
    """On the M5 (tinytitan carried) the ANE arm is slower but takes fewer joules: the objective picks."""
    timed, energy = (plan(N, family=TWO_B, chip="m5", objective=o) for o in ("time", "energy"))
    e = timed.energy
    gpu_w, ane_w = (cf.published_range(t, "").value for t in (cf.GPU_WATTS, cf.ANE_WATTS))
    assert e["gpu_joules"]["value"] == pytest.approx(timed.gpu_prefill_seconds * gpu_w, rel=1e-9)
    assert e["ane_joules"]["value"] < e["gpu_joules"]["value"]
    assert timed.ane_prefill_seconds > timed.gpu_prefill_seconds and timed.decision == "gpu"
    assert energy.decision == "ane" and energy.time_decision == "gpu"
    assert e["power"]["gpu"]["kind"] == "extrapolated" and e["power"]["gpu"]["source"]
    with pytest.raises(AnelabInputError, match="--objective"):
        plan(N, family=TWO_B, objective="money")


def test_plan_json_carries_joules_with_sources(capsys):
    assert main(["plan", "--family", TWO_B, "--prompt-tokens", str(N), "--chip", "m5-max", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for arm in ("gpu_joules", "ane_joules"):
        assert (
            d["energy"][arm]["value"] > 0
            and d["verdicts"][0]["energy"][arm]["low"] <= d["verdicts"][0]["energy"][arm]["high"]
        )
    assert PLACEMENT in d["energy"]["power"]["ane"]["source"]


def test_cold_start_prompts_to_repay_and_the_core_ai_floor():
    plain = cold_start(31.3, 49.9, 35.9, backend=None, assets=6, runs_on_ane=True)
    assert plain["prompts_to_repay"] == 3  # ceil(31.3 / 14.0)
    coreai = cold_start(31.3, 49.9, 35.9, backend="coreai", assets=6, runs_on_ane=True)
    assert coreai["one_time_seconds"] == pytest.approx(91.3) and coreai["prompts_to_repay"] == 7
    assert coreai["packed"]["one_time_seconds"] == pytest.approx(41.3) and coreai["packed"]["prompts_to_repay"] == 3
    assert "forums/thread/857290" in coreai["parts"]["coreai_model_floor"]["source"]
    assert cold_start(31.3, 10.0, 12.0, backend=None, assets=6, runs_on_ane=True)["prompts_to_repay"] is None
    p = plan(N, family=TWO_B, chip="m3")
    assert p.cold_start["prompts_to_repay"] == math.ceil(
        p.specialization_seconds / (p.gpu_prefill_seconds - p.ane_prefill_seconds)
    )


def test_validation_holds_three_non_m3_chips_and_every_row_is_a_prediction():
    v = validate_chips(seed_rows=False)
    chips = {r["chip"] for r in v["rows"] if r["predicted_ratio"] is not None}
    assert {"M4 Pro", "M5 Max", "M5 Pro"} <= chips and len(v["cannot_express"]) >= 2
    assert all(r["inside"] for r in v["rows"])  # recorded here: each published ratio inside its interval
    # the M4 Pro and M5 Max placement pair: the ANE faster on one, the GPU ~4x faster on the other, both predicted
    m4p, m5max = (next(r for r in v["rows"] if r["chip"] == c) for c in ("M4 Pro", "M5 Max"))
    assert m5max["predicted_ratio"] < m4p["predicted_ratio"] / 2


def test_a_validation_row_never_feeds_the_fit(monkeypatch):
    """Leave one out, or change its published value: no prediction (nor any plan) changes."""
    full = {r["name"]: r["predicted_ratio"] for r in validate_chips(seed_rows=False)["rows"]}
    for i in range(len(PUBLIC_PAIRS)):
        rest = PUBLIC_PAIRS[:i] + PUBLIC_PAIRS[i + 1 :]
        for r in validate_chips(rest, seed_rows=False)["rows"]:
            assert r["predicted_ratio"] == full[r["name"]]
    from dataclasses import replace

    assert predict(replace(PUBLIC_PAIRS[1], published_ratio=99.0))["predicted_ratio"] == full[PUBLIC_PAIRS[1].name]
    before = plan(N, family=TWO_B, chip="m5-max").ane_attention_seconds
    monkeypatch.setattr("anelab.planner.chip_validation.PUBLIC_PAIRS", ())
    assert plan(N, family=TWO_B, chip="m5-max").ane_attention_seconds == before
    # negative control: a row whose chip figure changes does move its prediction
    monkeypatch.setitem(cf.ANE_GEMM_TFLOPS, "M5 Pro", cf.Figure(20.0, cf.ANEFORGE))
    assert predict(PUBLIC_PAIRS[2])["predicted_ratio"] != full[PUBLIC_PAIRS[2].name]


def test_chip_detection_and_the_seed_default(monkeypatch, capsys):
    assert resolve_chip(None, brand="Apple M4 Pro")[0].name == "M4 Pro"
    assert "detected" in resolve_chip(None, brand="Apple M4 Pro")[1]
    chip, why = resolve_chip(None, brand="")
    assert chip.name == "M3" and "not a Mac" in why
    assert "not in the chip table" in resolve_chip(None, brand="Apple M9")[1]
    monkeypatch.setattr("anelab.planner.chips.this_machines_brand", lambda: "Apple M5 Max")
    assert plan(N, family=TWO_B, gpu_runtime="mlx-lm").chip == "M5 Max"
    monkeypatch.setattr("anelab.planner.chips.this_machines_brand", lambda: None)
    assert main(["plan", "--family", TWO_B, "--prompt-tokens", str(N)]) == 0
    assert "chip: M3 — the seed's M3 (not a Mac" in capsys.readouterr().out


def test_the_gpu_runtime_table():
    assert default_gpu_runtime(checkpoint=True) == "mlx-lm" and default_gpu_runtime(checkpoint=False) == "tinytitan"
    assert set(GPU_RUNTIMES) == {"tinytitan", "mlx-lm", "yours"}
    with pytest.raises(AnelabInputError, match="choose tinytitan or mlx-lm"):
        require_gpu_runtime("yours")  # the user's number is a flag, not a runtime to pick


RUNTIME_LITERAL = re.compile(r"""(["'])(tinytitan|mlx-lm)\1""")


def runtime_literals(root: Path) -> list[str]:
    """Lines outside the runtime table that spell a runtime's name as a string (a comparison or a default)."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        if path.name in ("gpu_runtimes.py", "mlx_lm_rates.py") or path.parent.name == "arms":
            continue  # the table; mlx-lm's records module names itself; arms/ name the decode engine, not a GPU arm
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if RUNTIME_LITERAL.search(line) and not line.lstrip().startswith(("#", '"', "anelab ")):
                hits.append(f"{path}:{i}")
    return hits


def test_no_runtime_name_is_spelled_outside_the_table(tmp_path):
    assert runtime_literals(Path(__file__).resolve().parents[2] / "anelab") == []
    (tmp_path / "bad.py").write_text('if runtime == "mlx-lm":\n    pass\n')
    assert runtime_literals(tmp_path) == [f"{tmp_path / 'bad.py'}:1"]  # negative control


def test_every_design_is_carried_to_the_chip():
    from anelab.planner.design_plans import compare_designs

    on = {c: {d.design: d.ane_attention_seconds for d in compare_designs(N, TWO_B, 4096, chip=c)} for c in ("m3", "m5")}
    scale = plan(N, family=TWO_B, chip="m5").ane_chip["scale"]
    for design, seconds in on["m3"].items():
        assert on["m5"][design] == pytest.approx(seconds * scale, rel=1e-9) and scale < 0.9


def test_the_seed_calibration_names_what_limits_the_sidecar_graph():
    """At the recorded layer-chunk (Qwen 3.8 h0: 24 x 4,096 x 4,096 at head_dim 256, 0.43 s recorded) the M3
    roofline is compute past the cliff; the recorded time sits above it (an efficiency, not a contradiction)."""
    from anelab.planner.chip_validation import seed_calibration

    c = seed_calibration()
    assert c["recorded"] == pytest.approx(0.43, rel=0.02) and c["bound"] == "compute past the cliff"
    flops = 4 * 256 * 24 * 4096 * 4096
    assert c["compute"] == pytest.approx(flops / (cf.ANE_GEMM_TFLOPS["M3"].value * 1e12 * 4.0 / 5.7), rel=1e-9)
    assert c["traffic"] < c["compute"] and c["recorded_over_roofline"] > 1.0


def test_plan_validate_chips_prints_the_table(capsys):
    assert main(["plan", "--validate-chips"]) == 0
    out = capsys.readouterr().out
    assert "calibration on the seed's M3" in out and "cannot express:" in out
    assert re.search(r"^M5 Max\s+0\.215\s+0\.255", out, re.M)
    assert main(["plan", "--validate-chips", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["rows"]) >= 3 + 10
