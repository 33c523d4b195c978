"""``anelab decide``'s report: ``decision.json``, ``report.md`` and a self-contained ``report.html``.

The HTML (jinja2 template ``templates/decide.html.j2``, autoescaped) embeds its figure as a PNG data
URI, so the one file opens anywhere. Sections: the verdict and its thresholds; the figure (ANE vs
GPU prefill over prompt length, intervals shaded, the user's prompt marked, each arm's provenance in
its legend); every deciding number with its provenance; the designs; the evidence (verify per layer,
the whole-model arms, measurements); what would change the answer and the exact command.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

from anelab.arms.arm_comparison import NEAR_TIE_RULE
from anelab.core.records import atomic_write_bytes, atomic_write_text
from anelab.decide.decide_request import ArmsSummary, CheckpointSummary, Decision
from anelab.planner.gpu_runtimes import gpu_runtime_phrase
from anelab.planner.plan_text import energy_line, offload_split_lines
from anelab.planner.verdict import thresholds_sentence

TEMPLATE_DIR = Path(__file__).with_name("templates")
TEMPLATE = "decide.html.j2"
FIGURE = "prefill_vs_prompt.png"
COST_NAMES = {
    "gpu_prefill": "GPU prefill of the prompt",
    "ane_attention": "ANE attention (all layers)",
    "load_per_layer": "loads of one layer for this prompt",
}


def seconds(x: float) -> str:
    """Seconds as the report prints them: 3 decimals, or 3 significant digits below 0.01 s."""
    return f"{x:.3f}" if x == 0 or abs(x) >= 0.01 else f"{x:.3g}"


def sliding_lines(ck: CheckpointSummary) -> list[str]:
    """What the verdict prices of a model with sliding-window layers: its full-attention layers only (the planner's
    ``full`` part); the sliding layers are exported, verified and served in the arms like the others."""
    sliding = ck.sliding_layers
    if not sliding:
        return []
    full = [i for i in ck.full_attention_layers if i not in sliding]
    return [
        f"layers priced: the verdict prices the {len(full)} full-attention layers ({', '.join(map(str, full))}); "
        f"the {len(sliding)} sliding-window layers (window {ck.sliding_window:,}) are exported with the same "
        "design, verified and served in the whole-model arms, but not priced here: 'anelab plan --checkpoint' plans "
        "them apart"
    ]


def verdict_lines(decision: Decision) -> list[str]:
    """The verdict section as plain lines (report.md and ``anelab decide``'s output)."""
    v, ck = decision.verdict, decision.checkpoint
    gpu, ane = v.gpu_prefill, v.ane_prefill
    lines = [
        f"verdict: {v.decision} — {v.reason}",
        f"model: {ck.path} ({ck.model_type}, {len(ck.full_attention_layers)} attention layers, "
        f"{ck.heads} heads x {ck.head_dim}, {ck.kv_heads} KV heads, RoPE {ck.rope}, {ck.dtype}); "
        f"prompt {decision.config.prompt_tokens:,} tokens; design {decision.candidate}, "
        f"chunk {decision.plan.chunk:,}",
        f"GPU arm {seconds(gpu['value'])} s [{seconds(gpu['low'])} .. {seconds(gpu['high'])}] ({gpu['kind']}); "
        f"ANE arm {seconds(ane['value'])} s [{seconds(ane['low'])} .. {seconds(ane['high'])}] ({ane['kind']}); "
        f"predicted ratio {v.predicted_ratio:.2f}x (GPU / ANE)",
        f"thresholds: {thresholds_sentence(v.to_dict())}",
        f"GPU arm: {gpu_runtime_phrase(decision.plan.to_dict())} (--gpu-runtime, --chip); ANE attention and loads: "
        "TinyTitan's sidecars recorded on an Apple M3 (seed 000) unless measured here",
    ]
    lines += _chip_lines(decision)
    lines += sliding_lines(ck)
    for what, command in v.settle:
        lines.append(f"to settle it: {what}: {command}")
    for line in decision.yours:
        lines.append(f"your numbers: {line}")
    if decision.measured:
        lines.append("measured records replaced the predicted costs marked 'measured on this Mac'")
    return lines


def _chip_lines(decision: Decision) -> list[str]:
    """The chip, both arms' joules, the objective and the cold start."""
    v, p = decision.verdict, decision.plan
    out = []
    if p.chip:
        out.append(f"chip: {p.chip} — {p.chip_choice}")
    if v.energy:
        out.append(energy_line(v.energy) + f"; objective {v.objective} (on time: {v.time_decision})")
    if p.cold_start:
        out.append(p.cold_start["sentence"])
    return out


def offload_split_report_lines(decision: Decision) -> list[str]:
    """Which blocks go to the ANE, per chip: the best split and the runner-up (none when it was not priced)."""
    return offload_split_lines(decision.offload_split) if decision.offload_split else []


def chip_map_rows(decision: Decision) -> list[dict]:
    """The verdict map's rows for the report: chip (the user's marked), then per prompt length ratio and verdict."""
    m = decision.chip_map
    rows = []
    for r in m.get("rows", []):
        cells = [f"{c['ratio']:.2f}x {c['decision']}" for c in r["cells"]] or [r["refused"]]
        rows.append({"chip": r["chip"] + (" (yours)" if r["marked"] else ""), "marked": r["marked"], "cells": cells})
    return rows


def chip_map_markdown(decision: Decision) -> list[str]:
    m = decision.chip_map
    if not m:
        return []
    lengths = m["prompt_lengths"]
    out = ["", "## Your chip among the others", "", "Ratio (GPU arm / ANE arm) and verdict per chip and prompt length; "
           "your chip's row is marked.", "", "| chip | " + " | ".join(f"{n:,}" for n in lengths) + " |",
           "|---|" + "---|" * len(lengths)]  # fmt: skip
    for r in chip_map_rows(decision):
        name = f"**{r['chip']}**" if r["marked"] else r["chip"]
        cells = r["cells"] if len(r["cells"]) == len(lengths) else [r["cells"][0]] + [""] * (len(lengths) - 1)
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def cost_rows(decision: Decision) -> list[dict]:
    """The deciding costs as the report's table rows: name, the cost's value, interval, kind and basis, deciding."""
    v = decision.verdict
    return [
        {"name": COST_NAMES[k], **c, "extrapolated": k in v.extrapolated}
        for k, c in v.costs.items()
        if k != "load_per_layer" or decision.plan.loads_in_arm
    ]


def figure_png(decision: Decision) -> bytes:
    """ANE vs GPU prefill over prompt length, intervals shaded, the user's prompt marked (PNG bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = decision.sweep
    x = [r.prompt_tokens for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.7), dpi=110)
    for arm, color in (("gpu", "tab:blue"), ("ane", "tab:orange")):
        points = [getattr(r, arm) for r in rows]  # the arm's cost at each prompt length (value, low, high, kind)
        kinds = sorted({p["kind"] for p in points})
        label = f"{'GPU' if arm == 'gpu' else 'ANE'} arm ({', '.join(kinds)})"
        ax.plot(x, [p["value"] for p in points], "-o", ms=3, color=color, label=label)
        ax.fill_between(x, [p["low"] for p in points], [p["high"] for p in points], color=color, alpha=0.18)
    n = decision.config.prompt_tokens
    ax.axvline(n, color="k", ls="--", lw=1)
    ax.annotate(
        f"your prompt: {n:,} tokens\nverdict: {decision.verdict.decision}",
        (n, 0.97),
        xycoords=("data", "axes fraction"),
        ha="left",
        va="top",
        fontsize=9,
        xytext=(4, 0),
        textcoords="offset points",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("prefill time (s)")
    ax.set_title(f"{Path(decision.checkpoint.path).name}: ANE ({decision.candidate}) vs GPU prefill")
    ax.legend(loc="lower right", fontsize=9, title="shaded: interval; (provenance)", title_fontsize=9)
    chip = decision.plan.chip
    provenance = (
        f"predicted by anelab's planner: GPU arm {gpu_runtime_phrase(decision.plan.to_dict()).split(' (')[0]}; "
        + ("ANE arm from the seed's M3 records (data/)" + (f", carried to the {chip}" if chip != "M3" else ""))
    )
    if decision.measured:
        provenance += "; measured on this Mac where marked"
    if decision.yours:
        provenance += "; your GPU number where marked 'yours'"
    fig.text(0.01, 0.01, provenance, fontsize=9, color="0.35")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def markdown(decision: Decision, figure: str) -> str:
    v = decision.verdict
    out = ["# Should this model's prefill attention go to the ANE?", "", "## Verdict", ""]
    out += [f"- {line}" for line in verdict_lines(decision)]
    out += ["", f"![ANE vs GPU prefill over prompt length]({figure})", "", "## Deciding numbers", ""]
    out += ["| cost | seconds | interval | provenance | basis |", "|---|---:|---|---|---|"]
    for r in cost_rows(decision):
        flag = " (deciding)" if r["extrapolated"] else ""
        out.append(
            f"| {r['name']} | {seconds(r['value'])} | {seconds(r['low'])} .. {seconds(r['high'])} | {r['kind']}{flag} "
            f"| {r['basis']} |"
        )
    out += ["", "## Designs", "", "| design | loads | load s each | ANE arm s | GPU arm s | ratio | verdict |"]
    out.append("|---|---:|---:|---:|---:|---:|---|")
    for d in decision.designs:
        verdict = decision.verdicts[d.design].decision
        out.append(
            f"| {d.design} | {d.loads} | {seconds(d.load_seconds_each)} ({d.load_source}) | "
            f"{d.ane_prefill_seconds:.2f} | {d.gpu_prefill_seconds:.2f} | {d.predicted_ratio:.2f}x | {verdict} |"
        )
    out += [
        "",
        "## Evidence",
        "",
        "| layer | verify | worst error | cases + controls | reused |",
        "|---:|---|---:|---|---|",
    ]
    for layer, r in decision.evidence.verify.items():
        status = "passed" if r.passed else ("VACUOUS" if r.vacuous else "FAILED")
        worst = "-" if r.max_relative_error is None else f"{r.max_relative_error:.2e}"
        out.append(f"| {layer} | {status} | {worst} | {r.cases} + {r.controls} | {r.reused} |")
    a = decision.evidence.arms
    out += [
        "",
        f"Whole-model arms (sidecar vs reference, {a.prompt_tokens} tokens in chunks of {a.chunk}, "
        f"{a.decode} decoded): logits {a.logits_relative_difference:.3%}, greedy agreement "
        f"{a.greedy_agreement:.0%}, first layer beyond {a.noise:.0e}: {a.first_divergent_layer}. {a.note}",
    ]
    out += _greedy_lines(a)
    out += chip_map_markdown(decision)
    split = offload_split_report_lines(decision)
    out += ["", "## Which blocks go to the ANE", "", *[f"- {line}" for line in split[1:]]] if split else []
    out += compression_lines(decision)
    if v.settle:
        out += ["", "## What would change the answer", ""]
        out += [f"- {what}: `{command}`" for what, command in v.settle]
    return "\n".join(out) + "\n"


def _greedy_lines(arms: ArmsSummary) -> list[str]:
    """The greedy text's agreement raw and excluding near-ties, each divergence labelled (arms.arm_comparison), and
    whether these results were reused from the evidence."""
    out = ["", f"Greedy text: {arms.greedy_summary}."]
    if arms.divergences:
        out.append(f"({NEAR_TIE_RULE.format(noise=arms.noise)}.)")
    if arms.reused:
        out.append("(The arms' results are those of an earlier run with the same checkpoint, packages and prompt, "
                   "kept in evidence.json.)")  # fmt: skip
    return out


def compression_lines(decision: Decision) -> list[str]:
    """``--weights``: what the compression costs the whole model on real text (reported, not judged)."""
    e = decision.evidence.compression
    if e is None:
        return []
    if e.cost is None:
        return ["", f"Compression {e.mode}: {e.note}."]
    c = e.cost
    return ["", f"Compression {e.mode} (each package verified against its own stored weights; its cost reported, "
                f"not judged), on {e.text}, {c.decode} decoded: logits {c.logits_diff:.3%} from the "
                f"uncompressed reference, greedy agreement {c.greedy_agreement:.0%} "
                f"({c.agreement_excluding_near_ties:.0%} excluding {c.near_ties} near-tie(s)), perplexity "
                f"{c.perplexity:.3f} against {c.reference_perplexity:.3f} ({c.perplexity_change:+.2%})."]  # fmt: skip


def html(decision: Decision, figure_png_bytes: bytes) -> str:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
    )
    return env.get_template(TEMPLATE).render(
        d=decision,
        verdict_lines=verdict_lines(decision),
        costs=cost_rows(decision),
        seconds=seconds,
        greedy_lines=[line for line in _greedy_lines(decision.evidence.arms) + compression_lines(decision) if line],
        chip_rows=chip_map_rows(decision),
        figure_uri="data:image/png;base64," + base64.b64encode(figure_png_bytes).decode("ascii"),
    )


def write_report(decision: Decision, out: str | Path) -> dict:
    """Write decision.json (``Decision.to_json``), report.md (figure beside it), report.html (figure embedded);
    returns the paths."""
    out = Path(out)
    record = json.loads(json.dumps(decision.to_json(), default=str))  # paths as text, int keys as JSON's
    png = figure_png(decision)
    paths = {
        "json": atomic_write_text(out / "decision.json", json.dumps(record, indent=2, sort_keys=True)),
        "figure": atomic_write_bytes(out / FIGURE, png),
        "md": atomic_write_text(out / "report.md", markdown(decision, FIGURE)),
        "html": atomic_write_text(out / "report.html", html(decision, png)),
    }
    return {k: str(v) for k, v in paths.items()}
