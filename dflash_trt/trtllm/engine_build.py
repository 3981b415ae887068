"""`python -m dflash_trt.trtllm.engine_build [--dflash_plugin_lib SO] --checkpoint_dir DIR <trtllm-build args>`

trtllm-build with our architecture registered: loads the plugin library through TensorRT's registry
(plugin_library.register: the "dflash" creators), registers DFlashForCausalLM for the one-engine checkpoint in
MODEL_MAP (model.register, which refuses until its network exists), turns on TensorRT's aliased plugin I/O (DFlashKVInject updates the drafter's
caches in place; TensorRT honours IPluginV3OneBuildV2::getAliasedInput only with
PreviewFeature.ALIASED_PLUGIN_IO_10_03, which tensorrt_llm's Builder.create_builder_config does not set),
then runs tensorrt_llm.commands.build:main on the remaining arguments.
"""

from __future__ import annotations

import argparse
import sys


def enable_aliased_plugin_io() -> None:
    """Wrap tensorrt_llm.builder.Builder.create_builder_config (what builder.build() calls once per engine)."""
    from . import api

    builder = api.get("Builder")
    create = builder.create_builder_config

    def create_with_aliasing(self, *args, **kwargs):
        config = create(self, *args, **kwargs)
        config.trt_builder_config.set_preview_feature(api.get("trt.PreviewFeature").ALIASED_PLUGIN_IO_10_03, True)
        return config

    builder.create_builder_config = create_with_aliasing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--dflash_plugin_lib")
    parser.add_argument("--checkpoint_dir", required=True)
    ours, rest = parser.parse_known_args(argv)
    from . import api, model, plugin_library

    model.register(ours.checkpoint_dir)  # the checkpoint first, then tensorrt_llm (engine_network imports it)
    from .engine_network import dflash_for_causal_lm

    from ..trtllm_config import ENGINE_ARCHITECTURE

    api.get("MODEL_MAP")[ENGINE_ARCHITECTURE] = dflash_for_causal_lm()
    plugin_library.register(ours.dflash_plugin_lib)  # through TensorRT's registry, before any network uses the plugins
    enable_aliased_plugin_io()
    sys.argv = ["trtllm-build", "--checkpoint_dir", ours.checkpoint_dir, *rest]
    api.get("build_main")()


if __name__ == "__main__":
    main()
