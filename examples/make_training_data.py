"""Training data for the drafters: the target's own greedy answers to training prompts, with its features.

For every prompt (chat template applied) the target generates greedily (batched, fp32,
our reference runtime); we keep the token ids, which of them the target produced (the
supervised positions) and the target features at `--layer-ids` for every token, the
context a drafter sees at run time. Output: shards of safetensors under --out.

    python examples/make_training_data.py --target $(dflash-trt fetch-models --quiet) --out data/train

`--split eval` generates the same records for the bench's evaluation prompts instead (`--mix code=40,math=40,chat=40`):
never trained on, they are what the trainers' `--curve-data` measures the learning curve on (teacher-forced τ on the
target's own answers to the bench's prompts, which is what decoding those prompts accepts).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_trt.loading import DTYPES, encode_prompt, generation_eos_ids, load_target, load_tokenizer
from dflash_trt.config import build_target_layer_ids, load_target_config
from dflash_trt.kv_cache import pool_pages
from dflash_trt.progress import progress_bar
from dflash_trt.prompts import load_eval_mix, load_train_mix
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend


class FeatureKeepingBackend(TorchBackend):
    """Keeps each finished sequence's target features instead of dropping them on release."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.finished: dict[int, torch.Tensor] = {}

    def release(self, seq_id: int) -> None:
        self.finished[seq_id] = self.pending_features(seq_id).to(torch.bfloat16)
        super().release(seq_id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mix", default="code=700,gsm=700,chat=500,multilingual=300", help="domain=count,...")
    ap.add_argument("--layer-ids", default=None, help="comma-separated target layer ids (default: the 3-layer formula)")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--shard-size", type=int, default=64, help="sequences per shard (a shard is written, and a rerun resumes, per shard)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--order", choices=["shuffled", "domain"], default="shuffled",
                    help="shuffled: the mix's prompts in one seeded random order, so a run stopped after a few shards "
                         "still holds every domain in proportion; domain: each domain's prompts in turn")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="bf16 doubles batched throughput on AMX CPUs")
    ap.add_argument("--split", choices=["train", "eval"], default="train",
                    help="eval: the mix names evaluation domains (prompts.load_eval_prompts), for a learning curve's --curve-data")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = load_target_config(args.target)
    layer_ids = [int(x) for x in args.layer_ids.split(",")] if args.layer_ids else build_target_layer_ids(cfg.num_layers, 3)
    tok = load_tokenizer(args.target)
    try:
        prompts = (load_train_mix if args.split == "train" else load_eval_mix)(args.mix)
    except ValueError as e:
        raise SystemExit(f"--mix: {e}") from None
    if args.order == "shuffled":
        random.Random(0).shuffle(prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "info.json").exists():  # a rerun resumes by shard index: the shards must hold the same prompts
        old = json.loads((out / "info.json").read_text())
        old.setdefault("order", "domain")  # written before --order existed
        old.setdefault("split", "train")
        for key, now in (("mix", args.mix), ("split", args.split), ("order", args.order), ("layer_ids", layer_ids), ("max_new_tokens", args.max_new_tokens)):
            if old.get(key, now) != now:
                raise SystemExit(f"{out / 'info.json'}: {key} = {old.get(key)!r}, this run {now!r}; a resumed run must "
                                 f"generate the same prompts (another --out, or the same options)")

    target = load_target(args.target, dtype=DTYPES[args.dtype])
    eos = generation_eos_ids(args.target, tok)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    start, shard, total_tokens = time.time(), 0, 0
    bar = progress_bar(total=len(prompts), desc="generate", unit="prompt")
    for lo in range(0, len(prompts), args.shard_size):
        chunk = prompts[lo : lo + args.shard_size]
        name = f"shard-{lo // args.shard_size:04d}"
        if (out / f"{name}.json").exists():  # written last: its shard is complete (a rerun resumes here)
            done = json.loads((out / f"{name}.json").read_text())
            total_tokens += sum(m["output_len"] for m in done)
            shard += 1
            bar.update(len(chunk))
            continue
        ids = [encode_prompt(tok, p.text, chat=True) for p in chunk]
        pages = pool_pages(args.batch, max(map(len, ids)) + args.max_new_tokens, 16, block_size=1)  # plain decoding
        backend = FeatureKeepingBackend(target, None, num_pages=pages, page_size=16, capture_layers=tuple(layer_ids))
        gen = Generator(backend, eos_token_ids=eos, max_batch=args.batch)
        # The whole shard at once: continuous batching refills the batch as answers finish.
        outs = gen.generate(ids, params, on_token=None)
        bar.update(len(ids))
        tensors, meta = {}, []
        for k, (p, o) in enumerate(zip(chunk, outs)):
            tokens = o.prompt_ids + o.output_ids
            feats = backend.finished[o.seq_id]  # [len(tokens) - 1, F]: the last token never entered the cache
            assert feats.shape[0] == len(tokens) - 1
            tensors[f"{k}.tokens"] = torch.tensor(tokens, dtype=torch.int32)
            tensors[f"{k}.features"] = feats.contiguous()
            meta.append({"id": p.id, "domain": p.domain, "prompt_len": len(o.prompt_ids), "output_len": len(o.output_ids)})
            total_tokens += len(o.output_ids)
        save_file(tensors, str(out / f"{name}.safetensors.tmp"))
        (out / f"{name}.safetensors.tmp").replace(out / f"{name}.safetensors")
        (out / f"{name}.json").write_text(json.dumps(meta))
        shard += 1
        bar.set_postfix(gen_tokens=total_tokens, tok_s=f"{total_tokens / (time.time() - start):.0f}")
        write_info(out, args, layer_ids, shard * args.shard_size if lo + args.shard_size < len(prompts) else len(prompts), total_tokens, start)
    bar.close()
    write_info(out, args, layer_ids, len(prompts), total_tokens, start)


def write_info(out: Path, args, layer_ids: list[int], sequences: int, total_tokens: int, start: float) -> None:
    """info.json after every shard: a stopped run leaves data the trainers read (the shards written so far)."""
    (out / "info.json.tmp").write_text(json.dumps({
        "target": str(args.target), "layer_ids": layer_ids, "mix": args.mix, "split": args.split, "order": args.order, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
        "sequences": sequences, "generated_tokens": total_tokens, "wall_s": round(time.time() - start, 1),
    }, indent=2))
    (out / "info.json.tmp").replace(out / "info.json")


if __name__ == "__main__":
    main()
