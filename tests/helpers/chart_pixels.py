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


def neutral_grey(rgb: np.ndarray) -> np.ndarray:
    """Pixels of the hatched idle background: neutral greys (#dddddd, its hatch lines, their
    blends), neither the boxes' colours, nor their black edges and the axes' frame, nor white."""
    return (np.ptp(rgb, axis=-1) < 0.02) & (rgb.min(axis=-1) > 0.6) & (rgb.max(axis=-1) < 0.95)


def schedule_area(rgb: np.ndarray) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """(rows, columns) of the schedule axes, from the idle background that fills them behind the
    boxes. The columns: the widest unbroken run of it along an image row, which the axes' black
    frame ends on both sides (the margin above the first row of boxes is all background). Columns
    holding an idle pixel anywhere would not do: antialiased tick labels and the legend's frame
    hold a few, and at some tick positions they join the axes to the legend and its swatches.
    The rows: those mostly idle across those columns (the margins above and below each row of
    boxes). A chart of several steps stacks its axes: the rows then span all of them."""
    left, right = max((longest_run(line) for line in neutral_grey(rgb) if line.any()),
                      key=lambda run: run[1] - run[0])
    idle = colour_mask(rgb, IDLE_GREY)
    rows = np.flatnonzero(idle[:, left:right].mean(axis=1) > 0.5)
    return (int(rows[0]), int(rows[-1]) + 1), (left, right)


def idle_share(schedule: np.ndarray, band: Tuple[int, int]) -> float:
    """Share of a line across a row of boxes that shows the hatched idle background."""
    top, bottom = band
    return float(neutral_grey(schedule[top + (bottom - top) // 5]).mean())


def box_rows(mask: np.ndarray) -> List[Tuple[int, int]]:
    """The bands of image rows holding pixels of `mask`: one per row of boxes."""
    return runs(mask.any(axis=1))


def boxes_in_row(mask: np.ndarray, band: Tuple[int, int]) -> int:
    """Boxes of `mask` along a line a fifth into the band: clear of the numbers at the box centres."""
    top, bottom = band
    return len(runs(mask[top + (bottom - top) // 5]))
