"""The sidecar back-ends — Core ML (``.mlpackage``) and Core AI (``.aimodel``) — each declared once, in one table.

A :class:`Backend` is what export, verify, inspect, doctor and measure may ask about one kind of saved
sidecar: its file suffix, how it is written from the exported Core ML package (Core ML: the package
itself; Core AI: lowered op by op, ``coreai_asset.write_asset``), whether the Core ML ANE gate applies,
how it is read back (``open_saved``: the object verification runs — ``evaluate.SavedPackage``'s NumPy
evaluation, or ``coreai_asset.CoreAIAsset`` on coreai-core's bundled CPU runtime), its metadata, its
inspection, and which runtime measures it on a Mac (``runtime``: ``"module:callable"``, resolved by
the layer that may import runtimes). Nothing outside this module spells a back-end's name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.sidecar import inspection
from anelab.sidecar.coreai import asset as coreai_asset
from anelab.sidecar.coreai import asset_inspection as coreai_inspection
from anelab.sidecar.format import SidecarMetadata, read_sidecar_metadata, weight_bytes
from anelab.sidecar.mil.evaluate import SavedPackage

COREML, COREAI = "coreml", "coreai"  # the back-ends' names: written here and nowhere else


@dataclass(frozen=True)
class Backend:
    """One kind of saved sidecar (see the module docstring)."""

    name: str
    summary: str
    suffix: str
    open_saved: Callable[
        [Path], object
    ]  # -> SavedPackage | CoreAIAsset (evaluate, evaluate_with_state, new_state, ...)
    read_metadata: Callable[[Path], SidecarMetadata]
    inspect: Callable[[Path], dict]
    format_inspection: Callable[[dict], str]
    stored_bytes: Callable[[Path], int]  # bytes of the weights (and constants) the saved sidecar holds
    # (the saved Core ML package in a work directory, the destination, its metadata) -> (written path, extra
    # fields); None: the Core ML package is the sidecar (moved into place by the exporter)
    derive: Callable[[Path, Path, SidecarMetadata], tuple[Path, dict]] | None
    # (weights mode, chunk, state capacity or None) -> None: refuses, in one line, what it cannot serve
    check_options: Callable[[str, int, int | None], None]
    gated: bool  # the Core ML ANE gate (per variant, on a Mac) applies to this back-end's sidecars
    runtime: str  # "module:callable" of the runtime that loads and times it on a Mac

    def package_path(self, out_dir: str | os.PathLike, layer: int) -> Path:
        return Path(out_dir) / f"layer_{layer}{self.suffix}"


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            COREML,
            "Core ML multifunction .mlpackage (coremltools 9.0): functions h<H> / c<C>, fp16 weights stored once",
            ".mlpackage",
            open_saved=lambda path: SavedPackage(path),
            read_metadata=read_sidecar_metadata,
            inspect=inspection.inspect_package,
            format_inspection=inspection.format_inspection,
            stored_bytes=weight_bytes,
            derive=None,
            check_options=lambda weights, chunk, capacity: None,  # the designs' own validation is Core ML's
            gated=True,
            runtime="anelab.runtimes.coreml.coreml_runtime:default_runtime",
        ),
        Backend(
            COREAI,
            "Core AI .aimodel (coreai-core 1.0.0b3): the Core ML package lowered op by op, one entrypoint per "
            "function, weights stored once, Neural Engine rules applied and named in its metadata",
            coreai_asset.SUFFIX,
            open_saved=lambda path: coreai_asset.CoreAIAsset(path),
            read_metadata=coreai_asset.read_asset_metadata,
            inspect=coreai_inspection.inspect_asset,
            format_inspection=coreai_inspection.format_asset_inspection,
            stored_bytes=coreai_inspection.stored_constant_bytes,
            derive=coreai_asset.write_asset,
            check_options=coreai_asset.check_options,
            gated=False,
            runtime="anelab.runtimes.coreai.coreai_runtime:default_coreai_runtime",
        ),
    )
}
DEFAULT_BACKEND = COREML


def get_backend(name: str | None, flag: str = "--backend") -> Backend:
    """The back-end called ``name`` (None: the default, Core ML); refuse an unknown one naming the known ones."""
    name = DEFAULT_BACKEND if name is None else name
    if name not in BACKENDS:
        raise AnelabInputError(f"unknown {flag} {name!r}; supported: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def backend_of(path: str | os.PathLike) -> Backend:
    """The back-end of a saved sidecar, by its suffix; anything else is taken as a Core ML package (whose
    reader refuses, in one line, a path that is not one)."""
    suffix = Path(path).suffix
    return next((b for b in BACKENDS.values() if b.suffix == suffix), BACKENDS[COREML])


def is_sidecar(path: str | os.PathLike) -> bool:
    """Whether ``path`` names one saved sidecar (of any back-end) rather than an export directory."""
    return Path(path).suffix in {b.suffix for b in BACKENDS.values()}


def open_saved(path: str | os.PathLike):
    """The saved sidecar read back from disk, as its back-end runs it (``Backend.open_saved``)."""
    return backend_of(path).open_saved(Path(path))


def read_metadata(path: str | os.PathLike) -> SidecarMetadata:
    """A saved sidecar's ``SidecarMetadata``, whichever back-end wrote it."""
    return backend_of(path).read_metadata(Path(path))
