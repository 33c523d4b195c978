"""The cost planner: predicts the offload win before anything is built.

``catalogue`` (recorded model families, plan geometry), ``fit`` (per-token costs and the load model
fitted on the seeds' records), ``plan`` (one prompt's schedule, setup and verdict), ``envelope`` (each
cost's source and interval), ``verdict`` (ane / gpu / depends with thresholds).
"""

from anelab.planner.catalogue import (
    FAMILIES,
    REFERENCE_CHUNK,
    REFERENCE_TOKENS,
    Family,
    PlanGeometry,
    every_fourth,
    family_attention_geometry,
    family_table,
    get_family,
)
from anelab.planner.fit import CostFit, LoadModel, fit_costs, linear_load_fit, load_fit_report
from anelab.planner.plan import PrefillPlan, plan, predicted_vs_recorded
from anelab.planner.plan_text import (
    format_checkpoint_plan,
    format_designs,
    format_family_table,
    format_fit_report,
    format_plan,
)

__all__ = [
    "FAMILIES",
    "REFERENCE_CHUNK",
    "REFERENCE_TOKENS",
    "CostFit",
    "Family",
    "LoadModel",
    "PlanGeometry",
    "PrefillPlan",
    "every_fourth",
    "family_attention_geometry",
    "family_table",
    "fit_costs",
    "format_checkpoint_plan",
    "format_designs",
    "format_family_table",
    "format_fit_report",
    "format_plan",
    "get_family",
    "linear_load_fit",
    "load_fit_report",
    "plan",
    "predicted_vs_recorded",
]
