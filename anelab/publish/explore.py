"""The notebooks' interactive explorers: controls beside a formatted text of the same numbers.

A study notebook ends with an "explore" cell: a few controls (sliders, drop-downs) and the numbers
they select, as text. One helper, ``explore``, serves every such cell in two modes:

- live (JupyterLab with a kernel): the controls and one ``HTML`` widget holding the text, redrawn
  in place whenever a control moves — nothing is printed, so no stale copy stays behind;
- headless (a papermill run: ``anelab reproduce``, ``anelab run``, ``anelab batch``; the runner
  sets ``anelab.core.progress.HEADLESS_VARIABLE`` in the kernel's environment): the text is printed once as plain
  output — readable in the executed notebook and its HTML without a kernel or a widget manager —
  and the controls are displayed beside it, disabled, at the values the text describes.

Neither mode uses ``interact`` or an ``Output`` widget, whose capture of a cell's output can wait
forever for a front end that a headless run does not have (nteract/papermill#723,
jupyter/nbclient#312): a value change only sends a message, it never waits for one.

Each study's explorer (``plan_explorer``, ``budget_explorer``, ``design_explorer``) names its
controls and its text here, so the notebook cell is one call and the tests can check the controls
(they reach the seeds' values, their labels are not cut) without running a notebook.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass

from anelab import planner
from anelab.core.errors import AnelabInputError
from anelab.core.progress import headless
from anelab.planner.design_plans import compare_designs
from anelab.sidecar.designs import STATEFUL_TILED
from anelab.studies import mask_fold

LABEL_STYLE = {"description_width": "initial"}  # the whole description, never cut to "prompt_to…"


HEADLESS_NOTE = "Controls shown at the values above; they move in JupyterLab with the anelab kernel (make lab)."


@dataclass
class Explorer:
    """A text function and its controls: ``describe(**{name: control.value})`` is the text."""

    describe: Callable[..., str]
    controls: dict  # name -> ipywidgets ValueWidget

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def text(self) -> str:
        return self.describe(**self.values())


def _pre(text: str) -> str:
    return f"<pre style='margin: 0.4em 0'>{html.escape(text)}</pre>"


def explorer_box(explorer: Explorer, *, live: bool):
    """The widgets of ``explorer``: live, its controls and an ``HTML`` widget holding the text,
    redrawn whenever a control's value changes; not live, the controls disabled and a note."""
    import ipywidgets as widgets

    controls = list(explorer.controls.values())
    if not live:
        for control in controls:
            control.disabled = True
        return widgets.VBox([*controls, widgets.HTML(f"<small>{html.escape(HEADLESS_NOTE)}</small>")])
    text = widgets.HTML(_pre(explorer.text()))

    def redraw(_change=None):
        text.value = _pre(explorer.text())

    for control in controls:
        control.observe(redraw, names="value")
    return widgets.VBox([*controls, text])


def show(explorer: Explorer, *, live: bool | None = None) -> None:
    """Display ``explorer`` once: live (JupyterLab), the controls and the text redrawn in place;
    headless (the default under papermill), the text printed and the disabled controls beside it."""
    from IPython.display import display

    live = (not headless()) if live is None else live
    if not live:
        print(explorer.text())
    display(explorer_box(explorer, live=live))


def int_slider(description: str, value: int, low: int, high: int, step: int = 1):
    """An integer slider that reaches ``value`` ((value - low) is a multiple of step), its whole
    label shown, its read-out editable (type an exact number), redrawn when released."""
    import ipywidgets as widgets

    return widgets.IntSlider(
        value=value, min=low, max=high, step=step, description=description, style=LABEL_STYLE,
        continuous_update=False, layout=widgets.Layout(width="34em"),
    )  # fmt: skip


def choice(description: str, options: list, value, *, slider: bool = False):
    """A drop-down (or a selection slider) over ``options`` with ``value`` among them."""
    import ipywidgets as widgets

    options = sorted({*options, value}) if all(isinstance(o, int | float) for o in [*options, value]) else options
    kind = widgets.SelectionSlider if slider else widgets.Dropdown
    extra = {"continuous_update": False} if slider else {}
    return kind(options=options, value=value, description=description, style=LABEL_STYLE, **extra)


# ---- the studies' explorers ------------------------------------------------------------------------


def plan_explorer(family: str) -> Explorer:
    """Notebook 01: the planner's decision for a family, prompt length and chunk (the seed's
    4,333-token prompt and 4,096-token chunk to start)."""

    def describe(family: str, prompt_tokens: int, chunk: int) -> str:
        result = planner.plan(prompt_tokens, family=family, chunk=chunk, allow_past_coverage=True)
        return planner.format_plan(result.to_dict())

    return Explorer(
        describe,
        {
            "family": choice("planner family", list(planner.FAMILIES), family),
            "prompt_tokens": int_slider("prompt tokens", planner.REFERENCE_TOKENS, 256, 32768),
            "chunk": choice("chunk (tokens)", [512, 1024, 2048, 4096], planner.REFERENCE_CHUNK),
        },
    )


def format_budget_point(point) -> str:
    """One ``mask_fold.BudgetPoint`` as the lines a reader compares (no dataclass repr)."""
    return "\n".join(
        [
            f"kept blocks {point.kept_blocks} x {point.compress_ratio} keys: budget {point.budget:,} keys, "
            f"{point.mean_kept_keys:.1f} kept per row on average",
            f"attn_out moved from the widest budget: package {point.package_moved:.2%}, "
            f"reference {point.reference_moved:.2%}",
            f"fold error (package vs reference, same mask): {point.fold_error:.2e}",
            f"greedy token agreement with the widest budget: {point.greedy_agreement:.0%}",
        ]
    )


def budget_explorer(case, compress_ratio: int, kept_blocks: int) -> Explorer:
    """Notebook 02: how far one indexer budget moves the saved package's output."""

    widest = mask_fold.widest_kept_blocks(case, compress_ratio)

    def describe(kept_blocks: int) -> str:
        return format_budget_point(mask_fold.budget_point(case, kept_blocks, compress_ratio))

    return Explorer(describe, {"kept_blocks": int_slider("kept blocks", min(kept_blocks, widest), 1, widest)})


def design_explorer(prompt_tokens: int, family: str, key_tile: int = 1024, query_tile: int = 256) -> Explorer:
    """Notebook 06: the stateful, tiled design's arena, ops and predicted ratio per chunk and tiles."""

    def describe(chunk: int, key_tile: int, query_tile: int) -> str:
        try:
            [d] = compare_designs(
                prompt_tokens, family, chunk, (STATEFUL_TILED,), key_tile=key_tile, query_tile=min(query_tile, chunk)
            )
        except AnelabInputError as e:  # a tile this chunk cannot take: say which
            return f"C={chunk}, tiles {key_tile} x {query_tile}: {e}"
        return (
            f"C={chunk}, tiles {d.key_tile} x {d.query_tile}: arena {d.per_call_arena_bytes / 1e6:.1f} MB, "
            f"{d.ops_per_function} ops, wasted {d.wasted_fraction:.0%}, predicted {d.predicted_ratio:.2f}x "
            f"({d.decision}); break-even load {d.break_even_load_seconds:.1f} s"
        )

    return Explorer(
        describe,
        {
            "chunk": choice("chunk C", [256, 512, 1024, 2048, 4096], 1024, slider=True),
            "key_tile": choice("key tile", [256, 512, 1024, 2048], key_tile, slider=True),
            "query_tile": choice("query tile", [64, 128, 256, 512], query_tile, slider=True),
        },
    )
