"""Turning measured cells into the JSON document and the markdown table."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .metrics import MetricSpec

__all__ = ["Cell", "build_report", "render_markdown"]


@dataclasses.dataclass
class Cell:
    """One system's value for one metric, or the reason there is none."""

    value: float | None = None
    error: str | None = None

    @classmethod
    def of(cls, value: Any) -> Cell:
        """A cell for ``value``, turning non-numbers and NaN/inf into errors."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return cls(error=f"not a number: {value!r}")
        if not math.isfinite(value):
            return cls(error=f"not a finite number: {value!r}")
        return cls(value=float(value))


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def build_report(*, specs: list[MetricSpec], systems: dict[str, dict[str, str]],
                 baseline: str | None, cells: dict[str, dict[str, Cell]],
                 details: dict[str, dict[str, Any]], sessions: list[dict[str, Any]],
                 machine: dict[str, Any], options: dict[str, Any], command: str,
                 workloads: list[str], rounds: int = 1,
                 samples: dict[str, dict[str, list[float]]] | None = None,
                 warnings: list[str] | None = None) -> dict[str, Any]:
    """Assemble the JSON document: every metric with every system's value or error.

    ``samples`` holds each round's values; with ``rounds > 1`` they are kept beside the
    medians so the spread can be seen.
    """
    metrics: dict[str, Any] = {}
    for spec in specs:
        values = {name: cells[name][spec.name].value for name in systems}
        errors = {name: cells[name][spec.name].error for name in systems
                  if cells[name][spec.name].error is not None}
        entry: dict[str, Any] = {
            "label": spec.label, "unit": spec.unit, "better": spec.better,
            "workload": spec.workload, "values": values, "errors": errors,
        }
        if rounds > 1 and samples is not None:
            entry["rounds"] = {name: samples[name][spec.name] for name in systems}
        if baseline is not None:
            entry["ratios"] = {name: _ratio(values[name], values[baseline])
                               for name in systems if name != baseline}
        if spec.target is not None:
            entry["target"] = dataclasses.asdict(spec.target)
            if spec.target.kind == "ratio":
                entry["target_met"] = {name: spec.target.met(ratio)
                                       for name, ratio in entry.get("ratios", {}).items()}
            else:
                entry["target_met"] = {name: spec.target.met(values[name])
                                       for name in systems if name != baseline}
        metrics[spec.name] = entry
    notes = list(warnings or [])
    notes += [f"{s['system']} {'+'.join(s['workloads'])}: {w}" for s in sessions
              for w in s["warnings"] if not s["error"]]
    return {
        "benchmark": "torchrpc.bench",
        "command": command,
        "machine": machine,
        "options": options,
        "workloads": workloads,
        "rounds": rounds,
        "systems": systems,
        "baseline": baseline,
        "metrics": metrics,
        "details": details,
        "warnings": notes,
        "sessions": sessions,
    }


def _fmt(value: float) -> str:
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if magnitude >= 0.01 else f"{value:.2g}"


def _mark(met: bool | None) -> str:
    return "" if met is None else (" ✓" if met else " ✗")


def _error_word(message: str) -> str:
    lowered = message.lower()
    if lowered.startswith("timeout"):
        return "timeout"
    if lowered.startswith("skipped"):
        return "skipped"
    return "error"


def render_markdown(report: dict[str, Any]) -> str:
    """The report as markdown: machine line, one table per group, error footnotes."""
    systems = list(report["systems"])
    baseline = report["baseline"]
    others = [name for name in systems if name != baseline]
    footnotes: dict[str, int] = {}

    def value_cell(name: str, entry: dict[str, Any]) -> str:
        value = entry["values"][name]
        if value is None:
            message = f"{name}: {entry['errors'].get(name, 'no value')}"
            number = footnotes.setdefault(message, len(footnotes) + 1)
            return f"{_error_word(entry['errors'].get(name, ''))} [{number}]"
        text = _fmt(value)
        target = entry.get("target")
        if target and target["kind"] == "absolute" and name != baseline:
            text += _mark(entry["target_met"].get(name))
        return text

    header = ["metric", "unit", "better"] + systems
    if baseline is not None:
        header += [f"{name} / {baseline}" for name in others]
    header.append("target")
    align = ["---", "---", "---"] + ["---:"] * (len(header) - 4) + ["---"]

    def table(entries: list[dict[str, Any]]) -> list[str]:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
        for entry in entries:
            row = [entry["label"], entry["unit"], entry["better"]]
            row += [value_cell(name, entry) for name in systems]
            if baseline is not None:
                for name in others:
                    ratio = entry["ratios"][name]
                    text = "–" if ratio is None else f"{ratio:.2f}"
                    target = entry.get("target")
                    if ratio is not None and target and target["kind"] == "ratio":
                        text += _mark(entry["target_met"].get(name))
                    row.append(text)
            target = entry.get("target")
            if target is None:
                row.append("")
            elif target["kind"] == "ratio":
                row.append(f"ratio {target['op']} {target['value']:g} ({target['source']})")
            else:
                row.append(f"{target['op']} {target['value']:g} {entry['unit']} "
                           f"({target['source']})")
            lines.append("| " + " | ".join(row).replace("<=", "≤").replace(">=", "≥") + " |")
        return lines

    machine = report["machine"]
    out = [f"# torchrpc.bench: {', '.join(systems)}", "",
           f"`{report['command']}`", "",
           f"{machine.get('cpu_model', '?')}, {machine.get('cpus', '?')} CPUs, "
           f"{machine.get('memory_GiB', '?')} GiB, {machine.get('platform', '?')}, "
           f"Python {machine.get('python', '?')}, torch {machine.get('torch', '?')}; "
           f"{machine.get('date_utc', '')}", ""]
    entries = list(report["metrics"].values())
    pair = [e for e in entries if e["workload"] != "scale"]
    scale = [e for e in entries if e["workload"] == "scale"]
    if pair:
        out += table(pair) + [""]
    if scale:
        out += ["## Scale: init_rpc, all-to-all, graceful shutdown", ""] + table(scale) + [""]
    if footnotes:
        out += ["Errors:", ""]
        out += [f"{number}. {message}" for message, number in footnotes.items()]
        out.append("")
    if report["warnings"]:
        out += ["Warnings:", ""] + [f"- {w}" for w in report["warnings"]] + [""]
    rounds = report.get("rounds", 1)
    out.append("Ratios are the compared system's value over the baseline's; 'better' says "
               "which direction wins. Echo GB/s = 2 x size / median round trip. Each "
               "system runs in its own fresh worker processes"
               + (f"; values are medians over {rounds} rounds." if rounds > 1 else "."))
    return "\n".join(out) + "\n"
