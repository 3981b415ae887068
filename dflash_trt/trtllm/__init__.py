"""The TensorRT-LLM engine path: model definitions for trtllm-build, the build driver, the engine's contract.

Nothing here imports tensorrt or tensorrt_llm at module load; every name they provide is resolved
through `api.get` (listed once in `api.NAMES`, checked against `api_snapshot.json`). See
docs/engine-path.md for the design.

The engine path exists only up to TensorRT-LLM's 1.2.x line: upstream removed trtllm-build, the TensorRT
backend's Python modules and the C++ executor from main in 2026 (docs/engine-path.md). We pin its last
release and the TensorRT it requires (PyPI metadata of tensorrt-llm 1.2.1: `tensorrt~=10.14.1`).
"""

TENSORRT_LLM_VERSION = "1.2.1"
TENSORRT_VERSION = "10.14.1"  # third_party/tensorrt holds these headers
RELEASE_IMAGE = f"nvcr.io/nvidia/tensorrt-llm/release:{TENSORRT_LLM_VERSION}"  # NGC tags are tensorrt_llm.__version__
