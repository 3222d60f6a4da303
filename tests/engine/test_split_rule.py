"""The decode attention's split-K rule (engine/attention/split_rule.py): the table lookup's exact
choices and the table's construction from a sweep's rows. That every count the rule can pick gives
the same attention output: tests/engine/test_triton_attention.py."""

from __future__ import annotations

import pytest

from tandem.engine.attention.split_rule import DEFAULT_SPLITS, SplitTable, choose_splits


def test_default_table_choices_exact():
    # SmolLM2 (3 KV heads) at the context limit 8,192: batch x 3 programs pick the column
    assert [choose_splits(DEFAULT_SPLITS, 8192, b, 3) for b in (1, 8, 16, 32, 64, 128, 256)] == \
        [16, 16, 9, 5, 3, 2, 1]
    # below the table's first span / programs: its first row / column; never more splits than keys
    assert choose_splits(DEFAULT_SPLITS, 100, 1, 3) == 1
    assert choose_splits(DEFAULT_SPLITS, 600, 16, 8) == 3          # row 512, column 128
    assert choose_splits(DEFAULT_SPLITS, 1024, 1, 8) == 8


def test_a_swept_table_drives_the_choice_and_caps_at_the_keys():
    t = SplitTable.from_rows([(16, 2, 8), (16, 64, 1), (256, 2, 4), (256, 64, 2)], "sweep")
    assert (t.spans, t.programs, t.splits) == ((16, 256), (2, 64), ((8, 1), (4, 2)))
    assert [choose_splits(t, 4, 1, 1), choose_splits(t, 20, 1, 2), choose_splits(t, 20, 32, 2),
            choose_splits(t, 300, 1, 1), choose_splits(t, 300, 40, 2)] == [4, 8, 1, 4, 2]
    assert SplitTable.from_dict(t.to_dict()) == t


def test_a_table_with_gaps_or_disorder_is_refused():
    with pytest.raises(ValueError, match="cells empty"):
        SplitTable.from_rows([(16, 2, 8), (256, 64, 2)])
    with pytest.raises(ValueError, match="not a split table"):
        SplitTable((256, 16), (2,), ((1,), (1,)))
    with pytest.raises(ValueError, match="not a split table"):
        SplitTable((16,), (2,), ((0,),))
