"""``python -m benchmarks chart``: a bench report's ratios drawn as an SVG."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from benchmarks.chart import Series, chart_rows, render_svg

REPO_ROOT = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"


def _entry(metric: str, label: str, workload: str, better: str, threads: str,
           values: dict[str, float | None]) -> dict[str, Any]:
    base = values["torch"]
    ratios = {name: (v / base if v is not None and base else None)
              for name, v in values.items() if name != "torch"}
    return {"metric": metric, "threads": threads, "label": label, "unit": "u",
            "better": better, "workload": workload, "values": values, "ratios": ratios,
            "errors": {name: "boom" for name, v in values.items() if v is None}}


def small_report() -> dict[str, Any]:
    """Two thread settings of two workloads, as ``--threads default,1`` writes them: at
    threads=1 torchrpc is twice as fast on latency (a time) and 3x the calls/s (a rate);
    with torch's default threads it is twice as slow on latency and has no throughput."""
    metrics = {}
    for threads, (p50, rate) in (("default", (200.0, None)), ("1", (50.0, 3000.0))):
        for entry in (
                _entry("rpc_sync_p50_us", "small rpc_sync p50 <&>", "latency", "lower",
                       threads, {"torch": 100.0, "torchrpc": p50}),
                _entry("rpc_async_calls_per_s", "rpc_async calls/s", "throughput", "higher",
                       threads, {"torch": 1000.0, "torchrpc": rate})):
            metrics[f"{entry['metric']}@threads={threads}"] = entry
    return {"benchmark": "benchmarks", "baseline": "torch", "threads": ["default", "1"],
            "machine": {"cpu_model": "AMD EPYC test", "cpus": 2}, "metrics": metrics}


def _bars(svg: str) -> list[tuple[float, float, str]]:
    """(x, width, tooltip) of each bar."""
    root = ET.fromstring(svg)
    return [(float(r.get("x")), float(r.get("width")), r.find(f"{SVG}title").text)
            for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]


def test_rows_turn_ratios_into_times_better_per_thread_setting() -> None:
    rows, series = chart_rows([small_report()])
    assert series == [Series("torchrpc", "default"), Series("torchrpc", "1")]
    assert [(r.metric, r.workload) for r in rows] == [("rpc_sync_p50_us", "latency"),
                                                      ("rpc_async_calls_per_s", "throughput")]
    latency, throughput = rows
    assert latency.advantage == {series[0]: pytest.approx(0.5), series[1]: pytest.approx(2.0)}
    assert throughput.advantage == {series[0]: None, series[1]: pytest.approx(3.0)}


def test_the_svg_draws_better_right_and_worse_left_on_a_log_axis() -> None:
    svg = render_svg([small_report()])
    root = ET.fromstring(svg)  # well-formed, the label's <&> escaped
    assert root.tag == f"{SVG}svg"
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "small rpc_sync p50 <&>" in texts and "n/a" in texts
    assert {"latency", "throughput", "torchrpc, torch threads default",
            "torchrpc, torch threads 1"} <= set(texts)
    assert {"0.5x", "2x", "3x"} <= set(texts)
    assert "machine: AMD EPYC test, 2 CPUs" in texts
    middle = [float(line.get("x1")) for line in root.iter(f"{SVG}line")
              if line.get("stroke") == "#000"]
    assert len(middle) == 1
    bars = {tip.split(": ")[0].split(", torch threads ")[-1] + " " + tip.split(": ")[1]: (x, w)
            for x, w, tip in _bars(svg)}
    assert set(bars) == {"default 0.5x", "1 2x", "1 3x"}, bars
    worse, better, best = bars["default 0.5x"], bars["1 2x"], bars["1 3x"]
    assert worse[0] + worse[1] == pytest.approx(middle[0])   # ends at 1, to the left
    assert better[0] == best[0] == pytest.approx(middle[0])  # start at 1, to the right
    assert worse[1] == pytest.approx(better[1])              # 2x either way: one length
    assert best[1] > better[1]


def test_systems_pick_the_bars_and_a_report_without_ratios_is_refused() -> None:
    report = small_report()
    rows, series = chart_rows([report], systems=["torchrpc"])
    assert len(series) == 2
    with pytest.raises(ValueError, match="no ratios"):
        chart_rows([report], systems=["floor"])
    with pytest.raises(ValueError, match="no baseline"):
        chart_rows([{**report, "baseline": None}])


def _chart(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", "chart", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_command_writes_the_chart_of_saved_reports(tmp_path: Path) -> None:
    # One report per thread setting, as two runs write them: the same chart as one report.
    report = small_report()
    halves = []
    for threads in ("default", "1"):
        half = {**report, "threads": [threads],
                "metrics": {k: v for k, v in report["metrics"].items()
                            if v["threads"] == threads}}
        halves.append(tmp_path / f"{threads}.json")
        halves[-1].write_text(json.dumps(half), encoding="utf-8")
    out = tmp_path / "chart.svg"
    proc = _chart(*map(str, halves), "-o", str(out), "--title", "two runs")
    assert proc.returncode == 0, proc.stderr
    svg = out.read_text(encoding="utf-8")
    assert "two runs" in svg
    assert re.sub(r"<text[^>]*>two runs</text>", "", svg) == re.sub(
        r"<text[^>]*>two runs</text>", "", render_svg([report], title="two runs"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    proc = _chart(str(bad), "-o", str(tmp_path / "no.svg"))
    assert proc.returncode == 2 and "JSONDecodeError" in proc.stderr
    assert not (tmp_path / "no.svg").exists()


def test_long_labels_lose_their_parenthesis_then_their_end() -> None:
    report = small_report()
    long = "parameter server, 4 trainers: steps of all (table 1024x32, MLP 32-64-10)"
    longer = "a metric whose label goes on and on and on well beyond the room left of the plot"
    for entry in report["metrics"].values():
        entry["label"] = long if entry["workload"] == "latency" else longer
    texts = [t.text for t in ET.fromstring(render_svg([report])).iter(f"{SVG}text")]
    assert "parameter server, 4 trainers: steps of all" in texts
    cut = [t for t in texts if t and t.startswith("a metric whose")]
    assert len(cut) == 1 and cut[0].endswith("\u2026") and len(cut[0]) <= 52, cut
