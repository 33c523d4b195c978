"""The exporter's pass pipeline (``coremltools_import.apply_pipeline_validated_at_cleanups``): coremltools' passes
validated after its cleanups instead of after every pass write the very package coremltools' own pipeline writes,
for every design of the table; a pass that breaks the program is still refused; another coremltools version runs
coremltools' own pipeline."""

from __future__ import annotations

import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.default import default_checkpoint_dir
from anelab.runtimes.mlx.checkpoints import write_mlx_lm_checkpoint
from anelab.sidecar import coremltools_import
from anelab.sidecar.coremltools_import import coremltools_modules, quiet_coremltools, save_model
from anelab.sidecar.designs import DENSE, DESIGNS, GDN_PROJ, MLP, STATEFUL, STATEFUL_TILED, TILED
from anelab.sidecar.export import convert_program, function_builds
from anelab.sidecar.format import WEIGHTS_RELATIVE

OPTIONS = {  # each design at a shape that exercises its passes (stateful-tiled: query tiles narrower than the chunk)
    DENSE: ({}, [0, 64]),
    TILED: ({"key_tile": 32}, [0, 64]),
    STATEFUL: ({"capacity": 128, "decode": True}, None),
    STATEFUL_TILED: ({"capacity": 256, "decode": True, "key_tile": 32, "query_tile": 16}, None),
    MLP: ({}, None),  # the block designs: a hybrid's MLPs and its Gated DeltaNet projections (``hybrid``)
    GDN_PROJ: ({}, None),
}


def _package_bytes(pkg) -> tuple[bytes, bytes]:
    ct, _, _ = coremltools_modules()
    spec = ct.utils.load_spec(str(pkg))
    return spec.SerializeToString(deterministic=True), (pkg / WEIGHTS_RELATIVE).read_bytes()


def _coremltools_own(prog, dest):
    """What ``convert_program`` does, through coremltools' own pipeline (a validation after every pass)."""
    ct, _, _ = coremltools_modules()
    with quiet_coremltools():
        model = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.macOS15,
                           compute_precision=ct.precision.FLOAT16, skip_model_load=True)  # fmt: skip
        save_model(model, dest)
    return dest


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A Qwen 3.5 hybrid written by mlx-lm: the block designs' layers (MLPs, Gated DeltaNet projections)."""
    from test_block_sidecars import CONFIGS

    return write_mlx_lm_checkpoint(tmp_path_factory.mktemp("hybrid") / "qwen3_5", CONFIGS["qwen3_5"], seed=3)


def _builds(graph: str, layer_index: int = 0, hybrid=None):
    options, histories = OPTIONS[graph]
    block = DESIGNS[graph].block
    if block is not None:
        checkpoint = load_checkpoint(hybrid)
        layer = block.layers(checkpoint)[layer_index]
        return function_builds(checkpoint.geometry, block.weights(checkpoint, layer), graph, 64, histories, **options)
    checkpoint = load_checkpoint(default_checkpoint_dir())
    layer = checkpoint.geometry.full_attention_layers[layer_index]
    return function_builds(checkpoint.geometry, checkpoint.layer(layer), graph, 64, histories, **options)


def test_every_design_of_the_table_has_a_shape_here():
    assert set(OPTIONS) == set(DESIGNS)


@pytest.mark.parametrize("graph", sorted(OPTIONS))
def test_the_pipeline_writes_what_coremltools_own_writes(tmp_path, graph, hybrid):
    """Each function of the design, converted both ways: the same spec and the same weights, byte for byte."""
    for name, build in _builds(graph, hybrid=hybrid).items():
        ours = convert_program(build(), tmp_path / f"ours_{name}.mlpackage")
        theirs = _coremltools_own(build(), tmp_path / f"theirs_{name}.mlpackage")
        assert _package_bytes(ours) == _package_bytes(theirs), name


def test_the_comparison_tells_two_layers_apart(tmp_path):
    """Control for the byte comparison: the same function of two layers (other weights) differs."""
    [first, *_] = _builds(DENSE, 0).values()
    [second, *_] = _builds(DENSE, 1).values()
    a = convert_program(first(), tmp_path / "a.mlpackage")
    b = convert_program(second(), tmp_path / "b.mlpackage")
    assert _package_bytes(a) != _package_bytes(b)


def _count_validations(monkeypatch, convert) -> int:
    from coremltools.converters.mil.mil import Program

    calls, inner = [], Program.validate

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("check_essential_scope", False))
        return inner(self, *args, **kwargs)

    monkeypatch.setattr(Program, "validate", counted)
    convert()
    return len(calls)


def test_the_program_is_validated_after_its_cleanups_not_after_every_pass(tmp_path, monkeypatch):
    [build, *_] = _builds(DENSE).values()
    ours = _count_validations(monkeypatch, lambda: convert_program(build(), tmp_path / "ours.mlpackage"))
    theirs = _count_validations(monkeypatch, lambda: _coremltools_own(build(), tmp_path / "theirs.mlpackage"))
    ct, _, _ = coremltools_modules()
    passes = len(ct.PassPipeline.DEFAULT.passes)
    assert theirs > passes  # coremltools: after every pass of the default pipeline (95), and more
    assert ours < 20  # here: at the start, after each of the 11 dead-code eliminations, at the end


def test_a_pass_that_breaks_the_program_is_still_refused(tmp_path, monkeypatch):
    """Negative control: a pass that leaves an op reading a var no op defines — the validation after the last
    pass raises, as coremltools' own would after that pass."""
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    class Orphaning:
        def set_options(self, options):
            pass

        def __call__(self, prog):  # the first op that reads another op's output loses that producer
            block = prog.functions["main"]
            for op in block.operations:
                producers = [v.op for v in op.inputs.values() if hasattr(v, "op") and v.op is not None]
                if producers and producers[0].op_type != "const":
                    block.operations.remove(producers[0])
                    return

    ct, _, _ = coremltools_modules()
    monkeypatch.setitem(PASS_REGISTRY.passes, "test::orphaning", Orphaning())
    pipeline = ct.PassPipeline.DEFAULT
    pipeline.append_pass("test::orphaning")
    [build, *_] = _builds(DENSE).values()
    with pytest.raises(ValueError, match="not visible"):
        coremltools_import.apply_pipeline_validated_at_cleanups(build(), pipeline)
    # control: the same pipeline without the breaking pass runs clean
    clean = ct.PassPipeline.DEFAULT
    coremltools_import.apply_pipeline_validated_at_cleanups(build(), clean)


def test_another_coremltools_runs_its_own_pipeline(monkeypatch):
    ct, _, _ = coremltools_modules()
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager

    own = PassPipelineManager.apply_pipeline
    with coremltools_import.fast_conversions():
        assert PassPipelineManager.apply_pipeline is coremltools_import.apply_pipeline_validated_at_cleanups
    assert PassPipelineManager.apply_pipeline is own  # restored on leaving
    monkeypatch.setattr(ct, "__version__", "9.1")
    with coremltools_import.fast_conversions():
        assert PassPipelineManager.apply_pipeline is own


def _compress_with_coremltools_own(src, dest, mode):
    """What ``quantize.compress_package`` does, through coremltools' own pipeline (a validation after every pass)."""
    from anelab.sidecar.quantize import _optimization

    ct, _, _ = coremltools_modules()
    fn, config = _optimization(mode)
    with quiet_coremltools():
        save_model(fn(ct.models.MLModel(str(src), skip_model_load=True), config), dest)
    return dest


@pytest.fixture(scope="module")
def dense_function(tmp_path_factory):
    """One fp16 dense function of the default checkpoint, converted (what an export compresses)."""
    [build, *_] = _builds(DENSE).values()
    return convert_program(build(), tmp_path_factory.mktemp("fp16") / "function.mlpackage")


@pytest.mark.parametrize("mode", ["int8", "palettize4", "int4-block"])
def test_a_compression_writes_what_coremltools_own_pipeline_writes(tmp_path, dense_function, mode):
    """``compress_package`` runs the pipeline validated at its cleanups: the same spec and weights, byte for byte,
    as coremltools' own; control: another mode's package differs."""
    from anelab.sidecar.quantize import compress_package

    ours = compress_package(dense_function, tmp_path / "ours.mlpackage", mode)
    theirs = _compress_with_coremltools_own(dense_function, tmp_path / "theirs.mlpackage", mode)
    assert _package_bytes(ours) == _package_bytes(theirs)
    other = "int8" if mode != "int8" else "int4-block"
    assert _package_bytes(compress_package(dense_function, tmp_path / "other.mlpackage", other)) != _package_bytes(ours)


def test_a_compression_validates_after_its_cleanups_not_after_every_pass(tmp_path, monkeypatch, dense_function):
    """The hot spot of a real model's weight-mode evidence (~120 compressions): coremltools' own pipeline validates the
    program after each of its ~95 passes; ``compress_package`` after its cleanups only."""
    from anelab.sidecar.quantize import compress_package

    ours = _count_validations(monkeypatch, lambda: compress_package(dense_function, tmp_path / "a.mlpackage", "int8"))
    theirs = _count_validations(
        monkeypatch, lambda: _compress_with_coremltools_own(dense_function, tmp_path / "b.mlpackage", "int8")
    )
    ct, _, _ = coremltools_modules()
    assert theirs > len(ct.PassPipeline.DEFAULT.passes)  # the control: coremltools' own, after every pass
    assert ours < 20


def _count_own_propagations(monkeypatch, convert) -> int:
    """How many times coremltools' own ``Block._propagate_nonreplaceable_vars`` walked a block during ``convert``."""
    from coremltools.converters.mil.mil.block import Block

    calls = []
    own = Block._propagate_nonreplaceable_vars  # outside ``fast_conversions``: coremltools' own

    def counted(block):
        calls.append(block)
        return own(block)

    monkeypatch.setattr(coremltools_import, "_COREMLTOOLS_PROPAGATE", [counted])
    convert()
    return len(calls)


def test_an_fp16_conversion_empties_the_sets_without_coremltools_walk(tmp_path, monkeypatch, dense_function):
    """A program with no ``constexpr_*`` op never needs coremltools' walk (its packages are the same bytes, above);
    a compression, whose ``constexpr_*`` ops start non-empty sets, goes through it every time (the control)."""
    from anelab.sidecar.quantize import compress_package

    [build, *_] = _builds(DENSE).values()
    assert _count_own_propagations(monkeypatch, lambda: convert_program(build(), tmp_path / "a.mlpackage")) == 0
    walks = _count_own_propagations(
        monkeypatch, lambda: compress_package(dense_function, tmp_path / "b.mlpackage", "int8")
    )
    assert walks > 0


def test_the_shortcut_leaves_every_set_as_coremltools_walk_does():
    """The sets ``propagate_nonreplaceable_vars`` leaves are the ones coremltools' own walk leaves: on a program
    without a ``constexpr_*`` op (all empty, even where a stale set was left on a var) and on one with (the shortcut
    defers; the linear downstream of the constexpr carries it: the control that the sets are not trivially empty)."""
    import numpy as np
    from coremltools.converters.mil.mil import types
    from coremltools.converters.mil.mil.block import Block

    ct, mb, _ = coremltools_modules()
    own = Block._propagate_nonreplaceable_vars  # outside ``fast_conversions``: coremltools' own

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 4), dtype=types.fp32)])
    def plain(x):
        return mb.relu(x=mb.add(x=x, y=np.ones((2, 4), np.float32)))

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 4), dtype=types.fp16)], opset_version=ct.target.iOS18)
    def compressed(x):
        weight = mb.constexpr_blockwise_shift_scale(
            data=np.ones((4, 4), np.int8), scale=np.ones((4, 1), np.float16), offset=None
        )
        return mb.linear(x=x, weight=weight)

    def sets_after(fn, propagate) -> dict[str, set[str]]:
        first = next(iter(fn.operations)).outputs[0]
        first.nonreplaceable_vars_upstream = {first}  # stale: a set coremltools' walk resets
        propagate(fn)
        return {o.name: {v.name for v in o.nonreplaceable_vars_upstream} for op in fn.operations for o in op.outputs}

    for program in (plain, compressed):
        fn = program.functions["main"]
        theirs = sets_after(fn, own)
        ours = sets_after(fn, coremltools_import.propagate_nonreplaceable_vars)
        assert ours == theirs
    assert not any(sets_after(plain.functions["main"], own).values())
    assert any(theirs.values())  # the compressed program: the linear carries its constexpr weight
