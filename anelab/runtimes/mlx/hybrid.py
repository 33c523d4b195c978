"""The hybrid prefill: mlx-lm's model, its softmax-attention layers' prefill chunks served by their sidecars.

mlx-lm calls a layer's attention as ``attention(x, mask, cache)`` with ``x`` [1, n, D] the post-input-norm rows
and ``cache`` the layer's own cache (``KVCache``; ``RotatingKVCache`` for a sliding-window layer), whose
``offset`` is the chunk's start and whose keys / values are K/V after RoPE, [1, kv_heads, T, head_dim]. While the
hybrid serves, each such layer hands the chunk to its sidecar instead: the rows (fp16, padded to the sidecar's
width C), the function for the chunk's start (the design registry's choice, made by the server), the K/V
history read from mlx-lm's cache token-major [start, kv_heads, head_dim] (for a design that takes it as an
input; a stateful sidecar holds it in its state), and the sidecar contract's additive mask
(``masks.causal(C, start, valid_rows=n, window=W)``). The sidecar's ``attn_out`` goes back into the residual
stream; its ``k_chunk`` / ``v_chunk`` are written into mlx-lm's cache with ``update_and_fetch``, so the rest of
the prefill and the decode continue on MLX from the cache the sidecars filled. The MLPs of ``mlp_layers`` are
served likewise: mlx-lm calls ``mlp(x)`` with x [1, n, D] the MLP's post-norm rows, and their sidecar's output
(``server.mlp.serve``, rows independent, no cache) goes back in its place; so do the four input projections of the
linear-attention layers of ``gdn_layers`` (``server.gdn.serve_all``: qkv, z, b, a in one call per chunk), the conv1d
and the delta-rule recurrence staying mlx-lm's. Everything else — MoE, the other blocks, norms, the LM head — is
mlx-lm's own.

A server is anything with ``chunk``, ``takes_history(layer)`` and ``serve(layer, start, normed, k_history,
v_history, mask, start_offset=)``, for MLPs ``mlp.serve(layer, rows)``, for the projections
``gdn.serve_all(layer, rows)`` (``anelab.arms.sidecars.SidecarSet``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.gated_deltanet import GDN_OUTPUTS
from anelab.core.geometry import AttentionGeometry, chunk_starts
from anelab.core.masks import causal
from anelab.runtimes.mlx.mlx_model import MlxModel, last_row_head, mlx_core, replaced, to_numpy, wrapper_class

CONTROLS = ("mask_dropped", "start_shifted")  # the hybrid's negative controls, per served layer


@dataclass
class HybridTiming:
    """Seconds the hybrid spent, on its clock: ``mlx_s`` evaluating mlx-lm's graph (everything between sidecar
    calls, and the chunk's end), ``marshalling_s`` moving rows, history and outputs between MLX and NumPy,
    ``sidecar_s`` inside the server's calls (its own split: the runner's), ``calls`` the chunks served."""

    mlx_s: float = 0.0
    marshalling_s: float = 0.0
    sidecar_s: float = 0.0
    calls: int = 0

    def to_dict(self) -> dict:
        return {"mlx_s": self.mlx_s, "marshalling_s": self.marshalling_s, "sidecar_s": self.sidecar_s,
                "calls": self.calls}  # fmt: skip


def read_history(cache, start: int, layer: int, window: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The K/V history of a layer's mlx-lm cache, token-major float16 [start, kv_heads, head_dim] each.

    ``KVCache``: its first ``start`` positions. ``RotatingKVCache`` (a sliding-window layer): the positions it
    still holds, in temporal order, at the end; the earlier ones are zeros, which the window's mask drops —
    refused when it holds fewer than the window needs. Any other cache is refused in one line."""
    mx = mlx_core()
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    if start == 0:
        return None, None  # a chunk at 0 has no history
    if isinstance(cache, KVCache):
        k, v = (a[0, :, :start] for a in (cache.keys, cache.values))
        return tuple(to_numpy(a.astype(mx.float16), np.float16).transpose(1, 0, 2) for a in (k, v))
    if isinstance(cache, RotatingKVCache) and cache.keep == 0:
        held = [cache._temporal_order(a)[0] for a in (cache.keys, cache.values)]  # mlx-lm's own reordering
        n = int(held[0].shape[1])
        need = min(start, (window or start) - 1)
        if n < need:
            raise AnelabInputError(
                f"layer {layer}: mlx-lm's rotating cache holds {n} positions, fewer than the window's {need}"
            )
        out = []
        for a in held:
            full = np.zeros((start, a.shape[0], a.shape[2]), np.float16)
            tail = to_numpy(a.astype(mx.float16), np.float16).transpose(1, 0, 2)[-min(n, start) :]
            full[start - len(tail) :] = tail
            out.append(full)
        return out[0], out[1]
    raise AnelabInputError(
        f"layer {layer}: the hybrid reads the K/V history from mlx-lm's KVCache or RotatingKVCache; this model's "
        f"layer uses {type(cache).__name__}"
    )


@dataclass
class Hybrid:
    """mlx-lm's model with the prefill chunks of ``layers`` served by ``server`` (module docstring).

    geometry: the checkpoint's attention geometry (each layer's window); controls: layer -> a kind of
    ``CONTROLS`` (negative controls: the mask dropped, the start told one position late); clock: the timing's
    clock (``timing``)."""

    mlx_model: MlxModel
    server: object
    geometry: AttentionGeometry
    layers: tuple[int, ...]
    controls: dict[int, str] = field(default_factory=dict)
    clock: Callable[[], float] = time.perf_counter
    timing: HybridTiming = field(default_factory=HybridTiming)
    serving: bool = False
    mlp_layers: tuple[int, ...] = ()  # the layers whose MLP the server's ``mlp`` serves in prefill
    gdn_layers: tuple[int, ...] = ()  # the linear-attention layers whose input projections the server's ``gdn`` serves
    _pending: dict = field(default_factory=dict, repr=False)  # layer -> the projections of its chunk not yet taken

    def __post_init__(self):
        stray = sorted(i for i in self.mlp_layers + self.gdn_layers if not 0 <= i < self.mlx_model.num_layers)
        if stray:
            raise AnelabInputError(f"{self.mlx_model.path}: MLP layers {stray} are not layers of mlx-lm's model")
        have = set(self.mlx_model.attention_layers())
        stray = sorted(set(self.layers) - have)
        if stray:
            raise AnelabInputError(
                f"{self.mlx_model.path}: layers {stray} have no softmax attention in mlx-lm's model (its attention "
                f"layers: {sorted(have)}); the sidecars were exported for another layout"
            )
        bad = sorted(k for k in self.controls.values() if k not in CONTROLS)
        if bad:
            raise AnelabInputError(f"hybrid control {bad[0]!r}: use one of {', '.join(CONTROLS)}")

    def attend(self, layer: int, x, cache):
        """One chunk x [1, n, D] of ``layer`` at ``cache.offset`` through its sidecar -> attn_out [1, n, D]."""
        mx = mlx_core()
        if cache is None or x.shape[0] != 1:
            raise AnelabInputError("the hybrid serves one prompt (batch 1) with mlx-lm's cache")
        start, rows, chunk = int(cache.offset), int(x.shape[1]), int(self.server.chunk)
        if rows > chunk or start % chunk:
            raise AnelabInputError(
                f"the hybrid serves chunks of {chunk} rows at multiples of {chunk}; got {rows} at {start}"
            )
        t0 = self.clock()
        mx.eval(x)
        t1 = self.clock()
        normed = to_numpy(x[0].astype(mx.float16), np.float16)
        window = self.geometry.window_of(layer)
        history = read_history(cache, start, layer, window) if self.server.takes_history(layer) else (None, None)
        mask = causal(chunk, start, valid_rows=rows, window=window)
        control = self.controls.get(layer)
        if control == "mask_dropped":
            mask = np.zeros_like(mask)
        t2 = self.clock()
        attn, k, v = self.server.serve(
            layer, start, normed, *history, mask, start_offset=int(control == "start_shifted")
        )
        t3 = self.clock()
        k, v = (mx.array(a.transpose(1, 0, 2)[None]).astype(x.dtype) for a in (k, v))  # [1, Hkv, n, d]
        cache.update_and_fetch(k, v)
        out = mx.array(attn[None]).astype(x.dtype)
        t4 = self.clock()
        self.timing.mlx_s += t1 - t0
        self.timing.marshalling_s += (t2 - t1) + (t4 - t3)
        self.timing.sidecar_s += t3 - t2
        self.timing.calls += 1
        return out

    def mlp(self, layer: int, x):
        """One chunk's MLP input rows x [1, n, D] of ``layer`` through its MLP sidecar -> the MLP's output [1, n, D]."""
        mx = mlx_core()
        if x.shape[0] != 1:
            raise AnelabInputError("the hybrid serves one prompt (batch 1)")
        t0 = self.clock()
        mx.eval(x)
        t1 = self.clock()
        rows = to_numpy(x[0].astype(mx.float16), np.float16)
        t2 = self.clock()
        out = self.server.mlp.serve(layer, rows)
        t3 = self.clock()
        result = mx.array(out[None]).astype(x.dtype)
        self.timing.mlx_s += t1 - t0
        self.timing.marshalling_s += (t2 - t1) + (self.clock() - t3)
        self.timing.sidecar_s += t3 - t2
        self.timing.calls += 1
        return result

    def project(self, layer: int, name: str, x):
        """One of a linear-attention layer's input projections (``qkv``, ``z``, ``b``, ``a``) of the chunk x [1, n, D]:
        the first of the four calls of a chunk runs the layer's sidecar once for all four, each later call takes its
        own (mlx-lm's ``GatedDeltaNet.__call__`` calls each once per chunk) -> [1, n, width]."""
        mx = mlx_core()
        if x.shape[0] != 1:
            raise AnelabInputError("the hybrid serves one prompt (batch 1)")
        pending = self._pending.get(layer)
        if pending is None or name not in pending:
            t0 = self.clock()
            mx.eval(x)
            t1 = self.clock()
            rows = to_numpy(x[0].astype(mx.float16), np.float16)
            t2 = self.clock()
            pending = self._pending[layer] = dict(self.server.gdn.serve_all(layer, rows))
            t3 = self.clock()
            self.timing.mlx_s += t1 - t0
            self.timing.marshalling_s += t2 - t1
            self.timing.sidecar_s += t3 - t2
            self.timing.calls += 1
        out = pending.pop(name)
        if out.shape[0] != x.shape[1]:
            raise AnelabInputError(f"layer {layer}: projection {name} served {out.shape[0]} rows for {x.shape[1]}")
        return mx.array(out[None]).astype(x.dtype)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Inside the block each served layer's attention is a ``SidecarAttention`` and each served MLP a
        ``SidecarMlp`` (mlx-lm's own while not ``serving``)."""
        base, hybrid = wrapper_class(), self

        class SidecarMlp(base):
            def __init__(self, wrapped, layer):
                super().__init__(wrapped)
                self.layer = layer

            def __call__(self, x):
                return hybrid.mlp(self.layer, x) if hybrid.serving else self.wrapped(x)

        class SidecarProjection(base):
            def __init__(self, wrapped, layer, name):
                super().__init__(wrapped)
                self.layer, self.name = layer, name

            def __call__(self, x):
                return hybrid.project(self.layer, self.name, x) if hybrid.serving else self.wrapped(x)

        class SidecarAttention(base):
            def __init__(self, wrapped, layer):
                super().__init__(wrapped)
                self.layer = layer

            def __call__(self, x, mask=None, cache=None):
                if not hybrid.serving:
                    return self.wrapped(x, mask, cache)
                return hybrid.attend(self.layer, x, cache)

        layers = self.mlx_model.decoder_layers
        with contextlib.ExitStack() as stack:
            for i in self.layers:
                owner = layers[i]
                while getattr(owner, "is_wrapper", False):  # a tapped layer: its wrapped decoder layer owns self_attn
                    owner = owner["wrapped"]
                stack.enter_context(replaced(owner, "self_attn", lambda a, i=i: SidecarAttention(a, i)))
            for i in self.mlp_layers:
                owner = layers[i]
                while getattr(owner, "is_wrapper", False):
                    owner = owner["wrapped"]
                stack.enter_context(replaced(owner, "mlp", lambda m, i=i: SidecarMlp(m, i)))
            for i in self.gdn_layers:
                owner = layers[i]
                while getattr(owner, "is_wrapper", False):
                    owner = owner["wrapped"]
                gdn = _separate_projections(owner, i)
                for name in GDN_OUTPUTS:
                    stack.enter_context(
                        replaced(gdn, f"in_proj_{name}", lambda m, i=i, n=name: SidecarProjection(m, i, n))
                    )
            self._pending.clear()
            yield


def _separate_projections(decoder_layer, layer: int):
    """The layer's ``linear_attn`` with Qwen 3.5's four separate input projections; refused (one line) for another
    layout (Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba``) or a layer without linear attention."""
    gdn = getattr(decoder_layer, "linear_attn", None)
    if gdn is None or not all(hasattr(gdn, f"in_proj_{name}") for name in GDN_OUTPUTS):
        raise AnelabInputError(
            f"layer {layer}: the hybrid serves the Gated DeltaNet projections of Qwen 3.5's layers (in_proj_qkv, "
            "in_proj_z, in_proj_b, in_proj_a); this layer has none (Qwen3-Next's fused ones are not served yet)"
        )
    return gdn


def prefill(mlx_model: MlxModel, prompt: np.ndarray, chunk: int, cache, hybrid: Hybrid | None = None,
            clock: Callable[[], float] = time.perf_counter, on_chunk: Callable[[int], None] | None = None):  # fmt: skip
    """``prompt`` (int [P]) through mlx-lm's model in chunks of ``chunk`` (the last partial) with ``cache``
    threaded -> the logits at the last prompt position, mx.array [V] (evaluated).

    With ``hybrid`` (installed by the caller) the served layers' attention is the sidecars'; without it
    every layer is mlx-lm's own. Only the last chunk's last row reaches the LM head. The end of each chunk
    (evaluating the caches it left, and the logits) is timed into ``hybrid.timing.mlx_s``. ``on_chunk(start)``
    is called before each chunk."""
    mx = mlx_core()
    clock = hybrid.clock if hybrid is not None else clock
    prompt = np.asarray(prompt)
    starts = chunk_starts(prompt.size, chunk)
    last_rows = [None]
    logits = None
    with last_row_head(mlx_model, lambda: last_rows[0]):
        if hybrid is not None:
            hybrid.serving = True
        try:
            for start in starts:
                if on_chunk is not None:
                    on_chunk(start)
                tokens = prompt[start : start + chunk]
                last_rows[0] = len(tokens)
                out = mlx_model.model(mx.array(tokens[None].astype(np.int32)), cache=cache)
                t0 = clock()
                if start == starts[-1]:
                    logits = out[0, -1]
                    mx.eval(logits, [c.state for c in cache])
                else:
                    mx.eval([c.state for c in cache])
                if hybrid is not None:
                    hybrid.timing.mlx_s += clock() - t0
        finally:
            if hybrid is not None:
                hybrid.serving = False
    return logits


def decode_greedy(mlx_model: MlxModel, first_logits, cache, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``steps`` greedy tokens on mlx-lm from ``cache`` (what a prefill left) -> (logits [steps, V] float32,
    tokens [steps]): row 0 is ``first_logits`` [V], row i the logits after feeding token i - 1."""
    mx = mlx_core()
    rows = [to_numpy(first_logits)]
    tokens = [int(np.argmax(rows[0]))]
    for _ in range(1, int(steps)):
        out = mlx_model.model(mx.array([[tokens[-1]]], dtype=mx.int32), cache=cache)[0, -1]
        rows.append(to_numpy(out))
        tokens.append(int(np.argmax(rows[-1])))
    return np.stack(rows), np.array(tokens)
