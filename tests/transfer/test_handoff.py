"""The KV handoff's state machine: named verbs along legal edges only, and the one rule for pages."""

from __future__ import annotations

import pytest

from tandem.core.transfer_state import LEGAL, IllegalTransition, TransferState as S
from tandem.transfer.handoff import Handoff


def test_receiving_happy_path_ends_done_and_keeps_the_pages():
    h = Handoff("r")
    assert h.state is S.ALLOCATED and h.live and not h.pages_free
    h.bootstrap(7)
    assert (h.state, h.transfer_id) == (S.BOOTSTRAPPED, 7)
    h.send()
    h.land()
    assert h.state is S.DONE and not h.live and not h.pages_free   # DONE pages are the request's
    assert h.fail("late") is False and h.state is S.DONE and h.error == ""


@pytest.mark.parametrize("aborted, end", [(False, S.FAILED), (True, S.ABORTED)])
@pytest.mark.parametrize("posted", [(), ("bootstrap",)])
def test_a_failure_before_any_write_frees_the_pages_at_once(posted, aborted, end):
    h = Handoff("r")
    for verb in posted:
        getattr(h, verb)(1)
    assert h.fail("client went away", aborted=aborted) is True
    assert h.state is end and h.pages_free and h.error == "client went away"


@pytest.mark.parametrize("in_flight, end, free", [(False, S.FAILED, True), (True, S.QUARANTINED, False)])
def test_a_failure_during_the_write_waits_for_the_writer(in_flight, end, free):
    h = Handoff("r")
    h.bootstrap(1)
    h.send()
    assert h.fail("timed out") is False                 # a write may still land
    assert h.state is S.TRANSFERRING and not h.pages_free and h.live
    assert h.fail("second reason") is False and h.error == "timed out"   # the first reason wins
    assert h.settle(in_flight) is free
    assert h.state is end and not h.live


def test_an_aborted_write_settles_aborted():
    h = Handoff("r")
    h.bootstrap(1)
    h.send()
    h.fail("aborted by the client", aborted=True)
    assert h.settle(in_flight=False) and h.state is S.ABORTED


def test_redispatch_reuses_the_pages_with_a_new_transfer():
    h = Handoff("r")
    h.bootstrap(1)
    h.send()
    h.redispatch(2)
    assert (h.state, h.transfer_id) == (S.BOOTSTRAPPED, 2)
    h.send()
    h.land()
    assert h.state is S.DONE


def test_the_sending_side_starts_bootstrapped():
    h = Handoff("r", 5, S.BOOTSTRAPPED)
    h.send()
    h.fail("write failed")
    assert h.settle(in_flight=True) is False and h.state is S.QUARANTINED


@pytest.mark.parametrize("path, verb, args, bad", [
    ((), "send", (), "ALLOCATED -> TRANSFERRING"),
    ((), "land", (), "ALLOCATED -> DONE"),
    ((("bootstrap", 1),), "bootstrap", (2,), "BOOTSTRAPPED -> BOOTSTRAPPED"),
    ((("bootstrap", 1), ("send",), ("land",)), "send", (), "DONE -> TRANSFERRING"),
    ((("bootstrap", 1),), "redispatch", (2,), "BOOTSTRAPPED -> BOOTSTRAPPED"),
])
def test_illegal_moves_raise_naming_both_states(path, verb, args, bad):
    h = Handoff("r9")
    for step in path:
        getattr(h, step[0])(*step[1:])
    before = h.state
    with pytest.raises(IllegalTransition, match=f"handoff r9 .*{verb} is an illegal transition {bad}"):
        getattr(h, verb)(*args)
    assert h.state is before


def test_misuse_after_a_failure_is_refused():
    h = Handoff("r")
    h.bootstrap(1)
    h.send()
    h.fail("timed out")
    with pytest.raises(IllegalTransition, match="land after it failed"):
        h.land()
    with pytest.raises(IllegalTransition, match="redispatch after it failed"):
        h.redispatch(2)
    with pytest.raises(IllegalTransition, match="settle in ALLOCATED with no failure"):
        Handoff("q").settle(False)


def test_every_live_state_can_fail_or_abort_and_terminal_states_have_no_edges():
    assert all({S.FAILED, S.ABORTED} <= LEGAL[s] for s in S if not s.terminal)
    assert {s for s in S if s.terminal} == {S.DONE, S.FAILED, S.ABORTED, S.QUARANTINED}
    assert all(not LEGAL[s] for s in S if s.terminal)
