"""Train a DFlash drafter on features from examples/make_training_data.py; export the released format.

The recipe of the paper as SpecForge implements it (reference/dflash-peers.md §2): the target
is frozen (its features are precomputed, its embedding and lm_head shared); per sequence many
random anchors a in the target's own answer; each block is [token_a, mask × (B-1)] at
positions a..a+B-1; its context is the features of positions strictly before a; the block
attends bidirectionally within itself; slot k predicts token a+k (the target's own greedy token) with
loss weight exp(-(k-1)/γ), γ = 7 for B = 16 (`--weighting exp`), or D-PACE (`--weighting dpace`, what
speculators 0.9.0 trains DFlash with, losses/utils.py): w_k = Σ_{j≥k} Π_{i≤j} ((1-α) q_i + α), q_i the
drafter's own (detached) probability of slot i's label, i.e. the expected number of tokens accepted from
slot k on; summed CE·w over the count of labelled slots. `--init-from DIR` resumes from a drafter; with
`--heldout F` the held-out τ is measured every `--eval-every` minutes into a learning curve (PNG + JSON in
the drafter's directory), and each measurement writes a checkpoint there.

    python examples/train_dflash.py --target TARGET --data data/train --out examples/drafters/smollm2-dflash-b16
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from train_common import (build_drafter, common_args, curve_evaluator, draft_coverage, export, finish, fit, lineage_prompts, load_curve_data,
                          load_inputs, model_card, previous_curve, split_heldout, training_head)

from dflash_trt.config import DRAFTER_ARCHITECTURE, load_target_config, parse_drafter_config
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.loading import load_drafter
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


def grow_layers(drafter: DFlashDrafter, raw_cfg: dict, n: int, path: Path) -> DFlashDrafter:
    """`drafter` with `n` more layers on top that start as the identity: each a copy of the last layer with its
    o_proj and down_proj zeroed (a layer is x + attn(x), then + mlp(x): zero outputs leave x as is; its k/v still
    read the injected context). So the grown drafter drafts exactly what the resumed one did, and training can only
    add to it (the zeroed matrices get gradients at once; the copied ones as soon as those move). Updates `raw_cfg`."""
    raw_cfg["num_hidden_layers"] = drafter.cfg.num_layers + n
    raw_cfg["layer_types"] = list(raw_cfg.get("layer_types") or ["full_attention"] * drafter.cfg.num_layers) + ["full_attention"] * n
    cfg = parse_drafter_config(raw_cfg, path / "config.json")
    grown = DFlashDrafter(cfg, drafter.fc.in_features).to(drafter.fc.weight.dtype)
    state = drafter.state_dict()
    last = drafter.cfg.num_layers - 1
    for i in range(drafter.cfg.num_layers, cfg.num_layers):
        for key in [k for k in state if k.startswith(f"layers.{last}.")]:
            state[f"layers.{i}." + key[len(f"layers.{last}."):]] = state[key].clone()
        for name in ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight", "mlp.down_proj.bias"):
            if f"layers.{i}.{name}" in state:  # the biases where the config has them (attention_bias, mlp_bias)
                state[f"layers.{i}.{name}"] = torch.zeros_like(state[f"layers.{i}.{name}"])
    grown.load_state_dict(state, strict=True)
    grown.fuse_context_projections()
    return grown


def block_outputs(drafter: DFlashDrafter, embed: torch.Tensor, head: tuple, seq: dict, anchors: list[int]):
    """The drafter's logits for the blocks at `anchors` of one sequence, as at run time: block [token_a, mask × (B-1)]
    at positions a..a+B-1 over the context features of positions < a. Returns (logits [n, Vd] of the labelled slots,
    labels y [A, B-1] in draft ids, -1 where unlabelled: past the end or outside the draft vocabulary, valid = y >= 0)."""
    lm_head, t2d = head
    cfg = drafter.cfg
    B = cfg.block_size
    tokens, feats = seq["tokens"], seq["features"]
    L = len(tokens)
    A = len(anchors)
    anchor_t = torch.tensor(anchors)
    slot = torch.arange(B)
    q_pos = (anchor_t[:, None] + slot[None]).reshape(-1)  # [A*B]
    block_ids = torch.full((A, B), cfg.mask_token_id, dtype=torch.long)
    block_ids[:, 0] = tokens[anchor_t]
    label_pos = anchor_t[:, None] + slot[None]
    labels = torch.where(label_pos < L, tokens[label_pos.clamp(max=L - 1)], -100)

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
    h = drafter.norm(x).view(A, B, -1)[:, 1:]  # slots 1..B-1 (slot 0 is the known anchor token)
    y = labels[:, 1:]
    y = torch.where(y >= 0, t2d[y.clamp(min=0)], -1)
    valid = y >= 0
    return F.linear(h[valid], lm_head).float(), y, valid


def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights [A, B-1] from the per-slot CE [A, B-1] (0 where not valid): w_k = m_k Σ_{j≥k} m_j Π_{i≤j} s_i,
    s_i = (1-α) exp(-ce_i) + α (1 where unlabelled); detached, not normalised (speculators losses/utils.py)."""
    with torch.no_grad():
        m = valid.float()
        s = torch.where(valid, (1 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
        prefix = torch.cumprod(s, dim=-1)
        tail = torch.flip(torch.cumsum(torch.flip(prefix * m, [-1]), -1), [-1])
        return tail * m


def dflash_loss(drafter: DFlashDrafter, embed: torch.Tensor, head: tuple, seq: dict, num_anchors: int, gamma: float, rng: random.Random,
                weighting: str = "exp", alpha: float = 0.5):
    """Weighted CE over the blocks of `num_anchors` random anchors of one sequence. Returns (loss, accuracy of slot 1).

    head: (lm_head rows of the draft vocabulary, target id → row or -1), see train_common.training_head."""
    n_prompt, L = seq["prompt_len"], len(seq["tokens"])
    candidates = list(range(n_prompt, L - 1))  # anchor = a committed answer token with a successor
    if not candidates:
        return None
    anchors = sorted(rng.sample(candidates, min(num_anchors, len(candidates))))
    logits, y, valid = block_outputs(drafter, embed, head, seq, anchors)
    ce_rows = F.cross_entropy(logits, y[valid], reduction="none")
    if weighting == "dpace":
        ce = torch.zeros(y.shape, dtype=ce_rows.dtype)
        ce[valid] = ce_rows.detach()
        weights = dpace_weights(ce, valid, alpha)[valid]
        loss = (ce_rows * weights).sum() / valid.sum().clamp(min=1)
    else:
        slot = torch.arange(1, y.shape[1] + 1)
        weights = torch.exp(-(slot.float() - 1) / gamma)[None].expand(len(anchors), -1)[valid]
        loss = (ce_rows * weights).sum() / weights.sum()
    # rows of `logits` are valid (anchor, slot) pairs in row-major order; slot 1 is column 0
    is_slot1 = torch.zeros_like(valid)
    is_slot1[:, 0] = True
    hits = (logits.argmax(-1) == y[valid])[is_slot1[valid]]
    return loss, float(hits.float().mean()) if hits.numel() else 0.0


def heldout_tau(drafter: DFlashDrafter, embed: torch.Tensor, head: tuple, seqs: list[dict], anchors_per_seq: int, seed: int = 0) -> dict:
    """τ on held-out sequences, teacher-forced: at random anchors of each answer (the same ones at every call), the
    drafts are the drafter's greedy block and greedy verification accepts their longest prefix equal to the
    target's own tokens, plus one: exactly what decoding accepts from that context. Also P(accepted ≥ k)."""
    rng = random.Random(seed)
    B = drafter.cfg.block_size
    accepted = []
    for seq in seqs:
        L = len(seq["tokens"])
        candidates = list(range(seq["prompt_len"], L - B))  # whole blocks only: no truncation at the end
        if not candidates:
            continue
        anchors = sorted(rng.sample(candidates, min(anchors_per_seq, len(candidates))))
        logits, y, valid = block_outputs(drafter, embed, head, seq, anchors)
        hit = torch.zeros(y.shape, dtype=torch.bool)
        hit[valid] = logits.argmax(-1) == y[valid]
        accepted.append(torch.cumprod(hit.int(), dim=-1).sum(-1))  # leading matches per anchor
    if not accepted:
        return {"tau": 1.0, "accept_rate": [0.0] * (B - 1), "anchors": 0}
    acc = torch.cat(accepted)
    rates = [float((acc >= k).float().mean()) for k in range(1, B)]
    return {"tau": round(float(acc.float().mean()) + 1, 4), "accept_rate": [round(r, 4) for r in rates], "anchors": int(acc.numel())}


def main(argv=None) -> None:
    ap = common_args(__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gamma", type=float, default=7.0)
    ap.add_argument("--weighting", choices=["exp", "dpace"], default="exp", help="per-slot loss weights (see above)")
    ap.add_argument("--alpha", type=float, default=0.5, help="D-PACE's smoothing α")
    ap.add_argument("--mask-token-id", type=int, help="required unless --init-from")
    ap.add_argument("--anchors", type=int, default=32, help="random anchors per sequence")
    ap.add_argument("--eval-anchors", type=int, default=16, help="anchors per held-out sequence for the learning curve")
    ap.add_argument("--init", choices=["target", "random"], default="target")
    ap.add_argument("--grow-layers", type=int, default=0, metavar="N",
                    help="with --init-from: add N layers on top that start as the identity (grow_layers), so a deeper drafter "
                         "resumes at the shipped one's acceptance")
    args = ap.parse_args(argv)
    if args.grow_layers and not args.init_from:
        ap.error("--grow-layers needs --init-from (the drafter to grow)")
    if Path(args.out).exists() and not args.force:
        ap.error(f"{args.out} exists (pass --force to replace it)")
    info, seqs, target = load_inputs(args)
    seqs, heldout = split_heldout(seqs, args.heldout, lineage_prompts(args.lineage_mix))
    embed = target.model.embed_tokens.weight.detach()
    if args.init_from:
        raw_cfg = json.loads((Path(args.init_from) / "config.json").read_text())
        drafter = load_drafter(args.init_from, target.cfg).requires_grad_(True)
        d2t = drafter.d2t
        coverage = draft_coverage(seqs, d2t, target.cfg.vocab_size)
        if list(drafter.cfg.target_layer_ids) != list(info["layer_ids"]):
            raise SystemExit(f"{args.init_from} reads target layers {list(drafter.cfg.target_layer_ids)}, the data has {info['layer_ids']}")
        init = f"resumed from {args.init_from}"
        if args.grow_layers:
            drafter = grow_layers(drafter, raw_cfg, args.grow_layers, Path(args.out)).requires_grad_(True)
            init += f", grown by {args.grow_layers} identity-initialized layer(s)"
    else:
        if args.mask_token_id is None:
            ap.error("--mask-token-id is required (unless --init-from)")
        raw_cfg = drafter_config(Path(args.target), info["layer_ids"], args.layers, args.block_size, args.mask_token_id)
        drafter, d2t, coverage = build_drafter(DFlashDrafter, raw_cfg, args, seqs, DRAFTER_ARCHITECTURE)
        if args.init == "target":
            init_from_target(drafter, target)
        init = f"init from {args.init}"
    cfg = drafter.cfg
    head = training_head(target.lm_head_weight.detach(), d2t)
    title = f"DFlash drafter for {Path(args.target).name}"
    weighting = f"loss weight exp(-(k-1)/{args.gamma})" if args.weighting == "exp" else f"D-PACE loss weights (α {args.alpha})"
    details = [f"{cfg.num_layers} layers, block size {cfg.block_size}, mask token id {cfg.mask_token_id}, target_layer_ids {info['layer_ids']}",
               f"{args.anchors} random anchors per sequence, {weighting}, {init}"]
    curve_seqs = load_curve_data(args.curve_data)
    evaluate = curve_evaluator(lambda model, s: heldout_tau(model, embed, head, s, args.eval_anchors), heldout, curve_seqs)
    if heldout:
        details.append(f"{len(heldout)} sequences held out for the learning curve ({args.heldout:.0%} by prompt-id hash)")
    if curve_seqs:
        details.append(f"learning curve measured on {len(curve_seqs)} target answers to the bench's evaluation prompts ({args.curve_data})")

    def checkpoint(run):  # the drafter as it is now, with its curve so far: a killed run leaves its last checkpoint
        export(drafter, raw_cfg, Path(args.out), model_card(title, "train_dflash.py", info, run, args, details), True, run["curve"], title)
        args.force = True  # the final export replaces this run's own checkpoint

    loss = lambda seq, rng: dflash_loss(drafter, embed, head, seq, args.anchors, args.gamma, rng, args.weighting, args.alpha)  # noqa: E731
    run = fit(drafter, loss, seqs, args, "DFlash drafter", evaluate, checkpoint if evaluate else None, previous_curve(args.init_from))
    return finish(drafter, raw_cfg, args, info, run, title, "train_dflash.py", details, coverage)


if __name__ == "__main__":
    main()
