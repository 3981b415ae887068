"""Tensor parallelism over MPI ranks (`mpirun -n 2` / `-n 4`, gloo on CPU) against TP=1 on the same weights:
token-identical outputs, accepted lengths and drafter drafts (greedy and sampled, batch 3, nkv < tp, tied and
untied heads, vocab padding, a reduced draft vocabulary, drafter sharded and replicated), every decode step's
collectives in closed form, and failures that end on every rank within a timeout. Each launch batches several
runs (a launch costs seconds).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import write_drafter, write_target, write_tokenizer
from safetensors.torch import load_file, save_file
from test_gpt_oss import write_gpt_oss
from test_mxfp4 import write_released_layout
from tp_worker import OracleDrafts, RecordedDrafts

from dflash_trt.cli import main
from dflash_trt.loading import encode_prompt, load_tokenizer
from dflash_trt.convert import convert
from dflash_trt.loading import load_drafter
from dflash_trt.loading import load_target
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend

WORKER = Path(__file__).with_name("tp_worker.py")
DRAFTERS = Path(__file__).resolve().parents[1] / "examples" / "drafters"
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
QUIET = dict(progress=False, log=lambda *_: None)
BLOCK, MAX_NEW, FP32 = 8, 24, 4
GREEDY = [{"max_new_tokens": MAX_NEW}] * 3
MIXED = [  # a batch that samples (top-p, top-k) around a greedy sequence
    {"max_new_tokens": MAX_NEW, "temperature": 0.9, "top_p": 0.95, "seed": 1},
    {"max_new_tokens": MAX_NEW},
    {"max_new_tokens": MAX_NEW, "temperature": 1.0, "top_k": 20, "seed": 2},
]
MODELS = {
    # vocab 99 pads to 100 at tp 2 and 4; 2 KV heads: split at tp 2, duplicated at tp 4
    "llama": dict(target=dict(arch="llama", seed=3, vocab_size=99), drafter={}),
    # tied lm_head, q/k norms, 1 KV head (duplicated at every tp), in the target and in the drafter; the drafter
    # drafts from 48 of the 96 tokens (d2t), none of them in rank 2's vocab slice [48, 72) at tp 4
    "qwen3": dict(target=dict(arch="qwen3", seed=4, tie=True, num_key_value_heads=1), drafter=dict(num_key_value_heads=1),
                  draft_tokens=[t for t in range(96) if not 48 <= t < 72 and t % 3 != 1]),
    # MoE (4 experts, top 2; each expert's intermediate 48 split 24 / 12 per rank), sinks split with their heads,
    # biases everywhere, alternating sliding / full layers, yarn RoPE; 2 KV heads duplicated at tp 4
    "gpt-oss": dict(target=dict(seed=7), writer=write_gpt_oss, drafter=dict(target_layer_ids=[1, 2])),
    # the released layout: MXFP4 experts (intermediate 64: 32 / 16 real columns per rank, padded to 32 / 16)
    "gpt-oss-mxfp4": dict(target=dict(seed=9), writer=lambda path, seed: write_released_layout(path.parent, seed)[0],
                          drafter=dict(target_layer_ids=[0, 3])),
}
RUNS = ("sharded", "replicated", "mixed")  # per model and launch: oracle-drafted greedy (both drafter modes), sampled


def mpirun(n: int, args: list[str], timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    assert shutil.which("mpirun"), "Open MPI is missing: apt-get install openmpi-bin libopenmpi-dev (.ci/run does)"
    start = time.perf_counter()
    proc = subprocess.run([*MPIRUN, "-n", str(n), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc, time.perf_counter() - start


def run_worker(n: int, jobs: list[dict], tmp: Path, timeout_s: float = 60) -> tuple[subprocess.CompletedProcess, float, list]:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "spec.json").write_text(json.dumps({"timeout_s": timeout_s, "jobs": jobs}))
    proc, seconds = mpirun(n, [sys.executable, WORKER, tmp / "spec.json", tmp])
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(n)] if proc.returncode == 0 else []
    return proc, seconds, ranks


def write_draft_vocab(drafter_dir: Path, tokens: list[int]) -> None:
    """Store the draft vocabulary `tokens` as EAGLE-3's d2t (draft token i is target token i + d2t[i]), as the
    shipped drafters do, in a drafter written with draft_vocab_size=len(tokens)."""
    path = drafter_dir / "model.safetensors"
    state = load_file(path)
    state["d2t"] = torch.tensor(tokens) - torch.arange(len(tokens))
    save_file(state, path)


def generate(backend, prompts, params):
    return Generator(backend, max_batch=len(prompts)).generate(prompts, [SamplingParams(**p) for p in params])


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    """Tiny random targets + drafters converted for tp 2 and 4, and their TP=1 outputs (HF weights, one process)."""
    root = tmp_path_factory.mktemp("tp")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 96, (n,), generator=gen).tolist() for n in (5, 11, 17)]
    models = {}
    for name, spec in MODELS.items():
        target_dir = spec.get("writer", write_target)(root / name / "target", **spec["target"])
        write_tokenizer(target_dir, spec["target"].get("vocab_size", 96))
        draft_tokens = spec.get("draft_tokens")
        drafter_kwargs = dict(spec["drafter"], **({"draft_vocab_size": len(draft_tokens)} if draft_tokens else {}))
        drafter_dir = write_drafter(root / name / "drafter", target_dir, num_layers=2, block_size=BLOCK, **drafter_kwargs)
        if draft_tokens:
            write_draft_vocab(drafter_dir, draft_tokens)
        for tp in (2, 4):
            convert(target_dir, drafter_dir, root / name / f"tp{tp}", dtype="fp32", tp=tp, **QUIET)
        target = load_target(target_dir)
        drafter = load_drafter(drafter_dir, target.cfg)
        refs = [o.output_ids for o in generate(TorchBackend(target, None, 256, 4), prompts, GREEDY)]
        oracle_drafter = RecordedDrafts(TorchBackend(target, drafter, 256, 4, BLOCK))
        oracle = generate(OracleDrafts(oracle_drafter, prompts, refs), prompts, GREEDY)
        assert [o.output_ids for o in oracle] == refs  # TP=1 is lossless with these drafts (test_lossless.py pins it)
        mixed_drafter = RecordedDrafts(TorchBackend(target, drafter, 256, 4, BLOCK))
        mixed = generate(mixed_drafter, prompts, MIXED)
        if draft_tokens:  # the drafter really drafts from its reduced vocabulary only
            assert {t for call in mixed_drafter.drafts for d in call for t in d} <= set(draft_tokens)
        models[name] = dict(dir=root / name, target_dir=target_dir, drafter_dir=drafter_dir, t_cfg=target.cfg, d_cfg=drafter.cfg, refs=refs,
                            accepted=[o.accepted_lengths for o in oracle], drafts=oracle_drafter.drafts,
                            mixed=[o.output_ids for o in mixed], mixed_accepted=[o.accepted_lengths for o in mixed], mixed_drafts=mixed_drafter.drafts)
    return root, prompts, models


def expected_collectives(record: dict, t_cfg, d_cfg, replicated: bool) -> tuple[dict, dict]:
    """Calls and bytes one rank sends in one verify or draft call: 2 all-reduces of [T, H] fp32 per layer
    (Megatron), one all-gather of (max, index) fp64 pairs per lm_head use; a replicated drafter only the latter."""
    if record["op"] == "verify":
        tokens = sum(record["shape"])  # K_b + 1 per sequence
        layers = 2 * t_cfg.num_layers
        return {"all_reduce": layers, "all_gather": 1}, {"all_reduce": layers * tokens * t_cfg.hidden_size * FP32, "all_gather": tokens * 16}
    drafted = sum(record["shape"])  # K_b per sequence; the block has K_b + 1 rows
    calls, nbytes = {"all_gather": 1}, {"all_gather": drafted * 16}
    if not replicated:
        layers = 2 * d_cfg.num_layers
        calls["all_reduce"], nbytes["all_reduce"] = layers, layers * (drafted + len(record["shape"])) * d_cfg.hidden_size * FP32
    return calls, nbytes


def planned_collectives(record: dict, t_cfg, d_cfg, tp: int, replicated: bool) -> tuple[dict, dict]:
    """The planner's cost model (cost_model.forward) for the same pass: what `dflash-trt plan` charges the links."""
    from dflash_trt.cost_model import Quant, forward
    from dflash_trt.presets import HARDWARE, drafter_shape, target_shape

    fp32 = Quant("bf16", "bf16", "bf16", activations="fp32")  # the CPU runtime's all-reduces carry fp32
    if record["op"] == "verify":
        cost = forward(target_shape(t_cfg), HARDWARE["B300"], fp32, tp, sum(record["shape"]), len(record["shape"]), 64)
    else:
        drafted = sum(record["shape"])
        cost = forward(drafter_shape(d_cfg), HARDWARE["B300"], fp32, tp, drafted + len(record["shape"]), len(record["shape"]), 64,
                       head_rows=drafted, head_vocab=d_cfg.draft_vocab_size or t_cfg.vocab_size, replicated=replicated)
    return cost.calls, cost.collectives


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_ranks_emit_the_tp1_tokens_drafts_and_accepted_lengths_with_closed_form_collectives(tp_models, tmp_path, tp):
    root, prompts, models = tp_models
    jobs, keys = [], []
    for name, m in models.items():
        ckpt = str(m["dir"] / f"tp{tp}")
        jobs += [
            dict(checkpoint=ckpt, drafter="sharded", prompts=prompts, params=GREEDY, block_size=BLOCK, oracle=m["refs"]),
            dict(checkpoint=ckpt, drafter="replicated", prompts=prompts, params=GREEDY, block_size=BLOCK, oracle=m["refs"]),
            dict(checkpoint=ckpt, drafter="sharded", prompts=prompts, params=MIXED, block_size=BLOCK),
        ]
        keys += [(name, run) for run in RUNS]
    proc, _, ranks = run_worker(tp, jobs, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank, results in enumerate(ranks):
        for (name, run), res in zip(keys, results):
            m = models[name]
            if run == "mixed":  # same seeds, same samples: the full logits are gathered for sampled sequences
                assert res["outputs"] == m["mixed"], (rank, name)
                assert res["accepted"] == m["mixed_accepted"], (rank, name)
                assert res["drafts"] == m["mixed_drafts"], (rank, name)  # real drafts, though almost all rejected
                continue
            assert res["outputs"] == m["refs"], (rank, name, run)
            assert res["accepted"] == m["accepted"], (rank, name, run)
            assert res["drafts"] == m["drafts"], (rank, name, run)  # the drafter's own drafts, under OracleDrafts
            for record in res["records"]:
                want = expected_collectives(record, m["t_cfg"], m["d_cfg"], replicated=run == "replicated")
                assert (record["calls"], record["bytes"]) == want, (rank, name, run, record)
                # the planner charges the links exactly what the runtime sends (issue 18, validation (c))
                assert planned_collectives(record, m["t_cfg"], m["d_cfg"], tp, run == "replicated") == want, (rank, name, run, record)
    assert max(n for m in models.values() for a in m["accepted"] for n in a) == BLOCK  # whole blocks were accepted


def test_generate_checkpoint_under_mpirun_prints_the_tp1_text_once(tp_models, capsys):
    root, _, models = tp_models
    m = models["llama"]
    args = ["--prompt", "def add", "--prompt", "hello world", "--max-new-tokens", "16", "--ignore-eos",
            "--block-size", str(BLOCK), "--page-size", "4", "--threads", "1"]
    assert main(["generate", "--target", str(m["target_dir"]), "--drafter", str(m["drafter_dir"]), *args]) == 0
    want = capsys.readouterr().out
    assert want.count("--- [") == 2
    proc, _ = mpirun(2, [sys.executable, "-m", "dflash_trt.cli", "generate", "--checkpoint", m["dir"] / "tp2", *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == want  # rank 0 alone prints, the same text as TP=1
    assert "tp=2, sharded drafter" in proc.stderr
    # the one-engine checkpoint (convert --format engine): the same shards in one rank file per rank
    convert(m["target_dir"], m["drafter_dir"], root / "engine-tp2", fmt="engine", dtype="fp32", tp=2, **QUIET)
    proc, _ = mpirun(2, [sys.executable, "-m", "dflash_trt.cli", "generate", "--checkpoint", root / "engine-tp2", "--tokenizer", m["target_dir"], *args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == want
    assert "tp=2, sharded drafter" in proc.stderr


def test_world_size_other_than_the_checkpoints_tp_size_fails_on_every_rank(tp_models):
    root, _, models = tp_models
    proc, seconds = mpirun(2, [sys.executable, "-m", "dflash_trt.cli", "generate", "--checkpoint", models["llama"]["dir"] / "tp4",
                               "--prompt", "hi", "--tp-timeout", "30"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: [rank 0,1 of 2]" in proc.stderr  # every rank found it, and they agreed before exiting
    assert "sharded for tp_size=4, but 2 rank(s) were launched" in proc.stderr and "mapping.tp_size" in proc.stderr
    assert seconds < 60


def test_a_rank_missing_its_shard_stops_every_rank_with_the_file_named(tp_models, tmp_path):
    root, prompts, models = tp_models
    ckpt = tmp_path / "ckpt"
    shutil.copytree(models["llama"]["dir"] / "tp2", ckpt)
    (ckpt / "drafter" / "rank1.safetensors").unlink()
    proc, seconds, _ = run_worker(2, [dict(checkpoint=str(ckpt), prompts=prompts, params=GREEDY, block_size=BLOCK)], tmp_path / "out", timeout_s=30)
    assert proc.returncode == 2
    # both ranks report rank 1's missing file (rank 0 had its own shards)
    assert proc.stderr.count("[rank 1 of 2]") == 2 and "drafter/rank1.safetensors" in proc.stderr, proc.stderr[-3000:]
    assert seconds < 60


def test_a_rank_dying_mid_run_ends_the_others_with_an_error_not_a_hang(tp_models, tmp_path):
    root, prompts, models = tp_models
    job = dict(checkpoint=str(models["llama"]["dir"] / "tp2"), prompts=prompts, params=GREEDY, block_size=BLOCK, die_after_steps=3)
    proc, seconds, _ = run_worker(2, [job], tmp_path, timeout_s=30)
    assert proc.returncode != 0
    assert "error: [rank 0/2]" in proc.stderr and "another rank died or timed out" in proc.stderr, proc.stderr[-3000:]
    assert seconds < 60


@pytest.mark.network
def test_shipped_drafter_on_smollm2_over_3_ranks_matches_tp1(tmp_path):
    """SmolLM2-135M has 9 heads and 3 KV heads: tp 3 is the degree that divides it (2 and 4 do not)."""
    from dflash_trt.fetch import fetch_smollm2
    from dflash_trt.prompts import load_eval_prompts

    target_dir = fetch_smollm2(progress=False)
    drafter_dir = DRAFTERS / "smollm2-dflash-b16"
    tok = load_tokenizer(target_dir)
    prompts = [encode_prompt(tok, p.text, chat=True) for d in ("code", "math") for p in load_eval_prompts(d, limit=1)]
    params = [{"max_new_tokens": 32}] * len(prompts)
    target = load_target(target_dir)
    ref = generate(TorchBackend(target, load_drafter(drafter_dir, target.cfg), 128, 16), prompts, params)
    del target
    convert(target_dir, drafter_dir, tmp_path / "tp3", dtype="fp32", tp=3, **QUIET)
    proc, _, ranks = run_worker(3, [dict(checkpoint=str(tmp_path / "tp3"), prompts=prompts, params=params)], tmp_path / "out", timeout_s=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for results in ranks:
        assert results[0]["outputs"] == [o.output_ids for o in ref]
        assert results[0]["accepted"] == [o.accepted_lengths for o in ref]
    assert sum(map(sum, results[0]["accepted"])) > 1.15 * sum(map(len, results[0]["accepted"]))  # the drafter is really used
