"""A step that raises leaves nothing behind; ranks that run different fused layers fail loudly, never silently."""

import time

import pytest
import torch
import torch.nn as nn

import commfuse_dp as cf
from harness import run_ranks
from commfuse_dp.handle import handle_of


def _stack(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 24), nn.GELU(), nn.Linear(24, 8))


def _data(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 16, generator=gen)


def _reference_grads(world_size, step):
    ref = _stack()
    (ref(torch.cat([_data(r, step) for r in range(world_size)])).pow(2).sum() / world_size).backward()
    return [p.grad for p in ref.parameters()]


class Boom(RuntimeError):
    pass


def _aborted_worker(rank, world_size, schedule, where, explicit_reset):
    model = _stack()
    cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))
    model(_data(rank, 0)).pow(2).sum().backward()  # step 1: the layer order is learnt (prefetch, deferral on)
    model.zero_grad(set_to_none=True)

    def raise_in_backward(module, args, output):
        output.register_hook(lambda grad: (_ for _ in ()).throw(Boom("backward")))

    def raise_in_forward(module, args, output):
        raise Boom("forward")

    # Step 2 raises: in the backward between the first and second linear (after the later layers' backward ran,
    # with the second linear's last gradient hop deferred), or in the forward after the first linear.
    hook = model[1].register_forward_hook(raise_in_backward if where == "backward" else raise_in_forward)
    try:
        model(_data(rank, 1)).pow(2).sum().backward()
    except Boom:
        pass
    else:
        raise AssertionError("the injected fault did not fire")
    hook.remove()
    if explicit_reset:
        model.reset_iter_state()
    model.zero_grad(set_to_none=True)
    # Step 3 must be exactly a clean step: nothing of step 2 arrives in it.
    for _ in range(2):
        model(_data(rank, 2)).pow(2).sum().backward()
        for p, expected in zip(model.parameters(), _reference_grads(world_size, 2)):
            torch.testing.assert_close(p.grad.full_tensor(), expected, rtol=1e-5, atol=1e-6)
        model.zero_grad(set_to_none=True)
    return True


@pytest.mark.parametrize("explicit_reset", [False, True], ids=["next-forward-resets", "reset_iter_state"])
@pytest.mark.parametrize("where", ["backward", "forward"])
@pytest.mark.parametrize("schedule", ["fused", "slicing"])
def test_a_step_that_raises_leaves_nothing_behind(schedule, where, explicit_reset):
    run_ranks(_aborted_worker, 2, (schedule, where, explicit_reset))


class Branches(nn.Module):
    """Two fused linears of one shape; which one runs depends on the rank's data (here: on the rank)."""

    def __init__(self):
        super().__init__()
        self.left_branch = nn.Linear(16, 16)
        self.right_branch = nn.Linear(16, 16)

    def forward(self, x, left: bool):
        return self.left_branch(x) if left else self.right_branch(x)


TIMEOUT_S = 4.0


def _divergent_worker(rank, world_size, schedule):
    torch.manual_seed(0)
    model = Branches()
    cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0, timeout_s=TIMEOUT_S))
    x = torch.randn(4, 16)
    model(x, True).sum().backward()  # in lockstep: fine
    start = time.monotonic()
    try:
        model(x, rank == 0).sum().backward()  # rank 0 runs left_branch, the others right_branch
    except cf.RingCommError as err:
        return {"elapsed": time.monotonic() - start, "message": str(err)}
    raise AssertionError("ranks ran different fused layers and no error was raised")


@pytest.mark.parametrize("schedule", ["fused", "slicing"])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.slow
def test_ranks_running_different_fused_layers_fail_loudly(world_size, schedule):
    results = run_ranks(_divergent_worker, world_size, (schedule,), timeout=60)
    for rank, info in enumerate(results):
        mine = "left_branch" if rank == 0 else "right_branch"
        assert info["elapsed"] < TIMEOUT_S + 2.0, info
        assert f"This rank is rank {rank}, in {mine} (forward" in info["message"], info["message"]
    # Rank 0's neighbours ran the other layer, and say so (each names its own and where its peer was).
    assert "was in right_branch (forward" in results[0]["message"], results[0]["message"]
    assert "was in left_branch (forward" in results[1]["message"], results[1]["message"]


def _untagged_divergent_worker(rank, world_size, schedule):
    torch.manual_seed(0)
    model = Branches()
    cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0, timeout_s=TIMEOUT_S))
    assert not handle_of(model).engine.ring.tagged  # paired by order alone, as NCCL pairs its messages
    x = torch.randn(4, 16)
    model(x, True).sum().backward()  # step 0, in lockstep
    model(x, rank == 0).sum().backward()  # step 1: rank 0 runs left_branch, the others right_branch, same sizes
    try:
        model(x, True).sum().backward()  # step 2
    except RuntimeError as err:
        return {"raised_in": "step 2", "message": str(err), "type": type(err).__name__}
    raise AssertionError("ranks ran different fused layers without tags and no error was raised")


@pytest.mark.parametrize("schedule", ["fused", "slicing"])
def test_ranks_that_diverge_without_tags_raise_one_step_later(schedule):
    """Without message tags (NCCL has none) ranks running different fused layers of one shape pair their bytes
    silently; the fingerprint of each step's hops, compared across ranks, makes every rank raise in the next
    step (when its backward ends), naming the first request that differs and what each rank issued there."""
    results = run_ranks(_untagged_divergent_worker, 2, (schedule,), timeout=60, env={"COMMFUSE_RING_TAGS": "0"})
    for info in results:
        assert info["type"] == "RuntimeError", info
        message = info["message"]
        assert "issued different hops in step 1: request 1 differs" in message, message
        assert "rank 0: left_branch forward (call 1)" in message, message
        assert "rank 1: right_branch forward (call 1)" in message, message


def _phases_worker(rank, world_size, schedule):
    from commfuse_dp.runtime.step import StepPhase

    model = _stack()
    cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))
    steps = handle_of(model).steps
    seen = [steps.phase]
    with torch.no_grad():
        model(_data(rank, 0))
    seen.append(steps.phase)  # a forward without grad: no backward awaited
    out = model(_data(rank, 1))
    seen.append(steps.phase)
    out.pow(2).sum().backward()
    seen.append(steps.phase)
    # what commfuse_dp keeps on the model is its handle, one attribute
    pinned = sorted(k for k in vars(model) if k.startswith(("_commfuse", "_cf_")))
    return [p.value for p in seen], pinned, StepPhase.IDLE.value


@pytest.mark.parametrize("schedule", ["fused", pytest.param("slicing", marks=pytest.mark.slow)])
def test_a_step_goes_through_its_phases_and_the_model_holds_one_handle(schedule):
    for seen, pinned, idle in run_ranks(_phases_worker, 2, (schedule,)):
        assert seen == [idle, idle, "awaiting backward", idle]
        assert pinned == ["_commfuse"]
