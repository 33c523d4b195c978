"""Progress bars: ``tqdm.auto``, silent when a notebook is executed headless.

Every long loop in anelab shows a ``tqdm`` bar: text on a terminal, a widget bar in JupyterLab.
Under papermill (``anelab reproduce``, ``anelab run``, ``anelab batch``) the runner sets
``HEADLESS_VARIABLE`` in the kernel's environment and every bar is disabled: a text bar would
leave a block of stderr lines in the executed notebook, a widget bar an empty gap in its HTML
(``tqdm.notebook`` ignores ``TQDM_DISABLE``, so the switch is made here, once).
"""

from __future__ import annotations

import os

from tqdm.auto import tqdm as _auto_tqdm

HEADLESS_VARIABLE = "ANELAB_HEADLESS"  # "1" in the kernel's environment when papermill runs a notebook


def headless() -> bool:
    """True inside a kernel that papermill runs for anelab (``HEADLESS_VARIABLE`` is "1")."""
    return os.environ.get(HEADLESS_VARIABLE) == "1"


class tqdm(_auto_tqdm):  # noqa: N801 — a drop-in for tqdm.auto.tqdm
    """``tqdm.auto.tqdm``, disabled when ``headless()``."""

    def __init__(self, *args, **kwargs):
        if headless():
            kwargs["disable"] = True
        super().__init__(*args, **kwargs)
