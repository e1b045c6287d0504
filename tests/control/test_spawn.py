"""The rank launcher of the multi-process tests (:mod:`tests.control.spawn`): what a rank prints
reaches the test that started it (the ranks start from a fork server that an earlier test
started, holding that test's captured output), and a rank that hangs leaves its stack there."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from tests.control.spawn import spawn_ranks

pytestmark = pytest.mark.distributed


def _say_hello(rank: int, init: str, out: str) -> None:
    import os

    print(f"rank {rank} says hello to {os.environ.get('SPAWN_PROBE')}", file=sys.stderr, flush=True)
    torch.save({"rank": rank}, f"{out}/rank{rank}.pt")


def _sleep_forever(rank: int, init: str, out: str) -> None:
    time.sleep(600)


@pytest.mark.parametrize("name", ["first", "second"])  # the second test's ranks come from a fork server the first started
def test_each_tests_ranks_write_to_that_test_and_see_its_environment(tmp_path, capfd, monkeypatch, name) -> None:
    monkeypatch.setenv("SPAWN_PROBE", name)
    out = spawn_ranks(_say_hello, 2, tmp_path, timeout=60)
    assert [o["rank"] for o in out] == [0, 1]
    err = capfd.readouterr().err
    assert f"rank 0 says hello to {name}" in err and f"rank 1 says hello to {name}" in err, err


def test_a_hanging_rank_leaves_its_stack_in_the_tests_output(tmp_path, capfd) -> None:
    with pytest.raises(Exception):  # noqa: B017 - the dump exits the rank: the join reports that exit
        spawn_ranks(_sleep_forever, 1, tmp_path, timeout=17)  # the stacks are written at 17 - 15 = 2 s
    err = capfd.readouterr().err
    assert "---- rank 0 output ----" in err and "in _sleep_forever" in err and "Timeout" in err, err
