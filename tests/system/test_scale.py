"""Scale and topology: 32 workers, workers on separate network hosts, address selection."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess

import pytest

from ..support.group import free_port, start_module, worker_env
from ..agent.test_lifecycle import assert_ok, launch

NS = ("trpc_ns_a", "trpc_ns_b")
ADDRS = ("10.231.7.1", "10.231.7.2")


def test_thirty_two_workers_init_call_everyone_and_shut_down(tmp_path):
    # 32 processes forked from one that imported torch and torchrpc (see scenarios.forked).
    world = 32
    proc = start_module("tests.support.scenarios",
                        ["forked", "all_to_all", str(world), str(tmp_path)],
                        worker_env(free_port(), world), capture=True, fresh=True)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    outs = [(int((tmp_path / f"{r}.status").read_text()), (tmp_path / str(r)).read_text())
            for r in range(world)]
    assert_ok(outs)
    inits = [float(re.search(r"init=([\d.]+)", out).group(1)) for _, out in outs]
    print(f"32 workers: slowest init_rpc {max(inits):.2f} s")


def _netns_available() -> str:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's 'ip' command"
    probe = subprocess.run(["ip", "netns", "add", "trpc_probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "trpc_probe"], capture_output=True)
    return ""


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    reason = _netns_available()
    if reason:
        pytest.skip(reason)
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    try:
        for ns in NS:
            _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", "trpc_va", "type", "veth", "peer", "name", "trpc_vb")
        for ns, dev, addr in zip(NS, ("trpc_va", "trpc_vb"), ADDRS):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in NS:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _run_on_two_hosts(extra_env):
    port = str(free_port())
    procs = []
    for rank, ns in enumerate(NS):
        env = worker_env(int(port), 2, {"MASTER_ADDR": ADDRS[0], **extra_env})
        procs.append(start_module("tests.support.scenarios", ["multihost", str(rank), "2", "0"],
                                  env, capture=True, prefix=("ip", "netns", "exec", ns)))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            out = p.communicate()[0] + "\nTIMEOUT"
        outs.append((p.returncode, out))
    return outs


def test_workers_on_two_hosts_talk_over_tcp_without_shared_memory(two_hosts):
    # Several hosts: the launcher gives every worker the secret (docs/security.md).
    outs = _run_on_two_hosts({"TORCHRPC_SECRET": secrets.token_hex(16)})
    assert_ok(outs)
    assert f"OK multihost {ADDRS[0]}" in outs[0][1] and f"OK multihost {ADDRS[1]}" in outs[1][1]


def test_second_host_without_a_secret_fails_at_once_naming_the_ways(two_hosts):
    outs = _run_on_two_hosts({})
    assert all("TIMEOUT" not in out for _, out in outs), outs
    assert outs[1][0] != 0 and "TORCHRPC_SECRET_FILE" in outs[1][1], outs


def test_listen_address_not_on_this_machine_fails_naming_it():
    outs = launch("bad_listen", 1, {"TORCHRPC_LISTEN_ADDR": "10.231.9.9"})
    assert "ERR" in outs[0][1] and "10.231.9.9" in outs[0][1], outs
    outs = launch("bad_listen", 1, {"TORCHRPC_IFNAME": "nosuchif0"})
    assert "ERR" in outs[0][1] and "nosuchif0" in outs[0][1], outs


def test_rendezvous_fails_at_one_deadline_for_all_its_steps():
    # The store opens late (after 2.5 s of 4): waiting for the missing worker gets the time
    # left, not a fresh 4 s.
    outs = launch("late_then_missing", 2, ranks=[0])
    out = outs[0][1]
    assert "ERR" in out and "store reached True" in out and "timed out" in out, out
    seconds = float(re.search(r"ERR after ([\d.]+)s", out).group(1))
    assert 3.5 <= seconds < 5.5, out


def test_unreachable_rendezvous_fails_within_timeout_naming_the_address():
    port = free_port()
    outs = launch("unreachable", 2, {"MASTER_PORT": str(port), "TORCHRPC_RENDEZVOUS_TIMEOUT": "3"},
                  ranks=[1])
    out = outs[0][1]
    assert "ERR" in out and f"MASTER_PORT='{port}'" in out and "127.0.0.1" in out, out
    seconds = float(re.search(r"ERR after ([\d.]+)s", out).group(1))
    assert seconds < 30, out
