"""The order of hops and compute pieces (docs/design.md §3-4, §7), recorded, not timed."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import commfuse_dp as cf
from commfuse_dp.ring import observe_ring
from harness import run_ranks
from commfuse_dp.handle import handle_of


def _fused_worker(rank, world_size, steps=1, prefetch_next=True, lookahead_mb=0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 16))
    cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=0, prefetch_next=prefetch_next,
                                      lookahead_mb=lookahead_mb),
             mesh=init_device_mesh("cpu", (world_size,)))
    x = torch.randn(4, 16, requires_grad=True)
    for _ in range(steps):
        events = []
        with observe_ring(lambda event, op, k: events.append((event, op, k))):
            model(x).sum().backward()
    return events  # of the last step


def test_fused_order_matches_design():
    world = 3
    events = run_ranks(_fused_worker, world, (1, False))[0]  # each layer on its own: no cross-layer prefetch
    shown = {"start": "S", "compute": "C", "wait": "W"}  # "compute_begin" and "done" are implied by these
    forward = [shown[e[0]] + str(e[2]) for e in events if e[1] == "forward" and e[0] in shown]
    backward = [shown[e[0]] + str(e[2]) for e in events if e[1] == "backward" and e[0] in shown]
    # Per layer. Forward: a piece of compute beside each hop, the first before any wait, the last with no
    # hop after it. Backward: the last hop (the final reduce-scatter one) lands beside the last piece.
    one_forward = ["S0", "C0", "W0", "S1", "C1", "W1", "C2"]
    one_backward = ["S0", "C0", "W0", "S1", "C1", "W1", "S2", "C2", "W2"]
    assert forward == one_forward * 2, forward
    assert backward == one_backward * 2, backward
    for seq in (one_forward, one_backward):
        assert seq.index("C0") < seq.index("W0")
        last_compute = max(i for i, e in enumerate(seq) if e.startswith("C"))
        assert not any(e.startswith("S") for e in seq[last_compute:])


def _sequence(events, op):
    shown = {"start": "S", "compute": "C", "wait": "W"}
    return [shown[e[0]] + str(e[2]) for e in events if e[1] == op and e[0] in shown]


# Lockstep (lookahead_mb=0) first: each layer's hops beside its own pieces.

def test_last_gradient_hop_lands_during_the_next_layer():
    # The first step does not know the layer order yet (no prefetch), but a layer's last reduce-scatter hop (S2)
    # is not waited beside its own last piece: it is waited after the next layer's first piece (C0 ... W2), and
    # the last layer's at the end of the backward.
    backward = _sequence(run_ranks(_fused_worker, 3)[0], "backward")
    assert backward == ["S0", "C0", "W0", "S1", "C1", "W1", "S2", "C2",
                        "S0", "C0", "W2", "W0", "S1", "C1", "W1", "S2", "C2", "W2"], backward


def test_next_layer_ring_starts_during_the_last_piece():
    # From the second step on, the order is known: the next layer's hop 0 starts (S0) before this layer's last
    # piece (C2), and the next layer then begins with a piece (C0), its hop 0 already in flight. The last forward
    # layer keeps its gathered weight shards for its backward, which then sends gradient partials only (no S0; S1
    # and S2 carry the partials); its last forward piece starts the hop 0 of the backward's next layer.
    events = run_ranks(_fused_worker, 3, (2,))[0]
    assert _sequence(events, "forward") == ["S0", "C0", "W0", "S1", "C1", "W1", "S0", "C2",
                                            "C0", "W0", "S1", "C1", "W1", "C2"]
    in_order = [(e[1], e[2]) for e in events if e[0] in ("start", "compute")]
    last_forward_piece = in_order.index(("forward", 2), in_order.index(("forward", 2)) + 1)
    assert in_order[last_forward_piece - 1] == ("backward", 0)
    assert _sequence(events, "backward") == ["S0", "C0", "S1", "C1", "W1", "S2", "C2",
                                             "C0", "W2", "W0", "S1", "C1", "W1", "S2", "C2", "W2"]


def test_no_backward_prefetch_without_grad():
    # Under no_grad nothing follows the forward: no backward hop may start.
    events = run_ranks(_no_grad_worker, 2)[0]
    assert [e for e in events if e[1] == "backward"] == []
    assert _sequence(events, "forward") == ["S0", "C0", "W0", "S0", "C1", "C0", "W0", "C1"]


def _no_grad_worker(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 16))
    cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=0, lookahead_mb=0))
    x = torch.randn(4, 16, requires_grad=True)
    model(x).sum().backward()  # learns the order
    events = []
    with torch.no_grad(), observe_ring(lambda event, op, k: events.append((event, op, k))):
        model(x)
    return events


def _three_layers_worker(rank, world_size, options):
    """The forward's requests, waits and pieces in the second step of 3 layers sharded with ``options``."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    cf.shard(model, cf.CommFuseConfig(min_fuse_numel=0, **options))
    x = torch.randn(4, 16)
    for _ in range(2):
        events = []
        with observe_ring(lambda event, op, k: events.append((event, op, k))):
            model(x).sum().backward()
    return _sequence(events, "forward")


def _forward(**options):
    """Rank 0's sequence of ``_three_layers_worker`` at 2 ranks."""
    return run_ranks(_three_layers_worker, 2, (options,))[0]


def test_auto_lookahead_is_elastic_at_two_ranks():
    # "auto" is the elastic lookahead at every world size: at 2 ranks a budget of two units' gathered weights (each
    # Linear here: (16 x 16 + 16) elements, 4 bytes), not lockstep.
    two_units = 2 * (16 * 16 + 16) * 4 / 2**20
    auto = _forward(lookahead_mb="auto")
    assert auto == _forward(lookahead_mb=two_units)
    assert auto != _forward(prefetch_depth=2, lookahead_mb=0)


def test_prefetch_depth_keeps_that_many_layers_in_flight():
    # 2 ranks, 3 layers, second step. Depth 1: each layer's hop 0 starts during the previous layer's last piece.
    # Depth 2: the first layer's last piece starts both following layers' hop 0; nothing starts after that.
    assert _forward(prefetch_depth=1, lookahead_mb=0) == ["S0", "C0", "W0", "S0", "C1", "C0", "W0", "S0", "C1",
                                                          "C0", "W0", "C1"]
    assert _forward(prefetch_depth=2, lookahead_mb=0) == ["S0", "C0", "W0", "S0", "S0", "C1", "C0", "W0", "C1",
                                                          "C0", "W0", "C1"]


def _slicing_worker(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    cf.shard(model, cf.CommFuseConfig(schedule="slicing", min_fuse_numel=0))
    scheduler = handle_of(model).steps.schedule
    counts = []
    for _ in range(3):
        model(torch.randn(4, 16)).sum().backward()
        counts.append((scheduler.prefetch_hits, scheduler.gathers))
    return counts


def test_slicing_prefetches_after_the_first_step():
    (hits1, started1), (hits2, started2), (hits3, started3) = run_ranks(_slicing_worker, 2)[0]
    # Step 1 learns the order: 4 forward + 3 backward gathers (layer 1's input needs no grad: no dx, no gather),
    # none prefetched. Later steps ask for the same 7; all but layer 1's forward are prefetched (layer 4's backward
    # keeps its forward gather), and no gather is started that nobody uses: 6 started per step.
    assert (hits1, started1) == (0, 7)
    assert (hits2 - hits1, started2 - started1) == (6, 6)
    assert (hits3 - hits2, started3 - started2) == (6, 6)


# Elastic lookahead (the default, lookahead_mb="auto"): whole rings of coming layers requested ahead, gradient
# partials lagging. Requests and compute-side waits are recorded on the compute thread, in program order.

def test_elastic_requests_coming_rings_whole_and_lets_gradients_lag():
    events = run_ranks(_fused_worker, 3, (2, True, "auto"))[0]
    # Forward: layer 1 requests its own ring (S0 S1) when it begins; layer 2's whole ring is chosen ahead (the
    # budget: the larger layer's gathered weight) and its hops are requested beside layer 1's pieces, spread over
    # them (S0 before piece 0, S1 before piece 1); each piece waits only for the shard of the next one. Layer 2 is
    # the last forward layer: it keeps its shards, and its pieces request layer 1's backward ring instead.
    assert _sequence(events, "forward") == ["S0", "S1", "S0", "C0", "W0", "S1", "C1", "W1", "C2",
                                            "C0", "W0", "C1", "W1", "C2"]
    in_order = [(e[0], e[1], e[2]) for e in events if e[0] in ("start", "compute")]
    layer2 = [i for i, e in enumerate(in_order) if e == ("compute", "forward", 0)][1]
    assert in_order[layer2 - 1:layer2 + 3] == [("start", "backward", 0), ("compute", "forward", 0),
                                               ("start", "backward", 1), ("compute", "forward", 1)]
    # Backward: layer 2 (kept weight) requests gradient partials beside pieces 1 and 2 (its unit's gradient ring:
    # it is the unit's only and last group) and never waits for them there; layer 1 waits for its weight shards
    # (W0, W1) only. Each ring's last hop (W2) is waited once it landed, at a piece boundary or when the backward
    # ends; where exactly depends on the link's timing.
    backward = _sequence(events, "backward")
    assert [e for e in backward if e != "W2"] == ["S0", "S1", "C0", "S1", "C1", "S2", "C2",
                                                   "C0", "W0", "S1", "C1", "W1", "S2", "C2"], backward
    assert backward.count("W2") == 2 and backward.index("W2") > backward.index("C2")


def test_lookahead_budget_bounds_the_rings_requested_ahead():
    # 2 ranks, 3 layers of 16x16 + bias: a gathered layer is 2 x 136 fp32 = 1088 bytes. Second step. The budget
    # bounds the gathered weights held at once: the running layer's and those requested ahead.
    layer_mib = 1088 / 2**20
    own = ["S0", "C0", "W0", "C1"]  # a layer whose ring is requested when it begins
    ahead = ["C0", "W0", "C1"]  # one whose ring was requested ahead
    for budget in (0.5, 1, 1.5):  # the running layer and the next one do not fit: nothing ahead
        assert _forward(lookahead_mb=budget * layer_mib) == own * 3
    # 2 and 2.5 layers: one layer ahead, chosen when the layer before it begins.
    for budget in (2, 2.5):
        assert _forward(lookahead_mb=budget * layer_mib) == ["S0", "S0", *ahead, "S0", *ahead, *ahead]
    # Three layers: both following rings are chosen when layer 1 begins; their hops go beside its two pieces.
    assert _forward(lookahead_mb=3 * layer_mib) == ["S0", "S0", "C0", "W0", "S0", "C1", *ahead, *ahead]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _blocks_worker(rank, world_size, lookahead_mb, forward_bundles=True):
    """Second step of 3 blocks (units) of two linears each: hops requested per phase, and the gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([_Block() for _ in range(3)]))
    model.forward = lambda x: model[0][2](model[0][1](model[0][0](x)))
    cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=0, lookahead_mb=lookahead_mb,
                                      forward_bundles=forward_bundles))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model.zero_grad()
        events = []
        with observe_ring(lambda event, op, k: events.append((event, op, k))):
            model(x).square().sum().backward()
    starts = {phase: sum(1 for e in events if e[0] == "start" and e[1] == phase) for phase in ("forward", "backward")}
    if lookahead_mb != 0:  # the gathered-weight buffers of finished rings served later rings (CPU pool)
        assert handle_of(model).steps.schedule.rings._pool.reused > 0
    return starts, [p.grad.full_tensor() for p in model.parameters()]


def test_elastic_bundles_the_hops_of_a_unit():
    # 3 ranks (2 hops per ring), 3 blocks a/b. Forward: block 1's a gathers alone (2 hops) and chooses b1 and
    # block 2 whole while two blocks' weights fit (auto), block 2's two rings as one bundle; block 2 then chooses
    # block 3 as one bundle: 4 rings of 2 hops, not 6. Backward: weight rings a3 | b2+a2 | b1 (a1's input needs no
    # gradient) and gradient rings b3+a3 | b2+a2 bundled per block (beside the block's last group, a), block 1's
    # (the last unit) one per group: 3 + 4 rings of 2 hops. The gradients are the lockstep schedule's (no bundles).
    # Without forward bundles (forward_bundles "auto" here: (3 - 1) x 3² is small), every forward ring goes alone:
    # 6 rings of 2 hops; the backward is the same.
    world = 3
    elastic = run_ranks(_blocks_worker, world, ("auto",))
    apart = run_ranks(_blocks_worker, world, ("auto", "auto"))
    lockstep = run_ranks(_blocks_worker, world, (0,))
    assert elastic[0][0] == {"forward": 8, "backward": 14}, elastic[0][0]
    assert apart[0][0] == {"forward": 12, "backward": 14}, apart[0][0]
    for (_, got), (_, alone), (_, want) in zip(elastic, apart, lockstep):
        for g, a, w in zip(got, alone, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(a, w, rtol=1e-6, atol=1e-6)


def test_both_schedules_implement_the_one_schedule_interface():
    """The fused layers (``fused/linear.py``) and the step state drive either schedule through the members of
    ``runtime.step.Schedule`` alone: ``FusedSchedule`` and ``SlicingScheduler`` each have all of them, with the
    protocol's parameters in its order, and ``shard()`` picks one by the config (``fused.step_state``). A layer's
    forward and backward are each one call (``layer_call.ScheduledCall``) that the schedule returns."""
    import inspect

    from commfuse_dp.runtime.schedule import FusedSchedule
    from commfuse_dp.runtime.slicing import SlicingScheduler
    from commfuse_dp.runtime.step import Schedule

    members = [name for name, value in vars(Schedule).items()
               if not name.startswith("_") and (callable(value) or isinstance(value, property))]
    assert {"forward", "backward", "begin_step", "end_backward", "reset"} <= set(members)
    assert len(members) <= 8, members
    for cls in (FusedSchedule, SlicingScheduler):
        for name in members:
            ours, protocol = getattr(cls, name, None), getattr(Schedule, name)
            assert ours is not None, f"{cls.__name__} lacks {name}"
            if isinstance(protocol, property):
                assert isinstance(ours, property), f"{cls.__name__}.{name} is not a property"
                continue
            assert list(inspect.signature(ours).parameters) == list(inspect.signature(protocol).parameters), \
                f"{cls.__name__}.{name}{inspect.signature(ours)} against Schedule.{name}{inspect.signature(protocol)}"
        assert "self.dtype_hint" in inspect.getsource(cls.__init__), cls


def _eval_then_train_worker(rank, world_size, lookahead):
    import hf_models

    import commfuse_dp as cf

    model = hf_models.build("llama", tie_word_embeddings=True)
    cf.shard(model, cf.CommFuseConfig(schedule="fused", lookahead_mb=lookahead, min_fuse_numel=0))
    ref = hf_models.build("llama", tie_word_embeddings=True)
    model.eval()
    with torch.no_grad():  # (as the Trainer's evaluate() before training: a step without a backward)
        model(**hf_models.batch(rank, 0))
    model.train()
    losses = []
    for step in range(3):
        loss = model(**hf_models.batch(rank, step)).loss
        loss.backward()
        losses.append(loss.detach())
    ref_losses = [ref(**hf_models.batch(rank, step)).loss.detach() for step in range(3)]
    return torch.allclose(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lookahead", [0, "auto"])
def test_training_after_an_evaluation_forward(lookahead):
    """The last group's forward keeps its weight for the backward only where its ring could hold it: after a step
    with no backward, lockstep requested that ring ahead as two shards, and its backward gathers again."""
    assert all(run_ranks(_eval_then_train_worker, 2, (lookahead,)))
