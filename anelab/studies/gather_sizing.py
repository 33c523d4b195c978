"""Study 3's back-end: would gathering the selected keys beat the dense graph? It composes the sizing
(``core.gather_size``), the probe graphs (``sidecar.graphs.probe_graphs``) and their runs
(``runtimes.coreml.gather_probe``) under one name for notebook 03; the product commands import those homes directly."""

from __future__ import annotations

from anelab.core.gather_size import (  # noqa: F401 (notebook 03's names)
    GatherSizing,
    crossover_budget,
    crossover_total,
    positive_int,
    size,
    sizing_table,
)
from anelab.runtimes.coreml.gather_probe import (  # noqa: F401 (notebook 03's names)
    ProbeResult,
    measure_probes_on_runtime,
    probe,
    probe_record,
    probe_table,
    run_probe,
    save_probe,
)
from anelab.sidecar.graphs.probe_graphs import (  # noqa: F401 (notebook 03's names)
    FULL_SCORES,
    GATHER,
    INDEX_LIMITS,
    PROBE_GRAPHS,
    RECORDED_PROBE_NAMES,
    ProbeInputs,
    ProbeShape,
    build_full_scores_probe_program,
    build_gather_probe_program,
    check_index_range,
    index_narrowing,
    probe_graph_name,
    probe_inputs,
    selected_attention,
)
