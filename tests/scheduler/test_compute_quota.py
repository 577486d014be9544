"""Compute-quota batching on the PE (docs/paper.md §5.5) and the attention cost model."""

from __future__ import annotations

import random

import pytest

from dualpath.scheduler import (
    DEFAULT_QUOTA_MS,
    AttentionCostModel,
    build_decode_batch,
    build_prefill_batch,
    largest_chunk,
)

M = AttentionCostModel(a=0.001)  # ms = 0.001 × bsz × (cached + bsz / 2)


def test_default_quota_is_300_ms():
    assert DEFAULT_QUOTA_MS == 300.0


def test_prediction_follows_the_documented_form():
    model = AttentionCostModel(a=2e-6, b=1e-3, c=0.5)
    assert model.request_ms(1000, 100) == pytest.approx(2e-6 * 100 * 1050 + 0.1 + 0.5)
    assert model.predict_ms([(1000, 100), (0, 10)]) == pytest.approx(
        model.request_ms(1000, 100) + model.request_ms(0, 10))
    assert model.predict_ms([]) == 0.0


def test_whole_requests_are_packed_fifo_while_they_fit():
    fifo = [("a", 0, 100), ("b", 100, 100), ("c", 0, 10)]  # 5 + 15 + 0.05 ms
    assert build_prefill_batch(fifo, 300.0, M) == fifo


def test_exact_fit_takes_the_whole_request():
    fifo = [("a", 0, 100), ("b", 100, 100)]
    assert build_prefill_batch(fifo, 20.0, M) == fifo  # exactly 5 + 15


def test_the_tail_request_gets_the_largest_chunk_that_fits_and_packing_stops():
    fifo = [("a", 0, 100), ("b", 1000, 1000), ("c", 0, 1)]
    batch = build_prefill_batch(fifo, 300.0, M)
    assert batch[0] == ("a", 0, 100)
    req_id, cached, bsz = batch[1]
    assert (req_id, cached) == ("b", 1000) and len(batch) == 2  # "c" waits behind "b"
    left = 300.0 - M.request_ms(0, 100)
    assert M.request_ms(1000, bsz) <= left < M.request_ms(1000, bsz + 1)
    assert bsz == 260  # 295 ms left: 0.001·260·1130 = 293.8 fits, 0.001·261·1130.5 = 295.06 not


def test_zero_fit_leaves_the_tail_request_out():
    fifo = [("a", 0, 774), ("b", 10_000, 100)]  # a: 0.001·774·387 = 299.5 ms
    assert build_prefill_batch(fifo, 300.0, M) == [("a", 0, 774)]  # b: one token costs 10 ms


def test_an_empty_batch_always_makes_progress():
    fifo = [("a", 1_000_000, 5000)]  # one token costs 1000 ms > quota
    assert build_prefill_batch(fifo, 300.0, M) == [("a", 1_000_000, 1)]
    assert build_prefill_batch(fifo, 300.0, M, align=64) == [("a", 1_000_000, 64)]
    assert build_prefill_batch([], 300.0, M) == []


def test_aligned_chunks_are_multiples_of_align():
    fifo = [("a", 1000, 1000)]
    (_, _, bsz), = build_prefill_batch(fifo, 300.0, M, align=64)
    assert bsz % 64 == 0 and M.request_ms(1000, bsz) <= 300.0 < M.request_ms(1000, bsz + 64)


@pytest.mark.parametrize("seed", range(20))
def test_binary_search_agrees_with_a_linear_scan(seed):
    rng = random.Random(seed)
    model = AttentionCostModel(a=rng.uniform(1e-6, 1e-3), b=rng.uniform(0, 0.01),
                               c=rng.uniform(0, 1))
    cached, remaining = rng.randrange(0, 50_000), rng.randrange(1, 5000)
    budget = rng.uniform(0, 300)
    expected = max((b for b in range(remaining + 1) if model.request_ms(cached, b) <= budget),
                   default=0)
    assert largest_chunk(cached, remaining, budget, model) == expected


def test_bad_batching_input_is_rejected():
    with pytest.raises(ValueError):
        largest_chunk(0, 0, 10.0, M)
    with pytest.raises(ValueError):
        build_prefill_batch([("a", 0, 1)], -1.0, M)


def test_decode_engines_batch_everything():
    running = ["r1", "r2", "r3"]
    assert build_decode_batch(running) == running


def _samples(model: AttentionCostModel, rng: random.Random, noise: float):
    out = []
    for _ in range(40):
        pairs = [(rng.randrange(0, 60_000), rng.randrange(1, 4000))
                 for _ in range(rng.randrange(1, 6))]
        out.append((pairs, model.predict_ms(pairs) * (1 + rng.uniform(-noise, noise))))
    return out


def test_fit_recovers_known_coefficients():
    truth = AttentionCostModel(a=3e-6, b=2e-3, c=0.7)
    fitted = AttentionCostModel.fit(_samples(truth, random.Random(0), noise=0.0))
    assert fitted.a == pytest.approx(truth.a, rel=1e-6)
    assert fitted.b == pytest.approx(truth.b, rel=1e-6)
    assert fitted.c == pytest.approx(truth.c, rel=1e-6)


def test_fit_tolerates_measurement_noise():
    truth = AttentionCostModel(a=3e-6, b=2e-3, c=0.7)
    fitted = AttentionCostModel.fit(_samples(truth, random.Random(1), noise=0.02))
    assert fitted.a == pytest.approx(truth.a, rel=0.05)
    pairs = [(30_000, 2000)]
    assert fitted.predict_ms(pairs) == pytest.approx(truth.predict_ms(pairs), rel=0.05)


def test_fit_needs_informative_samples():
    with pytest.raises(ValueError):
        AttentionCostModel.fit([([(0, 10)], 1.0)] * 2)
    with pytest.raises(ValueError):
        AttentionCostModel.fit([([(0, 10)], 1.0)] * 5)  # identical samples


def test_cost_model_round_trips():
    model = AttentionCostModel(a=1e-6, b=2e-3, c=0.25)
    assert AttentionCostModel.from_dict(model.to_dict()) == model


def test_token_budget_batch_ignores_context_cost():
    from dualpath.scheduler import build_token_batch

    fifo = [("a", 30_000, 400), ("b", 0, 300), ("c", 10, 500)]
    assert build_token_batch(fifo, 1000) == [("a", 30_000, 400), ("b", 0, 300), ("c", 10, 300)]
    assert build_token_batch(fifo, 400) == [("a", 30_000, 400)]
    assert build_token_batch([], 10) == []
    with pytest.raises(ValueError):
        build_token_batch(fifo, 0)
