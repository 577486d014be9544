"""The one block plan by read path (``kv/block_plan.py``), and both engine kinds deriving their
loads, pulls and pushes from it: our prefill engine's ``LayerPlan`` and the vLLM connector's
``PrefillPlan``."""

from __future__ import annotations

import pytest

from dualpath.engine.layerwise import LayerPlan
from dualpath.integrations.vllm.plan import PrefillParams, PrefillPlan
from dualpath.kv.block_plan import BlockPlan, load_blocks
from dualpath.vocab import PrefillMode, ReadPath

BS = 16
CASES = [(path, hit, pe_read, n) for path in (ReadPath.PE, ReadPath.DE, ReadPath.SPLIT)
         for hit in (0, 1, 3, 5) for pe_read in (0, 2, 7) for n in (hit + 1, hit + 4)]


def test_each_read_path_loads_its_share_of_the_hit():
    assert load_blocks(ReadPath.PE, 5, 0) == 5
    assert load_blocks(ReadPath.DE, 5, 3) == 0
    assert load_blocks(ReadPath.SPLIT, 5, 3) == 3
    assert load_blocks(ReadPath.SPLIT, 5, 9) == 5  # never more than the hit
    assert load_blocks("pe", 4, 0) == 4 and load_blocks("split", 4, 1) == 1  # wire strings


@pytest.mark.parametrize("path,hit,pe_read,n", CASES)
def test_loads_pulls_and_pushes_cover_every_block_once(path, hit, pe_read, n):
    plan = BlockPlan(path, hit, n, pe_read)
    loads, pulls, pushes = list(plan.loads()), list(plan.pulls()), plan.pushes()
    assert sorted(loads + pulls) == list(range(hit))  # the hit: read on one side or the other
    assert sorted(pulls + pushes) == list(range(n))  # the buffer gets every block once
    assert set(loads) <= set(pushes)  # what the PE read, it forwards


@pytest.mark.parametrize("path,hit,pe_read,n", CASES)
def test_our_prefill_engine_and_the_vllm_connector_move_the_same_blocks(path, hit, pe_read, n):
    layer = LayerPlan(list(range(n)), hit, path, PrefillMode.LAYERWISE, "de:1", 1 << 20,
                      pe_slots=[], num_pe_read_blocks=pe_read)
    params = PrefillParams.parse(PrefillParams(
        1, path, hit, load_blocks(path, hit, pe_read), "10.0.0.2:16001", 1 << 20, n,
        PrefillMode.LAYERWISE).to_params())
    assert params is not None
    vllm = PrefillPlan(params, n * BS, pending_load=(0, hit))
    store, pulled = vllm.loads()
    assert list(range(*store)) == list(layer.host_loads())
    assert list(range(*pulled)) == list(layer.de_loads())
    assert vllm.pushes(n * BS, BS) == layer.forward_blocks()
