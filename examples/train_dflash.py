"""Train a DFlash drafter on features from examples/make_training_data.py; export the released format.

The recipe of the paper as SpecForge implements it (reference/dflash-peers.md §2): the target
is frozen (its features are precomputed, its embedding and lm_head shared); per sequence many
random anchors a in the target's own answer; each block is [token_a, mask × (B-1)] at
positions a..a+B-1; its context is the features of positions strictly before a; the block
attends bidirectionally within itself; slot k predicts token a+k with loss weight
exp(-(k-1)/γ), γ = 7 for B = 16.

    python examples/train_dflash.py --target TARGET --data data/train --out examples/drafters/smollm2-dflash-b16
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F
from train_common import build_drafter, common_args, finish, fit, load_inputs, training_head

from dflash_trt.config import DRAFTER_ARCHITECTURE, load_target_config
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.layers import apply_rope


def drafter_config(target_dir: Path, layer_ids: list[int], num_layers: int, block_size: int, mask_token_id: int) -> dict:
    """The released z-lab config for a drafter as wide as the target (its embedding feeds the block)."""
    cfg = load_target_config(target_dir)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": layer_ids},
        "num_target_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope.theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
    }


def init_from_target(drafter: DFlashDrafter, target) -> None:
    """Start each draft layer from one of the target's last layers (same shapes): a head start
    over random init; q/k norms start at ones, the final norm from the target's."""
    n = len(target.model.layers)
    src = {k: v for k, v in target.state_dict().items()}
    with torch.no_grad():
        for i, layer in enumerate(drafter.layers):
            j = n - len(drafter.layers) + i
            for name, p in layer.named_parameters():
                key = f"model.layers.{j}.{name}"
                if key in src and src[key].shape == p.shape:
                    p.copy_(src[key])
        drafter.norm.weight.copy_(target.model.norm.weight)


def dflash_loss(drafter: DFlashDrafter, embed: torch.Tensor, head: tuple, seq: dict, num_anchors: int, gamma: float, rng: random.Random):
    """Weighted CE over the blocks of `num_anchors` random anchors of one sequence. Returns (loss, accuracy of slot 1).

    head: (lm_head rows of the draft vocabulary, target id → row or -1), see train_common.training_head."""
    lm_head, t2d = head
    cfg = drafter.cfg
    B = cfg.block_size
    tokens, feats, n_prompt = seq["tokens"], seq["features"], seq["prompt_len"]
    L = len(tokens)
    candidates = list(range(n_prompt, L - 1))  # anchor = a committed answer token with a successor
    if not candidates:
        return None
    anchors = sorted(rng.sample(candidates, min(num_anchors, len(candidates))))
    A = len(anchors)
    anchor_t = torch.tensor(anchors)
    slot = torch.arange(B)
    q_pos = (anchor_t[:, None] + slot[None]).reshape(-1)  # [A*B]
    block_ids = torch.full((A, B), cfg.mask_token_id, dtype=torch.long)
    block_ids[:, 0] = tokens[anchor_t]
    label_pos = anchor_t[:, None] + slot[None]
    labels = torch.where(label_pos < L, tokens[label_pos.clamp(max=L - 1)], -100)
    labels[:, 0] = -100  # slot 0 is the known anchor token

    C = feats.shape[0]  # context positions 0..C-1 (C = L - 1)
    ctx = drafter.hidden_norm(drafter.fc(feats.to(drafter.fc.weight.dtype)))  # [C, H]
    x = F.embedding(block_ids.reshape(-1), embed)  # [A*B, H]
    cos_q, sin_q = drafter.rotary(q_pos, x.dtype)
    cos_c, sin_c = drafter.rotary(torch.arange(C), x.dtype)
    # mask [A*B, C + A*B]: context strictly before the block's anchor; the block sees its own slots
    q_anchor = anchor_t.repeat_interleave(B)
    ctx_visible = torch.arange(C)[None, :] < q_anchor[:, None]
    blk = torch.arange(A).repeat_interleave(B)
    blk_visible = blk[:, None] == blk[None, :]
    mask = torch.cat([ctx_visible, blk_visible], dim=1)
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for layer in drafter.layers:
        attn = layer.self_attn
        q, k_blk, v_blk = attn.qkv(layer.input_layernorm(x), cos_q, sin_q)
        k_ctx = apply_rope(attn.k_norm(attn.k_proj(ctx).view(C, nkv, hd)), cos_c, sin_c)
        v_ctx = attn.v_proj(ctx).view(C, nkv, hd)
        k = torch.cat([k_ctx, k_blk]).transpose(0, 1)[None]
        v = torch.cat([v_ctx, v_blk]).transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask[None, None], enable_gqa=nh != nkv)
        x = x + attn.o_proj(out[0].transpose(0, 1).reshape(-1, nh * hd))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    h = drafter.norm(x).view(A, B, -1)[:, 1:]  # slots 1..B-1
    y = labels[:, 1:]
    y = torch.where(y >= 0, t2d[y.clamp(min=0)], -1)  # labels outside the draft vocabulary are skipped
    valid = y >= 0
    logits = F.linear(h[valid], lm_head).float()
    weights = torch.exp(-(slot[1:].float() - 1) / gamma)[None].expand(A, -1)[valid]
    ce = F.cross_entropy(logits, y[valid], reduction="none")
    loss = (ce * weights).sum() / weights.sum()
    # rows of `logits` are valid (anchor, slot) pairs in row-major order; slot 1 is column 0
    is_slot1 = torch.zeros_like(valid)
    is_slot1[:, 0] = True
    hits = (logits.argmax(-1) == y[valid])[is_slot1[valid]]
    return loss, float(hits.float().mean()) if hits.numel() else 0.0


def main(argv=None) -> None:
    ap = common_args(__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gamma", type=float, default=7.0)
    ap.add_argument("--mask-token-id", type=int, required=True)
    ap.add_argument("--anchors", type=int, default=32, help="random anchors per sequence")
    ap.add_argument("--init", choices=["target", "random"], default="target")
    args = ap.parse_args(argv)
    info, seqs, target = load_inputs(args)
    embed = target.model.embed_tokens.weight.detach()
    raw_cfg = drafter_config(Path(args.target), info["layer_ids"], args.layers, args.block_size, args.mask_token_id)
    drafter, d2t, coverage = build_drafter(DFlashDrafter, raw_cfg, args, seqs, DRAFTER_ARCHITECTURE)
    if args.init == "target":
        init_from_target(drafter, target)
    head = training_head(target.lm_head_weight.detach(), d2t)
    run = fit(drafter, lambda seq, rng: dflash_loss(drafter, embed, head, seq, args.anchors, args.gamma, rng), seqs, args, "DFlash drafter")
    return finish(
        drafter, raw_cfg, args, info, run, f"DFlash drafter for {Path(args.target).name}", "train_dflash.py",
        [f"{args.layers} layers, block size {args.block_size}, mask token id {args.mask_token_id}, target_layer_ids {info['layer_ids']}",
         f"{args.anchors} random anchors per sequence, loss weight exp(-(k-1)/{args.gamma}), init from {args.init}"],
        coverage,
    )


if __name__ == "__main__":
    main()
