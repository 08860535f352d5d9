"""bench/dashboard_render.py's drawing: each panel where the dashboard's gridPos puts it (24 columns,
rows of equal height), a line per series with its legend, the y axis in the panel's unit, in
Grafana's dark theme and palette."""

from __future__ import annotations

import math

GRID_COLUMNS = 24
UNIT_INCHES = 0.27  # one gridPos row unit (Grafana's 30 px at its scale)
FIGURE_WIDTH_INCHES = 20.0
DPI = 72
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
PALETTE = ("#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0", "#37872d")


def unit_formatter(unit: str):
    """A matplotlib tick formatter for a Grafana unit (those the dashboard uses; "short" and others: plain
    numbers, k and M past a thousand)."""
    from matplotlib.ticker import EngFormatter, FuncFormatter, PercentFormatter

    if unit == "percentunit":
        return PercentFormatter(xmax=1.0, decimals=None)  # (None: as many decimals as the range needs)
    if unit in ("s", "Bps", "reqps", "ops"):
        return EngFormatter(unit={"s": "s", "Bps": "B/s", "reqps": "req/s", "ops": "ops/s"}[unit], sep=" ")
    short = EngFormatter(sep="")
    return FuncFormatter(lambda value, at: short(value, at) if abs(value) >= 1000 else f"{value:g}")


def draw_dashboard(rows: list[dict], panels: list[tuple[dict, list]], subtitle: str, path: str) -> None:
    """Write the PNG: `rows` the dashboard's row panels (section titles), `panels` each graph panel with
    its curves (bench/dashboard_render.py's Curve)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    height_units = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in rows + [panel for panel, _ in panels]) + 2
    figure = plt.figure(figsize=(FIGURE_WIDTH_INCHES, height_units * UNIT_INCHES), dpi=DPI, facecolor=BACKGROUND)
    top = 2.0  # grid units above the first panel: the title and subtitle

    def box(grid: dict) -> tuple[float, float, float, float]:
        """The panel's (left, bottom, width, height) in figure fractions."""
        left = grid["x"] / GRID_COLUMNS
        bottom = 1 - (top + grid["y"] + grid["h"]) / height_units
        return left, bottom, grid["w"] / GRID_COLUMNS, grid["h"] / height_units

    figure.text(0.005, 1 - 0.6 / height_units, "pdserve", color=TEXT, fontsize=18, weight="bold", va="center")
    figure.text(0.065, 1 - 0.6 / height_units, subtitle, color=TEXT, fontsize=9.5, va="center", wrap=True)
    for row in rows:
        left, bottom, _, height = box(row["gridPos"])
        figure.text(
            left + 0.005, bottom + height / 2, row["title"], color=TEXT, fontsize=13, weight="bold", va="center"
        )
    for panel, curves in panels:
        left, bottom, width, height = box(panel["gridPos"])
        # the panel's background fills its cell; the axes sit inside it, leaving room for the title and ticks
        frame = figure.add_axes((left + 0.002, bottom + 0.002, width - 0.004, height - 0.004))
        frame.set_facecolor(PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for spine in frame.spines.values():
            spine.set_color(GRID)
        frame.set_title(" " + panel["title"], color=TEXT, fontsize=11, loc="left", y=1.0, pad=-14, weight="bold")
        # (in grid units: 1.2 above for the title, 1.5 below for the ticks and the axis label)
        axes = figure.add_axes((left + 0.042, bottom + 1.5 / height_units, width - 0.052, height - 2.7 / height_units))
        _draw_panel(axes, panel, curves)
    figure.savefig(path, facecolor=BACKGROUND)
    plt.close(figure)


def _draw_panel(axes, panel: dict, curves: list) -> None:
    axes.set_facecolor(PANEL)
    for spine in axes.spines.values():
        spine.set_visible(False)
    axes.tick_params(colors=TEXT, labelsize=8, length=0)
    axes.grid(color=GRID, linewidth=0.8)
    axes.yaxis.set_major_formatter(unit_formatter(panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")))
    axes.set_xlabel("seconds since the load began", color=TEXT, fontsize=8, labelpad=1)
    drawn = 0
    for curve in curves:
        points = [(t, v) for t, v in zip(curve.times, curve.values) if not math.isnan(v) and not math.isinf(v)]
        if not points:
            continue  # (Grafana draws no line for NaN: no observations in the window)
        color = PALETTE[drawn % len(PALETTE)]
        axes.plot([t for t, _ in points], [v for _, v in points], color=color, linewidth=1.6, label=curve.legend)
        drawn += 1
    if not drawn:
        axes.text(0.5, 0.5, "No data", color=TEXT, fontsize=12, ha="center", va="center", transform=axes.transAxes)
        axes.set_xticks([])
        axes.set_yticks([])
        return
    axes.set_ylim(bottom=0)
    legend = axes.legend(loc="upper left", fontsize=7.5, frameon=True, ncol=2 if drawn > 3 else 1)
    legend.get_frame().set_facecolor(PANEL)
    legend.get_frame().set_edgecolor(GRID)
    for text in legend.get_texts():
        text.set_color(TEXT)
