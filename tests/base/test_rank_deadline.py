"""The suite's multi-process runs cannot hang: a rank past its deadline prints its stacks and fails the test."""

from __future__ import annotations

import time

import pytest

from helpers import run_ranks


def _rank(rank: int, hang_rank: int) -> None:
    if rank == hang_rank:
        time.sleep(3600)  # a rank stuck for good (a teardown deadlock, a collective nobody joins)


def test_a_hanging_rank_fails_the_test_with_a_message(capfd):
    start = time.monotonic()
    with pytest.raises(AssertionError, match="a rank failed") as info:
        run_ranks(_rank, (1,), timeout_s=2.0)
    assert time.monotonic() - start < 60
    assert "exit code 1" in str(info.value)
    err = capfd.readouterr().err
    assert "Timeout" in err and "in _rank" in err, err  # the hanging rank's stack, where it hung


def test_ranks_that_finish_pass():
    run_ranks(_rank, (-1,), timeout_s=30.0)
