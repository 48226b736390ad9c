"""shard() refuses what it cannot serve with a clear error, and says once what it does not fuse."""


import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import commfuse_dp as cf
from harness import log_messages, run_ranks


def test_needs_an_initialised_process_group():
    import pytest

    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        cf.shard(nn.Linear(4, 4))


def _mixed_devices_worker(rank, world_size):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    try:
        cf.shard(model)
    except ValueError as err:
        message = str(err)
    else:
        raise AssertionError("a model on two devices was accepted")
    assert "several devices" in message and "'0.weight' on cpu" in message and "'1.weight' on meta" in message
    assert "model.to(device)" in message
    on_meta = cf.shard(nn.Linear(4, 4, device="meta"))  # accepted: each rank allocates its shards, uninitialised
    try:
        on_meta(torch.ones(2, 4))
    except RuntimeError as err:
        assert "Load its weights first" in str(err)
    else:
        raise AssertionError("a meta-built model ran a forward before its weights were loaded")
    sharded = cf.shard(nn.Linear(4, 4), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
    try:
        cf.shard(sharded)
    except ValueError as err:
        assert "sharded already" in str(err)
    else:
        raise AssertionError("a model was sharded twice")
    return True


def test_mixed_devices_meta_and_twice():
    run_ranks(_mixed_devices_worker, 2)


def _different_groups_worker(rank, world_size):
    first, second = dist.new_group([0, 1]), dist.new_group([2])
    mesh = DeviceMesh.from_group(first if rank < 2 else second, "cpu")
    try:
        cf.shard(nn.Linear(8, 8), mesh=mesh)
    except ValueError as err:
        assert "the ranks passed different data-parallel groups" in str(err)
        assert "rank 0: [0, 1]" in str(err) and "rank 2: [2]" in str(err)
        return True
    raise AssertionError("different groups on different ranks were accepted")


def test_group_that_differs_across_ranks():
    assert run_ranks(_different_groups_worker, 3, timeout=60) == [True] * 3


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)  # its out_proj is a Linear subclass
        self.head = nn.Linear(16, 16)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0])


def _unfusable_worker(rank, world_size):
    messages = log_messages()
    torch.manual_seed(0)
    model, ref = _Attention(), _Attention()
    ref.load_state_dict(model.state_dict())
    cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
    assert type(model.head).__name__ == "RingLinear"
    about = [m for m in messages if "NonDynamicallyQuantizableLinear" in m]
    assert len(about) == 1 and "not fused" in about[0] and "bucketed rings" in about[0], messages
    return True


def test_unfusable_module_falls_back_and_says_so_once():
    run_ranks(_unfusable_worker, 2)
