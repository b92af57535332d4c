"""bench/speedup_goal.py: a figure's verdict against its goal from paired timings."""

from __future__ import annotations

import pytest

from bench.speedup_goal import MET, MISSED, NOISE, cell, paired


def test_quartiles_above_the_goal_meet_it():
    f = paired([2.0, 2.2, 2.4, 2.0], [1.0, 1.0, 1.0, 1.0])
    assert f["verdict"] == MET and f["median"] == pytest.approx(2.1)
    assert f["q1"] == pytest.approx(2.0) and f["q3"] == pytest.approx(2.25)


def test_quartiles_below_the_goal_miss_it():
    assert paired([0.5, 0.6, 0.7], [1.0, 1.0, 1.0])["verdict"] == MISSED


def test_quartiles_that_straddle_the_goal_are_noise_not_met():
    f = paired([0.9, 1.0, 1.1, 1.2], [1.0, 1.0, 1.0, 1.0])
    assert f["median"] > 1.0 and f["verdict"] == NOISE
    assert cell(f) == "1.05x (0.97-1.12) within noise"


def test_one_repeat_and_other_goals():
    assert paired([3.0], [1.0], goal=5.0) == {"median": 3.0, "q1": 3.0, "q3": 3.0,
                                              "goal": 5.0, "verdict": MISSED}


def test_unpaired_timings_are_refused():
    with pytest.raises(ValueError, match="as many baseline as kvmove samples, got 2 and 1"):
        paired([1.0, 2.0], [1.0])
