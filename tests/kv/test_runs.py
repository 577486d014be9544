"""Paired runs: stretches where both block lists advance by one."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualpath.kv.runs import paired_runs


def test_runs_break_where_either_side_jumps():
    assert paired_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert paired_runs([1, 2, 3], [7, 6, 5]) == [(1, 7, 1), (2, 6, 1), (3, 5, 1)]
    assert paired_runs([], []) == []
    with pytest.raises(ValueError, match="2 destination blocks for 1"):
        paired_runs([1, 2], [3])


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40))
def test_runs_cover_every_pair_once_in_order(pairs):
    dst, src = [d for d, _ in pairs], [s for _, s in pairs]
    expanded = [(d + i, s + i) for d, s, n in paired_runs(dst, src) for i in range(n)]
    assert expanded == pairs
