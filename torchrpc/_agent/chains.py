"""Reading a snapshot: the wait-for chains through a group, and the words a person reads.

A snapshot (snapshot.py) lists, per worker, the calls it waits on (``pending``) and the
requests it serves (``serving``); a pending call names the request its thread served when
it was made (``for``). :func:`wait_chains` joins the workers' lists into chains; it reads
only the JSON document, so it works on a snapshot taken by any observer.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple


def wait_chains(workers: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The wait-for chains of a snapshot: each starts at a call that no request served by
    its caller explains (made for none, or for one whose caller did not answer) and
    follows it to the worker serving it, then on along the calls that worker made for
    that request (a call names the request it was made for, ``for``: the one its thread
    served); a chain that comes back to a worker on it is a cycle.

    Each chain is ``{"links": [{"worker", "function", "kind", "age_s", "state"}],
    "cycle": bool, "text": str}``; ``state`` of the last link says where it rests:
    ``running`` (its function runs there now, or is an ``@async_execution`` one waiting
    for its future: then the link has ``"async": true``), ``not running`` (queued, or
    the reply is on its way), ``no answer`` (that worker did not answer) or ``not
    asked`` (that worker was left out of the snapshot)."""
    by_rank = {w["rank"]: w for w in workers}
    serving_of: Dict[Tuple[int, int, int], Dict[str, Any]] = {}
    for w in workers:
        for s in w.get("serving", ()):
            serving_of[(w["rank"], s["from_rank"], s["id"])] = s

    def onward(w: Dict[str, Any], served: Dict[str, Any]) -> List[Dict[str, Any]]:
        # The calls this worker made for ``served``.
        return [p for p in w.get("pending", ()) if p.get("for")
                and p["for"]["from_rank"] == served["from_rank"]
                and p["for"]["id"] == served["id"]]

    explained = set()  # calls that a chain from their caller's caller reaches
    for w in workers:
        for s in w.get("serving", ()):
            if not by_rank.get(s["from_rank"], {}).get("answered", False):
                continue
            for p in onward(w, s):
                explained.add((w["rank"], p["id"]))
    chains: List[Dict[str, Any]] = []
    seen = set()  # calls some chain went through

    def follow(path: List[Dict[str, Any]], ranks: List[int], caller: Dict[str, Any],
               p: Dict[str, Any]) -> None:
        seen.add((caller["rank"], p["id"]))
        link = {"worker": p["to"], "rank": p["to_rank"], "function": p["function"],
                "kind": p["kind"], "age_s": p["age_s"]}
        path = path + [link]
        if p["to_rank"] in ranks:
            link["state"] = "cycle"
            chains.append(_chain(path, True))
            return
        callee = by_rank.get(p["to_rank"])
        if callee is None or not callee.get("answered", False):
            link["state"] = "not asked" if callee is None else "no answer"
            chains.append(_chain(path, False))
            return
        served = serving_of.get((p["to_rank"], caller["rank"], p["id"]))
        if served is None:
            link["state"] = "not running"
            chains.append(_chain(path, False))
            return
        link["state"] = "running"
        link["thread"] = served["thread"]
        if served.get("async"):
            link["async"] = True
        nxt = onward(callee, served)
        if not nxt:
            chains.append(_chain(path, False))
            return
        for q in nxt:
            follow(path, ranks + [p["to_rank"]], callee, q)

    for w in workers:
        for p in w.get("pending", ()):
            if (w["rank"], p["id"]) in explained:
                continue
            follow([{"worker": w["name"], "rank": w["rank"]}], [w["rank"]], w, p)
    # Calls that every chain above missed wait in a cycle of workers serving each other.
    for w in workers:
        for p in w.get("pending", ()):
            if (w["rank"], p["id"]) not in seen:
                follow([{"worker": w["name"], "rank": w["rank"]}], [w["rank"]], w, p)
    chains.sort(key=lambda c: -(c["links"][1]["age_s"] or 0))
    return chains


def _chain(links: List[Dict[str, Any]], cycle: bool) -> Dict[str, Any]:
    parts = [links[0]["worker"]]
    for link in links[1:]:
        age = link["age_s"]
        note = "" if link["state"] in ("running", "cycle") else f", {link['state']}"
        if link.get("async"):
            note = ", async"  # waits for its future
        parts.append(f"{link['worker']} ({short_name(link['function'])}, {age_text(age)}"
                     f"{note})")
    text = " -> ".join(parts) + ("  CYCLE" if cycle else "")
    return {"links": links, "cycle": cycle, "text": text}


def age_text(age: Optional[float]) -> str:
    """An age in seconds as a person reads it."""
    if age is None:
        return "?"
    if age >= 3600:
        return f"{age / 3600:.1f} h"
    if age >= 60:
        return f"{age / 60:.1f} min"
    return f"{age:.1f} s"


def short_name(function: str) -> str:
    """``module.qualname`` -> ``qualname`` (what a chain's text names)."""
    if " " in function or "<" in function:
        return function
    return function.rsplit(".", 1)[-1]
