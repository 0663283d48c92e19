"""The tools in benchmarks/ keep the package's size limits and use torchrpc as a user does:
no private module or name but where a tool measures the insides."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "benchmarks"

# The tools that measure torchrpc's insides, and what they reach for.
REACHES_INSIDE = {
    "segments.py": "times the steps of a call by wrapping the agent's and the wire's functions",
    "variants/tcp_nomac.py": "turns the transport's frame MACs off",
}


def _modules() -> list[Path]:
    return sorted(TOOLS.rglob("*.py"))


def test_every_tool_module_and_class_stays_small() -> None:
    assert len(_modules()) >= 15
    problems = []
    for path in _modules():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 500:
            problems.append(f"{path}: {text.count(chr(10))} lines (at most 500)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                problems.append(f"{path}: class {node.name} is over 300 lines")
    assert not problems, "\n".join(problems)


def _torchrpc_imports(tree: ast.Module) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return [name for name in names if name.split(".")[0] == "torchrpc"]


def test_tools_use_the_public_api_but_the_listed() -> None:
    problems, inside = [], set()
    for path in _modules():
        rel = path.relative_to(TOOLS).as_posix()
        private = [name for name in _torchrpc_imports(ast.parse(path.read_text("utf-8")))
                   if any(part.startswith("_") for part in name.split("."))]
        if private and rel in REACHES_INSIDE:
            inside.add(rel)
        elif private:
            problems.append(f"{rel}: imports {', '.join(private)}")
    assert not problems, "\n".join(problems)
    assert inside == set(REACHES_INSIDE), "REACHES_INSIDE lists a tool that no longer does"
