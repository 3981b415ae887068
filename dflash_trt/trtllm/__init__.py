"""The TensorRT-LLM engine path: model definitions for trtllm-build, the build driver, the engine backend.

Nothing here imports tensorrt or tensorrt_llm at module load; every name they provide is resolved
through `api.get` (listed once in `api.NAMES`, checked against `api_snapshot.json`). See
docs/engine-path.md for the design.
"""
