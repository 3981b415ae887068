"""bench's peers (issue 17 item 4): transformers' own generate, greedy and prompt lookup, in the same table as ours.

The reference is our runtime in fp32: transformers' greedy decoding of the same checkpoint is an independent
implementation, so its tokens must equal our AR's (and prompt lookup is exact in fp32, peers-cpu.md)."""

from dflash_trt.bench import HF_BASELINE, Method, markdown, run_bench, verdict
from dflash_trt.loading import load_drafter, load_target
from dflash_trt.peers import PLD_TOKENS, PeerOutput, make_peers
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend

PROMPTS = {"code": [[5, 6, 7, 5, 6, 7, 5, 6], [8, 9, 10, 11]], "chat": [[12, 13]]}


def test_transformers_peers_decode_what_our_runtime_decodes_and_count_their_steps(tiny_dirs):
    target_dir, _ = tiny_dirs
    greedy, pld = make_peers(["transformers"], target_dir, threads=1)
    assert (greedy.name, pld.name) == (HF_BASELINE, "hf-pld")
    for prompts in PROMPTS.values():
        for peer in (greedy, pld):
            outs = peer.generate(prompts, {2}, 12)
            assert all(isinstance(o, PeerOutput) for o in outs)
            for o in outs:
                # every token after the first step's is counted once, in steps of 1 (greedy) or 1..PLD_TOKENS + 1
                assert sum(o.accepted_lengths) == len(o.output_ids) - o.first_tokens
                assert all(1 <= n <= (1 if peer is greedy else PLD_TOKENS + 1) for n in o.accepted_lengths)
            if peer is greedy:
                hf_ids = [o.output_ids for o in outs]
        gen = Generator(TorchBackend(load_target(target_dir), None, 64, 16), max_batch=4)
        mine = [o.output_ids for o in gen.generate(prompts, SamplingParams(max_new_tokens=12))]
        assert hf_ids == [m[: len(h)] for m, h in zip(mine, hf_ids)] and [len(h) for h in hf_ids] == [len(m) for m in mine]


def test_bench_puts_the_peers_in_the_same_table_with_speedups_over_transformers_greedy(tiny_dirs):
    target_dir, drafter_dir = tiny_dirs
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, target.cfg)
    methods = [Method("ar", TorchBackend(target, None, 64, 16)), Method("dflash", TorchBackend(target, drafter, 64, 16, block_size=4))]
    methods += [Method(p.name, None, peer=p) for p in make_peers(["transformers"], target_dir, threads=1)]
    results = run_bench(methods, PROMPTS, eos=set(), max_new=10, concurrency=[1], progress=False)
    for row in results["domains"].values():
        assert row[HF_BASELINE]["speedup_vs_hf"] == 1.0
        for name in ("ar", "dflash", "hf-pld"):
            s = row[name]
            assert abs(s["speedup_vs_hf"] - s["decode_tokens_per_s"] / row[HF_BASELINE]["decode_tokens_per_s"]) < 1e-2
            assert s["equal_to_ar"] == s["requests"]  # fp32: every implementation decodes the same tokens
    assert set(results["concurrency"][1]) == {"ar", "dflash"}  # peers decode one request at a time
    names = [m.name for m in methods]
    table = markdown(results, names, "# t")
    assert "vs HF fp32 greedy" in table and table.count("| hf-pld |") == len(PROMPTS)
    assert any("over transformers fp32 greedy" in line for line in verdict(results, names, "fp32"))
