"""`dflash-trt bench` output: one run gives every method's figures side by side, and lossless outputs."""

import json

from dflash_trt.bench import Method, markdown, plot, run_bench
from dflash_trt.models.drafter import load_drafter
from dflash_trt.models.target import load_target
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
        for s in row.values():
            assert s["output_tokens"] == 10 * s["requests"] and s["decode_tokens_per_s"] > 0
            assert sum(k * v for k, v in s["acceptance_histogram"].items()) == s["output_tokens"] - s["requests"]
    table = markdown(results, ["ar", "dflash"], "# t")
    assert table.count("| code |") == 2 and "| 2 | dflash |" in table
    if plot(results, ["ar", "dflash"], tmp_path / "b.png"):
        assert (tmp_path / "b.png").stat().st_size > 1000
