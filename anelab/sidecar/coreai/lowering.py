"""Lower a saved Core ML sidecar's MIL program to one Core AI program, op by op (``LOWERINGS``).

Why lower the saved program rather than author the graph again with ``coreai.authoring``: the MIL
builders in ``sidecar/graphs/`` are the one source of truth for what a sidecar computes (every
family option, RoPE table, QK norm, gate and design), and the saved ``.mlpackage`` is what Core ML
runs and what ``verify`` checks. A second author would be a second copy of every design to keep in
step; a lowering has one small rule per MIL op (like ``kernels.KERNELS`` for the NumPy evaluation),
reads the program back from disk (``evaluate.SavedPackage``: the same fp16 weights, after coremltools'
passes) and covers a new design for free when its ops are known — an unknown op is refused naming it.

Where Apple's Neural Engine rules (apple/coreai-models, skills/skills/model-authoring/references/
neural_engine_rules.md) differ from the Core ML graph, the lowering follows them and names each
deviation (``Deviation``; the asset's metadata lists them):

- attention per head: a recognised attention core (``Q K^T -> [reshape] -> [elementwise] -> + mask ->
  softmax -> . V``) is emitted head by head ("there is no fused SDPA path"), not batched over KV heads;
- the drop value of an in-graph mask is ``NE_MASKED`` (-40000) instead of ``masks.MASKED`` (-30000);
  the asset's mask input takes the same value (``coreai_asset`` writes it for its callers);
- integer tensors are int16 (the rule lists fp16, int8, int16): the int32 index arithmetic of the
  stateful designs (start, positions, cache slots) is lowered to int16, the int32 ``start`` input is
  cast at entry — refused when the state's positions would not fit (``MAX_INT16_POSITION``);
- static shapes (one entrypoint per function) and rank <= 5 hold as in the Core ML graph (checked on
  the saved asset by ``coreai_asset.problems``);
- K/V state: ``read_state`` / ``coreml_update_state`` become a ``!coreai.handle`` per cache, read and
  written through a token chain (the graph returns the tokens).

Not applied, and said so: BC1S layout with 1x1 ``conv2d`` projections and the transposed ``K @ Q``
mask orientation (the sidecar keeps Core ML's token-major I/O contract: hidden [C, D], mask [C, T]).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from anelab.core.errors import AnelabInputError
from anelab.core.masks import MASKED
from anelab.sidecar.coreai.coreai_import import coreai_modules
from anelab.sidecar.coreai.op_rules import (
    LOWERINGS,
    NE_MASKED,
    authoring,
    numpy_dtype,
    shape_of,
    static_shape,
)
from anelab.sidecar.coremltools_import import coremltools_modules

MAX_INT16_POSITION = 2**15 - 1  # int16 index arithmetic: every position, slot and slice bound must fit
MAX_RANK = 5  # "Max tensor rank: 5. Rank-6+ intermediates are rejected."


@dataclass
class Deviation:
    """One Neural Engine rule against the Core ML graph: ``status`` "applied" (the asset differs from the
    Core ML graph to follow it), "as before" (the Core ML graph already follows it) or "not applied"."""

    rule: str
    status: str
    detail: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoweringNotes:
    """What the lowering did across the functions (counts feed the deviations)."""

    attention_cores: dict[str, int] = field(default_factory=dict)  # function -> cores emitted per head
    heads_per_core: int = 0
    mask_fills: int = 0  # in-graph selects whose drop value became NE_MASKED
    int_casts: int = 0  # int32 inputs cast to int16 at entry
    int32_slice_bounds: int = 0  # runtime slice_update bounds cast back to int32 (a beta refusal, see _l_slice_update)
    states: list[str] = field(default_factory=list)
    constant_bytes: dict[str, dict] = field(default_factory=dict)  # function -> {constant content key: bytes}

    def weights_once(self) -> dict:
        """Constant bytes each function references, their sum, and what the asset stores (each content once)."""
        per_function = {name: sum(used.values()) for name, used in self.constant_bytes.items()}
        union = {key: n for used in self.constant_bytes.values() for key, n in used.items()}
        return {
            "per_function": per_function,
            "sum_over_functions": sum(per_function.values()),
            "stored": sum(union.values()),
        }


class FunctionLowering:
    """One MIL function lowered into one ``coreai.graph`` (call ``emit`` inside a ``Module`` block)."""

    def __init__(self, name: str, fn, notes: LoweringNotes, constants: dict):
        self.ca = coreai_modules()
        self.name, self.fn, self.notes, self.constants = name, fn, notes, constants
        self.env: dict[str, object] = {}
        self.handles: dict[str, object] = {}  # state var name -> handle argument
        self.tokens: dict[str, object] = {}  # state var name -> its token chain's last token

    # ---- values ------------------------------------------------------------------------------------------
    def const_array(self, var) -> np.ndarray:
        """A const var's value as the Core AI element type (int32 -> int16, checked to fit)."""
        value = np.asarray(var.val)
        dtype = numpy_dtype(var)
        if dtype is np.int16 and value.size and np.abs(value.astype(np.int64)).max() > MAX_INT16_POSITION:
            raise AnelabInputError(
                f"{self.name}: constant {var.name} holds {int(np.abs(value).max())}, past int16; re-export with a "
                f"smaller --capacity (the Core AI asset keeps index arithmetic in int16)"
            )
        return value.astype(dtype)

    def constant(self, array: np.ndarray):
        """A ``coreai.constant`` of ``array`` (equal contents share one blob across functions)."""
        array = np.ascontiguousarray(array)
        key = (array.dtype.str, array.shape, array.tobytes()) if array.size <= 64 else None
        if key is None:
            import hashlib

            key = (array.dtype.str, array.shape, hashlib.sha256(array.view(np.uint8)).hexdigest())
        cached = self.constants.setdefault(key, array)  # one NumPy copy per content for the whole program
        self.notes.constant_bytes.setdefault(self.name, {})[key[:2] + (hash(key[2]),)] = int(array.nbytes)
        return self.ca.constant(cached)

    def value(self, var):
        if var.name in self.env:
            return self.env[var.name]
        if var.val is None:
            raise AnelabInputError(f"{self.name}: value of {var.name!r} is not available (unsupported graph)")
        return self.constant(self.const_array(var))

    def param(self, op, name, default=None):
        """A const parameter of ``op`` as a Python / NumPy value (None: not given)."""
        var = op.inputs.get(name)
        if var is None:
            return default
        if var.val is None:
            raise AnelabInputError(f"{self.name}: {op.op_type} {op.name} has a non-constant {name}; not lowered")
        return var.val

    # ---- the graph ---------------------------------------------------------------------------------------
    def signature(self):
        """(input types, input names, result types, result names) of the graph: states are handles, and
        one token per state is returned (a handle-taking graph must return its tokens)."""
        au = self.ca.authoring
        _, _, types = coremltools_modules()
        in_types, in_names, states = [], [], []
        for name, var in self.fn.inputs.items():
            if types.is_state(var.sym_type):
                shape = tuple(int(s) for s in var.sym_type.wrapped_type().get_shape())
                tensor = au.HandleType(au.TensorType(shape, np.float16))
                states.append(name)
            else:
                tensor = au.TensorType(static_shape(var), _input_dtype(var))
            in_types.append(tensor._to_mlir())
            in_names.append(name)
        out_types = [au.TensorType(static_shape(v), numpy_dtype(v))._to_mlir() for v in self.fn.outputs]
        out_names = [v.name for v in self.fn.outputs]
        out_types += [au.TokenType()._to_mlir() for _ in states]
        out_names += [f"{s}_token" for s in states]
        return in_types, in_names, out_types, out_names, states

    def emit(self, output_names: list[str]) -> None:
        """Build the graph: arguments bound, every op lowered in order, outputs (and tokens) returned."""
        in_types, in_names, out_types, names, states = self.signature()
        names[: len(output_names)] = output_names
        graph = self.ca.GraphOp(self.name, in_types, out_types, input_names=in_names, result_names=names)
        Value = self.ca.authoring.Value
        with graph.block:
            for name, arg in zip(in_names, graph.arguments, strict=True):
                if name in states:
                    self.handles[name] = arg
                    self.notes.states = sorted({*self.notes.states, name})
                else:
                    self.env[name] = self._entry(self.fn.inputs[name], Value._from_mlir(arg))
            ops = [op for op in self.fn.operations if op.op_type != "const"]
            cores = find_attention_cores(ops)
            skip = {id(o) for core in cores.values() for o in core.ops[:-1]}
            for op in ops:
                if id(op) in skip:
                    continue
                if id(op) in cores:
                    self.env[op.outputs[0].name] = lower_core_per_head(self, cores[id(op)])
                    self.notes.attention_cores[self.name] = self.notes.attention_cores.get(self.name, 0) + 1
                    continue
                self.lower(op)
            results = [self.env[v.name]._to_mlir() for v in self.fn.outputs]
            self.ca.dialect.output(results + [self.tokens[s] for s in states])

    def _entry(self, var, value):
        """An input as the body sees it: an int32 input (``start``) cast to int16 at entry."""
        if numpy_dtype(var) is np.int16 and _input_dtype(var) is np.int32:
            self.notes.int_casts += 1
            return self.ca.authoring.cast(value, np.int16)
        return value

    def lower(self, op) -> None:
        rule = LOWERINGS.get(op.op_type)
        if rule is None:
            raise AnelabInputError(
                f"the Core AI lowering has no rule for MIL op {op.op_type!r} (in {self.name}: {op.name}); "
                f"lowered: {', '.join(sorted(LOWERINGS))}"
            )
        results = rule(self, op)
        results = results if isinstance(results, (list, tuple)) else [results]
        for var, value in zip(op.outputs, results, strict=True):
            self.env[var.name] = value


def _input_dtype(var):
    """A function input's I/O element type: as the Core ML contract has it (int32 ``start`` stays int32)."""
    dtype = numpy_dtype(var)
    _, _, types = coremltools_modules()
    if dtype is np.int16 and types.builtin_to_string(var.dtype) == "int32":
        return np.int32
    return dtype


# ---- attention per head ----------------------------------------------------------------------------------------
ELEMENTWISE_CHAIN = frozenset({"mul", "add", "sub", "real_div", "tanh"})  # between the scores and the mask (soft-cap)


@dataclass
class AttentionCore:
    """``matmul(Q, K^T) -> [reshape] -> [elementwise with constants] -> add(mask) -> softmax -> matmul(., V)``."""

    ops: list  # in order; the last is the P V matmul
    qk: object
    chain: list  # the elementwise ops between the (reshaped) scores and the mask add
    add: object
    mask: object  # the mask var of the add
    softmax: object
    pv: object


def _single_use(ops) -> dict[str, int]:
    uses: dict[str, int] = {}
    for op in ops:
        for v in op.inputs.values():
            for var in v if isinstance(v, (list, tuple)) else [v]:
                uses[var.name] = uses.get(var.name, 0) + 1
    return uses


def find_attention_cores(ops) -> dict[int, AttentionCore]:
    """id(P V matmul) -> the attention core it closes, for every core whose intermediates have one use."""
    producer = {v.name: op for op in ops for v in op.outputs}
    uses = _single_use(ops)
    consumers: dict[str, list] = {}
    for op in ops:
        for v in op.inputs.values():
            for var in v if isinstance(v, (list, tuple)) else [v]:
                consumers.setdefault(var.name, []).append(op)
    cores = {}
    for sm in ops:
        if sm.op_type != "softmax" or int(sm.inputs["axis"].val) not in (-1, len(sm.outputs[0].shape) - 1):
            continue
        users = consumers.get(sm.outputs[0].name, [])
        add = producer.get(sm.inputs["x"].name)
        if len(users) != 1 or users[0].op_type != "matmul" or add is None or add.op_type != "add":
            continue
        pv = users[0]
        if pv.inputs["x"] is not sm.outputs[0] or pv.inputs["transpose_x"].val or pv.inputs["transpose_y"].val:
            continue
        core = _core_from_add(add, sm, pv, producer, uses)
        if core is not None:
            cores[id(pv)] = core
    return cores


def _core_from_add(add, sm, pv, producer, uses) -> AttentionCore | None:
    for s_name, m_name in (("x", "y"), ("y", "x")):
        chain, src = [], producer.get(add.inputs[s_name].name)
        while src is not None and src.op_type in ELEMENTWISE_CHAIN and uses.get(src.outputs[0].name) == 1:
            varying = [v for v in src.inputs.values() if not isinstance(v, (list, tuple)) and v.val is None]
            if len(varying) != 1:
                break
            chain.insert(0, src)
            src = producer.get(varying[0].name)
        reshape = None
        if src is not None and src.op_type == "reshape" and uses.get(src.outputs[0].name) == 1:
            reshape, src = src, producer.get(src.inputs["x"].name)
        if src is None or src.op_type != "matmul" or uses.get(src.outputs[0].name) != 1:
            continue
        if src.inputs["transpose_x"].val or not src.inputs["transpose_y"].val or len(src.outputs[0].shape) != 3:
            continue
        ops = [o for o in (src, reshape, *chain, add, sm, pv) if o is not None]
        return AttentionCore(ops, src, chain, add, add.inputs[m_name], sm, pv)
    return None


def lower_core_per_head(lw: FunctionLowering, core: AttentionCore):
    """The core head by head: for KV head b and query group g, scores [C, T] = q_bg @ k_b^T, the chain,
    + mask, softmax, @ v_b -> [C, d]; the heads concatenated back to the P V matmul's shape."""
    au = authoring(lw)
    q, k = lw.value(core.qk.inputs["x"]), lw.value(core.qk.inputs["y"])  # [B, R, d], [B, T, d]
    v_var = core.pv.inputs["y"]
    v = lw.value(v_var)
    B, R, d = shape_of(q)
    T = shape_of(k)[1]
    lead = static_shape(core.softmax.outputs[0])[:-2]  # (B,) or (B, G)
    G = lead[1] if len(lead) == 2 else 1
    C = R // G
    mask = lw.value(core.mask)
    heads = []
    for b in range(B):
        k_t = au.reshape(_slice_rows(lw, k, b), np.array([T, d], np.int32))
        k_t = au.transpose(k_t, np.array([1, 0], np.uint32))  # [d, T], shared by the group's query heads
        v_b = au.reshape(_slice_rows(lw, v, b), np.array([T, shape_of(v)[-1]], np.int32))
        for g in range(G):
            q_bg = au.slice_(q, *_index_arrays(lw, [b, g * C, 0], [b + 1, (g + 1) * C, d]))
            scores = au.batch_matmul(au.reshape(q_bg, np.array([C, d], np.int32)), k_t)  # [C, T]
            for op in core.chain:
                scores = _replay(lw, op, scores)
            scores = au.broadcasting_add(scores, _head_mask(lw, mask, b, g, C, T))
            probs = au.softmax(scores, np.array(-1, np.int32))
            heads.append(au.expand_dims(au.batch_matmul(probs, v_b), np.array([0], np.int32)))  # [1, C, dv]
    lw.notes.heads_per_core = B * G
    out = heads[0] if len(heads) == 1 else au.concat(np.array(0, np.int32), heads)
    return au.reshape(out, np.array(static_shape(core.pv.outputs[0]), np.int32))


def _index_arrays(lw, begin, end):
    n = len(begin)
    return (lw.constant(np.array(begin, np.int32)), lw.constant(np.array(end, np.int32)),
            lw.constant(np.ones(n, np.int32)))  # fmt: skip


def _slice_rows(lw, value, b: int):
    """value[b:b+1] along the first axis (any rank)."""
    shape = shape_of(value)
    begin = [b] + [0] * (len(shape) - 1)
    return authoring(lw).slice_(value, *_index_arrays(lw, begin, [b + 1, *shape[1:]]))


def _head_mask(lw, mask, b: int, g: int, C: int, T: int):
    """The mask one head adds: the mask itself when it is [C, T] (or broadcasts from fewer dims), else its
    (b, g) slice."""
    shape = shape_of(mask)
    if len(shape) <= 2:
        return mask
    full = (1,) * (4 - len(shape)) + shape if len(shape) < 4 else shape
    index = [min(b, full[0] - 1), min(g, full[1] - 1)]
    m = authoring(lw).reshape(mask, np.array(full, np.int32)) if len(shape) < 4 else mask
    m = authoring(lw).slice_(m, *_index_arrays(lw, index + [0, 0], [index[0] + 1, index[1] + 1, full[2], full[3]]))
    return authoring(lw).reshape(m, np.array(full[2:], np.int32))


def _replay(lw, op, varying):
    """One elementwise op of the chain on a head's scores: its varying input replaced by ``varying``."""
    name = next(k for k, v in op.inputs.items() if not isinstance(v, (list, tuple)) and v.val is None)
    saved = lw.env.get(op.inputs[name].name)
    lw.env[op.inputs[name].name] = varying
    try:
        rule = LOWERINGS[op.op_type]
        return rule(lw, op)
    finally:
        if saved is None:
            del lw.env[op.inputs[name].name]
        else:
            lw.env[op.inputs[name].name] = saved


# ---- the whole program -------------------------------------------------------------------------------------------
def lower_program(saved, functions: list[str]):
    """(``AIProgram`` with one entrypoint per function of ``saved`` (an ``evaluate.SavedPackage``), the
    ``LoweringNotes``). Every function is lowered in one module, so equal constants are one blob."""
    ca = coreai_modules()
    module = ca.authoring.Module.create()
    notes, constants = LoweringNotes(), {}
    with module:  # a clean exit runs coreai's pre-compilation rewrite over the whole module
        for name in functions:
            info = saved.function(name)
            FunctionLowering(name, saved.mil_function(name), notes, constants).emit([o.name for o in info.outputs])
    return ca.authoring.AIProgram(module), notes


def deviations(notes: LoweringNotes, functions: list[str], state_constraints: str | None) -> list[Deviation]:
    """The Neural Engine rules against the Core ML graph, for the asset's metadata (module docstring)."""
    cores = sum(notes.attention_cores.values())
    without = [f for f in functions if f not in notes.attention_cores]
    per_head = (
        Deviation("per-head attention", "applied",
                  f"{cores} attention cores emitted head by head ({notes.heads_per_core} heads each): "
                  "q_h @ k^T + mask, softmax, @ v per head, instead of one batched matmul over KV heads")
        if cores
        else Deviation("per-head attention", "not applied",
                       "no softmax attention core in these functions (online-softmax key tiles are kept as built)")
    )  # fmt: skip
    if cores and without:
        per_head.detail += f"; not in {', '.join(without)} (online-softmax tiles)"
    rules = [
        per_head,
        Deviation("mask value", "applied",
                  f"dropped keys are {float(NE_MASKED):g} (not -inf) instead of {float(MASKED):g}: in a mask input "
                  f"(anelab's callers feed it so: coreai_asset) and in {notes.mask_fills} in-graph mask fills"),
        Deviation("fp16 / int8 / int16 only", "applied" if notes.int_casts else "as before",
                  "fp16 weights and activations as in the Core ML graph; "
                  + (f"int32 index arithmetic lowered to int16 (the int32 start input is cast at entry), except the "
                     f"runtime slice_update bounds ({notes.int32_slice_bounds} over the entrypoints), cast back to int32: coreai-core "
                     "1.0.0b3's CPU runtime aborts on int16 ones" if notes.int_casts else "no integer tensors")),
        Deviation("static shapes", "as before", "one static entrypoint per function, as the Core ML package"),
        Deviation("rank <= 5", "as before", "the Core ML graph's tensors are rank <= 4 (checked on the saved asset)"),
        Deviation("conv2d projections / BC1S layout", "not applied",
                  "token-major I/O kept (hidden [C, D], mask [C, T]): projections are batch_matmul against W^T"),
    ]  # fmt: skip
    if notes.states:
        rules.append(Deviation("KV state", "applied",
                               f"{', '.join(notes.states)} are !coreai.handle arguments shared by every entrypoint"
                               + (f"; {state_constraints}" if state_constraints else "")))  # fmt: skip
    return rules
