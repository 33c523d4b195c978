"""The planner's Core AI price: the Core AI / Core ML load ratio ``anelab measure`` records on one layer and
Mac, applied to a family's loads (labelled extrapolated), and the per-variant load that flips Qwen 3.8."""

from __future__ import annotations

import shutil

import pytest

from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.core.paths import DATA_DIR
from anelab.core.records import make_record, write_record
from anelab.planner.coreai_loads import coreai_ratios
from anelab.planner.load_flip import flip_load
from anelab.planner.plan import plan
from anelab.planner.verdict import plan_arm_costs, verdict_for

QWEN38 = "qwen3.8-125b-a6b-4bit"
MAC = {"machine_model": "Mac15,3", "chip": "Apple M3", "os_version": "macOS 27.0", "python": "3.11",
       "coremltools": "9.0", "numpy": "2.3", "anelab": "0.1.0", "git_revision": "x", "date": "2026-12-01"}  # fmt: skip
KEY = "a" * 64


def _write(records, coreml_cold=2.0, coreai=None, provenance=MAC):
    """Core ML cold loads of h0, h8 and Core AI loads of the same asset (mode -> seconds), as measure writes them."""
    for fn in ("h0", "h8"):
        params = {"function": fn, "cold": True, "measure": {"step": "load", "package_sha256": KEY}}
        write_record(
            records, make_record("load_timing", params, {"median_s": coreml_cold}, provenance_override=provenance)
        )
    for mode, seconds in (coreai or {}).items():
        params = {"asset": "layer_0.aimodel", "mode": mode, "entrypoints": 2, "entrypoint_names": ["h0", "h8"],
                  "coreml_package_sha256": KEY, "measure": {"step": "coreai", "package_sha256": KEY}}  # fmt: skip
        results = {"median_s": seconds, "load_function_s": {"h0": 0.02, "h8": 0.02}}
        write_record(records, make_record("coreai_specialization", params, results, provenance_override=provenance))


@pytest.fixture
def data_dir(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(DATA_DIR, data, ignore=shutil.ignore_patterns("measured"))
    (data / "measured").mkdir()
    return data


def test_the_ratio_is_core_ai_against_core_ml_on_the_same_layer(data_dir):
    _write(data_dir / "measured", coreai={"cold": 6.0, "fresh_process": 0.5})
    ratios = coreai_ratios(data_dir / "measured")
    assert ratios["fresh_process"].ratio == pytest.approx((0.5 + 0.04) / 4.0)
    assert ratios["cold"].ratio == pytest.approx((6.0 + 0.04) / 4.0)
    assert ratios["cold"].machine == "Apple M3, macOS 27.0"


def test_a_record_from_another_machine_kind_or_package_prices_nothing(data_dir):
    """Negative controls: a Linux record (the fake), and Core AI records whose Core ML package has no loads."""
    _write(data_dir / "measured", coreai={"fresh_process": 0.5}, provenance={**MAC, "os_version": "Linux 6.1"})
    assert coreai_ratios(data_dir / "measured") == {}
    with pytest.raises(AnelabInputError, match="no Core AI record"):
        plan(4333, family=QWEN38, backend="coreai", data_dir=data_dir)


def test_a_cheap_core_ai_record_turns_the_qwen38_plan_and_a_dear_one_does_not(data_dir):
    coreml_plan = plan(4333, family=QWEN38, data_dir=data_dir)
    coreml = coreml_plan.to_dict()
    flip = flip_load(coreml_plan, data_dir)
    assert coreml["decision"] == "gpu" and flip["max_load_per_variant_s"] == pytest.approx(7.1, abs=0.05)
    assert flip["max_fraction_of_loads"] == pytest.approx(0.70, abs=0.01)
    _write(data_dir / "measured", coreai={"fresh_process": 0.5})  # 0.135x Core ML's loads: below 0.70x
    cheap_plan = plan(4333, family=QWEN38, backend="coreai", data_dir=data_dir)
    cheap = cheap_plan.to_dict()
    assert cheap["setup_seconds"] == pytest.approx(coreml["setup_seconds"] * 0.135)
    assert cheap["decision"] == "ane" and cheap["provenance"]["load"] == "extrapolated"
    verdict = verdict_for(plan_arm_costs(cheap_plan, data_dir=data_dir))
    # issue 30: extrapolation widens the bands; the verdict is "depends" only if the gain's interval spans 0
    assert verdict.gain_seconds[1] > 0 and verdict.decision == ("ane" if verdict.gain_seconds[0] > 0 else "depends")
    shutil.rmtree(data_dir / "measured")
    (data_dir / "measured").mkdir()
    _write(data_dir / "measured", coreai={"fresh_process": 3.56})  # 0.9x: above the 0.70x that flips it
    dear = plan(4333, family=QWEN38, backend="coreai", data_dir=data_dir).to_dict()
    assert dear["decision"] == "gpu"


def test_plan_without_a_record_says_which_load_would_flip_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("anelab.planner.coreai_loads.MEASURED_DIR", tmp_path / "no-records")
    assert main(["plan", "--family", QWEN38, "--prompt-tokens", "4333", "--backend", "coreai"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no Core AI record" in err and "if a variant loads in <= 7.11 s" in err


def test_a_core_ai_plan_prices_the_per_model_floor_once_per_asset_and_says_whether_packing_pays(data_dir):
    """Issue 40: under --backend coreai the cold start holds ~10 s per asset (one per full-attention layer,
    Apple developer forums thread 857290); one packed asset pays it once. Core ML's plan holds no floor."""
    _write(data_dir / "measured", coreai={"fresh_process": 0.5})
    p = plan(4333, family=QWEN38, backend="coreai", data_dir=data_dir)
    layers = len(p.geometry["full_attention_layers"])
    floor = p.cold_start["parts"]["coreai_model_floor"]
    assert floor["seconds"] == pytest.approx(10.0 * layers) and "forums/thread/857290" in floor["source"]
    once = 0.0 if p.pays_specialization else p.specialization_seconds  # Qwen 3.8 pays it per prompt (past memory)
    assert p.cold_start["one_time_seconds"] == pytest.approx(once + 10.0 * layers)
    assert p.cold_start["packed"]["one_time_seconds"] == pytest.approx(once + 10.0)
    assert "packing the" in p.cold_start["sentence"]
    assert "coreai_model_floor" not in plan(4333, family=QWEN38, data_dir=data_dir).cold_start["parts"]
