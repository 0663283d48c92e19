# Sourced by the scripts here: make .venv and install into it. Any failed step stops the
# script with pip's own output and the step that failed.
#
#   PYTHON=python3.11             the interpreter .venv is made with (default python3; 3.10+)
#   TORCHRPC_REUSE_TORCH=1        use the torch PYTHON has (.venv sees PYTHON's packages)
#   TORCHRPC_TORCH_INDEX_URL=URL  the index torch comes from, for example the CPU wheels'
#   TORCHRPC_ALLOW_CUDA_TORCH=1   install torch even when pip would pick a CUDA build
PY=${PYTHON:-python3}
CPU_INDEX=https://download.pytorch.org/whl/cpu

die() {
  echo "error: $*" >&2
  exit 1
}

# Stop unless interpreter $1 is Python 3.10 or newer; $2 is the fix to suggest.
check_python() {
  local version major minor fix=${2:-"set PYTHON, for example PYTHON=python3.11"}
  version=$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) ||
    die "cannot run '$1'; $fix"
  IFS=. read -r major minor <<<"$version"
  if ! [[ "$major" =~ ^[0-9]+$ && "$minor" =~ ^[0-9]+$ ]]; then
    die "'$1' did not report its version (got '$version'); $fix"
  fi
  if ((major < 3 || (major == 3 && minor < 10))); then
    die "torchrpc needs Python 3.10 or newer; '$1' is Python $version ($fix)"
  fi
}

# TORCHRPC_REUSE_TORCH=1: a .pth file in .venv puts PYTHON's site-packages after the
# venv's own, so its torch is found; unlike --system-site-packages, this also works when
# PYTHON is itself a virtual environment's interpreter.
REUSE_PTH=_torchrpc_reuse_torch.pth

make_venv() {
  check_python "$PY"
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv || die "could not create .venv with $PY"
  fi
  check_python .venv/bin/python "remove .venv to make it again with $PY"
  local site
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') ||
    die "cannot find the site-packages of .venv"
  if [ "${TORCHRPC_REUSE_TORCH:-0}" = 1 ]; then
    local version='import sys; print(sys.version_info[:2])'
    [ "$("$PY" -c "$version")" = "$(.venv/bin/python -c "$version")" ] ||
      die "TORCHRPC_REUSE_TORCH=1, but .venv has another Python version than $PY; remove .venv and run again"
    "$PY" -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' \
      >"$site/$REUSE_PTH" || die "cannot read the site-packages of $PY"
  else
    rm -f "$site/$REUSE_PTH"
  fi
}

pip_install() {
  local out
  if ! out=$(.venv/bin/python -m pip install -q "$@" 2>&1); then
    printf '%s\n' "$out" >&2
    die "pip install $* failed"
  fi
  printf '%s\n' "$out" | grep -v -e "^WARNING: Location" -e '^$' || true
}

torch_hint() {
  cat >&2 <<EOF
To get torch's CPU build (about 200 MB):
  TORCHRPC_TORCH_INDEX_URL=$CPU_INDEX $0
  (or by hand: .venv/bin/python -m pip install $1 --index-url $CPU_INDEX)
To use a torch already installed for $PY: TORCHRPC_REUSE_TORCH=1 $0
EOF
}

# Install torch requirement $1 (e.g. torch==2.13.0) into .venv, unless TORCHRPC_REUSE_TORCH=1
# (then the torch PYTHON has is used) or it is there already. Without an index given, it
# stops where pip would download a CUDA build (gigabytes) and says how to get the CPU one.
install_torch() {
  local want=$1 index=() report out
  if [ "${TORCHRPC_REUSE_TORCH:-0}" = 1 ]; then
    local have
    have=$(.venv/bin/python -c 'import torch; print(torch.__version__)' 2>&1) ||
      { printf '%s\n' "$have" >&2; die "TORCHRPC_REUSE_TORCH=1, but $PY cannot import torch"; }
    echo "using torch $have of $PY (TORCHRPC_REUSE_TORCH=1; the tests are pinned to $want)"
    return
  fi
  if .venv/bin/python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '${want#torch==}')" 2>/dev/null; then
    return
  fi
  if [ -n "${TORCHRPC_TORCH_INDEX_URL:-}" ]; then
    index=(--index-url "$TORCHRPC_TORCH_INDEX_URL")
  elif [ "${TORCHRPC_ALLOW_CUDA_TORCH:-0}" != 1 ]; then
    report=$(mktemp)
    if ! out=$(.venv/bin/python -m pip install -q --dry-run --ignore-installed --report "$report" "$want" 2>&1); then
      rm -f "$report"
      printf '%s\n' "$out" >&2
      echo "error: pip cannot find $want" >&2
      torch_hint "$want"
      exit 1
    fi
    if .venv/bin/python - "$report" <<'EOF'
import json, sys
picked = json.load(open(sys.argv[1]))["install"]
names = [(p["metadata"]["name"].lower(), p["metadata"]["version"]) for p in picked]
sys.exit(0 if any(n.startswith("nvidia-") or (n == "torch" and "+cu" in v) for n, v in names) else 1)
EOF
    then
      rm -f "$report"
      echo "error: pip would install a CUDA build of $want here (several GB with its nvidia-* packages)." >&2
      torch_hint "$want"
      echo "To take the CUDA build anyway: TORCHRPC_ALLOW_CUDA_TORCH=1 $0" >&2
      exit 1
    fi
    rm -f "$report"
  fi
  if ! out=$(.venv/bin/python -m pip install -q ${index[@]+"${index[@]}"} "$want" 2>&1); then
    printf '%s\n' "$out" >&2
    echo "error: pip install $want ${index[*]} failed" >&2
    torch_hint "$want"
    exit 1
  fi
}

make_venv
