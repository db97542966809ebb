"""The text report's words about steps and budget: ordinals as people write them, and an over-budget
line that says why (set by the user, backed off, too few steps yet, or the first steps read by design)."""

from __future__ import annotations

from memcallbacks._base.units import ordinal
from memcallbacks._files.report import _cost_lines, step_segments


def test_ordinals_and_step_segments_read_as_english():
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111, 112)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st", "111th", "112th"]
    assert step_segments([0, 1, 2, 3, 5, 7, 9, 11, 21, 31, 41, 43, 46, 49]) == [
        "0-3", "every 2nd from 5 to 11", "every 10th from 21 to 41", "every 3rd from 43 to 49"]


def cost(overhead, after, **cadence):
    lines = _cost_lines({"cadence": {"overhead": overhead, "overhead_after_start": after, "overhead_budget": 0.01,
                                     "dense_read_steps": 48, **cadence}}, {})
    return "\n".join(lines)


def test_over_budget_says_why_and_never_claims_a_back_off_that_did_not_happen():
    assert "over budget" not in cost(0.005, 0.004)
    early = cost(0.02, 0.005)
    assert "first 48 steps are read every step by design" in early and "back-off" not in early
    short = cost(0.005, 0.02)
    assert "too few steps since" in short and "back-off" not in short
    floor = cost(0.02, 0.02, over_budget_windows=2)
    assert "nothing it can measure less often is left" in floor and "log_every_n_steps" in floor
    backed = cost(0.02, 0.02, backoffs=[{"part": "read"}, {"part": "sample"}], over_budget_windows=2)
    assert "2 back-off(s) to keep the budget (read, sample)" in backed and "to bring it down (2 back-off(s))" in backed
    # backed off, and within the budget after the first steps: the first steps are why (a user check read "to come
    # back under it" on a run that never came back under its budget)
    early_backed = cost(0.02, 0.006, backoffs=[{"part": "read"}])
    assert "first 48 steps are read every step by design" in early_backed and "over budget" not in early_backed
    only_first = "\n".join(_cost_lines({"cadence": {"overhead": 0.14, "overhead_after_start": None, "overhead_budget": 0.01}}, {}))
    assert "this run's steps were all among the first ones, which are read every step by design" in only_first, only_first
    chosen = _cost_lines({"cadence": {"overhead": 0.03, "overhead_after_start": 0.03, "overhead_budget": 0.01,
                                      "sample_interval_source": "config", "sample_every_n_steps": 1}}, {})
    assert "sample_every_n_steps=1 is set" in "\n".join(chosen)


def test_rows_line_says_when_the_sampling_interval_is_longer_than_the_run():
    """A user check read "every 1050th step after the first ones" on a 200-step run, and "the logged ones" where nothing
    was logged (no log_fn): the rows at the logging interval are kept whether or not a logger writes them."""
    import pandas as pd
    from memcallbacks._files.report import _rows_lines

    history = pd.DataFrame({"step": [0, 1, 2, 3, 49, 99]})
    s = {"steps_seen": 200, "cadence": {"sample_interval_source": "overhead_budget", "sample_every_n_steps": 1050}}
    text = "\n".join(_rows_lines(s, history, "rows in history.csv"))
    assert "only those at the logging interval (its own, 1050 steps, is longer than this run)" in text and "1050th" not in text, text
    s["cadence"]["sample_every_n_steps"] = 25
    assert "every 25th step after the first ones, and those at the logging interval" in "\n".join(_rows_lines(s, history, "rows"))


def test_model_states_below_the_level_they_explain_read_as_nothing_unexplained():
    """A negative "unexplained" figure (a CPU heap that freed what it held at the start) reads as none."""
    from memcallbacks._files.report import _model_state_lines

    states = {"expected_steady_bytes": 7 << 20, "step": 1, "strategy": "single", "precision": "fp32", "world_size": 1,
              "expected": {"params": 2 << 20, "grads": 2 << 20, "optimizer": 3 << 20}, "unexplained_bytes": -(21 << 20)}
    line = _model_state_lines(states)[0]
    assert "nothing unexplained (the step started 21.0 MiB below the level they explain)" in line and "-21" not in line, line
    states["unexplained_bytes"] = 3 << 20
    assert _model_state_lines(states)[0].endswith("unexplained 3.0 MiB")
