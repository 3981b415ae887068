"""Write a small random gpt-oss pair for scripts/gpu_engine_check.sh: a GptOssForCausalLM made by transformers (MoE,
attention sinks, alternating sliding / full layers, yarn RoPE; random weights) with the tokenizer of --tokenizer, and
a random DFlash drafter for it in z-lab's format, whose KV heads and head size are the target's (one KV pool).

    python scripts/tiny_gpt_oss.py --tokenizer DIR --out DIR      # writes DIR/target and DIR/drafter

Random weights: the pair checks the engine path's logic on gpt-oss's shapes (convert, the contract emulation), not
acceptance.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from dflash_trt.config import check_pair, load_drafter_config, load_target_config
from dflash_trt.convert import TOKENIZER_FILES
from dflash_trt.models.drafter import DFlashDrafter

TARGET = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              num_local_experts=4, num_experts_per_tok=2, sliding_window=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "original_max_position_embeddings": 128, "truncate": False})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a Hugging Face directory whose tokenizer files the target takes")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    src, out = Path(args.tokenizer), Path(args.out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(src)
    special = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}

    torch.manual_seed(args.seed)
    config = transformers.GptOssConfig(**TARGET, vocab_size=len(tokenizer), **special)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # init leaves sinks and expert biases at 0: randomise them so they matter
        for name, t in model.named_parameters():
            if name.endswith(("_bias", "sinks")):
                t.normal_(0.0, 0.5)
    model.save_pretrained(out / "target", safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and name != "generation_config.json":
            shutil.copy2(src / name, out / "target" / name)

    drafter_dir = out / "drafter"
    drafter_dir.mkdir(parents=True, exist_ok=True)
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
        "dflash_config": {"mask_token_id": special["pad_token_id"] or 0, "target_layer_ids": [1, 2]},
        "hidden_size": TARGET["hidden_size"], "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": TARGET["num_attention_heads"], "num_key_value_heads": TARGET["num_key_value_heads"],
        "head_dim": TARGET["head_dim"], "attention_bias": True, "vocab_size": len(tokenizer), "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0, "max_position_embeddings": TARGET["max_position_embeddings"], "hidden_act": "silu",
        "tie_word_embeddings": False, "num_target_layers": TARGET["num_hidden_layers"], "layer_types": ["full_attention"] * 2,
    }
    (drafter_dir / "config.json").write_text(json.dumps(raw, indent=2))
    cfg = check_pair(load_target_config(out / "target"), load_drafter_config(drafter_dir))
    drafter = DFlashDrafter(cfg, len(cfg.target_layer_ids) * TARGET["hidden_size"])
    save_file({k: v.detach().contiguous() for k, v in drafter.state_dict().items()}, str(drafter_dir / "model.safetensors"))
    print(out)


if __name__ == "__main__":
    main()
