"""The streaming whole-model forward: layer-major prefill equals chunk-major bit for bit; weights stay in their files.

Layer-major prefill reads each layer's weights once (every chunk threaded through that layer's cache),
decode reads them per step, the LM head in vocabulary blocks and the embedding rows on demand, all
through memory maps whose pages are released after use.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from anelab.arms.arm_comparison import compare_runs
from anelab.arms.arm_runs import Arm, Perturbation, run_arm, run_arms
from anelab.arms.sidecars import open_sidecars
from anelab.checkpoints.checkpoint import load_checkpoint, write_checkpoint_directory
from anelab.checkpoints.safetensors_io import LazyTensor, MappedTensor, SafetensorsFile, to_float32, write_safetensors
from anelab.checkpoints.whole_model import load_model, write_model_checkpoint
from anelab.core.decoder import linear, random_head_weights, random_layer_weights
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import random_attention_weights
from anelab.sidecar.export import export_sidecars

CHUNK, PROMPT, DECODE = 4, 10, 3  # chunk starts 0, 4, 8: the last chunk partial
GEOMETRY = AttentionGeometry("qwen3", 32, 2, 1, 16, num_layers=3, full_attention_layers=(0, 1, 2))


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")
    g = GEOMETRY
    attention = {i: random_attention_weights(g, i, 4) for i in range(3)}
    layers = {i: random_layer_weights(i, 32, 40, 4) for i in range(3)}
    head = random_head_weights(48, 32, 4, tied=False)
    path = write_model_checkpoint(root / "m", g, attention, layers, head, model_type="qwen3", dtype="BF16", shards=3)
    export_sidecars(load_checkpoint(path), root / "sidecars", CHUNK, [0, CHUNK, 2 * CHUNK])
    return root, load_model(path)


@pytest.mark.parametrize(
    "arm",
    [Arm("reference"), Arm("sidecar", "sidecar"), Arm("shifted", perturbation=Perturbation(1, "rope_shifted"))],
    ids=lambda a: a.name,
)
def test_layer_major_prefill_equals_chunk_major_bit_for_bit(bf16_model, arm):
    root, model = bf16_model
    sidecars = open_sidecars(root / "sidecars", model, PROMPT) if arm.attention == "sidecar" else None
    prompt = np.random.default_rng(2).integers(0, model.vocab_size, PROMPT)
    runs = [
        run_arm(model, prompt, arm, decode=DECODE, chunk=CHUNK, sidecars=sidecars, order=order)
        for order in ("layer", "chunk")
    ]
    assert np.array_equal(runs[0].hidden, runs[1].hidden)
    assert np.array_equal(runs[0].logits, runs[1].logits) and np.array_equal(runs[0].tokens, runs[1].tokens)
    if arm.attention == "reference":  # negative control: other arithmetic (a chunk of 2) is not bit-identical
        other = run_arm(model, prompt, arm, decode=1, chunk=2)
        assert not np.array_equal(other.hidden, runs[0].hidden)
    with pytest.raises(AnelabInputError, match="prefill order"):
        run_arm(model, prompt, arm, decode=1, chunk=CHUNK, sidecars=sidecars, order="diagonal")


def test_arms_decoding_in_lockstep_equal_each_arm_alone_and_share_each_weight_read(bf16_model, monkeypatch):
    root, model = bf16_model
    sidecars = open_sidecars(root / "sidecars", model, PROMPT)
    prompt = np.random.default_rng(3).integers(0, model.vocab_size, PROMPT)
    arms = [Arm("reference"), Arm("sidecar", "sidecar"), Arm("shifted", perturbation=Perturbation(1, "rope_shifted"))]
    alone = {arm.name: run_arm(model, prompt, arm, decode=DECODE, sidecars=sidecars) for arm in arms}
    reads = []
    real_layer = type(model).layer
    monkeypatch.setattr(type(model), "layer", lambda self, i: reads.append(i) or real_layer(self, i))
    together = run_arms(model, prompt, arms, decode=DECODE, sidecars=sidecars, resident_budget=0)  # streamed
    for arm in arms:
        a, b = alone[arm.name], together[arm.name]
        assert np.array_equal(a.hidden, b.hidden) and np.array_equal(a.logits, b.logits)
        assert np.array_equal(a.tokens, b.tokens)
    # control: the arms do differ, so equal runs are not equal by construction
    assert not np.array_equal(together["reference"].logits, together["sidecar"].logits)
    # the prefill reads each layer once for all three arms, and so does each decode step
    assert len(reads) == model.num_layers * DECODE
    reads.clear()  # resident (the default budget): each layer read once for the whole run, the same results
    resident = run_arms(model, prompt, arms, decode=DECODE, sidecars=sidecars)
    assert len(reads) == model.num_layers and np.array_equal(resident["shifted"].logits, together["shifted"].logits)
    with pytest.raises(AnelabInputError, match="arm names must differ"):
        run_arms(model, prompt, [Arm("reference"), Arm("reference")], decode=1, chunk=CHUNK)


def test_per_layer_differences_computed_during_the_prefill_equal_those_from_kept_states(bf16_model):
    """compare-arms keeps no [L, P, D] hidden states: the differences it computes as each layer finishes are
    the ones compare_runs computes from kept states, bit for bit; a pair never asked for is refused."""
    root, model = bf16_model
    sidecars = open_sidecars(root / "sidecars", model, PROMPT)
    prompt = np.random.default_rng(4).integers(0, model.vocab_size, PROMPT)
    arms = [Arm("reference"), Arm("sidecar", "sidecar")]
    kept = run_arms(model, prompt, arms, decode=DECODE, sidecars=sidecars)
    lean = run_arms(model, prompt, arms, decode=DECODE, sidecars=sidecars, keep_hidden=False,
                    layer_pairs=(("reference", "sidecar"),))  # fmt: skip
    assert lean["sidecar"].hidden is None and lean["reference"].hidden is None
    want, got = compare_runs(kept["reference"], kept["sidecar"]), compare_runs(lean["reference"], lean["sidecar"])
    assert got.layer_diffs == want.layer_diffs and len(got.layer_diffs) == model.num_layers
    assert got.step_logits_diffs == want.step_logits_diffs
    assert min(want.layer_diffs) > 0  # control: the arms differ at every layer, so the equality is not vacuous
    with pytest.raises(AnelabInputError, match="no differences for this pair"):
        compare_runs(lean["sidecar"], lean["reference"])
    with pytest.raises(AnelabInputError, match="arm 'folded', which is not run"):
        run_arms(model, prompt, arms, decode=1, sidecars=sidecars, layer_pairs=(("reference", "folded"),))


def test_the_head_stays_in_its_file_and_reads_rows_and_blocks(bf16_model):
    _, model = bf16_model
    head = model.head()
    assert isinstance(head.embed_tokens, MappedTensor) and isinstance(head.lm_head, MappedTensor)
    stored = head.lm_head.file.view("lm_head.weight")
    exact = stored.astype(np.float32)  # ml_dtypes' own cast: independent of the bit copy in to_float32
    assert np.array_equal(head.lm_head[[5, 1]], exact[[5, 1]]) and np.array_equal(np.asarray(head.lm_head), exact)
    x = np.random.default_rng(0).standard_normal((2, 32)).astype(np.float32)
    blocked = linear(x, head.lm_head, block_bytes=5 * 32 * 8)  # 5 rows (their float64 bytes) at a time, the last short
    want = x.astype(np.float64) @ exact.T.astype(np.float64)
    assert np.abs(blocked - want).max() < 1e-5 * np.abs(want).max()
    wrong = stored.view(np.uint16).astype(np.float32)  # negative control: the raw bits read as numbers
    assert np.abs(x @ wrong.T - want).max() > 1.0


def test_bf16_conversion_matches_the_cast_and_rejects_nothing_else():
    values = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    for dtype in (ml_dtypes.bfloat16, np.float16, np.float32):
        stored = values.astype(dtype)
        assert np.array_equal(to_float32(stored), stored.astype(np.float32))
        assert to_float32(stored).dtype == np.float32


def _rss_file_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def test_mapped_pages_are_released_from_resident_memory(tmp_path):
    """Reading a 32 MiB tensor through the map leaves resident memory where it was; touching the same map
    without the release (negative control) raises it by about the tensor's size."""
    path = tmp_path / "big.safetensors"
    write_safetensors(path, {"w": np.ones((4096, 4096), np.float32)}, "BF16")
    file = SafetensorsFile.open(path)
    tensor = MappedTensor(file, "w")
    before = _rss_file_kib()
    for r0 in range(0, 4096, 512):
        assert tensor[r0 : r0 + 512].sum() == 512 * 4096
    assert _rss_file_kib() - before < 4 * 1024
    touched = float(file.view("w").astype(np.float32).sum())
    assert touched == 4096 * 4096 and _rss_file_kib() - before > 24 * 1024
    file.release()
    assert _rss_file_kib() - before < 4 * 1024


def test_the_writer_makes_lazy_tensors_in_turn_and_checks_their_shape(tmp_path):
    values = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)}
    made = []
    lazy = {name: LazyTensor(v.shape, lambda v=v, name=name: made.append(name) or v) for name, v in values.items()}
    config = {"model_type": "llama"}
    eager_dir = write_checkpoint_directory(tmp_path / "eager", config, values, dtype="BF16", shards=2)
    lazy_dir = write_checkpoint_directory(tmp_path / "lazy", config, lazy, dtype="BF16", shards=2)
    assert made == ["a", "b"]
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (eager_dir / name).read_bytes() == (lazy_dir / name).read_bytes()
    assert json.loads((lazy_dir / "model.safetensors.index.json").read_text())["weight_map"]["b"].startswith(
        "model-0000"
    )
    bad = {"a": LazyTensor((2, 3), lambda: np.ones((3, 2), np.float32))}
    with pytest.raises(AnelabInputError, match="made with shape"):
        write_checkpoint_directory(tmp_path / "bad", config, bad)
    assert not (tmp_path / "bad").exists()


def test_the_random_model_writer_makes_a_model_that_runs(tmp_path):
    """The benchmarks' writer: a loadable, runnable checkpoint; ``tile`` repeats one seeded block per tensor
    (the i.i.d. default does not — the negative control)."""
    from anelab.checkpoints.whole_model import write_random_model

    g = AttentionGeometry("llama", 32, 2, 1, 16, num_layers=2, full_attention_layers=(0, 1))
    tiled = load_model(write_random_model(tmp_path / "t", g, vocab=40, intermediate=48, tile=100, shards=2))
    plain = load_model(write_random_model(tmp_path / "p", g, vocab=40, intermediate=48))
    q_tiled, q_plain = (m.attention(1).q_proj.ravel() for m in (tiled, plain))
    assert np.array_equal(q_tiled[100:200], q_tiled[:100]) and not np.array_equal(q_plain[100:200], q_plain[:100])
    assert np.array_equal(q_tiled[:100], q_plain[:100])  # the same seeded values, stored bf16 either way
    run = run_arm(tiled, np.arange(5), Arm("reference"), decode=2, chunk=4)
    assert np.isfinite(run.logits).all() and run.tokens.shape == (2,)
