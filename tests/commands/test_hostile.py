"""Hostile input: every malformed config, header, index, package, record and flag gets one line and exit 2.

Issue 31's probe (291 runs on copies of the built-in checkpoints) as a table: each row builds one hostile
input in a fresh directory and names the command that reads it. Every row must end with exit status 2,
exactly one line on stderr (``anelab: error: ...``, at most ``MAX_ERROR_CHARS`` long, never a file's bytes),
no traceback, nothing written (the directory tree, $TMPDIR included, is unchanged) and no hang.
``python tests/commands/test_hostile.py [--against DIR]`` runs the table outside pytest and counts the outcomes
(``DIR``: another checkout's ``anelab`` package, e.g. main before the fixes).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import struct
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

MAX_ERROR_CHARS = 600  # a refusal is one readable line, not a dump of the input
CASE_TIMEOUT_S = 60  # a row that takes longer is a hang (a FIFO opened for reading blocks forever)
CHUNK = 16


# ---- the inputs each row starts from ----------------------------------------------------------------------


@dataclass
class Sources:
    """Pristine inputs, made once: the dense sibling (whole model, 4 full-attention layers), the hybrid default
    (full attention at 3 and 7) and an export of every dense layer (chunk 16, histories 0,16)."""

    dense: Path
    hybrid: Path
    export: Path


def make_sources(root: Path) -> Sources:
    from anelab.checkpoints.default import make_default_checkpoint, make_dense_checkpoint
    from anelab.cli import main

    dense, hybrid, export = root / "dense", root / "hybrid", root / "export"
    make_dense_checkpoint(dense)
    make_default_checkpoint(hybrid)
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        argv = ["export", str(dense), "--chunk", str(CHUNK), "--histories", f"0,{CHUNK}", "--out", str(export)]
        assert main([*argv, "--jobs", "1"]) == 0
    return Sources(dense, hybrid, export)


class Lab:
    """One row's working directory: copies of the sources to break, and where a command may write."""

    def __init__(self, root: Path, sources: Sources):
        self.root, self.sources = root, sources
        self.out = root / "out"

    def checkpoint(self, which: str = "dense") -> Path:
        dest = self.root / f"ck-{which}"
        if not dest.exists():
            shutil.copytree(getattr(self.sources, which), dest)
        return dest

    def config(self, edit: Callable[[dict], None] | None = None, *, raw: bytes | None = None, which="dense") -> Path:
        ck = self.checkpoint(which)
        config = json.loads((ck / "config.json").read_text())
        if edit is not None:
            edit(config)
        (ck / "config.json").write_bytes(raw if raw is not None else json.dumps(config).encode())
        return ck

    def header(self, edit: Callable[[dict], None] | None = None, *, raw: bytes | None = None, data=None) -> Path:
        """The dense checkpoint with its safetensors header edited (``edit(header)``), replaced (``raw``) or its
        data replaced (``data(bytes) -> bytes``)."""
        ck = self.checkpoint()
        path = ck / "model.safetensors"
        blob = path.read_bytes()
        n = struct.unpack("<Q", blob[:8])[0]
        header, body = json.loads(blob[8 : 8 + n]), blob[8 + n :]
        if edit is not None:
            edit(header)
        text = raw if raw is not None else json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + (body if data is None else data(body, header)))
        return ck

    def index(self, weight_map, *, raw: bytes | None = None) -> Path:
        """The dense checkpoint behind a shard index (``weight_map``: a value, or ``f(names) -> value``)."""
        ck = self.checkpoint()
        names = [k for k in _header_of(ck / "model.safetensors") if k != "__metadata__"]
        value = weight_map(names) if callable(weight_map) else weight_map
        text = raw if raw is not None else json.dumps({"metadata": {}, "weight_map": value}).encode()
        (ck / "model.safetensors.index.json").write_bytes(text)
        return ck

    def package(self, layer: int = 0) -> Path:
        dest = self.root / "pkgs" / f"layer_{layer}.mlpackage"
        if not dest.exists():
            shutil.copytree(self.sources.export / f"layer_{layer}.mlpackage", dest)
        return dest

    def export_argv(self, ck: Path, *extra: str) -> list[str]:
        return ["export", str(ck), "--chunk", str(CHUNK), "--histories", f"0,{CHUNK}", "--out", str(self.out),
                "--jobs", "1", *extra]  # fmt: skip

    def tokens(self, text: bytes) -> Path:
        path = self.root / "tokens.txt"
        path.write_bytes(text)
        return path

    def fifo(self, name: str) -> Path:
        path = self.root / name
        os.mkfifo(path)
        return path


def _header_of(path: Path) -> dict:
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n])


def _set(key, value, *, nested=None):
    def edit(config):
        (config[nested] if nested else config)[key] = value

    return edit


def _tensor(header: dict, suffix: str, layer: int = 0) -> str:
    return next(n for n in header if n.endswith(f"layers.{layer}.self_attn.{suffix}"))


def _entry(suffix: str, field: str, value, layer: int = 0):
    def edit(header):
        header[_tensor(header, suffix, layer)][field] = value

    return edit


def _overlap_k_on_q(header):
    """k_proj's offsets moved onto the first bytes of q_proj (same dtype; the bytes in between left unused)."""
    q, k = header[_tensor(header, "q_proj.weight")], header[_tensor(header, "k_proj.weight")]
    size = k["data_offsets"][1] - k["data_offsets"][0]
    k["data_offsets"] = [q["data_offsets"][0], q["data_offsets"][0] + size]


def _poison(value: float, suffix: str = "k_proj.weight", layer: int = 2):
    """Data with one element of a tensor set to ``value`` (NaN, Inf), header unchanged."""
    import ml_dtypes
    import numpy as np

    def data(body: bytes, header: dict) -> bytes:
        begin = header[_tensor(header, suffix, layer)]["data_offsets"][0]
        cell = np.array([value], dtype=ml_dtypes.bfloat16).tobytes()
        return body[:begin] + cell + body[begin + len(cell) :]

    return data


def _metadata(key: str, value: str):
    def tamper(lab: Lab) -> Path:
        from anelab.sidecar.format import read_raw_metadata, write_package_metadata

        src = lab.package()
        dest = src.with_name("tampered.mlpackage")
        write_package_metadata(src, dest, {**read_raw_metadata(src), key: value})
        shutil.rmtree(src)
        return dest

    return tamper


def _weight_file(lab: Lab, change: Callable[[Path], None]) -> Path:
    pkg = lab.package()
    change(pkg / "Data/com.apple.CoreML/weights/weight.bin")
    return pkg


def _flip_spec_byte(lab: Lab) -> Path:
    pkg = lab.package()
    spec = pkg / "Data/com.apple.CoreML/model.mlmodel"
    blob = bytearray(spec.read_bytes())
    blob[len(blob) // 3] ^= 0xFF
    spec.write_bytes(bytes(blob))
    return pkg


def _records(lab: Lab, name: str, record_edit: Callable[[dict], None]) -> Path:
    """A copy of the recorded data (data/*.json) with record ``name`` edited (still schema-valid)."""
    from anelab.core.paths import DATA_DIR

    directory = lab.root / "records"
    directory.mkdir()
    for src in DATA_DIR.glob("*.json"):
        shutil.copy(src, directory / src.name)
    record = json.loads((directory / name).read_text())
    record_edit(record)
    (directory / name).write_text(json.dumps(record))
    return directory


def _rows_as_text(record):
    record["results"]["rows"] = "not a list"


def _percent_as_text(record):
    for row in record["results"]["rows"]:
        row["relative_error_percent"] = "0.1 percent"


def _notebook_without_quick(lab: Lab) -> Path:
    """A study-like notebook whose parameters cell lacks ``quick`` (anelab run must refuse it before writing)."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("seed = 0")
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell, nbformat.v4.new_code_cell("print(seed)")]
    path = lab.root / "study.ipynb"
    nbformat.write(nb, str(path))
    return path


def _deep(depth: int) -> bytes:
    return b'{"model_type": "qwen3", "x": ' + b"[" * depth + b"]" * depth + b"}"


# ---- the table: row name -> the command (argv) after building its input in the lab -------------------------

CASES: dict[str, Callable[[Lab], list[str]]] = {
    # config.json (item 5, 9): text, numbers, types, nesting
    "config not UTF-8": lambda lab: lab.export_argv(lab.config(raw=b'{"model_type": "qwen3\xff\xfe"}')),
    "config rope_theta a word": lambda lab: lab.export_argv(lab.config(_set("rope_theta", "fast"))),
    "config rope_theta Infinity": lambda lab: lab.export_argv(lab.config(_set("rope_theta", float("inf")))),
    "config partial_rotary_factor a string": lambda lab: lab.export_argv(
        lab.config(_set("partial_rotary_factor", "0.25"), which="hybrid")
    ),
    "config partial_rotary_factor a word": lambda lab: lab.export_argv(
        lab.config(_set("partial_rotary_factor", "quarter"), which="hybrid")
    ),
    "config hidden_size NaN": lambda lab: lab.export_argv(lab.config(_set("hidden_size", float("nan")))),
    "config num_hidden_layers 1e400": lambda lab: lab.export_argv(
        lab.config(
            raw=(lab.checkpoint() / "config.json")
            .read_bytes()
            .replace(b'"num_hidden_layers": 4', b'"num_hidden_layers": 1e400')
        )
    ),
    "config num_hidden_layers 1e9": lambda lab: lab.export_argv(lab.config(_set("num_hidden_layers", 10**9))),
    "config num_hidden_layers 1e7 (hybrid)": lambda lab: lab.export_argv(
        lab.config(_set("num_hidden_layers", 10**7), which="hybrid")
    ),
    "config nested 100,000 deep": lambda lab: lab.export_argv(lab.config(raw=_deep(100_000))),
    "config head_dim 0": lambda lab: lab.export_argv(lab.config(_set("head_dim", 0))),
    "config rope_scaling a list": lambda lab: lab.export_argv(lab.config(_set("rope_scaling", [1, 2]))),
    "config model_type a list": lambda lab: lab.export_argv(lab.config(_set("model_type", ["qwen3"]))),
    "config layer_types of lists": lambda lab: lab.export_argv(lab.config(_set("layer_types", [[1]] * 4))),
    "config num_attention_heads true": lambda lab: lab.export_argv(lab.config(_set("num_attention_heads", True))),
    "config rms_norm_eps a word": lambda lab: lab.export_argv(lab.config(_set("rms_norm_eps", "tiny"))),
    "config max_position_embeddings a word": lambda lab: [
        "plan",
        "--checkpoint",
        str(lab.config(_set("max_position_embeddings", "big"))),
        "--prompt-tokens",
        "64",
    ],  # fmt: skip
    "config vocab_size NaN (whole model)": lambda lab: [
        "compare-arms",
        str(lab.config(_set("vocab_size", float("nan")))),
        "--prompt-tokens",
        "4",
        "--decode",
        "1",
    ],  # fmt: skip
    "config a directory": lambda lab: lab.export_argv(_replace_with_dir(lab.checkpoint() / "config.json")),
    "config a FIFO": lambda lab: lab.export_argv(_replace_with_fifo(lab.checkpoint() / "config.json")),
    # safetensors header (item 4, 5)
    "header offsets fractional": lambda lab: lab.export_argv(lab.header(_fractional_offsets)),
    "header k_proj overlaps q_proj": lambda lab: lab.export_argv(lab.header(_overlap_k_on_q)),
    "header offsets as strings": lambda lab: lab.export_argv(lab.header(_string_offsets)),
    "header length past the file": lambda lab: lab.export_argv(_header_length(lab, 10**6)),
    "header length 2**63": lambda lab: lab.export_argv(_header_length(lab, 2**63)),
    "header not UTF-8": lambda lab: lab.export_argv(lab.header(raw=b'{"\xff\xfe": 1}')),
    "header a JSON list": lambda lab: lab.export_argv(lab.header(raw=b"[1, 2, 3]")),
    "header dtype I8 in layer 2": lambda lab: lab.export_argv(lab.header(_entry("k_proj.weight", "dtype", "I8", 2))),
    "header negative shape": lambda lab: lab.export_argv(lab.header(_entry("k_proj.weight", "shape", [-64, -128]))),
    "header shape of floats": lambda lab: lab.export_argv(lab.header(_entry("k_proj.weight", "shape", [64.0, 128]))),
    "header bytes do not match the shape": lambda lab: lab.export_argv(
        lab.header(_entry("k_proj.weight", "shape", [32, 128]))
    ),
    "header trailing bytes after the data": lambda lab: lab.export_argv(lab.header(data=lambda b, h: b + b"\0" * 8)),
    "header truncated data": lambda lab: lab.export_argv(lab.header(data=lambda b, h: b[:-100])),
    "header metadata not strings": lambda lab: lab.export_argv(lab.header(_set("__metadata__", {"format": 1}))),
    "header empty file": lambda lab: lab.export_argv(_truncate(lab.checkpoint() / "model.safetensors", 0)),
    "header 7 bytes": lambda lab: lab.export_argv(_truncate(lab.checkpoint() / "model.safetensors", 7)),
    "weights NaN in layer 2": lambda lab: lab.export_argv(lab.header(data=_poison(float("nan")))),
    "weights Inf in layer 2": lambda lab: lab.export_argv(lab.header(data=_poison(float("inf")))),
    "safetensors a directory": lambda lab: lab.export_argv(_replace_with_dir(lab.checkpoint() / "model.safetensors")),
    # the shard index (items 5, 6)
    "index not UTF-8": lambda lab: lab.export_argv(lab.index(None, raw=b'{"weight_map": {"\xff": 1}}')),
    "index weight_map a list": lambda lab: lab.export_argv(lab.index(lambda names: names)),
    "index weight_map of ints": lambda lab: lab.export_argv(lab.index(lambda names: dict.fromkeys(names, 1))),
    "index weight_map of nulls": lambda lab: lab.export_argv(lab.index(lambda names: dict.fromkeys(names))),
    "index nested 100,000 deep": lambda lab: lab.export_argv(lab.index(None, raw=_deep(100_000))),
    "index a directory": lambda lab: lab.export_argv(
        _replace_with_dir(lab.index(lambda n: {}) / "model.safetensors.index.json")
    ),
    "index names ../ outside": lambda lab: lab.export_argv(_outside(lab, relative=True)),
    "index names an absolute path": lambda lab: lab.export_argv(_outside(lab, relative=False)),
    "index names /etc/passwd": lambda lab: lab.export_argv(
        lab.index(lambda names: dict.fromkeys(names, "/etc/passwd"))
    ),
    "index names a FIFO": lambda lab: lab.export_argv(
        lab.index(lambda names: dict.fromkeys(names, lab.fifo("ck-dense/pipe.safetensors").name))
    ),
    "index names a directory": lambda lab: lab.export_argv(_index_to_dir(lab)),
    "safetensors a symlink out of the checkpoint": lambda lab: lab.export_argv(_symlink_out(lab)),
    # the token file and token ids (items 5, 9)
    "tokens not UTF-8": lambda lab: _arms(lab, "--tokens", str(lab.tokens(b"1 2 \xff\xfe"))),
    "tokens fractional": lambda lab: _arms(lab, "--tokens", str(lab.tokens(b"[1.5, 2]"))),
    "token id 10**30": lambda lab: _arms(lab, "--tokens", str(lab.tokens(b"[1, 1000000000000000000000000000000]"))),
    "token id past the vocabulary": lambda lab: _arms(lab, "--tokens", str(lab.tokens(b"[1, 512]"))),
    "token id negative": lambda lab: _arms(lab, "--tokens", str(lab.tokens(b"[1, -3]"))),
    "tokens nested 100,000 deep": lambda lab: _arms(lab, "--tokens", str(lab.tokens(b"[" * 100_000 + b"]" * 100_000))),
    "tokens a FIFO": lambda lab: _arms(lab, "--tokens", str(lab.fifo("tokens.fifo"))),
    # flags: sizes before work (item 3, 5, 9)
    "export --tile 0": lambda lab: lab.export_argv(lab.checkpoint(), "--graph", "tiled", "--tile", "0"),
    "export --chunk 100000000": lambda lab: [
        *lab.export_argv(lab.checkpoint())[:2],
        "--chunk",
        "100000000",
        "--histories",
        "0",
        "--out",
        str(lab.out),
    ],  # fmt: skip
    "export 100,000 histories": lambda lab: [
        *lab.export_argv(lab.checkpoint())[:2],
        "--chunk",
        "1",
        "--histories",
        ",".join(map(str, range(100_000))),
        "--out",
        str(lab.out),
    ],  # fmt: skip
    "export --layers 0,0": lambda lab: lab.export_argv(lab.checkpoint(), "--layers", "0,0"),
    "plan --prompt-tokens 10**12": lambda lab: [
        "plan",
        "--family",
        "qwen3.8-125b-a6b-4bit",
        "--prompt-tokens",
        str(10**12),
    ],
    "plan --chunk 1 --prompt-tokens 10**6": lambda lab: [
        "plan",
        "--family",
        "qwen3.8-125b-a6b-4bit",
        "--chunk",
        "1",
        "--prompt-tokens",
        str(10**6),
    ],  # fmt: skip
    "plan --gpu-tokens-per-second inf": lambda lab: [
        "plan",
        "--family",
        "qwen3.8-125b-a6b-4bit",
        "--prompt-tokens",
        "4333",
        "--gpu-tokens-per-second",
        "inf",
    ],  # fmt: skip
    "plan --gpu-prefill-seconds nan": lambda lab: [
        "plan",
        "--family",
        "qwen3.8-125b-a6b-4bit",
        "--prompt-tokens",
        "4333",
        "--gpu-prefill-seconds",
        "nan",
    ],  # fmt: skip
    "compare-arms --prompt-tokens 10**12": lambda lab: _arms(lab, "--prompt-tokens", str(10**12)),
    "compare-arms --decode 10**9": lambda lab: _arms(lab, "--prompt-tokens", "4", decode=str(10**9)),
    "compare-arms default-dense, new sidecars for 10**7 tokens": lambda lab: [
        "compare-arms",
        "default-dense",
        "--sidecars",
        str(lab.out),
        "--prompt-tokens",
        str(10**7),
    ],  # fmt: skip
    # --out (item 5)
    "export --out a file": lambda lab: _out_at(lab, _a_file(lab.root / "out-file")),
    "export --out under a file": lambda lab: _out_at(lab, _a_file(lab.root / "out-file") / "sub"),
    "export --out /dev/null": lambda lab: _out_at(lab, Path("/dev/null")),
    # packages (item 5, 9)
    "package weight.bin truncated": lambda lab: [
        "verify",
        str(_weight_file(lab, lambda p: _truncate(p, 1000))),
        "--checkpoint",
        str(lab.checkpoint()),
    ],  # fmt: skip
    "package weight.bin empty": lambda lab: ["inspect", str(_weight_file(lab, lambda p: _truncate(p, 0)))],
    "package weight.bin missing": lambda lab: ["inspect", str(_weight_file(lab, lambda p: p.unlink()))],
    "package model.mlmodel byte flipped": lambda lab: ["inspect", str(_flip_spec_byte(lab))],
    "package metadata anelab.chunk=-16": lambda lab: [
        "verify",
        str(_metadata("anelab.chunk", "-16")(lab)),
        "--checkpoint",
        str(lab.checkpoint()),
    ],  # fmt: skip
    "package metadata sourceTensors a list": lambda lab: [
        "verify",
        str(_metadata("anelab.sourceTensors", "[1, 2]")(lab)),
        "--checkpoint",
        str(lab.checkpoint()),
    ],  # fmt: skip
    "package metadata format 99": lambda lab: [
        "verify",
        str(_metadata("anelab.format", "99")(lab)),
        "--checkpoint",
        str(lab.checkpoint()),
    ],  # fmt: skip
    "package metadata histories not numbers": lambda lab: [
        "verify",
        str(_metadata("anelab.histories", "a,b")(lab)),
        "--checkpoint",
        str(lab.checkpoint()),
    ],  # fmt: skip
    "package metadata geometry a list": lambda lab: [
        "verify",
        str(_metadata("anelab.geometry", "[1]")(lab)),
        "--checkpoint",
        str(lab.checkpoint()),
    ],  # fmt: skip
    "package Manifest.json not JSON": lambda lab: ["inspect", str(_manifest(lab, b"{not json"))],
    "package Manifest.json names a path outside": lambda lab: ["inspect", str(_manifest_outside(lab))],
    # records (item 5)
    "records compare: a record's rows a string": lambda lab: [
        "records",
        "compare",
        "--dir",
        str(_records(lab, "seed-qsa-fold-correctness.json", _rows_as_text)),
    ],  # fmt: skip
    "records compare: a record's number a string": lambda lab: [
        "records",
        "compare",
        "--dir",
        str(_records(lab, "seed-qsa-fold-correctness.json", _percent_as_text)),
    ],  # fmt: skip
    # refused before anything is written (item 9)
    "plan --design stateful-tiled --tile 0": lambda lab: [
        "plan",
        "--prompt-tokens",
        "4333",
        "--design",
        "stateful-tiled",
        "--tile",
        "0",
    ],  # fmt: skip
    "decide --gpu-tokens-per-second inf": lambda lab: [
        "decide",
        str(lab.checkpoint()),
        "--prompt-tokens",
        "64",
        "--gpu-tokens-per-second",
        "inf",
        "--out",
        str(lab.out),
    ],  # fmt: skip
    "decide --prompt-tokens 10**12": lambda lab: [
        "decide",
        str(lab.checkpoint()),
        "--prompt-tokens",
        str(10**12),
        "--out",
        str(lab.out),
    ],  # fmt: skip
    "run a notebook without quick": lambda lab: ["run", str(_notebook_without_quick(lab)), "--out", str(lab.out)],
}


# what each row's one line must say (the refusal names the cause, not merely some error)
EXPECT = {
    "config not UTF-8": "not UTF-8",
    "config rope_theta a word": "rope_theta must be a finite positive number",
    "config rope_theta Infinity": "rope_theta must be a finite positive number",
    "config partial_rotary_factor a string": "partial_rotary_factor must be a finite positive number",
    "config partial_rotary_factor a word": "partial_rotary_factor must be a finite positive number",
    "config hidden_size NaN": "'hidden_size' must be an integer",
    "config num_hidden_layers 1e400": "'num_hidden_layers' must be an integer",
    "config num_hidden_layers 1e9": "the limit is 4,096",
    "config num_hidden_layers 1e7 (hybrid)": "the limit is 4,096",
    "config nested 100,000 deep": "too deeply",
    "config head_dim 0": "head_dim must be a positive integer",
    "config rope_scaling a list": "rope_scaling must be a JSON object or null",
    "config model_type a list": "model_type must be a string",
    "config layer_types of lists": "layer_types must list one layer-type name",
    "config num_attention_heads true": "'num_attention_heads' must be an integer",
    "config rms_norm_eps a word": "'rms_norm_eps' must be a finite positive number",
    "config max_position_embeddings a word": "'max_position_embeddings' must be an integer",
    "config vocab_size NaN (whole model)": "'vocab_size'",
    "config a directory": "a directory, not a regular file",
    "config a FIFO": "a FIFO, not a regular file",
    "header offsets fractional": "data_offsets that are not two non-negative integers",
    "header k_proj overlaps q_proj": "leave a gap or overlap another tensor",
    "header offsets as strings": "data_offsets that are not two non-negative integers",
    "header length past the file": "not a valid safetensors file",
    "header length 2**63": "no header length that fits the file",
    "header not UTF-8": "header is not UTF-8",
    "header a JSON list": "header is not a JSON object",
    "header dtype I8 in layer 2": "layers.2.self_attn.k_proj.weight",
    "header negative shape": "shape that is not a list of non-negative integers",
    "header shape of floats": "shape that is not a list of non-negative integers",
    "header bytes do not match the shape": "not BF16 x [32, 128]",
    "header trailing bytes after the data": "truncated, or bytes appended",
    "header truncated data": "truncated, or bytes appended",
    "header metadata not strings": "__metadata__ is not a JSON object of strings",
    "header empty file": "shorter than its 8-byte header length",
    "header 7 bytes": "shorter than its 8-byte header length",
    "weights NaN in layer 2": "model.layers.2.self_attn.k_proj.weight holds 1 NaN or infinite",
    "weights Inf in layer 2": "model.layers.2.self_attn.k_proj.weight holds 1 NaN or infinite",
    "safetensors a directory": "a directory, not a regular file",
    "index not UTF-8": "not UTF-8",
    "index weight_map a list": "no 'weight_map' object",
    "index weight_map of ints": "does not name a file",
    "index weight_map of nulls": "does not name a file",
    "index nested 100,000 deep": "too deeply",
    "index a directory": "a directory, not a regular file",
    "index names ../ outside": "outside the checkpoint directory",
    "index names an absolute path": "outside the checkpoint directory",
    "index names /etc/passwd": "outside the checkpoint directory",
    "index names a FIFO": "a FIFO, not a regular file",
    "index names a directory": "a directory, not a regular file",
    "safetensors a symlink out of the checkpoint": "a checkpoint's files stay inside it",
    "tokens not UTF-8": "not UTF-8",
    "tokens fractional": "token ids must be whole numbers",
    "token id 10**30": "is not a token id",
    "token id past the vocabulary": "0..511",
    "token id negative": "is not a token id",
    "tokens nested 100,000 deep": "too deeply",
    "tokens a FIFO": "a FIFO, not a regular file",
    "export --tile 0": "--tile must be a positive integer",
    "export --chunk 100000000": "--chunk is 100,000,000; the limit is 2,097,152",
    "export 100,000 histories": "is 100,000; the limit is 1,024",
    "export --layers 0,0": "names layer 0 twice",
    "plan --prompt-tokens 10**12": "--prompt-tokens is 1,000,000,000,000; the limit is 2,097,152",
    "plan --chunk 1 --prompt-tokens 10**6": "the chunk count is 1,000,000; the limit is 65,536",
    "plan --gpu-tokens-per-second inf": "finite number of tokens per second",
    "plan --gpu-prefill-seconds nan": "finite number of seconds",
    "compare-arms --prompt-tokens 10**12": "--prompt-tokens is 1,000,000,000,000",
    "compare-arms --decode 10**9": "--decode is 1,000,000,000; the limit is 4,096",
    "compare-arms default-dense, new sidecars for 10**7 tokens": "is 625,000; the limit is 1,024",
    "export --out a file": "is a regular file, not a directory",
    "export --out under a file": "which is a regular file, not a directory",
    "export --out /dev/null": "is a character device, not a directory",
    "package weight.bin truncated": "program or weights cannot be read",
    "package weight.bin empty": "program or weights cannot be read",
    "package weight.bin missing": "program or weights cannot be read",
    # which refusal depends on the byte the flip hits (the spec's framing, or a field the program reader then meets)
    "package model.mlmodel byte flipped": ("model spec does not parse", "program or weights cannot be read"),
    "package metadata anelab.chunk=-16": "'anelab.chunk' is -16",
    "package metadata sourceTensors a list": "source_tensors is not a JSON object",
    "package metadata format 99": "sidecar format 99",
    "package metadata histories not numbers": "'anelab.histories' is malformed",
    "package metadata geometry a list": "geometry is not a JSON object",
    "package Manifest.json not JSON": "not valid package Manifest.json JSON",
    "package Manifest.json names a path outside": "outside",
    "records compare: a record's rows a string": "do not hold 'fold error: graph vs reference' as a number",
    "records compare: a record's number a string": "do not hold 'fold error: graph vs reference' as a number",
    "plan --design stateful-tiled --tile 0": "--tile must be a positive integer",
    "decide --gpu-tokens-per-second inf": "finite number of tokens per second",
    "decide --prompt-tokens 10**12": "--prompt-tokens is 1,000,000,000,000",
    "run a notebook without quick": "must declare 'quick",
}


def _replace_with_dir(path: Path) -> Path:
    path.unlink()
    path.mkdir()
    return path.parent


def _replace_with_fifo(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path.parent


def _truncate(path: Path, size: int) -> Path:
    with open(path, "r+b") as f:
        f.truncate(size)
    return path.parent


def _fractional_offsets(header):
    entry = header[_tensor(header, "k_proj.weight")]
    entry["data_offsets"] = [entry["data_offsets"][0] + 0.5, entry["data_offsets"][1] + 0.5]


def _string_offsets(header):
    entry = header[_tensor(header, "k_proj.weight")]
    entry["data_offsets"] = [str(x) for x in entry["data_offsets"]]


def _header_length(lab: Lab, n: int) -> Path:
    path = lab.checkpoint() / "model.safetensors"
    blob = path.read_bytes()
    path.write_bytes(struct.pack("<Q", n) + blob[8:])
    return path.parent


def _outside(lab: Lab, *, relative: bool) -> Path:
    """An index whose entries name a copy of the weights beside (not inside) the checkpoint directory."""
    other = lab.root / "other"
    other.mkdir()
    shutil.copy(lab.sources.dense / "model.safetensors", other / "x.safetensors")
    target = "../other/x.safetensors" if relative else str(other / "x.safetensors")
    ck = lab.index(lambda names: dict.fromkeys(names, target))
    (ck / "model.safetensors").unlink()
    return ck


def _index_to_dir(lab: Lab) -> Path:
    ck = lab.index(lambda names: dict.fromkeys(names, "shards"))
    (ck / "shards").mkdir()
    return ck


def _symlink_out(lab: Lab) -> Path:
    other = lab.root / "other"
    other.mkdir()
    ck = lab.checkpoint()
    shutil.move(ck / "model.safetensors", other / "model.safetensors")
    (ck / "model.safetensors").symlink_to(other / "model.safetensors")
    return ck


def _arms(lab: Lab, *argv: str, decode: str = "1") -> list[str]:
    return ["compare-arms", str(lab.checkpoint()), *argv, "--decode", decode]


def _a_file(path: Path) -> Path:
    path.write_text("a file, not a directory\n")
    return path


def _out_at(lab: Lab, out: Path) -> list[str]:
    argv = lab.export_argv(lab.checkpoint())
    argv[argv.index("--out") + 1] = str(out)
    return argv


def _manifest(lab: Lab, text: bytes) -> Path:
    pkg = lab.package()
    (pkg / "Manifest.json").write_bytes(text)
    return pkg


def _manifest_outside(lab: Lab) -> Path:
    pkg = lab.package()
    manifest = json.loads((pkg / "Manifest.json").read_text())
    for entry in manifest["itemInfoEntries"].values():
        entry["path"] = "../../../../../../../../etc/passwd" if entry["name"] == "model.mlmodel" else entry["path"]
    (pkg / "Manifest.json").write_text(json.dumps(manifest))
    return pkg


# ---- running one row -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    code: int | None  # None: the command raised (a traceback) or hung
    stderr: str
    traceback: str | None  # the exception that escaped main, if any
    written: list[str]  # paths created, changed or removed under the row's directory
    hung: bool = False

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    def problems(self) -> list[str]:
        """What breaks the promise (empty: one line, exit 2, nothing written)."""
        found = []
        if self.hung:
            found.append(f"hung for more than {CASE_TIMEOUT_S} s")
        if self.traceback is not None:
            found.append(f"traceback: {self.traceback}")
        elif self.code != 2:
            found.append(f"exit {self.code}, not 2")
        if len(self.lines) != 1 or not self.lines[0].startswith("anelab: error: "):
            found.append(f"stderr is not one 'anelab: error:' line: {self.stderr[-300:]!r}")
        elif len(self.lines[0]) > MAX_ERROR_CHARS:
            found.append(f"the error line is {len(self.lines[0]):,} characters long")
        if "root:" in self.stderr:
            found.append("the error echoes a file's bytes")
        if self.written:
            found.append(f"wrote {self.written[:4]}")
        return found


def _tree(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            out[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


class _Hang(Exception):
    pass


def run_case(name: str, root: Path, sources: Sources, cases: dict | None = None) -> Outcome:
    """Build row ``name``'s input (of ``cases``, default ``CASES``) under ``root`` and run its command in this
    process (bars off, $TMPDIR and the cwd inside ``root``), watching for an escaping exception, a hang and
    anything written."""
    import traceback

    from anelab.cli import main

    lab = Lab(root, sources)
    argv = (CASES if cases is None else cases)[name](lab)
    (root / "tmpdir").mkdir()
    before = _tree(root)
    err = io.StringIO()
    saved_tmp, saved_env, cwd = tempfile.tempdir, os.environ.get("ANELAB_HEADLESS"), os.getcwd()
    tempfile.tempdir, os.environ["ANELAB_HEADLESS"] = str(root / "tmpdir"), "1"

    def hang(*_):
        raise _Hang()

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(CASE_TIMEOUT_S)
    code, escaped, hung = None, None, False
    try:
        os.chdir(root)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    except _Hang:
        hung = True
    except BaseException as e:  # noqa: BLE001 — a traceback is what this table counts
        escaped = "".join(traceback.format_exception_only(type(e), e)).strip()[:300]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(cwd)
        tempfile.tempdir = saved_tmp
        if saved_env is None:
            os.environ.pop("ANELAB_HEADLESS", None)
        else:
            os.environ["ANELAB_HEADLESS"] = saved_env
    after = _tree(root)
    written = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return Outcome(code, err.getvalue(), escaped, written, hung)


# ---- pytest ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Sources:
    return make_sources(tmp_path_factory.mktemp("hostile-sources"))


@pytest.mark.parametrize("name", list(CASES))
def test_one_line_exit_2_nothing_written(name, sources, tmp_path):
    outcome = run_case(name, tmp_path, sources)
    assert not outcome.problems(), (name, outcome.problems())
    assert _says(EXPECT[name], outcome.lines[0]), (name, outcome.lines[0])


def test_every_row_says_what_its_line_must_name():
    assert set(EXPECT) == set(CASES)


def _says(expect: str | tuple[str, ...], line: str) -> bool:
    """Whether ``line`` holds the expected phrase (or one of the expected alternatives)."""
    return any(phrase in line for phrase in ((expect,) if isinstance(expect, str) else expect))


# ---- outside pytest: count the outcomes (e.g. against main before the fixes) -----------------------------

COUNT_ADDRESS_SPACE = 6 * 2**30  # each row of the count runs under this address-space limit, as the probe did


def _one(name: str, sources_root: str) -> int:
    """Run one row (in a child of ``_count``) and print its outcome as JSON."""
    sources = Sources(*(Path(sources_root) / n for n in ("dense", "hybrid", "export")))
    root = Path(tempfile.mkdtemp(dir=sources_root, prefix="row-"))
    o = run_case(name, root, sources)
    problems = o.problems() or ([] if _says(EXPECT[name], o.lines[0]) else [f"the line does not say {EXPECT[name]!r}"])
    print(json.dumps({"code": o.code, "traceback": o.traceback, "hung": o.hung, "problems": problems}))
    return 0


def _count(names: list[str], against: str | None) -> int:
    import resource
    import subprocess

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (COUNT_ADDRESS_SPACE, COUNT_ADDRESS_SPACE))

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    tally: dict[str, list[str]] = {"kept the promise": [], "traceback": [], "hang": [], "killed": [], "other": []}
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as scratch:
        make_sources(Path(scratch))
        for i, name in enumerate(names):
            argv = [sys.executable, __file__, "--one", name, scratch, *(["--against", against] if against else [])]
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=CASE_TIMEOUT_S + 60,
                                      preexec_fn=limit, env=env)  # fmt: skip
                last = done.stdout.strip().splitlines()[-1:] or ["{}"]
                o = json.loads(last[0]) if done.returncode == 0 else {"killed": done.returncode}
            except subprocess.TimeoutExpired:
                o = {"hung": True}
            except json.JSONDecodeError:
                o = {"killed": "no outcome"}
            kind = ("hang" if o.get("hung") else "killed" if "killed" in o else "traceback" if o.get("traceback")
                    else "other" if o.get("problems") else "kept the promise")  # fmt: skip
            tally[kind].append(name)
            detail = o.get("problems") or ([f"exit {o['killed']}"] if "killed" in o else [])
            print(f"{i + 1:>3} {kind:<16} {name}: {'; '.join(detail)[:220]}", flush=True)
    for kind, rows in tally.items():
        print(f"{kind}: {len(rows)}")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--against" in args:
        sys.path.insert(0, args[args.index("--against") + 1])
    if args and args[0] == "--one":
        raise SystemExit(_one(args[1], args[2]))
    rows = [a for a in args if a in CASES] or list(CASES)  # row names given: only those
    raise SystemExit(_count(rows, args[args.index("--against") + 1] if "--against" in args else None))
