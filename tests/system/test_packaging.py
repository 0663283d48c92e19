"""The package as a user installs and reads it: the README scripts, pyproject.toml, the
platform check, the interface variables, and option docstrings that match the defaults."""

from __future__ import annotations

import fnmatch
import inspect
import os
import re
import subprocess
import sys
import zipfile

import pytest

import torchrpc
import torchrpc.rpc as rpc
from torchrpc._rendezvous import rendezvous
from torchrpc.rpc import options

from ..support.group import ROOT

VENV_SH = os.path.join(ROOT, "scripts", "_venv.sh")
SCRIPTS = [os.path.join(ROOT, "scripts", n) for n in ("test.sh", "demo.sh", "conformance.sh")]


def _venv_sh(cwd, *command, **env):
    """Source scripts/_venv.sh in ``cwd`` and run ``command`` there (a function of it)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "TORCHRPC_"))}
    full.update(env)
    return subprocess.run(["bash", "-c", 'set -euo pipefail; source "$0"; "$@"', VENV_SH,
                           *(command or ("true",))],
                          cwd=cwd, env=full, capture_output=True, text=True, timeout=120)


def _bare_venv(path):
    """A .venv without pip (quick to make), with pip linked in from this interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path / ".venv")],
                   check=True, timeout=60)
    import pip
    site = subprocess.run([str(path / ".venv" / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    os.symlink(os.path.dirname(pip.__file__), os.path.join(site, "pip"))
    return site


def _wheel(folder, name, version, requires=()):
    """A minimal wheel that pip can resolve (metadata only)."""
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", "Metadata-Version: 2.1\n"
                   f"Name: {name}\nVersion: {version}\n"
                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                   "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")


# -- the scripts -------------------------------------------------------------------------------

def test_scripts_stop_on_a_python_too_old(tmp_path):
    fake = tmp_path / "python3.8"
    fake.write_text("#!/bin/sh\necho 3.8\n")
    fake.chmod(0o755)
    out = _venv_sh(tmp_path, PYTHON=str(fake))
    assert out.returncode == 1
    assert "needs Python 3.10 or newer" in out.stderr and "Python 3.8" in out.stderr
    assert not (tmp_path / ".venv").exists()
    missing = _venv_sh(tmp_path, PYTHON=str(tmp_path / "nosuchpython"))
    assert missing.returncode == 1 and "cannot run" in missing.stderr


def test_scripts_have_no_silenced_pip_and_use_the_checks():
    for path in SCRIPTS:
        with open(path) as f:
            text = f.read()
        assert "source scripts/_venv.sh" in text and "set -euo pipefail" in text, path
        assert 'install_torch "torch==2.13.0"' in text, path
        for line in text.splitlines():
            assert not ("pip" in line and "|| true" in line), line
    with open(VENV_SH) as f:
        for line in f:
            if "|| true" in line:  # only the filter of pip's output may fail quietly
                assert line.strip().startswith("printf '%s\\n' \"$out\" | grep -v"), line


def test_reuse_torch_uses_the_torch_of_python(tmp_path):
    site = _bare_venv(tmp_path)
    out = _venv_sh(tmp_path, "install_torch", "torch==2.13.0", PYTHON=sys.executable,
                   TORCHRPC_REUSE_TORCH="1")
    assert out.returncode == 0, out.stderr
    import torch
    assert f"using torch {torch.__version__}" in out.stdout
    assert os.path.exists(os.path.join(site, "_torchrpc_reuse_torch.pth"))
    again = _venv_sh(tmp_path, PYTHON=sys.executable)  # without it, the link goes
    assert again.returncode == 0, again.stderr
    assert not os.path.exists(os.path.join(site, "_torchrpc_reuse_torch.pth"))


def test_a_cuda_build_is_not_downloaded_by_surprise(tmp_path):
    _bare_venv(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "torch", "9.9.9", requires=["nvidia-fake-cu99"])
    _wheel(wheels, "nvidia-fake-cu99", "1.0")
    pip_env = dict(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels),
                   PYTHON=sys.executable)
    out = _venv_sh(tmp_path, "install_torch", "torch==9.9.9", **pip_env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "CUDA build" in out.stderr
    assert "TORCHRPC_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in out.stderr
    assert "TORCHRPC_REUSE_TORCH=1" in out.stderr


def test_a_failed_torch_install_says_how_to_get_the_cpu_build(tmp_path):
    _bare_venv(tmp_path)
    out = _venv_sh(tmp_path, "install_torch", "torch==9.9.9", PIP_CONFIG_FILE=os.devnull,
                   PYTHON=sys.executable, TORCHRPC_TORCH_INDEX_URL=(tmp_path / "none").as_uri())
    assert out.returncode == 1
    assert "pip install torch==9.9.9" in out.stderr and "failed" in out.stderr
    assert "--index-url https://download.pytorch.org/whl/cpu" in out.stderr


# -- pyproject.toml ----------------------------------------------------------------------------

def _pyproject():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_pyproject_metadata():
    data = _pyproject()
    project = data["project"]
    assert project["license"] == "BSD-3-Clause"
    assert not any(c.startswith("License ::") for c in project["classifiers"])
    assert "Operating System :: POSIX :: Linux" in project["classifiers"]
    for v in ("3.10", "3.11", "3.12"):
        assert f"Programming Language :: Python :: {v}" in project["classifiers"]
    assert project["requires-python"] == ">=3.10"
    assert {"Documentation", "Source"} <= set(project["urls"])
    assert all(u.startswith("https://") for u in project["urls"].values())
    requires = data["build-system"]["requires"]
    assert any(re.fullmatch(r"setuptools>=(\d+)", r) and int(r.split(">=")[1]) >= 77
               for r in requires), requires
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert "BSD 3-Clause License" in text and "Copyright (c) 2026, the torchrpc authors" in text


def test_version_is_written_once_and_py_typed_ships():
    data = _pyproject()
    assert "version" not in data["project"] and data["project"]["dynamic"] == ["version"]
    assert data["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "torchrpc.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", torchrpc.__version__)
    assert "py.typed" in data["tool"]["setuptools"]["package-data"]["torchrpc"]
    assert os.path.exists(os.path.join(ROOT, "torchrpc", "py.typed"))


def test_the_package_ships_no_benchmark_or_developer_tool():
    # The bench and the timing tool live beside the package, in benchmarks/: the package
    # configuration must not pick them (or the tests) up, and nothing in torchrpc/ may
    # import them. Programs under torchrpc/ are the examples, and the one command the
    # product ships (python -m torchrpc.inspect).
    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    for folder in ("benchmarks", "benchmarks.variants", "tests", "tests.support", "scripts"):
        assert not any(fnmatch.fnmatchcase(folder, pattern) for pattern in include), folder
    assert os.path.exists(os.path.join(ROOT, "benchmarks", "__main__.py"))
    problems = []
    for base, dirs, files in os.walk(os.path.join(ROOT, "torchrpc")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = os.path.relpath(base, ROOT)
        if os.path.basename(base) in ("bench", "benchmarks"):
            problems.append(f"{rel}: a benchmark inside the package")
        for name in (f for f in files if f.endswith(".py")):
            text = _read(rel, name)
            if re.search(r"^\s*(from|import) (benchmarks|tests)\b", text, re.MULTILINE):
                problems.append(f"{rel}/{name}: imports a tool from outside the package")
            program = name == "__main__.py" or re.search(r"__name__ == .__main__.", text)
            if program and not rel.startswith(os.path.join("torchrpc", "examples")) \
                    and rel != os.path.join("torchrpc", "inspect"):
                problems.append(f"{rel}/{name}: a program outside torchrpc/examples")
    assert not problems, "\n".join(problems)


# -- platform and interfaces -------------------------------------------------------------------

@pytest.mark.parametrize("platform", ["win32", "cygwin"])
def test_import_on_an_unsupported_platform_says_so(platform):
    out = subprocess.run([sys.executable, "-c",
                          f"import sys; sys.platform = {platform!r}; import torchrpc.rpc"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: torchrpc supports Linux"), out.stderr
    assert repr(platform) in last and "No module named" not in out.stderr


def test_tp_socket_ifname_is_honoured_like_torchrpc_ifname(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.9.8.7")  # not this machine: the variables decide

    def listen_host(environ):
        read, _ = options.read_environment(rpc.TensorPipeRpcBackendOptions(), environ)
        return rendezvous.listen_host("env://", read.listen_addr)

    assert listen_host({"TP_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    with pytest.raises(Exception, match="nosuchif0"):
        listen_host({"TP_SOCKET_IFNAME": "nosuchif0"})
    # torchrpc's own variable comes first
    assert listen_host({"TP_SOCKET_IFNAME": "nosuchif0", options.IFNAME_ENV: "lo"}) == "127.0.0.1"


# -- docstrings match the defaults -----------------------------------------------------------

_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _parse_default(text):
    """The value of a docstring's "default X" (``16``, ``5 s``, ``64 MiB``, ``True``...)."""
    text = text.strip().rstrip(".;,)")
    if text in ("True", "False"):
        return text == "True"
    m = re.fullmatch(r"([\d.,]+)\s*(KiB|MiB|GiB|s)?", text)
    assert m, f"cannot read the default {text!r}"
    number = float(m.group(1).replace(",", ""))
    return number * _UNITS.get(m.group(2), 1)


def _documented_defaults(cls):
    doc = inspect.getdoc(cls)
    args = doc.split("Args:", 1)[1]
    entries = re.split(r"\n(?=    \w+ \()", "\n" + args)
    found = {}
    for entry in entries:
        m = re.match(r"\s*(\w+) \(", entry)
        if not m:
            continue
        text = " ".join(entry.split())
        d = re.search(r"\(default ((?:[^;:)]|://)+)", text)
        if d:
            found[m.group(1)] = d.group(1)
    return found


@pytest.mark.parametrize("cls", [rpc.TensorPipeRpcBackendOptions])
def test_option_docstrings_state_the_real_defaults(cls):
    signature = inspect.signature(cls.__init__)
    documented = _documented_defaults(cls)
    assert len(documented) >= 12, documented
    for name, text in documented.items():
        real = signature.parameters[name].default
        if name == "init_method":
            assert text.strip("` ") == real, (name, text, real)
            continue
        assert _parse_default(text) == real, (name, text, real)
    for name in ("heartbeat_timeout", "heartbeat_interval", "rpc_timeout", "send_timeout",
                 "num_worker_threads", "log_debug_info_on_timeout"):
        assert name in documented, f"{name}'s docstring does not give its default"


# -- the docs ------------------------------------------------------------------------------------

def _read(*path):
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def test_readme_is_short_and_covers_every_option_and_variable():
    readme = _read("README.md")
    assert len(readme.splitlines()) < 275
    for name in inspect.signature(rpc.TensorPipeRpcBackendOptions.__init__).parameters:
        if name != "self" and not name.startswith("_"):
            assert f"`{name}" in readme or f"{name}=" in readme, name
    code = "".join(_read(os.path.relpath(os.path.join(base, f), ROOT))
                   for base, _, files in os.walk(os.path.join(ROOT, "torchrpc"))
                   for f in files if f.endswith(".py"))
    for variable in set(re.findall(r'"((?:TORCHRPC|TP)_[A-Z_]+)"', code)):
        assert variable in readme, variable
    for variable in ("PYTHON", "TORCHRPC_REUSE_TORCH", "TORCHRPC_TORCH_INDEX_URL",
                     "TORCHRPC_ALLOW_CUDA_TORCH"):
        assert f"`{variable}" in readme and variable in _read("scripts", "_venv.sh"), variable


def test_readme_conformance_count_matches_the_recorded_runs():
    totals = [0, 0, 0, 0]  # tests, passed, failed, skipped
    for line in _read("docs", "CONFORMANCE.md").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and all(c.isdigit() for c in cells[1:5]):
            totals = [t + int(c) for t, c in zip(totals, cells[1:5])]
    tests, passed, failed, skipped = totals
    assert tests == passed + failed + skipped
    readme = " ".join(_read("README.md").split())
    assert f"{passed} of {tests} tests pass" in readme
    assert f"{skipped} skipped" in readme and f"{failed} failed" in readme


def test_docs_describe_the_design_not_the_history_of_the_work():
    history = re.compile(r"\b(this session|until this session|since session|session \d|"
                         r"before this work|as torchrpc did before|the first version|"
                         r"\(issue \d+\))", re.IGNORECASE)
    for name in ["README.md", "BENCHMARKS.md", *(os.path.join("docs", f) for f in os.listdir(
            os.path.join(ROOT, "docs")) if f.endswith(".md"))]:
        # The bench's own tables name the issue of each target; the prose must not.
        prose = "\n".join(line for line in _read(name).splitlines() if not line.startswith("|"))
        found = history.findall(prose)
        assert not found, (name, found)


def test_every_benchmark_table_names_the_machine_it_ran_on():
    # Wins on one CPU must be re-measured on another, so each table's section says which.
    section, unnamed, in_table = "", [], False
    for line in _read("BENCHMARKS.md").splitlines():
        if line.startswith("#"):
            section = line
        elif line.startswith("|") and not in_table and not re.search(
                r"AMD\s+EPYC|Intel|Xeon", section):
            unnamed.append(section.split("(")[0].strip("# "))
        else:
            section += "\n" + line
        in_table = line.startswith("|")
    assert not unnamed, unnamed


def test_docs_state_the_real_option_defaults():
    signature = inspect.signature(rpc.TensorPipeRpcBackendOptions.__init__).parameters
    seen = 0
    for name in ["README.md", *(os.path.join("docs", f) for f in os.listdir(
            os.path.join(ROOT, "docs")) if f.endswith(".md"))]:
        text = " ".join(_read(name).split())
        for option, value in re.findall(r"`(\w+)` \(default ([\w.,]+(?: (?:s|KiB|MiB|GiB))?)",
                                        text):
            if option in signature:
                seen += 1
                assert _parse_default(value) == signature[option].default, (name, option, value)
    assert seen >= 2


def test_design_doc_is_short_and_what_it_names_exists():
    # docs/design.md is the map a newcomer follows file by file: it stays a page, the
    # files it names exist, and every "docs/design.md, <section>" elsewhere finds its section.
    design = _read("docs", "design.md")
    assert len(design.splitlines()) < 400
    headings = {line.lstrip("#").strip() for line in design.splitlines() if line.startswith("#")}
    tree = [os.path.relpath(os.path.join(base, f), ROOT)
            for top in ("torchrpc", "tests", "benchmarks", "scripts", "docs")
            for base, _, files in os.walk(os.path.join(ROOT, top)) for f in files]
    prose = re.sub(r"```.*?```", "", design, flags=re.S)
    for path in set(re.findall(r"`([\w/]+\.py)(?:::\w+)?`", prose)):
        assert any(f == path or f.endswith("/" + path) for f in tree), path
    cited = []
    for name in ["README.md", *tree]:
        if name.endswith((".py", ".md")) and name != os.path.join("docs", "design.md"):
            text = re.sub(r"\s*\n\s*#?\s*", " ", _read(name))  # comments wrapped over lines
            cited += [(name, s) for s in re.findall(r'design\.md[,(\s]+"([^"]+)"', text)]
    assert cited
    for name, section in cited:
        assert section in headings, (name, section)
