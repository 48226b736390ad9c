"""shard() checks, before converting anything, that every rank passed the same config and the same model; a mismatch
raises ValueError on every rank, naming what differs."""

import pytest
import torch.nn as nn

import commfuse_dp as cf
from harness import run_ranks
from commfuse_dp.handle import handle_of


def _llama(hidden=32, layers=2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=56,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=32))


def _refused(model, config):
    """The ValueError that shard() raises; the model must be left as it was."""
    try:
        cf.shard(model, config)
    except ValueError as err:
        assert getattr(handle_of(model), "engine", None) is None
        from torch.distributed.fsdp import FSDPModule

        converted = [n for n, m in model.named_modules()
                     if type(m).__name__.startswith("Ring") or isinstance(m, FSDPModule)]
        assert not converted and type(model.lm_head) is nn.Linear, f"shard() converted {converted} before raising"
        return str(err)
    raise AssertionError("shard() accepted ranks that disagree")


def _config_worker(rank, world_size):
    last = world_size - 1
    messages = {}
    # schedule differs on the last rank
    config = cf.CommFuseConfig(schedule="slicing" if rank == last else "fused")
    messages["schedule"] = _refused(_llama(), config)
    if world_size > 2:
        return messages  # the other cases at 2 ranks only
    # only prefetch_next differs
    messages["prefetch_next"] = _refused(_llama(), cf.CommFuseConfig(schedule="fused", prefetch_next=rank != last))
    # only min_fuse_numel differs
    messages["min_fuse_numel"] = _refused(_llama(), cf.CommFuseConfig(schedule="fused",
                                                                      min_fuse_numel=0 if rank == last else 1024))
    # the same config, but the ranks read different tokens per step off their batches: the defaults choose
    # differently (fused for 8 tokens, the peer for 4096 on this model and link)
    from commfuse_dp.planner.choose import batch_tokens
    from transformers import LlamaConfig, LlamaForCausalLM

    wider = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64))
    batch_tokens(wider, 8 if rank == last else 4096, "a test")
    given = cf.CommFuseConfig(min_fuse_numel=1024, link_gbps=0.1, ring_latency_us=200, tflops=0.1)
    messages["chosen"] = _refused(wider, given)
    # the same on every rank: accepted
    cf.shard(_llama(), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
    return messages


@pytest.mark.parametrize("world_size", [2, 3])
def test_config_that_differs_across_ranks(world_size):
    results = run_ranks(_config_worker, world_size, timeout=120)
    assert all(r == results[0] for r in results), "every rank must raise the same error"
    messages = results[0]
    others = "rank 0 has" if world_size == 2 else "ranks 0, 1 have"
    last = world_size - 1
    assert (f"the ranks passed different CommFuseConfigs: schedule: {others} 'fused', rank {last} has 'slicing'. "
            f"Pass the same config on every rank") in messages["schedule"]
    if world_size == 2:
        assert "CommFuseConfigs: prefetch_next: rank 0 has True, rank 1 has False." in messages["prefetch_next"]
        assert "CommFuseConfigs: min_fuse_numel: rank 0 has 1024, rank 1 has 0." in messages["min_fuse_numel"]
        assert "the ranks' \"auto\" settings chose differently (rank 0: fsdp2, piece_shards 1, rings" in \
            messages["chosen"] and "rank 1: fused, piece_shards 1, rings" in messages["chosen"], messages["chosen"]
        assert "8 tokens per rank (a test)" in messages.pop("chosen")
    for message in messages.values():  # only the differing field is named
        assert message.count(" has ") == 1 + (world_size == 2)


def _model_worker(rank, world_size):
    last = world_size - 1
    config = cf.CommFuseConfig(schedule="fused", min_fuse_numel=0)
    messages = {"layers": _refused(_llama(layers=3 if rank == last else 2), config)}
    if world_size == 2:  # at 3 ranks the extra layer only
        messages["hidden"] = _refused(_llama(hidden=48 if rank == last else 32), config)
    return messages


@pytest.mark.parametrize("world_size", [2, 3])
def test_model_that_differs_across_ranks(world_size):
    results = run_ranks(_model_worker, world_size, timeout=120)
    assert all(r == results[0] for r in results), "every rank must raise the same error"
    last = world_size - 1
    layers = results[0]["layers"]
    assert (f"shard: the ranks are sharding different models: rank {last} differs from rank 0: 9 extra on rank "
            f"{last} (model.layers.2.self_attn.q_proj.weight, model.layers.2.self_attn.k_proj.weight, "
            f"model.layers.2.self_attn.v_proj.weight, ...). Build the same model on every rank") in layers
    assert "parameters differ" not in layers and "missing" not in layers
    if world_size == 3:
        assert "rank 1 differs" not in layers
        return
    hidden = results[0]["hidden"]
    assert hidden.startswith("shard: the ranks are sharding different models: rank 1 differs from rank 0: ")
    assert ("parameters differ: model.embed_tokens.weight (rank 0 has shape (96, 32) float32, "
            "rank 1 has shape (96, 48) float32)") in hidden
    assert "missing" not in hidden and "extra" not in hidden and "Build the same model on every rank" in hidden


def test_differences_named_without_ranks():
    from commfuse_dp.checks import config_differences, model_differences

    a, b = cf.CommFuseConfig(schedule="fused").to_dict(), cf.CommFuseConfig(schedule="fused", bucket_mb=4,
                             exclude=("lm_head",)).to_dict()
    assert config_differences({0: a, 1: b, 2: a}) == [
        "bucket_mb: ranks 0, 2 have 25.0, rank 1 has 4.0", "exclude: ranks 0, 2 have [], rank 1 has ['lm_head']"]
    w, v = ("w", (4, 2), "float32", True), ("v", (4,), "float32", True)
    frozen = ("w", (4, 2), "float32", False)
    assert model_differences({0: [w, v], 1: [w, v]}) == []
    assert model_differences({0: [w, v], 1: [frozen]}) == [
        "rank 1 differs from rank 0: 1 parameters differ: w (rank 0 has shape (4, 2) float32, rank 1 has shape "
        "(4, 2) float32 frozen), 1 missing on rank 1 (v)"]
    assert model_differences({0: [w, v], 1: [v, w]}) == [
        "rank 1 differs from rank 0: the same parameters in another order (position 0: rank 0 has w, rank 1 has v)"]
