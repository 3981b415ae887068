"""`dflash-trt bench` output: one run gives every method's figures side by side, and lossless outputs."""

import json

from dflash_trt.bench import Method, markdown, plot, run_bench
from dflash_trt.loading import load_drafter
from dflash_trt.loading import load_target
from dflash_trt.torch_backend import TorchBackend


def test_bench_reports_every_method_per_domain_and_concurrency(tiny_dirs, tmp_path):
    target_dir, drafter_dir = tiny_dirs
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, target.cfg)
    methods = [Method("ar", TorchBackend(target, None, 64, 16)), Method("dflash", TorchBackend(target, drafter, 64, 16, block_size=4))]
    prompt_sets = {"code": [[5, 6, 7], [8, 9, 10, 11]], "chat": [[12, 13]]}
    results = run_bench(methods, prompt_sets, eos=set(), max_new=10, concurrency=[1, 2], progress=False)
    json.dumps(results)  # serialisable
    assert set(results["domains"]) == {"code", "chat"} and set(results["concurrency"]) == {1, 2}
    for row in results["domains"].values():
        assert set(row) == {"ar", "dflash"}
        assert row["ar"]["speedup_vs_ar"] == 1.0 and row["ar"]["tau"] == 1.0
        assert row["dflash"]["equal_to_ar"] == row["dflash"]["requests"]  # lossless in fp32
        assert row["dflash"]["flip_logit_gaps"] == []
        for s in row.values():
            assert s["output_tokens"] == 10 * s["requests"] and s["decode_tokens_per_s"] > 0
            assert sum(k * v for k, v in s["acceptance_histogram"].items()) == s["output_tokens"] - s["requests"]
    table = markdown(results, ["ar", "dflash"], "# t")
    assert table.count("| code |") == 2 and "| 2 | dflash |" in table
    # every column of the header and every method are explained under the table
    head = [c.strip() for c in table.splitlines()[2].strip("|").split("|")]
    notes = table.split("\n\n")[-1]
    for column in head[2:]:
        assert column.split(":")[0].split(" (")[0] in notes, column
    for method in ("`ar`", "`eagle3`", "`dflash`", "`dflash-auto`"):
        assert method in notes
    if plot(results, ["ar", "dflash"], tmp_path / "b.png"):
        assert (tmp_path / "b.png").stat().st_size > 1000


def test_flip_logit_gap_is_the_targets_logit_difference_where_outputs_first_differ(tiny_dirs):
    """Reference: transformers' logits for the common prefix, top-1 against top-2."""
    import torch
    import transformers

    from dflash_trt.bench import flip_logit_gap

    target_dir, _ = tiny_dirs
    backend = TorchBackend(load_target(target_dir), None, 16, 16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompt, reference = [5, 6, 7], [11, 12, 13, 14]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + reference[:2]])).logits[0, -1]
    top2 = logits.topk(2)
    reference[2] = int(top2.indices[0])
    output = reference[:2] + [int(top2.indices[1]), 9]
    gap = flip_logit_gap(backend, prompt, reference, output)
    assert abs(gap - float(top2.values[0] - top2.values[1])) < 1e-4 and gap >= 0
    assert flip_logit_gap(backend, prompt, reference, list(reference)) is None
    assert backend.target_cache.num_free_pages == 16  # the probe's pages went back to the pool


def test_the_verdict_says_which_method_is_fastest_why_and_whether_outputs_match():
    from dflash_trt.bench import verdict

    def row(speedup, tau, equal, gaps=()):
        return {"decode_tokens_per_s": 10 * speedup, "speedup_vs_ar": speedup, "tau": tau, "equal_to_ar": equal, "requests": 4,
                "flip_logit_gaps": list(gaps)}

    results = {"domains": {"code": {"ar": row(1.0, 1.0, 4), "dflash": row(1.6, 2.4, 4)}, "math": {"ar": row(1.0, 1.0, 4), "dflash": row(0.8, 1.2, 3, [0.06])}},
               "setup": {"step_cost": {"batches": [1, 4], "drafts": [0, 15], "seconds": [[0.04, 0.10], [0.08, 0.3]]}}}
    lines = verdict(results, ["ar", "dflash"], "bf16")
    assert lines[0].startswith("- code: fastest is `dflash` at 1.60× AR") and lines[1].startswith("- math: fastest is `ar`")
    assert "costs 2.5× a plain step" in lines[2]
    assert "7 of 8 outputs equal AR's" in lines[3] and "within 0.060" in lines[3]
    results["domains"]["math"]["dflash"] = row(0.8, 1.2, 4)
    assert verdict(results, ["ar", "dflash"], "fp32")[-1] == "- `dflash`'s outputs equal AR's on all 8 prompts (fp32: exact, as the tests prove)."
    results["setup"]["cpu_weights"] = "int8"  # fp32 activations, but int8 matmuls round to bf16: not exact
    assert verdict(results, ["ar", "dflash"], "fp32")[-1] == "- `dflash`'s outputs equal AR's on all 8 prompts."
    results["domains"]["math"]["dflash"] = row(0.8, 1.2, 3, [0.06])
    last = verdict(results, ["ar", "dflash"], "fp32")[-1]
    assert "int8 matmuls' bf16 rounding" in last and "fp32 is exact" not in last


def test_the_report_header_says_which_block_ran_in_words():
    from dflash_trt.bench import header_line

    assert "DFlash block 16 (the drafter's own)," in header_line("t", "bf16", 16, False, 4, 128, 2)
    assert "DFlash block 4 (--block-size)," in header_line("t", "bf16", 4, True, 4, 128, 2)
    assert "no DFlash drafter," in header_line("t", "fp32", None, False, 4, 128, 2)
    assert "default" not in header_line("t", "bf16", 16, False, 4, 128, 2)  # it once said "block drafter default"



def test_the_floor_probe_counts_the_weights_a_step_reads_and_divides_by_the_bandwidth(tmp_path):
    """Reference: transformers' own parameters (tied weights deduplicated by transformers), less the input
    embedding table when it is not also the lm_head; fused projections (one storage for q/k/v) counted once."""
    import math

    import torch
    import transformers

    from conftest import write_target
    from dflash_trt.bench import floor_figures, floor_probe, weight_bytes

    for tie in (False, True):
        target_dir = write_target(tmp_path / f"t{tie}", "llama", tie=tie)
        hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        expected = sum(p.nbytes for p in hf.parameters()) - (0 if tie else hf.model.embed_tokens.weight.nbytes)
        target = load_target(target_dir)
        assert weight_bytes(target) == expected
        backend = TorchBackend(target, None, 64, 16)  # fused q/k/v and gate/up
        assert weight_bytes(backend.target) == expected
        f = floor_probe(backend, reps=2)
        assert backend.target_cache.num_free_pages == 64  # the probe's sequences went back to the pool
        assert f["weight_mb"] == round(expected / 1e6, 1) and f["bandwidth_gb_per_s"] > 0
        assert f["context"] + 16 + 3 <= 64 * 16 and f["ar_step_ms"] > 0 and f["verify_ms"] > 0
    f = floor_figures(50e9, 270_000_000, 0.0162, 0.0243, 200)
    assert math.isclose(f["floor_ms"], 5.4) and math.isclose(f["ar_step_over_floor"], 3.0) and math.isclose(f["verify_over_ar_step"], 1.5)
