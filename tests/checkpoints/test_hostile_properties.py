"""Property-based hostile input: generated malformed safetensors headers and config.json files.

Headers: a valid header is generated and then broken one way at a time; anelab's validator
(``safetensors_io.parse_header`` + ``header_problem``) and the ``safetensors`` library are fed the same file
and must agree on whether it is valid — with one documented exception, where anelab is the stricter: the
library also reads a tensor entry written as a JSON array ``[dtype, shape, offsets]`` (serde's sequence form of
a struct), which no writer produces. ``SafetensorsFile.open`` raises nothing but ``AnelabInputError`` on any
bytes at all. Configs: any value at any key of a real config either gives a sane geometry or one line.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anelab.checkpoints.safetensors_io import FORMAT_DTYPE_BITS, SafetensorsFile, header_problem, parse_header
from anelab.core.errors import AnelabInputError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
WHOLE_BYTE_DTYPES = sorted(d for d, bits in FORMAT_DTYPE_BITS.items() if bits % 8 == 0)


@st.composite
def valid_headers(draw) -> tuple[dict, int]:
    """(header, data bytes): 1-4 tensors of whole-byte dtypes, small shapes, contiguous offsets in name order."""
    header, offset = {}, 0
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(WHOLE_BYTE_DTYPES))
        shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
        size = math.prod(shape) * FORMAT_DTYPE_BITS[dtype] // 8
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    return header, offset


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
)


@st.composite
def broken_files(draw) -> tuple[bytes, bytes, bool]:
    """(header JSON bytes, data bytes, the entry-as-array exception applies): a valid header broken one way."""
    header, size = draw(valid_headers())
    data = bytes(size)
    names = [n for n in header if n != "__metadata__"]
    name = draw(st.sampled_from(names))
    entry = header[name]
    kinds = ["offset", "shift", "field", "drop", "dtype", "shape", "data", "metadata", "array", "none"]
    how = draw(st.sampled_from(kinds))
    as_array = False
    if how == "shift":  # every size still right, the tensor moved: a gap before it, an overlap after it
        k = draw(st.integers(1, 8))
        entry["data_offsets"] = [o + k for o in entry["data_offsets"]]
        data += bytes(k)
    elif how == "offset":
        entry["data_offsets"][draw(st.integers(0, 1))] += draw(st.sampled_from([-1, 1, 2, 8, 0.5, -(2**65), 2**64]))
    elif how == "field":
        entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(JSON_VALUES)
    elif how == "drop":
        del entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]
    elif how == "dtype":
        entry["dtype"] = draw(st.sampled_from([*FORMAT_DTYPE_BITS, "f32", "F31", "", "FLOAT"]))
    elif how == "shape":
        entry["shape"] = draw(st.lists(st.integers(-2, 2**33) | st.floats(0, 4), max_size=4))
    elif how == "data":
        data = data + bytes(draw(st.integers(1, 9))) if draw(st.booleans()) else data[: -draw(st.integers(1, 9))]
    elif how == "metadata":
        header["__metadata__"] = draw(JSON_VALUES)
    elif how == "array":
        header[name] = [entry["dtype"], entry["shape"], entry["data_offsets"]]
        as_array = True
    return json.dumps(header).encode(), data, as_array


def _file(path: Path, text: bytes, data: bytes) -> Path:
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _library_refuses(path: Path) -> bool:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy"):
            return False
    except SafetensorError:
        return True


def _anelab_refuses(text: bytes, data_bytes: int) -> bool:
    header, problem = parse_header(text)
    return problem is not None or header_problem(header, data_bytes) is not None


@SETTINGS
@given(case=broken_files())
def test_anelab_and_the_safetensors_library_refuse_the_same_headers(case, tmp_path):
    text, data, as_array = case
    path = _file(tmp_path / "x.safetensors", text, data)
    library, anelab = _library_refuses(path), _anelab_refuses(text, len(data))
    if as_array and not library:
        assert anelab  # the one place anelab is stricter: an entry as a JSON array
    else:
        assert anelab == library, (text[:300], len(data), "library refuses" if library else "library reads it")
    if anelab or library:
        with pytest.raises(AnelabInputError, match="not a valid safetensors file"):
            SafetensorsFile.open(path)
    else:
        assert set(SafetensorsFile.open(path).entries) == {n for n in json.loads(text) if n != "__metadata__"}


def test_the_generator_makes_both_kinds():
    """The property above is not vacuous: its generator yields files the library reads and files it refuses."""
    seen = set()

    @settings(max_examples=80, deadline=None)
    @given(case=broken_files())
    def collect(case):
        text, data, _ = case
        with tempfile.TemporaryDirectory() as d:
            seen.add(_library_refuses(_file(Path(d) / "x.safetensors", text, data)))

    collect()
    assert seen == {True, False}


@SETTINGS
@given(blob=st.binary(max_size=300), n=st.integers(0, 2**64 - 1) | st.integers(0, 400))
def test_any_bytes_at_all_are_a_safetensors_file_or_one_line(blob, n, tmp_path):
    path = tmp_path / "y.safetensors"
    path.write_bytes(struct.pack("<Q", n) + blob)
    try:
        SafetensorsFile.open(path)
    except AnelabInputError as e:
        assert "\n" not in str(e) and len(str(e)) < 600


# ---- config.json -----------------------------------------------------------------------------------------

DENSE_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 32, "hidden_act": "silu",
    "hidden_size": 128, "intermediate_size": 256, "model_type": "qwen3", "num_attention_heads": 4,
    "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 512,
}  # fmt: skip
CONFIG_KEYS = [*DENSE_CONFIG, "partial_rotary_factor", "rope_scaling", "rope_parameters", "layer_types",
               "sliding_window", "use_sliding_window", "max_position_embeddings", "max_window_layers"]  # fmt: skip
INT_KEYS = ["hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "head_dim",
            "vocab_size", "intermediate_size", "max_position_embeddings"]  # fmt: skip
HOSTILE_NUMBERS = st.sampled_from(
    [0, -1, 1, 2, 3, 4, 8, 2.5, 4.0, 10**9, 2**64, 1e400, float("nan"), float("-inf"), -0.0, 0.5, 1e-300, True, "4"]
)


@st.composite
def broken_configs(draw) -> dict:
    """The dense sibling's config with one to three values replaced: an integer setting by a hostile number,
    or any setting by any JSON value."""
    config = dict(DENSE_CONFIG)
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            config[draw(st.sampled_from(INT_KEYS))] = draw(HOSTILE_NUMBERS)
        else:
            config[draw(st.sampled_from(CONFIG_KEYS))] = draw(HOSTILE_NUMBERS | JSON_VALUES)
    return config


def _exactly(config: dict, key: str, value: int) -> bool:
    """The config gives ``key`` as exactly ``value`` (an int, or a float holding it), not a string or a rounding."""
    given = config.get(key)
    return not isinstance(given, bool) and isinstance(given, int | float) and given == value


@settings(max_examples=400, deadline=None)
@given(config=broken_configs())
def test_any_config_gives_a_sane_geometry_or_one_line(config):
    from anelab.checkpoints.config import geometry_from_config
    from anelab.core.limits import MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS, MAX_WIDTH

    try:
        g = geometry_from_config(json.loads(json.dumps(config)))
    except AnelabInputError as e:
        assert "\n" not in str(e) and len(str(e)) < 600
        return
    assert 1 <= g.num_layers <= MAX_LAYERS and 1 <= g.hidden_size <= MAX_WIDTH
    assert 1 <= g.num_kv_heads <= g.num_heads <= MAX_HEADS and 1 <= g.head_dim <= MAX_HEAD_DIM
    assert math.isfinite(g.rope_theta) and g.rope_theta > 0 and 0 < g.partial_rotary_factor <= 1
    assert math.isfinite(g.rms_norm_eps) and g.rms_norm_eps > 0
    for key, value in (("hidden_size", g.hidden_size), ("num_attention_heads", g.num_heads),
                       ("num_hidden_layers", g.num_layers)):  # fmt: skip
        assert _exactly(config, key, value), (key, config.get(key), value)  # read as given, never rounded or parsed
    if config.get("head_dim") is not None:
        assert _exactly(config, "head_dim", g.head_dim), (config.get("head_dim"), g.head_dim)


@pytest.fixture(scope="module")
def dense_weights(tmp_path_factory) -> Path:
    from anelab.checkpoints.default import make_dense_checkpoint

    return make_dense_checkpoint(tmp_path_factory.mktemp("props") / "dense") / "model.safetensors"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=broken_configs())
def test_any_config_loads_as_a_whole_model_or_one_line(config, dense_weights, tmp_path):
    """The whole-model reader (compare-arms) on the same configs: a model, or one line, never a traceback."""
    from anelab.checkpoints.whole_model import load_model

    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        (Path(d) / "config.json").write_text(json.dumps(config))
        os.link(dense_weights, Path(d) / "model.safetensors")
        try:
            load_model(d)
        except AnelabInputError as e:
            assert "\n" not in str(e)
