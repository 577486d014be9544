"""Snapshots: validation, indexes, and JSON round trips."""

from __future__ import annotations

import json

import pytest

from dualpath.scheduler import (
    Assignment,
    ClusterView,
    EngineLoad,
    EngineView,
    NodeView,
    PendingRequest,
)


def _view() -> ClusterView:
    return ClusterView(
        (EngineView("p1", "prefill", 0, "P", seq=1, tok=10),
         EngineView("p0", "prefill", 0, "P"),
         EngineView("d0", "decode", 1, "D", free_kv_tokens=99)),
        (NodeView(0, 5), NodeView(1, 7)))


def test_indexes_by_name_group_role_and_node():
    view = _view()
    assert view.engine("p1").tok == 10
    assert view.has_engine("d0") and not view.has_engine("x")
    assert [e.name for e in view.group("P")] == ["p0", "p1"]  # name order
    assert list(view.groups("prefill")) == ["P"] and list(view.groups("decode")) == ["D"]
    assert view.group_tokens("P") == 10 and view.group_tokens("D") == 0
    assert view.read_queue(1) == 7 and view.read_queue(42) == 0
    queues = view.read_queues()
    queues[0] = 1000
    assert view.read_queue(0) == 5  # a copy
    with pytest.raises(KeyError):
        view.group("nope")


def test_round_trip_through_json():
    view = _view()
    again = ClusterView.from_dict(json.loads(json.dumps(view.to_dict())))
    assert again == view and again.group("P") == view.group("P")
    req = PendingRequest(3, 100, 64)
    assert PendingRequest.from_dict(json.loads(json.dumps(req.to_dict()))) == req
    a = Assignment(3, "p0", "d0", "split", 64, 32, 32)
    assert Assignment.from_dict(json.loads(json.dumps(a.to_dict()))) == a


@pytest.mark.parametrize("engines", [
    (EngineView("a", "prefill", 0, "G"), EngineView("a", "prefill", 1, "H")),  # same name
    (EngineView("a", "prefill", 0, "G"), EngineView("b", "decode", 1, "G")),  # mixed group
    (EngineView("a", "prefill", 0, "G"), EngineView("b", "prefill", 0, "H")),  # split node
])
def test_inconsistent_views_are_rejected(engines):
    with pytest.raises(ValueError):
        ClusterView(engines)


def test_a_group_may_span_nodes():
    view = ClusterView((EngineView("a", "prefill", 0, "G"), EngineView("b", "prefill", 1, "G")))
    assert len(view.group("G")) == 2


def test_bad_values_are_rejected():
    with pytest.raises(ValueError):
        EngineView("a", "mixed", 0, "G")
    with pytest.raises(ValueError):
        EngineView("a", "prefill", 0, "G", tok=-1)
    with pytest.raises(ValueError):
        NodeView(0, -5)
    with pytest.raises(ValueError):
        PendingRequest(0, 0)
    with pytest.raises(ValueError):
        PendingRequest(0, 10, 11)
    with pytest.raises(ValueError):
        Assignment(0, "p", "d", "both", 10, 10, 0)
    with pytest.raises(ValueError):
        Assignment(0, "p", "d", "pe", 10, 5, 0)
    with pytest.raises(ValueError):
        EngineView.from_dict({"name": "a", "role": "prefill", "node_id": 0, "group": "G",
                              "colour": "red"})
    with pytest.raises(ValueError):
        ClusterView((), (NodeView(0), NodeView(0)))


def test_engine_load_is_a_working_copy():
    view = EngineView("a", "decode", 2, "G", seq=1, tok=10, free_kv_tokens=50)
    load = EngineLoad.of(view, extra_tok=5)
    load.tok += 1
    assert (load.name, load.node_id, load.seq, load.tok, load.free_kv_tokens) == (
        "a", 2, 1, 16, 50)
    assert view.tok == 10


def test_from_groups_equals_the_checked_constructor():
    view = _view()
    fast = ClusterView.from_groups({r: view.groups(r) for r in ("prefill", "decode")},
                                   view.nodes)
    assert fast.to_dict()["nodes"] == view.to_dict()["nodes"]
    assert sorted(e.name for e in fast.engines) == sorted(e.name for e in view.engines)
    assert fast.group("P") == view.group("P") and fast.group_tokens("P") == 10
    assert fast.read_queue(1) == 7 and fast.engine("d0").free_kv_tokens == 99
