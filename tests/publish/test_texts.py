"""The words a reader trusts most — captions, alt text, notebook titles — checked against what they describe.

Each check runs on the committed figures (their MANIFEST entries carry the facts each figure recorded from
the data it drew) and on a wrong text, which it must reject.
"""

from __future__ import annotations

import re

import pytest

from anelab.core.paths import FIGURES_DIR
from anelab.publish import figures
from anelab.publish.notebooks import discover_notebooks, read_notebook

OLD_ARMS_ALT = (
    "Two panels against kept blocks: logits difference in percent, and greedy agreement in percent for the "
    "whole model and for the proxy."
)  # the alt text of the one-scatter figure this issue replaced


def _committed() -> dict:
    return figures.read_manifest(FIGURES_DIR)["figures"]


def test_every_committed_caption_and_alt_text_matches_its_figure():
    manifest = _committed()
    assert all("panels" in e.get("facts", {}) for e in manifest.values())
    assert [p for name, entry in manifest.items() for p in figures.text_problems(name, entry)] == []
    claimed = {name for name, entry in manifest.items() if entry.get("claims")}
    assert {"arms_logits_vs_greedy", "setup_load_vs_arena", "tiled_stateful_errors"} <= claimed


def test_a_text_naming_the_wrong_number_of_panels_is_caught():
    """Negative control: the old alt text of arms_logits_vs_greedy described two panels of a one-panel scatter."""
    entry = {"caption": "c", "alt": OLD_ARMS_ALT, "facts": {"panels": 1}}
    assert figures.text_problems("arms_logits_vs_greedy", entry) == [
        "arms_logits_vs_greedy: alt names 2 panels; the figure has 1"
    ]
    sides = {"caption": "Left: a. Right: b.", "alt": "a", "facts": {"panels": 3}}
    assert figures.text_problems("x", sides) == ["x: caption names 2 panels; the figure has 3"]


def test_a_claim_the_data_contradicts_is_caught():
    """Negative control: the old tiled_stateful_errors alt text said every bar stood below the 1 % line."""
    entry = _committed()["tiled_stateful_errors"]
    wrong = {
        **entry,
        "alt": "Paired bars on a log scale per design and weight mode, all below a dashed 1 percent line.",
        "claims": {"all below a dashed 1 percent line": {"graph_above_threshold": 0, "weights_above_threshold": 0}},
    }
    above = entry["facts"]["weights_above_threshold"]
    assert above >= 9
    assert figures.text_problems("tiled_stateful_errors", wrong) == [
        f"tiled_stateful_errors: 'all below a dashed 1 percent line' says weights_above_threshold = 0; "
        f"the figure shows {above}"
    ]


def test_a_claim_missing_from_the_text_or_the_figure_is_caught():
    entry = _committed()["setup_load_vs_arena"]
    dropped = {**entry, "alt": entry["alt"].replace("Three recorded points", "Some points")}
    assert figures.text_problems("setup_load_vs_arena", dropped) == [
        "setup_load_vs_arena: claim 'Three recorded points' is in neither the caption nor the alt text"
    ]
    unrecorded = {**entry, "facts": {k: v for k, v in entry["facts"].items() if k != "refused_gb"}}
    assert figures.text_problems("setup_load_vs_arena", unrecorded) == [
        "setup_load_vs_arena: claim 'from 3.2 GB' rests on 'refused_gb', which the figure does not record",
        "setup_load_vs_arena: claim 'the 3.2 GB h12288 variant is refused' rests on 'refused_gb', which the figure "
        "does not record",
    ]
    moved = {**entry, "facts": {**entry["facts"], "y_axis_from_seconds": -12.0}}  # the old linear fit's axis
    assert figures.text_problems("setup_load_vs_arena", moved) == [
        "setup_load_vs_arena: 'start at 0 seconds' says y_axis_from_seconds = 0.0; the figure shows -12.0"
    ]


@pytest.mark.parametrize(
    ("text", "panels"),
    [
        ("Two panels of bars", 2),
        ("Three panels of a rising curve", 3),
        ("Two bar panels per chunk", 2),
        ("Left: a curve. Right: bars.", 2),
        ("Top: logits. Bottom: agreement.", 2),
        ("Grouped bars on a log scale", None),
        ("the left end of the line", None),
    ],
)
def test_stated_panels(text, panels):
    assert figures.stated_panels(text) == panels


# ---- notebook titles -------------------------------------------------------------------------------


def title_problem(file_name: str, first_line: str) -> str | None:
    """``NN_name.ipynb`` must open with ``# Study N — ...`` (N = int(NN)); the problem, or None."""
    number = int(file_name.split("_", 1)[0])
    match = re.match(r"# Study (\d+) — \S", first_line)
    if match is None:
        return f"{file_name}: first line {first_line!r} is not '# Study {number} — <title>'"
    if int(match.group(1)) != number:
        return f"{file_name}: titled Study {match.group(1)}, but the file is study {number}"
    return None


def test_every_notebook_title_matches_its_file_name():
    paths = discover_notebooks()
    assert len(paths) >= 7
    firsts = {p.name: "".join(read_notebook(p)["cells"][0]["source"]).splitlines()[0] for p in paths}
    assert [title_problem(name, line) for name, line in firsts.items() if title_problem(name, line)] == []


def test_a_notebook_titled_with_another_study_number_is_caught():
    """Negative control: 01_dense_offload.ipynb was titled "Study 3", like 03."""
    assert title_problem("01_dense_offload.ipynb", "# Study 3 — Offloading dense attention") == (
        "01_dense_offload.ipynb: titled Study 3, but the file is study 1"
    )
    assert title_problem("01_dense_offload.ipynb", "Offloading dense attention") is not None


# ---- every stated number is a claim -----------------------------------------------------------------


def test_every_number_a_caption_states_is_a_claim():
    """Every number (and "threshold") in every caption and alt text lies inside a claim phrase, whose facts the
    figure records: run parameters (chunk, prompt tokens, band widths) echoed by the cell that draws it, and
    results (counts, which bars pass) computed from the data it draws."""
    loose = {name: figures.unclaimed_statements(entry) for name, entry in figures.caption_table().items()}
    assert {name: numbers for name, numbers in loose.items() if numbers} == {}
    assert len(loose) >= 30  # every figure's texts were read
    claimed = {name for name, entry in figures.caption_table().items() if entry.get("claims")}
    assert len(claimed) >= 18  # the 5 claimed first, and the 13 whose run parameters and results became facts


def test_an_unclaimed_number_is_caught():
    """Negative controls: a threshold and a count outside every claim phrase; names are not numbers."""
    entry = {"caption": "All 12 bars lie below the 1 % threshold.", "alt": "Bars of fp16 error for Qwen 3.8 at h0."}
    assert figures.unclaimed_statements(entry) == ["12", "1", "threshold"]
    claimed = {**entry, "claims": {"All 12 bars lie below the 1 % threshold": {"bars": 12}}}
    assert figures.unclaimed_statements(claimed) == []
    # the 5.6x of setup_load_vs_arena's caption, and the old alt of tiled_stateful_errors without its claims
    assert figures.unclaimed_statements({"caption": "3x the arena costs 5.6x the load", "alt": ""}) == []
    assert figures.unclaimed_statements({"caption": "Gemma 3 270M slides on 3 layers", "alt": ""}) == ["3"]  # a name
    old = figures.caption_table()["tiled_stateful_errors"] | {"claims": {}}
    assert "12" in figures.unclaimed_statements(old)


def test_every_claim_of_the_table_holds_on_the_committed_figures():
    manifest = _committed()
    problems = {}
    for name, declared in figures.caption_table().items():
        if name not in manifest or not declared.get("claims"):
            continue
        found = figures.text_problems(name, {**manifest[name], **figures.caption_for(name)})
        problems[name] = found
    assert problems and all(found == [] for found in problems.values()), problems
    claimed = {name for name, entry in figures.caption_table().items() if entry.get("claims")}
    assert claimed >= {"mask_fold_checks", "one_function_tile_error", "arms_logits_vs_greedy", "tiled_stateful_errors"}


def test_a_claim_added_before_reproduce_still_fails_on_a_wrong_value():
    """Negative control: a claim awaiting its facts is still compared once a fact is recorded."""
    entry = {**_committed()["tiled_stateful_errors"], **figures.caption_for("tiled_stateful_errors")}
    entry["facts"] = {**entry["facts"], "weights_above_threshold": 3}
    assert figures.text_problems("tiled_stateful_errors", entry) == [
        "tiled_stateful_errors: 'though above 1 %' says weights_above_threshold = 9; the figure shows 3"
    ]


# ---- every claim catches a wrong value --------------------------------------------------------------


def _wrong(value):
    """A value of the same kind as ``value`` that differs from it (the fact a broken figure would record)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + " (another)"
    if isinstance(value, list):
        return value + value[-1:] if value else [0]
    if isinstance(value, dict):
        return {key: _wrong(item) for key, item in value.items()}
    return 0  # None: a figure that drew nothing


CLAIMED_FACTS = sorted(
    (name, phrase, key)
    for name, entry in figures.caption_table().items()
    if name in _committed()  # a figure added since the last publish gets its controls once it is drawn (as above)
    for phrase, facts in entry.get("claims", {}).items()
    for key in facts
)


def test_every_figure_with_a_stated_number_has_a_claim_to_break():
    assert {name for name, _, _ in CLAIMED_FACTS} >= {
        "dense_offload_matrix",
        "dense_offload_share",
        "dense_offload_prompt_length",
        "dense_offload_narrow_sidecar",
        "dense_offload_predicted_vs_recorded",
        "mask_fold_budget_sweep",
        "mask_fold_greedy_vs_raw",
        "gather_sizing",
        "gather_probe_m3_recorded",
        "setup_package_composition",
        "tiled_stateful_arena_arithmetic",
        "arms_per_layer_difference",
        "one_function_prediction",
    }


@pytest.mark.parametrize(("name", "phrase", "key"), CLAIMED_FACTS)
def test_a_wrong_fact_under_a_claim_is_caught(name, phrase, key):
    """Negative control for every claim: the committed figure's fact replaced by a wrong value of its kind."""
    entry = {**_committed()[name], **figures.caption_for(name)}
    recorded = entry["facts"][key]
    assert _wrong(recorded) != recorded
    broken = {**entry, "facts": {**entry["facts"], key: _wrong(recorded)}}
    stated = entry["claims"][phrase][key]
    assert f"{name}: {phrase!r} says {key} = {stated!r}; the figure shows {_wrong(recorded)!r}" in (
        figures.text_problems(name, broken)
    )


@pytest.mark.parametrize("value", [True, 3, 0.01, "gather chunk 64", [1024, 4095], {"1024": True}, [], None])
def test_a_wrong_value_differs_from_the_value(value):
    assert not figures._same(_wrong(value), value)


def test_the_old_budget_sweep_alt_text_is_caught_by_the_data():
    """Negative control: mask_fold_budget_sweep's alt text said the points lay above the threshold; 4 of 20 do not."""
    entry = _committed()["mask_fold_budget_sweep"]
    old = {
        **entry,
        "alt": "Log-log lines of relative change, package circles and reference crosses coinciding, above a dashed threshold.",
        "claims": {"above a dashed threshold": {"points_above_threshold": entry["facts"]["points"]}},
    }
    assert figures.text_problems("mask_fold_budget_sweep", old) == [
        f"mask_fold_budget_sweep: 'above a dashed threshold' says points_above_threshold = {entry['facts']['points']}; "
        f"the figure shows {entry['facts']['points_above_threshold']}"
    ]
    assert figures.unclaimed_statements({**old, "claims": {}}) == ["threshold"]


@pytest.mark.parametrize(
    ("stated", "shown", "same"),
    [
        ([1e-4, 1e-3], [0.00010000000000000002, 0.001], True),  # 10.0 ** -4 as a figure computes it
        ([1.3, 20], [1.3, 21], False),
        ({"1024": True, "4096": False}, {"1024": True, "4096": False}, True),
        ({"1024": True, "4096": False}, {"1024": True}, False),
        (True, 1, False),  # a count is not a yes/no
        (0.01, 0.0100000001, True),
    ],
)
def test_claimed_and_recorded_facts_compare_inside_lists_and_tables(stated, shown, same):
    assert figures._same(stated, shown) is same
