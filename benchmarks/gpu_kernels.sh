#!/usr/bin/env bash
# On a lent GPU (torch + Triton, no TensorRT): the kernel tests compiled for the GPU, then bandwidth, then the
# planner's step-time check (benchmarks/plan_gpu.py).
#   benchmarks/gpu_kernels.sh            # GPU
#   benchmarks/gpu_kernels.sh --dry-run  # CPU: the same steps through the Triton interpreter, tiny shapes
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--dry-run" ]]; then
  TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py
  python benchmarks/gpu_kernels.py --dry-run
  python benchmarks/plan_gpu.py --dry-run --out "${TMPDIR:-/tmp}/plan-gpu-dry-run"
else
  python -c "import torch, triton; assert torch.cuda.is_available(); print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
  # The lent GPU machine has torch and Triton but maybe not safetensors or pytest, and no network: install the
  # wheels carried with the working tree (make them here first, ~1.5 MB:
  #   pip download --no-deps -d wheels safetensors tqdm pytest iniconfig pluggy packaging
  # and pass carry=["wheels"] to the device call).
  if ! python -c "import safetensors, tqdm, pytest" 2>/dev/null; then
    WHEELS="${DFLASH_WHEELS:-wheels}"
    [[ -d "$WHEELS" ]] || { echo "safetensors/tqdm/pytest missing and no $WHEELS/ to install them from (see the comment above)" >&2; exit 2; }
    pip install -q --no-index --find-links "$WHEELS" safetensors tqdm pytest
  fi
  # a failing kernel test is reported, and the timings still run (they are what the lent minutes are for)
  DFLASH_KERNELS=auto python -m pytest -q tests/test_kernels.py || echo "kernel tests FAILED (exit $?)"
  python benchmarks/gpu_kernels.py || echo "kernel timings FAILED (exit $?)"
  # the planner's cost model against the torch backend on this GPU (an 8B-shaped random model, bf16)
  python benchmarks/plan_gpu.py --out "${OUT:-gpu-results}"
fi
