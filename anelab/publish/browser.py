"""Headless Chromium: the docs pages as a reader's browser shows them — no kernel, no network.

The gallery (``anelab docs``) and the executed notebooks' HTML are checked by rendering them here
(``tests/publish/test_browser.py``, ``benchmarks/bench_widget_stress.py --screenshot``): ``dump_dom`` returns
the DOM after the page's scripts ran (the widget manager, image loads), ``screenshot`` writes a
PNG of the window. Chromium is found on the PATH (``chromium``, ``chromium-browser``, Google
Chrome) or named by ``ANELAB_CHROMIUM``; ``make test`` installs Debian's ``chromium`` when it runs
as root on a machine without one. Every run gets a fresh profile and no background networking
(on a machine with a closed network Chromium otherwise keeps retrying Google's hosts).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from anelab.core.errors import AnelabInputError

BROWSER_VARIABLE = "ANELAB_CHROMIUM"  # path of the browser, when it is not on the PATH


CANDIDATES = (
    "chromium",
    "chromium-browser",
    "google-chrome",
    "google-chrome-stable",
    "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome",
    "/Applications/Chromium.app/Contents/MacOS/Chromium",
)


INSTALL_HINT = (
    "install Chromium (Debian: apt-get install -y --no-install-recommends chromium, which `make test` runs "
    f"as root) or set {BROWSER_VARIABLE} to the browser"
)


FLAGS = (  # headless, as root, on a machine with no display, GPU or outside network
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
    "--allow-file-access-from-files",
)


BUDGET_MS = 10_000  # virtual time the page's scripts get before the DOM or the picture is taken


TIMEOUT = 120  # wall seconds one browser run may take


def find_chromium() -> str:
    """The browser to run: ``ANELAB_CHROMIUM`` if set, else the first of ``CANDIDATES`` found
    (refused in one line naming the install command when there is none)."""
    named = os.environ.get(BROWSER_VARIABLE)
    if named:
        if shutil.which(named) is None:
            raise AnelabInputError(f"{BROWSER_VARIABLE}={named} is not an executable; unset it or {INSTALL_HINT}")
        return shutil.which(named)
    for candidate in CANDIDATES:
        found = shutil.which(candidate)
        if found is not None:
            return found
    raise AnelabInputError(f"no Chromium found; {INSTALL_HINT}")


def _url(page: str | os.PathLike) -> str:
    text = str(page)
    return text if "://" in text else Path(page).resolve().as_uri()


def _run(page: str | os.PathLike, extra: list[str], budget_ms: int, window: tuple[int, int]) -> str:
    """One browser run on ``page`` (a path or URL) with a fresh profile; its standard output."""
    with tempfile.TemporaryDirectory(prefix="anelab-chromium-") as profile:
        args = [
            find_chromium(),
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={window[0]},{window[1]}",
            f"--virtual-time-budget={int(budget_ms)}",
            *extra,
            _url(page),
        ]
        done = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise AnelabInputError(f"chromium failed on {page} (exit {done.returncode}): {last}")
    return done.stdout


def dump_dom(page: str | os.PathLike, *, budget_ms: int = BUDGET_MS, window: tuple[int, int] = (1200, 1600)) -> str:
    """The page's DOM, serialised after its scripts ran for ``budget_ms`` of virtual time."""
    return _run(page, ["--dump-dom"], budget_ms, window)


def screenshot(
    page: str | os.PathLike,
    png: str | os.PathLike,
    *,
    budget_ms: int = BUDGET_MS,
    window: tuple[int, int] = (1200, 1600),
) -> Path:
    """A PNG of the browser window (``window`` = width, height in CSS pixels at scale 1) showing
    ``page`` after its scripts ran; refused when Chromium writes no picture."""
    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    _run(page, [f"--screenshot={png}"], budget_ms, window)
    if not png.is_file() or png.stat().st_size == 0:
        raise AnelabInputError(f"chromium wrote no screenshot of {page} to {png}")
    return png
