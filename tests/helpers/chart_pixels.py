"""A saved chart read back as pixels: what a reader of the PNG sees, found without the code that drew it.

The charts of launch/analysis/pipeline_chart.py fill boxes with flat colours, so a box is a run
of pixels of its colour along a line across it, and a row of boxes is a band of image rows
holding that colour. Antialiased edges and text blend colours and match none.
"""
from pathlib import Path
from typing import List, Tuple

import numpy as np
from matplotlib import colors, image

IDLE_GREY = "#dddddd"  # the hatched "bubble (idle)" background of a schedule chart


def read_rgb(path: Path) -> np.ndarray:
    """(height, width, 3) floats in [0, 1]; fails unless the file is a readable PNG."""
    return image.imread(path)[:, :, :3]


def colour_mask(rgb: np.ndarray, colour: str, alpha: float = 1.0, tolerance: float = 0.02) -> np.ndarray:
    """Pixels showing `colour` drawn with `alpha` over a white figure."""
    shown = alpha * np.array(colors.to_rgb(colour)) + (1 - alpha)
    return np.abs(rgb - shown).max(axis=2) <= tolerance


def runs(flags: np.ndarray) -> List[Tuple[int, int]]:
    """(start, stop) of each run of True in a 1-D array."""
    padded = np.concatenate([[False], flags, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def longest_run(flags: np.ndarray) -> Tuple[int, int]:
    return max(runs(flags), key=lambda run: run[1] - run[0])


def schedule_area(rgb: np.ndarray) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """(rows, columns) of the schedule axes, from the idle background that fills them behind the
    boxes: the widest span of columns showing it (the legend's small idle swatch lies apart, right
    of the axes), and the rows mostly idle across those columns (the margins above the first row
    of boxes and below the last; antialiased text elsewhere shows a few such pixels). A chart of
    several steps stacks its axes: the rows then span all of them."""
    idle = colour_mask(rgb, IDLE_GREY)
    left, right = longest_run(idle.any(axis=0))
    rows = np.flatnonzero(idle[:, left:right].mean(axis=1) > 0.5)
    return (int(rows[0]), int(rows[-1]) + 1), (left, right)


def idle_share(schedule: np.ndarray, band: Tuple[int, int]) -> float:
    """Share of a line across a row of boxes that shows the hatched idle background: neutral greys
    (#dddddd, its hatch lines, their blends), neither the boxes' colours nor their black edges."""
    top, bottom = band
    line = schedule[top + (bottom - top) // 5]
    grey = (np.ptp(line, axis=1) < 0.02) & (line.min(axis=1) > 0.6) & (line.max(axis=1) < 0.95)
    return float(grey.mean())


def box_rows(mask: np.ndarray) -> List[Tuple[int, int]]:
    """The bands of image rows holding pixels of `mask`: one per row of boxes."""
    return runs(mask.any(axis=1))


def boxes_in_row(mask: np.ndarray, band: Tuple[int, int]) -> int:
    """Boxes of `mask` along a line a fifth into the band: clear of the numbers at the box centres."""
    top, bottom = band
    return len(runs(mask[top + (bottom - top) // 5]))
