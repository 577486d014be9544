"""How many layers a layerwise move carries (``kv/layer_groups.py``)."""

from __future__ import annotations

import pytest

from dualpath.kv.layer_groups import group_of, layers_per_move

LAYERS = 30
KB = 1 << 10


def test_a_layer_that_reaches_the_size_moves_alone():
    assert layers_per_move(8 << 20, 4 << 20, LAYERS, LAYERS) == 1
    assert layers_per_move(4 << 20, 4 << 20, LAYERS, LAYERS) == 1


def test_no_group_size_or_nothing_to_move_is_one_layer_per_move():
    assert layers_per_move(430 * KB, 0, LAYERS, LAYERS) == 1
    assert layers_per_move(0, 4 << 20, LAYERS, LAYERS) == 1


def test_a_full_cache_takes_the_fewest_layers_that_reach_the_size():
    # the demo's SmolLM2 turn: 35 blocks x 16 tokens x 768 B per layer = 430 KB
    assert layers_per_move(430 * KB, 4 << 20, LAYERS, LAYERS) == 10
    assert layers_per_move(430 * KB, 1 << 30, LAYERS, LAYERS) == LAYERS  # at most every layer
    assert layers_per_move(430 * KB, 1 << 30, LAYERS + 5, LAYERS) == LAYERS


@pytest.mark.parametrize(("window", "group"), [(2, 1), (3, 1), (4, 2), (6, 3), (8, 4), (10, 5),
                                               (12, 6), (9, 3), (7, 1)])
def test_a_window_holds_two_groups_and_a_group_divides_it(window, group):
    got = layers_per_move(1 * KB, 1 << 30, window, LAYERS)
    assert got == group
    assert window % got == 0 and 2 * got <= window


def test_a_window_never_grows_a_group_past_the_size():
    assert layers_per_move(1 << 20, 2 << 20, 8, LAYERS) == 2
    assert layers_per_move(1 << 20, 3 << 20, 8, LAYERS) == 2  # 3 does not divide 8


@pytest.mark.parametrize("args", [(-1, 1, 2, 2), (1, -1, 2, 2), (1, 1, 0, 2), (1, 1, 2, 0)])
def test_bad_sizes_are_refused(args):
    with pytest.raises(ValueError, match="bad sizes"):
        layers_per_move(*args)


def test_groups_cover_every_layer_once_in_order():
    for group in (1, 3, 7, LAYERS):
        starts = range(0, LAYERS, group)
        covered = [i for s in starts for i in group_of(s, group, LAYERS)]
        assert covered == list(range(LAYERS))
        assert all(i in group_of(i, group, LAYERS) for i in range(LAYERS))
    assert group_of(29, 7, LAYERS) == range(28, 30)  # the last group is short
