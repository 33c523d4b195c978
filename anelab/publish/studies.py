"""The one table of the studies: each notebook with its back-end, what runs here and what needs a Mac, its
headline numbers, the figure a batch draws across a grid, and its figures.

``doctor``, the batch summary, ``reproduce`` and the docs gallery read it; ``tests/commands/test_front_door.py`` fails
on a notebook without a row, ``tests/publish/test_figures.py`` on a captioned figure no study claims.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.paths import NOTEBOOK_DIR
from anelab.core.records import read_records
from anelab.publish.headlines import (
    Headline,
    ane_over_gpu_at_largest_history,
    cold_setup_seconds,
    largest_intermediate,
    package_rows,
    probe_ratio,
    program_bytes_per_function,
    widest,
    worst_graph_error,
)
from anelab.sidecar.designs import DENSE, STATEFUL, TILED


@dataclass(frozen=True)
class Study:
    """One study notebook ``notebooks/<stem>.ipynb`` and its back-end ``anelab.studies.<name>``."""

    stem: str  # e.g. "01_dense_offload"
    question: str
    runs_here: str  # the part that runs on any machine
    needs_mac: str | None  # the part that needs the Core ML runtime (replayed elsewhere); None: nothing does
    figures: tuple[str, ...]  # figure names (captions in captions.toml)
    headlines: tuple[Headline, ...] = ()
    summary_plot: tuple[str, str] | None = None  # (grid parameter on x, headline on y) of a batch's figure
    # the default run's seconds in ``reproduce`` (2 cores, beside another study; measured here 2026-12-07): orders a
    # fresh checkout's notebooks longest first, as a previous run's durations order a later one (``longest_first``)
    typical_seconds: float | None = None

    @property
    def name(self) -> str:
        return self.stem.split("_", 1)[1]

    @property
    def notebook(self) -> str:
        return f"notebooks/{self.stem}.ipynb"

    @property
    def backend(self) -> str:
        return f"anelab.studies.{self.name}"

    @property
    def path(self) -> Path:
        return NOTEBOOK_DIR / f"{self.stem}.ipynb"


STUDIES: tuple[Study, ...] = (
    Study(
        "01_dense_offload",
        "why does the ANE win on dense attention, and by how much?",
        "planner sweeps (offload share, prompt length) over the recorded GPU/ANE matrix",
        "attention-block predict per compute-units setting (CPU+GPU vs CPU+Neural Engine)",
        ("dense_offload_matrix", "dense_offload_share", "dense_offload_prompt_length", "dense_offload_narrow_sidecar",
         "dense_offload_predicted_vs_recorded", "dense_offload_backtest", "dense_offload_gpu_runtimes", "dense_offload_chip_verdict_map",
         "dense_offload_attention_ab"),
        (Headline("gpu_over_ane", "GPU / Neural Engine predict time (Core ML's own durations) at the largest history "
                  "(Mac only)", "x",
                  "predict_timing", ane_over_gpu_at_largest_history),),
        typical_seconds=8,
    ),
    Study(
        "02_mask_fold",
        "does the saved graph compute a sparse indexer's selection folded into the mask, and would a wrong mask "
        "be caught?",
        "everything: saved graph vs fp64 reference under folded, causal and swept masks, vacuity guard, greedy vs raw",
        None,
        ("mask_fold_checks", "mask_fold_budget_sweep", "mask_fold_greedy_vs_raw", "mask_fold_real_text"),
        (
            Headline("fold_error", "fold error: saved graph vs fp64 reference, widest chunk", "relative", "mask_fold",
                     lambda rs: (w := widest(rs)) and w["check"]["fold_error"]),
            Headline("causal_off", "causal-only mask against the same reference", "relative", "mask_fold",
                     lambda rs: (w := widest(rs)) and w["check"]["causal_off"]),
            Headline("causal_off_over_noise", "causal-off x the fp16 noise floor", "x", "mask_fold",
                     lambda rs: (w := widest(rs)) and w["check"]["noise_ratio"]),
            Headline("control_error", "negative control (random selection) error", "relative", "mask_fold",
                     lambda rs: (w := widest(rs)) and w["control"]["fold_error"]),
        ),
        ("compress_ratio", "fold_error"),
        typical_seconds=29,
    ),
    Study(
        "03_gather_sizing",
        "would gathering the selected keys beat the dense graph?",
        "dense vs gather sizing, probe graphs built, saved and evaluated from disk",
        "probe load/predict timing and ANE operation counts",
        ("gather_sizing", "gather_probe_programs", "gather_probe_m3_recorded"),
        (
            Headline("gather_over_dense_intermediate", "gather / dense largest intermediate, first probe chunk", "x",
                     "gather_probe_numpy", probe_ratio("largest_intermediate_bytes")),
            Headline("gather_over_dense_numpy_s", "gather / dense NumPy evaluation time (CPU, not the ANE)", "x",
                     "gather_probe_numpy", probe_ratio("numpy_eval_median_s")),
        ),
        ("head_dim", "gather_over_dense_intermediate"),
        typical_seconds=7,
    ),
    Study(
        "04_setup_cost",
        "when does per-variant setup eat the win?",
        "fit of recorded load times against score-arena bytes, break-even prompt lengths",
        "cold/warm loads and package compositions through anelab.runtimes.coreml.timing; Core AI's specialization "
        "(cold, cached, per entrypoint count, AOT) beside them on macOS 27",
        ("setup_load_vs_arena", "setup_package_composition", "setup_variants_visited", "setup_vs_saved",
         "setup_break_even", "setup_package_size", "setup_fresh_loads_memory", "setup_coreml_vs_coreai"),
        (
            Headline("setup_seconds", "sum of median cold loads over the functions (Mac only)", "s", "load_timing",
                     cold_setup_seconds),
            Headline("weight_bytes", "weight.bin bytes (stored once)", "B", "package_size",
                     lambda rs: float(package_rows(rs)[-1]["weight_bytes"]) if rs else None),
            Headline("program_bytes_per_function", "model.mlmodel growth per added function", "B", "package_size",
                     program_bytes_per_function),
        ),
        ("export_chunk", "program_bytes_per_function"),
        typical_seconds=12,
    ),
    Study(
        "05_tiled_stateful",
        "tiled vs stateful vs per-history sidecars, chunk size, 4/8-bit weights",
        "tiled and stateful graphs verified from disk, largest intermediates, quantization error",
        "load and predict per chunk size and compute-units setting",
        ("tiled_stateful_functions_setup", "tiled_stateful_arena_arithmetic", "tiled_stateful_largest_intermediate",
         "tiled_stateful_errors", "tiled_stateful_numpy_time", "tiled_stateful_mac_timing"),
        (
            Headline("largest_intermediate_dense", "largest intermediate, dense design", "B", "design_comparison",
                     largest_intermediate(DENSE)),
            Headline("largest_intermediate_tiled", "largest intermediate, tiled design", "B", "design_comparison",
                     largest_intermediate(TILED)),
            Headline("largest_intermediate_stateful", "largest intermediate, stateful design", "B",
                     "design_comparison", largest_intermediate(STATEFUL)),
            Headline("worst_graph_error", "worst graph error over designs and weight modes", "relative",
                     "design_comparison", worst_graph_error),
        ),
        ("export_chunk", "largest_intermediate_dense"),
        typical_seconds=113,
    ),
    Study(
        "06_one_function",
        "does one stateful, tiled function per layer re-open the lost Qwen 3.8 case?",
        "planner per design, saved packages' op counts and intermediates, verification, NumPy prefill",
        "cold loads and predictions (through the state) of c<C> against h<H>",
        ("one_function_prediction", "one_function_intermediate", "one_function_tile_error"),
        typical_seconds=36,
    ),
    Study(
        "07_whole_model_arms",
        "does the whole model still say the same thing with every attention layer on its sidecar, and which "
        "check would notice a wrong mask?",
        "the whole dense model on its sidecars: chunked prefill, greedy decode, per-layer and logits differences",
        "Core ML numerics of the same arms (anelab compare-arms --compute-units)",
        ("arms_per_layer_difference", "arms_logits_vs_greedy", "arms_real_text", "arms_verify_margin",
         "arms_real_windowed"),
        typical_seconds=118,
    ),
    Study(
        "08_offload_split",
        "which blocks of prefill belong on the ANE: attention, the MLPs, a hybrid's projections, or none?",
        "the planner's offload split per model, chip and prompt length; the published oMLX / mlx-serve splits replayed",
        "each proposed split timed against the GPU prefill (anelab ab --split planned; anelab measure's split_ab)",
        ("offload_split_share", "offload_split_ratio", "offload_split_published"),
        typical_seconds=6,
    ),
)  # fmt: skip


def get_study(key: str) -> Study:
    """The study named by its notebook stem (``02_mask_fold``), name (``mask_fold``) or file name."""
    key = Path(key).stem if str(key).endswith(".ipynb") else str(key)
    for s in STUDIES:
        if key in (s.stem, s.name):
            return s
    raise AnelabInputError(f"no study {key!r}; studies: {', '.join(s.stem for s in STUDIES)}")


def notebooks_without_a_row(notebook_names: list[str]) -> list[str]:
    """The notebooks (file names) that ``STUDIES`` does not list: each is a study the tools would forget."""
    listed = {f"{s.stem}.ipynb" for s in STUDIES}
    return [name for name in notebook_names if name not in listed]


def study_notebooks() -> list[Path]:
    """Every study's notebook, in table order (what ``reproduce`` runs)."""
    return [s.path for s in STUDIES]


def study_of_figure(figure: str) -> Study | None:
    """The study that draws ``figure`` (None: no study claims it)."""
    return next((s for s in STUDIES if figure in s.figures), None)


# ---- headlines ------------------------------------------------------------------------------------------------
def headlines_for(stem: str) -> tuple[Headline, ...]:
    """The declared headlines of a study (by notebook stem); none for a stem no study has."""
    return next((s.headlines for s in STUDIES if s.stem == stem), ())


def headline_values(stem: str, records: list[dict]) -> dict[str, float | None]:
    """{headline name: value} from a run's records (all kinds; each headline picks its own)."""
    out = {}
    for h in headlines_for(stem):
        value = h.value([r for r in records if r["kind"] == h.kind])
        out[h.name] = None if value is None else float(value)
    return out


def run_headlines(stem: str, run_dir: str | os.PathLike) -> dict[str, float | None]:
    """Headline values of one run directory (from ``<run>/records``)."""
    records_dir = Path(run_dir) / "records"
    records = read_records(records_dir) if records_dir.is_dir() else []
    return headline_values(stem, records)


def summary_plot(stem: str) -> tuple[str, str] | None:
    """(grid parameter, headline) of the one figure a batch draws across its grid for this study, or None."""
    return next((s.summary_plot for s in STUDIES if s.stem == stem), None)
