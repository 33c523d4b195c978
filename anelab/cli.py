"""anelab command line. Bad input: one line on stderr, exit code 2, no traceback.

Each subcommand has a ``_add_<name>(sub)`` parser builder and a ``_run_<name>(args)`` runner;
runners import their module lazily, and this module imports nothing at its top beyond the standard
library and ``anelab.core.errors``, so a command pays only for what it uses (``anelab evaluate``: NumPy
and the saved-program evaluator; tests/test_cli_imports.py holds the line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from anelab.core.errors import AnelabInputError

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default also prints usage); main adds "anelab: error:"
        command = self.prog.removeprefix("anelab").strip()
        raise AnelabInputError(f"{command + ': ' if command else ''}{message} (see {self.prog} --help)")

    def _check_value(self, action, value):  # an unknown choice (a mistyped command): the closest one, by name
        if action.choices is not None and value not in action.choices:
            import difflib

            close = difflib.get_close_matches(value, [str(c) for c in action.choices], n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(map(str, action.choices))}"
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}; {hint}")
        super()._check_value(action, value)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


CHECKPOINT_HELP = (
    "checkpoint: a Hugging Face directory (config.json + safetensors), a .gguf file, an mlx_lm.convert -q "
    "directory, or a name: default-dense (the embedded dense sibling) | default-real (SmolLM2-135M-Instruct)"
)


def _checkpoint(value):
    """A checkpoint argument as a path: a name (default-dense, default-real) resolved, made or fetched first."""
    from anelab.checkpoints.default import resolve_checkpoint

    return None if value is None else resolve_checkpoint(value)


# ---- commands ----------------------------------------------------------------------------------
# (each section: _add_X registers the parser, _run_X executes; keep sections independent)

COMMANDS: list = []  # (name, add_fn, run_fn), filled below


def _register(name, add_fn, run_fn):
    COMMANDS.append((name, add_fn, run_fn))


# >>> section: core (export / inspect / evaluate / verify / reproduce)
def _add_export(sub):
    p = sub.add_parser(
        "export", help="export attention layers (full or sliding window) as multifunction Core ML sidecars"
    )
    p.add_argument("checkpoint", nargs="?", help=CHECKPOINT_HELP)
    p.add_argument(
        "--list-families",
        action="store_true",
        help="print the supported model families, RoPE types and what is refused",
    )
    p.add_argument(
        "--list-formats", action="store_true", help="print the checkpoint formats read (and named checkpoints)"
    )
    p.add_argument("--chunk", type=int, help="chunk width C (rows per call)")
    p.add_argument(
        "--jobs", type=int, default=None, help="layers exported at once off-Mac (default: up to 2, one per core)"
    )
    p.add_argument(
        "--histories",
        type=_int_list,
        default=None,
        help="comma-separated histories, multiples of C (e.g. 0,C,2C); required unless --graph stateful --capacity N",
    )
    p.add_argument(
        "--layers", type=_int_list, default=None, help="attention layers to export, full or windowed (default: all)"
    )
    p.add_argument(
        "--graph",
        default=None,
        help="sidecar design (anelab.sidecar.designs; default dense): dense | tiled (online softmax over key tiles) | "
        "stateful (K/V as Core ML state) | stateful-tiled (K/V in state, key and query tiles)",
    )
    p.add_argument("--query-tile", type=int, default=None, help="stateful-tiled graph: chunk rows per query tile")
    p.add_argument(
        "--mask-mode",
        default=None,
        help="stateful-tiled graph (default causal): causal (in-graph, no mask input; a windowed layer's window "
        "too) | additive (full-attention layers: plus a mask input [C, capacity], e.g. a folded selection)",
    )
    p.add_argument(
        "--tile",
        type=int,
        default=None,
        help="tiled graph: key positions per tile, a divisor of the chunk (default: the chunk); "
        "stateful-tiled: cache slots per tile, a divisor of the capacity",
    )
    p.add_argument("--weights", default="fp16", help="projection weights: fp16 | int8 | palettize4 | int4-block")
    p.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="stateful graph: cache slots per state (default: the histories' coverage)",
    )
    p.add_argument(
        "--decode", action="store_true", help="stateful graph: add a decode function c1 sharing the state and weights"
    )
    p.add_argument(
        "--backend",
        default=None,
        help="sidecar format (anelab.sidecar.backends): coreml (default: layer_<L>.mlpackage) | coreai (layer_<L>.aimodel, "
        "Core AI: the Core ML package lowered op by op, Neural Engine rules applied)",
    )
    p.add_argument("--out", help="output directory for layer_<L>.mlpackage (or .aimodel)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument(
        "--selection-kept-blocks",
        type=int,
        default=None,
        help="sparse-indexed model: the indexer's kept blocks per query (records selectionFolded: true)",
    )
    p.add_argument(
        "--selection-compress-ratio", type=int, default=None, help="sparse-indexed model: keys per indexer block"
    )


def _print_families(rows, refused):
    for r in rows:
        print(f"{r['model_type']:<17} {r['architecture']:<34} variant {r['variant']}")
        print(f"  RoPE: {', '.join(r['rope_types'])}; windows: {r['windows']}")
        if r["options"]:
            print(f"  options: {'; '.join(r['options'])}")
        print(f"  whole model (compare-arms): {r['whole_model']}")
    print("refused:")
    for line in refused:
        print(f"  {line}")


def _print_formats(args) -> int:
    from anelab.checkpoints.default import named_checkpoints
    from anelab.checkpoints.formats import supported_formats

    rows, named = supported_formats(), {n.name: n.what for n in named_checkpoints().values()}
    if args.json:
        _print_json({"formats": rows, "named": named})
        return 0
    for row in rows:
        print(f"{row['format']:<12} {row['summary']}")
        print("".join(f"  refuses: {line}\n" for line in row["refuses"]), end="")
    print("named checkpoints:")
    print("".join(f"  {name:<14} {what}\n" for name, what in named.items()), end="")
    return 0


def _sidecar_request(args):
    """The one options object of an export, from its flags (validated against the checkpoint by export)."""
    from anelab.sidecar.designs import SidecarRequest
    from anelab.sidecar.export import selection_from_flags

    return SidecarRequest(
        args.chunk,
        args.histories,
        args.graph,
        key_tile=args.tile,
        query_tile=args.query_tile,
        capacity=args.capacity,
        decode=args.decode,
        mask_mode=args.mask_mode,
        weights=args.weights,
        selection=selection_from_flags(args.selection_kept_blocks, args.selection_compress_ratio),
        backend=args.backend,
    )


def _run_export(args):
    if args.list_formats:
        return _print_formats(args)
    if args.list_families:
        from anelab.checkpoints.config import REFUSED, supported_families
        from anelab.checkpoints.model import whole_model_support

        rows = [{**r, "whole_model": whole_model_support(r["model_type"])} for r in supported_families()]
        _print_json({"families": rows, "refused": list(REFUSED)}) if args.json else _print_families(rows, REFUSED)
        return 0
    missing = [
        flag
        for flag, value in (("CHECKPOINT", args.checkpoint), ("--chunk", args.chunk), ("--out", args.out))
        if value is None
    ]
    if missing:
        raise AnelabInputError(f"export: pass {', '.join(missing)} (or --list-families)")
    from anelab.runtimes.coreml import default_runtime
    from anelab.runtimes.gate import AneGate
    from anelab.sidecar.export import export_request

    gate = AneGate.for_runtime(default_runtime())
    results = export_request(
        _checkpoint(args.checkpoint), args.out, _sidecar_request(args), args.layers, gate=gate, jobs=args.jobs
    )
    summary = [
        {
            "package": str(r.package),
            "layer": r.metadata.layer,
            "functions": r.functions or r.metadata.functions,
            "coverage": r.metadata.coverage,
            "weight_bytes": r.weight_bytes,
            "single_function_weight_bytes": r.metadata.single_function_weight_bytes,
            "aneCompileVerified": r.metadata.ane_verified,
            "reason": r.metadata.ane_reason,
            "selectionFolded": r.metadata.selection_folded,
            "window_note": r.window_note,
        }
        for r in results
    ]
    if args.json:
        _print_json(summary)
    else:
        for s in summary:
            print(
                f"{s['package']}: functions {','.join(s['functions'])}; coverage {s['coverage']}; "
                f"weights {s['weight_bytes']:,} B ({s['weight_bytes'] / max(1, s['single_function_weight_bytes']):.3f}x one function)"
            )
            if s["window_note"]:
                print(f"  {s['window_note']}")
        if results and not results[0].metadata.ane_verified:
            print(f"aneCompileVerified: false — {results[0].metadata.ane_reason}")
    return 0


def _add_inspect(sub):
    p = sub.add_parser("inspect", help="functions, shapes, op counts, weight bytes and metadata of a saved package")
    p.add_argument("package")
    p.add_argument("--json", action="store_true")


def _run_inspect(args):
    from anelab.sidecar.backends import backend_of

    backend = backend_of(args.package)
    info = backend.inspect(args.package)
    if args.json:
        _print_json(info)
    else:
        print(backend.format_inspection(info))
    return 0


def _add_evaluate(sub):
    p = sub.add_parser("evaluate", help="run one function of a saved package with NumPy (any OS)")
    p.add_argument("package")
    p.add_argument("--function", required=True, help="function name, h<history>")
    p.add_argument("--inputs", required=True, help=".npz with arrays named like the function's inputs")
    p.add_argument("--out", required=True, help=".npz to write the outputs to")
    p.add_argument("--fp32", action="store_true", help="evaluate in fp32 (no fp16 storage emulation)")


def _run_evaluate(args):
    import io

    import numpy as np

    from anelab.core.records import atomic_write_bytes
    from anelab.sidecar.evaluate import SavedPackage, evaluate

    pkg = SavedPackage(args.package)
    pkg.function(args.function)
    try:
        with np.load(args.inputs, allow_pickle=False) as npz:
            inputs = {k: npz[k] for k in npz.files}
    except FileNotFoundError:
        raise AnelabInputError(f"{args.inputs}: no such file; give an .npz of the function's inputs") from None
    except (ValueError, OSError) as e:
        raise AnelabInputError(
            f"{args.inputs}: not a readable .npz ({type(e).__name__}); write it with numpy.savez"
        ) from None
    outputs = evaluate(pkg, args.function, inputs, fp16=not args.fp32)
    del inputs
    buf = io.BytesIO()
    np.savez(buf, **outputs)
    with buf.getbuffer() as data:  # the archive's bytes, written without another copy
        atomic_write_bytes(args.out, data)
    print(f"{args.out}: " + ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in outputs.items()))
    return 0


def _add_verify(sub):
    p = sub.add_parser(
        "verify", help="check a saved package (or every package of an export directory) against the NumPy reference"
    )
    p.add_argument(
        "package",
        help="a layer_<L>.mlpackage or .aimodel, or an export directory: every package, one summary table",
    )
    p.add_argument("--checkpoint", default=None, help=CHECKPOINT_HELP + " (default: the one the package records)")
    p.add_argument("--fp32", action="store_true", help="evaluate the package in fp32 instead of emulating fp16 storage")
    p.add_argument(
        "--jobs", type=int, default=None, help="packages of an export directory verified at once (default: up to 2)"
    )
    p.add_argument(
        "--layers",
        type=_int_list,
        default=None,
        help="an export directory made with export --layers: the layers it must hold (default: every attention layer)",
    )
    p.add_argument(
        "--compute-units",
        default=None,
        help="on a Mac: run every case through Core ML predict (cpu_and_ne | cpu_and_gpu | cpu_only) beside NumPy",
    )
    p.add_argument(
        "--real-text",
        type=int,
        default=None,
        metavar="N",
        help="feed the cases each layer's real attention inputs, the first N tokens of README.md through the whole "
        "model (a checkpoint with a tokenizer, e.g. default-real; dense and tiled packages; N >= the longest "
        "history + the chunk), instead of random rows",
    )
    p.add_argument("--json", action="store_true")


def _is_export_directory(path: Path) -> bool:
    """A directory of layer packages (not a package: an .mlpackage holds a Manifest.json, an .aimodel is a sidecar)."""
    from anelab.sidecar.backends import is_sidecar

    return path.is_dir() and not (path / "Manifest.json").exists() and not is_sidecar(path)


def _real_text_verify(path: Path, args):
    """``verify --real-text N``: one package's verification fed its layer's real attention inputs (one package at a
    time, in this process; the inputs computed once, from the checkpoint given or the one the packages record)."""
    from anelab.arms.real_text import docs_activations
    from anelab.sidecar.backends import read_metadata
    from anelab.sidecar.verify import verify_package
    from anelab.sidecar.verify_export import export_packages

    if args.compute_units is not None:
        raise AnelabInputError("--real-text feeds the NumPy evaluation; drop --compute-units")
    if args.jobs is not None and args.jobs > 1:
        raise AnelabInputError("--real-text verifies one package at a time (the inputs are computed here); drop --jobs")
    if args.real_text < 1:
        raise AnelabInputError(f"--real-text must be at least 1 token, got {args.real_text}")
    first = export_packages(path)[0][1] if _is_export_directory(path) else path
    source = _checkpoint(args.checkpoint) if args.checkpoint is not None else read_metadata(first).source
    inputs, said = docs_activations(source, args.real_text)

    def verify_one(package, checkpoint):
        report = verify_package(
            package, checkpoint, fp16=not args.fp32, activations=inputs[read_metadata(package).layer]
        )
        report.inputs = said
        return report

    return verify_one


def _run_verify(args):
    from anelab.sidecar.verify import verify_package

    if args.real_text is not None:
        verify_one = _real_text_verify(Path(args.package), args)
    elif args.compute_units is not None:
        from anelab.runtimes.device_verify import verify_on_device

        def verify_one(package, checkpoint):
            return verify_on_device(package, checkpoint, compute_units=args.compute_units)
    else:

        def verify_one(package, checkpoint):
            return verify_package(package, checkpoint, fp16=not args.fp32)

    path = Path(args.package)
    if _is_export_directory(path):
        from anelab.sidecar.verify_export import verify_export

        # on the device or on real text: one package at a time here; None: NumPy in worker processes
        one_by_one = verify_one if args.compute_units is not None or args.real_text is not None else None
        checkpoint = _checkpoint(args.checkpoint)
        report = verify_export(
            path, checkpoint, fp16=not args.fp32, verify_one=one_by_one, jobs=args.jobs, layers=args.layers
        )
    else:
        if args.layers is not None:
            raise AnelabInputError("--layers applies to an export directory; drop it to verify one package")
        report = verify_one(path, _checkpoint(args.checkpoint))
    if args.json:
        _print_json(report.to_dict())
    else:
        print(report.table())
    return 0 if report.passed else 1


def _add_reproduce(sub):
    p = sub.add_parser(
        "reproduce", help="the main job: export + verify the default sidecar, run the study notebooks, write figures"
    )
    p.add_argument("--quick", action="store_true", help="small parameters (what the tests run)")
    p.add_argument("--build", default="build", help="build directory (default: build)")


def _run_reproduce(args):
    from anelab.publish.reproduce import reproduce

    return reproduce(quick=args.quick, build=args.build)


_register("export", _add_export, _run_export)
_register("inspect", _add_inspect, _run_inspect)
_register("evaluate", _add_evaluate, _run_evaluate)
_register("verify", _add_verify, _run_verify)
_register("reproduce", _add_reproduce, _run_reproduce)
# <<< section: core


# >>> section: runtime (doctor)
def _add_doctor(sub):
    p = sub.add_parser(
        "doctor", help="is the Core ML runtime available here, versions, which studies run fresh vs replay"
    )
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.add_argument(
        "--probe",
        action="store_true",
        help="on a Mac: exercise every Core ML behaviour anelab relies on, on a tiny package, and print each "
        "assumption passed / failed (exit 1 if one failed)",
    )


def _run_doctor(args):
    from anelab.publish.doctor import diagnose, format_report

    if args.probe:
        from anelab.runtimes.coreml import default_runtime
        from anelab.runtimes.probe import format_probe, probe_core_ml

        record = probe_core_ml(default_runtime())  # off-Mac: one line naming what it needs, exit 2
        _print_json(record) if args.json else print(format_probe(record))
        return 1 if record["results"]["failed"] else 0
    report = diagnose()
    if args.json:
        _print_json(report)
    else:
        print(format_report(report))
    return 0


_register("doctor", _add_doctor, _run_doctor)
# <<< section: runtime


# >>> section: plan
def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise AnelabInputError(f"expected comma-separated seconds, got {text!r}") from None


PLAN_EXAMPLES = """examples:
  anelab plan --family qwen3.8-125b-a6b-4bit --prompt-tokens 4333
      the seed's lost case: chunks, variants visited, setup, predicted ratio and the decision
  anelab plan --prompt-tokens 4333 --design all --family qwen3.8-125b-a6b-4bit
      dense (one function per history) vs stateful vs stateful-tiled sidecars for one family
  anelab plan --checkpoint build/checkpoints/anelab-tiny-hybrid --prompt-tokens 2048
      your model's own layers and heads, costs from the closest recorded family
  anelab plan --list-families
      the families, what is recorded and what is unknown
  anelab plan --fit-report
      predicted vs recorded ratio of every recorded A/B row
  anelab plan --backtest
      every recorded row: recorded ratio, in-sample and family-held-out prediction, side
  anelab plan --family qwen3.5-2b-4bit --prompt-tokens 4333 --chip m3 --reload-policy preloaded
      the estimate beside the fastest an M3 could run each arm; reloads hidden behind the GPU
  anelab plan --family qwen3.5-2b-4bit --prompt-tokens 4333 --gpu-runtime mlx-lm --chip m4-max
      the same ANE arm against mlx-lm's prefill on an M4 Max instead of the seed's GPU path
  anelab plan --gpu-runtimes
      the GPU runtimes a plan can price and the public mlx-lm records behind mlx-lm's"""


def _add_plan(sub):
    p = sub.add_parser(
        "plan",
        help="chunks, variants, setup and the ANE-vs-GPU decision for one prompt",
        description="Chunks, variants, setup and the ANE-vs-GPU decision for one prompt, from the recorded "
        "data's fitted costs (every number says where it came from).",
        epilog=PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--family", help="a recorded family (see --list-families); supplies geometry and fitted costs")
    p.add_argument(
        "--checkpoint",
        help="plan a checkpoint's own layers (full and windowed), heads and head_dim; its GPU arm from its own "
        "FLOPs (mlx-lm), the ANE's costs from the closest family",
    )
    p.add_argument("--prompt-tokens", type=int, help="prompt length in tokens")
    p.add_argument("--chunk", type=int, help="prefill chunk = sidecar width (default with a family: 4096)")
    p.add_argument(
        "--histories", type=_int_list, help="sidecar functions on hand, e.g. 0,4096 (default: what the prompt needs)"
    )
    p.add_argument(
        "--max-history", type=int, help="histories 0, chunk, ..., MAX_HISTORY (coverage = MAX_HISTORY + chunk)"
    )
    p.add_argument("--layers", type=int, help="number of layers")
    p.add_argument("--full-attention-layers", type=_int_list, help="indices of the full-attention layers, e.g. 3,7,11")
    p.add_argument("--heads", type=int, help="query heads of a full-attention layer")
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--sparse-budget", type=int, help="keys per query on the GPU's sparse path (omit: dense)")
    p.add_argument("--load-seconds", type=_float_list, help="per-variant load: one value, or one per history")
    p.add_argument("--gpu-attention-seconds", type=float, help="one layer's GPU attention, full chunk at history 0")
    p.add_argument("--ane-attention-seconds", type=float, help="one layer's ANE attention, full chunk at history 0")
    p.add_argument("--non-attention-seconds", type=float, help="the rest of this prompt's prefill")
    _add_user_gpu(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--list-families", action="store_true", help="list the families, what is recorded and unknown")
    p.add_argument("--fit-report", action="store_true", help="predicted vs recorded ratio of every recorded A/B row")
    p.add_argument(
        "--backtest",
        action="store_true",
        help="every recorded A/B row: recorded ratio, in-sample and leave-one-family-out prediction, side",
    )
    _add_protocol(p)
    _add_chip(p)
    _add_gpu_runtime(p)
    p.add_argument(
        "--gpu-runtimes",
        action="store_true",
        help="the GPU runtimes a plan can price and the public mlx-lm records behind mlx-lm's (each held out)",
    )
    p.add_argument(
        "--design",
        type=lambda t: t.split(","),
        help="compare sidecar designs: dense,stateful,stateful-tiled (or 'all'); every family unless --family",
    )
    p.add_argument("--tile", type=int, help="--design stateful-tiled: cache slots per key tile")
    p.add_argument("--query-tile", type=int, help="--design stateful-tiled: chunk rows per query tile")
    p.add_argument(
        "--backend",
        default=None,
        help="with --family: whose loads are priced — coreml (default: the recorded loads) | coreai (Core AI / Core ML "
        "load ratio from 'anelab measure' records on macOS 27, applied to them; prints the per-variant load that flips it)",
    )


def _run_plan(args):
    from anelab import planner

    replays = [f for f, on in (("--backtest", args.backtest), ("--fit-report", args.fit_report),
                                ("--list-families", args.list_families)) if on]  # fmt: skip
    if replays and args.gpu_runtime is not None:
        raise AnelabInputError(f"plan {replays[0]} replays TinyTitan's recorded rows; drop --gpu-runtime")
    if args.backtest:
        from anelab.planner.backtest import backtest, format_backtest

        rows = backtest()
        _print_json(rows) if args.json else print(format_backtest(rows))
        return 0
    if args.gpu_runtimes:
        from anelab.planner.gpu_model import GPU_RUNTIMES
        from anelab.planner.mlx_lm_rates import fit_mlx_lm, format_mlx_lm_fit

        fit = fit_mlx_lm()
        if args.json:
            _print_json({"runtimes": GPU_RUNTIMES, "mlx_lm": fit.to_dict()})
        else:
            print("\n".join(f"{k}: {v}" for k, v in GPU_RUNTIMES.items()) + "\n" + format_mlx_lm_fit(fit))
        return 0
    if args.list_families:
        rows = planner.family_table()
        _print_json(rows) if args.json else print(planner.format_family_table(rows))
        return 0
    if args.fit_report:
        rows, fit, loads = planner.predicted_vs_recorded(), planner.fit_costs().to_dict(), planner.load_fit_report()
        if args.json:
            fit.pop("rows")
            _print_json({"rows": rows, "fit": fit, "loads": loads})
        else:
            print(planner.format_fit_report(rows, fit, loads))
        return 0
    if args.prompt_tokens is None:
        raise AnelabInputError("plan: pass --prompt-tokens N (or --list-families / --fit-report)")
    if args.backend is not None and (args.design or args.checkpoint):
        raise AnelabInputError("plan: --backend prices a --family plan's loads; drop --design / --checkpoint")
    if args.checkpoint is not None and args.design:
        return _run_plan_checkpoint_designs(args)
    if args.checkpoint is not None:
        return _run_plan_checkpoint(args)
    if args.design:
        return _run_plan_family_designs(args, planner)
    prefill_plan = _family_plan(args, planner)
    result = prefill_plan.to_dict()
    text = planner.format_plan(result)
    if args.backend is not None:
        from anelab.planner.load_flip import flip_sentence

        text += f"\nloads priced for --backend {args.backend}; " + flip_sentence(_family_plan(args, planner, None))
    return _print_plan(args, result, text, [prefill_plan])


def _run_plan_family_designs(args, planner) -> int:
    """``plan --design ...`` on the recorded families (every family unless --family)."""
    from anelab.planner.design_plans import DESIGNS, compare_designs

    designs = list(DESIGNS) if args.design == ["all"] else args.design
    families = [args.family] if args.family else list(planner.FAMILIES)
    chunk = args.chunk or planner.REFERENCE_CHUNK
    rows = {
        f: [
            d.to_dict()
            for d in compare_designs(
                args.prompt_tokens,
                f,
                chunk,
                designs,
                key_tile=args.tile,
                query_tile=args.query_tile,
                gpu_runtime=args.gpu_runtime or "tinytitan",
                protocol=args.protocol,
                reload_policy=args.reload_policy,
                chip=args.chip,
            )  # fmt: skip
        ]
        for f in families
    }
    if args.json:
        _print_json(rows)
    else:
        from anelab.planner.chips import get_chip
        from anelab.planner.report import gpu_runtime_phrase

        runtime = {"gpu_runtime": args.gpu_runtime or "tinytitan", "gpu_chip": get_chip(args.chip or "M3").name}
        print(planner.format_designs(rows) + "\nGPU arm: " + gpu_runtime_phrase(runtime))
    return 0


def _family_plan(args, planner, backend="given"):
    """``planner.plan`` of the command line's flags (``backend``: the --backend's loads, or None: Core ML's).
    Without a Core AI record the refusal also says which per-variant load would flip the verdict."""
    from anelab.planner.coreai_loads import MISSING
    from anelab.planner.load_flip import flip_sentence

    backend = args.backend if backend == "given" else backend
    try:
        return _plan_of(args, planner, backend)
    except AnelabInputError as e:
        if backend is None or not str(e).startswith(MISSING):
            raise
        raise AnelabInputError(f"{e}; {flip_sentence(_plan_of(args, planner, None))}") from None


def _plan_of(args, planner, backend):
    return planner.plan(
        args.prompt_tokens,
        backend=backend,
        family=args.family,
        chunk=args.chunk,
        histories=args.histories,
        max_history=args.max_history,
        num_layers=args.layers,
        full_attention_layers=args.full_attention_layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        sparse_budget=args.sparse_budget,
        load_seconds=args.load_seconds,
        gpu_attention_seconds=args.gpu_attention_seconds,
        ane_attention_seconds=args.ane_attention_seconds,
        non_attention_seconds=args.non_attention_seconds,
        gpu_prefill_seconds=args.gpu_prefill_seconds,
        gpu_tokens_per_second=args.gpu_tokens_per_second,
        protocol=args.protocol,
        reload_policy=args.reload_policy,
        gpu_runtime=args.gpu_runtime or "tinytitan",
        chip=args.chip,
    )


def _add_chip(p) -> None:
    p.add_argument(
        "--chip",
        default=None,
        help="an Apple chip (m1 .. m5, m3-max, m4-pro, ...): the fastest each arm could run this prompt on it "
        "(peak compute or bandwidth, public figures), printed beside the estimate; mlx-lm's GPU arm is priced "
        "on it (default: the seed's M3)",
    )


def _add_gpu_runtime(p, default: str | None = None) -> None:
    # values checked by anelab.planner.gpu_model.require_gpu_runtime
    p.add_argument(
        "--gpu-runtime",
        default=default,
        help="whose GPU prefill the GPU arm is: mlx-lm (batched prefill, fitted to public mlx-lm records on the "
        "chip's peak; default for a checkpoint) | tinytitan (the seed's recorded GPU path on an M3; default for "
        "a --family)",
    )


def _add_protocol(p) -> None:
    # values checked by anelab.planner.loads (not imported here: the parser is built for every command)
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


def _run_plan_checkpoint_designs(args) -> int:
    """``plan --checkpoint CK --design ...``: every design per kind of attention layer, with verdicts."""
    from anelab import planner
    from anelab.planner.from_checkpoint import checkpoint_designs

    designs = None if args.design == ["all"] else args.design
    checkpoint_plan, plans = checkpoint_designs(
        _checkpoint(args.checkpoint),
        args.prompt_tokens,
        designs,
        family=args.family,
        chunk=args.chunk,
        key_tile=args.tile,
        query_tile=args.query_tile,
        gpu_prefill_seconds=args.gpu_prefill_seconds,
        gpu_tokens_per_second=args.gpu_tokens_per_second,
        protocol=args.protocol,
        reload_policy=args.reload_policy,
        gpu_runtime=args.gpu_runtime or "mlx-lm",
        chip=args.chip,
    )
    rows = {
        f"{Path(args.checkpoint).name} ({kind})": [d.to_dict() for d in kind_plans]
        for kind, kind_plans in plans.items()
    }
    if args.json:
        _print_json(rows)
    else:
        print(f"costs: {checkpoint_plan.cost_family or 'flags'} — {checkpoint_plan.cost_family_reason}")
        print(planner.format_designs(rows))
        if "full" in plans:
            _print_design_verdicts(checkpoint_plan.parts["full"], plans["full"])
    return 0


def _print_design_verdicts(full, designs: list) -> None:
    """Each design's three-way verdict (the same envelope ``decide`` reports): ``full`` the full-attention
    layers' ``PrefillPlan``, ``designs`` their ``DesignPlan``s."""
    from anelab.planner.report import format_verdict
    from anelab.planner.verdict import plan_arm_costs, verdict_for

    for design in designs:
        print(f"--- three-way verdict ({design.design}) ---")
        print(format_verdict(verdict_for(plan_arm_costs(full, design)).to_dict()))


def _add_user_gpu(p) -> None:
    p.add_argument("--gpu-prefill-seconds", type=float, help="your GPU runtime's prefill of this prompt (seconds)")
    p.add_argument("--gpu-tokens-per-second", type=float, help="your GPU runtime's prefill speed (tokens/s)")


def _print_plan(args, result: dict, text: str, parts: list) -> int:
    """The plan (``result``, as JSON) and, for each part (a ``PrefillPlan``), its three-way verdict with
    thresholds and envelope (``planner.verdict``)."""
    from anelab.planner.report import format_verdict
    from anelab.planner.verdict import plan_arm_costs, verdict_for

    where = f"--checkpoint {args.checkpoint}" if args.checkpoint else f"--family {result.get('family')}"
    commands = {
        "gpu_prefill": (
            f"time your GPU runtime's prefill of a {args.prompt_tokens:,}-token prompt (seconds, S)",
            f"anelab plan {where} --prompt-tokens {args.prompt_tokens} --gpu-prefill-seconds S",
        ),
        "load_per_layer": (
            "time your model's own loads and ANE predictions on a Mac",
            f"anelab decide {args.checkpoint or 'CHECKPOINT'} --prompt-tokens {args.prompt_tokens} --measure",
        ),
    }
    commands["ane_attention"] = commands["load_per_layer"]
    verdicts = [verdict_for(plan_arm_costs(part), commands).to_dict() for part in parts]
    bounds = []
    if getattr(args, "chip", None) is not None:
        from anelab.planner.chips import bound_sentence, plan_bounds

        bounds = [plan_bounds(part.to_dict(), args.chip) for part in parts]
        text += "\n" + "\n".join(bound_sentence(b) for b in bounds)
    if args.json:
        _print_json({**result, "verdicts": verdicts, **({"bounds": bounds} if bounds else {})})
        return 0
    print(text)
    for part, verdict in zip(parts, verdicts):
        kind = f" ({len(part.geometry['full_attention_layers'])} layers)" if len(parts) > 1 else ""
        print(f"--- three-way verdict{kind} ---")
        print(format_verdict(verdict))
    return 0


def _run_plan_checkpoint(args):
    from anelab import planner
    from anelab.planner.from_checkpoint import plan_from_checkpoint

    geometry_flags = ("layers", "full_attention_layers", "heads", "kv_heads", "head_dim", "sparse_budget")
    given = [f"--{f.replace('_', '-')}" for f in geometry_flags if getattr(args, f) is not None]
    if given:
        raise AnelabInputError(f"--checkpoint supplies the geometry; drop {', '.join(given)}")
    checkpoint_plan = plan_from_checkpoint(
        _checkpoint(args.checkpoint),
        args.prompt_tokens,
        family=args.family,
        chunk=args.chunk,
        histories=args.histories,
        max_history=args.max_history,
        load_seconds=args.load_seconds,
        gpu_attention_seconds=args.gpu_attention_seconds,
        ane_attention_seconds=args.ane_attention_seconds,
        non_attention_seconds=args.non_attention_seconds,
        gpu_prefill_seconds=args.gpu_prefill_seconds,
        gpu_tokens_per_second=args.gpu_tokens_per_second,
        protocol=args.protocol,
        reload_policy=args.reload_policy,
        gpu_runtime=args.gpu_runtime or "mlx-lm",
        chip=args.chip,
    )
    result = checkpoint_plan.to_dict()
    return _print_plan(args, result, planner.format_checkpoint_plan(result), list(checkpoint_plan.parts.values()))


_register("plan", _add_plan, _run_plan)
# <<< section: plan


# >>> section: gather (size / probe)
def _add_size(sub):
    p = sub.add_parser("size", help="bytes of a gather graph's gathered keys against the dense score matrix")
    p.add_argument("--heads", type=int, required=True, help="query heads")
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--chunk", type=int, required=True, help="query rows per chunk")
    p.add_argument("--total", type=int, required=True, help="keys per row: history + chunk")
    p.add_argument("--budget", type=int, required=True, help="keys gathered per row")
    p.add_argument("--kv-heads", type=int, default=None, help="gather once per KV head (default: per query head)")
    p.add_argument("--json", action="store_true", help="print the sizing as JSON")


def _run_size(args):
    from anelab.core.geometry import GB
    from anelab.studies.gather_sizing import GatherSizing

    s = GatherSizing(args.heads, args.head_dim, args.chunk, args.total, args.budget, kv_heads=args.kv_heads)
    d = s.to_dict()
    if args.json:
        _print_json(d)
        return 0
    rows = [
        ("dense scores", list(s.dense_score_shape), s.dense_score_bytes),
        ("gathered keys", list(s.gather_key_shape), s.gather_key_bytes),
        ("gathered values", list(s.gather_key_shape), s.gather_value_bytes),
    ]
    print(f"{'tensor':<16} {'shape':<26} {'bytes':>16} {'GB':>10}")
    for name, shape, nbytes in rows:
        print(f"{name:<16} {str(shape):<26} {nbytes:>16,} {nbytes / GB:>10.2f}")
    print(f"gathered keys / dense scores: {s.ratio:.2f}x (GB = 1e9 bytes)")
    print(f"gathered keys are smaller than dense scores only for budget <= {d['crossover_budget']}")
    return 0


_register("size", _add_size, _run_size)


def _add_probe(sub):
    p = sub.add_parser(
        "probe", help="build, save and evaluate the dense-masked and gather attention probes at one chunk"
    )
    p.add_argument("--chunk", type=int, required=True, help="query rows of the probe (e.g. 32, 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed NumPy evaluations per graph (default 3)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    p.add_argument("--history", type=int, default=None, help="keys before the chunk (default 3 x chunk)")
    p.add_argument("--kept-blocks", type=int, default=4, help="indexer blocks kept per row (default 4)")
    p.add_argument("--compress-ratio", type=int, default=4, help="keys per indexer block (default 4)")
    p.add_argument("--out", default=None, help="keep the saved probe packages in this directory")
    p.add_argument(
        "--records", default=None, help="write a measured record (kind gather_probe_numpy) into this directory"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def _run_probe(args):
    from anelab.studies.gather_sizing import probe, probe_record, probe_table

    results = probe(
        args.chunk,
        heads=args.heads,
        head_dim=args.head_dim,
        history=args.history,
        kept_blocks=args.kept_blocks,
        compress_ratio=args.compress_ratio,
        repeats=args.repeats,
        out_dir=args.out,
    )
    written = None
    if args.records:
        from anelab.core.records import write_record

        written = write_record(args.records, probe_record(results, args.repeats))
    if args.json:
        _print_json(
            {
                "rows": [r.to_dict() for r in results],
                "record": str(written) if written else None,
                "timing": "numpy_eval_* are NumPy evaluations of the saved programs on this machine, not ANE times",
            }
        )
    else:
        print(probe_table(results))
        if written:
            print(f"record written to {written}")
    return 0 if all(r.agrees for r in results) else 1


_register("probe", _add_probe, _run_probe)
# <<< section: gather


# >>> section: compare-arms
def _add_compare_arms(sub):
    p = sub.add_parser(
        "compare-arms",
        help="whole model: per-layer hidden, logits and greedy text with the attention on the sidecars vs the reference",
    )
    p.add_argument(
        "checkpoint",
        help=CHECKPOINT_HELP + "; by name, its sidecars are exported first when --sidecars names a new directory",
    )
    p.add_argument("--sidecars", default=None, help="directory of layer_<L>.mlpackage for every full-attention layer")
    p.add_argument("--prompt-tokens", type=int, default=None, help="random prompt length (fixed seed)")
    p.add_argument("--tokens", default=None, help="token ids file (JSON list or whitespace-separated) instead")
    p.add_argument("--decode", type=int, default=32, help="greedy tokens decoded on the reference path (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk without sidecars (default 16)")
    p.add_argument("--kept-blocks", type=int, default=None, help="add folded / causal-only arms: indexer kept blocks")
    p.add_argument("--compress-ratio", type=int, default=4, help="indexer keys per block (default 4)")
    p.add_argument(
        "--compute-units",
        default=None,
        help="serve the sidecars through Core ML on a Mac (cpu_only | cpu_and_gpu | cpu_and_ne | all); "
        "default: NumPy evaluation of the saved programs",
    )
    p.add_argument(
        "--engine",
        default="auto",
        help="who runs everything but the sidecars: numpy (anelab's forward, the independent reference), mlx "
        "(mlx-lm's model: every family it runs, Qwen 3.5 hybrids and MoE included), or auto (default: numpy "
        "where anelab models the family, else mlx)",
    )
    p.add_argument(
        "--resident-budget",
        type=float,
        default=None,
        help="GiB of float32 decoder weights kept in memory (numpy engine; default 4; 0 streams every read from the "
        "checkpoint's files, the path for models that do not fit)",
    )
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")


def _run_compare_arms(args):
    from anelab.arms.compare import compare_arms, named_with_sidecars, read_tokens
    from anelab.arms.run import Indexer
    from anelab.checkpoints.default import named_checkpoints

    if (args.prompt_tokens is None) == (args.tokens is None):
        raise AnelabInputError("compare-arms: pass exactly one of --prompt-tokens N or --tokens FILE")
    checkpoint, sidecars = args.checkpoint, args.sidecars
    named = named_checkpoints().get(checkpoint)
    if named is not None:
        tokens = args.prompt_tokens or read_tokens(args.tokens).size
        checkpoint, sidecars = named_with_sidecars(checkpoint, sidecars, tokens, args.chunk or named.chunk)
    report = compare_arms(
        checkpoint,
        sidecars,
        args.prompt_tokens,
        decode=args.decode,
        tokens=read_tokens(args.tokens) if args.tokens else None,
        seed=args.seed,
        indexer=Indexer(args.kept_blocks, args.compress_ratio) if args.kept_blocks else None,
        chunk=args.chunk,
        compute_units=args.compute_units,
        engine=args.engine,
        resident_budget=None if args.resident_budget is None else _resident_bytes(args.resident_budget),
    )
    if args.json:
        _print_json(report.to_dict())
    else:
        print(report.table())
    return 0


def _resident_bytes(gib: float) -> int:
    if not gib >= 0 or gib == float("inf"):
        raise AnelabInputError(f"--resident-budget must be a finite number of GiB >= 0 (0 streams), got {gib}")
    return int(gib * 2**30)


_register("compare-arms", _add_compare_arms, _run_compare_arms)


# <<< section: compare-arms
# >>> section: ab
def _add_ab(sub):
    p = sub.add_parser(
        "ab",
        help="whole-model prefill A/B: mlx-lm's own prefill (the GPU arm) against the hybrid with every full-attention "
        "layer on its sidecar (the ANE arm, cpu_and_ne); measured on a Mac, labelled correctness run elsewhere",
    )
    p.add_argument("checkpoint", help="model directory (config.json + safetensors) mlx-lm reads")
    p.add_argument("--sidecars", required=True, help="directory of layer_<L>.mlpackage for every full-attention layer")
    p.add_argument("--prompt-tokens", type=_int_list, required=True, help="prompt lengths, e.g. 512,2048 (random ids)")
    p.add_argument(
        "--compute-units", default="cpu_and_ne", help="the ANE arm's Core ML compute units (cpu_and_ne | all)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each arm first (default 1)")
    p.add_argument("--repeats", type=int, default=2, help="measured runs of each arm (default 2: the seed's protocol)")
    p.add_argument("--dtype", default=None, help="mlx-lm's parameters: float32 | float16 | bfloat16 (default: the "
                   "checkpoint's on a Mac, float32 elsewhere)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument(
        "--out", default=None, help="records directory (default data/measured; new files, never overwritten)"
    )
    p.add_argument("--json", action="store_true", help="print the records and verdicts as JSON")


def _run_ab(args):
    from anelab.arms.prefill_ab import ab_request, run_ab
    from anelab.core.paths import MEASURED_DIR

    request = ab_request(
        _checkpoint(args.checkpoint), args.sidecars, args.prompt_tokens, compute_units=args.compute_units, warmup=args.warmup,
        repeats=args.repeats, dtype=args.dtype, seed=args.seed, out_dir=Path(args.out) if args.out else MEASURED_DIR,
    )  # fmt: skip
    report = run_ab(request)
    if args.json:
        _print_json(report.to_dict())
    else:
        print(report.table())
    return 0


_register("ab", _add_ab, _run_ab)


# <<< section: ab
# >>> section: decide
def _add_decide(sub):
    p = sub.add_parser(
        "decide",
        help="plan every design for a checkpoint, export + verify the candidate, run the whole-model arms, "
        "(on a Mac) measure, and write report.html / report.md / decision.json",
    )
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument("--prompt-tokens", type=int, required=True, help="your prompt length in tokens")
    _add_user_gpu(p)
    p.add_argument("--design", default="auto", help="auto (best predicted ratio) | dense | stateful | stateful-tiled")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk = sidecar width (default: the cost family's)")
    p.add_argument("--family", default=None, help="recorded dense family for the costs (default: the closest)")
    p.add_argument("--out", default=None, help="report directory (default: decide-<checkpoint name>)")
    p.add_argument("--measure", action="store_true", help="on a Mac: time the packages and plan again with the times")
    p.add_argument("--repeats", type=int, default=3, help="--measure: timed repeats per measurement (default 3)")
    p.add_argument("--json", action="store_true", help="print decision.json's verdict as JSON")
    p.add_argument("--weights", default="fp16", help="the packages' weight mode: fp16 | int8 | palettize4 | int4-block "
                   "(verified against their own weights; the compression's cost on real text reported beside)")  # fmt: skip
    _add_chip(p)
    _add_gpu_runtime(p, default="mlx-lm")


def _run_decide(args):
    from anelab.core.limits import MAX_POSITIONS, require_at_most
    from anelab.decide.report import verdict_lines
    from anelab.decide.run import DecideConfig, decide
    from anelab.planner.plan import check_user_gpu

    if args.prompt_tokens < 1:  # refused before decide writes its report directory
        raise AnelabInputError(f"--prompt-tokens must be a positive integer, got {args.prompt_tokens}")
    require_at_most("--prompt-tokens", args.prompt_tokens, MAX_POSITIONS, "decide for a shorter prompt")
    check_user_gpu(args.gpu_prefill_seconds, args.gpu_tokens_per_second)
    if args.chip is not None:
        from anelab.planner.chips import get_chip

        get_chip(args.chip)  # a bad name is refused before the work
    from anelab.planner.gpu_model import require_gpu_runtime

    require_gpu_runtime(args.gpu_runtime)
    out = Path(args.out) if args.out else Path(f"decide-{Path(args.checkpoint).name}")
    config = DecideConfig(
        checkpoint=_checkpoint(args.checkpoint),
        prompt_tokens=args.prompt_tokens,
        out=out,
        design=args.design,
        chunk=args.chunk,
        family=args.family,
        gpu_prefill_seconds=args.gpu_prefill_seconds,
        gpu_tokens_per_second=args.gpu_tokens_per_second,
        gpu_runtime=args.gpu_runtime,
        chip=args.chip,
        measure=args.measure,
        repeats=args.repeats,
        weights=args.weights,
    )
    decision = decide(config).to_dict()
    if args.json:
        _print_json(decision["verdict"])
    else:
        print("\n".join(verdict_lines(decision)))
        if args.chip is not None:
            from anelab.planner.chips import bound_sentence, plan_bounds

            print(bound_sentence(plan_bounds(decision["plan"], args.chip)))
        print(f"report: {out / 'report.html'} (also report.md, decision.json)")
    return 0


_register("decide", _add_decide, _run_decide)
# <<< section: decide


# >>> section: studies (run / batch / records / docs)
def _add_run(sub):
    p = sub.add_parser("run", help="one papermill run of a study into runs/<study>/<run id>/")
    p.add_argument("notebook", help="study number, stem or notebook path (e.g. 02, 02_mask_fold)")
    p.add_argument(
        "-p", dest="params", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
        help="a parameter of the notebook's parameters cell (repeatable; checked against its declared type)",
    )  # fmt: skip
    p.add_argument("--out", default=None, help="run directory (default: <runs>/<study>/<run id>)")
    p.add_argument("--runs", default=None, help="root of the run directories (default: runs/)")
    p.add_argument(
        "--publish", action="store_true", help="write figures to the committed figures/ (and HTML to build/html)"
    )
    p.add_argument("--threads", type=int, default=None, help="BLAS/OpenMP threads of the notebook's kernel")
    p.add_argument("--timeout", type=float, default=None, help="seconds any one cell may take")
    p.add_argument("--resume", action="store_true", help="exit 0 if the run directory holds a successful run")


def _run_run(args):
    from anelab.publish import notebooks

    notebook = notebooks.resolve_notebook(args.notebook)
    names = [name for name, _ in args.params]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise AnelabInputError(f"parameter {repeated[0]} given twice; pass each -p NAME VALUE once")
    if args.threads is not None and args.threads < 1:
        raise AnelabInputError(f"--threads must be at least 1, got {args.threads}")
    params = notebooks.check_parameters(notebook, dict(args.params), from_text=True)
    out = args.out or notebooks.run_directory(notebook, params, *([args.runs] if args.runs else []))
    finished = notebooks.read_result(out)
    if args.resume and finished is not None:
        if finished.get("status") == "ok":
            print(f"{out}: finished ok before; skipped (--resume)")
            return 0
        notebooks.clear_run_directory(out)  # a failed run runs again
    run = notebooks.run_study(
        notebook, params, out=out, publish=args.publish, threads=args.threads, timeout=args.timeout
    )
    print(run.line())
    print(f"run directory: {run.executed.parent}")
    return 0 if run.ok else 1


def _add_batch(sub):
    p = sub.add_parser("batch", help="run a TOML grid of study parameters in a local process pool")
    p.add_argument("grid", help="grid file (see grids/), one table per study with fixed / vary / runs")
    p.add_argument(
        "--jobs", type=int, default=None,
        help="concurrent runs, default 1 (each gets cores // jobs BLAS threads; with --emit-jobs: --threads of each command)",
    )  # fmt: skip
    p.add_argument("--emit-jobs", action="store_true", help="print one 'anelab run ...' command per run; run nothing")
    p.add_argument("--resume", action="store_true", help="skip runs whose directory holds a successful result")
    p.add_argument("--runs", default=None, help="root of the run directories (default: runs/)")
    p.add_argument("--timeout", type=float, default=None, help="seconds any one cell may take")


def _run_batch(args):
    from pathlib import Path

    from anelab.core.parallel import threads_per_run
    from anelab.core.paths import RUNS_DIR
    from anelab.publish import batch
    from anelab.publish.batch_summary import write_summary

    root = Path(args.runs) if args.runs else RUNS_DIR
    jobs = 1 if args.jobs is None else args.jobs
    threads = threads_per_run(jobs)
    planned = batch.plan_grid(args.grid, root)
    if args.emit_jobs:  # --threads only when --jobs says how many run at once on the machine running them
        for line in batch.job_commands(planned, threads=None if args.jobs is None else threads, runs_root=args.runs):
            print(line)
        return 0
    results = batch.run_batch(planned, jobs=jobs, resume=args.resume, timeout=args.timeout)
    written = write_summary(results, root / f"batch-{Path(args.grid).stem}", Path(args.grid).stem)
    print((root / f"batch-{Path(args.grid).stem}" / "summary.md").read_text())
    for what, path in written.items():
        print(f"{what}: {path}")
    failed = [r for r in results.values() if r.get("status") != "ok"]
    print(f"{len(results) - len(failed)} of {len(results)} runs ok" + (f", {len(failed)} failed" if failed else ""))
    return 1 if failed else 0


def _add_records(sub):
    p = sub.add_parser("records", help="list the records, or compare fresh values with the seeds' recorded ones")
    p.add_argument("action", choices=["list", "compare"])
    p.add_argument("--kind", default=None, help="list: only records of this kind")
    p.add_argument("--machine", default=None, help="only records whose machine (model, chip, OS) contains this")
    p.add_argument(
        "--dir", dest="dirs", action="append", default=None,
        help="records directory (repeatable; default: data/, data/measured/ and runs/*/*/records)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print JSON")


def _run_records(args):
    from anelab.publish import records_compare as rc

    skipped: list = []
    records = rc.gather_records(args.dirs, skipped=skipped if args.action == "list" else None)
    if args.action == "list":  # an unreadable record is reported on stderr; the others are listed
        for path, reason in skipped:
            print(f"anelab: skipped an unreadable record: {reason}", file=sys.stderr)
        rows = rc.list_rows(rc.select(records, kind=args.kind, machine=args.machine))
        if args.json:
            _print_json(rows)
            return 0
        for r in rows:
            print(f"{r['kind']:<24} {r['origin']:<9} {r['machine']:<44} {r['date']:<26} {r['path']}")
        print(f"{len(rows)} records" + (f" ({len(skipped)} unreadable, skipped: see stderr)" if skipped else ""))
        return 0
    if args.kind is not None:
        raise AnelabInputError("records compare: --kind applies to list; compare covers its declared quantities")
    rows = rc.compare(records, machine=args.machine)
    _print_json(rows) if args.json else print(rc.compare_table(rows))
    return 0


def _add_docs(sub):
    p = sub.add_parser("docs", help="build the figure gallery (build/docs/index.html) from figures/MANIFEST.json")
    p.add_argument("--figures", default=None, help="figures directory (default: the committed figures/)")
    p.add_argument("--html", default="build/html", help="executed notebooks' HTML (default: build/html)")
    p.add_argument("--out", default="build/docs", help="output directory (default: build/docs)")


def _run_docs(args):
    from anelab.core.paths import FIGURES_DIR
    from anelab.publish.docs_site import build_docs, vendor_widget_manager

    index, pages = build_docs(args.figures or FIGURES_DIR, args.html, args.out)
    print(vendor_widget_manager(args.out))
    for page in pages:
        if page.html is None:
            print(f"{page.stem}: {page.missing}")
    print(f"{sum(len(p.figures) for p in pages)} figures from {len(pages)} notebooks -> {index}")
    return 0


_register("run", _add_run, _run_run)
_register("batch", _add_batch, _run_batch)
_register("records", _add_records, _run_records)
_register("docs", _add_docs, _run_docs)


# <<< section: studies
# >>> section: measure (a Mac: everything fresh in one command)
def _add_measure(sub):
    p = sub.add_parser(
        "measure",
        help="on a Mac: doctor, export with the ANE gate, verify on the device, load timings, block A/B, probe timing",
    )
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the embedded default)")
    p.add_argument("--layer", type=int, default=None, help="full-attention layer (default: the first)")
    p.add_argument("--chunk", type=int, default=64, help="chunk width C (default 64)")
    p.add_argument("--histories", type=_int_list, default=None, help="histories (default 0,C,2C)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (default 3)")
    p.add_argument("--build", default=None, help="build directory for packages (default build/measure)")
    p.add_argument("--records", default=None, help="where records go (default data/measured)")
    p.add_argument("--again", action="store_true", help="measure again what is already recorded here")
    p.add_argument("--dry-run", action="store_true", help="list the steps and exit (runs anywhere)")


def _run_measure(args):
    from anelab.publish.measure import MeasureConfig, measure, plan_text

    config = MeasureConfig(
        checkpoint=_checkpoint(args.checkpoint), layer=args.layer, chunk=args.chunk, histories=args.histories,
        repeats=args.repeats, again=args.again,
    )  # fmt: skip
    if args.build:
        config.build = args.build
    if args.records:
        config.records = args.records
    if args.dry_run:
        print(plan_text(config))
        return 0
    summary = measure(config)
    print(
        f"{len(summary['written'])} records written to {config.records}; skipped: {', '.join(summary['skipped']) or 'none'}"
    )
    return 0


_register("measure", _add_measure, _run_measure)
# <<< section: measure


def _is_gate_refusal(error: Exception) -> bool:
    """Whether ``error`` is the ANE gate's refusal (``anelab.runtimes.gate.AneGateError``). Only a command
    that imported the gate can raise it, so the gate is looked up, not imported (its import pulls in
    NumPy and the runtime layer, which most commands never need)."""
    gate = sys.modules.get("anelab.runtimes.gate")
    return gate is not None and isinstance(error, gate.AneGateError)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="anelab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name, add_fn, _ in COMMANDS:
        add_fn(sub)
    return parser


EXIT_TERMINATED = 128 + 15


def main(argv: list[str] | None = None) -> int:
    from anelab.core.termination import Terminated, terminate_by_exception

    try:
        with terminate_by_exception():  # SIGTERM runs every finally (an export's staging folder, its workers)
            return _main(argv)
    except Terminated:
        print("anelab: terminated", file=sys.stderr)
        return EXIT_TERMINATED


def _main(argv: list[str] | None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help()
            return EXIT_BAD_INPUT
        runners = {name: run_fn for name, _, run_fn in COMMANDS}
        return int(runners[args.command](args) or 0)
    except AnelabInputError as e:
        print(f"anelab: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("anelab: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _is_gate_refusal(e):
            raise
        print(f"anelab: export refused: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
