"""A rank that stops early (uneven inputs: it runs fewer steps than the others) makes the ranks still running raise
``RingCommError`` naming it within ``timeout_s``, whatever it does instead -- exit, wait in a barrier, gather metrics
-- and also when it never reaches ``shard()``; no rank hangs. Uneven inputs themselves are not supported (design.md
section 11, "Uneven inputs")."""

import json

import pytest

from harness import run_ranks

import early_stop_worker

TIMEOUT_S = 4.0
# Two or three ranks (and the stopped rank's barrier) on two shared cores: scheduling slack on top of timeout_s.
SLACK_S = 3.0
HARNESS_TIMEOUT_S = 40.0  # a rank still running then is a hang (the process group's own timeout is 60 s)


def _early_stop(case: str, schedule: str = "fused", world_size: int = 2):
    results = run_ranks(early_stop_worker.worker, world_size, (case, schedule, TIMEOUT_S), check=False,
                        timeout=HARNESS_TIMEOUT_S)
    assert not any(res.hung for res in results), "\n".join(res.describe() for res in results if res.hung)
    stopper = results[early_stop_worker.STOPPER]
    if case == "exit":
        assert stopper.ok and stopper.value == "stopped", stopper.describe()
    for res in results:
        if res.rank == early_stop_worker.STOPPER:
            continue
        assert res.error_type == "RingCommError", res.describe()
        assert "rank 1" in res.error, res.describe()
        reports = [json.loads(line.removeprefix("EARLY_STOP "))
                   for line in res.log.splitlines() if line.startswith("EARLY_STOP ")]
        assert len(reports) == 1, res.describe()
        assert reports[0]["phase"] == ("shard" if case == "no_shard" else "step"), res.describe()
        assert reports[0]["elapsed"] < TIMEOUT_S + SLACK_S, (reports[0], res.describe())
    return results


@pytest.mark.parametrize("schedule", ["fused", "slicing"])
def test_stopped_rank_exits(schedule):
    results = _early_stop("exit", schedule)
    assert "peer lost" in results[0].error or "connection was lost" in results[0].error, results[0].describe()


@pytest.mark.slow
def test_stopped_rank_waits_in_barrier():
    results = _early_stop("barrier")
    assert "no answer within timeout_s=4s" in results[0].error, results[0].describe()


@pytest.mark.slow
def test_stopped_rank_waits_in_barrier_three_ranks():
    _early_stop("barrier", world_size=3)


@pytest.mark.slow
def test_stopped_rank_gathers_metrics():
    _early_stop("gather")


@pytest.mark.slow
def test_rank_that_never_reaches_shard():
    results = _early_stop("no_shard")
    assert "shard()" in results[0].error, results[0].describe()
