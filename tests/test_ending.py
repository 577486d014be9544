"""The stop rule and the end-of-sequence ids both engine kinds apply (``dualpath/ending.py``)."""

from __future__ import annotations

from dualpath.ending import eos_ids, finish_reason
from dualpath.request import SamplingParams

EOS = frozenset({2, 7})


def test_eos_ids_are_the_checkpoints_and_the_tokenizers():
    assert eos_ids((2,), 7) == EOS
    assert eos_ids([2, 7], None) == EOS
    assert eos_ids((), None) == frozenset()


def test_an_eos_stops_once_min_tokens_are_out_unless_ignored():
    params = SamplingParams(max_tokens=10, min_tokens=2)
    assert finish_reason(params, 1, 2, 50, EOS, 100) is None  # before min_tokens
    assert finish_reason(params, 2, 7, 50, EOS, 100) == "stop"
    assert finish_reason(SamplingParams(max_tokens=10, ignore_eos=True), 3, 2, 50, EOS,
                         100) is None
    assert finish_reason(params, 3, 5, 50, EOS, 100) is None  # not an EOS


def test_length_at_max_tokens_or_the_models_context():
    params = SamplingParams(max_tokens=3)
    assert finish_reason(params, 3, 5, 50, EOS, 100) == "length"
    assert finish_reason(params, 3, 2, 50, EOS, 100) == "stop"  # an EOS on the last token
    assert finish_reason(SamplingParams(max_tokens=10), 2, 5, 100, EOS, 100) == "length"
    assert finish_reason(SamplingParams(max_tokens=10), 2, 5, 10_000, EOS, None) is None
