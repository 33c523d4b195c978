"""The figure gallery for the docs (``make docs``): ``build/docs/index.html`` from the manifest.

Every figure in ``figures/MANIFEST.json`` appears with its caption, alt text, provenance kinds and
full provenance note, grouped by the notebook that drew it, with a link to that notebook's
executed HTML (copied from ``build/html/``, where ``make reproduce`` and ``anelab run --publish``
leave it). The page is rendered by a jinja2 template (``templates/gallery.html.j2``, autoescaped);
the figure files and notebook pages are copied beside it so the folder can be served as is.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from anelab.core.errors import AnelabInputError
from anelab.core.output_paths import require_output_dir
from anelab.core.paths import FIGURES_DIR
from anelab.core.records import atomic_write_text
from anelab.publish import widget_manager
from anelab.publish.figures import read_manifest
from anelab.publish.studies import STUDIES, get_study

TEMPLATE_DIR = Path(__file__).with_name("templates")


TEMPLATE = "gallery.html.j2"


TITLE = "anelab study figures"


@dataclass
class StudyPage:
    """One notebook's section of the gallery."""

    stem: str
    question: str  # the study's question (``publish.studies.STUDIES``)
    html: str | None  # link relative to index.html, None when the executed notebook is missing
    missing: str = ""
    figures: list[dict] = field(default_factory=list)


def _figure_item(name: str, entry: dict) -> dict:
    if not entry.get("caption") or not entry.get("alt"):
        raise AnelabInputError(f"figure {name} has no caption/alt text; add it to anelab/publish/captions.toml")
    return {
        "name": name,
        "svg": f"figures/{entry['files']['svg']['path']}",
        "png": f"figures/{entry['files']['png']['path']}",
        "caption": entry["caption"],
        "alt": entry["alt"],
        "kinds": entry.get("provenance_kinds", []),
        "provenance": entry.get("provenance", ""),
    }


def gallery_pages(manifest: dict, html_dir: Path) -> list[StudyPage]:
    """The gallery's sections, in the order of the table of studies; each figure checked for caption and alt
    text and refused when no study draws it."""
    order = [s.stem for s in STUDIES]
    pages: dict[str, StudyPage] = {}
    for name, entry in sorted(manifest["figures"].items(), key=lambda kv: (_position(kv[1], order), kv[0])):
        stem = Path(entry["notebook"]).stem
        if stem not in pages:
            html = html_dir / f"{stem}.html"
            found = html.is_file()
            pages[stem] = StudyPage(
                stem,
                get_study(stem).question,
                f"notebooks/{stem}.html" if found else None,
                "" if found else f"no {html}; run make reproduce",
            )
        pages[stem].figures.append(_figure_item(name, entry))
    return list(pages.values())


def _position(entry: dict, order: list[str]) -> int:
    stem = Path(entry["notebook"]).stem
    if stem not in order:
        raise AnelabInputError(
            f"figure drawn by {entry['notebook']}, which no study lists; add it to anelab/publish/studies.py"
        )
    return order.index(stem)


def render(pages: list[StudyPage], title: str = TITLE) -> str:
    """The gallery page (jinja2, autoescaped HTML)."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    figures = [f for p in pages for f in p.figures]
    return env.get_template(TEMPLATE).render(title=title, studies=pages, figures=figures)


def build_docs(
    figures_dir: str | os.PathLike = FIGURES_DIR,
    html_dir: str | os.PathLike = "build/html",
    out_dir: str | os.PathLike = "build/docs",
) -> tuple[Path, list[StudyPage]]:
    """Write ``out_dir/index.html`` with copies of the figures and executed notebooks beside it.

    Returns (index path, sections); a section whose executed notebook is missing says so on the
    page (and in ``missing``) rather than linking nowhere.
    """
    figures_dir, html_dir, out_dir = Path(figures_dir), Path(html_dir), require_output_dir(out_dir)
    manifest = read_manifest(figures_dir)
    if not manifest["figures"]:
        raise AnelabInputError(f"{figures_dir} has no figures in MANIFEST.json; run make reproduce first")
    pages = gallery_pages(manifest, html_dir)
    for entry in manifest["figures"].values():
        for f in entry["files"].values():
            source = figures_dir / f["path"]
            if not source.is_file():
                raise AnelabInputError(f"{source} is listed in MANIFEST.json but missing; run make reproduce")
            (out_dir / "figures").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, out_dir / "figures" / f["path"])
    for page in pages:
        if page.html is not None:
            (out_dir / "notebooks").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(html_dir / f"{page.stem}.html", out_dir / page.html)
    index = atomic_write_text(out_dir / "index.html", render(pages))
    return index, pages


def vendor_widget_manager(out_dir: str | os.PathLike = "build/docs") -> str:
    """Vendor the pinned widget manager into the docs folder; one line saying what happened."""

    bundle, why_not = widget_manager.vendor(out_dir)
    if bundle is None:
        return f"widgets: not vendored ({why_not}); the explore cells read as printed text"
    return f"widgets: {widget_manager.PACKAGE}@{widget_manager.VERSION} -> {bundle}"
