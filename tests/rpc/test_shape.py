"""The shape of the package, read from its source with ``ast``: no import cycle among
torchrpc's modules (imports under ``TYPE_CHECKING`` and inside functions counted), no
module but ``_agent/agent.py`` touching a private attribute of the agent, nothing under
``torchrpc/`` that is a benchmark or a test tool, and no patching of torch at import."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap
from typing import Dict, Iterator, List, Set, Tuple

import pytest

import torchrpc

PKG = pathlib.Path(torchrpc.__file__).parent

# -- the import graph ------------------------------------------------------------------------------


def _modules(root: pathlib.Path) -> Dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module under package directory ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(name: str, path: pathlib.Path, modules: Dict[str, pathlib.Path]) -> Set[str]:
    """The modules of ``modules`` that module ``name`` imports, anywhere in its source.

    ``from package import name`` imports the submodule ``package.name`` where there is
    one, else the package itself. A package's ``__init__`` that runs before a submodule
    is not counted: that is how Python finds the submodule, not a dependency of it.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif source in modules:
                    found.add(source)
    found.discard(name)
    return found


def import_cycles(root: pathlib.Path) -> List[List[str]]:
    """The import cycles among the modules under ``root``: each strongly connected
    component of the import graph with more than one module, sorted."""
    modules = _modules(root)
    graph = {name: sorted(_imported(name, path, modules)) for name, path in modules.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    cycles: List[List[str]] = []
    for start in graph:  # Tarjan's algorithm, iteratively (no recursion limit)
        if start in index:
            continue
        work: List[Tuple[str, Iterator[str]]] = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return sorted(cycles)


def _write(root: pathlib.Path, files: Dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / "pkg"


def test_the_cycle_finder_counts_type_only_and_function_local_imports(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from .a import A\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
        "pkg/b.py": "def f():\n    from . import a\n",
        "pkg/c.py": "from .a import A\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/d.py": "from .. import e\n",
        "pkg/e.py": "import pkg.sub.d\n",
    })
    assert import_cycles(pkg) == [["pkg.a", "pkg.b"], ["pkg.e", "pkg.sub.d"]]
    (pkg / "b.py").write_text("def f():\n    pass\n")
    (pkg / "e.py").write_text("X = 1\n")
    assert import_cycles(pkg) == []


PACKAGES = sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists())


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    involved = [cycle for cycle in import_cycles(PKG)
                if any(m.split(".")[1] == package for m in cycle)]
    assert not involved, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in involved)


# The agent's parts: every module of _agent but the composition root. Each is handed what it
# uses, and so never imports agent.py.
HANDED = sorted(p.stem for p in (PKG / "_agent").glob("*.py")
                if p.stem not in ("agent", "__init__"))


@pytest.mark.parametrize("part", HANDED)
def test_a_part_that_is_handed_what_it_uses_does_not_import_the_agent(part):
    modules = _modules(PKG)
    assert "torchrpc._agent.agent" not in _imported(
        f"torchrpc._agent.{part}", modules[f"torchrpc._agent.{part}"], modules)


# Objects that name the agent to the upper layers, as their API: not a part holding it.
HANDS_THE_AGENT_UP = {"hooks.MessageContext"}


def agent_parameters(path: pathlib.Path) -> List[str]:
    """The classes of ``path`` whose constructor takes a parameter named ``agent``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    names = [a.arg for a in item.args.args + item.args.kwonlyargs]
                    if any(n.endswith("agent") for n in names):
                        found.append(node.name)
    return found


def test_the_agent_parameter_finder_sees_a_constructor_taking_the_agent(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("class A:\n    def __init__(self, agent, x):\n        pass\n"
                     "class B:\n    def __init__(self, *, _agent=None):\n        pass\n"
                     "class C:\n    def __init__(self, agents_pool):\n        pass\n"
                     "def f(agent):\n    pass\n")
    assert agent_parameters(probe) == ["A", "B"]


@pytest.mark.parametrize("part", HANDED)
def test_a_part_that_is_handed_what_it_uses_is_not_constructed_with_the_agent(part):
    found = [name for name in agent_parameters(PKG / "_agent" / f"{part}.py")
             if f"{part}.{name}" not in HANDS_THE_AGENT_UP]
    assert not found, found


def test_no_import_cycle_outside_the_packages():
    loose = [cycle for cycle in import_cycles(PKG)
             if not any(m.split(".")[1] in PACKAGES for m in cycle)]
    assert not loose, loose


# -- the agent's private state ---------------------------------------------------------------------


def private_reaches(path: pathlib.Path, base: pathlib.Path = PKG.parent) -> List[str]:
    """Where the source of ``path`` touches a private attribute of an agent: ``x._y``
    where ``x`` is a name or an attribute called ``agent`` or ``_agent`` (or ending so)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else \
            owner.attr if isinstance(owner, ast.Attribute) else ""
        if name.endswith("agent"):
            found.append((node.lineno, node.col_offset,
                          f"{path.relative_to(base)}:{node.lineno}: {ast.unparse(node)}"))
    return [line for _, _, line in sorted(found)]


def test_the_private_reach_finder_sees_the_agents_private_attributes(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        def f(agent, self, peer):
            agent._lock, self._agent._state, self.agent._pool  # three
            agent.lock, self._agent.state, peer._x, agent.__class__  # none
    """))
    assert private_reaches(probe, tmp_path) == [
        "probe.py:3: agent._lock", "probe.py:3: self._agent._state", "probe.py:3: self.agent._pool"]


COMPOSITION_ROOT = "_agent/agent.py"


def _module_files() -> List[str]:
    return sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py")
                  if p.relative_to(PKG).as_posix() != COMPOSITION_ROOT)


def test_no_module_but_agent_py_touches_a_private_attribute_of_the_agent():
    found = [reach for rel in _module_files() for reach in private_reaches(PKG / rel)]
    assert not found, "\n".join(found)


# -- options: one typed object, read as it is ---------------------------------------------------------


def defaulted_option_reads(path: pathlib.Path, base: pathlib.Path = PKG.parent) -> List[str]:
    """Where ``path`` reads an option with a default of its own: ``getattr(x, name,
    default)`` where ``x`` is named (or is an attribute named) options, opts or settings."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "getattr" and len(node.args) == 3:
            owner = node.args[0]
            name = owner.id if isinstance(owner, ast.Name) else \
                owner.attr if isinstance(owner, ast.Attribute) else ""
            if name in ("options", "opts", "settings", "rpc_backend_options"):
                found.append(f"{path.relative_to(base)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_option_read_finder_sees_getattr_with_a_default(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(agent, options):\n"
                     "    getattr(agent.options, 'a', 1), getattr(options, 'b', None)\n"
                     "    getattr(agent, 'c', 2), getattr(options, 'd'), options.e\n")
    assert defaulted_option_reads(probe, tmp_path) == [
        "probe.py:2: getattr(agent.options, 'a', 1)", "probe.py:2: getattr(options, 'b', None)"]


def test_no_option_is_read_with_a_default_below_rpc_options():
    found = [line for path in sorted(PKG.rglob("*.py"))
             if path.relative_to(PKG).parts[0] != "bench"  # a tool, leaving the package
             and path.relative_to(PKG).as_posix() != "rpc/options.py"
             for line in defaulted_option_reads(path)]
    assert not found, "\n".join(found)


# -- no tools in the library -----------------------------------------------------------------------

TEST_FRAMEWORKS = {"pytest", "unittest", "hypothesis", "_pytest", "timeit", "cProfile",
                   "pstats"}
TOOL_NAMES = ("bench", "test_", "conftest")
API_SURFACE = {"_testing/faulty.py", "_testing/__init__.py"}
"""torch ships the faulty backend as ``torch.distributed.rpc._testing``, and its faulty
suites need it: API surface, not a test tool (its faults sit at the connection)."""

def tools_in(root: pathlib.Path) -> List[str]:
    """The files under ``root`` that are benchmarks or test tools: by name (a benchmark,
    a test module, a conftest), by place (``_testing/`` holds the API surface only), or
    by what they import (a test framework, a profiler or a timing harness)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in API_SURFACE:
            continue
        if any(part.startswith(TOOL_NAMES) for part in path.relative_to(root).parts):
            found.append(f"{rel}: named as a tool")
            continue
        if rel.startswith("_testing/"):
            found.append(f"{rel}: a test tool beside the faulty backend")
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            hits = sorted(n for n in names if n.split(".")[0] in TEST_FRAMEWORKS)
            if hits:
                found.append(f"{rel}: imports {', '.join(hits)}")
                break
    return found


def test_the_tool_finder_sees_benchmarks_and_test_tools(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "", "pkg/ok.py": "import time\n",
        "pkg/bench/__init__.py": "", "pkg/timing.py": "import timeit\n",
        "pkg/_testing/faulty.py": "", "pkg/_testing/timer.py": "import time\n",
        "pkg/tools/helpers.py": "from unittest import mock\n",
    })
    assert tools_in(root) == ["_testing/timer.py: a test tool beside the faulty backend",
                              "bench/__init__.py: named as a tool", "timing.py: imports timeit",
                              "tools/helpers.py: imports unittest"]


def test_nothing_under_torchrpc_is_a_benchmark_or_a_test_tool():
    found = tools_in(PKG)
    assert not found, "\n".join(found)


ENTRY_POINTS = ("torchrpc.examples", "torchrpc._testing", "torchrpc.inspect.__main__")
"""Modules that are loaded without an import from the library: the examples (``python
-m torchrpc.examples.NAME``), the faulty backend (API surface, see above) and the
inspector's command (``python -m torchrpc.inspect``)."""


def unimported_modules(root: pathlib.Path, entry_points: Tuple[str, ...] = ()) -> List[str]:
    """The modules under package directory ``root`` that no module of it imports and that
    are no entry point: only their tests would load them, so they are test tools."""
    modules = _modules(root)
    used: Set[str] = {root.name}
    for name, path in modules.items():
        for module in _imported(name, path, modules):
            while module:  # a package is loaded with each of its modules
                used.add(module)
                module = module.rpartition(".")[0]
    return [name for name in modules if name not in used
            and not any(name == e or name.startswith(e + ".") for e in entry_points)]


def test_the_unimported_module_finder_sees_modules_only_tests_would_load(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "from .a import A\n",
        "pkg/a.py": "from . import b\nA = 1\n",
        "pkg/b.py": "def f():\n    from .sub.c import C\n",
        "pkg/sub/__init__.py": "", "pkg/sub/c.py": "C = 1\n",
        "pkg/memory.py": "from .a import A\n",
        "pkg/examples/__init__.py": "", "pkg/examples/demo.py": "import pkg\n",
    })
    assert unimported_modules(root, ("pkg.examples",)) == ["pkg.memory"]


def test_every_module_under_torchrpc_is_used_by_the_library():
    found = unimported_modules(PKG, ENTRY_POINTS)
    assert not found, f"modules only tests would load (move them under tests/): {found}"


# -- no patching of torch at import -------------------------------------------------------------------


def test_no_module_patches_torch_when_imported():
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:  # statements that run at import (functions do not)
            for sub in ast.walk(node) if not isinstance(
                    node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else ():
                targets = sub.targets if isinstance(sub, ast.Assign) else \
                    [sub.target] if isinstance(sub, (ast.AugAssign, ast.AnnAssign)) else []
                for target in targets:
                    root = target
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if target is not root and isinstance(root, ast.Name) and root.id == "torch":
                        problems.append(f"{path.relative_to(PKG)}:{sub.lineno}: "
                                        f"{ast.unparse(target)} = ...")
    assert not problems, "\n".join(problems)


def test_importing_torchrpc_leaves_torch_futures_as_they_are():
    # A fresh interpreter: this one has run init_rpc, which installs torchrpc's versions.
    code = textwrap.dedent("""
        import torch.futures
        before = (torch.futures.collect_all, torch.futures.wait_all)
        import torchrpc, torchrpc.rpc, torchrpc.autograd, torchrpc.optim, torchrpc.nn
        import torchrpc._testing.faulty
        from torchrpc._agent import collect
        assert (torch.futures.collect_all, torch.futures.wait_all) == before
        assert not collect.installed()
        collect.install()
        assert collect.installed() and torch.futures.wait_all is collect.wait_all
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=str(PKG.parent))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
