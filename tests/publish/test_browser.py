"""The docs as a reader's browser shows them, without a kernel: headless Chromium renders the gallery
(built by ``anelab docs`` from the committed figures) and notebook 02's executed HTML (run headless in
its quick mode, linked from the gallery), and the DOM after the scripts ran and a PNG screenshot must
show the figures and the explore cell's widget. Controls: broken and blank figure files, the page
without its widget state, the page without the vendored widget manager.

One run of notebook 02 (~15 s) serves every test here, in every xdist worker: the first worker to
need it builds the docs under a file lock in the session's shared temporary folder, the others wait
and reuse them (xdist_group does not group tests under pytest 9.2 here). Chromium: ``make test``
installs it when missing (``anelab.publish.browser``).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from anelab import cli
from anelab.core.errors import AnelabInputError
from anelab.core.paths import FIGURES_DIR
from anelab.publish import browser, notebooks, widget_manager
from anelab.publish.figures import read_manifest

NOTEBOOK = "02_mask_fold"
EXPLORE_CALL = "explore.show("  # the source of notebook 02's explore cell
GALLERY_WINDOW = (1000, 3000)  # CSS px: the first figures of the gallery
CELL_WINDOW = (1000, 600)  # CSS px: the explore cell alone
PAINTED_LEVEL = 235  # a pixel with a channel darker than this is drawn (white and near-white are not)

# Appended to a copy of a page: after the load event, writes what the page shows into the DOM as JSON
# (<pre id="anelab-probe">) — every image's natural size and box, the widget slider's box. The page
# itself is unchanged, so the same copy is screenshot with the same layout.
PROBE = """<script>
window.addEventListener('load', () => {
  let waited = 0;
  const box = (el) => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; };
  const look = () => {
    const slider = document.querySelector('.widget-slider');
    if (!slider && waited < 3000) { waited += 100; setTimeout(look, 100); return; }
    if (ONLY_EXPLORE_CELL) {
      for (const cell of document.querySelectorAll('.jp-Cell')) {
        if (!cell.textContent.includes('EXPLORE_CALL')) cell.style.display = 'none';
      }
    }
    const images = [...document.images].map((img) => ({src: img.getAttribute('src').slice(0, 200), width: img.naturalWidth,
                                                         box: box(img)}));
    const out = document.createElement('pre');
    out.id = 'anelab-probe';
    out.hidden = true;
    out.textContent = JSON.stringify({images, slider: slider ? box(slider) : null});
    document.body.appendChild(out);
  };
  look();
});
</script>"""


def probed(page: Path, *, only_explore_cell: bool = False) -> Path:
    """A copy of ``page`` beside it (its relative links still resolve) with ``PROBE`` appended."""
    script = PROBE.replace("ONLY_EXPLORE_CELL", "true" if only_explore_cell else "false")
    script = script.replace("EXPLORE_CALL", EXPLORE_CALL)
    copy = page.with_name(f"probe-{os.getpid()}-{page.name}")  # workers share the docs folder
    copy.write_text(page.read_text().replace("</body>", script + "</body>"))
    return copy


def probe_result(dom: str) -> dict:
    found = re.search(r'<pre id="anelab-probe"[^>]*>(.*?)</pre>', dom, re.S)
    assert found, "the probe did not run: the page's scripts never reached the load event"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def painted_fraction(png: Path, box: list[float]) -> float:
    """Share of the pixels inside ``box`` (left, top, width, height in CSS px = PNG px at scale 1)
    that are drawn, not white."""
    left, top, width, height = (round(v) for v in box)
    pixels = np.asarray(Image.open(png).convert("RGB"))[top : top + height, left : left + width]
    assert pixels.size, f"box {box} lies outside the {png.name} screenshot"
    return float((pixels.min(axis=2) < PAINTED_LEVEL).mean())


class WidgetText(HTMLParser):
    """Text inside the rendered widget elements (class ``widget-*``), by class; scripts (the widget
    state itself) are not rendered content and are left out."""

    def __init__(self):
        super().__init__()
        self.stack: list[tuple[str, list[str]]] = []
        self.text: dict[str, list[str]] = {}

    def handle_starttag(self, tag, attrs):
        if tag in ("br", "img", "input", "meta", "link", "hr"):
            return
        self.stack.append((tag, (dict(attrs).get("class") or "").split()))

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if not data.strip() or any(tag in ("script", "style") for tag, _ in self.stack):
            return
        for _, classes in self.stack:
            for c in classes:
                if c.startswith("widget-"):
                    self.text.setdefault(c, []).append(data.strip())


def widget_text(dom: str) -> dict[str, list[str]]:
    parser = WidgetText()
    parser.feed(dom)
    return parser.text


def test_a_missing_browser_is_refused_in_one_line_naming_the_install(monkeypatch, tmp_path):
    assert browser.find_chromium()  # control: this machine has one (make test installs it)
    monkeypatch.setenv(browser.BROWSER_VARIABLE, str(tmp_path / "no-such-browser"))
    with pytest.raises(AnelabInputError, match="is not an executable.*apt-get install"):
        browser.find_chromium()
    monkeypatch.delenv(browser.BROWSER_VARIABLE)
    monkeypatch.setattr(browser, "CANDIDATES", ("chromium", "chromium-browser"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(AnelabInputError, match="no Chromium found.*apt-get install"):
        browser.find_chromium()


def build_docs(root: Path) -> dict:
    """Notebook 02 run headless in its quick mode, then the gallery built from the committed figures
    as ``anelab docs`` builds it, with that notebook's HTML linked and the widget manager vendored."""
    run = notebooks.run_notebook(notebooks.resolve_notebook(NOTEBOOK), quick=True, build=root / "build")
    assert run.ok, run.error
    out = root / "docs"
    assert cli.main(["docs", "--html", str(run.html.parent), "--out", str(out)]) == 0
    if not (out / widget_manager.BUNDLE).is_file():
        pytest.fail(f"the widget manager was not vendored: {widget_manager.vendor(out)[1]}")
    return {"out": str(out), "executed": str(run.executed), "page": str(out / "notebooks" / f"{NOTEBOOK}.html")}


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> dict:
    """``build_docs`` once per test session, shared by the xdist workers (a file lock around it)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "browser-docs"
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = root / "built.json"
        if not built.is_file():
            built.write_text(json.dumps(build_docs(root)))
        return {k: Path(v) for k, v in json.loads(built.read_text()).items()}


# ---- the gallery ---------------------------------------------------------------------------------------


def render_gallery(out: Path, tmp_path: Path, *, picture: bool = True) -> tuple[dict, Path | None]:
    page = probed(out / "index.html")
    shown = probe_result(browser.dump_dom(page, window=GALLERY_WINDOW))
    png = browser.screenshot(page, tmp_path / "gallery.png", window=GALLERY_WINDOW) if picture else None
    return shown, png


def in_view(image: dict, window: tuple[int, int]) -> bool:
    left, top, width, height = image["box"]
    return width > 100 and height > 100 and top >= 0 and top + height <= window[1] and left + width <= window[0]


def test_the_gallery_shows_every_committed_figure(docs, tmp_path):
    shown, png = render_gallery(docs["out"], tmp_path)
    manifest = read_manifest(FIGURES_DIR)["figures"]
    expected = sorted(f"figures/{entry['files']['svg']['path']}" for entry in manifest.values())
    assert sorted(i["src"] for i in shown["images"]) == expected
    assert [i["src"] for i in shown["images"] if i["width"] == 0] == []  # every figure decoded
    visible = [i for i in shown["images"] if in_view(i, GALLERY_WINDOW)]
    assert visible, "no figure lies inside the screenshot"
    assert all(painted_fraction(png, i["box"]) > 0.02 for i in visible), "a figure in view is blank"
    text = (docs["out"] / "index.html").read_text()
    assert f'href="notebooks/{NOTEBOOK}.html"' in text  # the notebook page checked below is linked


def test_a_broken_or_blank_figure_is_caught(docs, tmp_path):
    """Negative controls: the same gallery with unreadable figure files (not decoded: width 0) and with
    blank ones of the same size (decoded, but nothing drawn in the screenshot)."""
    broken, blank = tmp_path / "broken", tmp_path / "blank"
    for copy in (broken, blank):
        shutil.copytree(docs["out"], copy, ignore=shutil.ignore_patterns("notebooks", "widgets"))
    for svg in (broken / "figures").glob("*.svg"):
        svg.write_text("not an image")
    for svg in (blank / "figures").glob("*.svg"):
        size = re.search(r'width="([^"]+)" height="([^"]+)"', svg.read_text())
        svg.write_text(f'<svg xmlns="http://www.w3.org/2000/svg" width="{size[1]}" height="{size[2]}"></svg>')
    shown, _ = render_gallery(broken, tmp_path, picture=False)
    assert shown["images"] and all(i["width"] == 0 for i in shown["images"])
    shown, png = render_gallery(blank, tmp_path)
    assert all(i["width"] > 0 for i in shown["images"])
    visible = [i for i in shown["images"] if in_view(i, GALLERY_WINDOW)]
    assert visible and all(painted_fraction(png, i["box"]) < 0.005 for i in visible)


# ---- notebook 02's explore widget, without a kernel ------------------------------------------------------


def slider_state(executed: Path) -> dict:
    """The explore slider as the kernel left it: the state nbclient saved in the executed notebook."""
    state = json.loads(executed.read_text())["metadata"]["widgets"]["application/vnd.jupyter.widget-state+json"]
    [slider] = [m["state"] for m in state["state"].values() if m["model_name"] == "IntSliderModel"]
    return slider


def render_explore_cell(page: Path, tmp_path: Path) -> tuple[dict, dict, Path]:
    """The page's rendered widget text, the probe's result and a screenshot of its explore cell."""
    dom = browser.dump_dom(page)
    cell = probed(page, only_explore_cell=True)
    shown = probe_result(browser.dump_dom(cell, window=CELL_WINDOW))
    png = browser.screenshot(cell, tmp_path / f"{page.stem}.png", window=CELL_WINDOW)
    return widget_text(dom), shown, png


@pytest.fixture(scope="module")
def explore_cell(docs, tmp_path_factory) -> tuple[dict, dict, Path]:
    """Notebook 02's page as the gallery links it, rendered with its widget state and the manager."""
    return render_explore_cell(docs["page"], tmp_path_factory.mktemp("explore"))


def test_notebook_02_shows_its_widget_without_a_kernel(docs, explore_cell):
    slider = slider_state(docs["executed"])
    text, shown, png = explore_cell
    assert slider["description"] in text["widget-slider"]  # the label, rendered by the widget manager
    assert text["widget-readout"] == [str(slider["value"])]  # the value the kernel left, as the reader sees it
    assert any("Controls shown at the values above" in t for t in text["widget-html-content"])
    assert shown["slider"] is not None and painted_fraction(png, shown["slider"]) > 0.02


def test_without_its_state_or_manager_the_widget_is_not_shown(docs, explore_cell, tmp_path):
    """Negative controls: the same page without the widget state, and the gallery without the
    vendored widget manager: no widget element is rendered and nothing is drawn where the slider was."""
    _, with_widget, _ = explore_cell
    page = docs["page"].read_text()
    state = re.compile(r'<script type="application/vnd.jupyter.widget-state\+json">.*?</script>', re.S)
    assert state.search(page)
    no_state = docs["page"].with_name(f"no-state-{os.getpid()}.html")
    no_state.write_text(state.sub("", page))
    text, shown, png = render_explore_cell(no_state, tmp_path)
    assert text == {} and shown["slider"] is None
    assert painted_fraction(png, with_widget["slider"]) < 0.005
    no_manager = tmp_path / "no-manager"
    shutil.copytree(docs["out"], no_manager, ignore=shutil.ignore_patterns("widgets", "figures"))
    text = widget_text(browser.dump_dom(no_manager / "notebooks" / f"{NOTEBOOK}.html"))
    assert text == {}


# ---- nothing from the network ----------------------------------------------------------------------------

REMOTE_SCRIPT = re.compile(r"""(?:\bsrc\s*=\s*|import\(\s*)["'](?:https?:)?//""")  # a script fetched from elsewhere

NEEDS_A_RENDERER = re.compile(r"\$[^$\n]+\$|\\\(|\\\[|\\begin\{|```mermaid|\b(?:Latex|Math)\(")  # TeX, mermaid


def test_the_notebook_page_loads_no_script_from_the_network(docs):
    """No MathJax, mermaid or widget manager from a CDN: an offline reader's page is complete.
    Control: nbconvert's stock export of the same notebook fetches MathJax from a CDN."""
    import nbformat
    from nbconvert import HTMLExporter

    assert REMOTE_SCRIPT.findall(docs["page"].read_text()) == []
    stock, _ = HTMLExporter().from_notebook_node(nbformat.read(str(docs["executed"]), as_version=4))
    assert REMOTE_SCRIPT.findall(stock)


def renderer_needs(nb: dict) -> list[str]:
    """What in a notebook's sources would need MathJax or mermaid, which its HTML does not load."""
    return [m for c in nb["cells"] for m in NEEDS_A_RENDERER.findall("".join(c.get("source", "")))]


@pytest.mark.parametrize("path", notebooks.discover_notebooks(), ids=lambda p: p.name)
def test_no_notebook_writes_tex_or_mermaid(path):
    assert renderer_needs(notebooks.read_notebook(path)) == []


def test_tex_and_mermaid_are_caught():
    """Control of the check above."""
    for source in ("cost is $O(P^2)$", "\\(x\\)", "```mermaid\ngraph TD\n```", "display(Math(r'x'))"):
        assert renderer_needs({"cells": [{"source": source}]}), source
    assert renderer_needs({"cells": [{"source": "chunk 4,096 at ~4,333 tokens (1.38x)"}]}) == []
