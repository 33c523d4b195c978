"""The planner's text reports: the catalogue, the fit against the records, one plan."""

from __future__ import annotations

from anelab.planner.gpu_runtimes import gpu_runtime_phrase
from anelab.planner.verdict import thresholds_sentence


def format_family_table(rows: list[dict]) -> str:
    """The catalogue (``family_table()``) as text: each family's geometry facts with their status."""
    out = []
    for f in rows:
        g, facts = f["geometry"], f["facts"]

        def fact(key, value):
            return f"{value if value is not None else '?'} ({facts[key]['status']})"

        cap = (
            "unknown" if f["max_history"] is None else f"{f['max_history']} (coverage {f['coverage_cap']:,}, recorded)"
        )
        out.append(f"{f['name']:<26} {f['label']}")
        out.append(
            f"  layers {fact('num_layers', g['num_layers'])}; full-attention "
            f"{fact('full_attention_layers', len(g['full_attention_layers']))} at {','.join(map(str, g['full_attention_layers']))}"
        )
        out.append(
            f"  heads {fact('num_heads', g['num_heads'])}; kv heads {fact('num_kv_heads', g['num_kv_heads'])}; "
            f"head_dim {fact('head_dim', g['head_dim'])}; sparse budget "
            f"{fact('sparse_budget', g['sparse_budget'] or 'none (every key)')}; max history {cap}"
        )
        out.append(f"  records: {', '.join(f['records'])}")
        out.append(f"  unknown: {'; '.join(f['unknown'])}")
    return "\n".join(out)


def format_fit_report(rows: list[dict], fit: dict, loads: list[dict]) -> str:
    """Predicted vs recorded ratios, the fitted rates and the load law as text."""
    out = []
    out.append(
        f"{'family':<26} {'record':<27} {'tokens':>6} {'chunk':>5} {'recorded':>8} "
        f"{'in-sample':>9} {'err':>6} {'LOO':>6} {'err':>6} {'plan':>6} {'err':>6}"
    )
    for r in rows:
        out.append(
            f"{r['family']:<26} {r['record']:<27} {r['prompt_tokens']:>6} {r['chunk']:>5} {r['recorded_ratio']:>7.2f}x "
            f"{r['in_sample_ratio']:>8.2f}x {r['in_sample_error']:>+6.1%} {r['leave_one_out_ratio']:>5.2f}x "
            f"{r['leave_one_out_error']:>+6.1%} {r['plan_ratio']:>5.2f}x {r['plan_error']:>+6.1%}"
        )
    out.append(
        f"rates: ANE {fit['ane_seconds_per_entry']:.3g} s/entry (recorded h0), dense GPU "
        f"{fit['gpu_dense_seconds_per_entry']:.3g}, sparse GPU {fit['gpu_sparse_seconds_per_entry']:.3g} s/entry (fitted); "
        f"every ANE arm holds its reloads ({fit['reload_seconds_per_gb']:.3g} s per GB of score arena), Qwen 3.8's its "
        "specializations too (protocol 'machine', its arenas exceed the M3's memory)"
    )
    out.append(
        f"cold load = specialization {fit['load_power_coef']:.3g} s x (score arena / GB) ^ {fit['load_power_exp']:.3g} "
        f"+ reload: "
        + ", ".join(
            f"h{x['history']} {x['recorded_seconds']:.1f} s recorded, {x['power_fit_seconds']:.1f} s fit" for x in loads
        )
    )
    return "\n".join(out)


def format_plan(d: dict) -> str:
    """A plan (``PrefillPlan.to_dict()``) as text: schedule, variants, both arms, verdict."""
    out = []
    name = d["family"] or "custom geometry"
    out.append(
        f"{name}: prompt {d['prompt_tokens']:,} tokens, chunk {d['chunk']:,}, histories "
        f"{','.join(map(str, d['histories']))} (coverage {d['coverage']:,}; needed {d['coverage_needed']:,}; "
        f"{'fits' if d['fits'] else 'does not fit'})"
    )
    out.append(f"{'chunk':>5} {'start':>7} {'tokens':>7}  device  function")
    for c in d["chunks"]:
        out.append(
            f"{c['index']:>5} {c['start']:>7,} {c['tokens']:>7,}  {c['device']:<6}  "
            f"{'h' + str(c['history']) if c['device'] == 'ane' else '-'}"
        )
    n_fa = len(d["geometry"]["full_attention_layers"])
    loads = ", ".join(f"h{h} {v['seconds']:.2f} s ({v['source']})" for h, v in d["load_seconds"].items())
    out.append(
        f"variants visited: {d['variants_visited']} ({n_fa} full-attention layers x "
        f"{len(d['load_seconds'])} histories){'; loads ' + loads if loads else ''}"
    )
    out.append(
        f"GPU arm: non-attention {d['non_attention_seconds']:.3g} s + attention {d['gpu_attention_seconds']:.3g} s "
        f"= {d['gpu_prefill_seconds']:.3g} s — {gpu_runtime_phrase(d)}"
    )
    out.append(
        f"ANE arm: {d['ane_prefill_seconds']:.1f} s (setup {d['setup_seconds']:.1f} s, ANE attention "
        f"{d['ane_attention_seconds']:.1f} s, attention saved {d['attention_saved_seconds']:.1f} s)"
    )
    if d.get("variants_visited"):
        pre = d.get("preloaded_ane_prefill_seconds")
        out.append(
            f"loads ({d['protocol_reason']}): specialization {d['specialization_seconds']:.1f} s "
            f"({'in this arm' if d['pays_specialization'] else 'one-time, not in this arm'}), reload "
            f"{d['reload_seconds']:.1f} s ({d['reload_policy']}"
            + (f", {d['hidden_reload_seconds']:.1f} s hidden" if d["hidden_reload_seconds"] else "")
            + ")"
            + (f"; preloaded on a background thread the ANE arm would be {pre:.1f} s" if pre is not None else "")
        )
    out.append(f"predicted ratio {d['predicted_ratio']:.2f}x (GPU / ANE)")
    out.append(f"central-cost decision: {d['decision']} — {d['reason']}")
    out += chip_lines(d) if d.get("chip") else []
    return "\n".join(out)


def format_checkpoint_plan(d: dict) -> str:
    """A checkpoint's plan (``plan_from_checkpoint(...).to_dict()``): the geometry read from its
    config, where the costs came from, one plan per kind of attention layer, and the combined verdict."""
    window = f", {len(d['windowed_layers'])} windowed (W={d['sliding_window']})" if d["windowed_layers"] else ""
    out = [
        f"{d['checkpoint']} ({d['model_type']}): {d['num_layers']} layers, {len(d['full_layers'])} full attention"
        f"{window}; {d['num_heads']} heads, {d['num_kv_heads']} KV heads, head_dim {d['head_dim']}",
        f"costs: {d['cost_family'] or 'flags'} — {d['cost_family_reason']}"
        + f"; the GPU arm is {next(iter(d['parts'].values())).get('gpu_runtime')}'s",
    ]
    for kind, part in d["parts"].items():
        out += [f"--- {kind} layers ---", format_plan(part)]
    out.append(
        f"combined: GPU {d['gpu_prefill_seconds']:.1f} s, ANE {d['ane_prefill_seconds']:.1f} s "
        f"(offloaded: {', '.join(d['offloaded']) or 'none'}); predicted ratio {d['predicted_ratio']:.2f}x; "
        f"central-cost decision: {d['decision']}"
    )
    return "\n".join(out)


def format_designs(rows: dict[str, list[dict]]) -> str:
    """Each family's designs side by side (``compare_designs``): loads, arena, waste, ops, both arms, verdict."""
    out = []
    out.append(
        f"{'family':<24} {'design':<15} {'chunk':>5} {'loads':>5} {'load s':>7} {'arena MB':>9} {'wasted':>6} "
        f"{'ops/fn':>6} {'ANE attn':>8} {'ANE arm':>8} {'GPU arm':>8} {'ratio':>6}  verdict (break-even load/layer)"
    )
    for family, designs in rows.items():
        for d in designs:
            be = d["break_even_load_seconds"]
            out.append(
                f"{family:<24} {d['design']:<15} {d['chunk']:>5} {d['loads']:>5} {d['load_seconds_each']:>7.2f} "
                f"{d['per_call_arena_bytes'] / 1e6:>9.1f} {d['wasted_fraction']:>6.1%} {d['ops_per_function']:>6} "
                f"{d['ane_attention_seconds']:>8.1f} {d['ane_prefill_seconds']:>8.1f} {d['gpu_prefill_seconds']:>8.1f} "
                f"{d['predicted_ratio']:>5.2f}x  {d['decision']}" + (f" ({be:.1f} s)" if be is not None else "")
            )
    first = next(iter(rows.values()))
    for design in first:
        out.append(f"assumptions ({design['design']}): " + "; ".join(design["assumptions"]))
    return "\n".join(out)


def format_verdict(v: dict) -> str:
    """A three-way verdict (``planner.verdict.Verdict.to_dict()``): the decision, both arms with their
    intervals and provenance, the thresholds, every deciding cost's envelope, and what would settle it."""

    gpu, ane = v["gpu_prefill"], v["ane_prefill"]

    def span(c):
        return f"{c['value']:.4g} s [{c['low']:.4g} .. {c['high']:.4g}]"

    out = [
        f"verdict: {v['decision']} — {v['reason']}",
        f"GPU arm {span(gpu)} ({gpu['kind']}); ANE arm {span(ane)} ({ane['kind']}); "
        f"predicted ratio {v['predicted_ratio']:.2f}x (GPU / ANE)",
        f"thresholds: {thresholds_sentence(v)}",
        "envelope: " + "; ".join(f"{name.replace('_', ' ')} {span(c)} {c['kind']}" for name, c in v["costs"].items()),
    ]
    if v.get("energy"):
        out.append(energy_line(v["energy"]) + f"; objective {v['objective']} (on time: {v['time_decision']})")
    out += [f"to settle it: {what}: {command}" for what, command in v["settle"]]
    return "\n".join(out)


def energy_line(e: dict) -> str:
    """Both arms' joules with intervals and the power figures' kinds (``planner.energy``)."""

    def joules(j):
        return f"{j['value']:.4g} J [{j['low']:.4g} .. {j['high']:.4g}]"

    watts = ", ".join(f"{k} {p['watts']:.3g} W ({p['kind']})" for k, p in e["power"].items())
    return f"energy: GPU arm {joules(e['gpu_joules'])}, ANE arm {joules(e['ane_joules'])} ({watts}) -> {e['decision']}"


def chip_lines(d: dict) -> list[str]:
    """A plan's chip, how it was chosen, the ANE arm's carry to it, both arms' joules and the cold start."""
    out = [f"chip: {d['chip']} — {d['chip_choice'] or '--chip'}"]
    if d.get("ane_chip") and d["ane_chip"]["scale"] != 1.0:
        out.append(f"ANE attention on the {d['chip']}: {d['ane_chip']['basis']}")
    if d.get("energy"):
        out.append(energy_line(d["energy"]) + f" (assumes {d['energy']['assumes']})")
        out += [f"  {k} power: {p['note'] or ''} ({p['source']})" for k, p in d["energy"]["power"].items()]
    if d.get("cold_start"):
        out.append(d["cold_start"]["sentence"])
    out.append(f"objective: {d['objective']} (decision on seconds: {d['time_decision']})")
    return out


def offload_split_lines(d: dict) -> list[str]:
    """The best offload split and the runner-up per chip (``planner.offload_split.checkpoint_splits``): each with
    its ratio to all-GPU, its interval and the part that decides it; a chip that cannot be priced says why."""

    def one(s: dict) -> str:
        programs = f"; {s['programs']} ANE program(s) of ~4 GiB" if s["programs"] else ""
        return (f"{s['name']} {s['ratio']:.2f}x [{s['ratio_low']:.2f} .. {s['ratio_high']:.2f}]{programs}")  # fmt: skip

    w = d["window"]
    out = [
        f"--- offload split per chip (prompt {d['prompt_tokens']:,} tokens; ratio = all-GPU / split, predicted) ---",
        f"ANE program window {w['value'] / 2**30:.0f} GiB ({w['source']}); package size limit: {d['package_limit']['kind']}"
        + "".join(f"; {a}" for a in d["absent"]),
    ]
    for c in d["chips"]:
        if c["refused"]:
            out.append(f"{c['chip']}: cannot be priced — {c['refused']}")
            continue
        best, *rest = c["splits"]
        runner = f"; runner-up {one(rest[0])}" if rest else ""
        out.append(f"{c['chip']}: best {one(best)}{runner} — {best['decided_by']}")
    return out
