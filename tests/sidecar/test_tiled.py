"""Tiled (flash) attention sidecars: export -> saved package -> evaluation from disk -> verification."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import TINY_GEOMETRIES

from anelab.checkpoints.checkpoint import load_checkpoint
from anelab.cli import main
from anelab.core.errors import AnelabInputError
from anelab.core.masks import causal
from anelab.sidecar.checks.comparison import RELATIVE_ERROR_THRESHOLD, relative_error, rope_control_offset
from anelab.sidecar.checks.verify import verify_package
from anelab.sidecar.export import export_sidecars
from anelab.sidecar.format import KEY_TILE_META, read_raw_metadata, read_sidecar_metadata
from anelab.sidecar.graphs import common as graph_common
from anelab.sidecar.inspection import inspect_package
from anelab.sidecar.mil.evaluate import SavedPackage, evaluate

CHUNK = 8
HISTORIES = [0, 8, 16]
KEY_TILES = {"llama": 2, "qwen3_next": 4}


def _layer(variant: str) -> int:
    return TINY_GEOMETRIES[variant].full_attention_layers[-1]


@pytest.fixture(scope="module")
def packages(tiny_checkpoint, tmp_path_factory):
    """variant -> (checkpoint, tiled package); the llama one is exported through the CLI, and a
    dense llama package is kept as the comparison."""
    out = {}
    ckpt = tiny_checkpoint("llama")
    where = tmp_path_factory.mktemp("tiled-llama")
    assert (
        main(
            [
                "export",
                str(ckpt),
                "--chunk",
                str(CHUNK),
                "--histories",
                ",".join(map(str, HISTORIES)),
                "--layers",
                str(_layer("llama")),
                "--graph",
                "tiled",
                "--tile",
                str(KEY_TILES["llama"]),
                "--out",
                str(where),
            ]
        )
        == 0
    )
    out["llama"] = (ckpt, where / f"layer_{_layer('llama')}.mlpackage")
    ckpt = tiny_checkpoint("qwen3_next")
    [r] = export_sidecars(
        load_checkpoint(ckpt),
        tmp_path_factory.mktemp("tiled-qwen3_next"),
        CHUNK,
        HISTORIES,
        [_layer("qwen3_next")],
        graph="tiled",
        key_tile=KEY_TILES["qwen3_next"],
    )
    out["qwen3_next"] = (ckpt, r.package)
    [r] = export_sidecars(
        load_checkpoint(tiny_checkpoint("llama")),
        tmp_path_factory.mktemp("dense-llama"),
        CHUNK,
        HISTORIES,
        [_layer("llama")],
    )
    out["dense_llama"] = (tiny_checkpoint("llama"), r.package)
    return out


@pytest.mark.parametrize("variant", ["llama", "qwen3_next"])
def test_tiled_package_passes_verification_from_disk(packages, variant):
    ckpt, pkg = packages[variant]
    meta = read_sidecar_metadata(pkg)
    assert meta.graph == "tiled" and meta.weights == "fp16"
    assert read_raw_metadata(pkg)[KEY_TILE_META] == str(KEY_TILES[variant])
    report = verify_package(pkg, load_checkpoint(ckpt))
    assert report.passed, report.table()
    assert {c.function for c in report.comparisons} == {f"h{h}" for h in HISTORIES}
    ordinary = [c for c in report.comparisons if not c.control]
    assert all(1e-5 < c.worst < RELATIVE_ERROR_THRESHOLD for c in ordinary)
    controls = [c for c in report.comparisons if c.control]
    masked = {c.function for c in controls if c.case == "control: mask reaches graph"}
    assert masked == {f"h{h}" for h in HISTORIES}  # the controls ran: an empty list would pass all() below
    assert all(c.worst > 10 * RELATIVE_ERROR_THRESHOLD for c in controls)


def test_tiled_graph_holds_no_full_score_tensor(packages):
    """No op of the tiled h16 function has an axis of H + C = 24 keys; the dense one has (control)."""
    T = 16 + CHUNK
    _, tiled = packages["llama"]
    _, dense = packages["dense_llama"]

    def ops_with_all_keys(pkg):
        fn = SavedPackage(pkg).mil_function("h16")
        return [
            op.op_type
            for op in fn.operations
            if op.op_type != "const"
            for out in op.outputs
            if getattr(out, "shape", None) and T in tuple(out.shape)
        ]

    assert ops_with_all_keys(tiled) == []
    assert "matmul" in ops_with_all_keys(dense) and "softmax" in ops_with_all_keys(dense)
    # the score tile is [Hkv, group * C, key_tile]: no exp runs on more than Hq * C * key_tile values
    g = TINY_GEOMETRIES["llama"]
    fn = SavedPackage(tiled).mil_function("h16")
    exp_sizes = [int(np.prod(op.outputs[0].shape)) for op in fn.operations if op.op_type == "exp"]
    assert exp_sizes and max(exp_sizes) == g.num_heads * CHUNK * KEY_TILES["llama"]


def test_tiled_and_dense_packages_agree_in_fp32(packages):
    """Online softmax is exact arithmetic-wise: fp32 evaluations of both graphs agree closely, and a
    different mask moves the tiled result (so agreement is not trivial)."""
    g = TINY_GEOMETRIES["llama"]
    rng = np.random.default_rng(5)
    inputs = {
        "hidden": rng.standard_normal((CHUNK, g.hidden_size)).astype(np.float16),
        "k_history": rng.standard_normal((16, g.num_kv_heads, g.head_dim)).astype(np.float16),
        "v_history": rng.standard_normal((16, g.num_kv_heads, g.head_dim)).astype(np.float16),
        "mask": causal(CHUNK, 16),
    }
    tiled = evaluate(packages["llama"][1], "h16", inputs, fp16=False)
    dense = evaluate(packages["dense_llama"][1], "h16", inputs, fp16=False)
    for name in dense:
        assert relative_error(tiled[name], dense[name]) < 1e-5, name
    # keys at the start of the history hidden by the mask: tiles that are fully masked must not count
    masked = inputs["mask"].copy()
    masked[:, :4] = -30000
    moved = evaluate(packages["llama"][1], "h16", {**inputs, "mask": masked}, fp16=False)
    ref_moved = evaluate(packages["dense_llama"][1], "h16", {**inputs, "mask": masked}, fp16=False)
    assert relative_error(moved["attn_out"], tiled["attn_out"]) > 0.01
    assert relative_error(moved["attn_out"], ref_moved["attn_out"]) < 1e-5


def test_largest_intermediate_is_reported_per_function(packages, capsys):
    _, pkg = packages["llama"]
    assert main(["inspect", str(pkg), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    g = TINY_GEOMETRIES["llama"]
    dense = inspect_package(packages["dense_llama"][1])["functions"]
    for name in ("h0", "h8", "h16"):
        assert info["functions"][name]["largest_intermediate_bytes"] > 0
    # dense h16 holds the [Hkv, group, C, H + C] fp16 scores; tiled's largest is a [C, Hq*d] projection
    assert dense["h16"]["largest_intermediate_bytes"] == 2 * g.num_heads * CHUNK * (16 + CHUNK)
    assert info["functions"]["h16"]["largest_intermediate_bytes"] == 2 * CHUNK * g.num_heads * g.head_dim
    assert info["functions"]["h16"]["largest_intermediate_bytes"] < dense["h16"]["largest_intermediate_bytes"]


def test_tiled_graph_with_wrong_rope_fails_verification(tiny_checkpoint, tmp_path, monkeypatch):
    """A tiled graph built with history-rotation tables as many positions late as the RoPE control's offset
    must fail. It fails twice: its outputs miss the reference, and the 'rope offset' control — the reference
    that many positions late — now *matches* it, so the report also calls itself vacuous."""
    real = graph_common.rope_tables
    offset = rope_control_offset(TINY_GEOMETRIES["llama"], _layer("llama"))
    monkeypatch.setattr(
        graph_common,
        "rope_tables",
        lambda g, layer, chunk, history, coverage=None: real(g, layer, chunk, history + offset, coverage),
    )
    ckpt = tiny_checkpoint("llama")
    [r] = export_sidecars(load_checkpoint(ckpt), tmp_path, CHUNK, [8], [_layer("llama")], graph="tiled", key_tile=4)
    report = verify_package(r.package, load_checkpoint(ckpt))
    assert not report.passed
    full = [c for c in report.comparisons if c.case == "full chunk"]
    rope_control = [c for c in report.comparisons if c.case == f"control: rope offset +{offset}"]
    assert report.vacuous and rope_control[0].worst < RELATIVE_ERROR_THRESHOLD
    assert full and full[0].errors["attn_out"] > RELATIVE_ERROR_THRESHOLD
    assert full[0].errors["k_chunk"] > RELATIVE_ERROR_THRESHOLD


def test_bad_tile_is_refused(tiny_checkpoint, tmp_path, capsys):
    ckpt = tiny_checkpoint("llama")
    with pytest.raises(AnelabInputError, match="does not divide the chunk 8"):
        export_sidecars(load_checkpoint(ckpt), tmp_path, CHUNK, [0], [0], graph="tiled", key_tile=3)
    with pytest.raises(AnelabInputError, match="positive integer"):
        export_sidecars(load_checkpoint(ckpt), tmp_path, CHUNK, [0], [0], graph="tiled", key_tile=0)
    with pytest.raises(AnelabInputError, match="--tile applies to --graph tiled or stateful-tiled, not dense"):
        export_sidecars(load_checkpoint(ckpt), tmp_path, CHUNK, [0], [0], graph="dense", key_tile=4)
    with pytest.raises(AnelabInputError, match="unknown --graph"):
        export_sidecars(load_checkpoint(ckpt), tmp_path, CHUNK, [0], [0], graph="flash")
    code = main(
        [
            "export",
            str(ckpt),
            "--chunk",
            "8",
            "--histories",
            "0",
            "--graph",
            "tiled",
            "--tile",
            "5",
            "--out",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "does not divide the chunk" in err[0]
    assert not any(tmp_path.glob("*.mlpackage"))
