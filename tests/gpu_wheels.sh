#!/usr/bin/env bash
# Fill .whl/ (git-excluded) with what tests/gpu_run.sh installs on a GPU machine without a package
# index: run here, where pip reaches PyPI, before carrying .whl/ there:
#   bash tests/gpu_wheels.sh [PYTHON_VERSION]     (default 3.12, the GPU machine's python3)
# Wheels of sdp's dependencies the GPU image lacks (pyzmq, python-hostlist) and of PyCUDA's
# (pytools, platformdirs, mako, siphash24), plus PyCUDA's source, which gpu_run.sh builds there
# against that machine's CUDA once (the wheel it leaves in its OUTDIR can be carried next time).
set -euo pipefail
cd "$(dirname "$0")/.."
ver=${1:-3.12}
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")" .whl
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"
pip=(python3 -m pip)
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version "$ver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pyzmq pytools platformdirs mako siphash24
"${pip[@]}" download -q --no-deps --no-binary=:all: --no-build-isolation -d .whl pycuda python-hostlist
"${pip[@]}" wheel -q --no-deps --no-build-isolation -w .whl .whl/python_hostlist-*.tar.gz  # (pure Python)
rm -f .whl/python_hostlist-*.tar.gz
ls -la .whl
