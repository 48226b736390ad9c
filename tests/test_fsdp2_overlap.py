"""FSDP2's GPU schedule on the rings (``use_ring_collectives(model, overlap=True)``) over the peer's units
(``fsdp_units.peer_plan``: embedding, layers, norm + lm_head; the coarse shape too): exact against DDP, the next
unit's all-gather issued one unit ahead and asynchronously, the backward's first at the forward's end, the
reduce-scatters waited for at the backward's end."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from commfuse_dp import CommFuseConfig, fsdp_units
from commfuse_dp.integrations.fsdp import RingAllGather, RingReduceScatter, use_ring_collectives
from harness import run_ranks
import hf_models
from commfuse_dp.handle import handle_of

STEPS = 4


def _peer(overlap=True, layers=3, coarse=False):
    model = hf_models.build("llama", num_hidden_layers=layers)
    blocks = list(model.model.layers)[::-1]  # (innermost first, as shard() lists units)
    fsdp_units.apply((fsdp_units.coarse_plan if coarse else fsdp_units.peer_plan)(model, blocks, set()))
    fully_shard(model)
    return use_ring_collectives(model, CommFuseConfig(timeout_s=60, bucket_mb=1 / 256), overlap=overlap)


def _train(model, rank, accumulate):
    """``accumulate``: two backwards per step, the first one's gradient kept in ``.grad`` (FSDP2 then adds the
    second reduce-scatter's output to it: the reduce-scatter must be complete when it returns)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        for micro in range(2 if accumulate else 1):
            loss = model(**hf_models.batch(rank, step, micro)).loss
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {name.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p.detach())
              for name, p in model.named_parameters()}
    return torch.stack(losses), params


def _parity_worker(rank, world_size, accumulate, coarse):
    ddp_losses, ddp_params = _train(DistributedDataParallel(hf_models.build("llama", num_hidden_layers=3)), rank,
                                    accumulate)
    losses, params = _train(_peer(coarse=coarse), rank, accumulate)
    torch.testing.assert_close(losses, ddp_losses, rtol=0, atol=1e-5)
    for name, p in ddp_params.items():
        torch.testing.assert_close(params[name], p, rtol=0, atol=1e-5, msg=name)
    start = hf_models.build("llama", num_hidden_layers=3)
    return max((ddp_params[n] - p.detach()).abs().max().item() for n, p in start.named_parameters())


@pytest.mark.parametrize("world_size,accumulate,coarse", [(2, False, False), (3, False, False), (2, True, False),
                                                          (3, False, True)], ids=["2", "3", "2-accumulate", "3-coarse"])
@pytest.mark.slow
def test_overlapping_peer_trains_like_ddp(world_size, accumulate, coarse):
    moved = run_ranks(_parity_worker, world_size, args=(accumulate, coarse), timeout=240)
    assert moved[0] > 1e-3, "training did not move the parameters: the comparison would prove nothing"


def _schedule_worker(rank, world_size, overlap):
    model = _peer(overlap)
    layers = list(model.model.layers)
    names = {id(model.model.embed_tokens): "embed", id(model.lm_head): "norm+lm_head",
             **{id(layer): f"layer{i}" for i, layer in enumerate(layers)}}
    kept = {name: unit._get_fsdp_state()._fsdp_param_groups[0].post_forward_mesh_info is None
            for name, unit in (("embed", model.model.embed_tokens), ("layer1", layers[1]), ("layer2", layers[2]),
                               ("norm+lm_head", model.model.norm))}
    events = []
    for unit in (model.model.embed_tokens, *layers, model.lm_head):
        group = unit._get_fsdp_state()._fsdp_param_groups[0]
        gather, scatter = group._all_gather_comm, group._reduce_scatter_comm
        assert isinstance(gather, RingAllGather) and isinstance(scatter, RingReduceScatter)

        def gathering(self, *args, _call=type(gather).__call__, _name=names[id(unit)], **kwargs):
            work = _call(self, *args, **kwargs)
            events.append(("gather", _name, work is not None))  # issued (asynchronously: a Work to wait for)
            return work

        gather.__class__ = type("Recorded", (RingAllGather,), {"__call__": gathering})
    assert not model._get_fsdp_state()._fsdp_param_groups, "the root holds parameters: the peer's units are coarse"
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: events.append(("forward", f"layer{i}", None)))
        layer.register_full_backward_pre_hook(
            lambda m, g, i=i: events.append(("backward", f"layer{i}", len(deferred.pending) if deferred else 0)))
    model.register_forward_hook(lambda m, a, o: events.append(("forward ends", None, None)), prepend=True)
    deferred = handle_of(model).deferred_reductions
    model(**hf_models.batch(rank, 1))  # gradients on, outputs dropped: no backward follows, nothing is gathered for it
    dropped = list(events)
    events.clear()
    for unit in model.modules():  # (the kept units resharded, and FSDP2's record of that forward dropped)
        if isinstance(unit, FSDPModule):
            unit.reshard()
    model.reset_iter_state()
    model(**hf_models.batch(rank, 0)).loss.backward()
    left = len(deferred.pending) if deferred else 0
    return events, left, kept, dropped


def test_schedule_gathers_one_unit_ahead_and_defers_reduce_scatters():
    events, left, kept, dropped = run_ranks(_schedule_worker, 2, args=(True,), timeout=120)[0]
    assert dropped[-1] == ("forward ends", None, None), dropped
    # The units: embed (resharded after forward), layer0-2 (layer2, the last, kept), norm+lm_head (kept).
    assert kept == {"embed": False, "layer1": False, "layer2": True, "norm+lm_head": True}, kept
    # Forward: the embedding's pre-forward gathers it and prefetches layer0; each unit's pre-forward prefetches the
    # next before it computes (the hook "forward" runs after FSDP2's pre-forward). Every gather is asynchronous (a
    # Work); the embedding's is waited for at once, as nothing computes before it. The backward's start issues its
    # first gather: layer1, the last unit resharded after the forward.
    # Backward: layer2 and norm+lm_head are still gathered; layer2's pre-backward finds layer1 issued, each
    # layer's pre-backward prefetches the unit before it (the hook "backward" runs before FSDP2's pre-backward).
    assert events == [
        ("gather", "embed", True), ("gather", "layer0", True), ("gather", "layer1", True), ("forward", "layer0", None),
        ("gather", "layer2", True), ("forward", "layer1", None), ("gather", "norm+lm_head", True),
        ("forward", "layer2", None), ("forward ends", None, None), ("gather", "layer1", True),
        ("backward", "layer2", 1), ("backward", "layer1", 2), ("gather", "layer0", True),
        ("backward", "layer0", 3), ("gather", "embed", True)], events
    # (the last field of "backward": reduce-scatters issued and still deferred when that layer's backward began)
    assert left == 0, "backward() returned with reduce-scatters still pending"
    # Without overlap (stock FSDP2 on CPU): each unit is gathered at its own pre-forward and waited for at once
    events, left, _, _ = run_ranks(_schedule_worker, 2, args=(False,), timeout=120)[0]
    assert events[:8] == [
        ("gather", "embed", False), ("gather", "layer0", False), ("forward", "layer0", None),
        ("gather", "layer1", False), ("forward", "layer1", None), ("gather", "layer2", False),
        ("forward", "layer2", None), ("gather", "norm+lm_head", False)], events
    assert ("forward ends", None, None) in events and all(e[2] == 0 for e in events if e[0] == "backward"), events
