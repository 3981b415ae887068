#!/usr/bin/env bash
# On a lent GPU (torch + Triton, no TensorRT): the kernel tests compiled for the GPU, then bandwidth.
#   benchmarks/gpu_kernels.sh            # GPU
#   benchmarks/gpu_kernels.sh --dry-run  # CPU: the same steps through the Triton interpreter, tiny shapes
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--dry-run" ]]; then
  TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py
  python benchmarks/gpu_kernels.py --dry-run
else
  python -c "import torch, triton; assert torch.cuda.is_available(); print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
  DFLASH_KERNELS=auto python -m pytest -q tests/test_kernels.py
  python benchmarks/gpu_kernels.py
fi
