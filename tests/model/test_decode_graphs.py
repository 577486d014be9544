"""Decode graphs (``model/attention_graphs.py``) without a GPU: what the captured forward sees
in its static buffers (padded rows repeat row 0, new steps overwrite the buffers in place),
which steps fit a graph, and a capture that fails."""

from __future__ import annotations

import pytest
import torch

from dualpath.model import attention_flex, attention_graphs
from dualpath.model.attention import AttentionBatch, DecodeSlice, PrefillSlice
from dualpath.model.attention_graphs import DecodeGraphs, EagerCapture

BLOCK = 16


class Recorder:
    """A forward that records the buffers it is handed and returns ids + 1000 * positions."""

    def __init__(self) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor,
                 batch: AttentionBatch) -> torch.Tensor:
        d = batch.decode
        self.calls.append(dict(ids=ids.clone(), positions=positions.clone(),
                               slots=batch.slot_mapping.clone(), rows=d.token_idx.clone(),
                               tables=d.block_table.clone(), ctx=d.ctx_lens.clone()))
        return (ids + 1000 * positions).float()[:, None]


class FailingCapture:
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def _graphs(capture=None, width: int = 4) -> tuple[DecodeGraphs, Recorder]:
    forward = Recorder()
    layer = torch.zeros(12, BLOCK, 2, 1, 16)
    graphs = DecodeGraphs(forward, layer, None, width, torch.float32, capture or EagerCapture(),
                          max_batch=8)
    return graphs, forward


def _step(ctx: list[int], tables: list[list[int]]) -> tuple[torch.Tensor, ...]:
    rows = len(ctx)
    ids = torch.tensor([10 + i for i in range(rows)])
    positions = torch.tensor([n - 1 for n in ctx])
    slots = torch.tensor([t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
                          for t, n in zip(tables, ctx, strict=True)])
    decode = DecodeSlice.build(list(range(rows)), tables, ctx, BLOCK, None)
    return ids, positions, AttentionBatch(slots, [], decode)


@pytest.fixture(autouse=True)
def _flex(monkeypatch):
    monkeypatch.setenv(attention_flex.ENV_SWITCH, "flex")


def test_padded_rows_repeat_row_zero_and_outputs_keep_the_real_rows():
    graphs, forward = _graphs()
    ids, positions, batch = _step([20, 5, 33], [[3, 4], [7], [1, 2, 9]])
    out = graphs.run(ids, positions, batch)
    assert list(graphs.replays) == [4]  # 3 rows run as 4
    seen = forward.calls[-1]
    assert seen["ids"].tolist() == [10, 11, 12, 10]
    assert seen["positions"].tolist() == [19, 4, 32, 19]
    assert seen["slots"].tolist() == [*batch.slot_mapping.tolist(), batch.slot_mapping[0]]
    assert seen["ctx"].tolist() == [20, 5, 33, 20]
    assert seen["rows"].tolist() == [0, 1, 2, 3]
    assert seen["tables"][:, :3].tolist() == [[3, 4, 0], [7, 0, 0], [1, 2, 9], [3, 4, 0]]
    assert out.shape == (3, 1) and out[:, 0].tolist() == [19010, 4011, 32012]


def test_a_replay_sees_the_new_step_in_the_same_buffers():
    graphs, forward = _graphs()
    graphs.run(*_step([20, 5, 33], [[3, 4], [7], [1, 2, 9]]))
    replay = graphs.replays[4]
    ids, positions, batch = _step([6, 40], [[5], [8, 10, 11]])
    graphs.run(ids, positions, batch)  # 2 rows: a new size
    ids, positions, batch = _step([21, 6, 34, 2], [[3, 4], [7], [1, 2, 9], [11]])
    out = graphs.run(ids, positions, batch)
    assert graphs.replays[4] is replay and set(graphs.replays) == {2, 4}
    seen = forward.calls[-1]
    assert seen["ctx"].tolist() == [21, 6, 34, 2]
    assert seen["tables"][3, 0] == 11
    assert out[:, 0].tolist() == [20010, 5011, 33012, 1013]


def test_steps_that_do_not_fit_run_eagerly(monkeypatch):
    graphs, _ = _graphs(width=2)
    batch = _step([20, 5], [[3, 4], [7]])[2]
    assert graphs.fits(batch)
    assert not graphs.fits(_step([40], [[1, 2, 3]])[2])  # a table wider than the graphs'
    assert not graphs.fits(_step([2] * 9, [[i] for i in range(9)])[2])  # more rows than 8
    mixed = AttentionBatch(batch.slot_mapping, [PrefillSlice(2, 3, torch.arange(3))],
                           batch.decode)
    assert not graphs.fits(mixed)
    monkeypatch.setenv(attention_graphs.ENV_SWITCH, "0")
    assert not graphs.fits(batch)
    monkeypatch.setenv(attention_graphs.ENV_SWITCH, "1")
    monkeypatch.setenv(attention_flex.ENV_SWITCH, "auto")  # a CPU cache: the reference path
    assert not graphs.fits(batch)


def test_a_failed_capture_keeps_the_eager_result_and_turns_graphs_off():
    graphs, _ = _graphs(FailingCapture())
    ids, positions, batch = _step([20, 5], [[3, 4], [7]])
    out = graphs.run(ids, positions, batch)
    assert out[:, 0].tolist() == [19010, 4011]
    assert "stream is capturing" in graphs.failed
    assert not graphs.fits(batch)


def test_a_warm_up_that_leaves_the_flex_path_captures_nothing(monkeypatch):
    # a compile that fails in the warm-up turns flex off; the reference path it falls back to
    # reads lengths back from the device, which a capture cannot hold
    class Fails(Recorder):
        def __call__(self, ids, positions, batch):
            monkeypatch.setenv(attention_flex.ENV_SWITCH, "reference")
            return super().__call__(ids, positions, batch)

    forward = Fails()
    graphs = DecodeGraphs(forward, torch.zeros(12, BLOCK, 2, 1, 16), None, 4, torch.float32,
                          FailingCapture(), max_batch=8)
    out = graphs.run(*_step([20, 5], [[3, 4], [7]]))
    assert out[:, 0].tolist() == [19010, 4011]
    assert not graphs.replays and not graphs.failed
