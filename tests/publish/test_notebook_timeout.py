"""papermill takes its per-cell timeout in whole seconds; a timeout sized from a previous run is a float."""

from __future__ import annotations

import papermill

from anelab.core.paths import REPO_ROOT
from anelab.publish import notebooks


def test_a_sized_float_timeout_reaches_papermill_as_whole_seconds(tmp_path, monkeypatch):
    seen = {}

    def execute(src, dst, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")  # nothing is executed

    monkeypatch.setattr(papermill, "execute_notebook", execute)
    run = notebooks.run_notebook(
        REPO_ROOT / "notebooks" / "03_gather_sizing.ipynb", quick=True, build=tmp_path, timeout=507.36, html=False
    )
    assert seen["execution_timeout"] == 508 and isinstance(seen["execution_timeout"], int)
    assert not run.ok  # the stand-in refused to run, and the run says so
