"""Sampler (greedy, temperature, top-p, seeds) and request/sequence validation."""

import pytest
import torch

from dualpath.engine.sampler import Sampler, draw_seed, top_p_filter
from dualpath.errors import RequestError
from dualpath.request import SamplingParams, SeqStatus, Sequence

# --- top_p_filter ----------------------------------------------------------------------------

# powers of two: cumulative sums are exact in float32, so boundaries are unambiguous
PROBS = torch.tensor([0.125, 0.5, 0.125, 0.25])


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.1, {1}),
        (0.5, {1}),  # the top token alone reaches 0.5
        (0.6, {1, 3}),
        (0.75, {1, 3}),  # exactly reached by two tokens
    ],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p, kept):
    out = top_p_filter(PROBS.clone(), top_p)
    assert set(out.nonzero().flatten().tolist()) == kept
    for i in kept:
        assert out[i] == PROBS[i]


def test_top_p_just_above_two_token_mass_keeps_a_third_token():
    out = top_p_filter(PROBS.clone(), 0.8)
    nonzero = out.nonzero().flatten().tolist()
    assert len(nonzero) == 3
    assert {1, 3} <= set(nonzero)
    assert out.sum().item() == pytest.approx(0.875)


def test_top_p_with_ties_keeps_exactly_enough_tokens():
    probs = torch.full((4,), 0.25)
    out = top_p_filter(probs, 0.5)
    assert int((out > 0).sum()) == 2
    assert out.sum().item() == pytest.approx(0.5)
    assert set(out[out > 0].tolist()) == {0.25}


def test_top_p_tie_at_the_boundary_keeps_one_of_the_tied_tokens():
    probs = torch.tensor([0.0625, 0.5, 0.0625, 0.125, 0.125, 0.125])
    out = top_p_filter(probs, 0.6)
    kept = set(out.nonzero().flatten().tolist())
    assert len(kept) == 2
    assert 1 in kept
    assert len(kept & {3, 4, 5}) == 1


def test_top_p_one_is_a_no_op():
    probs = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), -1)
    out = top_p_filter(probs, 1.0)
    assert torch.equal(out, probs)


@pytest.mark.parametrize("top_p", [1e-9, 0.01, 0.3])
def test_top_p_always_keeps_at_least_the_top_token(top_p):
    probs = torch.tensor([0.2, 0.3, 0.5])
    out = top_p_filter(probs, top_p)
    assert out[2] == pytest.approx(0.5)
    assert int((out > 0).sum()) >= 1


def test_top_p_on_one_hot_keeps_the_hot_token():
    probs = torch.zeros(10)
    probs[7] = 1.0
    out = top_p_filter(probs, 0.5)
    assert out.nonzero().flatten().tolist() == [7]


def test_top_p_does_not_modify_its_input():
    probs = PROBS.clone()
    top_p_filter(probs, 0.5)
    assert torch.equal(probs, PROBS)


def test_top_p_filters_each_row_of_a_batch():
    probs = torch.stack([PROBS, PROBS.flip(0)])
    out = top_p_filter(probs, 0.6)
    assert set(out[0].nonzero().flatten().tolist()) == {1, 3}
    assert set(out[1].nonzero().flatten().tolist()) == {2, 0}


# --- Sampler ---------------------------------------------------------------------------------


def _draws(sampler, logits, params, seq_id, n):
    return [sampler.sample(logits, [params], [seq_id])[0] for _ in range(n)]


def test_greedy_rows_take_argmax():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0)] * 5
    tokens = Sampler().sample(logits, params, list(range(5)))
    assert tokens == logits.argmax(-1).tolist()
    assert all(isinstance(t, int) for t in tokens)


def test_greedy_row_in_a_mixed_batch_still_takes_argmax():
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.0)]
    for _ in range(20):
        tokens = Sampler().sample(logits, params, [0, 1])
        assert tokens[1] == int(logits[1].argmax())


def test_greedy_ignores_top_p():
    logits = torch.tensor([[0.0, 5.0, 4.9, 0.0]])
    assert Sampler().sample(logits, [SamplingParams(top_p=0.01)], [0]) == [1]


def test_seeded_sampling_is_reproducible():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=1234)
    first = _draws(Sampler(), logits, params, seq_id=7, n=16)
    second = _draws(Sampler(), logits, params, seq_id=7, n=16)
    assert first == second
    assert len(set(first)) > 1  # a flat distribution really was sampled


def test_seeded_sampling_ignores_the_sampler_default_seed():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=99)
    assert (_draws(Sampler(seed=0), logits, params, 3, 8)
            == _draws(Sampler(seed=1), logits, params, 3, 8))


def test_different_seed_gives_different_draws():
    logits = torch.zeros(1, 1000)
    a = _draws(Sampler(), logits, SamplingParams(temperature=1.0, seed=1), seq_id=7, n=16)
    b = _draws(Sampler(), logits, SamplingParams(temperature=1.0, seed=2), seq_id=7, n=16)
    assert a != b


def test_seeded_draws_do_not_depend_on_other_sequences_in_the_batch():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=5)
    alone = _draws(Sampler(), logits, params, seq_id=1, n=8)
    sampler = Sampler()
    other = SamplingParams(temperature=1.0)
    mixed = []
    for _ in range(8):
        mixed.append(sampler.sample(torch.zeros(2, 1000), [other, params], [2, 1])[1])
    assert mixed == alone


def test_release_forgets_the_sequence_generator():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=42)
    sampler = Sampler()
    first = _draws(sampler, logits, params, seq_id=9, n=4)
    sampler.release(9)
    assert _draws(sampler, logits, params, seq_id=9, n=4) == first
    sampler.release(12345)  # unknown ids are ignored


def test_unseeded_sampling_follows_the_sampler_seed():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0)
    a = _draws(Sampler(seed=11), logits, params, 0, 16)
    b = _draws(Sampler(seed=11), logits, params, 0, 16)
    c = _draws(Sampler(seed=12), logits, params, 0, 16)
    assert a == b
    assert a != c


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_peaked_distribution_always_picks_the_peak(temperature):
    logits = torch.zeros(1, 50)
    logits[0, 17] = 40.0
    params = SamplingParams(temperature=temperature, seed=0)
    assert set(_draws(Sampler(), logits, params, 0, 100)) == {17}


def test_sampling_never_picks_a_token_removed_by_top_p():
    # probabilities 0.4, 0.3, 0.2, 0.1: top_p 0.6 keeps tokens 0 and 1 only
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    params = SamplingParams(temperature=1.0, top_p=0.6, seed=0)
    draws = _draws(Sampler(), logits, params, 0, 500)
    assert set(draws) == {0, 1}


def test_low_temperature_sharpens_toward_the_argmax():
    logits = torch.tensor([[1.0, 2.0, 1.5]])
    hot = _draws(Sampler(), logits, SamplingParams(temperature=5.0, seed=0), 0, 400)
    cold = _draws(Sampler(), logits, SamplingParams(temperature=0.05, seed=0), 0, 400)
    assert cold.count(1) > hot.count(1)
    assert cold.count(1) >= 399


# --- seeded draws across engines: prefill samples token 0, decode the rest ------------------


def _step_logits(n, vocab=1000):
    """Different logits per step, as a real model gives."""
    return [torch.randn(1, vocab, generator=torch.Generator().manual_seed(100 + k))
            for k in range(n)]


def _one_engine(params, steps, seq_id=3):
    """Every token on one sampler, called the way LLMEngine.step calls it today."""
    sampler = Sampler(seed=0)
    return [sampler.sample(logits, [params], [seq_id])[0] for logits in steps]


def _prefill_then_decode(params, steps):
    """Token 0 on the prefill engine's sampler, the rest on a fresh decode-engine sampler."""
    prefill = Sampler(seed=1)
    first = prefill.sample(steps[0], [params], [40])[0]
    prefill.release(40)
    decode = Sampler(seed=2)
    rest = [decode.sample(logits, [params], [77], num_outputs=[k])[0]
            for k, logits in enumerate(steps[1:], start=1)]
    return [first, *rest]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_seeded_request_split_across_engines_matches_one_engine(top_p):
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=1234)
    steps = _step_logits(16)
    together = _one_engine(params, steps)
    assert _prefill_then_decode(params, steps) == together
    assert len(set(together)) > 1  # a spread distribution really was sampled


def test_split_across_engines_still_depends_on_the_seed():
    steps = _step_logits(16)
    a = _prefill_then_decode(SamplingParams(temperature=1.0, seed=1), steps)
    b = _prefill_then_decode(SamplingParams(temperature=1.0, seed=2), steps)
    assert a != b


def test_draw_of_token_k_depends_only_on_seed_and_k():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=9)
    running = Sampler()
    in_order = [running.sample(logits, [params], [5], num_outputs=[k])[0] for k in range(8)]
    for k in reversed(range(8)):  # out of order, each on a fresh sampler with another seq id
        assert Sampler(seed=k).sample(logits, [params], [100 + k], num_outputs=[k]) == [
            in_order[k]]
    assert _draws(Sampler(), logits, params, seq_id=5, n=8) == in_order  # no index: counted


def test_seeded_rows_of_a_batch_each_use_their_own_index():
    logits = torch.zeros(3, 1000)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (4, 4, 6)]
    batch = Sampler().sample(logits, params, [0, 1, 2], num_outputs=[0, 5, 2])
    alone = [Sampler().sample(logits[:1], [p], [9], num_outputs=[k])[0]
             for p, k in zip(params, [0, 5, 2], strict=True)]
    assert batch == alone


def test_unseeded_rows_ignore_the_index():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0)
    sampler = Sampler(seed=11)
    with_index = [sampler.sample(logits, [params], [0], num_outputs=[0])[0] for _ in range(16)]
    assert with_index == _draws(Sampler(seed=11), logits, params, 0, 16)
    assert len(set(with_index)) > 1  # the shared generator moves on


def test_greedy_rows_ignore_the_index():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.0, seed=1)] * 3
    assert Sampler().sample(logits, params, [0, 1, 2], num_outputs=[0, 7, 3]) == (
        logits.argmax(-1).tolist())


def test_draw_seed_is_a_fixed_function_of_seed_and_index():
    """Engines in other processes (or other builds) must derive the same generator seed."""
    assert draw_seed(1234, 0) == draw_seed(1234, 0) != draw_seed(1234, 1)
    assert draw_seed(1, 10) != draw_seed(11, 0)
    assert draw_seed(1234, 0) == 0xbb8a50c5c5a8be1a


def test_num_outputs_needs_one_index_per_row():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams(temperature=1.0)] * 2, [0, 1],
                         num_outputs=[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_cuda_logits():
    logits = torch.zeros(2, 100, device="cuda")
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0)]
    tokens = Sampler().sample(logits, params, [0, 1])
    assert all(0 <= t < 100 for t in tokens)


def test_sample_requires_one_param_and_id_per_row():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()] * 2, [0])


# --- SamplingParams --------------------------------------------------------------------------


def test_default_params_are_greedy():
    p = SamplingParams()
    assert p.greedy is True
    assert SamplingParams(temperature=0.7).greedy is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ("ok", "")}, "stop"),
    ],
)
def test_invalid_sampling_params_raise_request_error(kwargs, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 1}, {"top_p": 1.0}, {"top_p": 1e-6}, {"temperature": 0.0},
     {"stop": ("\n", "END")}],
)
def test_valid_sampling_params_edges(kwargs):
    p = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(p, key) == value


# --- Sequence --------------------------------------------------------------------------------


def test_empty_prompt_raises_request_error():
    with pytest.raises(RequestError, match="empty"):
        Sequence([], SamplingParams())


def test_new_sequence_state():
    seq = Sequence([1, 2, 3], SamplingParams())
    assert seq.token_ids == [1, 2, 3]
    assert seq.num_tokens == 3
    assert seq.num_pending_tokens == 3
    assert seq.output_ids == []
    assert seq.status is SeqStatus.WAITING
    assert not seq.is_finished


def test_token_ids_is_a_copy_of_the_prompt():
    prompt = [1, 2, 3]
    seq = Sequence(prompt, SamplingParams())
    seq.append_token(4)
    assert prompt == [1, 2, 3]
    assert seq.prompt_ids == [1, 2, 3]


def test_append_token_updates_counts():
    seq = Sequence([5, 6, 7], SamplingParams())
    seq.num_computed_tokens = 3
    seq.append_token(42)
    assert seq.output_ids == [42]
    assert seq.token_ids == [5, 6, 7, 42]
    assert seq.num_tokens == 4
    assert seq.num_pending_tokens == 1
    seq.append_token(43)
    assert seq.token_ids == [5, 6, 7, 42, 43]
    assert seq.num_tokens == 5
    assert seq.num_pending_tokens == 2


def test_sequence_ids_are_unique():
    ids = {Sequence([1], SamplingParams()).seq_id for _ in range(10)}
    assert len(ids) == 10


def test_finished_status():
    seq = Sequence([1], SamplingParams())
    seq.status = SeqStatus.FINISHED
    assert seq.is_finished
