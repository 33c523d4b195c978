"""mlx-lm's model of a checkpoint directory, opened for anelab: its decoder layers, each layer's softmax attention,
its caches, and the layers' outputs handed to a caller on the way (per-layer differences).

mlx-lm (``mlx_lm.utils.load_model``) reads the Hugging Face directory itself — config.json, the safetensors, its
own ``sanitize`` of each family's tensor names — so what runs here is mlx-lm's model of the checkpoint, not
anelab's. A decoder layer's softmax attention is its ``self_attn`` (mlx-lm's name in every family anelab exports
sidecars for); a Qwen 3.5 / Qwen3-Next linear-attention layer (``is_linear``) has ``linear_attn`` instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anelab.core.errors import AnelabInputError

MLX_DTYPES = ("float32", "float16", "bfloat16")


def mlx_core():
    """``mlx.core``, or a one-line refusal naming the install when MLX is missing."""
    try:
        import mlx.core as mx
        import mlx_lm  # noqa: F401  (the models)
    except ImportError as e:
        raise AnelabInputError(
            f"MLX is not installed here ({e}); 'make install' installs it (mlx[cpu] on Linux, mlx on macOS, mlx-lm)"
        ) from None
    return mx


def mlx_versions() -> dict[str, str]:
    """MLX's and mlx-lm's versions and the default device (what a record of an MLX timing carries)."""
    mx = mlx_core()
    import mlx_lm

    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "mlx_device": str(mx.default_device())}


def gpu_available() -> bool:
    """Whether MLX has a GPU here (Metal on a Mac; never with the CPU build on Linux)."""
    mx = mlx_core()
    return bool(mx.is_available(mx.gpu))


@dataclass
class MlxModel:
    """An mlx-lm model of one checkpoint directory.

    ``model``: mlx-lm's ``Model`` (called as ``model(tokens [1, n], cache=caches) -> logits [1, n, V]``);
    ``config``: config.json as mlx-lm read it; ``dtype``: the floating parameters' dtype name.
    """

    path: Path
    model: object
    config: dict
    dtype: str

    @property
    def parameter_bytes(self) -> int:
        """Bytes of every parameter array (all evaluated when the model is opened: mlx-lm holds them in memory)."""
        return int(sum(v.nbytes for _, v in _leaves(self.model.parameters())))

    @property
    def body(self):
        """The module that owns the decoder-layer list and the final norm (``model.model``: ``LlamaModel``,
        ``Qwen3_5TextModel``, ...)."""
        return self.model.model

    @property
    def decoder_layers(self) -> list:
        """The list the forward iterates (modified in place to install a wrapper)."""
        layers = getattr(self.body, "layers", None)
        if not isinstance(layers, list):
            raise AnelabInputError(
                f"{self.path}: mlx-lm's {type(self.model).__module__} keeps no decoder-layer list at model.model.layers; "
                "the hybrid cannot wrap its layers"
            )
        return layers

    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers)

    def attention_layers(self) -> tuple[int, ...]:
        """Layers whose decoder layer has a softmax attention (``self_attn``; not a linear-attention layer)."""
        return tuple(
            i
            for i, layer in enumerate(self.decoder_layers)
            if "self_attn" in _own(layer) and not getattr(_inner(layer), "is_linear", False)
        )

    @property
    def vocab_size(self) -> int:
        embed = _find_embedding(self.body)
        return int(embed.weight.shape[0])

    def make_cache(self) -> list:
        """mlx-lm's own caches for one prompt (``make_prompt_cache``: KVCache, RotatingKVCache, ArraysCache...)."""
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)


def _own(module) -> dict:
    """A module's own children (a wrapper's are those of the module it wraps)."""
    return dict(_inner(module))


def _inner(module):
    while "wrapped" in module and getattr(module, "is_wrapper", False):
        module = module["wrapped"]
    return module


def _find_embedding(body):
    embed = getattr(body, "embed_tokens", None)
    if embed is None:
        raise AnelabInputError("mlx-lm's model has no embed_tokens; the vocabulary size is unknown")
    return embed


def require_mlx_readable(path: str | os.PathLike) -> None:
    """Refuse (one line) a checkpoint mlx-lm's loader cannot open: a file, e.g. a GGUF file (llama.cpp's), where it
    opens ``<path>/config.json``. A missing path is left to the checkpoint reader, which names it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise AnelabInputError(
            f"mlx-lm cannot load {path}: it reads checkpoint directories (Hugging Face or MLX layout), not "
            f"{'GGUF files' if path.suffix.lower() == '.gguf' else 'files'}; give the model's directory (compare-arms "
            "runs a GGUF file on anelab's forward: --engine numpy)"
        )


def open_mlx_model(path: str | os.PathLike, *, dtype: str | None = None) -> MlxModel:
    """mlx-lm's model of the checkpoint at ``path`` (its weights read now), cast to ``dtype`` when given
    (``float32`` for a reference; default: the checkpoint's own dtypes, as a user runs it). Refuses (one line)
    a directory mlx-lm cannot load."""
    mx = mlx_core()
    from mlx_lm.utils import load_model

    path = Path(path)
    if dtype is not None and dtype not in MLX_DTYPES:
        raise AnelabInputError(f"--dtype {dtype!r}: use one of {', '.join(MLX_DTYPES)}")
    require_mlx_readable(path)
    try:
        model, config = load_model(path, lazy=True)
    except (ValueError, FileNotFoundError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AnelabInputError(f"mlx-lm cannot load {path}: {first}") from None
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    dtypes = {str(v.dtype).removeprefix("mlx.core.") for _, v in _leaves(model.parameters())}
    floating = sorted(d for d in dtypes if d.startswith(("float", "bfloat")))
    return MlxModel(path, model, config, dtype or ("/".join(floating) or "none"))


def _leaves(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


# ---- wrappers: a module standing in for a child of the model, everything else read through -----------------------
_WRAPPER = None


def wrapper_class():
    global _WRAPPER
    if _WRAPPER is None:
        import mlx.nn as nn

        class Wrapper(nn.Module):
            """Stands in for ``wrapped``: attributes it does not define are read from the wrapped module."""

            is_wrapper = True

            def __init__(self, wrapped):
                super().__init__()
                self.wrapped = wrapped

            def __getattr__(self, key):
                if key in self:
                    return self[key]
                if "wrapped" not in self:  # while constructing
                    raise AttributeError(key)
                return getattr(self["wrapped"], key)

        _WRAPPER = Wrapper
    return _WRAPPER


@contextlib.contextmanager
def replaced(owner, key, make: Callable) -> Iterator[object]:
    """``owner[key]`` (a list index or a module attribute) replaced by ``make(original)`` inside the block."""
    original = owner[key]
    wrapper = make(original)
    if isinstance(owner, list):
        owner[key] = wrapper
    else:
        setattr(owner, key, wrapper)
    try:
        yield wrapper
    finally:
        if isinstance(owner, list):
            owner[key] = original
        else:
            setattr(owner, key, original)


@contextlib.contextmanager
def tapped_layers(mlx_model: MlxModel, sink: Callable[[int, object], None]) -> Iterator[None]:
    """Inside the block every decoder layer's output (mx.array [1, n, D]) is handed to ``sink(layer, output)``."""
    base = wrapper_class()

    class LayerTap(base):
        def __init__(self, wrapped, index):
            super().__init__(wrapped)
            self.index = index

        def __call__(self, *args, **kwargs):
            out = self.wrapped(*args, **kwargs)
            sink(self.index, out)
            return out

    layers = mlx_model.decoder_layers
    with contextlib.ExitStack() as stack:
        for i in range(len(layers)):
            stack.enter_context(replaced(layers, i, lambda layer, i=i: LayerTap(layer, i)))
        yield


@contextlib.contextmanager
def last_row_head(mlx_model: MlxModel, rows: Callable[[], int | None]) -> Iterator[None]:
    """Inside the block the final norm keeps only row ``rows() - 1`` of its input when ``rows()`` is not None, so
    the LM head runs on the one row whose logits a prefill needs (mlx-lm's prefill likewise runs the head on the
    last token only). The norm is row-wise: its last row is the same either way. A model without a final
    ``norm`` keeps every row."""
    if "norm" not in mlx_model.body:
        yield
        return
    base = wrapper_class()

    class LastRow(base):
        def __call__(self, x):
            n = rows()
            return self.wrapped(x if n is None else x[:, n - 1 : n])

    with replaced(mlx_model.body, "norm", LastRow):
        yield


def to_numpy(array, dtype=np.float32) -> np.ndarray:
    """An mx.array as a NumPy array of ``dtype`` (bfloat16 goes through float32: NumPy has no bfloat16)."""
    mx = mlx_core()
    if array.dtype == mx.bfloat16:
        array = array.astype(mx.float32)
    return np.asarray(array).astype(dtype, copy=False)
