"""First contact on a Mac, the log and the plan (issue 41 items 4, 8-12): the log row reads words, the helpers'
lines and one clear line; a redacted or missing log is a caveat beside the compute plan, not a refusal; a plan's
Neural Engine share reaches the pricing; the probe's own graphs must reach the Neural Engine; a merged plan is read
for its function; every probe row is asked for by the code that relies on it; the first-use model's placement is
checked."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from anelab.core.errors import AnelabInputError
from anelab.runtimes.child import ChildRun
from anelab.runtimes.coreml import assumptions as a
from anelab.runtimes.coreml.ane_placement import MIN_COMPUTE_SHARE, require_ane_placement
from anelab.runtimes.coreml.coreml_fake import FakeFunction, FakeRuntime
from anelab.runtimes.coreml.gate import GATE_ASSUMPTIONS, check_variants
from anelab.runtimes.coreml.probe import _log_rows, core_ml_log_lines
from anelab.runtimes.interface import FIRST_USE_OFF_ANE

ANELAB = Path(__file__).resolve().parents[3] / "anelab"


def _variants(tmp_path: Path, names=("h0",)) -> dict[str, Path]:
    out = {}
    for name in names:
        pkg = tmp_path / f"{name}.mlpackage"
        pkg.mkdir(parents=True)
        (pkg / "Manifest.json").write_text(f'{{"name": "{name}"}}')
        out[name] = pkg
    return out


def _logged(fake: FakeRuntime, *core_ml_lines: str, own: str = "") -> dict:
    """The probe's log rows over lines this process logged as the ANE child would (its PID is the child's)."""
    start = time.time()
    fake.write_log_marker(f"anelab-probe: unified-log marker of pid {os.getpid()}")
    fake.unified_log.write(own)
    for line in core_ml_lines:
        fake.unified_log.write_core_ml(line)
    return _log_rows(fake, ChildRun(0, "", "", os.getpid(), start, time.time() + 0.01))


# ---- item 4: the log row as the runbook describes it --------------------------------------------------------------
def test_one_redacted_line_beside_a_clear_one_passes_the_log_row():
    rows = _logged(FakeRuntime(core_ml_lines="one_redacted"), "[espresso] compiled %s", "[coreml] loaded h0")
    assert rows[a.CORE_ML_LOGS_FOR_CLIENT]["passed"], rows
    assert "1 redacted" in rows[a.CORE_ML_LOGS_FOR_CLIENT]["detail"]


def test_lines_match_by_word_so_plane_is_not_ane():
    lines, _ = core_ml_log_lines("a plane took off\nmachinery\n[ANE] program loaded\nE5RT: ok")
    assert lines == ["[ANE] program loaded", "E5RT: ok"]
    rows = _logged(FakeRuntime(core_ml_lines="missing"), "[coreml] x", own="a plane took off; an arcane word")
    assert not rows[a.CORE_ML_LOGS_FOR_CLIENT]["passed"]  # substrings no longer count as Core ML's lines


def test_the_helper_processes_lines_count():
    rows = _logged(FakeRuntime(core_ml_lines="helper"), "[coreml] ANE program compiled for the client")
    assert rows[a.CORE_ML_LOGS_FOR_CLIENT]["passed"] and rows[a.UNIFIED_LOG_READABLE]["passed"]


@pytest.mark.parametrize("lines", ["redacted", "missing"])
def test_an_unreadable_log_fails_its_row_but_the_gate_records_a_caveat_instead_of_refusing(tmp_path, lines):
    rows = _logged(FakeRuntime(core_ml_lines=lines), "[coreml] loaded h0", "[espresso] plan built")
    assert not rows[a.CORE_ML_LOGS_FOR_CLIENT]["passed"]
    runtime = FakeRuntime(core_ml_lines=lines)  # its seeded verdicts: the row failed, as the probe finds
    assert a.CORE_ML_LOGS_FOR_CLIENT in runtime.failed_assumptions()
    assert a.CORE_ML_LOGS_FOR_CLIENT not in GATE_ASSUMPTIONS
    evidence = check_variants(runtime, _variants(tmp_path))
    assert "would be missed" in evidence["h0"]["log_caveat"] and evidence["h0"]["ane_ops"] > 0
    clear = check_variants(FakeRuntime(), _variants(tmp_path / "clear"))  # control: a readable log, no caveat
    assert clear["h0"]["log_caveat"] == ""


# ---- item 8: the plan's share reaches the pricing -----------------------------------------------------------------
def test_a_plan_with_most_compute_operations_off_the_ane_is_not_priced_as_ane_attention(tmp_path):
    few = FakeRuntime(default=FakeFunction(compute_ops=12, compute_ops_on_ane=2))
    pkg = _variants(tmp_path, ("h0",))["h0"]
    with pytest.raises(AnelabInputError, match=r"2 of its 12 compute operations .* below 50%"):
        require_ane_placement(few, pkg, "cpu_and_ne")
    placed = require_ane_placement(FakeRuntime(default=FakeFunction(compute_ops=12, compute_ops_on_ane=12)), pkg)
    assert placed.compute_share == 1.0 >= MIN_COMPUTE_SHARE  # control
    assert placed.to_dict()["compute_share"] == 1.0


# ---- item 9: the probe's ANE verdicts are the ANE's only when its graphs run there --------------------------------
def test_every_check_after_the_placement_row_needs_it_in_the_ane_child():
    from anelab.runtimes.coreml import probe

    names = [name for name, _, _ in probe.CHECKS]
    assert names.index(a.PROBE_ON_ANE) < names.index(a.FP32_FEEDS_FP16_INPUTS)
    assert a.assumption(a.PROBE_ON_ANE).compute_units == a.ANE_ONLY
    source = Path(probe.__file__).read_text()
    assert "needs = (*needs, a.PROBE_ON_ANE) if on_ane_first else needs" in source


def test_the_placement_check_fails_on_a_plan_without_neural_engine_work(tmp_path):
    from anelab.runtimes.coreml.probe import _Probe, _probe_on_ane

    class P(_Probe):
        def __init__(self, runtime, compiled):
            self.runtime, self.units, self.compiled = runtime, "cpu_and_ne", compiled

    compiled = tmp_path / "probe.mlmodelc"
    compiled.mkdir()
    on_cpu = FakeRuntime({"c2": FakeFunction(assignment={"neural_engine": 0, "gpu": 0, "cpu": 40})})
    on_cpu._sources[str(compiled)] = str(tmp_path / "c2.mlpackage")
    with pytest.raises(AssertionError, match="would be the CPU's"):
        _probe_on_ane(P(on_cpu, compiled))
    on_ane = FakeRuntime({"c2": FakeFunction()})
    on_ane._sources[str(compiled)] = str(tmp_path / "c2.mlpackage")
    assert "compute operations on the Neural Engine" in _probe_on_ane(P(on_ane, compiled))  # control


# ---- item 10: a merged plan is read for the function asked --------------------------------------------------------
def test_a_plan_listing_every_function_of_a_merged_package_is_read_for_its_function(monkeypatch, tmp_path):
    fake = FakeRuntime({"h0": FakeFunction(assignment={"neural_engine": 10, "gpu": 0, "cpu": 5}),
                        "h2": FakeFunction(assignment={"neural_engine": 30, "gpu": 0, "cpu": 5})})  # fmt: skip
    merged = tmp_path / "merged.mlmodelc"
    merged.mkdir()
    fake._sources[str(merged)] = str(tmp_path / "merged.mlpackage")
    monkeypatch.setattr(fake, "_functions_in", lambda package: ["h0", "h2"])
    assert fake.plan_path(merged, "cpu_and_ne")["neural_engine"] == 40  # the whole program, as the old row summed
    assert fake.plan_path(merged, "cpu_and_ne", function="h0")["neural_engine"] == 10
    source = (ANELAB / "runtimes" / "coreml" / "probe.py").read_text()
    assert 'function="h0" if kind == "merged" else None' in source


# ---- item 11: every probe row is asked for by the code that relies on it ------------------------------------------
# rows no measuring code asks for, and who reads them instead: the fake's fidelity (tests stand in for the Mac only
# while they hold), or the probe itself (its later cpu_and_ne checks need the placement row)
READ_ELSEWHERE = {
    a.UNSUPPORTED_DTYPE_REFUSED: "runtimes/coreml/coreml_fake.py",
    a.READ_ONLY_REFUSED: "runtimes/coreml/coreml_fake.py",
    a.UNGATED_LOAD_AND_PLAN_SURVIVE: "runtimes/coreml/coreml_fake.py",
    a.PROBE_ON_ANE: "runtimes/coreml/probe.py",
}


def _askers(constant: str) -> list[str]:
    found = []
    for path in ANELAB.rglob("*.py"):
        if path.name in ("assumptions.py", "probe.py") or "fake" in path.name:
            continue
        if re.search(rf"\b{constant}\b", path.read_text()):
            found.append(str(path.relative_to(ANELAB)))
    return found


def test_every_probe_row_is_asked_for_by_the_code_that_relies_on_it():
    constants = {getattr(a, k): k for k in dir(a) if k.isupper() and isinstance(getattr(a, k), str)}
    unasked = [n for n in a.ASSUMPTION_NAMES if n not in READ_ELSEWHERE and not _askers(constants[n])]
    assert unasked == []
    for name, where in READ_ELSEWHERE.items():
        assert constants[name] in (ANELAB / where).read_text(), name
    assert _askers("NO_SUCH_ROW_CONSTANT") == []  # control: the search finds nothing for a name nobody uses


def test_opening_a_stateful_sidecar_asks_for_its_rows_before_any_clock():
    from anelab.runtimes.open import assumptions_relied_on

    class Meta:
        weights = "palettize4"

    assert assumptions_relied_on(Meta, True, "cpu_and_ne") == (
        a.INT32_INPUTS_ACCEPTED, a.FRESH_STATE_ZEROED, a.STATEFUL_PREDICTS_STABLE)  # fmt: skip
    assert assumptions_relied_on(Meta, True, "cpu_only") == (a.INT32_INPUTS_ACCEPTED, a.FRESH_STATE_ZEROED)
    assert assumptions_relied_on(Meta, False, "cpu_and_ne") == ()


def test_a_mac_lacking_a_zero_filled_fresh_state_refuses_to_make_one(tmp_path):
    from anelab.runtimes.interface import AssumptionFailedError

    fake = FakeRuntime(lacks={a.FRESH_STATE_ZEROED})
    pkg = _variants(tmp_path, ("c2",))["c2"]
    handle = fake.load(pkg, None, "cpu_only")
    with pytest.raises(AssumptionFailedError, match=a.FRESH_STATE_ZEROED):
        fake.make_state(handle)
    FakeRuntime().make_state(FakeRuntime().load(pkg, None, "cpu_only"))  # control


# ---- item 12: the first-use model's placement ---------------------------------------------------------------------
def test_a_first_use_model_kept_on_the_cpu_is_said_before_the_clock():
    on_cpu = FakeRuntime(first_use_on_ane=False)
    assert FIRST_USE_OFF_ANE in on_cpu.prepare_process("cpu_only") + on_cpu.prepare_process("cpu_and_ne")
    assert FIRST_USE_OFF_ANE not in FakeRuntime().prepare_process("cpu_and_ne")  # control


# ---- item 15: device comparisons allow the fp16 accumulation a Neural Engine may do ------------------------------
def test_the_fakes_ane_noise_grows_with_the_width_and_the_device_threshold_allows_it(monkeypatch):
    import numpy as np

    from anelab.runtimes.coreml import device_verify
    from anelab.runtimes.coreml.device_verify import FP16_ACCUMULATION_AT_576, device_threshold
    from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, relative_error

    fake = FakeRuntime()
    clean = {"attn_out": np.random.default_rng(0).standard_normal((8, 576)).astype(np.float32)}
    noisy = fake._as_returned(dict(clean), "h0", "cpu_and_ne")["attn_out"]
    error = relative_error(noisy, clean["attn_out"])
    assert error > RELATIVE_ERROR_THRESHOLD  # a 576-wide block on the fake ANE: beyond the old 1 % bound
    assert relative_error(fake._as_returned(dict(clean), "h0", "cpu_only")["attn_out"], clean["attn_out"]) < 1e-3

    class Meta:
        geometry = {"hidden_size": 576, "num_heads": 9, "head_dim": 64}

    monkeypatch.setattr(device_verify, "read_sidecar_metadata", lambda pkg: Meta)
    bound, why = device_threshold("x.mlpackage", "cpu_and_ne")
    assert bound == pytest.approx(RELATIVE_ERROR_THRESHOLD + FP16_ACCUMULATION_AT_576) and error < bound
    assert "576" in why
    assert device_threshold("x.mlpackage", "cpu_only")[0] == RELATIVE_ERROR_THRESHOLD  # control: no ANE, no allowance
