"""Every hop is requested, issued and waited for in one place (``commfuse_dp/ring/issue.py``): the
collectives' hops are folded into the ring's fingerprint one by one, counted in the step statistics and reported
to ``observe_ring`` exactly as many times as they are issued, on real gloo ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import commfuse_dp as cf
from commfuse_dp.ring import get_ring, observe_ring, ring_all_gather, ring_reduce_scatter
from commfuse_dp.stats import StatsRecorder
from harness import run_ranks
from commfuse_dp.handle import handle_of

BUCKET_MB = 64 * 4 / 2**20  # 64 fp32 elements a bucket


def _collectives_worker(rank, world_size):
    ring = get_ring()
    stats = StatsRecorder()
    stats.begin_step()
    ring.fingerprint.begin_step(0, 60.0)  # a step is open: its requests are folded in
    events = []
    with observe_ring(lambda event, op, k: events.append((event, op, k))):
        gathered = torch.empty(world_size * 200)
        ring_all_gather(gathered, torch.full((200,), float(rank)), bucket_mb=BUCKET_MB, stats=stats)  # 4 buckets
        summed = torch.empty(150)
        work = ring_reduce_scatter(summed, torch.ones(world_size * 150), async_op=True, bucket_mb=BUCKET_MB,
                                   stats=stats)  # on the ring's thread
        work.wait()
        small = torch.empty(world_size * 3)
        ring_all_gather(small, torch.full((3,), float(rank)), stats=stats)  # at 3 ranks: one direct round
        empty = ring_all_gather(torch.empty(0), torch.empty(0), async_op=True, stats=stats)  # no hop
        assert isinstance(empty, dist.Work) and empty.is_completed() and empty.wait()
    requests = list(ring.fingerprint.requests)
    value = ring.fingerprint.value
    ring.fingerprint.drop()
    assert torch.equal(gathered, torch.arange(world_size).repeat_interleave(200).float())
    assert torch.equal(summed, torch.full((150,), float(world_size)))
    started = [(op, k) for event, op, k in events if event == "start"]
    issued = [(op, k) for event, op, k in events if event == "issued"]
    landed = [(op, k) for event, op, k in events if event == "landed"]
    waited = [(op, k) for event, op, k in events if event == "wait"]
    values = [None] * world_size
    dist.all_gather_object(values, value)
    return {"started": started, "issued": issued, "landed": landed, "waited": waited,
            "requests": [(op[1], k, hops, numel) for op, k, hops, numel in requests],
            "hops": stats.current().hops, "values": values}


def test_every_hop_of_a_collective_goes_through_the_one_issuing_point():
    world = 3
    for got in run_ranks(_collectives_worker, world):
        # 4 buckets of the all-gather and 3 of the reduce-scatter in a wavefront of N - 1 = 2 hops: 5 and 4 hops;
        # the small all-gather is one direct round.
        hops = {"all_gather": 4 + world - 2, "reduce_scatter": 3 + world - 2}
        expected = ([("all_gather", k) for k in range(hops["all_gather"])]
                    + [("reduce_scatter", k) for k in range(hops["reduce_scatter"])] + [("all_gather", 0)])
        assert got["started"] == expected, got["started"]
        assert got["issued"] == expected and got["landed"] == expected, got["issued"]
        # each collective waited for once, from the compute side, with its last hop's index
        assert got["waited"] == [("all_gather", hops["all_gather"] - 1),
                                 ("reduce_scatter", hops["reduce_scatter"] - 1), ("all_gather", 0)], got["waited"]
        # every issued hop folded into the fingerprint, with its index, its collective's length and its size
        assert [(kind, k) for kind, k, _, _ in got["requests"]] == expected, got["requests"]
        ag = [r for r in got["requests"] if r[0] == "all_gather"]
        assert [hops for _, _, hops, _ in ag] == [5] * 5 + [1], ag
        assert [numel for _, _, _, numel in ag] == [64, 128, 128, 72, 8, 6], ag  # chunks in flight; direct: 3 x 2
        assert got["hops"] == len(expected) == 10
        assert len(set(got["values"])) == 1, got["values"]  # the same hops on every rank: the same fingerprint


def _other_buckets_worker(rank, world_size):
    """Without tags (as NCCL pairs messages): rank 0 gathers 128 elements in two buckets, rank 1 two tensors of 64 in
    one bucket each. The messages pair up (the same sizes in the same order) and nothing fails, but the ranks ran
    different hops: the fingerprint, compared after the step, says so on every rank."""
    ring = get_ring()
    assert not ring.tagged
    ring.fingerprint.begin_step(0, 60.0)
    if rank == 0:
        ring_all_gather(torch.empty(2 * 128), torch.ones(128), bucket_mb=BUCKET_MB, label="one tensor")
    else:
        for _ in range(2):
            ring_all_gather(torch.empty(2 * 64), torch.ones(64), bucket_mb=BUCKET_MB, label="one tensor")
    ring.fingerprint.end_backward()  # starts comparing step 0
    ring.fingerprint.begin_step(1, 60.0)
    try:
        ring.fingerprint.end_backward()  # reads step 0's comparison, a step later
    except RuntimeError as err:
        return str(err)
    raise AssertionError("ranks that issued different hops were not told")


def test_a_collective_cut_into_other_hops_is_caught_without_tags():
    for message in run_ranks(_other_buckets_worker, 2, env={"COMMFUSE_RING_TAGS": "0"}):
        assert "issued different hops in step 0: request 1 differs" in message, message
        assert "rank 0: one tensor all_gather (tag 1), hop 1 of 2, 64 elements" in message, message
        assert "rank 1: one tensor all_gather (tag 1), hop 1 of 1, 64 elements" in message, message


def _slicing_worker(rank, world_size, schedule):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    # (the non-finite check's all-gather comes after the backward's end, where the fingerprint of the step is
    # closed already: counted, not folded; it is off here so that both count the same hops)
    cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0, direct_kb=0, bucket_mb=BUCKET_MB,
                                      nonfinite_grads="off"))
    ring = handle_of(model).engine.ring
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    for step in range(3):
        issued = []
        with observe_ring(lambda event, op, k: issued.append(op) if event == "issued" else None):
            model(x).square().sum().backward()
        counted = handle_of(model).engine.stats.current().hops  # this step's, so far
        folded = len(ring.fingerprint.requests)
        assert issued and counted == len(issued) == folded, (step, counted, len(issued), folded)
    return counted


@pytest.mark.parametrize("schedule", ["slicing", "fsdp2"])
def test_a_step_counts_and_fingerprints_every_collective_hop(schedule):
    """The slicing schedule's gathers and reduce-scatters (on the ring's thread, waited for by compute) and FSDP2
    units' collectives: every hop issued in a training step is counted in its statistics and folded into its
    fingerprint, once."""
    counts = run_ranks(_slicing_worker, 3, (schedule,))
    assert counts == [counts[0]] * 3 and counts[0] > 0


def test_step_stats_ring_steps_is_a_deprecated_alias_of_hops():
    stats = cf.StepStats(step=0, wall_s=1.0, compute_s=1.0, comm_s=0.0, exposed_comm_s=0.0, hops=4)
    with pytest.warns(DeprecationWarning, match="StepStats.ring_steps is now StepStats.hops"):
        assert stats.ring_steps == 4
    assert stats.as_dict()["hops"] == 4 and "ring_steps" not in stats.as_dict()
