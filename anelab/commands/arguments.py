"""The flags several commands share (checkpoint, chip, GPU runtime, protocol, the user's GPU) and JSON output.

Imports nothing beyond the standard library and ``anelab.core.errors``: every command module imports it.
"""

from __future__ import annotations

import argparse
import json

from anelab.core.errors import AnelabInputError

CHECKPOINT_HELP = (
    "checkpoint: a Hugging Face directory (config.json + safetensors), a .gguf file, an mlx_lm.convert -q "
    "directory, or a name: default-dense (the embedded dense sibling) | default-real (SmolLM2-135M-Instruct) | "
    "default-real-windowed (Gemma 3 270M)"
)


def int_list(text: str) -> list[int]:
    """A comma-separated list of integers (``0,64,128``); empty items are skipped."""
    try:
        return [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def float_list(text: str) -> list[float]:
    """A comma-separated list of seconds (``0.5,0.7``)."""
    try:
        return [float(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise AnelabInputError(f"expected comma-separated seconds, got {text!r}") from None


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def add_chip(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chip",
        default=None,
        help="an Apple chip (m1 .. m5, m3-max, m4-pro, m5-max, ...): both arms are priced on it from its sourced "
        "figures (planner.chips) and the fastest each arm could run is printed beside the estimate (default: "
        "this Mac's chip; off a Mac the seed's M3, said so)",
    )
    # values checked by anelab.planner.energy.require_objective
    p.add_argument("--objective", default="time", help="time | energy: what the verdict optimises (default "
                   "time); both seconds and joules are reported either way")  # fmt: skip


def add_gpu_runtime(p: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--gpu-runtime`` (values checked by ``anelab.planner.gpu_runtimes.require_gpu_runtime``; ``default``
    None: the GPU-runtime table's default for a family or a checkpoint)."""
    p.add_argument(
        "--gpu-runtime",
        default=default,
        help="whose GPU prefill the GPU arm is: mlx-lm (batched prefill, fitted to public mlx-lm records on the "
        "chip's peak; default for a checkpoint) | tinytitan (the seed's recorded GPU path on an M3; default for "
        "a --family)",
    )


def add_protocol(p: argparse.ArgumentParser) -> None:
    """``--protocol`` and ``--reload-policy`` (values checked by ``anelab.planner.loads``)."""
    p.add_argument(
        "--protocol",
        default="machine",
        help="machine | process | prompt: when a function's ANE specialization is paid — once per machine "
        "(default: cached by the OS, as TinyTitan's record says), per process, or per prompt; reloads are paid "
        "per prompt either way",
    )
    p.add_argument(
        "--reload-policy",
        default="serialized",
        help="serialized | preloaded: reloads wait for compute (as measured) or load on a background thread "
        "while the GPU runs",
    )


def add_user_gpu(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-prefill-seconds", type=float, help="your GPU runtime's prefill of this prompt (seconds)")
    p.add_argument("--gpu-tokens-per-second", type=float, help="your GPU runtime's prefill speed (tokens/s)")
