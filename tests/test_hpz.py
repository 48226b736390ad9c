"""hpZ (``CommFuseConfig.hpz_size``, ZeRO++'s second copy of the weights per node, FSDP2's
``reshard_after_forward=<int>``): one flat shard over 4 ranks whose units keep a second copy over groups of 2
after the forward. Losses, grad norms, parameters and logits against one process, with and without gradient
accumulation; the backward's all-gathers run on the groups of 2 and nowhere else; ``describe()`` gives the second
copy's bytes; and where it cannot run, one line on every rank."""

import pytest
import torch.distributed as dist

import commfuse_dp as cf
from commfuse_dp.handle import handle_of
from harness import run_ranks
from test_shard_parity import assert_parity, run_case


def _hpz_worker(rank, world_size):
    import hf_models
    from commfuse_dp.ring import fsdp_comm

    sizes = []  # the group size of every ring all-gather FSDP2 asked for
    original = fsdp_comm.ring_all_gather

    def recording(output, input, group, *args, **kwargs):
        sizes.append(dist.get_world_size(group))
        return original(output, input, group, *args, **kwargs)

    fsdp_comm.ring_all_gather = recording
    try:
        for accum in (1, 2):
            sizes.clear()
            config = cf.CommFuseConfig(schedule="auto", hpz_size=2, min_fuse_numel=0)
            result = run_case(rank, world_size, "llama", "fsdp2", accum=accum, config=config)
            assert_parity(result, label=f"hpz 2 of 4, accum {accum}")
            assert set(sizes) == {2, 4}, sizes  # forward's on the 4, backward's on the 2
    finally:
        fsdp_comm.ring_all_gather = original
    model = cf.shard(hf_models.build("llama"), cf.CommFuseConfig(hpz_size=2))
    report = cf.describe(model)
    flat = cf.describe(cf.shard(hf_models.build("llama"), cf.CommFuseConfig(schedule="fsdp2", hpz_size=1)))
    assert report.schedule == "fsdp2"
    layer = next(u for u in report.fsdp_units if u.module == "model.layers.0")
    plain = next(u for u in flat.fsdp_units if u.module == "model.layers.0")
    assert layer.second_copy_bytes == layer.numel // 2 * 4 and plain.second_copy_bytes == 0
    assert 3 * layer.backward_gather_bytes == 2 * plain.backward_gather_bytes  # 1 hop of 1/2, not 3 of 1/4
    assert "hpZ" in str(report) and "hpZ" not in str(flat)
    return True


@pytest.mark.slow
def test_second_copy_per_pair_matches_one_process():
    assert all(run_ranks(_hpz_worker, 4, timeout=600))


def _launch_worker(rank, world_size):
    from test_nodes import _launched

    _launched(rank, 2)  # two nodes of two: hpz_size given, the layout left "auto" becomes one flat shard
    result = run_case(rank, world_size, "llama", "fsdp2", config=cf.CommFuseConfig(hpz_size=2, min_fuse_numel=0))
    assert_parity(result, label="hpz 2 on 2 nodes of 2")
    engine = handle_of(result["model"]).engine
    return engine.ring.size, engine.replicas is None


@pytest.mark.slow
def test_on_a_multi_node_launch_the_shard_is_flat():
    assert run_ranks(_launch_worker, 4, timeout=600) == [(4, True)] * 4


def _refusals_worker(rank, world_size):
    import hf_models

    cases = [(cf.CommFuseConfig(hpz_size=3), "does not divide the 4 ranks"),
             (cf.CommFuseConfig(hpz_size=2, schedule="fused"), "runs under schedule='fsdp2'"),
             (cf.CommFuseConfig(hpz_size=2, replicate=2), "not HSDP")]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            cf.shard(hf_models.build("llama"), config)
    return True


def test_where_it_cannot_run_every_rank_says_why():
    assert all(run_ranks(_refusals_worker, 4, timeout=300))
