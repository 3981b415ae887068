"""Loading libdflash_plugins.so so that TensorRT can find its creators.

TensorRT finds a plugin by (name, version, namespace) in its plugin registry. Loading the library with
`ctypes.CDLL` only maps it: nothing calls its entry points, the registry stays without our creators and
engine deserialization fails. `IPluginRegistry::loadLibrary` (NvInferRuntimeCommon.h:208 in TensorRT
10.14.1, Python `get_plugin_registry().load_library`) calls the library's exported `setLoggerFinder` and
`getCreators` and registers every creator it returns (the convention of TensorRT's samples/trtexec
README.md:78-83 @ v10.14). That is what `register` does, in the process that builds or runs engines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..kernels import plugin_spec
from . import api

ENV = "DFLASH_PLUGIN_LIB"


def register(path: str | os.PathLike | None = None, trt_module: Any = None) -> Any:
    """Load the plugin library through TensorRT's registry and check that every creator of plugin_spec is
    now found; returns the library handle. `trt_module`: tensorrt_rtx in the CPU check."""
    path = path or os.environ.get(ENV)
    if not path or not Path(path).is_file():
        raise api.TensorRTUnavailable(f"plugin library not found ({path!r}): build plugins/ (CMake) and pass its path or set {ENV}")
    registry = api.get("trt.get_plugin_registry", trt_module)()
    handle = registry.load_library(str(path))
    missing = [name for name in plugin_spec.PLUGINS if registry.get_creator(name, plugin_spec.VERSION, plugin_spec.NAMESPACE) is None]
    if handle is None or missing:
        raise api.TensorRTUnavailable(f"{path}: TensorRT's plugin registry did not register {missing or 'the library'} "
                                      f"(namespace {plugin_spec.NAMESPACE!r}, version {plugin_spec.VERSION})")
    return handle
