"""Ring all-gather / reduce-scatter against torch's own collectives, on real gloo process groups."""

import pytest
import torch
import torch.distributed as dist

from commfuse_dp.ring import (
    get_ring,
    ring_all_gather,
    ring_all_gather_coalesced,
    ring_reduce_scatter,
    ring_reduce_scatter_coalesced,
)
from harness import run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (elements per rank, bucket_mb): empty, tiny, odd, several 4 KiB buckets in flight, larger than a default bucket.
SIZES = ((0, 25.0), (1, 25.0), (7, 25.0), (1001, 25.0), (5003, 4 / 1024), (7_000_003, 25.0))
# A bf16/fp16 sum of N values rounds at every hop; fp32 rounds at the 1e-7 level.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 4e-2), torch.float16: (2e-3, 4e-3)}


def _data(rank, n, dtype, salt=0):
    gen = torch.Generator().manual_seed(1000 * rank + 7 * n + salt)
    return torch.randn(n, generator=gen).to(dtype)


def _parity_worker(rank, world_size):
    checked = 0
    for dtype in DTYPES:
        for n, bucket_mb in SIZES:
            if n > 10_000 and dtype != torch.float32:
                continue
            x = _data(rank, n, dtype)
            ours, ref = torch.empty(world_size * n, dtype=dtype), torch.empty(world_size * n, dtype=dtype)
            ring_all_gather(ours, x, bucket_mb=bucket_mb)  # small ones at 3+ ranks: the direct exchange
            dist.all_gather_into_tensor(ref, x)
            assert torch.equal(ours, ref), f"all-gather differs: {dtype}, n={n}"
            ring_all_gather(ours, x, bucket_mb=bucket_mb, direct_kb=0)  # always the ring
            assert torch.equal(ours, ref), f"all-gather (ring only) differs: {dtype}, n={n}"
            # In place, as FSDP2 calls it: the input is a view of the output at rank * n.
            inplace = torch.empty(world_size * n, dtype=dtype)
            inplace[rank * n:(rank + 1) * n].copy_(x)
            ring_all_gather(inplace, inplace[rank * n:(rank + 1) * n], bucket_mb=bucket_mb)
            assert torch.equal(inplace, ref), f"in-place all-gather differs: {dtype}, n={n}"

            y = _data(rank, world_size * n, dtype, salt=1)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                ours, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
                ring_reduce_scatter(ours, y, op=op, bucket_mb=bucket_mb)
                dist.reduce_scatter_tensor(ref, y, op=op)
                rtol, atol = TOLERANCES[dtype]
                torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol, msg=lambda m: f"{dtype} n={n} {op}: {m}")
                again = torch.empty(n, dtype=dtype)
                ring_reduce_scatter(again, y, op=op, bucket_mb=bucket_mb)
                assert torch.equal(again, ours), "ring reduce-scatter is not deterministic"
                # The direct exchange sums in the ring's order: the same bits as the ring
                ring_reduce_scatter(again, y, op=op, bucket_mb=bucket_mb, direct_kb=0)
                assert torch.equal(again, ours), f"direct and ring reduce-scatter differ: {dtype} n={n} {op}"
                checked += 1
    return checked


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.slow
def test_parity_with_native_collectives(world_size):
    counts = run_ranks(_parity_worker, world_size, timeout=240)
    assert counts == [counts[0]] * world_size and counts[0] == 2 * (len(DTYPES) * (len(SIZES) - 1) + 1)


def _subgroup_worker(rank, world_size):
    members = [0, 2] if world_size == 3 else [1, 2, 3]
    group = dist.new_group(members)
    other = dist.new_group([r for r in range(world_size) if r not in members])
    if rank not in members:
        try:
            get_ring(group)
        except ValueError as err:
            assert "not a member" in str(err)
        else:
            raise AssertionError("a non-member was given a ring")
        return "outside"
    size, group_rank = len(members), members.index(rank)
    assert get_ring(group).size == size and get_ring(group).rank == group_rank
    x = _data(rank, 1001, torch.float32)
    ours, ref = torch.empty(size * 1001), torch.empty(size * 1001)
    ring_all_gather(ours, x, group, bucket_mb=1 / 1024)
    dist.all_gather_into_tensor(ref, x, group=group)
    assert torch.equal(ours, ref)
    y = _data(rank, size * 333, torch.float32, salt=3)
    ours, ref = torch.empty(333), torch.empty(333)
    ring_reduce_scatter(ours, y, group, dist.ReduceOp.SUM)
    dist.reduce_scatter_tensor(ref, y, group=group)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    del other
    return "inside"


@pytest.mark.parametrize("world_size", [3, 4])
def test_sub_group(world_size):
    roles = run_ranks(_subgroup_worker, world_size)
    assert roles.count("inside") == (2 if world_size == 3 else 3)


def _coalesced_and_async_worker(rank, world_size):
    sizes = [3, 0, 1000, 17, 4096, 1]
    xs = [_data(rank, n, torch.float32, salt=i) for i, n in enumerate(sizes)]
    outs = [torch.empty(world_size * n) for n in sizes]
    ring_all_gather_coalesced(outs, xs, bucket_mb=8 / 1024)  # several buckets, one tensor alone in its own
    for out, x in zip(outs, xs):
        ref = torch.empty(world_size * x.numel())
        dist.all_gather_into_tensor(ref, x)
        assert torch.equal(out, ref)
    ys = [_data(rank, world_size * n, torch.float32, salt=10 + i) for i, n in enumerate(sizes)]
    outs = [torch.empty(n) for n in sizes]
    ring_reduce_scatter_coalesced(outs, ys, op="avg", bucket_mb=8 / 1024)
    for out, y in zip(outs, ys):
        ref = torch.empty(y.numel() // world_size)
        dist.reduce_scatter_tensor(ref, y, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)

    # Async: a reduce-scatter on the ring thread while this thread runs a sync all-gather and computes.
    y = _data(rank, world_size * 20_000, torch.float32, salt=99)
    rs_out = torch.empty(20_000)
    work = ring_reduce_scatter(rs_out, y, op=dist.ReduceOp.SUM, async_op=True, bucket_mb=16 / 1024)
    x = _data(rank, 5000, torch.float32, salt=98)
    ag_out = torch.empty(world_size * 5000)
    ring_all_gather(ag_out, x, bucket_mb=4 / 1024)
    busy = torch.randn(256, 256) @ torch.randn(256, 256)
    if world_size > 1:
        assert isinstance(work, dist.Work)
        work.wait()
    rs_ref, ag_ref = torch.empty(20_000), torch.empty(world_size * 5000)
    dist.reduce_scatter_tensor(rs_ref, y)
    dist.all_gather_into_tensor(ag_ref, x)
    torch.testing.assert_close(rs_out, rs_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ag_out, ag_ref)
    return float(busy.sum())


@pytest.mark.parametrize("world_size", [1, 3])
def test_coalesced_and_async(world_size):
    run_ranks(_coalesced_and_async_worker, world_size)


def _submit_worker(rank, world_size):
    import time

    from commfuse_dp.ring.topology import get_ring, set_device_clock

    ring = get_ring()
    plain = ring.submit(lambda: rank + 1).result()
    started = time.perf_counter()
    set_device_clock(lambda: started + 0.05)  # an emulated device busy for 50 ms more
    try:
        gated = ring.submit(lambda: (rank + 2, time.perf_counter())).result()
    finally:
        set_device_clock(None)
    return plain, gated[0], gated[1] - started


def test_submit_returns_the_value_also_behind_a_device_clock():
    """``Ring.submit``'s future holds what the job returned, also when the job waits for an emulated device first
    (HSDP's replica exchange reads it: ``runtime/replicas.py``), and the job does not start before that device time."""
    for rank, (plain, gated, after) in enumerate(run_ranks(_submit_worker, 2)):
        assert (plain, gated) == (rank + 1, rank + 2) and after >= 0.05
