"""Verification of every package of one export directory: one progress bar, one summary row per layer.

The directory must hold one export: every attention layer of one checkpoint, of one design (``set_problems``;
a partial or mixed set fails). Each ``layer_<L>.mlpackage`` is verified as ``anelab verify PKG`` would (``verify.verify_package``: its
comparisons with the reference and its negative controls). The summary keeps, per layer, the worst
error of the comparisons that must stay under their bound and the weakest margin by which a negative
control landed above its bound (a margin <= 1x means the control did not fail: the check is vacuous).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from anelab.checkpoints.checkpoint import Checkpoint, load_checkpoint
from anelab.core.errors import AnelabInputError
from anelab.core.parallel import default_jobs, process_map, threads_per_run
from anelab.core.progress import tqdm
from anelab.sidecar.backends import BACKENDS, read_metadata
from anelab.sidecar.checks.comparison import Comparison, open_package_checkpoint
from anelab.sidecar.checks.verify import VerifyReport, verify_package
from anelab.sidecar.coremltools_import import coremltools_modules
from anelab.sidecar.format import SidecarMetadata

_PACKAGE = re.compile(r"^layer_(\d+)(" + "|".join(re.escape(b.suffix) for b in BACKENDS.values()) + r")$")

# (package, the opened checkpoint or None) -> its report; verify_package without its own progress bar by default
VerifyOne = Callable[[Path, "Checkpoint | None"], VerifyReport]


def _bound(c: Comparison, threshold: float) -> float:
    return threshold if c.bound is None else c.bound


@dataclass
class LayerVerdict:
    """One package's summary: design (graph and weight mode), worst checked error against its bound, and
    the weakest control margin (control error / its bound; None when the package has no control), and a compressed
    package's cost (its worst error against the uncompressed weights: reported, not judged)."""

    layer: int
    package: str
    design: str
    report: VerifyReport

    @property
    def worst(self) -> Comparison | None:
        checked = [c for c in self.report.comparisons if not c.control and not c.cost]
        return max(checked, key=lambda c: c.worst / _bound(c, self.report.threshold), default=None)

    @property
    def weakest_control_margin(self) -> float | None:
        controls = [c.worst / _bound(c, self.report.threshold) for c in self.report.comparisons if c.control]
        return min(controls, default=None)

    @property
    def compression_cost(self) -> float | None:
        """The worst error against the checkpoint's uncompressed weights (None for an fp16 package)."""
        return max((c.worst for c in self.report.comparisons if c.cost), default=None)

    @property
    def result(self) -> str:
        return "ok" if self.report.passed else ("VACUOUS" if self.report.vacuous else "FAIL")

    def to_dict(self) -> dict:
        worst = self.worst
        return {
            "layer": self.layer,
            "package": self.package,
            "design": self.design,
            "worst_error": None if worst is None else worst.worst,
            "worst_bound": None if worst is None else _bound(worst, self.report.threshold),
            "weakest_control_margin": self.weakest_control_margin,
            "compression_cost": self.compression_cost,
            "passed": self.report.passed,
            "report": self.report.to_dict(),
        }


@dataclass
class ExportVerifyReport:
    """Every package of one export directory, verified (``passed``: at least one, every one passed, and the
    packages form one set: ``set_problems`` empty — see ``set_problems``)."""

    directory: str
    layers: list[LayerVerdict]
    set_problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.layers) and all(v.report.passed for v in self.layers) and not self.set_problems

    def table(self) -> str:
        compressed = any(v.compression_cost is not None for v in self.layers)
        lines = [
            f"verify {self.directory}: {len(self.layers)} packages"
            + "".join(sorted({f"; inputs: {v.report.inputs}" for v in self.layers})),
            f"{'layer':>5}  {'design':<22} {'worst error':>12} {'(bound)':>9}  {'weakest control':>15}  result"
            + ("  compression cost (vs uncompressed weights; not judged)" if compressed else ""),
        ]
        for v in self.layers:
            worst, margin = v.worst, v.weakest_control_margin
            error = f"{worst.worst:>12.2e} {_bound(worst, v.report.threshold):>9.0e}" if worst else f"{'-':>12} {'':>9}"
            control = f"{margin:>14.0f}x" if margin is not None else f"{'none':>15}"
            cost = "" if v.compression_cost is None else f"  {v.compression_cost:.2e}"
            lines.append(f"{v.layer:>5}  {v.design:<22} {error}  {control}  {v.result:<6}{cost}".rstrip())
        lines += [f"not one export: {problem}" for problem in self.set_problems]
        failed = [str(v.layer) for v in self.layers if not v.report.passed]
        failures = ([f"layer {', '.join(failed)}"] if failed else []) + (["the set"] if self.set_problems else [])
        lines.append("PASSED: every package" if self.passed else f"FAILED: {'; '.join(failures) or 'no package'}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "directory": self.directory,
            "passed": self.passed,
            "set_problems": self.set_problems,
            "layers": [v.to_dict() for v in self.layers],
        }


def export_packages(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(layer, path) of every ``layer_<L>`` sidecar (``.mlpackage`` or ``.aimodel``) in an export directory, by layer;
    refuses an empty one or one holding a layer in two formats."""
    directory = Path(directory)
    if not directory.is_dir():
        raise AnelabInputError(f"{directory}: no such directory; pass a package or an 'anelab export --out' directory")
    found = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _PACKAGE.match(p.name)))
    layers = [layer for layer, _ in found]
    twice = sorted({layer for layer in layers if layers.count(layer) > 1})
    if twice:
        raise AnelabInputError(
            f"{directory} holds layer {twice[0]} in two formats; verify one sidecar, or export each format to its own --out"
        )
    if not found:
        raise AnelabInputError(
            f"{directory} is not an .mlpackage and holds no layer_<L>.mlpackage; pass a package or an export directory"
        )
    return found


def verify_export(
    directory: str | os.PathLike,
    checkpoint: Checkpoint | None = None,
    *,
    fp16: bool = True,
    verify_one: VerifyOne | None = None,
    jobs: int | None = None,
    layers: list[int] | None = None,
) -> ExportVerifyReport:
    """Verify every ``layer_<L>.mlpackage`` of ``directory`` against its checkpoint (``checkpoint``, opened, else
    the one each package records), with one progress bar over the packages. ``verify_one`` replaces the
    NumPy verification of one package (e.g. on the device: then one package at a time, and a ``jobs``
    above 1 is refused). ``jobs``: packages verified at once in worker processes (default
    ``anelab.core.parallel.default_jobs``); the reports do not depend on it. ``layers``: the layers the export
    was asked for (``export --layers``); default every attention layer of the checkpoint."""
    packages = export_packages(directory)
    if verify_one is not None:
        if jobs is not None and jobs > 1:
            raise AnelabInputError(f"--jobs {jobs}: packages are verified on the device one at a time; drop --jobs")
        jobs = 1
    elif jobs is None:
        jobs = default_jobs(len(packages))
    threads_per_run(jobs)  # 1..cores, else refused in one line before anything runs
    if layers is not None and packages:  # a --layers that names no attention layer is refused before any work
        _attention_layers(checkpoint.path if checkpoint is not None else read_metadata(packages[0][1]).source, layers)
    source = None if checkpoint is None else str(checkpoint.path)  # the workers open it again, once per package
    work = [(str(path), source, fp16) for _, path in packages]
    with tqdm(total=len(packages), desc="verify packages", unit="pkg") as bar:
        if verify_one is None:
            coremltools_modules()  # imported before the workers fork, so they inherit it (~1.5 s each otherwise)
            reports = process_map(_verify_numpy, work, jobs=jobs, on_result=lambda job, _: bar.update())
        else:
            reports = []
            for layer, path in packages:
                bar.set_postfix_str(f"layer {layer}")
                reports.append(verify_one(path, checkpoint))
                bar.update()
    verdicts, metas = [], {}
    for (layer, path), report in zip(packages, reports, strict=True):
        meta = metas[layer] = read_metadata(path)
        design = meta.graph if meta.weights == "fp16" else f"{meta.graph} {meta.weights}"
        verdicts.append(LayerVerdict(layer, str(path), design, report))
    return ExportVerifyReport(str(directory), verdicts, set_problems(metas, source, layers))


def _design_key(meta: SidecarMetadata) -> tuple:
    """What one export's packages share: the design, weight mode, chunk, functions (histories or state
    capacity), mask mode and selection contract (tiles may differ between full and windowed layers)."""
    return (meta.graph, meta.weights, meta.chunk, tuple(meta.histories), meta.state_capacity, meta.mask_mode,
            meta.selection_folded)  # fmt: skip


def set_problems(
    metas: dict[int, SidecarMetadata], checkpoint_dir: str | os.PathLike | None, layers: list[int] | None = None
) -> list[str]:
    """Why the packages (layer -> metadata) are not one complete export of one checkpoint (empty: they are):
    the packages record more than one checkpoint (without ``checkpoint_dir``, which each is then verified
    against) or more than one design, or the checkpoint's attention layers (full and sliding-window) and the
    packages' layers differ — a missing layer (an interrupted or failed export) or a stray one. ``layers``: the
    set asked for (each must be an attention layer), instead of all of them."""

    problems = []
    sources = sorted({m.source for m in metas.values()})
    if checkpoint_dir is None and len(sources) > 1:
        problems.append(f"the packages come from {len(sources)} checkpoints ({', '.join(sources[:2])}, ...)")
    designs = {}
    for layer, meta in sorted(metas.items()):
        designs.setdefault(_design_key(meta), []).append(layer)
    if len(designs) > 1:
        groups = "; ".join(f"layers {','.join(map(str, ls))}: {k[0]} {k[1]} chunk {k[2]}" for k, ls in designs.items())
        problems.append(f"the packages are {len(designs)} designs ({groups})")
    source = checkpoint_dir if checkpoint_dir is not None else sources[0]
    try:
        attention = _attention_layers(source, None)
    except AnelabInputError as e:
        return [*problems, f"the checkpoint {source} cannot be read to list its attention layers ({e})"]
    _refuse_other_layers(layers, attention, source)
    expected = attention if layers is None else set(layers)
    whose = "the checkpoint's" if layers is None else "the requested"
    missing, stray = sorted(expected - set(metas)), sorted(set(metas) - expected)
    if missing:
        problems.append(
            f"layer_{missing[0]} is missing ({len(missing)} of {whose} {len(expected)} attention layers: "
            f"{','.join(map(str, missing))}); export them into this directory (a partial export made with "
            "--layers: give verify the same --layers)"
        )
    if stray:
        problems.append(f"layer {','.join(map(str, stray))} is not an attention layer of {source}")
    return problems


def _attention_layers(source, layers: list[int] | None) -> set[int]:
    """The checkpoint's attention layers (full and sliding-window); a ``layers`` naming another is refused."""

    attention = set(load_checkpoint(source).geometry.full_attention_layers)
    _refuse_other_layers(layers, attention, source)
    return attention


def _refuse_other_layers(layers: list[int] | None, attention: set[int], source) -> None:
    if layers is not None and set(layers) - attention:
        raise AnelabInputError(
            f"--layers {','.join(map(str, sorted(set(layers) - attention)))}: not an attention layer of {source}"
        )


def _verify_numpy(job: tuple[str, str | None, bool]) -> VerifyReport:
    """One package's NumPy verification (in a worker process): ``job`` = (package, checkpoint path or None: the one
    the package records, fp16)."""
    package, source, fp16 = job
    checkpoint = None if source is None else open_package_checkpoint(source)
    return verify_package(package, checkpoint, fp16=fp16, progress=False)
