"""Draft length from the step cost and the running acceptance (draft_length.py): the interpolation, the
acceptance estimates and the choice against closed forms, the calibration cache, and the loop stays lossless."""

from __future__ import annotations

import json
import math
import random

import pytest

from dflash_trt import draft_length as dl


def test_step_cost_is_exact_at_measured_points_and_linear_between():
    cost = dl.StepCost([1, 4], [0, 3], [[1.0, 2.5], [2.0, 6.5]])
    assert cost(1, 0) == 1.0 and cost(4, 3) == 6.5
    assert cost(1, 1) == pytest.approx(1.5)
    assert cost(2, 0) == pytest.approx(1.0 + (2.0 - 1.0) / 3)
    assert cost(8, 0) == pytest.approx(4.0)  # past the largest batch: linear in the batch


def test_acceptance_estimates_converge_to_the_true_conditional_rates():
    rng = random.Random(0)
    truth = [0.8, 0.6, 0.3]
    stats = dl.AcceptanceStats(3, decay=1.0)
    for _ in range(20000):
        accepted = 0
        while accepted < 3 and rng.random() < truth[accepted]:
            accepted += 1
        stats.observe(3, accepted)
    assert stats.rates() == pytest.approx(truth, abs=0.02)
    a = stats.rates()
    assert stats.expected_tokens(2) == pytest.approx(1 + a[0] + a[0] * a[1])


def test_choice_is_the_brute_force_optimum_of_tokens_per_second():
    cost = dl.StepCost([1, 16], [0, 1, 3, 7], [[1.0, 1.05, 1.2, 1.6], [4.0, 6.0, 10.0, 20.0]])
    for rates in ([0.9] * 7, [0.2] * 7, [0.7, 0.5, 0.3, 0.2, 0.1, 0.1, 0.1]):
        policy = dl.DraftLengthPolicy(cost, 7)
        policy.stats.accepted = [r * 1e6 for r in rates]
        policy.stats.offered = [1e6] * 7
        for batch in (1, 16):
            best = max(range(8), key=lambda k: batch * policy.stats.expected_tokens(k) / cost(batch, k))
            assert policy.choose(batch) == best
    policy.stats.accepted = [0.9e6] * 7  # cheap wide verify, high acceptance: the whole block at batch 1
    assert policy.choose(1) == 7
    policy.stats.accepted = [0.05e6] * 7  # drafting cannot pay for itself: plain decoding
    assert policy.choose(16) == 0


def test_calibration_is_cached_and_not_measured_again(tiny_dirs, tmp_path, monkeypatch):
    from dflash_trt.loading import load_torch_backend

    backend = load_torch_backend(*tiny_dirs, num_pages=256, page_size=4, block_size=8)
    cost = dl.load_or_calibrate(backend, "k", tmp_path, max_batch=2)
    assert cost.batches == [1, 2] and cost.drafts == [0, 1, 3, 7]
    assert all(t > 0 for row in cost.seconds for t in row)
    assert json.loads((tmp_path / "step-cost-k.json").read_text()) == cost.to_json()
    assert backend.target_cache.num_free_pages == backend.target_cache.num_pages  # calibration gave its pages back

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(dl, "measure_step", no_measuring)
    assert dl.load_or_calibrate(backend, "k", tmp_path, max_batch=2).to_json() == cost.to_json()
    assert dl.cache_key("a", "b") != dl.cache_key("a", "c")
    before = dl.cache_key("a", "b")
    monkeypatch.setattr(dl, "COST_REVISION", dl.COST_REVISION + "x")  # a runtime whose costs moved measures again
    assert dl.cache_key("a", "b") != before


def test_calibration_fits_a_small_pool_or_gives_up(tiny_dirs, tmp_path):
    """A pool of a few pages (a short prompt) shrinks the synthetic sequences; one that holds none means no policy."""
    from dflash_trt.loading import load_torch_backend

    small = load_torch_backend(*tiny_dirs, num_pages=3, page_size=16, block_size=8)
    cost = dl.calibrate(small, max_batch=4)
    assert cost is not None and cost.batches == [1]
    assert small.target_cache.num_free_pages == 3
    tiny = load_torch_backend(*tiny_dirs, num_pages=1, page_size=4, block_size=8)
    assert dl.calibrate(tiny, max_batch=4) is None
    assert dl.auto_policy(tiny, ["x"], 4, cache_dir=tmp_path, progress=False) is None


def test_calibrate_subcommand_measures_once_and_generate_reuses_the_table(tiny_dirs, capsys):
    from dflash_trt.cli import main
    from dflash_trt.draft_length import calibration_dir

    target, drafter = tiny_dirs
    args = ["--target", str(target), "--drafter", str(drafter), "--threads", "1", "--quiet"]
    before = set(calibration_dir().glob("step-cost-*.json")) if calibration_dir().exists() else set()
    assert main(["calibrate", *args, "--force"]) == 0
    first = capsys.readouterr().out
    assert "measured in" in first and "| 1 |" in first and "(1.00×)" in first
    made = set(calibration_dir().glob("step-cost-*.json")) - before
    assert len(made) <= 1  # one table for this pair (none new if an earlier test made the same one)
    assert main(["calibrate", *args]) == 0
    second = capsys.readouterr().out
    assert "(cached)" in second.splitlines()[0]
    assert second.splitlines()[1:] == first.splitlines()[1:]  # the same table, read back
    mtime = {p: p.stat().st_mtime_ns for p in calibration_dir().glob("step-cost-*.json")}
    gen = ["generate", "--target", str(target), "--drafter", str(drafter), "--prompt", "x", "--max-new-tokens", "4", "--threads", "1", "--quiet"]
    assert main(gen) == 0 and "draft length auto" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in calibration_dir().glob("step-cost-*.json")} == mtime  # generate measured nothing new


def _settled(policy, rates):
    policy.stats.accepted = [r * 1e6 for r in rates]
    policy.stats.offered = [1e6] * len(rates)


def test_measured_step_times_scale_the_drafting_cost_the_choice_sees():
    cost = dl.StepCost([1, 16], [0, 1, 3, 7], [[1.0, 1.05, 1.2, 1.6], [4.0, 6.0, 10.0, 20.0]])
    policy = dl.DraftLengthPolicy(cost, 7, probe_after=0)
    _settled(policy, [0.6] * 7)
    assert policy.choose(1) > 0
    for _ in range(200):  # plain steps run 1.2x the calibration, drafting steps 3.6x: drafting is 3x dearer
        policy.observe_time(1, 0, 1.2 * cost(1, 0))
        policy.observe_time(1, 3, 3.6 * cost(1, 3))
    assert policy.drafting_cost_scale() == pytest.approx(3.0, rel=1e-3)
    for batch in (1, 16):
        best = max(range(8), key=lambda k: batch * policy.stats.expected_tokens(k) / (cost(batch, k) * (3.0 if k else 1.0)))
        assert policy.choose(batch) == best
    assert policy.choose(1) == 0  # at 3x, 0.6 acceptance no longer pays for a draft
    for _ in range(200):  # the same load on both kinds of step: the calibration's ratios hold again
        policy.observe_time(1, 0, 2.0 * cost(1, 0))
        policy.observe_time(1, 1, 2.0 * cost(1, 1))
    assert policy.drafting_cost_scale() == pytest.approx(1.0, rel=1e-3)
    assert policy.choose(1) == max(range(8), key=lambda k: policy.stats.expected_tokens(k) / cost(1, k))


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_after_a_fallback_the_policy_probes_with_backoff_and_recovers_when_drafts_pass(kind):
    cost = dl.StepCost([1], [0, 1, 3, 7], [[1.0, 1.1, 1.3, 1.8]])
    policy = dl.DraftLengthPolicy(cost, 7, probe_after=8) if kind == "chain" else dl.TreePolicy(cost, 7, probe_after=8)
    rng = random.Random(0)

    def run(steps, accept_p):
        chosen = []
        for _ in range(steps):
            k = policy.choose(1)
            accepted = 0
            while accepted < k and rng.random() < accept_p:
                accepted += 1
            policy.observe_path(k, list(range(accepted + 1)))
            chosen.append(k)
        return chosen

    dead = run(2000, 0.0)  # nothing is ever accepted
    start = next(i for i, k in enumerate(dead) if k == 0)
    probes = [i for i, k in enumerate(dead) if k and i > start]
    assert 1 <= len(probes) <= 1 + int(math.log2((2000 - start) / 8 + 1))  # bounded: the gaps double
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert all(g2 - 1 == 2 * (g1 - 1) for g1, g2 in zip(gaps, gaps[1:]))  # a probe after each run of plain steps
    live = run(3000, 0.9)  # drafts pass again: a probe notices, and drafting comes back for good
    first = next(i for i, k in enumerate(live) if k)
    assert first <= 2 * 8 * 2 ** len(probes)
    assert sum(1 for k in live[-500:] if k) > 450
