"""Fused layers behave as nn.Linear does under autograd, autocast, torch.compile and copy.deepcopy."""

import copy

import pytest
import torch
import torch.nn as nn

import commfuse_dp as cf
import hf_models
from harness import run_ranks
from test_shard_parity import assert_parity, run_case


def _stack(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 24), nn.GELU(), nn.Linear(24, 8))


def _data(rank, step=0):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 16, generator=gen)


def _reference_grads(world_size, step=0):
    """Mean over ranks of the single-process gradients (what the sharded grads must equal)."""
    ref = _stack()
    x = torch.cat([_data(r, step) for r in range(world_size)])
    (ref(x).pow(2).sum() / world_size).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _hooks_worker(rank, world_size, schedule):
    model = _stack()
    cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))
    fired, seen = [], {}
    def pre(grad, name):
        fired.append(("pre", name))
        return grad * 2  # a tensor hook may replace the gradient

    def post(param, name):
        fired.append(("post", name))
        seen[name] = param.grad.full_tensor()

    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: pre(g, name))
        p.register_post_accumulate_grad_hook(lambda q, name=name: post(q, name))
    for step in range(2):  # step 2: the order is known, the last reduce-scatter hops are deferred
        fired.clear()
        model.zero_grad()
        model(_data(rank, step)).pow(2).sum().backward()
        expected = _reference_grads(world_size, step)
        names = [n for n, _ in model.named_parameters()]
        assert sorted(fired) == sorted([("pre", n) for n in names] + [("post", n) for n in names]), fired
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), 2 * expected[name], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(seen[name], 2 * expected[name], rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("schedule", ["fused", "slicing"])
def test_gradient_hooks_fire_on_fused_parameters(schedule):
    run_ranks(_hooks_worker, 2, (schedule,))


def _autograd_grad_worker(rank, world_size, schedule):
    model = _stack()
    cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))
    model(_data(rank, 0)).pow(2).sum().backward()  # a first step teaches the layer order (prefetch, deferral)
    model.zero_grad(set_to_none=True)
    params = list(model.parameters())
    loss = model(_data(rank, 1)).pow(2).sum()
    grads = torch.autograd.grad(loss, params)
    expected = _reference_grads(world_size, 1)
    for (name, p), g in zip(model.named_parameters(), grads):
        assert g is not None, name
        torch.testing.assert_close(g.full_tensor(), expected[name], rtol=1e-5, atol=1e-6)
        assert p.grad is None, f"torch.autograd.grad wrote {name}.grad"
    # The backward after it is a normal one again (deferral and all).
    model(_data(rank, 1)).pow(2).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), expected[name], rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("schedule", ["fused", "slicing"])
def test_autograd_grad_returns_fused_gradients(schedule):
    run_ranks(_autograd_grad_worker, 2, (schedule,))


def _autocast_worker(rank, world_size, schedule):
    model, ref = _stack(), _stack()
    cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))
    xs = [_data(r, 0) for r in range(world_size)]
    for step in range(2):
        model.zero_grad()
        ref.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(xs[rank])
            ref_out = ref(torch.cat(xs))
        assert out.dtype == torch.bfloat16 == ref_out.dtype
        mine = ref_out[rank * 6:(rank + 1) * 6]
        torch.testing.assert_close(out, mine, rtol=0, atol=2e-2)
        out.float().pow(2).sum().backward()
        (ref_out.float().pow(2).sum() / world_size).backward()
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
            err = (p.grad.full_tensor() - r.grad).norm() / r.grad.norm()
            assert err < 2e-2, f"{name}: relative error {err:.3g} against nn.Linear under autocast"
    return True


@pytest.mark.parametrize("schedule", ["fused", "slicing"])
def test_autocast_computes_as_nn_linear(schedule):
    run_ranks(_autocast_worker, 2, (schedule,))


def _compile_worker(rank, world_size, schedule):
    import torch._dynamo

    torch._dynamo.reset()
    config = cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0)  # the defaults otherwise: ring embeddings on
    compiled = lambda model: torch.compile(model, backend="aot_eager")  # noqa: E731
    result = run_case(rank, world_size, "llama", schedule, config=config, compile=compiled)
    assert_parity(result, label=f"compiled llama/{schedule}")
    assert result["stats"].hops > 0
    return True


@pytest.mark.parametrize("schedule", ["fused", "slicing"])
@pytest.mark.slow
def test_torch_compile_trains_correctly(schedule):
    run_ranks(_compile_worker, 2, (schedule,), timeout=400)


def _deepcopy_worker(rank, world_size):
    model = hf_models.build("llama")
    cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
    for target in (model, model.model.layers[0].self_attn.q_proj, model.model.embed_tokens):
        try:
            copy.deepcopy(target)
        except RuntimeError as err:
            assert "copy.deepcopy of a model sharded with commfuse_dp.shard() is not supported" in str(err)
            assert "before shard()" in str(err)
        else:
            raise AssertionError(f"deepcopy of {type(target).__name__} did not raise")
    return True


def test_deepcopy_raises_clearly():
    run_ranks(_deepcopy_worker, 2)


def _inplace_worker(rank, world_size):
    model, ref = _stack(), _stack()
    cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
    x = _data(rank, 0)
    out = model[0](x)
    out.mul_(2)  # as into an nn.Linear's output (wav2vec2 masks its projection in place)
    torch.testing.assert_close(out, ref[0](x) * 2, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    return True


def test_output_can_be_written_in_place():
    run_ranks(_inplace_worker, 2)


def _tied_hook_worker(rank, world_size, schedule):
    model = hf_models.build("gpt2")  # wte and lm_head share one table, fused in both
    cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))
    table = model.lm_head.weight
    assert table is model.transformer.wte.weight and type(model.lm_head).__name__ == "RingLinear"
    calls = []
    table.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.full_tensor().clone()))
    for step in range(2):  # step 2: deferral would be on
        calls.clear()
        model(**hf_models.batch(rank, step)).loss.backward()
        assert len(calls) == 1, f"the tied table's hook ran {len(calls)} times in one backward"
        torch.testing.assert_close(calls[0], table.grad.full_tensor())  # it saw both gradients, summed
        model.zero_grad(set_to_none=True)
    return True


@pytest.mark.parametrize("schedule", ["fused", "slicing"])
def test_tied_table_hook_runs_once(schedule):
    run_ranks(_tied_hook_worker, 2, (schedule,))


def _eval_then_optimizer_worker(rank, world_size, min_fuse_numel):
    """The Trainer's order: evaluate() (a no-grad forward), then build the optimizer, then train."""
    model = _stack()
    cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=min_fuse_numel))
    with torch.no_grad():
        model(_data(rank, step=9))
    # every registered parameter must be the sharded one again, not FSDP2's unsharded full tensor
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    (model(_data(rank)).pow(2).sum()).backward()
    opt.step()
    ref = _reference_grads(world_size)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), before[n] - 0.1 * ref[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("min_fuse_numel", [0, 1 << 30], ids=["fused", "fsdp2-units"])
def test_optimizer_built_after_a_no_grad_forward_updates_the_shards(min_fuse_numel):
    run_ranks(_eval_then_optimizer_worker, 2, (min_fuse_numel,))
