"""Activation and KV-cache calibration on the reference runtime: the amax of every linear layer's input
and of every layer's cached K and V, over calibration prompts decoded by the real draft → verify loop
(so the drafter sees the inputs it sees in service: block embeddings and injected target features).

ModelOpt's calibration forward needs CUDA for NVFP4; ours runs anywhere and feeds the same formulas
(quant/fp8.py, quant/nvfp4.py). Keys: "target" / "drafter" → HF module name → amax, with
"layers.{i}.k_cache" / "layers.{i}.v_cache" for the caches.
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn
from ..progress import progress_bar

from ..models.layers import fuse_projections
from ..models.moe import MoE
from ..runtime import Generator
from ..sampling import SamplingParams


def calibrate(backend, prompts: list[list[int]], max_new_tokens: int = 32, progress: bool = True) -> dict[str, dict[str, float]]:
    """Run `prompts` (token ids) greedily through `backend` (a TorchBackend) and return the amax tables."""
    amax: dict[str, dict[str, float]] = {"target": defaultdict(float), "drafter": defaultdict(float)}
    handles = []

    def record(table: dict[str, float], name: str):
        def hook(module, args):
            x = args[0]
            if x.numel():
                table[name] = max(table[name], float(x.detach().abs().amax()))

        return hook

    models = [("target", backend.target)] + ([("drafter", backend.drafter)] if backend.drafter is not None else [])
    # a fused q/k/v or gate/up matmul bypasses the linears' hooks: run them apart while calibrating
    fused_before = [model for _, model in models if fuse_projections(model, on=False)]
    for key, model in models:
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                handles.append(module.register_forward_pre_hook(record(amax[key], name)))
            elif isinstance(module, MoE):
                # gpt-oss's experts are stacked tensors, not nn.Linear: the up / gate input is the layer's input (every
                # token goes to some expert), the down input what Experts.down_input sees; keys are the converter's
                # sources (checkpoint_formats.ExpertView).
                for part in ("up", "gate"):
                    handles.append(module.register_forward_pre_hook(record(amax[key], f"{name}.experts.{part}")))
                handles.append(module.experts.down_input.register_forward_pre_hook(record(amax[key], f"{name}.experts.down")))
    drafter = backend.drafter
    if drafter is not None and hasattr(drafter, "hidden_norm") and hasattr(drafter, "layers"):
        # Context K/V are projected from hidden_norm's output by the fused ctx_kv weight, outside the
        # k_proj / v_proj modules: their input amax counts toward those projections too.
        def ctx_hook(module, args, output):
            value = float(output.detach().abs().amax()) if output.numel() else 0.0
            for i in range(len(drafter.layers)):
                for p in ("k_proj", "v_proj"):
                    name = f"layers.{i}.self_attn.{p}"
                    amax["drafter"][name] = max(amax["drafter"][name], value)

        handles.append(drafter.hidden_norm.register_forward_hook(ctx_hook))

    def caches():
        yield "target", backend.target_cache
        if getattr(backend, "drafter_cache", None) is not None:
            yield "drafter", backend.drafter_cache

    try:
        gen = Generator(backend, eos_token_ids=(), max_batch=1)
        for ids in progress_bar(iterable=prompts, desc="calibrating", unit="prompt", disable=not progress):
            gen.generate([ids], SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
            # the pools hold every K/V written so far (freed pages keep their last contents)
            for key, cache in caches():
                for i in range(cache.k.shape[0]):
                    for kind, pool in (("k", cache.k[i]), ("v", cache.v[i])):
                        name = f"layers.{i}.{kind}_cache"
                        amax[key][name] = max(amax[key][name], float(pool.abs().amax()))
    finally:
        for h in handles:
            h.remove()
        for model in fused_before:
            fuse_projections(model, on=True)
    return {k: dict(v) for k, v in amax.items()}

