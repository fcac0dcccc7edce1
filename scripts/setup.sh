#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 and installs jaxkv into it (editable), pinned
# by constraints.txt to the JAX version the GPU kernels were built against.
# Usage: bash scripts/setup.sh [EXTRAS], e.g. `test`, `test,bench`, `cuda13`.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local cand v
  for cand in python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$cand"; return
    fi
  done
  # pyenv shims refuse versions that are installed but not selected.
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare | grep -E '^3\.1[2-9]\.[0-9]+$' | sort -V -r); do
      echo "env PYENV_VERSION=$v python${v%.*}"; return
    done
  fi
  echo "error: jaxkv needs Python >= 3.12; none found" >&2
  return 1
}

if [ ! -x .venv/bin/python ]; then
  py=$(find_python)
  $py -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
spec="."
[ -n "${1:-}" ] && spec=".[$1]"
.venv/bin/python -m pip install -q -c constraints.txt -e "$spec"
