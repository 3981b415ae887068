"""Train the EAGLE-3-style baseline drafter on the same data and budget as train_dflash.py.

One decoder layer over pairs (fused target features g_p, token x_{p+1}) predicting x_{p+2},
trained with EAGLE-3's training-time test: step k (k = 0..K-1) replaces the features by
the layer's own output of step k-1 at the previous position, exactly what chain drafting
feeds it at run time; position q at step k sees the true context up to q-k and its own
chain of earlier steps. Tokens are the ground truth (the target's own greedy answer).

    python examples/train_eagle3.py --target TARGET --data data/train --out examples/drafters/smollm2-eagle3
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from train_common import build_drafter, common_args, draft_coverage, finish, fit, load_inputs, training_head

from dflash_trt.config import load_target_config
from dflash_trt.config import EAGLE_ARCHITECTURE
from dflash_trt.loading import load_eagle_drafter
from dflash_trt.models.eagle import Eagle3Drafter


def eagle_config(target_dir: Path, layer_ids: list[int], intermediate_size: int, max_chain: int) -> dict:
    cfg = load_target_config(target_dir)
    return {
        "architectures": [EAGLE_ARCHITECTURE],
        "block_size": max_chain + 1,  # verify width: last token + the chain
        "dflash_config": {"target_layer_ids": layer_ids},
        "num_target_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope.theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }


def eagle_loss(model: Eagle3Drafter, embed: torch.Tensor, head: tuple, seq: dict, ttt_steps: int):
    """Mean CE over TTT steps of the answer-token predictions of one sequence. Returns (loss, step-0 accuracy).

    head: (lm_head rows of the draft vocabulary, target id → row or -1), see train_common.training_head."""
    lm_head, t2d = head
    cfg = model.cfg
    tokens, feats, n_prompt = seq["tokens"], seq["features"], seq["prompt_len"]
    P = feats.shape[0] - 1  # pair positions p = 0..P-1: (g_p, x_{p+1}) → x_{p+2}
    if P < 2:
        return None
    pos = torch.arange(P)
    labels = t2d[tokens[pos + 2]]  # -1 outside the draft vocabulary: skipped
    supervised = (pos + 2 >= n_prompt) & (labels >= 0)
    e = F.embedding(tokens[pos + 1], embed)
    cos, sin = model.rotary(pos, e.dtype)
    hidden = model.fuse(feats[:P])
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    keys, values, losses, acc0 = [], [], [], 0.0
    for k in range(ttt_steps):
        if k > 0:  # the previous step's output at the previous position stands in for the features
            hidden = torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])

        def attend(q, kk, v):
            keys.append(kk)
            values.append(v)
            # step 0 keys: positions <= q - k; step j >= 1 keys: exactly position q - k + j
            masks = [pos[None, :] <= (pos[:, None] - k)] + [pos[None, :] == (pos[:, None] - k + j) for j in range(1, k + 1)]
            mask = torch.cat(masks, dim=1)
            mask[:, 0] |= ~mask.any(dim=1)  # rows with nothing visible (q < k) are dropped from the loss anyway
            K = torch.cat(keys).transpose(0, 1)[None]
            V = torch.cat(values).transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], K, V, attn_mask=mask[None, None], enable_gqa=nh != nkv)
            return out[0].transpose(0, 1).reshape(-1, nh * hd)

        hidden = model.layer(e, hidden, cos, sin, attend)
        valid = supervised & (pos >= k)
        if not valid.any():
            return None
        logits = F.linear(model.norm(hidden[valid]), lm_head).float()
        losses.append(F.cross_entropy(logits, labels[valid]))
        if k == 0:
            acc0 = float((logits.argmax(-1) == labels[valid]).float().mean())
    return torch.stack(losses).mean(), acc0


def main(argv=None) -> None:
    ap = common_args(__doc__)
    ap.add_argument("--intermediate-size", type=int, default=3264, help="MLP width; 3264 matches the 2-layer DFlash drafter's parameter count")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--max-chain", type=int, default=7, help="drafts per step at run time (block_size - 1)")
    args = ap.parse_args(argv)
    if args.heldout or args.curve_data:
        ap.error("--heldout and --curve-data (the learning curve) are implemented for train_dflash.py only so far")
    info, seqs, target = load_inputs(args)
    embed = target.model.embed_tokens.weight.detach()
    if args.init_from:  # training goes on from a shipped drafter: its config, d2t and weights
        raw = json.loads((Path(args.init_from) / "config.json").read_text())
        model = load_eagle_drafter(args.init_from, target.cfg).requires_grad_(True)
        d2t = model.d2t if model.cfg.draft_vocab_size else None
        coverage = draft_coverage(seqs, d2t, target.cfg.vocab_size)
        if list(model.cfg.target_layer_ids) != list(info["layer_ids"]):
            raise SystemExit(f"{args.init_from} reads target layers {list(model.cfg.target_layer_ids)}, the data has {info['layer_ids']}")
    else:
        raw = eagle_config(Path(args.target), info["layer_ids"], args.intermediate_size, args.max_chain)
        model, d2t, coverage = build_drafter(Eagle3Drafter, raw, args, seqs, EAGLE_ARCHITECTURE)
        with torch.no_grad():
            model.norm.weight.copy_(target.model.norm.weight)
    head = training_head(target.lm_head_weight.detach(), d2t)
    run = fit(model, lambda seq, rng: eagle_loss(model, embed, head, seq, args.ttt_steps), seqs, args, "EAGLE-3-style drafter")
    return finish(
        model, raw, args, info, run, f"EAGLE-3-style baseline drafter for {Path(args.target).name}", "train_eagle3.py",
        [f"1 decoder layer over [embedding ; fused features of layers {info['layer_ids']}], MLP width {args.intermediate_size}",
         f"training-time test with {args.ttt_steps} steps; chain of up to {raw['block_size'] - 1} drafts at run time"]
        + ([f"resumed from {args.init_from}"] if args.init_from else []),
        coverage,
    )


if __name__ == "__main__":
    main()
