"""Peak memory of one fused linear's forward (measured): lockstep holds two weight shards, never the full weight;
the elastic schedule (the default) gathers the layer's weight into one buffer, never more than that."""

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import commfuse_dp as cf
from commfuse_dp.fused.reference import naive_sharded_linear
from harness import run_ranks

OUT, IN, TOKENS = 2048, 1024, 8  # an 8 MiB fp32 weight; input and output are tiny beside it


def peak_bytes(fn) -> int:
    """Highest CPU memory allocated while ``fn`` runs, from the profiler's per-op (self) allocations: an op's net
    allocation counts from its start, its net release only from its end, so this is an upper bound of the peak."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    timeline = []
    for event in prof.events():
        change = event.self_cpu_memory_usage
        if change:
            timeline.append((event.time_range.start if change > 0 else event.time_range.end, change))
    current = peak = 0
    for _, change in sorted(timeline):
        current += change
        peak = max(peak, current)
    return peak


def _worker(rank, world_size, lookahead_mb):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, OUT, bias=False))
    cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=0, lookahead_mb=lookahead_mb))
    layer = model[0]
    x = torch.randn(TOKENS, IN)
    with torch.no_grad():
        fused = peak_bytes(lambda: layer(x))
        naive = peak_bytes(lambda: naive_sharded_linear(x, layer.weight))
        torch.testing.assert_close(layer(x), naive_sharded_linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    return {"fused": fused, "naive": naive}


@pytest.mark.parametrize("lookahead_mb", [0, "auto"])
def test_forward_peak(lookahead_mb):
    world = 4
    full = OUT * IN * 4
    shard, output = full // world, TOKENS * OUT * 4
    for peaks in run_ranks(_worker, world, (lookahead_mb,)):
        print(f"peak forward memory ({lookahead_mb}): fused {peaks['fused'] / 2**20:.2f} MiB, naive "
              f"{peaks['naive'] / 2**20:.2f} MiB; full weight {full / 2**20:.0f} MiB, shard {shard / 2**20:.0f} MiB")
        if lookahead_mb == 0:
            assert peaks["fused"] <= 2 * shard + output + 64 * 1024, peaks
        else:
            assert full <= peaks["fused"] <= full + output + 64 * 1024, peaks
        assert peaks["naive"] >= full, peaks  # the measurement sees a full weight when there is one
