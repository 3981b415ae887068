"""The drafter trainers: a few steps on a tiny slice lower the loss, and what they export loads and runs losslessly."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_target
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_common  # noqa: E402
import train_dflash  # noqa: E402
import train_eagle3  # noqa: E402

from dflash_trt.loading import load_drafter, load_eagle_drafter, load_target  # noqa: E402
from dflash_trt.runtime import Generator  # noqa: E402
from dflash_trt.sampling import SamplingParams  # noqa: E402
from dflash_trt.torch_backend import TorchBackend  # noqa: E402

LAYER_IDS = [0, 1, 2]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A target and 6 of its own greedy continuations, with features, in make_training_data's shard format."""
    root = tmp_path_factory.mktemp("train")
    target_dir = write_target(root / "target", "llama", seed=21)
    target = load_target(target_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 96, (6,), generator=gen).tolist() for _ in range(6)]
    backend = TorchBackend(target, None, num_pages=64, page_size=16, capture_layers=tuple(LAYER_IDS))
    g = Generator(backend, max_batch=6)
    ids = [g.submit(p, SamplingParams(max_new_tokens=40)) for p in prompts]
    outs, feats = {}, {}
    while g.has_work:  # take each sequence's features before the backend releases it
        for s in g.running_ids:
            feats[s] = backend.pending_features(s)
        for o in g.step():
            outs[o.seq_id] = o
    data = root / "data"
    data.mkdir()
    tensors, meta = {}, []
    for k, s in enumerate(ids):
        tokens = outs[s].prompt_ids + outs[s].output_ids
        tensors[f"{k}.tokens"] = torch.tensor(tokens, dtype=torch.int32)
        tensors[f"{k}.features"] = feats[s][: len(tokens) - 1].to(torch.bfloat16).contiguous()
        meta.append({"id": str(k), "domain": "test", "prompt_len": 6, "output_len": 40})
    save_file(tensors, str(data / "shard-0000.safetensors"))
    (data / "shard-0000.json").write_text(json.dumps(meta))
    (data / "info.json").write_text(json.dumps({"layer_ids": LAYER_IDS, "mix": "test=6", "dtype": "fp32", "max_new_tokens": 40,
                                                "sequences": 6, "generated_tokens": 240}))
    return target_dir, data, prompts, [outs[s].output_ids for s in ids]


def _common(target_dir, data, out):
    return ["--target", str(target_dir), "--data", str(data), "--out", str(out), "--epochs", "40", "--seqs-per-step", "2",
            "--lr", "3e-3", "--threads", "1", "--warmup", "0.05", "--draft-vocab", "48"]


def _lossless(target_dir, drafter, prompts, refs, block):
    target = load_target(target_dir)
    outs = Generator(TorchBackend(target, drafter, num_pages=64, page_size=16, block_size=block), max_batch=3).generate(prompts, SamplingParams(max_new_tokens=40))
    assert [o.output_ids for o in outs] == refs
    return sum(sum(o.accepted_lengths) for o in outs) / sum(len(o.accepted_lengths) for o in outs)


def test_dflash_training_lowers_the_loss_and_exports_a_loadable_lossless_drafter(tiny_data, tmp_path):
    target_dir, data, prompts, refs = tiny_data
    run = train_dflash.main(_common(target_dir, data, tmp_path / "dflash") + ["--mask-token-id", "3", "--block-size", "8", "--anchors", "8"])
    assert run["log"][-1]["loss_ema"] < 0.7 * run["log"][0]["loss"]
    drafter = load_drafter(tmp_path / "dflash", load_target(target_dir).cfg)
    assert drafter.cfg.block_size == 8 and list(drafter.cfg.target_layer_ids) == LAYER_IDS
    assert _lossless(target_dir, drafter, prompts, refs, block=8) > 1.5  # it learned these very sequences
    assert "steps" in (tmp_path / "dflash" / "README.md").read_text()


def test_eagle_training_lowers_the_loss_and_exports_a_loadable_lossless_drafter(tiny_data, tmp_path):
    target_dir, data, prompts, refs = tiny_data
    run = train_eagle3.main(_common(target_dir, data, tmp_path / "eagle") + ["--intermediate-size", "64", "--max-chain", "5"])
    assert run["log"][-1]["loss_ema"] < 0.7 * run["log"][0]["loss"]
    eagle = load_eagle_drafter(tmp_path / "eagle", load_target(target_dir).cfg)
    assert _lossless(target_dir, eagle, prompts, refs, block=6) > 1.5


def test_dpace_weights_are_the_expected_accepted_tokens_from_each_slot():
    """Against a naive loop over the definition (speculators losses/utils.py): w_k = m_k Σ_{j≥k} m_j Π_{i≤j} s_i."""
    torch.manual_seed(0)
    ce = torch.rand(3, 6) * 3
    valid = torch.rand(3, 6) > 0.2
    ce = torch.where(valid, ce, torch.zeros_like(ce))
    alpha = 0.3
    got = train_dflash.dpace_weights(ce, valid, alpha)
    want = torch.zeros_like(ce)
    for a in range(3):
        for k in range(6):
            if not valid[a, k]:
                continue
            total = 0.0
            for j in range(k, 6):
                if valid[a, j]:
                    prod = 1.0
                    for i in range(j + 1):
                        prod *= float((1 - alpha) * torch.exp(-ce[a, i]) + alpha) if valid[a, i] else 1.0
                    total += prod
            want[a, k] = total
    torch.testing.assert_close(got, want)
    # a perfect drafter (ce 0) on a full block of 5 labelled slots: 5, 4, 3, 2, 1
    assert train_dflash.dpace_weights(torch.zeros(1, 5), torch.ones(1, 5, dtype=torch.bool), 0.5).tolist() == [[5.0, 4.0, 3.0, 2.0, 1.0]]


def test_heldout_tau_is_what_greedy_decoding_accepts_at_those_anchors(tiny_data, tmp_path):
    """The teacher-forced τ equals a naive re-computation: per anchor, the drafter's own greedy block (the runtime's
    DFlashDrafter forward over the same context) compared with the target's tokens, longest matching prefix + 1."""
    target_dir, data, prompts, refs = tiny_data
    train_dflash.main(_common(target_dir, data, tmp_path / "d") + ["--mask-token-id", "3", "--block-size", "8", "--anchors", "8", "--epochs", "4"])
    target = load_target(target_dir)
    drafter = load_drafter(tmp_path / "d", target.cfg)
    seqs = train_common.load_shards(data)
    head = train_common.training_head(target.lm_head_weight, drafter.d2t)
    embed = target.model.embed_tokens.weight
    got = train_dflash.heldout_tau(drafter, embed, head, seqs, anchors_per_seq=4, seed=3)
    rng, accepted = random.Random(3), []
    B = drafter.cfg.block_size
    for seq in seqs:
        tokens = seq["tokens"]
        anchors = sorted(rng.sample(range(seq["prompt_len"], len(tokens) - B), 4))
        for a in anchors:
            logits, y, valid = train_dflash.block_outputs(drafter, embed, head, seq, [a])
            ids = torch.arange(len(drafter.d2t)) + drafter.d2t
            drafts = ids[logits.argmax(-1)].tolist()  # all slots are labelled here: whole blocks, full draft vocab
            n = 0
            while n < B - 1 and drafts[n] == int(tokens[a + 1 + n]):
                n += 1
            accepted.append(n)
    assert got["anchors"] == len(accepted)
    assert got["tau"] == pytest.approx(1 + sum(accepted) / len(accepted), abs=1e-4)
    assert got["accept_rate"][0] == pytest.approx(sum(n >= 1 for n in accepted) / len(accepted), abs=1e-4)


def test_resumed_training_continues_the_learning_curve(tiny_data, tmp_path):
    target_dir, data, prompts, refs = tiny_data
    common = _common(target_dir, data, tmp_path / "a") + ["--mask-token-id", "3", "--block-size", "8", "--anchors", "8", "--epochs", "6",
                                                          "--heldout", "0.34", "--eval-every", "0"]
    first = train_dflash.main(common)
    curve = json.loads((tmp_path / "a" / "learning_curve.json").read_text())["points"]
    assert curve == first["curve"] and len(curve) >= 2 and curve[0]["train_tokens"] == 0
    assert (tmp_path / "a" / "learning_curve.png").is_file() or not _has_matplotlib()
    second = train_dflash.main(_common(target_dir, data, tmp_path / "b") + ["--init-from", str(tmp_path / "a"), "--anchors", "8", "--epochs", "6",
                                                                         "--heldout", "0.34", "--eval-every", "0", "--optimizer", "muon",
                                                                         "--schedule", "linear", "--weighting", "dpace"])
    points = second["curve"]
    assert points[: len(curve)] == curve  # the earlier run's points, then this run's
    new = points[len(curve):]
    assert new[0]["train_tokens"] == curve[-1]["train_tokens"]  # starts where the first run ended
    assert new[0]["tau"] == pytest.approx(curve[-1]["tau"], abs=1e-3)  # the same drafter on the same held-out set
    assert all(b["train_tokens"] > a["train_tokens"] for a, b in zip(new, new[1:]))
    assert "resumed from" in (tmp_path / "b" / "README.md").read_text()
    drafter = load_drafter(tmp_path / "b", load_target(target_dir).cfg)
    _lossless(target_dir, drafter, prompts, refs, block=8)


def test_grown_drafter_starts_as_the_resumed_one_then_trains_its_new_layer(tiny_data, tmp_path):
    """--grow-layers: the extra layer starts as the identity (held-out τ at step 0 equals the resumed drafter's last
    point, the drafts are the same tokens), and training moves it; the export loads with one more layer, lossless."""
    target_dir, data, prompts, refs = tiny_data
    base = ["--anchors", "8", "--heldout", "0.34", "--eval-every", "0"]
    train_dflash.main(_common(target_dir, data, tmp_path / "a") + ["--mask-token-id", "3", "--block-size", "8", "--epochs", "6"] + base)
    target = load_target(target_dir)
    small = load_drafter(tmp_path / "a", target.cfg)
    raw = json.loads((tmp_path / "a" / "config.json").read_text())
    grown = train_dflash.grow_layers(small, raw, 1, tmp_path / "g")
    assert grown.cfg.num_layers == small.cfg.num_layers + 1 and raw["num_hidden_layers"] == grown.cfg.num_layers

    def drafts(drafter):
        backend = TorchBackend(target, drafter, num_pages=64, page_size=16)
        backend.add_sequence(0)
        backend.prefill([0], [prompts[0] + refs[0][:10]], [False])
        return backend.draft([0], [refs[0][10]], [7])

    assert drafts(grown) == drafts(small)
    run = train_dflash.main(_common(target_dir, data, tmp_path / "b") + ["--init-from", str(tmp_path / "a"), "--grow-layers", "1",
                                                                         "--epochs", "6"] + base)
    before = json.loads((tmp_path / "a" / "learning_curve.json").read_text())["points"]
    assert run["curve"][len(before)]["tau"] == pytest.approx(before[-1]["tau"], abs=1e-3)
    out = load_drafter(tmp_path / "b", target.cfg)
    assert out.cfg.num_layers == small.cfg.num_layers + 1
    assert out.layers[-1].self_attn.o_proj.weight.abs().max() > 0  # the zeroed output matrices trained
    assert "grown by 1" in (tmp_path / "b" / "README.md").read_text()
    _lossless(target_dir, out, prompts, refs, block=8)
    with pytest.raises(SystemExit):
        train_dflash.main(_common(target_dir, data, tmp_path / "c") + ["--grow-layers", "1", "--mask-token-id", "3"])


def test_grown_layers_start_as_the_identity_with_biases_too(tmp_path):
    """A drafter with attention and MLP biases: the grown layer's o_proj and down_proj biases start at zero as well,
    so its block hidden states are exactly the resumed drafter's."""
    from conftest import write_drafter

    target_dir = write_target(tmp_path / "t", "qwen3", seed=1)
    drafter_dir = write_drafter(tmp_path / "d", target_dir, block_size=8, attention_bias=True, mlp_bias=True, target_layer_ids=[0, 1])
    target = load_target(target_dir)
    small = load_drafter(drafter_dir, target.cfg)
    assert small.layers[-1].self_attn.o_proj.bias.abs().max() > 0 and small.layers[-1].mlp.down_proj.bias.abs().max() > 0
    grown = train_dflash.grow_layers(small, json.loads((drafter_dir / "config.json").read_text()), 1, tmp_path / "g")

    def drafts(drafter):
        backend = TorchBackend(target, drafter, num_pages=64, page_size=4)
        backend.add_sequence(0)
        backend.prefill([0], [[5, 6, 7, 8, 9]], [False])
        return backend._draft_dflash([0], [10], [7])  # the final hidden states at the block slots

    assert torch.equal(drafts(grown), drafts(small))


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_lineage_prompts_are_never_held_out_and_the_rest_split_as_before():
    """--lineage-mix: what the resumed drafter trained on stays out of the held-out set (its τ there would be a
    training score); every other sequence is held out by the same hash as without the flag."""
    mix = "code=30,chat=20"
    seen = train_common.lineage_prompts(mix)
    from dflash_trt.prompts import load_train_prompts

    code, chat = load_train_prompts("code", 90, seed=0), load_train_prompts("chat", 60, seed=0)
    assert len(seen) == 50 and {("code", p.id) for p in code[:30]} <= seen and not {("code", p.id) for p in code[30:]} & seen
    seqs = [{"domain": p.domain, "id": p.id} for p in code + chat]
    _, plain = train_common.split_heldout(seqs, 0.5)
    train, held = train_common.split_heldout(seqs, 0.5, seen)
    assert held and not {(s["domain"], s["id"]) for s in held} & seen
    assert held == [s for s in plain if (s["domain"], s["id"]) not in seen]  # the rest: the same hash split
    assert len(train) + len(held) == len(seqs)
    with pytest.raises(SystemExit, match="--lineage-mix"):
        train_common.lineage_prompts("code:30")


def test_several_data_directories_train_as_one_and_must_agree(tiny_data, tmp_path):
    _, data, _, _ = tiny_data
    other = tmp_path / "other"
    other.mkdir()
    for f in data.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    info, seqs = train_common.merge_data([data, other])
    one = train_common.load_shards(data)
    assert len(seqs) == 2 * len(one) and info["sequences"] == 12 and info["generated_tokens"] == 480
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(seqs, one + one))
    raw = json.loads((other / "info.json").read_text())
    (other / "info.json").write_text(json.dumps(dict(raw, layer_ids=[0, 1])))
    with pytest.raises(SystemExit, match=r"other/info.json: layer_ids"):
        train_common.merge_data([data, other])
    with pytest.raises(SystemExit, match="given twice in --data"):  # the same directory, spelled another way
        train_common.merge_data([data, data.parent / "." / data.name])


def _as_eval_split(data: Path, out: Path, domains: list[str]) -> Path:
    """A copy of the tiny data marked as make_training_data --split eval, its sequences under `domains` in turn."""
    out.mkdir()
    meta = json.loads((data / "shard-0000.json").read_text())
    for k, m in enumerate(meta):
        m["domain"] = domains[k % len(domains)]
    (out / "shard-0000.json").write_text(json.dumps(meta))
    (out / "shard-0000.safetensors").write_bytes((data / "shard-0000.safetensors").read_bytes())
    info = json.loads((data / "info.json").read_text())
    (out / "info.json").write_text(json.dumps(dict(info, split="eval")))
    return out


def test_curve_data_measures_the_curve_per_domain_and_is_never_trained_on(tiny_data, tmp_path):
    """--curve-data: the curve's τ is heldout_tau on those sequences, pooled and per domain (recomputed here on the
    exported drafter); an eval-split directory passed as --data is refused (never trained on)."""
    target_dir, data, _, _ = tiny_data
    curve_dir = _as_eval_split(data, tmp_path / "evalset", ["code", "math"])
    args = _common(target_dir, data, tmp_path / "d") + ["--mask-token-id", "3", "--block-size", "8", "--anchors", "8", "--epochs", "4",
                                                        "--curve-data", str(curve_dir), "--eval-every", "0", "--eval-anchors", "5"]
    run = train_dflash.main(args)
    last = run["curve"][-1]
    assert last["set"] == "eval" and set(last["by_domain"]) == {"code", "math"} and "heldout_tau" not in last
    target = load_target(target_dir)
    drafter = load_drafter(tmp_path / "d", target.cfg)
    embed = target.model.embed_tokens.weight.detach()
    head = train_common.training_head(target.lm_head_weight.detach(), drafter.d2t)
    seqs = train_common.load_curve_data(str(curve_dir))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # as fit measures it (the export is bf16: near, not equal)
        pooled = train_dflash.heldout_tau(drafter, embed, head, seqs, 5)
        code = train_dflash.heldout_tau(drafter, embed, head, [s for s in seqs if s["domain"] == "code"], 5)
    assert last["tau"] == pytest.approx(pooled["tau"], abs=0.15) and last["by_domain"]["code"] == pytest.approx(code["tau"], abs=0.2)
    assert "bench prompts" in (tmp_path / "d" / "README.md").read_text()
    with pytest.raises(SystemExit, match="never trained on"):
        train_dflash.main(_common(target_dir, curve_dir, tmp_path / "e") + ["--mask-token-id", "3"])
    with pytest.raises(SystemExit, match="--split eval"):
        train_common.load_curve_data(str(data))


def test_eagle_training_resumes_from_a_drafter(tiny_data, tmp_path):
    """--init-from: the resumed run starts from the drafter's weights (at lr 0 it exports them unchanged) and its
    config (max chain, d2t); with a learning rate it goes on lowering the loss from where the first run ended."""
    target_dir, data, prompts, refs = tiny_data
    first = train_eagle3.main(_common(target_dir, data, tmp_path / "a") + ["--intermediate-size", "64", "--max-chain", "5", "--epochs", "20"])
    still = train_eagle3.main(_common(target_dir, data, tmp_path / "b") + ["--init-from", str(tmp_path / "a"), "--epochs", "2", "--lr", "0"])
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "b" / "config.json").read_text()) == json.loads((tmp_path / "a" / "config.json").read_text())
    assert still["log"][0]["loss"] < 0.5 * first["log"][0]["loss"]  # not an untrained start
    more = train_eagle3.main(_common(target_dir, data, tmp_path / "c") + ["--init-from", str(tmp_path / "a"), "--epochs", "20"])
    assert more["log"][-1]["loss_ema"] < still["log"][-1]["loss_ema"]  # training goes on from there
    eagle = load_eagle_drafter(tmp_path / "c", load_target(target_dir).cfg)
    assert _lossless(target_dir, eagle, prompts, refs, block=6) > 1.0
    assert "resumed from" in (tmp_path / "c" / "README.md").read_text()
