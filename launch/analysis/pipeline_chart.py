"""Pictures of a 3D layout: the devices as a dp x pp x tp grid, and a pipeline schedule.

The schedule is drawn from a list of events (stage, kind, microbatch, start, end), kind "F", "B"
or "W" (ZB-H1's weight-gradient pass), so the same chart shows a simulated schedule
(launch/analysis/schedule_sim.py) or measured times (launch/instruments/timeline.py).
"""
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from launch.analysis.schedule_sim import Event  # noqa: E402

COLOURS = {"F": "#8ecae6", "B": "#f4a261", "W": "#90be6d"}


def draw_schedule(ax: Axes, events: Sequence[Event], title: str) -> None:
    """Stages on y (stage 0 on top), time on x; F/B boxes with micro-batch numbers; idle shaded."""
    pp = max(e[0] for e in events) + 1
    t0, t1 = min(e[3] for e in events), max(e[4] for e in events)
    ax.add_patch(Rectangle((t0, -0.5), t1 - t0, pp, facecolor="#dddddd", hatch="//",
                           edgecolor="#bbbbbb", linewidth=0))  # idle shows where no box covers it
    label_min = (t1 - t0) / 60  # boxes narrower than this get no number
    for stage, kind, micro, start, end in events:
        ax.add_patch(Rectangle((start, stage - 0.4), end - start, 0.8, facecolor=COLOURS[kind],
                               edgecolor="black", linewidth=0.5))
        if end - start >= label_min:
            ax.text((start + end) / 2, stage, str(micro), ha="center", va="center", fontsize=7)
    ax.set_xlim(t0, t1)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp), [f"stage {k}" for k in range(pp)])
    ax.set_xlabel("time (s)")
    ax.set_title(title)
    split = any(e[1] == "W" for e in events)  # ZB-H1: the backward is B (input grads) and W
    labels = {"F": "forward", "B": "B (input grads)" if split else "backward", "W": "W (weight grads)"}
    ax.legend(handles=[Patch(facecolor=COLOURS[kind], label=labels[kind]) for kind in ("FBW" if split else "FB")]
              + [Patch(facecolor="#dddddd", hatch="//", label="bubble (idle)")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)  # outside: never hides a box


def draw_device_grid(ax: Axes, tp: int, pp: int, dp: int) -> None:
    """One cell per device, labelled with its global rank: DP replicas side by side, pipeline
    stages as rows coloured by stage, the tp devices of one TP group outlined together.
    Ranks follow the topology's axis order (pipe, data, model): pipe*dp*tp + data*tp + model."""
    colours = plt.get_cmap("tab10" if pp <= 10 else "viridis")
    label = tp * pp * dp <= 256
    for data in range(dp):
        x0 = data * (tp + 0.6)
        for stage in range(pp):
            colour = colours(stage % 10 if pp <= 10 else stage / max(pp - 1, 1))
            for model in range(tp):
                ax.add_patch(Rectangle((x0 + model, stage), 1, 1, facecolor=colour, alpha=0.55,
                                       edgecolor="white", linewidth=0.5))
                if label:
                    ax.text(x0 + model + 0.5, stage + 0.5, str(stage * dp * tp + data * tp + model),
                            ha="center", va="center", fontsize=6)
            ax.add_patch(Rectangle((x0, stage), tp, 1, fill=False, edgecolor="black", linewidth=1.2))
        ax.text(x0 + tp / 2, -0.15, f"dp {data}", ha="center", va="bottom", fontsize=7)
    ax.set_xlim(-0.2, dp * (tp + 0.6))
    ax.set_ylim(pp + 0.1, -0.6)
    ax.set_yticks([k + 0.5 for k in range(pp)], [f"stage {k}" for k in range(pp)])
    ax.set_xticks([])
    ax.set_title(f"{tp * pp * dp} devices = dp {dp} x pp {pp} x tp {tp}: colour = pipeline stage, "
                 f"outlined = one TP group, columns of boxes = DP replicas", fontsize=9)


def draw_plan(path: str, tp: int, pp: int, dp: int, events: Sequence[Event], title: str) -> None:
    """The layout grid above the schedule, in one PNG."""
    fig, (grid, schedule) = plt.subplots(2, 1, figsize=(13, 2.5 + 0.7 * pp),
                                         gridspec_kw={"height_ratios": [1, 1]})
    draw_device_grid(grid, tp, pp, dp)
    draw_schedule(schedule, events, title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
