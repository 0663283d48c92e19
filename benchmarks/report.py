"""Turning measured cells into the JSON document and the markdown table."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .metrics import MetricSpec

__all__ = ["Cell", "build_report", "combine_reports", "render_markdown", "threads_label"]


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


def threads_label(torch_threads: int) -> str:
    """How a thread setting is named in reports: ``"default"`` (0: torch's own choice) or
    the count of torch's intra-op threads per worker, e.g. ``"1"``."""
    return "default" if torch_threads == 0 else str(torch_threads)


def build_report(*, specs: list[MetricSpec], systems: dict[str, dict[str, str]],
                 baseline: str | None, cells: dict[str, dict[str, Cell]],
                 details: dict[str, dict[str, Any]], sessions: list[dict[str, Any]],
                 machine: dict[str, Any], options: dict[str, Any], command: str,
                 workloads: list[str], rounds: int = 1,
                 samples: dict[str, dict[str, list[float]]] | None = None,
                 warnings: list[str] | None = None, threads: str = "1") -> dict[str, Any]:
    """Assemble the JSON document: every metric with every system's value or error.

    ``samples`` holds each round's values; with ``rounds > 1`` they are kept beside the
    medians so the spread can be seen. ``threads`` names the thread setting the run had
    (:func:`threads_label`); every metric, details entry and session carries it.
    """
    metrics: dict[str, Any] = {}
    for spec in specs:
        values = {name: cells[name][spec.name].value for name in systems}
        errors = {name: cells[name][spec.name].error for name in systems
                  if cells[name][spec.name].error is not None}
        entry: dict[str, Any] = {
            "metric": spec.name, "threads": threads,
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
        "benchmark": "benchmarks",
        "command": command,
        "machine": machine,
        "options": options,
        "threads": [threads],
        "workloads": workloads,
        "rounds": rounds,
        "systems": systems,
        "baseline": baseline,
        "metrics": metrics,
        "details": {system: {key: [_with_threads(item, threads) for item in items]
                             for key, items in per_system.items()}
                    for system, per_system in details.items()},
        "warnings": notes,
        "sessions": [_with_threads(session, threads) for session in sessions],
    }


def _with_threads(item: Any, threads: str) -> Any:
    return {**item, "threads": threads} if isinstance(item, dict) else item


def combine_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One document from the reports of the same run under several thread settings.

    A single report is returned as it is. Otherwise each metric's key gets its setting,
    ``NAME@threads=SETTING`` (the entry keeps ``metric`` and ``threads``); details and
    sessions (each entry tagged with its setting) and warnings are joined, in the order of
    the settings; ``options`` lose ``torch_threads``, which the top-level ``threads`` list
    replaces.
    """
    if len(reports) == 1:
        return reports[0]
    first = reports[0]
    combined = dict(first)
    combined["options"] = {k: v for k, v in first["options"].items() if k != "torch_threads"}
    combined["threads"] = [label for report in reports for label in report["threads"]]
    combined["metrics"] = {f"{name}@threads={entry['threads']}": entry
                           for report in reports for name, entry in report["metrics"].items()}
    details: dict[str, dict[str, list[Any]]] = {}
    for report in reports:
        for system, per_system in report["details"].items():
            for key, items in per_system.items():
                details.setdefault(system, {}).setdefault(key, []).extend(items)
    combined["details"] = details
    combined["warnings"] = [f"threads={report['threads'][0]}: {warning}"
                            for report in reports for warning in report["warnings"]]
    combined["sessions"] = [session for report in reports for session in report["sessions"]]
    return combined


def _threads_heading(report: dict[str, Any], label: str) -> str:
    """``1``, or ``default`` with the count torch chose in the workers, where they said."""
    if label != "default":
        return label
    counts = sorted({item.get("torch_threads") for per_system in report["details"].values()
                     for items in per_system.values() for item in items
                     if isinstance(item, dict) and item.get("threads") == label
                     and isinstance(item.get("torch_threads"), int)})
    return (f"default (torch's own: {', '.join(map(str, counts))} per worker)" if counts
            else "default (torch's own)")


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
    out = [f"# benchmarks: {', '.join(systems)}", "",
           f"`{report['command']}`", "",
           f"{machine.get('cpu_model', '?')}, {machine.get('cpus', '?')} CPUs, "
           f"{machine.get('memory_GiB', '?')} GiB, {machine.get('platform', '?')}, "
           f"Python {machine.get('python', '?')}, torch {machine.get('torch', '?')}; "
           f"{machine.get('date_utc', '')}", ""]
    settings = report.get("threads") or ["?"]
    several = len(settings) > 1
    for label in settings:
        entries = [e for e in report["metrics"].values() if e.get("threads", label) == label]
        heading = f"torch intra-op threads per worker: {_threads_heading(report, label)}"
        out += [f"## {heading}" if several else f"{heading}.", ""]
        pair = [e for e in entries if e["workload"] != "scale"]
        scale = [e for e in entries if e["workload"] == "scale"]
        if pair:
            out += table(pair) + [""]
        if scale:
            out += [f"{'###' if several else '##'} Scale: init_rpc, all-to-all, graceful "
                    f"shutdown", ""] + table(scale) + [""]
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
