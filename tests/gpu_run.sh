#!/usr/bin/env bash
# The device path's checks on a GPU machine, end to end, in one command (see tests/test_gpu.py):
#   bash tests/gpu_run.sh [OUTDIR]
# Needs: nvcc and the CUDA headers, a driver, Python with numpy (+ CuPy / PyTorch for those kinds),
# and in .whl/ the PyCUDA sdist (or a built wheel) plus wheels of pyzmq, pytools, platformdirs,
# mako, siphash24, python-hostlist (no package index is assumed; tests/gpu_wheels.sh fetches them
# here).  Builds PyCUDA once (the wheel is left in OUTDIR for the next run), runs the GPU and
# device tests (the PyTorch face's with CUDA tensors too), then the device benchmark and, where
# torch sees the GPU, benchmarks/torch_allreduce.py --device cuda.
set -uo pipefail
out=${1:-${OUT:-/tmp/sdp-gpu}}; mkdir -p "$out"
site=/tmp/sdp-site; mkdir -p "$site"
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
py=python3
deps=$(ls .whl/*.whl 2>/dev/null | grep -v '/pycuda-')
$py -m pip install -q --no-index --no-deps --no-compile --target "$site" $deps || exit 1
if ls .whl/pycuda-*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/pycuda-*.whl || exit 1
else
  cuda_root=$(dirname "$(dirname "$(command -v nvcc)")")
  lib=$(find "$cuda_root"/ /usr/local/cuda*/ /usr/local/nvidia/ /usr/lib/x86_64-linux-gnu/ -name 'libcuda.so*' 2>/dev/null | head -1)
  stubs=/tmp/sdp-cudalib; mkdir -p $stubs; ln -sf "$lib" $stubs/libcuda.so
  echo "cuda root $cuda_root ($(ls "$cuda_root"/include/cuda.h 2>&1)), libcuda $lib"
  t0=$(date +%s)
  rm -rf /tmp/pycuda-src && mkdir -p /tmp/pycuda-src && tar xzf .whl/pycuda-*.tar.gz -C /tmp/pycuda-src
  (cd /tmp/pycuda-src/pycuda-* &&
   $py configure.py --cuda-root="$cuda_root" --cudadrv-lib-dir="$stubs" --no-cuda-enable-curand >/dev/null &&
   $py setup.py -q build_ext -j 16 >"$out/pycuda-build.log" 2>&1 &&
   $py setup.py -q bdist_wheel -d "$out" >>"$out/pycuda-build.log" 2>&1) || { tail -40 "$out/pycuda-build.log"; exit 1; }
  $py -m pip install -q --no-index --no-deps --no-compile --target "$site" "$out"/pycuda-*.whl || exit 1
  echo "pycuda built in $(( $(date +%s) - t0 )) s"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import pycuda.driver as c; c.init(); print('pycuda', c.get_version(), c.get_driver_version(), c.Device(0).name())"
$py -m pytest -q -rs --tb=short -p no:cacheprovider --timeout 300 tests/test_gpu.py tests/test_device.py tests/test_torch_gpu.py 2>&1 | tee "$out/tests.log" | tail -40
if command -v nvidia-cuda-mps-control >/dev/null; then  # ranks sharing the GPU without time-slicing
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/sdp-mps CUDA_MPS_LOG_DIRECTORY=/tmp/sdp-mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d && echo "MPS on"
fi
$py -m sdp.launcher.cli -np 2 $py benchmarks/allreduce.py --device gpu --sizes 1K,1M,16M,64M,256M 2>&1 | tee "$out/bench2.log"
$py -m sdp.launcher.cli -np 4 $py benchmarks/allreduce.py --device gpu --sizes 1K,64M 2>&1 | tee "$out/bench4.log" | tail -12
if $py -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then  # the PyTorch face
  $py -m sdp.launcher.cli -np 2 $py benchmarks/torch_allreduce.py --device cuda --sizes 1K,1M,64M --rounds 3 2>&1 |
    tee "$out/torch_bench.log" | tail -16
fi
command -v nvidia-cuda-mps-control >/dev/null && echo quit | nvidia-cuda-mps-control
