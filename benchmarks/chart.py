"""``python -m benchmarks chart REPORT.json [...] -o chart.svg``: the ratios as a picture.

Reads one or more JSON reports of the bench (``--json-out``; a run with ``--threads
default,1`` holds both thread settings, or give one report per setting) and writes an SVG
bar chart, in plain Python with no plotting library: one row per metric, grouped by
workload, one bar per system and thread setting. Every bar is that system's figure
against the baseline (torch), turned so that right of the middle line is better and left
is worse whatever the metric's direction: ``value / torch`` for a rate, ``torch / value``
for a time or a size. The axis is logarithmic, so 2x better and 2x worse are the same
length; it reaches from the worst bar to the best, and at least 2x each way. A metric with no ratio (an error, a missing system) shows ``n/a``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

__all__ = ["Row", "Series", "chart_rows", "main", "render_svg"]

_WIDTH = 960
_LABEL_W = 330      # the metric labels, left of the plot
_PLOT_X0 = _LABEL_W + 20
_PLOT_X1 = _WIDTH - 70  # room for the value beside a bar that reaches the edge
_LABEL_CHARS = 52   # what fits in _LABEL_W at the labels' size
_BAR_H = 11
_BAR_GAP = 2
_ROW_GAP = 9
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#7f7f7f")


@dataclasses.dataclass(frozen=True)
class Series:
    """One bar colour: a system under one thread setting."""

    system: str
    threads: str

    @property
    def name(self) -> str:
        """How the legend names it."""
        return f"{self.system}, torch threads {self.threads}"


@dataclasses.dataclass
class Row:
    """One metric: its label, workload, direction, and each series' advantage (``None``
    where the report has no ratio)."""

    metric: str
    label: str
    workload: str
    better: str
    advantage: dict[Series, float | None]


def _advantage(ratio: Any, better: str) -> float | None:
    """How many times better than the baseline (below 1: worse) a ratio is."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        return None
    if not math.isfinite(ratio) or ratio <= 0:
        return None
    return float(ratio) if better == "higher" else 1.0 / float(ratio)


def chart_rows(reports: list[dict[str, Any]],
               systems: list[str] | None = None) -> tuple[list[Row], list[Series]]:
    """The rows and series of the chart of ``reports``, in the reports' order.

    ``systems`` keeps only those systems (default: every system with ratios). A metric
    measured under the same thread setting in two reports takes the later report's value.
    """
    rows: dict[str, Row] = {}
    series: list[Series] = []
    for report in reports:
        if not report.get("baseline"):
            raise ValueError("the report has no baseline to take ratios against: run the "
                             "bench with torch and at least one other system")
        for key, entry in report["metrics"].items():
            threads = str(entry.get("threads", "1"))
            metric = entry.get("metric", key.split("@")[0])
            row = rows.setdefault(metric, Row(metric, entry.get("label", metric),
                                              entry.get("workload", ""),
                                              entry.get("better", "lower"), {}))
            for system, ratio in entry.get("ratios", {}).items():
                if systems is not None and system not in systems:
                    continue
                one = Series(system, threads)
                if one not in series:
                    series.append(one)
                row.advantage[one] = _advantage(ratio, row.better)
    if not series:
        raise ValueError("no ratios to draw: the reports hold no system besides the "
                         "baseline" + (f" among {', '.join(systems)}" if systems else ""))
    order = {name: i for i, name in enumerate(dict.fromkeys(r.workload for r in rows.values()))}
    ordered = sorted(rows.values(), key=lambda r: order[r.workload])  # stable within one
    return ordered, series


def _span(rows: list[Row]) -> tuple[int, int]:
    """The axis' ends as powers of two, at least 2x each side of 1, holding every bar."""
    logs = [math.log2(v) for r in rows for v in r.advantage.values() if v]
    return (min(-1, math.floor(min(logs, default=0) - 0.05)),
            max(1, math.ceil(max(logs, default=0) + 0.05)))


def _x(advantage: float, span: tuple[int, int]) -> float:
    low, high = span
    return _PLOT_X0 + (math.log2(advantage) - low) / (high - low) * (_PLOT_X1 - _PLOT_X0)


def _fit(label: str) -> str:
    """The label, less a closing parenthesis or its end, within the room left of the plot."""
    if len(label) > _LABEL_CHARS and label.endswith(")") and " (" in label:
        label = label[:label.rindex(" (")]
    return label if len(label) <= _LABEL_CHARS else label[:_LABEL_CHARS - 1] + "\u2026"


def _text(x: float, y: float, text: str, anchor: str = "start", size: int = 12,
          extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"'
            f'{extra}>{escape(text)}</text>')


def _times(value: float) -> str:
    """``2.1x``, ``0.62x``: two significant figures."""
    return f"{value:.2g}x" if value < 10 else f"{value:.0f}x"


def render_svg(reports: list[dict[str, Any]], systems: list[str] | None = None,
               title: str | None = None) -> str:
    """The SVG document of the chart of ``reports`` (see the module docstring)."""
    rows, series = chart_rows(reports, systems)
    baseline = reports[0]["baseline"]
    span = _span(rows)
    machine = reports[0].get("machine", {})
    heading = title or f"Against {baseline}: times better (right) or worse (left)"
    subtitle = ", ".join(form.format(machine[key]) for key, form in (
        ("cpu_model", "{}"), ("cpus", "{} CPUs"), ("torch", "torch {}"), ("date_utc", "{} UTC"))
        if machine.get(key) is not None)
    top = 58 + 18 * len(series)
    body: list[str] = [_text(12, 22, heading, size=15, extra=' font-weight="bold"'),
                       _text(12, 40, f"machine: {subtitle}" if subtitle else "", size=11)]
    for i, one in enumerate(series):
        y = 52 + 18 * i
        body.append(f'<rect x="12" y="{y}" width="14" height="11" '
                    f'fill="{_COLORS[i % len(_COLORS)]}"/>')
        body.append(_text(32, y + 10, one.name, size=11))
    y = top + 22
    workload = None
    for row in rows:
        if row.workload != workload:
            workload = row.workload
            body.append(_text(12, y + 4, workload, size=12, extra=' font-weight="bold"'))
            y += 14
        height = len(series) * (_BAR_H + _BAR_GAP)
        body.append(_text(_LABEL_W + 10, y + height / 2 + 4, _fit(row.label), anchor="end",
                          size=11))
        for i, one in enumerate(series):
            value = row.advantage.get(one)
            bar_y = y + i * (_BAR_H + _BAR_GAP)
            middle = _x(1.0, span)
            if value is None:
                body.append(_text(middle + 4, bar_y + _BAR_H - 2, "n/a", size=9,
                                  extra=' fill="#777"'))
                continue
            end = _x(value, span)
            left, width = min(middle, end), max(abs(end - middle), 1.0)
            body.append(f'<rect x="{left:.1f}" y="{bar_y}" width="{width:.1f}" '
                        f'height="{_BAR_H}" fill="{_COLORS[series.index(one) % len(_COLORS)]}">'
                        f'<title>{escape(f"{row.label}, {one.name}: {_times(value)}")}</title>'
                        f'</rect>')
            beside = end + 4 if value >= 1 else end - 4
            body.append(_text(beside, bar_y + _BAR_H - 2, _times(value), size=9,
                              anchor="start" if value >= 1 else "end"))
        y += height + _ROW_GAP
    bottom = y + 4
    axis = [f'<line x1="{_x(1.0, span):.1f}" y1="{top}" x2="{_x(1.0, span):.1f}" '
            f'y2="{bottom}" stroke="#000" stroke-width="1"/>']
    for power in range(span[0], span[1] + 1):
        x = _x(2.0 ** power, span)
        axis.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" '
                    f'stroke="#ddd" stroke-width="1"/>')
        axis.append(_text(x, top - 4, "1" if power == 0 else _times(2.0 ** power),
                          anchor="middle", size=10))
    axis.append(_text(_x(1.0, span) - 8, bottom + 16, f"worse than {baseline}", anchor="end",
                      size=11))
    axis.append(_text(_x(1.0, span) + 8, bottom + 16, f"better than {baseline}", size=11))
    height = bottom + 28
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
        f'viewBox="0 0 {_WIDTH} {height}" font-family="sans-serif">',
        f'<rect width="{_WIDTH}" height="{height}" fill="#fff"/>',
        *axis, *body, "</svg>", ""])


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks chart``: read the reports, write the SVG; the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks chart",
        description="Draw the ratios of bench reports (--json-out) as an SVG bar chart.")
    parser.add_argument("reports", nargs="+", type=Path, help="JSON reports of the bench")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the SVG to write")
    parser.add_argument("--systems", default=None,
                        help="comma-separated systems to draw (default: all but the baseline)")
    parser.add_argument("--title", default=None, help="the chart's heading")
    args = parser.parse_args(argv)
    try:
        reports = [json.loads(path.read_text(encoding="utf-8")) for path in args.reports]
        svg = render_svg(reports, args.systems.split(",") if args.systems else None,
                         args.title)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"python -m benchmarks chart: {exc!r}", file=sys.stderr)
        return 2
    args.output.write_text(svg, encoding="utf-8")
    return 0
