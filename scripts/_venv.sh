# Sourced by the scripts here: make .venv and install into it; any failed step stops the
# script with pip's own output and the step that failed.
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv || { echo "error: could not create .venv with $PY" >&2; exit 1; }
fi

pip_install() {
  local out
  if ! out=$(.venv/bin/python -m pip install -q "$@" 2>&1); then
    printf '%s\n' "$out" >&2
    echo "error: pip install $* failed" >&2
    exit 1
  fi
  printf '%s\n' "$out" | grep -v -e "^WARNING: Location" -e '^$' || true
}
