"""The planner plays the runtime's own fused schedule ([Note: one policy, two clocks], ``commfuse_dp/planner/replay.py``):
on the same model, ranks and settings, the order of ring requests it predicts is the order that a real step on a
gloo ring records, request for request."""

from __future__ import annotations

import pytest
from harness import run_ranks
from commfuse_dp.handle import handle_of

SETTINGS = {
    "elastic, auto budget": {},
    "elastic, forward bundles": {"forward_bundles": True},
    "elastic, a budget of one layer": {"lookahead_mb": 0.3},
    "elastic, runs of 2 shards": {"piece_shards": 2},
    "lockstep": {"lookahead_mb": 0},
    "lockstep, prefetch 1": {"lookahead_mb": 0, "prefetch_depth": 1},
}


def _order_worker(rank, world_size, settings):
    import hf_models

    import commfuse_dp as cf
    from commfuse_dp.fused.embedding import RingEmbedding
    from commfuse_dp.planner.replay import Group, traced
    from commfuse_dp.ring import transport

    model = cf.shard(hf_models.build("llama"), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0, **settings))
    model(**hf_models.batch(rank, 0)).loss.backward()  # the first step records the layer order
    recorded = []

    def sent(what, op, k, nbytes, fmt):
        if op in ("forward", "backward"):  # the fused groups' rings (not the embedding's, not FSDP2 units')
            recorded.append((what, op, k))

    with transport.observe_sent(sent):
        model(**hf_models.batch(rank, 1)).loss.backward()
    steps = handle_of(model).steps
    order = steps.schedule.order.groups  # the fused groups in the forward order the step recorded
    groups = [Group(state.name, state.layout.numel * world_size, 0.0, state.unit) for state in order]
    first = any(isinstance(m, RingEmbedding) for m in model.modules())  # it requests the first layers' rings
    assert first
    config = handle_of(model).engine.config
    predicted = traced(groups, world_size, config, first=first).order
    return recorded, predicted, len(order)


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_planner_plays_the_order_the_runtime_records(name, world_size):
    for recorded, predicted, groups in run_ranks(_order_worker, world_size, (SETTINGS[name],)):
        assert groups >= 8 and len(recorded) > groups  # a real step of several fused groups
        assert predicted == recorded, next(
            f"request {i}: planner {p}, runtime {r}" for i, (p, r) in enumerate(zip(predicted + [None] * len(recorded),
                                                                                   recorded + [None] * len(predicted)))
            if p != r)
