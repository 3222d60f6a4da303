"""Transfer state machine: legal edges only, deadlines, expiry order."""

from __future__ import annotations

import pytest

from tandem.transfer.state import LEGAL, IllegalTransition, TransferRegistry, TransferState as S


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_happy_path_and_terminal():
    reg = TransferRegistry(Clock())
    reg.add(1, timeout_s=5)
    for s in (S.BOOTSTRAPPED, S.TRANSFERRING, S.DONE):
        assert reg.advance(1, s).state is s
    assert S.DONE.terminal and not S.TRANSFERRING.terminal
    assert reg.fail(1, "late error") is False and reg.get(1).state is S.DONE
    assert reg.remove(1).transfer_id == 1 and 1 not in reg and len(reg) == 0


@pytest.mark.parametrize("path, bad", [
    ((), S.TRANSFERRING),
    ((), S.DONE),
    ((S.BOOTSTRAPPED,), S.ALLOCATED),
    ((S.BOOTSTRAPPED, S.TRANSFERRING, S.DONE), S.FAILED),
    ((S.FAILED,), S.BOOTSTRAPPED),
])
def test_illegal_transitions_name_both_states(path, bad):
    reg = TransferRegistry(Clock())
    reg.add(3, timeout_s=1)
    for s in path:
        reg.advance(3, s)
    cur = reg.get(3).state
    with pytest.raises(IllegalTransition, match=f"transfer 3: illegal transition {cur.name} -> {bad.name}"):
        reg.advance(3, bad)
    assert reg.get(3).state is cur


def test_every_live_state_can_fail_or_abort():
    assert all({S.FAILED, S.ABORTED} <= LEGAL[s] for s in S if not s.terminal)
    assert {s for s in S if s.terminal} == {S.DONE, S.FAILED, S.ABORTED}
    reg = TransferRegistry(Clock())
    reg.add(1, 1)
    reg.advance(1, S.BOOTSTRAPPED)
    assert reg.fail(1, "peer died") is True
    assert reg.get(1).state is S.FAILED and reg.get(1).error == "peer died"


def test_expired_lists_live_late_transfers_earliest_first():
    clock = Clock()
    reg = TransferRegistry(clock)
    reg.add(1, timeout_s=10)
    reg.add(2, timeout_s=5)
    reg.add(3, timeout_s=5)
    reg.add(4, timeout_s=1)
    reg.advance(4, S.FAILED)          # terminal: never listed
    assert reg.expired() == []
    clock.t += 5
    assert reg.expired() == [2, 3]
    assert reg.expired(now=200.0) == [2, 3, 1]


def test_registry_misuse():
    reg = TransferRegistry(Clock())
    reg.add(1, 1)
    with pytest.raises(ValueError, match="transfer 1 is already registered"):
        reg.add(1, 1)
    with pytest.raises(KeyError, match="transfer 9 is not registered"):
        reg.advance(9, S.DONE)
