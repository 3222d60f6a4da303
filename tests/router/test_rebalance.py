"""router/rebalance.py: when a running request moves between decode workers (pure, exact)."""

from __future__ import annotations

from tandem.router.rebalance import MoveReason, MoveRequest, plan_drain, plan_forced, plan_moves
from tandem.router.view import WorkerView

KW = dict(high=0.85, low=0.6, spread=0.5)


def dec(wid: int, tokens: int, cap: int = 1000, alive: bool = True) -> WorkerView:
    return WorkerView(wid, "decode", alive=alive, running_tokens=tokens, capacity_tokens=cap)


def test_pressure_moves_the_largest_request_that_fits_to_the_emptiest_worker():
    ws = [dec(0, 900), dec(1, 100), dec(2, 400)]
    running = [("a", 0, 300), ("b", 0, 500), ("c", 0, 100), ("d", 1, 100)]
    assert plan_moves(ws, running, **KW) == [MoveRequest("b", 0, 1, MoveReason.PRESSURE)]   # 400 / 600 ties 600 / 400: larger


def test_no_move_when_no_peer_has_room_or_nothing_fits():
    assert plan_moves([dec(0, 900), dec(1, 700)], [("a", 0, 100)], **KW) == []      # peer above low
    assert plan_moves([dec(0, 900), dec(1, 500)], [("a", 0, 400)], **KW) == []      # 500 + 400 > 850
    assert plan_moves([dec(0, 900)], [("a", 0, 100)], **KW) == []                    # one worker


def test_skew_moves_only_what_narrows_the_gap():
    running = [("a", 0, 300), ("b", 0, 300)]
    assert plan_moves([dec(0, 600), dec(1, 0)], running, **KW) == [MoveRequest("a", 0, 1, MoveReason.REBALANCE)]   # gap 0.6; ties by rid
    assert plan_moves([dec(0, 600), dec(1, 200)], running, **KW) == []                      # gap 0.4
    # equal requests 2:1 -> moving one only flips the imbalance: no move
    assert plan_moves([dec(0, 200), dec(1, 100)], [("a", 0, 100), ("b", 0, 100), ("c", 1, 100)],
                      high=0.99, low=0.0, spread=0.01) == []
    assert plan_moves([dec(0, 300), dec(1, 0)], [("a", 0, 100), ("b", 0, 200)],
                      high=0.99, low=0.0, spread=0.01) == [MoveRequest("b", 0, 1, MoveReason.REBALANCE)]   # 100 / 200 either way
    assert plan_moves([dec(0, 400), dec(1, 0)], [("a", 0, 150), ("b", 0, 300)],
                      high=0.99, low=0.0, spread=0.01) == [MoveRequest("a", 0, 1, MoveReason.REBALANCE)]   # 250 / 150 beats 100 / 300



def test_excluded_dead_and_unsized_workers_are_never_targets():
    running = [("a", 0, 100)]
    assert plan_moves([dec(0, 900), dec(1, 0)], running, **KW, exclude={1}) == []
    assert plan_moves([dec(0, 900), dec(1, 0, alive=False)], running, **KW) == []
    assert plan_moves([dec(0, 900), dec(1, 0, cap=0)], running, **KW) == []
    assert plan_moves([dec(0, 900), dec(1, 0), dec(2, 0)], running, **KW) == [MoveRequest("a", 0, 1, MoveReason.PRESSURE)]



def test_drain_plans_every_request_on_the_worker_that_is_not_moving_yet():
    running = [("a", 0), ("b", 1), ("c", 0), ("d", 0)]
    assert plan_drain(0, running, moving={"c"}) == [MoveRequest("a", 0, None, MoveReason.DRAIN),
                                                     MoveRequest("d", 0, None, MoveReason.DRAIN)]
    assert plan_drain(2, running, moving=()) == []


def test_the_forced_lever_moves_a_request_once_it_streamed_its_tokens_on_one_worker():
    from tandem.core.config import MigrationConfig

    cfg = MigrationConfig(debug_migrate_every=12)
    assert plan_forced("a", 3, 11, cfg) is None
    assert plan_forced("a", 3, 12, cfg) == MoveRequest("a", 3, None, MoveReason.FORCED)
    assert plan_forced("a", 3, 500, MigrationConfig()) is None        # 0: off


def test_the_reasons_are_the_metric_labels_dashboards_know():
    from tandem.router.metrics import MIGRATION_REASONS

    assert MIGRATION_REASONS == ("pressure", "rebalance", "drain", "admin", "forced", "prestop")
    assert MoveReason("pressure") is MoveReason.PRESSURE and MoveReason.DRAIN == "drain"
