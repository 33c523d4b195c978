"""The words a reader trusts most — captions, alt text, notebook titles — checked against what they describe.

Each check runs on the committed figures (their MANIFEST entries carry the facts each figure recorded from
the data it drew) and on a wrong text, which it must reject.
"""

from __future__ import annotations

import re

import pytest

from anelab.paths import FIGURES_DIR
from anelab.studies import figures
from anelab.studies.notebooks import discover_notebooks, read_notebook

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

# Figures whose caption or alt text still states numbers no claim covers (issue 24's remainder): each
# needs `facts=` in its notebook cell and a [name.claims] table. The test fails when one of these gets
# its claims (remove it here) and when any other figure states an unclaimed number.
NOT_YET_CLAIMED = {
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


# Claims added to captions.toml whose facts the committed figures predate: until `anelab reproduce`
# redraws them, the only problem allowed is "which the figure does not record"; a wrong value is caught
# before and after.
def test_every_number_a_caption_states_is_a_claim():
    loose = {name: figures.unclaimed_statements(entry) for name, entry in figures.caption_table().items()}
    assert {name for name, numbers in loose.items() if numbers} == NOT_YET_CLAIMED
    assert len(loose) - len(NOT_YET_CLAIMED) >= 17


def test_an_unclaimed_number_is_caught():
    """Negative controls: a threshold and a count outside every claim phrase; names are not numbers."""
    entry = {"caption": "All 12 bars lie below the 1 % threshold.", "alt": "Bars of fp16 error for Qwen 3.8 at h0."}
    assert figures.unclaimed_statements(entry) == ["12", "1", "threshold"]
    claimed = {**entry, "claims": {"All 12 bars lie below the 1 % threshold": {"bars": 12}}}
    assert figures.unclaimed_statements(claimed) == []
    # the 5.6x of setup_load_vs_arena's caption, and the old alt of tiled_stateful_errors without its claims
    assert figures.unclaimed_statements({"caption": "3x the arena costs 5.6x the load", "alt": ""}) == []
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
