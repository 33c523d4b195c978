"""A deterministic figure's bytes do not move with the BLAS kernel (issue 44 item 11).

The same figure — row norms of a float32 attention-shaped product (through OpenBLAS) as bars on a log axis, its
row sums as a line with a band on a linear one, a line, a span and a note placed at computed values — is
computed and saved in two processes, each with OpenBLAS pinned to another core type (``OPENBLAS_CORETYPE``).
The control: the numbers computed differ between the two, and so do the bytes of the figure saved without
rounding (``deterministic=False``); the figure ``save_figure`` rounds (``publish.figure_precision``) is
byte-identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from anelab.publish.figure_precision import AXIS_STEPS, round_to_drawn_precision  # noqa: E402

# two OpenBLAS kernels every x86-64 CPU with AVX2 runs, and whose float32 GEMMs round differently
CORE_TYPES = ("Haswell", "Sandybridge")

DRAW = """
import hashlib, json, sys
import numpy as np
import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot as plt
from anelab.publish import figures

rng = np.random.default_rng(0)
q, k = rng.standard_normal((48, 64)).astype(np.float32), rng.standard_normal((64, 192)).astype(np.float32)
v = rng.standard_normal((192, 64)).astype(np.float32)
got = (q @ k) @ v                           # float32 through OpenBLAS: its kernel picks the last bits
norms, sums = np.linalg.norm(got, axis=1), got.sum(axis=1)
figures.use_style()
out = {"values": [float(x) for x in np.concatenate([norms, sums])]}
for name, deterministic in (("raw", False), ("rounded", True)):  # a figure each: a draw moves the layout's state
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(5, 4))
    top.bar(np.arange(norms.size), norms); top.set_yscale("log")
    bottom.plot(np.arange(sums.size), sums); bottom.fill_between(np.arange(sums.size), sums - 1, sums + 1, alpha=0.3)
    bottom.axhline(sums.mean(), ls="--"); bottom.axvspan(0, float(norms.std()) / 20, alpha=0.1)  # blended
    top.annotate("mean", (1.0, float(norms.mean())), xycoords=("axes fraction", "data"), ha="right")
    entry = figures.save_figure(fig, name, figures_dir=sys.argv[1], notebook="test", parameters={},
                                provenance_note="test", caption="c", alt="a", deterministic=deterministic)
    out[name] = {fmt: f["sha256"] for fmt, f in entry["files"].items()}
print(json.dumps(out))
"""


def _draw(core_type: str, figures_dir) -> dict:
    env = {**os.environ, "OPENBLAS_CORETYPE": core_type, "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", DRAW, str(figures_dir)], capture_output=True, text=True, env=env,
                          timeout=120, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_deterministic_figure_is_byte_identical_under_another_blas_kernel(tmp_path):
    first, second = (_draw(core, tmp_path / core) for core in CORE_TYPES)
    assert first["values"] != second["values"]  # control: the kernels compute other last bits
    assert first["raw"] != second["raw"]  # control: drawn as computed, the files differ
    assert first["rounded"] == second["rounded"]


def test_rounding_keeps_what_the_figure_shows():
    """Each coordinate moves by at most half a grid step (span / AXIS_STEPS), far below a pixel, and a log axis
    is rounded in decades (a value of 1e-6 beside 1 keeps its digits)."""
    x = np.linspace(0.0, 1.0, 50)
    y = np.exp(-x) * 123.456789
    fig, (lin, log) = plt.subplots(2, 1)
    line = lin.plot(x, y)[0]
    bars = log.bar([0, 1, 2], [1e-6 * 1.23456789, 1e-3 * 4.56789, 0.987654321])
    log.set_yscale("log")
    round_to_drawn_precision(fig)
    span = float(np.ptp(lin.get_ylim()))
    moved = np.abs(np.asarray(line.get_ydata()) - y)
    assert moved.max() <= span / AXIS_STEPS / 2 and moved.max() > 0
    heights = np.array([b.get_height() for b in bars])
    assert np.allclose(heights, [1.23456789e-6, 4.56789e-3, 0.987654321], rtol=1e-3) and heights[0] != 1.23456789e-6
    plt.close(fig)
