"""Notebook back-ends: the planner, gather sizing and probe, dense offload, setup cost, the mask-fold
study, the chunk sweep, figures, the notebook runner and ``reproduce``."""
