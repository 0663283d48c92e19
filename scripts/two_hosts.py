"""Echo tensors between two "hosts": two network namespaces joined by a veth pair.

    sudo .venv/bin/python scripts/two_hosts.py [--sizes-mb 1,64,256] [--iters 7]
        [--rounds 3] [--systems raw,torchrpc,torchrpc-nomac]

Systems, each with one process per namespace:

- ``raw``: a Python TCP echo (``sendall`` / ``recv_into``), the ceiling a Python RPC can
  reach on that link;
- ``torchrpc``: torchrpc over plain TCP as it runs between hosts (frame MACs, tensor
  bytes sealed: the ``tensor_mac`` option on);
- ``torchrpc-nomac``: the same with ``tensor_mac=False`` (frame MACs on header and
  envelope only).

For each: the p50 and p99 of a small call (an 8-byte ping-pong for ``raw``, an
``rpc_sync`` of a no-op for torchrpc) and the echo rate of each size, 2 x size / time
in GiB/s, the median of ``--iters`` timed echoes. ``--rounds`` runs every system that
many times, interleaved, and reports each figure's median over the rounds. Needs root
(``ip netns``); the namespaces and the veth pair are removed on every exit path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NS = ("trpc2h_a", "trpc2h_b")
DEVS = ("trpc2h_va", "trpc2h_vb")
ADDRS = ("10.200.0.1", "10.200.0.2")
SYSTEMS = ("raw", "torchrpc", "torchrpc-nomac")


# -- the two namespaces -----------------------------------------------------------------------

def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def make_link() -> None:
    remove_link()
    for ns in NS:
        _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", DEVS[0], "type", "veth", "peer", "name", DEVS[1])
    for ns, dev, addr in zip(NS, DEVS, ADDRS):
        _sh("ip", "link", "set", dev, "netns", ns)
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")


def remove_link() -> None:
    for ns in NS:  # deleting a namespace deletes its end of the pair, and so the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _spawn(ns: str, args: List[str], env: Dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, __file__, *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def run_system(system: str, opts: argparse.Namespace) -> Dict[str, float]:
    """Run ``system``'s two processes, one per namespace; the caller's figures."""
    port = str(29000 + secrets.randbelow(2000))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", TORCHRPC_SECRET=secrets.token_hex(32),
               MASTER_ADDR=ADDRS[0], MASTER_PORT=port, WORLD_SIZE="2")
    common = ["--sizes-mb", opts.sizes_mb, "--iters", str(opts.iters),
              "--calls", str(opts.calls), "--port", port, "--system", system]
    # The callee (rank 1, the server) in the second namespace, the caller in the first.
    callee = _spawn(NS[1], ["--role", "callee", *common], env)
    time.sleep(0.5 if system == "raw" else 0.0)
    caller = _spawn(NS[0], ["--role", "caller", *common], env)
    try:
        out, _ = caller.communicate(timeout=600)
        callee.wait(timeout=60)
    finally:
        for p in (caller, callee):
            if p.poll() is None:
                p.kill()
                p.wait()
    if caller.returncode != 0:
        raise RuntimeError(f"{system}: the caller exited with {caller.returncode}")
    return json.loads(out.strip().splitlines()[-1])


# -- raw TCP ------------------------------------------------------------------------------------

def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("closed")
        got += n


def _send(sock: socket.socket, head: Any, data: memoryview) -> None:
    """Send ``head`` and ``data`` with as few system calls as the kernel allows."""
    sent = sock.sendmsg([head, data])
    if sent < len(head):
        sock.sendall(memoryview(head)[sent:])
        sent = len(head)
    if sent - len(head) < len(data):
        sock.sendall(data[sent - len(head):])


def raw_callee(opts: argparse.Namespace) -> None:
    server = socket.create_server((ADDRS[1], opts.port))
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(8)
    buf = bytearray(max(_sizes(opts)) or 8)
    while True:
        try:
            _recv_into(conn, memoryview(head))
        except ConnectionError:
            return
        n = struct.unpack("<Q", head)[0]
        view = memoryview(buf)[:n]
        _recv_into(conn, view)
        _send(conn, head, view)


def raw_caller(opts: argparse.Namespace) -> Dict[str, float]:
    sock = None
    for _ in range(100):
        try:
            sock = socket.create_connection((ADDRS[1], opts.port))
            break
        except OSError:
            time.sleep(0.1)
    assert sock is not None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = bytearray(8)

    def echo(data: memoryview, back: memoryview) -> None:
        _send(sock, struct.pack("<Q", len(data)), data)
        _recv_into(sock, memoryview(head))
        _recv_into(sock, back)

    small, small_back = memoryview(bytearray(8)), memoryview(bytearray(8))
    result = _latency(lambda: echo(small, small_back), opts.calls)
    for size in _sizes(opts):
        data = memoryview(bytearray(os.urandom(1 << 16)) * (size >> 16))
        back = memoryview(bytearray(size))
        result[_echo_name(size)] = _rate(lambda: echo(data, back), size, opts.iters)
        assert back == data
    sock.close()
    return result


# -- torchrpc ----------------------------------------------------------------------------------

def _noop() -> None:
    return None


def _echo(x: Any) -> Any:
    return x


def rpc_role(opts: argparse.Namespace, rank: int) -> Dict[str, float]:
    import torch
    import torchrpc.rpc as rpc

    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=4, rpc_timeout=120, listen_addr=ADDRS[rank],
        enable_shm=False, enable_uds=False,  # as between hosts, whatever the host ids say
        tensor_mac=opts.system != "torchrpc-nomac")
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    result: Dict[str, float] = {}
    if rank == 0:
        result = _latency(lambda: rpc.rpc_sync("w1", _noop), opts.calls)
        for size in _sizes(opts):
            x = torch.rand(size // 4)
            back = rpc.rpc_sync("w1", _echo, args=(x,))
            assert torch.equal(back, x)
            del back
            result[_echo_name(size)] = _rate(lambda: rpc.rpc_sync("w1", _echo, args=(x,)),
                                             size, opts.iters)
    rpc.shutdown()
    return result


# -- timing ------------------------------------------------------------------------------------

def _sizes(opts: argparse.Namespace) -> List[int]:
    return [int(float(s) * (1 << 20)) for s in opts.sizes_mb.split(",") if s]


def _echo_name(size: int) -> str:
    return f"echo {size / (1 << 20):g} MB (GiB/s)"


def _latency(call: Any, n: int) -> Dict[str, float]:
    for _ in range(max(n // 10, 10)):
        call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"small call p50 (us)": times[len(times) // 2] * 1e6,
            "small call p99 (us)": times[min(len(times) - 1, int(len(times) * 0.99))] * 1e6}


def _rate(call: Any, size: int, iters: int) -> float:
    call()
    call()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 2 * size / statistics.median(times) / (1 << 30)


# -- main ------------------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="1,64,256")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--role", choices=("caller", "callee"), help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.role:
        if opts.system == "raw":
            if opts.role == "callee":
                raw_callee(opts)
                return
            print(json.dumps(raw_caller(opts)))
            return
        result = rpc_role(opts, 0 if opts.role == "caller" else 1)
        if opts.role == "caller":
            print(json.dumps(result))
        return
    systems = [s for s in opts.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if os.geteuid() != 0:
        sys.exit("two_hosts.py needs root to make network namespaces (ip netns); skipped")
    # A signal ends the run through the finally below, which removes the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runs: Dict[str, List[Dict[str, float]]] = {s: [] for s in systems}
    try:
        make_link()
        for r in range(opts.rounds):
            for system in systems:
                runs[system].append(run_system(system, opts))
                print(f"round {r + 1} {system}: {json.dumps(runs[system][-1])}",
                      file=sys.stderr)
    finally:
        remove_link()
    print(f"two network namespaces over a veth pair; {_cpu_model()}, {os.cpu_count()} CPUs; "
          f"median of {opts.rounds} rounds")
    names = list(runs[systems[0]][0])
    print("| metric | " + " | ".join(systems) + " |")
    print("|---|" + "---:|" * len(systems))
    for name in names:
        cells = [f"{statistics.median(r[name] for r in runs[s]):.2f}" for s in systems]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
