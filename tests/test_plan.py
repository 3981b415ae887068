"""The planner's cost model (dflash_trt/cost_model.py, plan.py): its terms against independent references (the
torch modules' own parameter and KV-cache sizes, Monte-Carlo simulation of routing and acceptance, closed forms),
the CPU fit predicting held-out decoding runs measured on this project's machine, and the command line.
The TP collective bytes are checked against the TP runtime's counters in tests/test_tp.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from dflash_trt.cli import main
from dflash_trt.config import parse_drafter_config, parse_target_config
from dflash_trt.cost_model import (
    Acceptance, Quant, ar_step, dflash_step, expected_tokens, experts_touched, kv_bytes_per_sequence, resident_bytes,
    tree_expected_tokens,
)
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.target import TargetModel
from dflash_trt.plan import Setup, best_rows, plan, validate_measured
from dflash_trt.presets import HARDWARE, MODELS, drafter_shape, target_shape

ROOT = Path(__file__).resolve().parent.parent
TARGET = dict(architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=300, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
              tie_word_embeddings=False, eos_token_id=1)
DRAFTER = dict(architectures=["DFlashDraftModel"], block_size=8, dflash_config={"mask_token_id": 2, "target_layer_ids": [0, 1]},
               num_target_layers=3, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=300, rms_norm_eps=1e-6, rope_theta=10000.0,
               max_position_embeddings=512, layer_types=["full_attention"] * 2)


def _matrix_params(module: torch.nn.Module) -> int:
    """Parameters of the module's matrices (norm vectors excluded: the cost model does not count them)."""
    return sum(p.numel() for p in module.parameters() if p.dim() >= 2)


def test_resident_weights_equal_the_torch_modules_parameters():
    t_cfg = parse_target_config(TARGET, "t/config.json")
    d_cfg = parse_drafter_config(DRAFTER, "d/config.json")
    with torch.device("meta"):
        target, drafter = TargetModel(t_cfg), DFlashDrafter(d_cfg, 2 * t_cfg.hidden_size)
    fp32 = Quant("fp32", "fp32", "fp32", "fp32")
    assert resident_bytes(target_shape(t_cfg), fp32, 1) == 4 * _matrix_params(target)
    assert resident_bytes(drafter_shape(d_cfg), fp32, 1) == 4 * _matrix_params(drafter)
    # under TP every matrix is split over the ranks (vocabulary-parallel embedding and lm_head included)
    assert resident_bytes(target_shape(t_cfg), fp32, 2) == 2 * _matrix_params(target)


def test_kv_bytes_per_sequence_equal_the_paged_cache_per_token_times_context():
    t_cfg = parse_target_config(TARGET, "t/config.json")
    with torch.device("meta"):
        target = TargetModel(t_cfg)
    cache = target.new_cache(num_pages=4, page_size=16)
    per_token = (cache.k.numel() + cache.v.numel()) * cache.k.element_size() / (4 * 16)
    assert kv_bytes_per_sequence(target_shape(t_cfg), Quant("fp32", "fp32", "fp32", "fp32"), 1, 100) == per_token * 100
    # a sliding layer keeps only its window
    shape = MODELS["gpt-oss-120b"].target
    full = sum(w is None for w in shape.windows)
    bf16 = Quant()
    assert kv_bytes_per_sequence(shape, bf16, 1, 4096) == (full * 4096 + (36 - full) * 128) * 2 * 8 * 64 * 2


def test_experts_touched_matches_simulated_top_k_routing():
    rng = random.Random(0)
    for tokens, experts, k in [(1, 128, 4), (16, 128, 4), (64, 32, 4), (512, 128, 4)]:
        trials = 400
        mean = sum(len({e for _ in range(tokens) for e in rng.sample(range(experts), k)}) for _ in range(trials)) / trials
        assert experts_touched(tokens, experts, k) == pytest.approx(mean, rel=0.02, abs=0.05)


def test_expected_tokens_is_the_geometric_closed_form_and_from_tau_inverts_it():
    for alpha in (0.0, 0.3, 0.8, 0.95):
        for k in (1, 5, 15):
            assert expected_tokens([alpha], k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))
    acc = Acceptance.from_tau(4.4, 10)
    assert acc.expected(9) == pytest.approx(4.4, abs=1e-9)
    with pytest.raises(ValueError):
        Acceptance.from_tau(11, 10)


def test_acceptance_from_a_histogram_recovers_the_per_position_rates():
    rates = [0.9, 0.7, 0.5, 0.2]
    hist, reach = {}, 1.0
    for n in range(1, 6):  # n tokens committed: n − 1 drafts accepted, then a rejection (or the block's end)
        stop = 1.0 - rates[n - 1] if n <= len(rates) else 1.0
        hist[n] = round(1e6 * reach * stop)
        reach *= rates[n - 1] if n <= len(rates) else 0
    got = Acceptance.from_histogram(hist, drafts=4).rates
    assert got == pytest.approx(rates, abs=1e-5)


def test_tree_expectation_matches_a_simulated_tree_and_a_one_path_tree_is_the_chain():
    acc = Acceptance((0.7, 0.6, 0.5, 0.4), second_choice=0.4)
    depth, nodes = 4, 9
    # the tree independently: every path of ranks (0: first choice, 1: second) by its probability, best `nodes`
    def p(j, r):
        a = acc.rates[j]
        return a if r == 0 else (1 - a) * 0.4
    paths = []
    def grow(path, prob):
        if path:
            paths.append((prob, tuple(path)))
        if len(path) < depth:
            for r in (0, 1):
                grow(path + [r], prob * p(len(path), r))
    grow([], 1.0)
    tree = {path for _, path in sorted(paths, reverse=True)[:nodes]}
    rng = random.Random(1)
    total, trials = 0, 40000
    for _ in range(trials):
        path, n = (), 1
        for j in range(depth):
            u = rng.random()
            r = 0 if u < acc.rates[j] else (1 if u < acc.rates[j] + p(j, 1) else None)
            if r is None or path + (r,) not in tree:
                break
            path += (r,)
            n += 1
        total += n
    assert tree_expected_tokens(acc, depth, nodes) == pytest.approx(total / trials, abs=0.03)
    chain = Acceptance((0.7, 0.6, 0.5, 0.4), second_choice=0.0)
    assert tree_expected_tokens(chain, depth, depth) == pytest.approx(chain.expected(depth))


def test_best_rows_pick_the_draft_length_a_brute_force_search_picks():
    m = MODELS["llama-3.1-8b"]
    acc = Acceptance.from_tau(4.0, 10)
    setup = Setup(m.target, m.drafter, m.block_size, None, HARDWARE["H200"], Quant(), acc, None)
    for batch in (1, 16, 128):
        rows = {r.method: r for r in best_rows(setup, 1, batch, 2048, None, 64)}
        brute = max(range(1, 10), key=lambda k: acc.expected(k) / dflash_step(m.target, m.drafter, setup.hardware, setup.quant, 1, batch, 2048, k).seconds)
        assert rows["dflash"].drafts == brute
        assert rows["ar"].per_user_tokens_per_s == pytest.approx(1 / ar_step(m.target, setup.hardware, setup.quant, 1, batch, 2048).seconds, rel=1e-3)


def test_a_drafter_that_is_never_right_never_beats_plain_decoding():
    m = MODELS["qwen3-8b"]
    setup = Setup(m.target, m.drafter, m.block_size, m.eagle, HARDWARE["B300"], Quant("fp8", "fp8", "bf16", "bf16"),
                  Acceptance((0.0,) * 15), Acceptance((0.0,) * 7))
    result = plan(setup, [1, 8], [1, 64], 1024, second_choice=0.0)
    assert all(r["speedup_vs_ar"] < 1.0 for r in result["rows"] if r["method"] != "ar")


def test_max_batch_is_where_the_kv_stops_fitting():
    m = MODELS["gpt-oss-120b"]
    setup = Setup(m.target, m.drafter, m.block_size, None, HARDWARE["H200"], Quant("mxfp4", "bf16", "bf16", "bf16"),
                  Acceptance.from_tau(4.4, 10), None)
    result = plan(setup, [1, 8], [1, 4096, 65536], 8192)
    for mem in result["memory"]:
        weights_and_kv = lambda b: mem["weights_gb"] * 1e9 + b * mem["kv_per_sequence_mb"] * 1e6 / 0.9  # noqa: E731
        assert weights_and_kv(mem["max_batch"]) <= 141e9 * 1.0001 and weights_and_kv(mem["max_batch"] + 1) > 141e9 * 0.9999
        for r in result["rows"]:
            if r["tp"] == mem["tp"]:
                assert r["fits"] == (r["batch"] <= mem["max_batch"])


def test_cpu_fit_predicts_held_out_decoding_runs_within_25_percent():
    """Validation (a): fitted on synthetic step timings and the batch-1 and batch-16 runs measured on this project's
    2-core machine (examples/plan/cpu-measured.json, benchmarks/plan_measure.py), the model predicts the batch 2, 4
    and 8 runs' tokens/s, AR and DFlash, within 25%."""
    measured = json.loads((ROOT / "examples/plan/cpu-measured.json").read_text())
    from dflash_trt.cost_model import Shape

    shape = lambda d: Shape(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})  # noqa: E731
    v = validate_measured(measured, shape(measured["target_shape"]), shape(measured["drafter_shape"]))
    held = [r for r in v["runs"] if r["held_out"]]
    assert {(r["method"], r["batch"]) for r in held} == {(m, b) for m in ("ar", "dflash") for b in (2, 4, 8)}
    assert v["max_abs_error_held_out"] <= 0.25, v["runs"]


def test_plan_command_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "--preset", "gpt-oss-120b", "--hardware", "B300", "--quant", "nvfp4", "--tp", "1,8", "--batch", "1,64",
                 "--eagle-tau", "3", "--second-choice", "0.3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| TP | batch | AR | EAGLE-style | DFlash | DFlash tree |" in text
    result = json.loads((out / "plan.json").read_text())
    assert {(r["tp"], r["batch"], r["method"]) for r in result["rows"]} == {
        (tp, b, m) for tp in (1, 8) for b in (1, 64) for m in ("ar", "eagle", "dflash", "dflash-tree")}
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_from_config_dirs_and_a_bench_json(tmp_path, capsys):
    drafter = ROOT / "examples/drafters/smollm2-dflash-b16"
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET | dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                                                                 num_key_value_heads=3, head_dim=64, vocab_size=49152, intermediate_size=1536)))
    assert main(["plan", "--target", str(target), "--drafter", str(drafter), "--hardware", "H100", "--tp", "1,3", "--batch", "1",
                 "--acceptance", str(ROOT / "examples/bench/fp32/bench.json"), "--domain", "code"]) == 0
    assert "bench.json: dflash, code" in capsys.readouterr().out


@pytest.mark.parametrize("argv, key", [
    (["--preset", "qwen3-8b", "--tp", "3"], "--tp"),
    (["--preset", "qwen3-8b", "--tp", "x"], "--tp"),
    ([], "--target"),
])
def test_bad_plan_input_is_one_error_line_with_exit_2(argv, key, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and key in err


def test_the_gpt_oss_120b_preset_is_what_the_released_configs_parse_to():
    """The planner's gpt-oss-120b preset and `plan --target/--drafter` on the released configs (examples/configs, the
    same files `build --dry-run` checks the deployment against) give one shape: the preset is not a second source."""
    from dataclasses import replace

    from dflash_trt.config import load_drafter_config, load_target_config
    from dflash_trt.presets import MODELS, drafter_shape, target_shape

    root = Path(__file__).parents[1] / "examples" / "configs"
    target = load_target_config(root / "gpt-oss-120b")
    drafter = load_drafter_config(root / "gpt-oss-120b-DFlash")

    def same(shape):  # names differ; "all layers full" is () in a preset
        return replace(shape, name="", windows=shape.windows if any(w is not None for w in shape.windows) else ())

    preset = MODELS["gpt-oss-120b"]
    assert same(target_shape(target)) == same(preset.target)
    assert same(drafter_shape(drafter)) == same(preset.drafter)
    assert drafter.block_size == preset.block_size
