"""The exporter's short pass pipeline (``export.SIDECAR_PASSES``) writes the very package coremltools'
whole default pipeline writes — for every design, on every supported family — and a kept pass matters."""

from __future__ import annotations

import pytest
from test_families import FAMILIES, write_family_checkpoint

from anelab.hf.checkpoint import load_checkpoint
from anelab.hf.default import default_checkpoint_dir
from anelab.sidecar.coremltools_import import coremltools_modules
from anelab.sidecar.designs import DENSE, STATEFUL, STATEFUL_TILED, TILED
from anelab.sidecar.export import (
    SIDECAR_PASSES,
    convert_program,
    function_builds,
    merge_functions,
    sidecar_pass_pipeline,
)
from anelab.sidecar.format import WEIGHTS_RELATIVE

CHUNK = 4


def _saved(prog_builder, dest, pipeline) -> tuple[bytes, bytes]:
    """(spec, weights) bytes of the program converted with ``pipeline`` and saved at ``dest``."""
    ct, _, _ = coremltools_modules()
    convert_program(prog_builder(), dest, pipeline=pipeline)
    return ct.utils.load_spec(str(dest)).SerializeToString(deterministic=True), (dest / WEIGHTS_RELATIVE).read_bytes()


def _same_both_ways(tmp_path, checkpoint, layer, graph, chunk, histories, functions, **options) -> None:
    ct, _, _ = coremltools_modules()
    builds = function_builds(checkpoint.geometry, checkpoint.layer(layer), graph, chunk, histories, **options)
    for name in functions:
        short = _saved(builds[name], tmp_path / f"{graph}-{layer}-{name}-short.mlpackage", None)
        whole = _saved(builds[name], tmp_path / f"{graph}-{layer}-{name}-whole.mlpackage", ct.PassPipeline.DEFAULT)
        assert short == whole, f"{graph} layer {layer} {name}: the short pipeline's package differs"


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_converts_identically_with_the_short_pipeline(tmp_path, family):
    checkpoint = load_checkpoint(write_family_checkpoint(tmp_path / "ckpt", family))
    g = checkpoint.geometry
    layers = {g.window_of(layer) is None: layer for layer in reversed(g.full_attention_layers)}  # one of each kind
    for layer in layers.values():
        _same_both_ways(tmp_path, checkpoint, layer, DENSE, CHUNK, [CHUNK], ["h4"])
        _same_both_ways(tmp_path, checkpoint, layer, STATEFUL_TILED, CHUNK, None, ["c4"], capacity=4 * CHUNK)


def test_every_design_converts_identically_on_the_default_model(tmp_path):
    """The default model's head_dim 64 makes RoPE tables of 100+ values, which const_deduplication merges."""
    checkpoint = load_checkpoint(default_checkpoint_dir())
    layer = checkpoint.geometry.full_attention_layers[0]
    _same_both_ways(tmp_path, checkpoint, layer, DENSE, 64, [0, 64], ["h0", "h64"])
    _same_both_ways(tmp_path, checkpoint, layer, TILED, 64, [128], ["h128"], key_tile=64)
    _same_both_ways(tmp_path, checkpoint, layer, STATEFUL, 64, None, ["c64", "c1"], capacity=256, decode=True)
    _same_both_ways(tmp_path, checkpoint, layer, STATEFUL_TILED, 64, None, ["c64", "c1"], capacity=256, decode=True)
    _same_both_ways(tmp_path, checkpoint, layer, STATEFUL_TILED, 64, None, ["c64"], capacity=256, mask_mode="additive")


def test_a_kept_pass_changes_the_package_so_the_comparison_can_fail(tmp_path):
    """Negative control: without one of the kept passes (here the one merging the duplicated RoPE tables of
    a function) the package is not the default pipeline's."""
    ct, _, _ = coremltools_modules()
    checkpoint = load_checkpoint(default_checkpoint_dir())
    layer = checkpoint.geometry.full_attention_layers[0]
    builds = function_builds(checkpoint.geometry, checkpoint.layer(layer), DENSE, 64, [64])
    fewer = sidecar_pass_pipeline(tuple(p for p in SIDECAR_PASSES if p != "common::const_deduplication"))
    whole = _saved(builds["h64"], tmp_path / "whole.mlpackage", ct.PassPipeline.DEFAULT)
    assert _saved(builds["h64"], tmp_path / "fewer.mlpackage", fewer) != whole
    with pytest.raises(RuntimeError, match="has no pass common::no_such_pass"):
        sidecar_pass_pipeline(("common::no_such_pass",))


def _merged_bytes(pkg) -> tuple[bytes, bytes]:
    ct, _, _ = coremltools_modules()
    spec = ct.utils.load_spec(str(pkg))
    spec.description.metadata.Clear()
    return spec.SerializeToString(deterministic=True), (pkg / WEIGHTS_RELATIVE).read_bytes()


@pytest.mark.parametrize("graph", [DENSE, STATEFUL_TILED])
def test_the_merge_writes_what_save_multifunction_writes(tmp_path, graph):
    """``merge_functions`` against coremltools' own merge of the same converted functions: the same bytes,
    and the shared weights stored once (the merged weights are far smaller than the functions' sum)."""
    ct, _, _ = coremltools_modules()
    checkpoint = load_checkpoint(default_checkpoint_dir())
    layer = checkpoint.geometry.full_attention_layers[0]
    options = {"capacity": 256, "decode": True} if graph == STATEFUL_TILED else {}
    histories = None if graph == STATEFUL_TILED else [0, 64, 128]
    builds = function_builds(checkpoint.geometry, checkpoint.layer(layer), graph, 64, histories, **options)
    variants = {name: convert_program(b(), tmp_path / f"{name}.mlpackage") for name, b in builds.items()}
    ours = merge_functions(variants, tmp_path / "ours.mlpackage", next(iter(variants)), {"a.test.key": "kept"})
    desc = ct.utils.MultiFunctionDescriptor()
    for name, path in variants.items():
        desc.add_function(str(path), src_function_name="main", target_function_name=name)
    desc.default_function_name = next(iter(variants))
    ct.utils.save_multifunction(desc, str(tmp_path / "theirs.mlpackage"))
    assert _merged_bytes(ours) == _merged_bytes(tmp_path / "theirs.mlpackage")
    assert ct.utils.load_spec(str(ours)).description.metadata.userDefined["a.test.key"] == "kept"
    single = sum((p / WEIGHTS_RELATIVE).stat().st_size for p in variants.values())
    assert (ours / WEIGHTS_RELATIVE).stat().st_size < 0.6 * single


def test_constants_are_shared_only_when_bit_equal(tmp_path):
    """Negative control for the matching: a weight that differs in one value keeps its own copy."""
    ct, mb, types = coremltools_modules()
    import numpy as np

    from anelab.sidecar.export import share_identical_constants

    w = np.arange(256, dtype=np.float16).reshape(16, 16)
    nudged = w.copy()
    nudged[3, 3] = np.nextafter(nudged[3, 3], np.float16(1000))

    def program(weight):
        @mb.program(input_specs=[mb.TensorSpec((16, 16), dtype=types.fp16)], opset_version=ct.target.iOS18)
        def prog(x):
            return mb.matmul(x=x, y=mb.const(val=weight), name="y")

        return prog

    def shared(first, second):
        from coremltools.converters.mil.mil import Program

        merged = Program()
        merged.add_function("a", program(first).functions["main"])
        merged.add_function("b", program(second).functions["main"])
        share_identical_constants(merged)
        weights = [op for f in merged.functions.values() for op in f.operations if op.op_type == "const"]
        return [op.weight_id for op in weights if op.outputs[0].shape == (16, 16)]

    assert shared(w, w.copy()) == ["0", "0"]
    assert shared(w, nudged) == [None, None]
