"""loadgen/report.py ``by_turn``: per turn, prompt tokens computed (prompt - cached) against the
ideal (a later turn: its prompt minus the previous prompt and reply), and TTFT."""

from __future__ import annotations

import pytest

from tandem.loadtest.loadgen.report import Record, by_turn, format_turns


def _r(session, turn, prompt, cached, completion, ttft, error=None):
    return Record(session, turn, 0.0, ttft=ttft, prompt_tokens=prompt, cached_tokens=cached,
                  completion_tokens=completion, error=error)


def test_later_turns_are_measured_against_their_new_tokens():
    records = [_r("a", 0, 500, 100, 256, 1.0), _r("a", 1, 800, 780, 256, 0.2),
               _r("b", 0, 500, 480, 100, 3.0), _r("b", 1, 650, 300, 10, 0.6),
               _r("c", 0, 500, 0, 0, None, error="timeout"), _r("c", 1, 600, 0, 5, 0.1)]
    t = by_turn(records)
    assert t[0]["n"] == 2 and t[0]["computed"] == 400 + 20 and t[0]["ideal"] == 420
    # a: 800 - 500 - 256 = 44 new, 20 computed; b: 650 - 500 - 100 = 50 new, 350 computed;
    # c's turn 1 follows a failed turn: left out
    assert t[1]["n"] == 2 and t[1]["computed"] == 370 and t[1]["ideal"] == 94
    assert t[1]["ttft_p50_s"] == pytest.approx(0.4) and t[1]["ttft_mean_s"] == pytest.approx(0.4)
    table = format_turns(t)
    assert table.splitlines()[2].split()[:4] == ["1", "2", "370", "94"]
