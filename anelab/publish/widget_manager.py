"""The widget manager of the executed notebooks' HTML: a pinned html-manager bundle, served locally.

An executed notebook keeps its widgets' state (nbclient stores it in the notebook's metadata); the
HTML export renders them with ``@jupyter-widgets/html-manager``'s standalone ``embed.js`` — never a
CDN an offline reader cannot reach. ``make docs`` vendors the bundle (one pinned version, checked
against its registry integrity hash) into ``<docs>/widgets/``; every notebook page, in
``<docs>/notebooks/`` (or ``build/html/``), loads it as ``RENDERER_URL``. Without the bundle the
page still reads: each explore cell prints its numbers as text (``anelab.publish.explore``).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.paths import REPO_ROOT
from anelab.core.records import atomic_write_bytes

PACKAGE = "@jupyter-widgets/html-manager"
VERSION = "1.0.15"  # the release matching ipywidgets 8's widget protocol (state version 2)
INTEGRITY = (  # the registry's integrity of the tarball (npm pack --json), checked before use
    "sha512-5thBIV6ymNgmPVOHvzx+gGy8ZSKmSazhtGw4/c4xJDVzRhG9PTeQsRjF3FUTopvFi//SABeNz1yp47bCrJ3CQA=="
)
BUNDLE = "widgets/html-manager-embed.js"  # relative to the docs folder
RENDERER_URL = "../" + BUNDLE  # as a notebook page in <docs>/notebooks/ loads it
CACHE_DIR = REPO_ROOT / "build" / "vendor"  # the downloaded tarball, kept between builds
MEMBERS = {"package/dist/embed.js": BUNDLE, "package/dist/embed.js.LICENSE.txt": BUNDLE + ".LICENSE.txt"}


def integrity_of(data: bytes) -> str:
    """npm's ``integrity`` string of a tarball: ``sha512-<base64 digest>``."""
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def tarball_name() -> str:
    return f"{PACKAGE.lstrip('@').replace('/', '-')}-{VERSION}.tgz"


def fetch_tarball(cache: Path = CACHE_DIR) -> Path:
    """The pinned tarball, from ``cache`` or fetched with ``npm pack`` (refused in one line without npm)."""
    cached = Path(cache) / tarball_name()
    if cached.is_file():
        return cached
    npm = shutil.which("npm")
    if npm is None:
        raise AnelabInputError("npm not found; install Node.js (npm) to vendor the widget manager")
    with tempfile.TemporaryDirectory(prefix="anelab-npm-") as work:
        done = subprocess.run(
            [npm, "pack", f"{PACKAGE}@{VERSION}", "--silent"], cwd=work, capture_output=True, text=True, timeout=300
        )
        fetched = Path(work) / tarball_name()
        if done.returncode != 0 or not fetched.is_file():
            raise AnelabInputError(f"npm pack {PACKAGE}@{VERSION} failed: {done.stderr.strip().splitlines()[-1:]}")
        return atomic_write_bytes(cached, fetched.read_bytes())


def extract_bundle(tarball: Path, dest: Path) -> Path:
    """``dest/BUNDLE`` (and its licence) from ``tarball``, after checking its integrity against
    ``INTEGRITY`` (a tarball that does not match is refused, nothing written)."""
    data = Path(tarball).read_bytes()
    if integrity_of(data) != INTEGRITY:
        raise AnelabInputError(f"{tarball}: not {PACKAGE}@{VERSION} (integrity differs); remove it and build again")
    with tarfile.open(tarball, "r:gz") as tar:
        for member, target in MEMBERS.items():
            atomic_write_bytes(Path(dest) / target, tar.extractfile(member).read())
    return Path(dest) / BUNDLE


def vendor(dest: str | os.PathLike, cache: Path = CACHE_DIR) -> tuple[Path | None, str]:
    """Put the bundle in ``dest`` (the docs folder). Returns (bundle path, "") or (None, why not):
    the gallery is still built without it — the explore cells' numbers are printed as text."""
    try:
        return extract_bundle(fetch_tarball(cache), Path(dest)), ""
    except (AnelabInputError, OSError, subprocess.SubprocessError) as e:
        return None, str(e)
