"""Bad input gets a clear error; a dead or stalled peer makes hops fail in time, never hang."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from commfuse_dp.ring import RingCommError, ring_all_gather, ring_reduce_scatter
from harness import run_ranks


def test_uninitialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised.*init_process_group"):
        ring_all_gather(torch.empty(4), torch.empty(2))
    with pytest.raises(RuntimeError, match="not initialised"):
        ring_reduce_scatter(torch.empty(2), torch.empty(4))


def _bad_input_worker(rank, world_size):
    cases = {
        "output has 5 elements, expected world_size \\(2\\) x input \\(3\\) = 6":
            lambda: ring_all_gather(torch.empty(5), torch.empty(3)),
        "input has 7 elements, expected world_size \\(2\\) x output \\(3\\) = 6":
            lambda: ring_reduce_scatter(torch.empty(3), torch.empty(7)),
        "output dtype torch.float16 differs from input dtype torch.float32":
            lambda: ring_all_gather(torch.empty(6, dtype=torch.float16), torch.empty(3)),
        "output is on meta but input is on cpu":
            lambda: ring_all_gather(torch.empty(6, device="meta"), torch.empty(3)),
        "input is not contiguous .*pass input.contiguous\\(\\)":
            lambda: ring_all_gather(torch.empty(8), torch.empty(4, 2).t()),
        "output is not contiguous":
            lambda: ring_reduce_scatter(torch.empty(2, 4).t(), torch.empty(16)),
        "op .* is not supported; use ReduceOp.SUM or ReduceOp.AVG":
            lambda: ring_reduce_scatter(torch.empty(2), torch.empty(4), op=dist.ReduceOp.MAX),
        "ReduceOp.AVG needs a floating-point tensor":
            lambda: ring_reduce_scatter(torch.empty(2, dtype=torch.int64), torch.empty(4, dtype=torch.int64),
                                        op=dist.ReduceOp.AVG),
        "must be a torch.Tensor":
            lambda: ring_all_gather([0.0, 1.0], torch.empty(1)),
    }
    import re
    for pattern, call in cases.items():
        try:
            call()
        except (ValueError, TypeError) as err:
            assert re.search(pattern, str(err)), f"message {str(err)!r} does not match {pattern!r}"
        else:
            raise AssertionError(f"no error for: {pattern}")
    # The group still works after rejected calls (nothing was half-sent).
    out = torch.empty(2 * 3)
    ring_all_gather(out, torch.full((3,), float(rank)))
    assert out.tolist() == [0.0] * 3 + [1.0] * 3
    return len(cases)


def test_bad_input_is_rejected_clearly():
    assert run_ranks(_bad_input_worker, 2) == [9, 9]


TIMEOUT_S = 4.0


def _fault_worker(rank, world_size, fault, victim, direct_kb):
    x = torch.full((1000,), float(rank))
    out = torch.empty(world_size * 1000)
    ring_all_gather(out, x, timeout_s=TIMEOUT_S, direct_kb=direct_kb)  # a healthy all-gather first: the ring is up
    if rank == victim:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(2 * TIMEOUT_S)  # stall: alive, but never answers, until after the survivors must have raised
        os._exit(0)
    start = time.monotonic()
    try:
        if fault == "kill":
            time.sleep(0.5)  # let the victim be gone before the ring starts
            start = time.monotonic()
        for _ in range(3):
            ring_reduce_scatter(torch.empty(1000), torch.ones(world_size * 1000), timeout_s=TIMEOUT_S,
                                direct_kb=direct_kb)
            ring_all_gather(out, x, timeout_s=TIMEOUT_S, direct_kb=direct_kb)
    except RingCommError as err:
        return {"elapsed": time.monotonic() - start, "message": str(err), "peer": err.peer,
                "k": err.k, "reason": err.reason}
    raise AssertionError("the ring did not notice the faulty peer")


@pytest.mark.parametrize("fault", ["kill", "stall"])
@pytest.mark.parametrize("world_size,direct_kb", [(2, 1024), (3, 1024), (3, 0)], ids=["2", "3-direct", "3-ring"])
@pytest.mark.slow
def test_faulty_peer_fails_every_rank_in_time(world_size, direct_kb, fault):
    # 4 KiB tensors: at 3 ranks one direct round with both peers (direct_kb=1024) or a ring of 2 hops (0)
    victim = 1
    results = run_ranks(_fault_worker, world_size, (fault, victim, direct_kb), check=False, timeout=60)
    survivors = [res for res in results if res.rank != victim]
    for res in survivors:
        assert res.ok, res.describe()
        info = res.value
        # Within the configured timeout (plus scheduling slack), not a hang.
        assert info["elapsed"] < TIMEOUT_S + 2.0, info
        assert info["peer"] in range(world_size) and info["peer"] != res.rank, info
        assert f"rank {info['peer']}" in info["message"] and f"hop {info['k'] + 1} of" in info["message"], info
    # The victim's neighbours name the victim itself.
    neighbours = {(victim + 1) % world_size, (victim - 1) % world_size} - {victim}
    for res in survivors:
        if res.rank in neighbours and res.rank == (victim + 1) % world_size:
            assert res.value["peer"] == victim, res.value
            expected = "timeout" if fault == "stall" else "peer lost"
            assert res.value["reason"] == expected, res.value


def _async_fault_worker(rank, world_size):
    out = torch.empty(world_size * 1000)
    ring_all_gather(out, torch.ones(1000), timeout_s=TIMEOUT_S)
    if rank == 1:
        time.sleep(2 * TIMEOUT_S)  # alive, but never answers
        os._exit(0)
    work = ring_all_gather(out, torch.ones(1000), async_op=True, timeout_s=TIMEOUT_S)  # on the ring thread
    try:
        work.wait()
    except RingCommError as err:
        return err.reason
    raise AssertionError("wait() on a failed async ring op returned as if it had succeeded")


@pytest.mark.slow
def test_async_ring_op_reraises_its_error_on_wait():
    # FSDP2 prefetches and the slicing schedule wait on these Works: a failure must surface there, not leave an
    # output that was never written.
    results = run_ranks(_async_fault_worker, 2, check=False, timeout=60)
    assert results[0].ok and results[0].value == "timeout", results[0].describe()
