"""Defect 1 of issue 11: stateful sidecars run through their state, under their own function names.

At 6b7ba86 ``Sidecar.function_for`` and ``memory_vs_functions`` asked a stateful package (functions
``c<C>`` / ``c1``) for ``h<H>`` names, and ``predict`` passed no state, which Core ML refuses
(apple/coremltools#2519). The fake refuses a stateful predict without a state and any input that
does not match the saved spec, so these tests pass only through the state, with the right names.
"""

from __future__ import annotations

import numpy as np
import pytest

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.runtimes.coreml.coreml_fake import FakeRuntime
from anelab.runtimes.interface import RuntimePredictError, package_functions, zero_inputs
from anelab.runtimes.open import open_sidecar
from anelab.sidecar.export import export_layer
from anelab.studies.setup_cost import memory_vs_functions

CHUNK, CAPACITY = 4, 8


@pytest.fixture(scope="module")
def stateful(tiny_checkpoint, tmp_path_factory):
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    out = tmp_path_factory.mktemp("stateful")
    return export_layer(ckpt, 0, CHUNK, None, out, graph="stateful", capacity=CAPACITY, decode=True).package


def test_the_functions_come_from_the_package_metadata(stateful):
    assert package_functions(stateful) == ["c4", "c1"]


def test_memory_vs_functions_loads_the_stateful_functions_by_their_names(stateful):
    asked = []

    def measure(pkg, functions, *, compute_units):
        asked.append(list(functions))
        return {"loads": [{"function": f, "rss_bytes": 1, "delta_bytes": 1} for f in functions]}

    memory_vs_functions({2: stateful}, measure=measure)
    assert asked == [["c4", "c1"]]


def test_open_sidecar_serves_a_stateful_package_through_one_state(stateful):
    runtime = FakeRuntime()
    sidecar = open_sidecar(stateful, compute_units="cpu_only", chunk=CHUNK, prompt_tokens=CAPACITY, runtime=runtime)
    assert sidecar.function_for(0) == "c4" and sidecar.function_for(4) == "c4"
    sig = runtime.signature(stateful, "c4")
    assert set(sig.states) == {"k_cache", "v_cache"}
    seen = []
    for start in (0, 4):
        inputs = zero_inputs(sig)
        inputs["start"] = np.array([start], np.int32)
        out = sidecar.predict(start, inputs)
        assert out["attn_out"].shape == (CHUNK, sig.inputs["hidden"][0][1])
        seen.append(sidecar.state)
    assert seen[0] is seen[1] and set(seen[0]) == {"k_cache", "v_cache"}  # one state carried across calls
    sidecar.reset_state()
    assert sidecar.state is None
    # control: the same function without a state is refused, as Core ML refuses it
    handle = sidecar.handle_for(0)
    with pytest.raises(RuntimePredictError, match="must be an MLState"):
        runtime.predict(handle, zero_inputs(sig))
