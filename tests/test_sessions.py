"""A request's agent session from its headers and body (``dualpath/sessions.py``; pure)."""

from __future__ import annotations

import pytest

from dualpath.errors import RequestError
from dualpath.sessions import AgentHint, Session, check_session_id, session_of

HINT = AgentHint(priority=2, lease_s=30.0)


def test_the_id_comes_from_either_header_or_the_body():
    assert session_of({"x-session-id": "traj-7"}, None, None) == Session("traj-7", "header")
    assert session_of({"x-dynamo-session-id": "d1"}, None, HINT) == Session("d1", "header",
                                                                             HINT)
    assert session_of({}, "b-2", None) == Session("b-2", "body")
    both = session_of({"x-session-id": "s", "x-dynamo-session-id": "s"}, "s", None)
    assert both == Session("s", "header")  # the same id everywhere: fine
    assert session_of({}, None, None) is None


@pytest.mark.parametrize("headers,body", [({"x-session-id": "a"}, "b"),
                                          ({"x-session-id": "a", "x-dynamo-session-id": "b"},
                                           None)])
def test_ids_that_disagree_are_refused_naming_both_places(headers, body):
    with pytest.raises(RequestError, match="differs between"):
        session_of(headers, body, None)


@pytest.mark.parametrize("text", ["", "a b", "x" * 257, "tab\there", "é"])
def test_an_id_must_be_visible_ascii_of_bounded_length(text):
    with pytest.raises(RequestError, match="x-session-id must be"):
        check_session_id(text, "x-session-id")


def test_a_hint_needs_a_session():
    with pytest.raises(RequestError, match="agent_hint needs a session"):
        session_of({}, None, HINT)


def test_a_hint_names_what_it_sets():
    assert AgentHint().names() == ()
    assert HINT.names() == ("priority", "lease_s")
    assert AgentHint(next_turn_in_s=0.0, end_of_session=False).names() == ("next_turn_in_s",)
    assert AgentHint(end_of_session=True).names() == ("end_of_session",)
