"""anelab command line. Bad input: one line on stderr, exit code 2, no traceback.

Each subcommand has a ``_add_<name>(sub)`` parser builder and a ``_run_<name>(args)`` runner;
runners import their module lazily so ``anelab doctor`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys

from anelab.errors import AnelabInputError

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default also prints usage)
        raise AnelabInputError(f"{self.prog}: {message} (see --help)")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


# ---- commands ----------------------------------------------------------------------------------
# (each section: _add_X registers the parser, _run_X executes; keep sections independent)

COMMANDS: list = []  # (name, add_fn, run_fn), filled below


def _register(name, add_fn, run_fn):
    COMMANDS.append((name, add_fn, run_fn))


# >>> section: core (export / inspect / evaluate / verify / reproduce)
def _add_export(sub):
    p = sub.add_parser("export", help="export full-attention layers as multifunction Core ML sidecars")
    p.add_argument("checkpoint", help="Hugging Face-style model directory (config.json + safetensors)")
    p.add_argument("--chunk", type=int, required=True, help="chunk width C (rows per call)")
    p.add_argument(
        "--histories",
        type=_int_list,
        default=None,
        help="comma-separated histories, multiples of C (e.g. 0,C,2C); required unless --graph stateful --capacity N",
    )
    p.add_argument("--layers", type=_int_list, default=None, help="full-attention layers to export (default: all)")
    p.add_argument(
        "--graph",
        default="dense",
        help="graph form: dense | tiled (online softmax over key tiles) | stateful (K/V as Core ML state)",
    )
    p.add_argument(
        "--tile",
        type=int,
        default=None,
        help="tiled graph: key positions per tile, a divisor of the chunk (default: the chunk)",
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
    p.add_argument("--out", required=True, help="output directory for layer_<L>.mlpackage")
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


def _run_export(args):
    from anelab.runtime.gate import AneGate
    from anelab.runtime.mac import default_runtime
    from anelab.sidecar.export import export_sidecars

    if args.histories is None and args.graph != "stateful":
        raise AnelabInputError(
            "export: --histories is required (e.g. --histories 0,C,2C); only --graph stateful --capacity N goes without"
        )
    selection = None
    if args.selection_kept_blocks is not None or args.selection_compress_ratio is not None:
        selection = {"kept_blocks": args.selection_kept_blocks, "compress_ratio": args.selection_compress_ratio}
    gate = AneGate.for_runtime(default_runtime())
    results = export_sidecars(
        args.checkpoint,
        args.out,
        args.chunk,
        args.histories,
        args.layers,
        graph=args.graph,
        key_tile=args.tile,
        weights_mode=args.weights,
        capacity=args.capacity,
        decode=args.decode,
        selection=selection,
        gate=gate,
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
        if results and not results[0].metadata.ane_verified:
            print(f"aneCompileVerified: false — {results[0].metadata.ane_reason}")
    return 0


def _add_inspect(sub):
    p = sub.add_parser("inspect", help="functions, shapes, op counts, weight bytes and metadata of a saved package")
    p.add_argument("package")
    p.add_argument("--json", action="store_true")


def _run_inspect(args):
    from anelab.sidecar.inspection import inspect_package

    info = inspect_package(args.package)
    if args.json:
        _print_json(info)
    else:
        from anelab.sidecar.inspection import format_inspection

        print(format_inspection(info))
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

    from anelab.records import atomic_write_bytes
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
    p = sub.add_parser("verify", help="check a saved package against the NumPy reference, with negative controls")
    p.add_argument("package")
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the one the package records)")
    p.add_argument("--fp32", action="store_true", help="evaluate the package in fp32 instead of emulating fp16 storage")
    p.add_argument("--json", action="store_true")


def _run_verify(args):
    from anelab.sidecar.verify import verify_package

    report = verify_package(args.package, args.checkpoint, fp16=not args.fp32)
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
    from anelab.studies.reproduce import reproduce

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


def _run_doctor(args):
    from anelab.runtime.doctor import diagnose, format_report

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


def _add_plan(sub):
    p = sub.add_parser("plan", help="chunks, variants, setup and the ANE-vs-GPU decision for one prompt")
    p.add_argument("--family", help="a recorded family (see --list-families); supplies geometry and fitted costs")
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
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--list-families", action="store_true", help="list the families, what is recorded and unknown")
    p.add_argument("--fit-report", action="store_true", help="predicted vs recorded ratio of every recorded A/B row")


def _print_family_table(rows):
    for f in rows:
        g, facts = f["geometry"], f["facts"]

        def fact(key, value):
            return f"{value if value is not None else '?'} ({facts[key]['status']})"

        cap = (
            "unknown" if f["max_history"] is None else f"{f['max_history']} (coverage {f['coverage_cap']:,}, recorded)"
        )
        print(f"{f['name']:<26} {f['label']}")
        print(
            f"  layers {fact('num_layers', g['num_layers'])}; full-attention "
            f"{fact('full_attention_layers', len(g['full_attention_layers']))} at {','.join(map(str, g['full_attention_layers']))}"
        )
        print(
            f"  heads {fact('num_heads', g['num_heads'])}; kv heads {fact('num_kv_heads', g['num_kv_heads'])}; "
            f"head_dim {fact('head_dim', g['head_dim'])}; sparse budget "
            f"{fact('sparse_budget', g['sparse_budget'] or 'dense')}; max history {cap}"
        )
        print(f"  records: {', '.join(f['records'])}")
        print(f"  unknown: {'; '.join(f['unknown'])}")


def _print_fit_report(rows, fit, loads):
    print(
        f"{'family':<26} {'record':<27} {'tokens':>6} {'chunk':>5} {'recorded':>8} "
        f"{'in-sample':>9} {'err':>6} {'LOO':>6} {'err':>6} {'plan':>6} {'err':>6}"
    )
    for r in rows:
        print(
            f"{r['family']:<26} {r['record']:<27} {r['prompt_tokens']:>6} {r['chunk']:>5} {r['recorded_ratio']:>7.2f}x "
            f"{r['in_sample_ratio']:>8.2f}x {r['in_sample_error']:>+6.1%} {r['leave_one_out_ratio']:>5.2f}x "
            f"{r['leave_one_out_error']:>+6.1%} {r['plan_ratio']:>5.2f}x {r['plan_error']:>+6.1%}"
        )
    print(
        f"rates: ANE {fit['ane_seconds_per_entry']:.3g} s/entry (recorded h0), dense GPU "
        f"{fit['gpu_dense_seconds_per_entry']:.3g}, sparse GPU {fit['gpu_sparse_seconds_per_entry']:.3g} s/entry (fitted); "
        f"dense setup {fit['dense_setup_seconds_per_variant']:.3g} s/variant (fitted)"
    )
    print(
        f"load = {fit['load_power_coef']:.3g} s x (score arena / GB) ^ {fit['load_power_exp']:.3g}: "
        + ", ".join(
            f"h{x['history']} {x['recorded_seconds']:.1f} s recorded, {x['power_fit_seconds']:.1f} s fit" for x in loads
        )
    )


def _print_plan(d):
    name = d["family"] or "custom geometry"
    print(
        f"{name}: prompt {d['prompt_tokens']:,} tokens, chunk {d['chunk']:,}, histories "
        f"{','.join(map(str, d['histories']))} (coverage {d['coverage']:,}; needed {d['coverage_needed']:,}; "
        f"{'fits' if d['fits'] else 'does not fit'})"
    )
    print(f"{'chunk':>5} {'start':>7} {'tokens':>7}  device  function")
    for c in d["chunks"]:
        print(
            f"{c['index']:>5} {c['start']:>7,} {c['tokens']:>7,}  {c['device']:<6}  "
            f"{'h' + str(c['history']) if c['device'] == 'ane' else '-'}"
        )
    n_fa = len(d["geometry"]["full_attention_layers"])
    loads = ", ".join(f"h{h} {v['seconds']:.2f} s ({v['source']})" for h, v in d["load_seconds"].items())
    print(
        f"variants visited: {d['variants_visited']} ({n_fa} full-attention layers x "
        f"{len(d['load_seconds'])} histories){'; loads ' + loads if loads else ''}"
    )
    print(
        f"GPU arm: non-attention {d['non_attention_seconds']:.1f} s + attention {d['gpu_attention_seconds']:.1f} s "
        f"= {d['gpu_prefill_seconds']:.1f} s"
    )
    print(
        f"ANE arm: {d['ane_prefill_seconds']:.1f} s (setup {d['setup_seconds']:.1f} s, ANE attention "
        f"{d['ane_attention_seconds']:.1f} s, attention saved {d['attention_saved_seconds']:.1f} s)"
    )
    print(f"predicted ratio {d['predicted_ratio']:.2f}x (GPU / ANE)")
    print(f"decision: {d['decision']} — {d['reason']}")


def _run_plan(args):
    from anelab.studies import planner

    if args.list_families:
        rows = planner.family_table()
        _print_json(rows) if args.json else _print_family_table(rows)
        return 0
    if args.fit_report:
        rows, fit, loads = planner.predicted_vs_recorded(), planner.fit_costs().to_dict(), planner.load_fit_report()
        if args.json:
            fit.pop("rows")
            _print_json({"rows": rows, "fit": fit, "loads": loads})
        else:
            _print_fit_report(rows, fit, loads)
        return 0
    if args.prompt_tokens is None:
        raise AnelabInputError("anelab plan: pass --prompt-tokens N (or --list-families / --fit-report)")
    result = planner.plan(
        args.prompt_tokens,
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
    ).to_dict()
    _print_json(result) if args.json else _print_plan(result)
    return 0


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
    from anelab.geometry import GB
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
    from anelab.studies.gather_probe import probe, probe_record, probe_table

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
        from anelab.records import write_record

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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="anelab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name, add_fn, _ in COMMANDS:
        add_fn(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
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
    except RuntimeError as e:
        if type(e).__name__ != "AneGateError":
            raise
        print(f"anelab: export refused: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("anelab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
