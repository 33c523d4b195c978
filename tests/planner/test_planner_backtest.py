"""Issue 30: the one load model, the protocol, the backtest and its negative controls.

Expected values are typed from the seed (shared/seeds/ane-prefill-research.txt), TinyTitan's design record
(Pummelchen/NVMAI docs/v4.5-ane-prefill.md) or computed by hand in the test.
"""

import json
import math
import shutil

import numpy as np
import pytest

from anelab.cli import main
from anelab.core.paths import DATA_DIR
from anelab.planner.backtest import backtest
from anelab.planner.catalogue import FAMILIES
from anelab.planner.fit import LoadModel, fit_costs
from anelab.planner.loads import cache_holds, fit_specialization, hidden_reload, pays_specialization
from anelab.planner.plan import plan

SEED_RATIOS = {  # (family, chunk) -> recorded ratio (seed 000)
    ("qwen3.5-2b-4bit", 4096): 1.38, ("qwen3.5-2b-4bit", 1024): 1.30, ("qwen3.5-2b-8bit", 4096): 1.14,
    ("qwen3.5-4b-4bit", 4096): 1.38, ("qwen3.5-4b-8bit", 4096): 1.26, ("qwen3.5-9b-4bit", 4096): 1.25,
    ("qwen3.5-9b-8bit", 4096): 1.13, ("agentworld-35b-a3b-4bit", 4096): 1.68,
    ("qwen3.8-125b-a6b-4bit", 4096): 0.72, ("qwen3.8-125b-a6b-8bit", 4096): 0.87,
}  # fmt: skip
GB = 1e9


def on_recorded_side(rows: list[dict]) -> list[str]:
    """The rows whose in-sample or held-out prediction is on the other side of 1 from the record."""
    return [
        f"{r['family']}@{r['chunk']}"
        for r in rows
        if not ((r["recorded_ratio"] > 1) == (r["in_sample_ratio"] > 1) == (r["leave_one_family_out_ratio"] > 1))
    ]


# ---- the one load model -------------------------------------------------------------------------
@pytest.mark.parametrize("arena", [536_870_912, 1_073_741_824])
def test_equal_arenas_get_equal_prices_in_every_family(arena):
    # the two arenas: the 9B's and the 35B's h0 (16 heads x 4,096 x 4,096 x 2 B), and twice that
    fit = fit_costs()
    for specialize in (False, True):
        load = fit.recorded_load_model(specialize=specialize)
        prices = {
            load.at_arena(g.num_heads, g.head_dim, 4096, arena)[0] for g in (f.geometry for f in FAMILIES.values())
        }
        assert len(prices) == 1, prices
    reload = fit.recorded_load_model().at_arena(16, 256, 4096, arena)[0]
    assert reload == pytest.approx(0.5 * arena / ((536_870_912 + 1_073_741_824) / 2))  # the note's 0.5 s at its mean
    # and the plans agree: the 9B's and the 35B's h0 loads are the same number
    nine, thirty_five = (
        plan(4333, family=f).load_seconds["0"]["seconds"] for f in ("qwen3.5-9b-4bit", "agentworld-35b-a3b-4bit")
    )
    assert nine == thirty_five
    # control: the old per-family rule (a flat 0.5 s for the 35B, the arena law for the 9B) prices them apart
    old_35b = LoadModel(flat=0.5).at_arena(16, 256, 4096, arena)[0]
    assert old_35b != pytest.approx(fit.recorded_load_model(specialize=True).at_arena(16, 256, 4096, arena)[0])


def test_specialization_fit_by_hand():
    # points on 2 s x (arena/GB)^1.5 are recovered exactly
    coef, exp = fit_specialization([(a * GB, 2 * a**1.5) for a in (0.5, 1.0, 2.0)])
    assert (coef, exp) == (pytest.approx(2.0, rel=1e-3), pytest.approx(1.5, abs=0.005))
    # a total alone (one set of arenas): linear, coef = total / sum of arenas in GB
    coef, exp = fit_specialization([], [([0.5 * GB, 1.5 * GB], 130.0)])
    assert (coef, exp) == (pytest.approx(65.0), 1.0)
    # control: points on another law give another exponent
    assert fit_specialization([(a * GB, 2 * a) for a in (0.5, 1.0, 2.0)])[1] == pytest.approx(1.0, abs=0.005)


def _fit_one_exponent_at_a_time(points, totals=()):
    """The specialization fit as a plain scan: each exponent of the grid on its own (the oracle for the
    vectorized ``fit_specialization``)."""
    distinct = {a for a, _ in points} | {tuple(a) for a, _ in totals}
    grid = np.arange(0.25, 3.0001, 0.005) if len(distinct) > 1 else np.array([1.0])
    best = None
    for exp in grid:
        logs = [np.log(s) - exp * np.log(a / GB) for a, s in points]
        logs += [np.log(s) - np.log(np.sum((np.asarray(a, dtype=float) / GB) ** exp)) for a, s in totals]
        log_coef = float(np.mean(logs))
        miss = float(np.sum((np.asarray(logs) - log_coef) ** 2))
        if best is None or miss < best[0] - 1e-12:
            best = (miss, float(np.exp(log_coef)), float(exp))
    return best[1], best[2]


def test_the_specialization_fit_is_the_one_exponent_at_a_time_scans_bit_for_bit():
    """Every exponent of the grid is scored at once, with the operations a scan of one exponent at a time makes:
    the same (coef, exp) to the last bit on the recorded loads and on random ones (points, totals, both)."""
    from anelab.planner import fit as fit_module

    points, totals, *_ = fit_module._load_records(fit_module.read_records(DATA_DIR), None)  # the recorded loads
    rng = np.random.default_rng(7)
    cases = [(points, totals), (points, []), ([], totals)]
    for _ in range(60):
        points = [(float(rng.uniform(0.1, 5) * GB), float(rng.uniform(0.1, 50))) for _ in range(rng.integers(0, 7))]
        totals = [([float(x) for x in rng.uniform(0.1, 3, rng.integers(1, 40)) * GB], float(rng.uniform(1, 200)))
                  for _ in range(rng.integers(0 if points else 1, 3))]  # fmt: skip
        cases.append((points, totals))
    cases = [(p, t) for p, t in cases if p or t]
    assert [fit_specialization(p, t) for p, t in cases] == [_fit_one_exponent_at_a_time(p, t) for p, t in cases]
    # control: the scan tells the fits apart (the comparison is not vacuous)
    assert len({fit_specialization(p, t) for p, t in cases}) > len(cases) // 2


def test_protocol_and_cache():
    three_eight = 12 * 24 * 4096 * (4096 + 8192) * 2  # 3.8: 12 layers x (h0 + h4096) at 24 heads
    thirty_five = 10 * 16 * 4096 * (4096 + 8192) * 2
    assert not cache_holds(three_eight) and cache_holds(thirty_five)
    assert pays_specialization("machine", thirty_five)[0] is False
    assert pays_specialization("machine", three_eight)[0] is True
    assert all(pays_specialization(p, thirty_five)[0] for p in ("process", "prompt"))
    assert hidden_reload(0.5, 2.0, "serialized") == 0.0
    assert (hidden_reload(0.5, 2.0, "preloaded"), hidden_reload(0.5, 0.2, "preloaded")) == (0.5, 0.2)


def test_reload_policy_is_priced():
    serial = plan(4333, family="qwen3.5-2b-4bit")
    pre = plan(4333, family="qwen3.5-2b-4bit", reload_policy="preloaded")
    # the 2B's GPU time between two offloaded blocks (non-attention / 12) is far above a reload: all hidden
    assert pre.hidden_reload_seconds == pytest.approx(serial.reload_seconds)
    assert pre.ane_prefill_seconds == pytest.approx(serial.ane_prefill_seconds - serial.reload_seconds)
    assert serial.preloaded_ane_prefill_seconds == pytest.approx(pre.ane_prefill_seconds)
    assert serial.hidden_reload_seconds == 0.0


def test_cli_refuses_a_bad_protocol(capsys):
    assert main(["plan", "--family", "qwen3.5-2b-4bit", "--prompt-tokens", "4333", "--protocol", "daily"]) == 2
    err = capsys.readouterr().err
    assert "--protocol" in err and "machine" in err and "Traceback" not in err


# ---- the backtest ------------------------------------------------------------------------------
def test_backtest_every_row_on_the_recorded_side_with_its_errors():
    rows = backtest()
    assert {(r["family"], r["chunk"]): r["recorded_ratio"] for r in rows} == SEED_RATIOS
    assert on_recorded_side(rows) == []
    for r in rows:
        recorded = r["recorded_ratio"]
        assert r["in_sample_error"] == pytest.approx(r["in_sample_ratio"] / recorded - 1, abs=0.01)
        assert r["leave_one_family_out_error"] == pytest.approx(
            r["leave_one_family_out_ratio"] / recorded - 1, abs=0.01
        )
        assert abs(r["in_sample_error"]) < 0.10 and abs(r["leave_one_family_out_error"]) < 0.20, r
        assert r["held_out"] == FAMILIES[r["family"]].model


def test_backtest_cli(capsys):
    assert main(["plan", "--backtest", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 10
    assert main(["plan", "--backtest"]) == 0
    out = capsys.readouterr().out
    assert "10/10 rows on the recorded side" in out and "replayed, not measured" in out


def test_backtest_negative_control_a_perturbed_record_flips_a_row(tmp_path):
    # the 2B 4-bit's ANE arm made slower than its GPU arm: the record now says "gpu", the model still "ane"
    data = tmp_path / "data"
    shutil.copytree(DATA_DIR, data, ignore=shutil.ignore_patterns("*.py", "*.md"))
    path = data / "v5.5-ane-matrix-3.json"
    record = json.loads(path.read_text())
    row = next(r for r in record["results"]["rows"] if r["family"] == "qwen3.5-2b-4bit")
    row["ane_seconds"], row["ratio"] = 60.0, round(row["gpu_seconds"] / 60.0, 2)
    path.write_text(json.dumps(record))
    assert on_recorded_side(backtest(data)) == ["qwen3.5-2b-4bit@4096"]


def test_backtest_negative_control_loads_paid_per_prompt_fail_the_check():
    # the old reading (every visited function's cold load in every dense arm) puts the dense rows on the GPU side
    fit = fit_costs()
    losses = []
    for name, family in FAMILIES.items():
        if family.sparse:
            continue
        p = plan(4333, family=name, protocol="prompt")
        if p.decision == "gpu":
            losses.append(name)
    assert len(losses) >= 6 and fit.reload_seconds_per_gb > 0


def test_arena_reload_fits_the_records_where_a_flat_reload_does_not():
    # issue 30's "~0.5 s per layer-chunk" taken flat would put the chunk-1,024 row (18 layer-chunks) on the GPU side
    p = plan(2500, family="qwen3.5-2b-4bit", chunk=1024)
    flat = 18 * 0.5
    gain = p.attention_saved_seconds - flat
    assert p.decision == "ane" and gain < 0
    assert math.isclose(
        p.reload_seconds, fit_costs().reload_seconds_per_gb * 6 * 8 * 1024 * (1024 + 2048 + 3072) * 2 / GB
    )
