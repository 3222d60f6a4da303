"""cluster/moves.py: one live migration's phases, legal edges only (no Ray, no workers)."""

from __future__ import annotations

import pytest

from tandem.cluster.moves import LEGAL, OUTCOME, TERMINAL, IllegalTransition, Migration, Phase
from tandem.cluster.workers import DECODE, WorkerRef
from tandem.router.metrics import MIGRATION_OUTCOMES
from tandem.router.rebalance import MoveReason

A, B = WorkerRef("decode-0", DECODE, 0, None), WorkerRef("decode-1", DECODE, 1, None)


def test_a_move_walks_precopy_frozen_copying_done():
    m = Migration("r", A, B, MoveReason.ADMIN)
    assert m.phase is Phase.PRECOPY and not m.froze and m.frozen_source(B) is None
    m.to(Phase.FROZEN)
    assert m.froze and m.frozen_source(B) is None        # not copying yet
    m.to(Phase.COPYING)
    assert m.frozen_source(B) is A and m.frozen_source(A) is None   # resumed on its source: nothing held apart
    m.to(Phase.DONE)
    assert m.ended and m.view()["phase"] == "done" and m.view()["reason"] == "admin"


def test_illegal_edges_raise_and_change_nothing():
    m = Migration("r", A, B, MoveReason.DRAIN)
    with pytest.raises(IllegalTransition, match="PRECOPY -> COPYING"):
        m.to(Phase.COPYING)
    assert m.phase is Phase.PRECOPY
    m.to(Phase.REFUSED)
    with pytest.raises(IllegalTransition):
        m.to(Phase.FROZEN)                                 # a terminal phase has no way out
    assert m.phase is Phase.REFUSED


def test_a_prestop_never_froze_so_it_holds_no_kv_to_fall_back_to():
    m = Migration("r", A, B, MoveReason.PRESTOP, Phase.COPYING)
    assert not m.froze and m.frozen_source(B) is None
    assert Migration("r", A, B, MoveReason.ADMIN, Phase.FROZEN).froze   # frozen by another router


def test_every_terminal_phase_but_refused_names_a_metric_outcome():
    assert TERMINAL == {Phase.DONE, Phase.FELL_BACK, Phase.RECOMPUTED, Phase.FAILED, Phase.ABORTED, Phase.REFUSED}
    assert set(OUTCOME) == TERMINAL - {Phase.REFUSED}
    assert set(OUTCOME.values()) == set(MIGRATION_OUTCOMES)
    assert all(nxt in Phase for edges in LEGAL.values() for nxt in edges)
