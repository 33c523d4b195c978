"""The numbers a figure draws, rounded to what the figure can show, so its bytes do not move with the BLAS kernel.

A float32 result computed through OpenBLAS differs in its last bits from one CPU kernel to another (Haswell,
SkylakeX, ...), and a relative error built from it in its fourth or fifth digit; matplotlib writes SVG
coordinates to six decimals and antialiases PNG edges to 1/256 of a pixel, so those bits reached the committed
figures. ``round_to_drawn_precision`` rounds every data coordinate an axes draws (lines, bars and other patches,
collections: scatter offsets, filled areas, segments; text placed in data coordinates) to a grid of ``AXIS_STEPS`` steps per axis span — in
data units on a linear axis, in decades on a log axis — far finer than a pixel at the gallery's size, and then
recomputes the autoscaled limits from the rounded data (explicit limits are rounded on the same grid).

Rounding makes a kernel's difference vanish unless a value lies within that difference of a grid boundary: with
float32 noise of ~1e-5 of a value and a grid of 1/``AXIS_STEPS`` of the span, about one value in a thousand;
``tests/publish/test_figure_precision.py`` redraws a BLAS-computed figure under two OpenBLAS core types and compares
bytes. Scales other than linear and log (symlog, logit) and the words of a text are left as drawn.

Rounding cannot hold a figure that draws the *difference* of two float32 computations (a sidecar arm against the
reference): there a kernel's last bits flip fp16 roundings and move the difference in its third digit. The studies'
float32 products therefore go through ``anelab.core.matmul`` (float64 accumulation, one rounding), which takes the
kernel out of the numbers themselves (``tests/studies/test_blas_kernels.py``).
"""

from __future__ import annotations

import math

import numpy as np

AXIS_STEPS = 2000  # grid steps per axis span (rounded down to a power of ten): a gallery figure is ~600 px wide


def _grid(lo: float, hi: float) -> float | None:
    """The rounding step for an axis spanning ``lo``..``hi``: a power of ten at most span / AXIS_STEPS."""
    span = abs(hi - lo)
    if not math.isfinite(span) or span <= 0:
        return None
    return 10.0 ** math.floor(math.log10(span / AXIS_STEPS))


def _rounder(axis_scale: str, limits: tuple[float, float]):
    """A function rounding an array of this axis's data coordinates to its grid (None: a scale left as drawn)."""
    if axis_scale == "linear":
        step = _grid(*limits)
        if step is None:
            return None
        return lambda v: np.where(np.isfinite(v), np.round(v / step) * step, v)
    if axis_scale == "log" and min(limits) > 0:
        step = _grid(math.log10(limits[0]), math.log10(limits[1]))
        if step is None:
            return None

        def log_round(v):
            with np.errstate(divide="ignore", invalid="ignore"):
                rounded = 10.0 ** (np.round(np.log10(v) / step) * step)
            return np.where(np.isfinite(v) & (v > 0), rounded, v)

        return log_round
    return None


def _xy(rx, ry, xy) -> np.ndarray:
    """``xy`` [N, 2] with its x column rounded by ``rx`` and its y column by ``ry`` (either may be None)."""
    xy = np.array(xy, dtype=float, copy=True).reshape(-1, 2)
    if rx is not None:
        xy[:, 0] = rx(xy[:, 0])
    if ry is not None:
        xy[:, 1] = ry(xy[:, 1])
    return xy


def _round_axes(ax) -> None:
    from matplotlib import collections, lines, patches, text

    xlim, ylim = ax.get_xlim(), ax.get_ylim()  # the autoscaled limits, settled now
    rx, ry = _rounder(ax.get_xscale(), xlim), _rounder(ax.get_yscale(), ylim)
    if rx is None and ry is None:
        return
    for artist in ax.get_children():
        if isinstance(artist, text.Annotation):  # the point it marks: "data", or a pair such as (axes fraction, data)
            coords = artist.xycoords if isinstance(artist.xycoords, tuple) else (artist.xycoords,) * 2
            point_rx, point_ry = (rx if coords[0] == "data" else None), (ry if coords[1] == "data" else None)
            if point_rx is not None or point_ry is not None:
                artist.xy = tuple(_xy(point_rx, point_ry, [artist.xy])[0])
        if isinstance(artist, collections.Collection):
            _round_collection(ax, artist, rx, ry)
            continue
        transform = artist.get_data_transform() if isinstance(artist, patches.Patch) else artist.get_transform()
        ax_rx, ax_ry = _rounders_for(ax, transform, rx, ry)
        if ax_rx is None and ax_ry is None:
            continue
        if isinstance(artist, text.Text):
            artist.set_position(tuple(_xy(ax_rx, ax_ry, [artist.get_position()])[0]))
        elif isinstance(artist, lines.Line2D):
            x, y = artist.get_xdata(orig=True), artist.get_ydata(orig=True)
            plain = not (np.ma.is_masked(x) or np.ma.is_masked(y))  # a masked point stays hidden: left as drawn
            if plain and np.asarray(x).dtype.kind in "fiu" and np.asarray(y).dtype.kind in "fiu":
                artist.set_data(_xy(ax_rx, ax_ry, np.column_stack([np.ravel(x), np.ravel(y)])).T)
        elif isinstance(artist, patches.Rectangle):
            corners = [artist.get_xy(), (artist.get_x() + artist.get_width(), artist.get_y() + artist.get_height())]
            (x0, y0), (x1, y1) = _xy(ax_rx, ax_ry, corners)
            artist.set_bounds(x0, y0, x1 - x0, y1 - y0)
        elif isinstance(artist, patches.Polygon):
            artist.set_xy(_xy(ax_rx, ax_ry, artist.get_xy()))
    _settle_limits(ax, rx, ry, xlim, ylim)


def _rounders_for(ax, transform, rx, ry):
    """The (x, y) rounders for coordinates drawn through ``transform``: both for data; one for a blended transform
    (``axhline`` / ``axhspan``: y in data, x a fraction of the axes; ``axvline`` / ``axvspan`` the other way)."""
    if transform == ax.transData:
        return rx, ry
    if transform == ax.get_yaxis_transform(which="grid"):
        return None, ry
    if transform == ax.get_xaxis_transform(which="grid"):
        return rx, None
    return None, None


def _round_collection(ax, coll, rx, ry) -> None:
    from matplotlib import collections

    offset_rx, offset_ry = _rounders_for(ax, coll.get_offset_transform(), rx, ry)
    if (offset_rx or offset_ry) and len(coll.get_offsets()):
        coll.set_offsets(_xy(offset_rx, offset_ry, coll.get_offsets()))
    path_rx, path_ry = _rounders_for(ax, coll.get_transform(), rx, ry)
    if path_rx is None and path_ry is None:
        return  # marker shapes in points (scatter), not data
    if isinstance(coll, collections.LineCollection):
        coll.set_segments([_xy(path_rx, path_ry, seg) for seg in coll.get_segments()])
    elif isinstance(coll, collections.PolyCollection):
        coll.set_verts([_xy(path_rx, path_ry, path.vertices) for path in coll.get_paths()])


def _settle_limits(ax, rx, ry, xlim, ylim) -> None:
    """Autoscaled limits recomputed from the rounded data; explicit ones rounded on the same grid. Rounding is
    monotone, so the data's rounded bounds are the bounds of the rounded data (``relim`` would not do: a
    ``fill_between`` keeps the bounds of the data it was given)."""
    ax.dataLim.set_points(_xy(rx, ry, ax.dataLim.get_points()))
    for rounder, limits, autoscaled, setter in (
        (rx, xlim, ax.get_autoscalex_on(), ax.set_xlim),
        (ry, ylim, ax.get_autoscaley_on(), ax.set_ylim),
    ):
        if rounder is not None and not autoscaled:
            setter(*rounder(np.array(limits, dtype=float)))
    ax.autoscale_view()


def round_to_drawn_precision(fig) -> None:
    """Round, in place, every data coordinate ``fig``'s axes draw to the grid its axis can show (module docstring)."""
    for ax in fig.axes:
        _round_axes(ax)
