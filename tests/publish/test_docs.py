"""The figure gallery (make docs): every figure with caption, alt text, provenance and a link to
its executed notebook, rendered by the jinja2 template (escaped), from the committed manifest too."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from anelab import cli  # noqa: E402
from anelab.core.errors import AnelabInputError  # noqa: E402
from anelab.core.paths import FIGURES_DIR  # noqa: E402
from anelab.publish import docs_site, figures  # noqa: E402


class _Page(HTMLParser):
    """Images (src, alt), links and text of the rendered page."""

    def __init__(self):
        super().__init__()
        self.images, self.links, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append((attrs["src"], attrs.get("alt")))
        if tag == "a":
            self.links.append(attrs["href"])

    def handle_data(self, data):
        self.text.append(data)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    return page


def _save(directory: Path, name: str, notebook: str, **caption) -> None:
    """A small figure saved with the caption from the table, or with an explicit caption= / alt=."""
    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.plot([0, 1], [1, 0])
    note = "measured here: test box"
    figures.save_figure(
        fig, name, figures_dir=directory, notebook=notebook, parameters={}, provenance_note=note, **caption
    )
    plt.close(fig)


def test_gallery_shows_every_figure_with_caption_alt_provenance_and_notebook_link(tmp_path):
    figs, html, out = tmp_path / "figures", tmp_path / "html", tmp_path / "docs"
    _save(figs, "gather_sizing", "03_gather_sizing.ipynb")
    _save(figs, "mask_fold_checks", "02_mask_fold.ipynb")
    _save(figs, "extra", "02_mask_fold.ipynb", caption="a <b> & c, measured here", alt='alt "quoted"')
    html.mkdir()
    (html / "03_gather_sizing.html").write_text("<html>executed</html>")
    index, pages = docs_site.build_docs(figs, html, out)
    page = _parse(index)
    assert sorted(alt for _, alt in page.images) == sorted(
        [figures.caption_for("gather_sizing")["alt"], figures.caption_for("mask_fold_checks")["alt"], 'alt "quoted"']
    )
    assert all((out / src).is_file() for src, _ in page.images)
    text = " ".join(page.text)
    assert figures.caption_for("mask_fold_checks")["caption"] in text
    assert "a <b> & c, measured here" in text  # shown as text, not parsed as a tag
    assert "<b>" not in index.read_text()  # jinja2 escaped it
    assert "measured here: test box" in text and "predicted" in text
    assert "notebooks/03_gather_sizing.html" in page.links and (out / "notebooks/03_gather_sizing.html").is_file()
    by_stem = {p.stem: p for p in pages}
    assert by_stem["02_mask_fold"].html is None and "Executed notebook not built" in text


def test_a_figure_without_caption_is_refused(tmp_path):
    _save(tmp_path / "figures", "not_in_the_table", "02_mask_fold.ipynb")
    with pytest.raises(AnelabInputError, match="not_in_the_table has no caption"):
        docs_site.build_docs(tmp_path / "figures", tmp_path / "html", tmp_path / "docs")
    assert not (tmp_path / "docs" / "index.html").exists()


def test_docs_command_builds_the_committed_gallery(tmp_path, capsys):
    code = cli.main(["docs", "--html", str(tmp_path / "html"), "--out", str(tmp_path / "docs")])
    out = capsys.readouterr().out
    assert code == 0
    manifest = figures.read_manifest(FIGURES_DIR)["figures"]
    page = _parse(tmp_path / "docs" / "index.html")
    assert len(page.images) == len(manifest) and f"{len(manifest)} figures" in out
    assert all(alt for _, alt in page.images)
