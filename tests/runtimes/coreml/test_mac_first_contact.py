"""First contact on a Mac, fourth reading (issue 41): nothing but measured work inside a clock, an A/B judged by a
bound that knows its reference's precision, and the GPU arm run as mlx-lm runs it — on a fake Mac no kinder than a
real one (its ``versions()`` spawns processes as ``sysctl`` and ``sw_vers`` do, its plan may list every function).

Checkpoints are written by mlx-lm itself (``runtimes.mlx.checkpoints``), in fp32 and in bf16.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import gated_copy

from anelab.arms import prefill_ab
from anelab.arms.prefill_ab import ab_request, correctness_bound, judge_correctness, run_ab
from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.runtimes import interface
from anelab.runtimes.coreml import timing
from anelab.runtimes.coreml.block_ab import block_inputs
from anelab.runtimes.coreml.coreml_fake import FakeFunction, FakeRuntime
from anelab.runtimes.mlx.checkpoints import write_mlx_lm_checkpoint
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD
from anelab.sidecar.export import export_sidecars

CHUNK, PROMPT = 8, 13
CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=2, rope_theta=5e5,
              hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              rms_norm_eps=1e-6, vocab_size=96, max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """dtype -> (mlx-lm checkpoint of that dtype, gated dense sidecars for a PROMPT-token prompt in chunks of CHUNK)."""
    root = tmp_path_factory.mktemp("first-contact")
    out = {}
    for dtype in ("float32", "bfloat16"):
        checkpoint = write_mlx_lm_checkpoint(root / dtype / "model", CONFIG, seed=1, dtype=dtype)
        export_sidecars(load_checkpoint(checkpoint), root / dtype / "sidecars", CHUNK, [0, CHUNK])
        out[dtype] = (checkpoint, gated_copy(root / dtype / "sidecars", root / dtype / "gated"))
    return out


def _fake_mac(**kwargs) -> tuple[FakeRuntime, object]:
    functions = {f"h{s}": FakeFunction(cold_load_s=0.5, predict_s={"cpu_and_ne": 0.04}) for s in (0, CHUNK)}
    fake = FakeRuntime(functions, numerics=True, **kwargs)
    return fake, (lambda: time.perf_counter() + fake.clock())  # MLX runs here in real time, Core ML on the fake's


class _Counter:
    """Subprocess spawns and package hashes, counted only while a timed region runs (``inside``)."""

    def __init__(self, monkeypatch):
        self.inside, self.spawns, self.hashes, self.regions = False, [], [], 0
        real_init, real_hash = subprocess.Popen.__init__, interface.package_content_hash

        def spawn(popen, args, *a, **k):
            if self.inside:
                self.spawns.append(args)
            return real_init(popen, args, *a, **k)

        def hashed(pkg):
            if self.inside:
                self.hashes.append(str(pkg))
            return real_hash(pkg)

        monkeypatch.setattr(subprocess.Popen, "__init__", spawn)
        # every module that holds the function (imports sit at module tops: each binds its own name)
        for module in [m for name, m in sys.modules.items() if name.startswith("anelab.") and m is not None]:
            if getattr(module, "package_content_hash", None) is real_hash:
                monkeypatch.setattr(module, "package_content_hash", hashed)

    def timed(self, fn):
        def run(*a, **k):
            self.regions += 1
            self.inside = True
            try:
                return fn(*a, **k)
            finally:
                self.inside = False

        return run


# ---- item 2: nothing but measured work inside a clock ----------------------------------------------------------
def test_the_fakes_versions_cost_what_a_macs_do():
    fake, _ = _fake_mac()
    before = fake.clock()
    assert fake.read_versions()["chip"] and fake.clock() - before == pytest.approx(3 * fake.versions_spawn_s)


def test_no_spawn_or_package_hash_inside_the_ab_s_timed_regions(made, tmp_path, monkeypatch):
    checkpoint, gated = made["float32"]
    fake, clock = _fake_mac()
    counter = _Counter(monkeypatch)
    monkeypatch.setattr(prefill_ab, "_time_gpu_arm", counter.timed(prefill_ab._time_gpu_arm))
    monkeypatch.setattr(prefill_ab, "_time_ane_arm", counter.timed(prefill_ab._time_ane_arm))
    fake.__dict__.pop("_versions", None)  # a fresh process: nothing resolved yet
    [result] = run_ab(ab_request(checkpoint, gated, [PROMPT], runtime=fake, clock=clock)).prompts
    assert counter.regions == 2 and len(result.results["ane_arm"]["loads"]) == 4  # both arms ran, loads timed
    assert counter.spawns == [] and counter.hashes == []
    # control: the counter sees a spawn and a hash made inside a region
    counter.timed(lambda: (fake.read_versions(), interface.package_content_hash(next(gated.iterdir()))))()
    assert len(counter.spawns) == 3 and len(counter.hashes) == 1


def test_no_spawn_or_package_hash_inside_time_predicts_timed_region(made, monkeypatch):
    _, gated = made["float32"]
    fake, clock = _fake_mac()
    counter = _Counter(monkeypatch)
    monkeypatch.setattr(timing, "measure", counter.timed(timing.measure))
    pkg = sorted(gated.glob("layer_*.mlpackage"))[0]
    geometry = load_checkpoint(made["float32"][0]).geometry
    record = timing.time_predict(fake, pkg, "h0", block_inputs(geometry, CHUNK, 0), ["cpu_and_ne", "cpu_only"],
                                 clock=fake.clock)  # fmt: skip
    assert counter.regions == 2 and all("median_s" in r for r in record["results"].values())
    assert counter.spawns == [] and counter.hashes == []


# ---- item 3: an A/B threshold that knows its reference's precision ------------------------------------------------
def test_a_bf16_checkpoints_ab_is_judged_against_fp32_within_a_bound_its_own_noise_cannot_cross(made, tmp_path):
    checkpoint, gated = made["bfloat16"]
    fake, clock = _fake_mac()
    [result] = run_ab(ab_request(checkpoint, gated, [PROMPT], runtime=fake, clock=clock)).prompts
    c = result.results["correctness"]
    assert result.record["parameters"]["mlx_dtype"] == "bfloat16"
    assert c["reference_precision_noise"] > 1e-4  # bf16 against fp32: not zero
    assert c["bound"] == pytest.approx(correctness_bound(c["reference_precision_noise"]))
    assert c["reference_precision_noise"] < c["bound"] and c["within_bound"]  # the reference itself passes
    # control: a hybrid off by more than the bound is rejected, NaN too
    want = np.linspace(1, 2, 96)
    for wrong in (want * (1 + 3 * c["bound"]), want * np.nan):
        assert not judge_correctness(wrong, want, want, CHUNK)["within_bound"]


def test_the_bound_grows_with_the_reference_noise_that_a_fixed_threshold_ignores():
    """Two bf16 paths (mlx-lm's and the hybrid's) each stray ~1e-2 from fp32 (measured on SmolLM2-135M at 512
    tokens: 1.27e-2 between them): a fixed 1e-2 between the two rejects a correct hybrid; the bound does not."""
    rng = np.random.default_rng(0)
    want32 = rng.standard_normal(4096)
    want16 = want32 * (1 + 1.1e-2 * rng.standard_normal(4096))  # mlx-lm's bf16 forward
    got = want32 * (1 + 1.1e-2 * rng.standard_normal(4096) + 1e-3 * rng.standard_normal(4096))  # the hybrid
    judged = judge_correctness(got, want16, want32, CHUNK)
    assert judged["logits_relative_difference"] > RELATIVE_ERROR_THRESHOLD  # what the old fixed threshold judged
    assert judged["within_bound"] and judged["against_fp32"] < judged["bound"]
    wrong = want32 * (1 + 8e-2 * rng.standard_normal(4096))  # control: 8 % off is still rejected
    assert not judge_correctness(wrong, want16, want32, CHUNK)["within_bound"]


# ---- item 14: the GPU arm as mlx-lm runs it --------------------------------------------------------------------
def test_the_gpu_arm_runs_inside_mlx_lms_wired_limit(made, monkeypatch):
    generate = importlib.import_module("mlx_lm.generate")  # the package's name "generate" is its function

    entered = []
    real = generate.wired_limit

    def spy(model, streams=None):
        entered.append(streams)
        return real(model, streams)

    monkeypatch.setattr(generate, "wired_limit", spy)
    checkpoint, gated = made["float32"]
    run_ab(ab_request(checkpoint, gated, [PROMPT]))
    assert len(entered) == 1 and entered[0]


def test_a_mac_whose_mlx_default_device_is_not_the_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(prefill_ab, "mlx_device", lambda: ("cpu", True))
    with pytest.raises(AnelabInputError, match="not the GPU"):
        prefill_ab.require_gpu_arm_device(on_mac=True)
    assert prefill_ab.require_gpu_arm_device(on_mac=False) == "cpu"  # off a Mac: said, not refused
    monkeypatch.setattr(prefill_ab, "mlx_device", lambda: ("gpu", True))
    assert prefill_ab.require_gpu_arm_device(on_mac=True) == "gpu"  # control


# ---- item 13: a GGUF checkpoint's whole-model A/B runs ---------------------------------------------------------
def test_a_gguf_checkpoints_ab_runs_mlx_lm_on_its_fp16_copy_and_decide_asks_for_it(made, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from test_gguf import write_gguf

    from anelab.decide import decision as decide_run
    from anelab.runtimes.mlx import from_gguf
    from anelab.runtimes.mlx.from_gguf import mlx_readable_path

    path = write_gguf(made["float32"][0], tmp_path / "m.gguf", "F32")
    export_sidecars(load_checkpoint(path), tmp_path / "sidecars", CHUNK, [0, CHUNK])
    with pytest.raises(AnelabInputError, match="GGUF"):  # what decide met before: mlx-lm's loader refuses the file
        run_ab(ab_request(path, tmp_path / "sidecars", [PROMPT]))
    copy = mlx_readable_path(load_checkpoint(path), tmp_path / "copies")
    assert mlx_readable_path(load_checkpoint(path), tmp_path / "copies") == copy  # written once
    [result] = run_ab(ab_request(path, tmp_path / "sidecars", [PROMPT], mlx_checkpoint=copy)).prompts
    assert result.record["parameters"]["mlx_checkpoint"] == str(copy)
    assert result.results["correctness"]["within_bound"]
    # decide's whole-model A/B hands mlx-lm that copy (its request, captured)
    asked = []
    monkeypatch.setattr(from_gguf, "MLX_COPY_DIR", tmp_path / "copies")
    monkeypatch.setattr(prefill_ab, "run_ab", lambda request: asked.append(request) or SimpleNamespace(prompts=[]))
    config = SimpleNamespace(prompt_tokens=PROMPT, clock=None, out=tmp_path / "out")
    opened = SimpleNamespace(checkpoint=load_checkpoint(path), runtime=None)
    with pytest.raises(ValueError):  # no prompt came back from the stand-in run_ab
        decide_run.whole_model_ab(config, opened, tmp_path / "sidecars")
    assert asked[0].mlx_checkpoint == copy
