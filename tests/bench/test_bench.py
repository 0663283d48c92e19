"""The side-by-side benchmark, ``python -m benchmarks``, run end to end.

These run the real program as a subprocess, as a user would, with ``--quick`` sizes. They
check the shape of the report, not the speed: every metric must have a number for torch and
for torchrpc, and a system that cannot even be imported must become an error row.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch.distributed

from benchmarks.metrics import metric_specs
from benchmarks.options import DEFAULT_WORKLOADS, QUICK_OVERRIDES, BenchOptions

from ..support.group import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="this torch build has no torch.distributed, so no "
                                       "torch.distributed.rpc to compare against")


def run_bench(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess:
    """Run ``python -m benchmarks ARGS`` from the repository root."""
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False)


# The one quick run most tests read: the default workloads and fan-out (one run, not one
# per workload: each run spawns its workers afresh).
QUICK_WORKLOADS = [*DEFAULT_WORKLOADS, "fanout"]


def quick_metric_names() -> list[str]:
    """Every metric a ``--quick`` run of QUICK_WORKLOADS reports."""
    options = BenchOptions(**QUICK_OVERRIDES)
    return [spec.name for w in QUICK_WORKLOADS for spec in metric_specs(w, options)]


@pytest.fixture(scope="module")
def quick_run() -> subprocess.CompletedProcess:
    """One quick run of QUICK_WORKLOADS on torch and torchrpc."""
    proc = run_bench("--quick", "--systems", "torch,torchrpc", "--workloads",
                     ",".join(QUICK_WORKLOADS), "--json", timeout=420)
    assert proc.returncode == 0, f"bench failed:\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def quick_report(quick_run: subprocess.CompletedProcess) -> dict[str, Any]:
    """The JSON report of the quick run."""
    return json.loads(quick_run.stdout)


def test_quick_run_reports_every_metric(quick_report: dict[str, Any]) -> None:
    assert list(quick_report["systems"]) == ["torch", "torchrpc"]
    assert quick_report["baseline"] == "torch"
    assert sorted(quick_report["metrics"]) == sorted(quick_metric_names())
    for name, entry in quick_report["metrics"].items():
        assert entry["better"] in ("lower", "higher"), name
        assert entry["unit"], name


@pytest.mark.parametrize("system", ["torch", "torchrpc"])
def test_quick_run_has_numbers_for(quick_report: dict[str, Any], system: str) -> None:
    missing = {name: entry["errors"].get(system, "no value")
               for name, entry in quick_report["metrics"].items()
               if not isinstance(entry["values"][system], (int, float))}
    assert not missing, f"{system} has no value for: {json.dumps(missing, indent=2)}"
    for name, entry in quick_report["metrics"].items():
        value = entry["values"][system]
        assert math.isfinite(value) and value > 0, (name, value)
    # --quick sets 1 torch thread per worker, which each system's workers keep.
    assert quick_report["details"][system]["latency"][0]["torch_threads"] == 1


def test_quick_run_ratios_are_torchrpc_over_torch(quick_report: dict[str, Any]) -> None:
    for name, entry in quick_report["metrics"].items():
        torch_value = entry["values"]["torch"]
        ours = entry["values"]["torchrpc"]
        assert torch_value is not None, (name, entry["errors"])
        assert ours is not None, (name, entry["errors"])
        assert entry["ratios"]["torchrpc"] == pytest.approx(ours / torch_value), name


# Broken systems beside the two that train: "mixed" is torch's autograd with torchrpc's
# RPC, whose first training step fails (no torch RPC agent) before it is ready to take
# turns; "crashy"'s caller exits in its 4th step, in the middle of its first turn (its
# callee reports the lost caller).
BROKEN = {"mixed": "torchrpc.rpc,torch.distributed.autograd,torchrpc.optim",
          "crashy": "torchrpc.rpc,torchrpc.autograd,tests.support.bench_crashing_optim"}


@pytest.fixture(scope="module")
def train_run() -> subprocess.CompletedProcess:
    """One quick run of ``latency``, ``remote``, ``throughput`` and ``train``, each in a
    session of its own (so they take turns), with BROKEN beside."""
    defines = [arg for name, modules in BROKEN.items()
               for arg in ("--define-system", f"{name}={modules}")]
    proc = run_bench("--quick", "--sessions", "per-workload", "--workloads",
                     "latency,remote,throughput,train", "--systems",
                     ",".join(["torch", "torchrpc", *BROKEN]), *defines, "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def measured(report: dict[str, Any], metric: str, system: str) -> float:
    """The positive value of ``metric`` for ``system``; failing, the error the bench gave."""
    entry = report["metrics"][metric]
    value = entry["values"][system]
    assert isinstance(value, (int, float)) and value > 0, \
        (system, metric, value, entry["errors"].get(system))
    return value


def test_training_sessions_take_turns(train_run: subprocess.CompletedProcess) -> None:
    for system in ("torch", "torchrpc"):
        assert f"[{system}] train (in turns): ok" in train_run.stderr, train_run.stderr[-4000:]
    report = json.loads(train_run.stdout)
    turns = QUICK_OVERRIDES["train_turns"]
    for system in ("torch", "torchrpc"):
        measured(report, "train_step_ms", system)
        # The floor: the same step in the caller alone, measured in the same turns.
        measured(report, "train_local_step_ms", system)
        (train,) = report["details"][system]["train"]
        assert train["turns"] == turns, train
        assert len(train["turn_medians_ms"]) == turns
        assert train["steps"] == QUICK_OVERRIDES["train_steps"]


def test_calls_are_measured_in_turns(train_run: subprocess.CompletedProcess) -> None:
    assert "latency (in turns): ok" in train_run.stderr
    assert "remote (in turns): ok" in train_run.stderr
    assert "throughput (in turns): ok" in train_run.stderr
    report = json.loads(train_run.stdout)
    turns = QUICK_OVERRIDES["call_turns"]
    for system in ("torch", "torchrpc", *BROKEN):
        for workload, calls in (("latency", "latency_calls"), ("remote", "remote_calls")):
            (details,) = report["details"][system][workload]
            assert details["turns"] == turns, (system, details)
            assert details["calls"] == QUICK_OVERRIDES[calls], (system, details)
        # A repeat of the throughput workload in each turn at least.
        (details,) = report["details"][system]["throughput"]
        assert details["turns"] == turns, (system, details)
        assert len(details["rates"]) == max(turns, QUICK_OVERRIDES["throughput_repeats"])
        for metric in ("rpc_async_calls_per_s", "rpc_sync_p50_us", "noop_p50_us",
                       "remote_to_here_p50_us", "remote_noop_p50_us"):
            measured(report, metric, system)


def test_broken_systems_do_not_hold_up_the_turns(train_run: subprocess.CompletedProcess) -> None:
    report = json.loads(train_run.stdout)
    measured(report, "train_step_ms", "torchrpc")
    entry = report["metrics"]["train_step_ms"]
    for name in BROKEN:
        assert entry["values"][name] is None, (name, entry)
        assert entry["errors"][name], (name, entry)


def test_unimportable_system_becomes_an_error_row(tmp_path: Path) -> None:
    table = tmp_path / "table.md"
    proc = run_bench("--quick", "--workloads", "latency", "--systems", "torch,ghost",
                     "--define-system", "ghost=torchrpc_bench_no_such_package.rpc",
                     "--json", "--markdown-out", str(table), timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    for name in ("rpc_sync_p50_us", "rpc_sync_p99_us"):
        entry = report["metrics"][name]
        assert entry["values"]["torch"] > 0
        assert entry["values"]["ghost"] is None
        assert entry["ratios"]["ghost"] is None
        assert "ModuleNotFoundError" in entry["errors"]["ghost"]
        assert "import" in entry["errors"]["ghost"]
    markdown = table.read_text(encoding="utf-8")
    assert "| ghost / torch |" in markdown
    assert "torchrpc_bench_no_such_package" in markdown


@pytest.mark.parametrize("args, said", [
    (["--systems", "torch,nonesuch"], "nonesuch"),
    (["--echo-sizes-mb", "1,-4"], "--echo-sizes-mb"),
    (["--train-steps", "4", "--train-turns", "5"], "--train-turns"),
    (["--remote-calls", "4", "--call-turns", "5"], "--call-turns"),
    (["--call-turns", "-1"], "--call-turns"),
    (["--threads", "default,1", "--torch-threads", "2"], "--threads or --torch-threads, not both"),
    (["--threads", "1,many"], "'many'"),
    (["--ps-dims", "10,4"], "--ps-dims"),
])
def test_bad_arguments_are_refused(args: list[str], said: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    # Refused while the arguments are read, before any worker starts: in this process.
    from benchmarks.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert said in capsys.readouterr().err


def test_scale_reports_memory_and_stops_short_of_the_memory_floor() -> None:
    proc = run_bench("--scale", "--scale-sizes", "3", "--systems", "torchrpc", "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads(proc.stdout)["metrics"]
    for what in ("rss", "beyond_import", "private"):
        assert metrics[f"scale_3w_{what}_MB"]["values"]["torchrpc"] > 0, what
    assert metrics["scale_3w_rss_MB"]["values"]["torchrpc"] > \
        metrics["scale_3w_beyond_import_MB"]["values"]["torchrpc"]
    # A floor above what the machine has: the first size is stopped, the next skipped.
    proc = run_bench("--scale", "--scale-sizes", "2,3", "--systems", "torchrpc", "--json",
                     "--min-available-gib", "100000", timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    errors = json.loads(proc.stdout)["metrics"]
    assert "available memory fell below 100000 GiB with 2 workers" in \
        errors["scale_2w_init_s"]["errors"]["torchrpc"]
    assert "skipped: memory ran out at 2 workers" in errors["scale_3w_rss_MB"]["errors"]["torchrpc"]


NOMAC = "torchrpc-tcp-nomac=benchmarks.variants.tcp_nomac,torchrpc.autograd,torchrpc.optim"


def test_tcp_variants_run_over_tcp_with_and_without_frame_macs() -> None:
    proc = run_bench("--quick", "--workloads", "latency", "--systems",
                     "torchrpc-tcp,torchrpc-tcp-nomac", "--define-system", NOMAC, "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    values = json.loads(proc.stdout)["metrics"]["rpc_sync_p50_us"]["values"]
    assert all(isinstance(values[s], (int, float)) and values[s] > 0
               for s in ("torchrpc-tcp", "torchrpc-tcp-nomac")), values
    # What each variant changes, checked in a fresh interpreter (tcp_nomac patches its own).
    probe = ("import socket, {0} as v\n"
             "from torchrpc._transport import links, handshake\n"
             "o = v.TensorPipeRpcBackendOptions(num_worker_threads=2)\n"
             "c = type('C', (), {{'features': handshake.FEATURE_FRAME_MAC,\n"
             "                    'sock': socket.socket()}})()\n"
             "print(o.enable_uds, o.enable_shm, links.needs_frame_macs(c))\n")
    for variant, macs in (("benchmarks.variants.tcp", "True"),
                          ("benchmarks.variants.tcp_nomac", "False")):
        out = subprocess.run([sys.executable, "-c", probe.format(variant)], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert out.split() == ["False", "False", macs], (variant, out)


NOGC = "torchrpc-nogc=benchmarks.variants.nogc,torchrpc.autograd,torchrpc.optim"


def test_nogc_variant_turns_the_collector_off_in_the_chosen_workers() -> None:
    proc = run_bench("--quick", "--workloads", "throughput", "--systems", "torchrpc-nogc",
                     "--define-system", NOGC, "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    value = json.loads(proc.stdout)["metrics"]["rpc_async_calls_per_s"]["values"]
    assert value["torchrpc-nogc"] > 0, value
    # A group of one, in a fresh interpreter: the collector stays on until init_rpc, then
    # goes off in every worker, or only in the one TORCHRPC_BENCH_NOGC names.
    probe = ("import gc, benchmarks.variants.nogc as v\n"
             "on = gc.isenabled()\n"
             "v.init_rpc('caller', rank=0, world_size=1)\n"
             "print(on, gc.isenabled())\n"
             "v.shutdown()\n")
    for only, after in (("", "False"), ("caller", "False"), ("callee", "True")):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   TORCHRPC_BENCH_NOGC=only)
        out = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, env=env,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert out.split() == ["True", after], (only, out)


def test_fanout_reports_both_systems_and_the_group_call_used(
        quick_report: dict[str, Any]) -> None:
    report = quick_report
    metrics = {k: v for k, v in report["metrics"].items() if k.startswith("fanout_")}
    assert sorted(metrics) == ["fanout_calls_per_s", "fanout_round_p50_us"]
    for name, entry in metrics.items():
        for system in ("torch", "torchrpc"):
            value = entry["values"][system]
            assert isinstance(value, (int, float)) and value > 0, (name, system, entry)
        assert entry["ratios"]["torchrpc"] == pytest.approx(
            entry["values"]["torchrpc"] / entry["values"]["torch"])
    assert "fanout" not in DEFAULT_WORKLOADS  # not in the default run: it spawns more workers
    text = json.dumps(report["details"])
    assert "rpc_async_many" in text and "rpc_async + wait_all" in text


def test_ps_trains_four_trainers_against_a_parameter_server(
        quick_report: dict[str, Any]) -> None:
    report = quick_report
    metrics = {k: v for k, v in report["metrics"].items() if k.startswith("ps_")}
    assert sorted(metrics) == ["ps_step_p50_ms", "ps_steps_per_s"]
    assert metrics["ps_steps_per_s"]["better"] == "higher"
    assert metrics["ps_steps_per_s"]["target"]["value"] == 2.0
    for name, entry in metrics.items():
        for system in ("torch", "torchrpc"):
            value = entry["values"][system]
            assert isinstance(value, (int, float)) and value > 0, (name, system, entry)
    for system in ("torch", "torchrpc"):
        (ps,) = report["details"][system]["ps"]
        assert ps["trainers"] == BenchOptions().ps_trainers == 4, ps
        assert len(ps["trainer_p50_ms"]) == 4
        assert ps["steps_per_trainer"] == QUICK_OVERRIDES["ps_steps"]
        assert ps["last_loss_mean"] < ps["first_loss_mean"], ps
    (session,) = [s for s in report["sessions"]
                  if s["system"] == "torchrpc" and s["workloads"] == ["ps"]]
    assert session["world_size"] == 5


def test_threads_runs_every_workload_under_each_setting(tmp_path: Path) -> None:
    table, chart = tmp_path / "table.md", tmp_path / "chart.svg"
    proc = run_bench("--quick", "--workloads", "latency", "--systems", "torch,torchrpc",
                     "--threads", "default,1", "--json", "--markdown-out", str(table),
                     "--chart-out", str(chart))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["threads"] == ["default", "1"]
    assert "torch_threads" not in report["options"]  # "threads" says it, per setting
    names = ["rpc_sync_p50_us", "rpc_sync_p99_us", "noop_p50_us"]
    assert sorted(report["metrics"]) == sorted(f"{name}@threads={label}" for name in names
                                               for label in ("default", "1"))
    for key, entry in report["metrics"].items():
        assert key == f"{entry['metric']}@threads={entry['threads']}"
        value = entry["values"]["torchrpc"]
        assert isinstance(value, (int, float)) and value > 0, (key, entry)
    runs = report["details"]["torchrpc"]["latency"]
    assert [run["threads"] for run in runs] == ["default", "1"]
    assert runs[1]["torch_threads"] == 1  # what torch.get_num_threads() said
    assert runs[0]["torch_threads"] >= 1
    assert sorted(s["threads"] for s in report["sessions"]
                  if s["system"] == "torchrpc") == ["1", "default"]
    markdown = table.read_text(encoding="utf-8")
    assert "## torch intra-op threads per worker: default (torch's own: " in markdown
    assert "## torch intra-op threads per worker: 1\n" in markdown
    # The chart of the same report: a bar per metric and setting, the metrics' labels.
    svg = ET.fromstring(chart.read_text(encoding="utf-8"))
    texts = {t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")}
    assert {"torchrpc, torch threads default", "torchrpc, torch threads 1",
            "small rpc_sync p50"} <= texts, texts
    assert sum(1 for r in svg.iter("{http://www.w3.org/2000/svg}rect")
               if r.find("{http://www.w3.org/2000/svg}title") is not None) == 2 * len(names)
    # One setting (--torch-threads, or nothing): the report keeps its plain metric names.
    proc = run_bench("--quick", "--workloads", "latency", "--systems", "torchrpc",
                     "--torch-threads", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    single = json.loads(proc.stdout)
    assert single["threads"] == ["1"] and single["options"]["torch_threads"] == 1
    assert sorted(single["metrics"]) == sorted(names)
    assert all(entry["threads"] == "1" for entry in single["metrics"].values())


def test_echo_of_64_mb_and_more_is_also_reported_against_one_memcpy() -> None:
    names = [spec.name for spec in metric_specs("echo", BenchOptions(echo_sizes_mb=(1.0, 64.0)))]
    assert "echo_64MB_per_memcpy" in names and "echo_1MB_per_memcpy" not in names


def test_the_featureless_floor_runs_latency_and_throughput_and_errs_on_the_rest() -> None:
    proc = run_bench("--quick", "--workloads", "latency,throughput,remote", "--systems",
                     "floor,floor-self", "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    for name in ("rpc_sync_p50_us", "noop_p50_us", "rpc_async_calls_per_s"):
        values = report["metrics"][name]["values"]
        assert all(isinstance(values[s], (int, float)) and values[s] > 0
                   for s in ("floor", "floor-self")), (name, values)
    # The floor has no remote(): that workload is an error row of each floor system.
    errors = report["metrics"]["remote_to_here_p50_us"]["errors"]
    assert all("remote" in errors[s] for s in ("floor", "floor-self")), errors


def test_echo_rss_growth_counts_from_the_resident_size_after_warming_torch() -> None:
    # A fresh process: the peak of this one holds whatever the other tests left there.
    script = (
        "import torch\n"
        "from benchmarks.callees import baseline_rss_mb, peak_rss_mb\n"
        "base = baseline_rss_mb()\n"
        "x = torch.rand(16 << 20)\n"  # 64 MiB, made and touched by torch's large-tensor code
        "print(base, peak_rss_mb())\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    base, peak = (float(v) for v in proc.stdout.split())
    # The payload and nothing else: no code pages or thread stacks of torch's large-tensor
    # path, which the warm-up ran before the baseline (with them, about 64.5 MiB).
    assert 64.0 <= peak - base < 64.25, f"growth {peak - base:.3f} MiB"
