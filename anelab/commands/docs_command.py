"""``anelab docs``: the figure gallery (build/docs/index.html) from figures/MANIFEST.json."""

from __future__ import annotations

import argparse

from anelab.core.paths import FIGURES_DIR
from anelab.publish.docs_site import build_docs, vendor_widget_manager


def setup_arg_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--figures", default=None, help="figures directory (default: the committed figures/)")
    p.add_argument("--html", default="build/html", help="executed notebooks' HTML (default: build/html)")
    p.add_argument("--out", default="build/docs", help="output directory (default: build/docs)")


def main(args) -> int:
    index, pages = build_docs(args.figures or FIGURES_DIR, args.html, args.out)
    print(vendor_widget_manager(args.out))
    for page in pages:
        if page.html is None:
            print(f"{page.stem}: {page.missing}")
    print(f"{sum(len(p.figures) for p in pages)} figures from {len(pages)} notebooks -> {index}")
    return 0
