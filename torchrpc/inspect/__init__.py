"""``python -m torchrpc.inspect``: where a running group's calls wait, and why.

Joins the group at ``--init-method`` (default ``MASTER_ADDR``/``MASTER_PORT``) as an
observer (no rank, invisible to the workers' group; see ``torchrpc._agent.observer``) with
the job secret from where a worker gets it (``TORCHRPC_SECRET``, ``TORCHRPC_SECRET_FILE``,
or on the job's host rank 0's secret file), asks every worker
for a snapshot and prints a table of the workers, their outstanding calls and the
requests they serve, and the wait-for chains; ``--stacks`` adds every thread's stack,
``--json`` prints the document instead, ``--watch S`` refreshes it every S seconds.
A group whose links run over TLS needs what a worker is given: ``--tls-certfile``,
``--tls-keyfile``, ``--tls-cafile`` and ``--tls-identity``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, TextIO

from .._agent.chains import age_text as _age
from .._agent.observer import Observer, default_init_method, snapshot
from ..errors import RpcError

__all__ = ["main", "render", "snapshot"]


def render(doc: Dict[str, Any], stacks: bool = False, where: str = "") -> str:
    """The text of a snapshot document (see :func:`torchrpc.rpc.snapshot`)."""
    workers: List[Dict[str, Any]] = doc["workers"]
    out = [f"torchrpc group{' at ' + where if where else ''}: {len(workers)} workers, "
           f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(doc['taken_at']))}", ""]
    rows = [("WORKER", "RANK", "HOST", "PID", "STATE", "UPTIME", "THREADS BUSY/TOTAL")]
    for w in workers:
        if not w.get("answered"):
            rows.append((w["name"], str(w["rank"]), w.get("host", "?"), "?", "NO ANSWER",
                         "?", "?"))
            continue
        t = w["threads"]
        rows.append((w["name"], str(w["rank"]), w["host"], str(w["pid"]), w["state"],
                     _age(w.get("uptime_s")), f"{t['busy']}/{t['total']}"
                     + (f" (+{t['queued']} queued)" if t["queued"] else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
    for w in workers:
        out.append("")
        out.append(f"{w['name']} (rank {w['rank']}):")
        if not w.get("answered"):
            out.append(f"  did not answer: {w.get('error')}")
            out.extend(_known_of(w, workers))
            continue
        out.append("  waits on (outstanding calls):" if w["pending"] else
                   "  waits on: nothing")
        for p in w["pending"]:
            out.append(f"    -> {p['to']:<12} {p['function']}  [{p['kind']}]  {_age(p['age_s'])}")
        out.append("  serving:" if w["serving"] else "  serving: nothing")
        for s in w["serving"]:
            where = "waiting for its future" if s.get("async") else f"on {s['thread']}"
            out.append(f"    <- {s['from']:<12} {s['function']}  [{s['kind']}]  "
                       f"{_age(s['age_s'])}  {where}")
        r, a = w["rrefs"], w["autograd"]
        out.append(f"  rrefs: owned {r['owned']}, forks {r['forks']}, unconfirmed "
                   f"{r['unconfirmed']};  autograd contexts {a['contexts']}, backward passes "
                   f"{a['backward_passes']}")
        if w["lost"]:
            for name, why in w["lost"].items():
                out.append(f"  considers lost: {name}: {why}")
        if w.get("left"):
            out.append(f"  left the group: {', '.join(w['left'])}")
        if stacks and "stacks" in w:
            out.append("  threads:")
            for thread, text in w["stacks"].items():
                out.append(f"    --- {thread}")
                out.extend("    " + line for line in text.rstrip("\n").splitlines())
    out.append("")
    chains = doc.get("chains") or []
    if chains:
        out.append("wait-for chains (oldest first):")
        for c in chains:
            out.append("  " + c["text"])
    else:
        out.append("wait-for chains: none (no worker waits on another)")
    return "\n".join(out) + "\n"


def _known_of(worker: Dict[str, Any], workers: List[Dict[str, Any]]) -> List[str]:
    """What the other workers know of one that did not answer."""
    out = []
    for w in workers:
        if not w.get("answered"):
            continue
        for p in w["pending"]:
            if p["to_rank"] == worker["rank"]:
                out.append(f"  {w['name']} waits on it: {p['function']} [{p['kind']}] "
                           f"{_age(p['age_s'])}")
        why = w["lost"].get(worker["name"])
        if why:
            out.append(f"  {w['name']} considers it lost: {why}")
        if worker["name"] in w.get("left", ()):
            out.append(f"  {w['name']} saw it leave the group")
    return out or ["  no other worker waits on it or considers it lost"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchrpc.inspect",
        description="Show a running torchrpc group's outstanding calls, the requests each "
                    "worker serves, the wait-for chains and (with --stacks) every thread's "
                    "stack. Needs the job's rendezvous and its secret (TORCHRPC_SECRET or "
                    "TORCHRPC_SECRET_FILE; on the host of a one-host job started without "
                    "either, as its user: none).")
    p.add_argument("--init-method", default=None,
                   help="the job's rendezvous: tcp://HOST:PORT, file:///PATH or env:// "
                        "(default: MASTER_ADDR and MASTER_PORT)")
    p.add_argument("--workers", default=None,
                   help="comma-separated names or ranks of the workers to ask (default all)")
    p.add_argument("--stacks", action="store_true", help="every thread's Python stack")
    p.add_argument("--json", action="store_true", help="print the JSON document")
    p.add_argument("--watch", type=float, default=None, metavar="S",
                   help="refresh every S seconds until interrupted")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to reach the store and for each worker's answer (10)")
    tls = p.add_argument_group(
        "TLS", "for a group whose links run over TLS: what a worker's backend options of the "
               "same names hold (the certificate must carry the job identity, or name this "
               "host's address)")
    tls.add_argument("--tls-certfile", default=None, metavar="PEM",
                     help="a certificate signed by the job's CA (with its key, or see "
                          "--tls-keyfile)")
    tls.add_argument("--tls-keyfile", default=None, metavar="PEM",
                     help="the certificate's private key, when not inside --tls-certfile")
    tls.add_argument("--tls-cafile", default=None, metavar="PEM",
                     help="the job's CA, which the workers' certificates chain to")
    tls.add_argument("--tls-identity", default=None, metavar="NAME",
                     help="the job identity the workers' certificates carry, if they set "
                          "tls_identity")
    p.add_argument("-v", "--verbose", action="store_true", help="log torchrpc's messages")
    return p


def main(argv: Optional[Sequence[str]] = None, out: TextIO = sys.stdout) -> int:
    """The command line; the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                        format="%(name)s: %(message)s")
    workers: Optional[List[Any]] = None
    if args.workers:
        workers = [int(w) if w.strip().isdigit() else w.strip()
                   for w in args.workers.split(",") if w.strip()]
    if args.watch is not None and args.watch <= 0:
        print("torchrpc.inspect: error: --watch takes a positive number of seconds",
              file=sys.stderr)
        return 2
    observer: Optional[Observer] = None
    try:
        try:
            observer = Observer(args.init_method, timeout=args.timeout,
                                tls_certfile=args.tls_certfile, tls_keyfile=args.tls_keyfile,
                                tls_cafile=args.tls_cafile, tls_identity=args.tls_identity)
        except (RpcError, ValueError) as exc:
            print(f"torchrpc.inspect: error: {exc}", file=sys.stderr)
            return 2
        where = args.init_method or default_init_method()
        while True:
            try:
                doc = observer.snapshot(workers, args.stacks, args.timeout)
            except (RpcError, ValueError) as exc:
                print(f"torchrpc.inspect: error: {exc}", file=sys.stderr)
                return 2
            if args.json:
                text = json.dumps(doc, indent=1, default=str) + "\n"
            else:
                text = render(doc, args.stacks, where)
            if args.watch is not None:
                out.write("\x1b[H\x1b[2J")  # in place: home, clear
            out.write(text)
            out.flush()
            if args.watch is None:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:  # Ctrl-C, while it connects too: the way a watch ends
        return 0
    finally:
        if observer is not None:
            observer.close()
