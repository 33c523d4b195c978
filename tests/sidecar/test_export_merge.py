"""The exporter's merge of single-function packages (``export.merge_functions``) writes the very package
``ct.utils.save_multifunction`` writes, and shares a constant only when it is bit-equal."""

from __future__ import annotations

import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.checkpoints.default import default_checkpoint_dir
from anelab.sidecar.coremltools_import import coremltools_modules
from anelab.sidecar.designs import DENSE, STATEFUL_TILED
from anelab.sidecar.export import convert_program, function_builds, merge_functions
from anelab.sidecar.format import WEIGHTS_RELATIVE


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
    # stateful-tiled: query tiles narrower than the chunk (consecutive reshapes the pipeline merges)
    options = {"capacity": 256, "decode": True, "key_tile": 32, "query_tile": 16} if graph == STATEFUL_TILED else {}
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
