"""The router's state machine without processes: transitions, faults, and a property test.

Engines are played by a small model that answers each message as a real engine would, and
the property test interleaves those answers with duplicated, late and unknown messages,
engine losses, rejoins, silences and aborts. Whatever the order, nothing raises, every request
completes exactly once, and once idle every counter is back to zero.
"""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dualpath.errors import RequestError
from dualpath.protocol import (
    Abort,
    Aborted,
    AllocBuffer,
    BufferReady,
    Decode,
    Failed,
    Finished,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Message,
    PeerInfo,
    Peers,
    Prefill,
    Prefilled,
    ProtocolError,
    ReadDone,
    Tokens,
    Unfence,
    decode,
    encode,
)
from dualpath.request import SamplingParams
from dualpath.scheduler.global_scheduler import GlobalScheduler, SchedulerParams
from dualpath.server.router.endings import MAX_ATTEMPTS
from dualpath.server.router.state import RouterState
from dualpath.server.router.types import (
    Capacity,
    ClusterOutput,
    RequestAborted,
    RequestFailed,
    RequestState,
)
from dualpath.vocab import Mode, Phase, ReadPath

BLOCK = 16
STREAMED: dict[int, list[int]] = {}  # req_id -> tokens handed on in the current test
ENGINES = [("pe0", "prefill", 0), ("pe1", "prefill", 1), ("de2", "decode", 2),
           ("de3", "decode", 3)]


def make_state(kv_tokens: int = 4096, pool: int = 64, staging: int = 8,
               local_prefill_tokens: int = 0) -> RouterState:
    STREAMED.clear()
    params = SchedulerParams(alpha_tokens=1 << 40, beta_tokens=1 << 40, block_size=BLOCK)
    return RouterState(GlobalScheduler(params), Capacity(BLOCK, kv_tokens, pool, staging),
                       engine_timeout_s=5.0, local_prefill_tokens=local_prefill_tokens)


def hello_all(state: RouterState, now: float = 0.0) -> None:
    for name, role, node in ENGINES:
        state.on_message(name, Hello(name, role, node, f"ep-{name}"), now)


def request(req_id: int, n: int = 40, hit_blocks: int = 1, mode: Mode = Mode.DUALPATH,
            max_tokens: int = 4, path: ReadPath = ReadPath.AUTO) -> RequestState:
    return RequestState(req_id, tuple(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens),
                        mode, path, num_hit_blocks=hit_blocks)


def zero(state: RouterState) -> dict[str, int]:
    return {k: v for k, v in state.counters().items() if v}


class EngineModel:
    """Answers the router's messages the way an engine does (no compute), and checks the write
    fence: a PE takes up a ``Prefill`` (and writes the DE buffer) only while the DE process
    that allocated the buffer still holds it — allocated or fenced, never back in its pool."""

    def __init__(self) -> None:
        self.alive = {name for name, _, _ in ENGINES}
        self.tokens: dict[int, tuple[int, ...]] = {}  # wire id -> an AllocBuffer's tokens
        self.incarnation = {name: 0 for name, _, _ in ENGINES}  # a restart makes a new one
        self.held: dict[str, set[int]] = {name: set() for name, _, _ in ENGINES}  # DE buffers
        self.fenced: dict[str, set[int]] = {name: set() for name, _, _ in ENGINES}
        self.holder: dict[int, tuple[str, int]] = {}  # wire id -> (DE, its incarnation)
        # wire ids a made-up answer spoke for: a PE that lies about having stopped writing (or
        # a DE about a buffer) cannot be fenced, so the check skips them
        self.lies: set[int] = set()

    def kill(self, name: str) -> None:
        """The process ends (its memory with it); the next one is a new incarnation."""
        self.alive.discard(name)
        self.incarnation[name] += 1
        self.held[name].clear()
        self.fenced[name].clear()

    def drop_everything(self, name: str) -> None:
        """A lost engine rejoining: a DE fences every buffer it announced."""
        self.fenced[name] |= self.held[name]
        self.held[name].clear()

    def check_writable(self, wire_id: int) -> None:
        """A PE is about to write wire ``wire_id``'s DE buffer."""
        if wire_id in self.lies:
            return
        de, incarnation = self.holder[wire_id]
        if de in self.alive and self.incarnation[de] == incarnation:
            assert wire_id in self.held[de] | self.fenced[de], \
                f"a PE writes request {wire_id}'s buffer after {de} reused it"

    def hello(self, name: str) -> Hello:
        """``name``'s hello as its current process."""
        role, node = next((r, n) for e, r, n in ENGINES if e == name)
        return Hello(name, role, node, "ep", incarnation=str(self.incarnation[name]))

    def answer(self, engine: str, msg: Message) -> list[Message]:
        if engine not in self.alive:
            return []
        if isinstance(msg, AllocBuffer):  # a DE keeps the tokens for the Decode
            self.tokens[msg.req_id] = msg.prompt_ids
            self.held[engine].add(msg.req_id)
            self.holder[msg.req_id] = (engine, self.incarnation[engine])
            return [BufferReady(msg.req_id, 4096, msg.num_blocks, msg.num_read_blocks)]
        if isinstance(msg, Unfence):
            self.fenced[engine].difference_update(msg.req_ids)
            return []
        if isinstance(msg, Prefill):
            self.check_writable(msg.req_id)
            reads = msg.read_path in ("pe", "split")
            read = [ReadDone(msg.req_id, msg.num_hit_blocks)] if reads else []
            computed = len(msg.prompt_ids) - msg.num_hit_blocks * BLOCK
            return [*read, Prefilled(msg.req_id, 7, msg.num_hit_blocks, computed)]
        if isinstance(msg, Decode):  # a moved stream's outputs start with the prior ones
            self.held[engine].discard(msg.req_id)
            tokens = self.tokens.pop(msg.req_id)
            prior = tokens[len(tokens) - msg.num_prior_outputs:]
            outputs = (*prior, 7 if msg.local else msg.first_token, 8, 9)
            # the router streamed the first one itself, unless this engine prefilled (local)
            first = 0 if msg.local else msg.num_prior_outputs or 1
            return [Tokens(((msg.req_id, first, outputs[first:-1]),)),
                    Finished(msg.req_id, outputs, "length")]
        if isinstance(msg, Abort):
            if msg.req_id in self.held[engine]:
                self.held[engine].discard(msg.req_id)
                if msg.fenced:
                    self.fenced[engine].add(msg.req_id)
            return [Aborted(msg.req_id)]
        return []

    def beat(self, name: str) -> Heartbeat:
        """``name``'s heartbeat (a DE lists its fenced buffers)."""
        return Heartbeat(name, 1, 1, 0, fenced=tuple(sorted(self.fenced[name])))


def run_to_quiet(state: RouterState, model: EngineModel, done: dict, sends: list,
                 now: float) -> None:
    """Deliver every message, in order, until nothing moves."""
    while sends:
        engine, msg = sends.pop(0)
        for reply in model.answer(engine, msg):
            apply(state.on_message(engine, reply, now), done, sends, state)


def apply(effects, done: dict, sends: list, state: RouterState | None = None) -> None:
    assert all(engine for engine, _ in effects.sends), "a message to no engine"
    sends.extend(effects.sends)
    for req_id in effects.lookups:  # a moved request: every block its DE stored is a hit
        assert state is not None, "a request moved where the test did not expect it"
        kv_ids = state.requests[req_id].kv_ids
        apply(state.resume(req_id, (len(kv_ids) - 1) // BLOCK, 0.0), done, sends, state)
    for req_id, tokens in effects.streamed:
        assert req_id not in done, f"request {req_id} streamed after it completed"
        STREAMED.setdefault(req_id, []).extend(tokens)
    for req_id, result in effects.done:
        assert req_id not in done, f"request {req_id} completed twice"
        done[req_id] = result
        if isinstance(result, ClusterOutput):  # every token streamed once, in order
            assert STREAMED.pop(req_id, []) == result.output_ids
        else:
            STREAMED.pop(req_id, None)


# -- transitions ----------------------------------------------------------------------------------


def test_a_request_flows_through_both_engines_and_releases_everything():
    state, model, done, sends = make_state(), EngineModel(), {}, []
    hello_all(state)
    apply(state.submit(request(1, hit_blocks=2), 0.0), done, sends, state)
    assert state.counters()["read_queue_tokens"] == 2 * BLOCK
    run_to_quiet(state, model, done, sends, 0.0)
    out = done[1]
    assert isinstance(out, ClusterOutput) and out.output_ids == [7, 8, 9]
    assert out.num_computed_tokens == 40 - 2 * BLOCK and out.num_hit_tokens == 2 * BLOCK
    assert zero(state) == {}


def test_a_request_that_can_never_fit_is_refused_at_once():
    state, done, sends = make_state(kv_tokens=256), {}, []
    hello_all(state)
    apply(state.submit(request(1, n=300, hit_blocks=0), 0.0), done, sends, state)
    assert isinstance(done[1], RequestError) and "KV cache" in str(done[1])
    state2, done2 = make_state(pool=8, staging=4), {}
    apply(state2.submit(request(2, n=5 * BLOCK, hit_blocks=0, max_tokens=1), 0.0), done2, [])
    assert isinstance(done2[2], RequestError) and "host-buffer" in str(done2[2])
    assert zero(state) == {} and zero(state2) == {}


def test_a_request_decoding_survives_its_prefill_engines_loss():
    state, model, done, sends = make_state(), EngineModel(), {}, []
    hello_all(state)
    apply(state.submit(request(1), 0.0), done, sends, state)
    while sends and not isinstance(sends[0][1], Decode):
        engine, msg = sends.pop(0)
        for reply in model.answer(engine, msg):
            apply(state.on_message(engine, reply, 0.0), done, sends, state)
    req = state.requests[1]
    assert req.phase == Phase.DECODING
    apply(state.lose(req.pe, "killed"), done, sends, state)
    assert 1 not in done
    run_to_quiet(state, model, done, sends, 0.0)
    assert isinstance(done[1], ClusterOutput)
    assert zero(state) == {}


def test_a_request_whose_decode_engine_is_lost_before_decoding_is_placed_again():
    state, model, done, sends = make_state(), EngineModel(), {}, []
    hello_all(state)
    apply(state.submit(request(1), 0.0), done, sends, state)
    first_de = state.requests[1].de
    sends.clear()  # the AllocBuffer went to an engine that is about to die
    model.alive.discard(first_de)
    apply(state.lose(first_de, "killed"), done, sends, state)
    run_to_quiet(state, model, done, sends, 0.0)
    out = done[1]
    assert isinstance(out, ClusterOutput) and out.decode_engine != first_de
    assert out.num_attempts == 2 and zero(state) == {}


def _to_decoding(state: RouterState, model: EngineModel, done: dict, sends: list) -> str:
    """Deliver messages until the request's Decode is next; returns its DE."""
    while not isinstance(sends[0][1], Decode):
        engine, msg = sends.pop(0)
        for reply in model.answer(engine, msg):
            apply(state.on_message(engine, reply, 0.0), done, sends, state)
    return state.requests[1].de


def test_a_stream_whose_decode_engine_is_lost_moves_to_another_and_goes_on():
    """The new attempt assembles the prompt plus the streamed token, looks its hit up anew,
    samples from output index 1 and streams on: no repeated or missing token."""
    state, model, done, sends = make_state(), EngineModel(), {}, []
    hello_all(state)
    apply(state.submit(request(1, n=47), 0.0), done, sends, state)
    de = _to_decoding(state, model, done, sends)
    assert STREAMED[1] == [7]
    sends.clear()
    model.alive.discard(de)
    effects = state.lose(de, "killed")
    assert effects.lookups == [1] and state.requests[1].phase == Phase.MOVING
    apply(effects, done, sends, state)
    req = state.requests[1]
    assert req.kv_ids == (*range(3, 50), 7) and req.num_hit_blocks == 2  # 48 tokens: 2 blocks
    alloc = next(m for _, m in sends if isinstance(m, AllocBuffer))
    assert alloc.prompt_ids == req.kv_ids and alloc.num_blocks == 3
    while sends:
        engine, msg = sends.pop(0)
        if isinstance(msg, Prefill):
            assert msg.prompt_ids == req.kv_ids and msg.num_prior_outputs == 1
        if isinstance(msg, Decode):  # its DE has the tokens from the AllocBuffer
            assert msg.num_prior_outputs == 1 and msg.params == req.params
        for reply in model.answer(engine, msg):
            apply(state.on_message(engine, reply, 0.0), done, sends, state)
    out = done[1]
    assert isinstance(out, ClusterOutput) and out.decode_engine != de
    assert out.output_ids == [7, 7, 8, 9] and out.num_attempts == 2
    assert zero(state) == {}


def test_a_stream_that_keeps_losing_its_decode_engine_fails_clearly():
    state, model, done, sends = make_state(), EngineModel(), {}, []
    hello_all(state)
    apply(state.submit(request(1), 0.0), done, sends, state)
    for _ in range(MAX_ATTEMPTS):
        de = _to_decoding(state, model, done, sends)
        sends.clear()
        apply(state.on_message(de, Failed(state.requests[1].wire_id, "decode step failed"), 0.0),
              done, sends, state)
    assert isinstance(done[1], RequestFailed) and "decoding" in str(done[1])
    assert f"after {MAX_ATTEMPTS} attempts" in str(done[1])
    run_to_quiet(state, model, done, sends, 0.0)
    assert zero(state) == {}


def test_a_stream_grown_past_a_decode_engines_buffer_fails_clearly_when_it_would_move():
    """40 prompt tokens fit a DE's 4 buffer blocks; with 30 streamed outputs they would not."""
    state, model, done, sends = make_state(pool=8, staging=4), EngineModel(), {}, []
    hello_all(state)
    apply(state.submit(request(1, max_tokens=100), 0.0), done, sends, state)
    de = _to_decoding(state, model, done, sends)
    wire = state.requests[1].wire_id
    apply(state.on_message(de, Tokens(((wire, 1, tuple(range(8, 37))),)), 0.0), done, sends,
          state)
    apply(state.lose(de, "killed"), done, sends, state)
    assert isinstance(done[1], RequestFailed) and "host-buffer" in str(done[1])
    assert "cannot move" in str(done[1]) and zero(state) == {}


def test_a_stream_its_decode_engine_failed_moves_once_to_the_other_decode_engine():
    """Its DE failed the stream (its model server dying, say) but is still registered: the
    stream goes on elsewhere, not back where it would fail and move again (both DEs idle once
    it left, the tie would pick the same one)."""
    state, model, done, sends = make_state(), EngineModel(), {}, []
    hello_all(state)
    apply(state.submit(request(1), 0.0), done, sends, state)
    de = _to_decoding(state, model, done, sends)
    assert de == "de2"  # the tie's winner
    sends.pop(0)  # the Decode the engine fails instead of answering
    wire = state.requests[1].wire_id
    apply(state.on_message(de, Failed(wire, "vllm decode instance: connection reset"), 0.0),
          done, sends, state)
    assert state.requests[1].de not in ("", de)
    run_to_quiet(state, model, done, sends, 0.0)
    assert isinstance(done[1], ClusterOutput) and state.moved == 1
    assert zero(state) == {}


def test_a_request_aborted_while_it_moves_is_not_placed_again():
    state, model, done, sends = make_state(), EngineModel(), {}, []
    hello_all(state)
    apply(state.submit(request(1), 0.0), done, sends, state)
    de = _to_decoding(state, model, done, sends)
    moved = state.lose(de, "killed")
    apply(state.abort(1, "client left"), done, sends, state)
    assert isinstance(done[1], RequestAborted)
    assert state.resume(1, 2, 0.0).sends == [] and 1 not in state.requests
    assert moved.lookups == [1] and zero(state) == {}


def test_an_engine_that_beats_but_makes_no_progress_with_work_is_declared_stuck():
    """Beats from a live thread do not keep an engine whose work loop is stuck: past
    engine_timeout_s without progress while it holds a request, it is lost (its stream moves)
    and hears so; the same age with no work is only an idle engine."""
    state, model, done, sends = make_state(), EngineModel(), {}, []
    hello_all(state)
    idle = state.on_message("de3", Heartbeat("de3", 1, 1, 0, (), progress_age_s=60.0), 1.0)
    assert idle.sends == [("de3", HeartbeatAck(known=True))] and "de3" in state.engines
    apply(state.submit(request(1), 0.0), done, sends, state)
    de = _to_decoding(state, model, done, sends)
    wire = state.requests[1].wire_id
    busy = Heartbeat(de, 1, 1, 0, (wire,), progress_age_s=4.0)  # under the 5 s timeout: fine
    apply(state.on_message(de, busy, 1.0), done, sends, state)
    assert de in state.engines
    sends.clear()
    stuck = Heartbeat(de, 1, 1, 0, (wire,), progress_age_s=5.5)
    effects = state.on_message(de, stuck, 2.0)
    assert (de, HeartbeatAck(known=False)) in effects.sends and de not in state.engines
    assert state.stuck == {de: 1}
    apply(effects, done, sends, state)
    model.alive.discard(de)
    run_to_quiet(state, model, done, sends, 2.0)
    assert isinstance(done[1], ClusterOutput) and done[1].decode_engine != de
    assert zero(state) == {}


def test_silent_engines_are_lost_and_hear_so_when_they_speak_again():
    state, done, sends = make_state(), {}, []
    hello_all(state, now=0.0)
    for name, _, _ in ENGINES[1:]:
        state.on_message(name, Heartbeat(name, 10, 10, 0), 4.0)
    apply(state.tick(6.0), done, sends, state)
    assert "pe0" not in state.engines and "pe1" in state.engines
    effects = state.on_message("pe0", Heartbeat("pe0", 10, 10, 0), 7.0)
    assert effects.sends == [("pe0", HeartbeatAck(known=False))]
    state.on_message("pe0", Hello("pe0", "prefill", 0, "ep"), 7.1)
    assert "pe0" in state.engines


def test_aborting_during_prefill_keeps_the_buffer_until_the_prefill_engine_lets_go():
    state, model, done, sends = make_state(), EngineModel(), {}, []
    hello_all(state)
    apply(state.submit(request(1), 0.0), done, sends, state)
    engine, alloc = sends.pop(0)
    for reply in model.answer(engine, alloc):
        apply(state.on_message(engine, reply, 0.0), done, sends, state)
    assert isinstance(sends[0][1], Prefill)
    sends.clear()  # the PE is computing
    apply(state.abort(1, "client left"), done, sends, state)
    assert isinstance(done[1], RequestAborted)
    pe, de = state.draining[next(iter(state.draining))].pe, engine
    assert sends == [(pe, Abort(alloc.req_id))]  # the DE is not told yet
    assert state.counters()["buffer_blocks"] > 0
    apply(state.on_message(pe, Aborted(alloc.req_id), 0.0), done, sends, state)
    assert sends[-1] == (de, Abort(alloc.req_id))
    assert zero(state) == {}


def test_a_failing_engine_costs_attempts_then_a_clear_error():
    state, done, sends = make_state(), {}, []
    hello_all(state)
    apply(state.submit(request(1), 0.0), done, sends, state)
    for _ in range(MAX_ATTEMPTS):
        engine, msg = next((e, m) for e, m in reversed(sends) if isinstance(m, AllocBuffer))
        apply(state.on_message(engine, Failed(msg.req_id, "disk on fire"), 0.0), done, sends, state)
    assert isinstance(done[1], RequestFailed) and "disk on fire" in str(done[1])
    assert zero(state) == {}


def test_messages_of_an_earlier_attempt_cannot_move_a_later_one():
    state, model, done, sends = make_state(), EngineModel(), {}, []
    hello_all(state)
    apply(state.submit(request(1), 0.0), done, sends, state)
    engine, first = sends.pop(0)
    apply(state.on_message(engine, Failed(first.req_id, "transient"), 0.0), done, sends, state)
    late = model.answer(engine, first)[0]  # the first attempt's BufferReady, arriving late
    before = state.dropped_messages
    apply(state.on_message(engine, late, 0.0), done, sends, state)
    assert state.dropped_messages == before + 1 and state.requests[1].phase == Phase.BUFFERING


def test_heartbeats_correct_a_lost_message():
    state, model, done, sends = make_state(), EngineModel(), {}, []
    hello_all(state)
    apply(state.submit(request(1), 0.0), done, sends, state)
    engine, lost = sends.pop(0)  # the AllocBuffer never arrives
    for beat in range(3):
        busy = Heartbeat(engine, 1, 1, 0, (), inbox_age_s=4.0)  # a busy loop proves nothing
        apply(state.on_message(engine, busy, 0.1 * beat), done, sends, state)
    assert state.requests[1].wire_id == lost.req_id and state.drift[engine] == 1
    for beat in range(3):
        apply(state.on_message(engine, Heartbeat(engine, 1, 1, 0, ()), 1 + beat), done, sends,
              state)
    assert state.corrected == 1 and state.requests[1].wire_id != lost.req_id
    sends[:] = [(e, m) for e, m in sends if not isinstance(m, HeartbeatAck)]
    run_to_quiet(state, model, done, sends, 4.0)
    assert isinstance(done[1], ClusterOutput) and done[1].num_attempts == 2
    assert zero(state) == {}


# -- membership -----------------------------------------------------------------------------------


def peers_sent(effects) -> dict[str, tuple[PeerInfo, ...]]:
    """Each engine's ``Peers`` in these effects (at most one each)."""
    sent = [(engine, msg) for engine, msg in effects.sends if isinstance(msg, Peers)]
    assert len(sent) == len({engine for engine, _ in sent}), "Peers sent twice to an engine"
    return {engine: msg.peers for engine, msg in sent}


def test_every_engine_hears_the_peer_list_when_one_joins():
    state = make_state()
    hello_all(state)
    effects = state.on_message("de4", Hello("de4", "decode", 4, "ep-de4", "nic-de4", 4096, 512),
                               1.0)
    sent = peers_sent(effects)
    assert set(sent) == {"pe0", "pe1", "de2", "de3", "de4"}
    new = next(p for p in sent["pe0"] if p.name == "de4")
    assert new == PeerInfo("de4", "decode", 4, "ep-de4", "nic-de4", 4096, 512)
    assert {p.name for p in sent["de2"]} == set(sent)
    assert all(peers == sent["pe0"] for peers in sent.values())


def test_the_survivors_hear_the_peer_list_when_an_engine_is_lost_or_silent():
    state = make_state()
    hello_all(state, now=0.0)
    sent = peers_sent(state.lose("de3", "killed"))
    assert set(sent) == {"pe0", "pe1", "de2"}
    assert {p.name for p in sent["de2"]} == {"pe0", "pe1", "de2"}
    assert peers_sent(state.lose("de3", "killed again")) == {}  # no change, no message
    for name in ("pe0", "pe1"):
        state.on_message(name, Heartbeat(name, 10, 10, 0), 4.0)
    sent = peers_sent(state.tick(6.0))  # de2 fell silent
    assert set(sent) == {"pe0", "pe1"} and {p.name for p in sent["pe1"]} == {"pe0", "pe1"}


def test_a_rejoining_engine_is_announced_once_and_other_messages_announce_nothing():
    state, done, sends = make_state(), {}, []
    hello_all(state)
    apply(state.submit(request(1), 0.0), done, sends, state)
    assert peers_sent(state.on_message("de2", Heartbeat("de2", 1, 1, 0), 0.5)) == {}
    engine, alloc = sends.pop(0)
    reply = BufferReady(alloc.req_id, 4096, alloc.num_blocks, 0)
    assert peers_sent(state.on_message(engine, reply, 0.6)) == {}
    # the same name says hello again (restarted): lost and joined in one call, one message
    sent = peers_sent(state.on_message("pe0", Hello("pe0", "prefill", 0, "ep-new"), 1.0))
    assert set(sent) == {name for name, _, _ in ENGINES}
    assert next(p for p in sent["de3"] if p.name == "pe0").endpoint == "ep-new"


def test_peers_and_the_new_hello_fields_cross_the_wire():
    peers = Peers((PeerInfo("de2", "decode", 2, "ep", "tcp://h:1", 1 << 40, 4096),))
    back = decode(encode(peers))
    assert back == peers and back.peers[0].ep_buffer_addr == 1 << 40
    hello = Hello("de2", "decode", 2, "ep", "tcp://h:1", 4096, 512)
    assert decode(encode(hello)) == hello
    with pytest.raises(ProtocolError):
        decode(msgpack.packb({"type": "peers", "peers": [["de2", "decode"]]}))  # 2 fields


def test_an_old_style_hello_registers_without_nic_or_ep_buffer():
    state = make_state()
    sent = peers_sent(state.on_message("pe0", Hello("pe0", "prefill", 0, "ep"), 0.0))
    assert sent == {"pe0": (PeerInfo("pe0", "prefill", 0, "ep", "", 0, 0),)}


# -- the property ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_random_faults_never_raise_and_always_end_at_zero(seed):
    """Odd seeds: half the requests continue one of four agent sessions, and their short
    turns are prefilled on the decode engine where the session is warm (no PE)."""
    from dualpath.sessions import Session, warm_key

    rng = random.Random(seed)
    state = make_state(kv_tokens=1024, pool=24, staging=4, local_prefill_tokens=64 * (seed % 2))
    model = EngineModel()
    agents = [Session(f"agent-{i}", "header") for i in range(4)]
    for i, agent in enumerate(agents):  # their earlier turns ended on the two DEs
        state.placement.warm_at[warm_key(agent, "")] = ("de2", "de3")[i % 2]
    done, sends = {}, []
    inbox: list[tuple[str, Message]] = []  # engine -> router, delivered in random order
    now, submitted = 0.0, 0
    hello_all(state)
    for _ in range(400):
        now += rng.random() * 0.3
        action = rng.random()
        if action < 0.2 and submitted < 30:
            submitted += 1
            req = request(submitted, n=rng.randint(1, 120), hit_blocks=rng.randint(0, 6),
                          mode=rng.choice(list(Mode)), max_tokens=rng.randint(1, 300),
                          path=rng.choice(list(ReadPath)))
            if seed % 2 and rng.random() < 0.5:  # an agent's turn (mode: ours)
                req.session = rng.choice(agents)
                req.mode = Mode.DUALPATH
            apply(state.submit(req, now), done, sends, state)
        elif action < 0.5 and sends:  # in order per engine, as ZeroMQ delivers them
            engine = sends[rng.randrange(len(sends))][0]
            msg = sends.pop(next(i for i, (e, _) in enumerate(sends) if e == engine))[1]
            inbox.extend((engine, reply) for reply in model.answer(engine, msg))
        elif action < 0.8 and inbox:
            engine, msg = inbox.pop(rng.randrange(len(inbox)))
            if rng.random() < 0.1:
                inbox.append((engine, msg))  # duplicated
            apply(state.on_message(engine, msg, now), done, sends, state)
        elif action < 0.84:
            junk = rng.choice([Failed(rng.randint(0, 99), "junk"), Aborted(rng.randint(0, 99)),
                               Finished(rng.randint(0, 99), (1,), "stop"),
                               BufferReady(rng.randint(0, 99), 0, 1, 0),
                               Prefilled(rng.randint(0, 99), 1, 0, 1),
                               ReadDone(rng.randint(0, 99), 0),
                               Tokens(((rng.randint(0, 99), 0, (7,)),))])
            if isinstance(junk, Failed | Aborted | Prefilled | BufferReady):
                model.lies.add(junk.req_id)
            apply(state.on_message(rng.choice(ENGINES)[0], junk, now), done, sends, state)
        elif action < 0.86:  # killed: its launcher sees the exit; it restarts as a new process
            name = rng.choice(ENGINES)[0]
            model.kill(name)
            sends[:] = [(e, m) for e, m in sends if e != name]  # nothing reaches the old one
            apply(state.lose(name, "killed", exited=True), done, sends, state)
        elif action < 0.88:  # cut off: lost, but the process lives on (its answers still come)
            apply(state.lose(rng.choice(ENGINES)[0], "cut off"), done, sends, state)
        elif action < 0.92:
            name = rng.choice(ENGINES)[0]
            if name in model.alive and name not in state.engines:
                model.drop_everything(name)  # it hears it was lost, then says hello
            model.alive.add(name)
            apply(state.on_message(name, model.hello(name), now), done, sends, state)
        elif action < 0.96 and submitted:
            apply(state.abort(rng.randint(1, submitted), "cancelled"), done, sends, state)
        else:
            for name, _, _ in ENGINES:
                if name in model.alive and rng.random() < 0.8:
                    apply(state.on_message(name, model.beat(name), now), done, sends, state)
            apply(state.tick(now), done, sends, state)
        _check_non_negative(state)
    # every engine back, every message delivered, whatever remains aborted
    for name, _, _ in ENGINES:
        if name not in state.engines:
            if name in model.alive:
                model.drop_everything(name)
            model.alive.add(name)
            apply(state.on_message(name, model.hello(name), now), done, sends, state)
    for engine, msg in inbox:
        apply(state.on_message(engine, msg, now), done, sends, state)
    run_to_quiet(state, model, done, sends, now)
    for req_id in list(state.requests):
        apply(state.abort(req_id, "end of test"), done, sends, state)
    run_to_quiet(state, model, done, sends, now)
    for name, _, _ in ENGINES:  # the DEs' beats unfence what they fenced on their own
        apply(state.on_message(name, model.beat(name), now), done, sends, state)
    run_to_quiet(state, model, done, sends, now)
    assert sorted(done) == list(range(1, submitted + 1))
    assert zero(state) == {}
    assert not any(model.fenced.values()), model.fenced


def _check_non_negative(state: RouterState) -> None:
    negative = {k: v for k, v in state.counters().items() if v < 0}
    assert not negative, negative
    for name, engine in state.engines.items():
        load = engine.load
        held = (load.seq, load.tok, load.kv_tokens, load.buffer_blocks, load.pool_blocks)
        assert min(held) >= 0, name


def test_the_output_says_where_the_time_to_first_token_went():
    """Router marks (submitted and placed 1.0, buffer ready 3.0, prefilled 7.0, DE tokens 7.5)
    and the PE's own durations add up to the TTFT; the rest is 'other'."""
    state, done, sends = make_state(), {}, []
    hello_all(state)
    apply(state.submit(request(1, hit_blocks=2, path=ReadPath.DE), 1.0), done, sends, state)
    (de, alloc), = sends
    sends.clear()
    apply(state.on_message(de, BufferReady(alloc.req_id, 4096, alloc.num_blocks, 2), 3.0),
          done, sends)
    (pe, _), = sends
    sends.clear()
    prefilled = Prefilled(alloc.req_id, 7, 2, 8, wait_s=0.5, read_s=0.0, forward_s=2.0)
    apply(state.on_message(pe, prefilled, 7.0), done, sends, state)
    apply(state.on_message(de, Tokens(((alloc.req_id, 1, (8,)),)), 7.5), done, sends, state)
    apply(state.on_message(de, Finished(alloc.req_id, (7, 8, 9), "length"), 8.0), done, sends,
          state)
    t = done[1].timings
    assert t["ttft_s"] == 6.0 and t["queue_s"] == 0.5 and t["read_s"] == 2.0
    assert t["prefill_s"] == 2.0 and t["other_s"] == 1.5 and t["transfer_s"] == 0.5


_IDS = st.integers(0, 40)
_MESSAGES = st.one_of(
    st.builds(BufferReady, _IDS, st.integers(0, 1 << 20), _IDS, _IDS),
    st.builds(ReadDone, _IDS, _IDS),
    st.builds(Prefilled, _IDS, _IDS, _IDS, _IDS),
    st.builds(Tokens, st.lists(st.tuples(_IDS, _IDS, st.lists(_IDS, max_size=3).map(tuple)),
                               max_size=3).map(tuple)),
    st.builds(Finished, _IDS, st.lists(_IDS, max_size=4).map(tuple), st.sampled_from(
        ["stop", "length"])),
    st.builds(Failed, _IDS, st.text(max_size=5)), st.builds(Aborted, _IDS),
    st.builds(Heartbeat, st.sampled_from(["pe0", "de2", "x9"]), _IDS, _IDS, _IDS,
              st.lists(_IDS, max_size=3).map(tuple), st.floats(0, 10)),
    st.builds(Hello, st.sampled_from(["pe0", "de3", "x9"]), st.sampled_from(["prefill",
                                                                             "decode"]),
              st.integers(0, 5), st.just("ep")))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pe0", "pe1", "de2", "de3", "x9"]),
                          st.one_of(_MESSAGES.map(encode), st.binary(max_size=24))),
                max_size=60))
# a DE claiming more loaded blocks than the prompt has, then losing the request: its retry
# must not be queued with a hit longer than the prompt
@example(frames=[("de2", encode(BufferReady(3, 0, 0, 3))),
                 ("de2", encode(Heartbeat("de2", 0, 0, 0, (), 6.0)))])
def test_random_frames_from_any_peer_never_break_the_router_state(frames):
    """Well- and ill-formed frames, from registered engines and from a stranger, some speaking
    for another engine: decoded as the router does, none raises in the state, no counter goes
    negative, and once the engines answer and the rest is aborted every counter is zero."""
    state, model, done, sends = make_state(), EngineModel(), {}, []
    hello_all(state)
    for req_id in (1, 2, 3):
        apply(state.submit(request(req_id), 0.0), done, sends, state)
    for now, (sender, raw) in enumerate(frames):
        try:
            msg = decode(raw)
        except ProtocolError:
            continue
        apply(state.on_message(sender, msg, float(now)), done, sends, state)
        _check_non_negative(state)
    for name, role, node in ENGINES:  # every engine back (a frame may have stalled one)
        if name not in state.engines:
            apply(state.on_message(name, Hello(name, role, node, "ep"), 99.0), done, sends, state)
    run_to_quiet(state, model, done, sends, 99.0)
    for req_id in list(state.requests):
        apply(state.abort(req_id, "end of test"), done, sends, state)
    run_to_quiet(state, model, done, sends, 99.0)
    assert zero(state) == {} and sorted(done) == [1, 2, 3]


def test_a_sessions_next_turn_goes_to_the_decode_engine_that_keeps_it_warm():
    from dualpath.sessions import AgentHint, Session, warm_key

    state, model, done, sends = make_state(), EngineModel(), {}, []
    hello_all(state)
    session = Session("traj-9", "header", AgentHint(lease_s=30))

    def turn(req_id: int, with_session: bool = True) -> tuple[AllocBuffer, Prefill]:
        req = request(req_id, hit_blocks=2)
        req.session = session if with_session else None
        apply(state.submit(req, 0.0), done, sends, state)
        alloc = next(m for _, m in sends if isinstance(m, AllocBuffer))
        seen = []
        while sends:
            engine, msg = sends.pop(0)
            seen.append(msg)
            for reply in model.answer(engine, msg):
                apply(state.on_message(engine, reply, 0.0), done, sends, state)
        return alloc, next(m for m in seen if isinstance(m, Prefill))

    alloc, prefill = turn(1)
    assert alloc.warm_session == prefill.warm_session == warm_key(session, "")
    assert alloc.warm_lease_s == 30.0
    first_de = state.decisions[-1][2]
    for req_id in (2, 3):
        _, prefill = turn(req_id)
        assert state.decisions[-1][2] == first_de and prefill.read_path == ReadPath.DE
    alloc, _ = turn(4, with_session=False)
    assert alloc.warm_session == "" and alloc.warm_lease_s == 0.0


# -- conditional disaggregation: a warm session's short turn prefilled on its DE ------------------


def _local_state(threshold: int = 64) -> tuple[RouterState, EngineModel, dict, list]:
    state, model = make_state(local_prefill_tokens=threshold), EngineModel()
    hello_all(state)
    return state, model, {}, []


def _agent_turn(req_id: int, n: int, hit_blocks: int, mode: Mode = Mode.DUALPATH):
    from dualpath.sessions import Session

    req = request(req_id, n=n, hit_blocks=hit_blocks, mode=mode)
    req.session = Session("traj-1", "header")
    return req


def _deliver(state, model, done, sends, now: float = 0.0) -> list[tuple[str, Message]]:
    """Run to quiet; every message the router sent, in order."""
    seen = []
    while sends:
        engine, msg = sends.pop(0)
        seen.append((engine, msg))
        for reply in model.answer(engine, msg):
            apply(state.on_message(engine, reply, now), done, sends, state)
    return seen


def test_a_warm_sessions_short_turn_is_prefilled_on_its_decode_engine_with_no_prefill_engine():
    state, model, done, sends = _local_state()
    apply(state.submit(_agent_turn(1, n=40, hit_blocks=1), 0.0), done, sends, state)
    first = _deliver(state, model, done, sends)
    assert any(isinstance(m, Prefill) for _, m in first)  # no warm DE yet: the usual way
    warm_de = done[1].decode_engine
    apply(state.submit(_agent_turn(2, n=40 + 2 * BLOCK, hit_blocks=3), 1.0), done, sends, state)
    (engine, alloc), = sends
    assert engine == warm_de and isinstance(alloc, AllocBuffer) and alloc.num_read_blocks == 3
    model.answer(engine, alloc)  # it holds the buffer; its answer is the one below
    assert state.engines[warm_de].load.seq == 1 and not any(
        e.load.seq for name, e in state.engines.items() if name != warm_de)  # no PE held
    sends.clear()
    apply(state.on_message(warm_de, BufferReady(alloc.req_id, 4096, alloc.num_blocks, 2), 1.5),
          done, sends, state)
    (engine, dec), = sends  # the DE read only 2 of the 3 blocks: it computes the rest
    assert engine == warm_de and isinstance(dec, Decode) and dec.local
    assert dec.num_stored_blocks == 2
    assert state.engines[warm_de].load.buffer_blocks == 0  # it frees the buffer at copy-in
    rest = _deliver(state, model, done, sends, 2.0)
    assert not any(isinstance(m, Prefill) for _, m in rest)
    out = done[2]
    assert isinstance(out, ClusterOutput) and out.output_ids == [7, 8, 9]
    assert out.prefill_engine == "" and out.decode_engine == warm_de
    assert out.num_computed_tokens == 40 + 2 * BLOCK - 2 * BLOCK and out.read_path == "de"
    assert out.timings["ttft_s"] == 1.0 and out.timings["prefill_s"] == 0.5
    assert state.placement.num_local == 1 and zero(state) == {}


@pytest.mark.parametrize("case", ["long", "not_dualpath", "no_room", "off", "busy"])
def test_turns_with_much_to_compute_other_modes_and_a_full_decode_engine_go_to_a_prefill_engine(
        case):
    state, model, done, sends = _local_state(0 if case == "off" else 64)
    apply(state.submit(_agent_turn(1, n=40, hit_blocks=1), 0.0), done, sends, state)
    _deliver(state, model, done, sends)
    warm_de = done[1].decode_engine
    if case == "no_room":  # the warm DE's KV is held by others
        load = state.engines[warm_de].load
        load.kv_tokens, load.tok = 4096 - 50, 4000
    if case == "busy":  # it decodes more than this turn's tokens beyond the other DE
        state.engines[warm_de].load.tok = 61
    n, mode = (40 + 200, Mode.DUALPATH) if case == "long" else (60, Mode.DUALPATH)
    if case == "not_dualpath":
        mode = Mode.LAYERWISE
    apply(state.submit(_agent_turn(2, n=n, hit_blocks=2, mode=mode), 1.0), done, sends, state)
    seen = _deliver(state, model, done, sends)
    assert any(isinstance(m, Prefill) for _, m in seen) and state.placement.num_local == 0
    assert isinstance(done[2], ClusterOutput) and done[2].prefill_engine


@pytest.mark.parametrize("phase", [Phase.BUFFERING, Phase.DECODING])
def test_a_local_attempt_aborted_or_whose_engine_is_lost_holds_no_fence_and_no_prefill_engine(
        phase):
    state, model, done, sends = _local_state()
    apply(state.submit(_agent_turn(1, n=40, hit_blocks=1), 0.0), done, sends, state)
    _deliver(state, model, done, sends)
    warm_de = done[1].decode_engine
    for req_id in (2, 3):
        apply(state.submit(_agent_turn(req_id, n=50, hit_blocks=2), 1.0), done, sends, state)
    if phase == Phase.DECODING:
        for engine, msg in list(sends):
            sends.remove((engine, msg))
            for reply in model.answer(engine, msg):  # BufferReady: Decode(local) sent
                apply(state.on_message(engine, reply, 1.0), done, sends, state)
        assert all(isinstance(m, Decode) and m.local for _, m in sends)
    sends.clear()  # the AllocBuffers (or the Decodes) are in flight, lost with what follows
    assert {state.requests[r].phase for r in (2, 3)} == {phase}
    apply(state.abort(2, "cancelled"), done, sends, state)
    ((engine, abort),) = sends
    assert engine == warm_de and isinstance(abort, Abort) and not abort.fenced
    assert isinstance(done[2], RequestAborted) and not state.fences
    sends.clear()
    model.kill(warm_de)
    apply(state.lose(warm_de, "killed", exited=True), done, sends, state)
    _deliver(state, model, done, sends)  # buffering: placed again; decoding: moved
    out = done[3]
    assert isinstance(out, ClusterOutput) and out.decode_engine != warm_de
    assert out.prefill_engine  # its session is warm nowhere now: a PE prefilled it
    assert not state.fences and zero(state) == {}
