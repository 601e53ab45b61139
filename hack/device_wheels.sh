#!/usr/bin/env bash
# Wheels for the lent GPU machine (Python 3.12, no network there): lmcache and what it imports
# that the machine's image lacks (the bundle's list less numba, llvmlite, py-cpuinfo and
# sortedcontainers, which that image has). Saved under .whl/ (git-ignored through
# .git/info/exclude); a device call carries `.whl` and starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/common/src:$PWD/connector/src:$PWD/sidecar/src:$PWD
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
exclude="$(git rev-parse --git-path info/exclude)"  # a worktree's .git is a file: ask git where its excludes live
grep -qxF '/.whl/' "$exclude" 2>/dev/null || { mkdir -p "$(dirname "$exclude")"; echo '/.whl/' >> "$exclude"; }
mkdir -p .whl
mapfile -t wanted < <(grep -Ev '^\s*(#|$)' hack/bundle-requirements.txt | grep -Ev '^(numba|llvmlite|py-cpuinfo|sortedcontainers)==')
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "lmcache==${LMCACHE_VERSION:-0.5.6}" "${wanted[@]}"
du -sh .whl
