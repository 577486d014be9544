"""Write fences and the two liveness clocks in the router's state machine (no processes).

A DE buffer that a prefill engine the router gave up on may still write stays fenced until
that writer is known to have stopped — never on a timer; a busy engine (its inbox read late) is
never taken for one that lost a request; a long layer is judged against its expected time; a
role with no live engine fails its waiting requests after ``engine_timeout_s``.
"""

from __future__ import annotations

import pytest

from dualpath.protocol import (
    Abort,
    Aborted,
    AllocBuffer,
    BufferReady,
    Failed,
    Heartbeat,
    Hello,
    Prefill,
    Prefilled,
    Unfence,
)
from dualpath.server.router.membership import PROGRESS_MARGIN
from dualpath.server.router.state import RouterState
from dualpath.server.router.types import ClusterOutput, RequestFailed
from dualpath.vocab import Phase

from .test_router_state import ENGINES, EngineModel, apply, make_state, request, zero

TIMEOUT_S = 5.0  # make_state's engine_timeout_s


def hello(name: str, incarnation: str = "1") -> Hello:
    role, node = next((r, n) for e, r, n in ENGINES if e == name)
    return Hello(name, role, node, f"ep-{name}", incarnation=incarnation)


def started(state: RouterState, sends: list, done: dict) -> tuple[str, str, int]:
    """Every engine joins, request 1 is placed and its DE buffer is ready: (pe, de, wire)
    with the ``Prefill`` sent (the PE is computing)."""
    for name, _, _ in ENGINES:
        state.on_message(name, hello(name), 0.0)
    apply(state.submit(request(1), 0.0), done, sends, state)
    de, alloc = next((e, m) for e, m in sends if isinstance(m, AllocBuffer))
    sends.clear()
    apply(state.on_message(de, BufferReady(alloc.req_id, 4096, alloc.num_blocks, 0), 0.0),
          done, sends, state)
    pe, prefill = next((e, m) for e, m in sends if isinstance(m, Prefill))
    sends.clear()
    return pe, de, prefill.req_id


def unfenced(sends: list, de: str) -> set[int]:
    return {w for e, m in sends if e == de and isinstance(m, Unfence) for w in m.req_ids}


STOPS = {
    "it answers late": lambda pe, wire: ("msg", pe, Aborted(wire)),
    "it fails the request late": lambda pe, wire: ("msg", pe, Failed(wire, "dropped")),
    "it finishes the prefill late": lambda pe, wire: ("msg", pe, Prefilled(wire, 7, 0, 40)),
    "it rejoins as the same process": lambda pe, wire: ("msg", pe, hello(pe, "1")),
    "its process exited": lambda pe, wire: ("exit", pe, None),
}


@pytest.mark.parametrize("stop", list(STOPS))
def test_a_lost_prefill_engines_buffer_stays_fenced_until_it_is_known_to_have_stopped(stop):
    state, done, sends = make_state(), {}, []
    pe, de, wire = started(state, sends, done)
    blocks = state.counters()["buffer_blocks"]
    apply(state.lose(pe, "silent"), done, sends, state)
    assert (de, Abort(wire, fenced=True)) in sends and state.counters()["fences"] == 1
    # the request goes on elsewhere; time passing, beats and another process under the same
    # name prove nothing: the buffer stays out of the DE's pool, counted on the DE
    for now in range(1, 100):
        for name in [n for n in state.engines if n != de]:
            apply(state.on_message(name, Heartbeat(name, 1, 1, 0), now), done, sends, state)
        apply(state.on_message(de, Heartbeat(de, 1, 1, 0, fenced=(wire,)), now), done, sends,
              state)
        apply(state.tick(now), done, sends, state)
    apply(state.on_message(pe, hello(pe, "2"), 100.0), done, sends, state)
    assert wire not in unfenced(sends, de) and state.fences[wire].pe == pe
    assert state.engines[de].load.buffer_blocks >= blocks
    if stop != "its process exited":
        state.lose(pe, "the new one goes again")  # the old process is still the writer
    kind, engine, msg = STOPS[stop](pe, wire)
    before = state.engines[de].load.buffer_blocks
    sends.clear()
    effects = (state.lose(engine, "exited", exited=True) if kind == "exit"
               else state.on_message(engine, msg, 100.0))
    apply(effects, done, sends, state)
    assert unfenced(sends, de) == {wire} and wire not in state.fences
    assert state.engines[de].load.buffer_blocks == before - blocks


def test_a_decode_engine_is_unfenced_only_where_no_writer_may_reach_its_buffer():
    """A DE that was itself declared lost fences every buffer it announced; its beats then
    list them, and the router unfences those it holds no fence for — not the one a lost PE
    may still write."""
    state, done, sends = make_state(), {}, []
    pe, de, wire = started(state, sends, done)
    apply(state.lose(pe, "silent"), done, sends, state)
    sends.clear()
    beat = Heartbeat(de, 1, 1, 0, fenced=(wire, 9999))  # 9999: no writer the router knows
    apply(state.on_message(de, beat, 1.0), done, sends, state)
    assert unfenced(sends, de) == {9999}


def test_a_busy_engine_that_reads_its_inbox_late_is_never_corrected():
    """Requests sent while the PE runs a long forward are not in its beats (its inbox was
    read before they were sent): no correction, however many beats; once it reads its inbox
    and lists them, nothing happened."""
    state, done, sends = make_state(), {}, []
    pe, _, wire = started(state, sends, done)
    for beat in range(20):  # a 10 s forward; the inbox was read just before the Prefill
        now = 0.5 * (beat + 1)
        busy = Heartbeat(pe, 1, 1, 0, (), inbox_age_s=now + 0.01, progress_age_s=0.1,
                         step_budget_s=1.0)
        apply(state.on_message(pe, busy, now), done, sends, state)
    assert state.corrected == 0 and state.requests[1].phase == Phase.PREFILLING
    assert state.requests[1].wire_id == wire and not any(isinstance(m, Abort) for _, m in sends)
    apply(state.on_message(pe, Heartbeat(pe, 1, 1, 0, (wire,)), 10.5), done, sends, state)
    assert state.requests[1].unseen == {}


def test_a_correction_aborts_the_prefill_engine_and_fences_the_buffer_until_it_answers():
    """A PE that read its inbox after the Prefill was sent and does not hold it lost it: the
    request is placed again, the PE told to abort (it may hold it after all), the DE buffer
    fenced until the PE answers."""
    state, done, sends = make_state(), {}, []
    pe, de, wire = started(state, sends, done)
    for beat in range(3):
        now = 1.0 + beat
        apply(state.on_message(pe, Heartbeat(pe, 1, 1, 0, (), inbox_age_s=0.0), now), done,
              sends, state)
    assert state.corrected == 1 and state.requests[1].wire_id != wire
    assert (pe, Abort(wire)) in sends and (de, Abort(wire, fenced=True)) in sends
    sends.clear()
    apply(state.on_message(pe, Aborted(wire), 4.0), done, sends, state)
    assert unfenced(sends, de) == {wire}


def test_a_long_layer_is_judged_against_its_expected_time_not_the_timeout():
    state, done, sends = make_state(), {}, []
    pe, de, wire = started(state, sends, done)
    layer_s = 10.0  # each layer of this forward takes twice the engine timeout
    slow = Heartbeat(pe, 1, 1, 0, (wire,), progress_age_s=TIMEOUT_S + 2 * layer_s,
                     step_budget_s=layer_s)
    apply(state.on_message(pe, slow, 1.0), done, sends, state)
    assert pe in state.engines and state.stuck == {}
    hung = Heartbeat(pe, 1, 1, 0, (wire,), step_budget_s=layer_s,
                     progress_age_s=TIMEOUT_S + PROGRESS_MARGIN * layer_s + 0.1)
    apply(state.on_message(pe, hung, 2.0), done, sends, state)
    assert pe not in state.engines and state.stuck == {pe: 1}
    assert (de, Abort(wire, fenced=True)) in sends  # the stuck PE may yet write


def test_a_role_left_without_a_live_engine_fails_its_waiting_requests_after_the_timeout():
    state, done, sends = make_state(), {}, []
    for name, _, _ in ENGINES:
        state.on_message(name, hello(name), 0.0)
    for de in ("de2", "de3"):
        apply(state.lose(de, "killed", exited=True), done, sends, state)
    apply(state.submit(request(1), 1.0), done, sends, state)

    def tick(now: float) -> None:
        for pe in ("pe0", "pe1"):
            state.on_message(pe, Heartbeat(pe, 1, 1, 0), now)
        apply(state.tick(now), done, sends, state)

    tick(1.0)
    tick(1.0 + TIMEOUT_S - 0.5)
    assert 1 not in done  # a decode engine may still come back
    tick(1.0 + TIMEOUT_S + 0.5)
    assert isinstance(done[1], RequestFailed) and "no live decode engine" in str(done[1])
    state.on_message("de2", hello("de2", "2"), 7.0)  # back: new requests are served
    apply(state.submit(request(2), 7.0), done, sends, state)
    model = EngineModel()
    while sends:
        engine, msg = sends.pop(0)
        for reply in model.answer(engine, msg):
            apply(state.on_message(engine, reply, 7.0), done, sends, state)
    assert isinstance(done[2], ClusterOutput) and zero(state) == {}
