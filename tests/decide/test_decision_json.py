"""decision.json and report.md stay what they were when ``decide`` passed dicts (issue 39: typed objects inside).

``tests/decide/golden/<case>/`` holds the decision.json and report.md that main's code (df85c67, before the
Decision was typed) wrote for three small runs of the Llama-3.2-1B-shaped test model: the seed's GPU path at
fp16 (``depends``), int8 weights with the user's GPU number (compression cost, ``yours``), and the first run
measured on a fake Mac (``MeasuredPackage``). Each run is repeated here and compared key for key: every key,
string, integer, boolean and null exactly, floats to within ``FLOAT_RELATIVE_TOLERANCE`` (the arms' and verify's
numbers run through BLAS, whose kernels differ between machines), time stamps as ``<TIME>``, a record's git
revision as any text, a package's content hash as a hash (its metadata holds its export time). Temporary paths are written as ``<TMP>``.

Added since (issue 43, after df85c67): the offload split, ``decision.json``'s ``offload_split`` (and the split's
keys in a whole-model A/B record) and report.md's section "Which blocks go to the ANE"; each is required present
and then set aside before the comparison (tests/decide/test_decide.py and tests/planner/ test what they hold).

Regenerate (only with the code the files must stand for): ``python -c "import sys; sys.path[:0]=['tests/decide'];
import test_decision_json as t; t.write_golden()"``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from anelab.checkpoints.checkpoint import Checkpoint
from anelab.checkpoints.default import make_llama32_1b_shaped
from anelab.decide.decision import DecideConfig, decide

GOLDEN = Path(__file__).with_name("golden")
CASES = ("seed-gpu-fp16", "int8-yours", "measured-fake-mac")
CHUNK, PROMPT = 32, 64
# verify errors and arm differences move in their third digit between BLAS kernels (test_decide's
# VERIFY_ERROR_RELATIVE_TOLERANCE); the planner's numbers are plain Python arithmetic and agree to far better
FLOAT_RELATIVE_TOLERANCE = 1e-2
# the sidecar arm against the reference arm: a difference of two float32 forwards, whose size is the fp16 roundings
# the last float32 bits decide; core/matmul (products accumulated in float64, after df85c67) moved them 4-10 % here
# (logits 1.87e-4 -> 1.79e-4, a near-tie band 0.0239 -> 0.0215), so these compare at ARM_DIFFERENCE_TOLERANCE
ARM_DIFFERENCES = ("logits_relative_difference", "max_step_logits_difference", "layer_differences", "greedy_summary")
ARM_DIFFERENCE_TOLERANCE = 0.25
TIMESTAMP = re.compile(r"\d{8}T\d{6}Z|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:[+-]\d\d:\d\d|Z)?")
SHA256 = re.compile(r"[0-9a-f]{64}")
REPORT_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?")


class _Words:
    """The test model has no tokenizer: one id per word of the README (as test_decide's int8 test)."""

    def encode(self, text):
        return np.array([sum(map(ord, w)) % 96 for w in text.split()], dtype=np.int64)

    def decode(self, ids):
        return " ".join(f"w{int(i)}" for i in ids)


def run_cases(root: Path) -> dict[str, Path]:
    """The three runs under ``root`` (model in ``root/model``): case name -> its output directory."""
    from anelab.runtimes.coreml.coreml_fake import FakeFunction, FakeRuntime

    model = make_llama32_1b_shaped(root / "model" / "llama-1b-shaped", scale=8, num_layers=2, vocab=96,
                                   intermediate=64)  # fmt: skip
    outs = {name: root / name for name in CASES}
    decide(DecideConfig(model, PROMPT, outs["seed-gpu-fp16"], design="dense", chunk=CHUNK, gpu_runtime="tinytitan"))
    with mock.patch.object(Checkpoint, "tokenizer", lambda self: _Words()):
        decide(DecideConfig(model, PROMPT, outs["int8-yours"], design="dense", chunk=CHUNK, gpu_runtime="tinytitan",
                            weights="int8", gpu_prefill_seconds=5.0))  # fmt: skip
    shutil.copytree(outs["seed-gpu-fp16"], outs["measured-fake-mac"], ignore=shutil.ignore_patterns("measured"))
    functions = {f"h{s}": FakeFunction(cold_load_s=0.25 + s / 1000, predict_s={"cpu_and_ne": 0.01}) for s in (0, 32)}
    fake = FakeRuntime(functions)
    config = DecideConfig(model, PROMPT, outs["measured-fake-mac"], design="dense", chunk=CHUNK, measure=True,
                          runtime=fake, repeats=2)  # fmt: skip
    config.clock = fake.clock
    decide(config)
    return outs


def _normalised(text: str, root: Path) -> str:
    return text.replace(str(root.resolve()), "<TMP>").replace(str(root), "<TMP>")


def _timeless(text: str) -> str:
    """A record's time stamps (its file name's and its own) as ``<TIME>``: the run's clock, not its result."""
    return TIMESTAMP.sub("<TIME>", text)


def write_golden() -> None:
    """Write ``golden/`` from the code in this checkout (see the module docstring: main's, before issue 39)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, out in run_cases(root).items():
            (GOLDEN / name).mkdir(parents=True, exist_ok=True)
            for file in ("decision.json", "report.md"):
                (GOLDEN / name / file).write_text(_normalised((out / file).read_text(), root))


def same_record(actual, expected, where: str = "decision") -> list[str]:
    """Where ``actual`` differs from ``expected`` (JSON values): keys, strings, integers, booleans and nulls
    exactly, floats to within ``FLOAT_RELATIVE_TOLERANCE`` (an arm difference's, ``ARM_DIFFERENCES``, to within
    ``ARM_DIFFERENCE_TOLERANCE``, its text's words exactly); an empty list when they are the same record."""
    arm_difference = any(f".{key}" in where for key in ARM_DIFFERENCES)
    if arm_difference and isinstance(expected, str):
        return [f"{where}: {line}" for line in same_report(actual, expected, ARM_DIFFERENCE_TOLERANCE)]
    if arm_difference and isinstance(expected, float) and type(actual) is float:
        close = actual == pytest.approx(expected, rel=ARM_DIFFERENCE_TOLERANCE)
        return [] if close else [f"{where}: {actual!r} != {expected!r}"]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or list(actual) != list(expected):
            return [f"{where}: keys {list(actual) if isinstance(actual, dict) else actual!r} != {list(expected)}"]
        return [d for k in expected for d in same_record(actual[k], expected[k], f"{where}.{k}")]
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return [f"{where}: {actual!r} != {expected!r}"]
        return [
            d for i, (a, e) in enumerate(zip(actual, expected, strict=True)) for d in same_record(a, e, f"{where}[{i}]")
        ]
    if where.endswith(".sha256"):  # a package's content hash: its metadata holds its export time
        return [] if all(isinstance(x, str) and SHA256.fullmatch(x) for x in (actual, expected)) else [where]
    if where.endswith(".git_revision"):  # a record's provenance: the checkout that ran it
        return [] if isinstance(actual, str) and isinstance(expected, str) else [where]
    if isinstance(expected, float) and type(actual) is float:
        same = (math.isnan(actual) and math.isnan(expected)) or actual == pytest.approx(
            expected, rel=FLOAT_RELATIVE_TOLERANCE
        )
        return [] if same else [f"{where}: {actual!r} != {expected!r}"]
    return [] if type(actual) is type(expected) and actual == expected else [f"{where}: {actual!r} != {expected!r}"]


def same_report(actual: str, expected: str, arm_tolerance: float = ARM_DIFFERENCE_TOLERANCE) -> list[str]:
    """Where report.md differs: each line's words exactly, its numbers to within a tenth (a formatted verify error
    or arm difference may round the other way between machines); a line of the greedy text (an arm difference's
    near-tie band) to within ``arm_tolerance``."""
    out = []
    a_lines, e_lines = actual.splitlines(), expected.splitlines()
    if len(a_lines) != len(e_lines):
        return [f"{len(a_lines)} lines != {len(e_lines)}"]
    for i, (a, e) in enumerate(zip(a_lines, e_lines, strict=True)):
        rel = arm_tolerance if "greedy agreement" in e else 0.1
        a_nums, e_nums = REPORT_NUMBER.findall(a), REPORT_NUMBER.findall(e)
        words_differ = REPORT_NUMBER.sub("#", a) != REPORT_NUMBER.sub("#", e) or len(a_nums) != len(e_nums)
        if words_differ or any(
            float(x.replace(",", "")) != pytest.approx(float(y.replace(",", "")), rel=rel, abs=1e-3)
            for x, y in zip(a_nums, e_nums, strict=True)
        ):
            out.append(f"line {i + 1}: {a!r} != {e!r}")
    return out


SPLIT_SECTION = "## Which blocks go to the ANE"


AB_SPLIT_KEYS = ("gdn_layers_on_sidecars", "mlp_layers_on_sidecars", "planned", "split")  # an A/B record's, since


def without_the_split(record: dict) -> dict:
    """``record`` (a decision.json) without the offload split added after df85c67 (required present): the key
    ``offload_split``, and the split's keys in a whole-model A/B record's parameters."""
    assert record.get("offload_split"), "decision.json lacks the offload split"

    def strip(value):
        if isinstance(value, dict):
            if "timings_are_a_macs" in value:  # an A/B record's parameters
                assert all(k in value for k in AB_SPLIT_KEYS), "an A/B record lacks the split's keys"
                value = {k: v for k, v in value.items() if k not in AB_SPLIT_KEYS}
            return {k: strip(v) for k, v in value.items()}
        return [strip(v) for v in value] if isinstance(value, list) else value

    return strip({k: v for k, v in record.items() if k != "offload_split"})


def report_without_the_split(text: str) -> str:
    """report.md without its offload-split section (required present): the blank line before its heading, the
    heading, a blank line and its list."""
    lines = text.splitlines(keepends=True)
    start = lines.index(SPLIT_SECTION + "\n")
    end = next((i for i in range(start + 2, len(lines)) if not lines[i].startswith("- ")), len(lines))
    assert end > start + 2, "the offload-split section lists nothing"
    return "".join(lines[: start - 1] + lines[end:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("golden-runs")
    return root, run_cases(root)


@pytest.mark.parametrize("case", CASES)
def test_decision_json_is_the_one_main_wrote_key_for_key(runs, case):
    root, outs = runs
    actual = json.loads(_timeless(_normalised((outs[case] / "decision.json").read_text(), root)))
    expected = json.loads(_timeless((GOLDEN / case / "decision.json").read_text()))
    assert same_record(without_the_split(actual), expected) == []
    text = (outs[case] / "decision.json").read_text()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True)  # written as before: sorted, indent 2


@pytest.mark.parametrize("case", CASES)
def test_report_md_is_the_one_main_wrote(runs, case):
    root, outs = runs
    actual = report_without_the_split(_normalised((outs[case] / "report.md").read_text(), root))
    assert same_report(actual, (GOLDEN / case / "report.md").read_text()) == []


def test_the_comparisons_notice_a_changed_key_value_or_line():
    """Negative controls: a renamed key, a changed string, an integer for a float, a float beyond the tolerance
    and a changed word of the report are each caught; a float within it is not."""
    expected = json.loads((GOLDEN / "seed-gpu-fp16" / "decision.json").read_text())
    renamed = json.loads(json.dumps(expected))
    renamed["verdict"]["choice"] = renamed["verdict"].pop("decision")
    changed = json.loads(json.dumps(expected))
    changed["checkpoint"]["rope"] = "default"
    typed = json.loads(json.dumps(expected))
    typed["plan"]["chunk"] = float(typed["plan"]["chunk"])
    moved = json.loads(json.dumps(expected))
    moved["verdict"]["predicted_ratio"] *= 1.05
    nudged = json.loads(json.dumps(expected))
    nudged["verdict"]["predicted_ratio"] *= 1.001
    assert same_record(expected, expected) == [] and same_record(nudged, expected) == []
    arms_moved = json.loads(json.dumps(expected))
    arms_moved["evidence"]["arms"]["logits_relative_difference"] *= 1.5  # beyond an arm difference's tolerance
    arms_nudged = json.loads(json.dumps(expected))
    arms_nudged["evidence"]["arms"]["logits_relative_difference"] *= 1.1  # within it
    worded = json.loads(json.dumps(expected))
    worded["evidence"]["arms"]["greedy_summary"] = worded["evidence"]["arms"]["greedy_summary"].replace("raw", "all")
    assert same_record(arms_nudged, expected) == []
    for wrong in (renamed, changed, typed, moved, arms_moved, worded):
        assert same_record(wrong, expected) != []
    report = (GOLDEN / "seed-gpu-fp16" / "report.md").read_text()
    assert same_report(report, report) == []
    assert same_report(report.replace("## Designs", "## Design"), report) != []
    assert same_report(report.replace("chunk 32", "chunk 64"), report) != []
