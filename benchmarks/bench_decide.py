"""Benchmark: ``anelab decide`` end to end off-Mac, a first run and a rerun, with the wall time of each phase.

Default: a Llama-3.2-1B-shaped checkpoint (16 layers, hidden 2048, 32 heads x 64, 8 KV heads, llama3 RoPE,
MLP 8,192, tied 128,256-token vocabulary, BF16, two shards) with random weights, written by the project's
writer (``anelab.checkpoints.default.make_llama32_1b_shaped``). ``--checkpoint default-real`` (or any checkpoint
path or name) runs that one instead: issue 32 times ``--checkpoint default-real --prompt-tokens 2048 --chunk 512``
(its first run within 60 s on a quiet 2-core machine, the rerun within 5 s).

``decide`` plans every design, exports and verifies the candidate's sidecars for every layer (its last layers
verified while the arms run), runs the whole-model arms and writes the report. The first run starts in an empty
``--out/report`` (no evidence); the second reuses every exported and verified package and the arms (same
content hashes). Printed per run: the wall time of each phase (plan, export + verify, arms with the layers
verified beside them, report), the whole run, and the CPU time of this process and of its worker processes;
then the verdict and where report.html is. Nothing is asserted. Run it on a quiet machine (``uptime``).

Usage: python benchmarks/bench_decide.py [--checkpoint NAME|PATH] [--prompt-tokens N] [--chunk C] [--design D]
[--out DIR] [--quick]
(``--quick``: the 1B shape scaled down 8x in width, 2 layers, small vocabulary — what the tests run.)
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import shutil
import time
from pathlib import Path

PHASES = {  # anelab.decide.decision function -> the phase it times
    "open_request": "open the checkpoint",
    "export_and_verify": "export + verify",
    "verified_beside": "arms (+ layers verified beside)",
    "write_report": "report",
}


def _timed_phases(times: dict[str, float]):
    """Wrap decide's phase functions so that each adds its wall time to ``times`` (a benchmark's instrument)."""
    import anelab.decide.decision as run
    import anelab.decide.decision_report as report

    def wrap(module, name):
        inner = getattr(module, name)

        if name == "verified_beside":

            @contextlib.contextmanager
            def timed(*args, **kwargs):
                start = time.perf_counter()
                with inner(*args, **kwargs):
                    yield
                times[PHASES[name]] = times.get(PHASES[name], 0.0) + time.perf_counter() - start

        else:

            def timed(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    times[PHASES[name]] = times.get(PHASES[name], 0.0) + time.perf_counter() - start

        setattr(module, name, timed)

    for name in ("open_request", "export_and_verify", "verified_beside"):
        wrap(run, name)
    wrap(report, "write_report")


def _cpu() -> tuple[float, float]:
    """(this process's, its finished children's) user + system CPU seconds."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="a checkpoint path or name (default: the 1B-shaped one)")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=None, help="default: the cost family's (4,096)")
    parser.add_argument("--design", default="auto")
    parser.add_argument("--out", default="build/bench_decide")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()

    from anelab.checkpoints.default import make_llama32_1b_shaped, resolve_checkpoint
    from anelab.decide.decision import DecideConfig, decide
    from anelab.decide.decision_report import verdict_lines

    out = Path(args.out)
    start = time.perf_counter()
    if args.checkpoint is not None:
        checkpoint = resolve_checkpoint(args.checkpoint)
    else:
        checkpoint = out / ("llama32-1b-shaped-quick" if args.quick else "llama32-1b-shaped")
        if not (checkpoint / "config.json").exists():
            shape = dict(scale=8, num_layers=2, vocab=256, intermediate=128) if args.quick else {}
            make_llama32_1b_shaped(checkpoint, **shape)
    print(f"checkpoint {checkpoint}: {time.perf_counter() - start:.1f} s")
    tokens, chunk = (64, 32) if args.quick and args.checkpoint is None else (args.prompt_tokens, args.chunk)
    shutil.rmtree(out / "report", ignore_errors=True)  # a first run: no evidence
    config = DecideConfig(checkpoint, tokens, out / "report", design=args.design, chunk=chunk)
    times: dict[str, float] = {}
    _timed_phases(times)
    for run in ("first run", "second run (reuses the verified packages and the arms)"):
        times.clear()
        cpu = _cpu()
        start = time.perf_counter()
        decision = decide(config)
        total = time.perf_counter() - start
        own, children = (after - before for after, before in zip(_cpu(), cpu, strict=True))
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in times.items())
        print(f"decide, {run}: {total:.1f} s ({phases}, plan and the rest {total - sum(times.values()):.1f} s; "
              f"CPU {own:.1f} s here + {children:.1f} s in worker processes)")  # fmt: skip
    print("\n".join(verdict_lines(decision)))
    print(f"report: {out / 'report' / 'report.html'}")


if __name__ == "__main__":
    main()
