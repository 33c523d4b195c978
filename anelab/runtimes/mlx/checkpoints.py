"""Whole checkpoints written by mlx-lm itself: a config -> mlx-lm's model with seeded random weights -> its tensors
in the Hugging Face layout, checked by loading the directory back through mlx-lm's own reader (``sanitize``).

mlx-lm keeps some tensors in its own layout and converts a Hugging Face checkpoint on load (its ``sanitize``):
Qwen3-MoE's experts stacked into ``switch_mlp``; Qwen 3.5's ``model.language_model.`` prefix, its conv1d
kernels moved to channels-last and its zero-centred norms stored as 1 + w. ``HF_LAYOUT`` undoes that per
model_type (one entry each; identity for the families mlx-lm reads as they are), so the directory is what
transformers' ``save_pretrained`` writes and anelab reads — and the round trip through mlx-lm proves it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.runtimes.mlx.mlx_model import mlx_core

NORM_NOISE = 0.1  # random norm weights: 1 + N(0, 0.1) as mlx-lm applies them (zero-centred ones: N(0, 0.1))

# qwen3_5's zero-centred norms, as its sanitize lists them (mlx_lm/models/qwen3_5.py TextModel.sanitize)
_QWEN3_5_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                  ".q_norm.weight", ".k_norm.weight")  # fmt: skip


def _identity(name: str, value, config: dict) -> list[tuple[str, object]]:
    return [(name, value)]


def _qwen3_moe(name: str, value, config: dict) -> list[tuple[str, object]]:
    """``model.layers.L.mlp.switch_mlp.P.weight`` [E, ...] -> ``model.layers.L.mlp.experts.e.P.weight``."""
    if ".mlp.switch_mlp." not in name:
        return [(name, value)]
    prefix, _, param = name.partition(".switch_mlp.")
    return [(f"{prefix}.experts.{e}.{param}", value[e]) for e in range(value.shape[0])]


def _qwen3_5(name: str, value, config: dict) -> list[tuple[str, object]]:
    """mlx-lm's ``language_model.model.`` -> ``model.language_model.``; conv1d [C, K, 1] -> [C, 1, K]; the
    zero-centred norms stored as w (mlx-lm adds 1 on load)."""
    if name.endswith("conv1d.weight"):
        value = value.moveaxis(2, 1)
    elif value.ndim == 1 and any(name.endswith(suffix) for suffix in _QWEN3_5_NORMS):
        value = value - 1.0
    if name.startswith("language_model.model."):
        name = "model.language_model." + name.removeprefix("language_model.model.")
    elif name.startswith("language_model."):
        name = name.removeprefix("language_model.")
    return [(name, value)]


HF_LAYOUT: dict[str, Callable] = {
    "llama": _identity,
    "mistral": _identity,
    "qwen2": _identity,
    "qwen3": _identity,
    "qwen3_moe": _qwen3_moe,
    "gemma3_text": _identity,
    "qwen3_5": _qwen3_5,
}


def _randomised_norms(model, seed: int) -> None:
    """Every 1-D norm weight perturbed (mlx-lm initialises them to ones, or zeros when zero-centred)."""
    mx = mlx_core()
    from mlx.utils import tree_flatten, tree_unflatten

    keys = iter(mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters()))))
    updates = []
    for name, value in tree_flatten(model.parameters()):
        key = next(keys)
        if value.ndim == 1 and "norm" in name.split(".")[-2]:
            noise = NORM_NOISE * mx.random.normal(value.shape, key=key)
            updates.append((name, value + noise.astype(value.dtype)))
    model.update(tree_unflatten(updates))


def write_mlx_lm_checkpoint(directory: str | os.PathLike, config: dict, *, seed: int = 0,
                            dtype: str = "float32") -> Path:  # fmt: skip
    """Write ``config`` (a Hugging Face config.json) and mlx-lm's model of it with random weights from ``seed``
    into ``directory`` in the Hugging Face layout (one ``model.safetensors`` of ``dtype``); refuses a model_type
    without an ``HF_LAYOUT`` entry and fails if mlx-lm does not read the directory back to the same tensors."""
    mx = mlx_core()
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, load_model  # load_model's own default class lookup

    model_type = config["model_type"]
    if model_type not in HF_LAYOUT:
        raise AnelabInputError(
            f"no Hugging Face layout for model_type {model_type!r}; writable: {', '.join(HF_LAYOUT)}"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=False)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    _randomised_norms(model, seed)
    model.set_dtype(getattr(mx, dtype))
    source = dict(tree_flatten(model.parameters()))
    tensors = {}
    for name, value in source.items():
        tensors.update(HF_LAYOUT[model_type](name, value, config))
    mx.save_safetensors(str(directory / "model.safetensors"), tensors, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2, sort_keys=True))
    read, _ = load_model(directory)
    back = dict(tree_flatten(read.parameters()))
    differ = sorted(n for n in source if n not in back or not mx.array_equal(back[n], source[n]).item())
    if differ or set(back) != set(source):
        raise AssertionError(
            f"mlx-lm reads {directory} back differently: {(differ or sorted(set(back) ^ set(source)))[:3]}"
        )
    return directory
