"""CommFuseConfig.nonfinite_grads: a synced backward that leaves NaN/inf in a gradient shard raises on every rank
("raise"), or drops the step's gradients on every rank so that optimizer.step() changes nothing ("skip").

The non-finite values are real: one rank's loss is multiplied by infinity before its backward (its gradients
become inf/NaN through the real fused rings and FSDP2 reduce-scatters), or a post-accumulate-grad hook writes an
infinity into one rank's local gradient shard (the one fault that data cannot put on one rank only, since a
gradient is summed over the ranks before it is sharded). Each run is compared with a reference model, sharded
alike with the check off, that never saw the bad step."""


import hf_models
import pytest
import torch
from harness import log_messages, run_ranks

import commfuse_dp as cf
from commfuse_dp.handle import handle_of

BIG = 1 << 30  # min_fuse_numel: nothing fused, no ring embedding: every parameter in FSDP2's root unit


def _pair(schedule, mode, min_fuse_numel=0, optimizer="adamw"):
    """(model under test, reference with the check off), both sharded alike, with their optimizers."""
    models = []
    for nonfinite in (mode, "off"):
        model = hf_models.build("llama")
        cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=min_fuse_numel, nonfinite_grads=nonfinite))
        if optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        models.append((model, opt))
    return models


def _loss(model, rank, step, poisoned_rank=None):
    loss = model(**hf_models.batch(rank, step)).loss
    if rank == poisoned_rank:
        loss = loss * float("inf")  # this rank's gradients become inf/NaN in the real backward
    return loss


def _step(model, opt, rank, step):
    _loss(model, rank, step).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def _params(model):
    return {n: _full(p) for n, p in model.named_parameters()}


def _assert_same_params(model, ref, label):
    ours, theirs = _params(model), _params(ref)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=lambda m, name=name: f"{label} {name}: {m}")


def _opt_state(opt):
    return {id(p): {k: _full(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in opt.state.items()}


def _local_fault(model, rank, name):
    """On ``rank``: a post-accumulate-grad hook on parameter ``name`` writes inf into this rank's local shard."""
    param = dict(model.named_parameters())[name]
    if torch.distributed.get_rank() != rank:
        return None
    assert param.to_local().numel() > 0, f"{name} has no rows on rank {rank}: pick another parameter"

    def poison(p):
        if p.grad is not None:  # autograd also calls it, with no gradient, where the library writes it later
            p.grad.to_local().view(-1)[0] = float("inf")

    return param.register_post_accumulate_grad_hook(poison)


def _raise_worker(rank, world_size, schedule, min_fuse_numel, fault_param):
    (model, opt), (ref, ref_opt) = _pair(schedule, "raise", min_fuse_numel)
    for m, o in ((model, opt), (ref, ref_opt)):
        _step(m, o, rank, 0)
    errors = []
    # Step 1 of the model under test: rank 1's loss is infinite. Every rank raises from backward().
    try:
        _loss(model, rank, 1, poisoned_rank=1).backward()
    except FloatingPointError as err:
        errors.append(str(err))
    else:
        raise AssertionError("a backward with non-finite gradients did not raise")
    _assert_same_params(model, ref, "after the raise (no optimizer step)")
    opt.zero_grad(set_to_none=True)
    # Step 2: finite data, but rank 1 alone gets an inf in one local gradient shard, written after the parameter's
    # gradient was accumulated (for FSDP2's root unit that is inside FSDP2's own end-of-backward callback, for a
    # fused layer in the fused schedule's end-of-backward callback): the check runs after both.
    hook = _local_fault(model, 1, fault_param)
    try:
        _loss(model, rank, 2).backward()
    except FloatingPointError as err:
        errors.append(str(err))
    else:
        raise AssertionError("a backward whose rank-1 shard holds an inf did not raise")
    if hook is not None:
        hook.remove()
    opt.zero_grad(set_to_none=True)
    # Step 3, clean on both: the model trains on as if steps 1 and 2 had never been.
    _step(model, opt, rank, 3)
    _step(ref, ref_opt, rank, 3)
    _assert_same_params(model, ref, "after the clean step")
    with torch.no_grad():
        probe = hf_models.batch(rank, 9)
        torch.testing.assert_close(model(**probe).loss, ref(**probe).loss, rtol=0, atol=0)
    return errors


@pytest.mark.parametrize("schedule,min_fuse_numel,fault_param", [
    ("fused", 0, "model.layers.0.self_attn.q_proj.weight"),
    ("slicing", 0, "model.layers.1.mlp.down_proj.weight"),
    ("fused", BIG, "model.norm.weight"),
], ids=["fused", "slicing", "fsdp2-only"])
@pytest.mark.slow
def test_raise_on_every_rank_then_train_on(schedule, min_fuse_numel, fault_param):
    per_rank = run_ranks(_raise_worker, 2, (schedule, min_fuse_numel, fault_param), timeout=150)
    for rank, (summed, local) in enumerate(per_rank):
        # Rank 1's infinite loss reaches every shard through the reduction: both ranks hold non-finite shards.
        assert "step 1: the gradients are non-finite (NaN or inf) on rank(s) [0, 1] of 2" in summed, summed
        assert f"on rank {rank}: " in summed and "nonfinite_grads='skip'" in summed and "learning rate" in summed
        # Rank 1's local fault stays on rank 1: every rank names rank 1 alone, rank 1 names the parameter.
        assert "step 2: the gradients are non-finite (NaN or inf) on rank(s) [1] of 2" in local, local
        assert (f"on rank 1: {fault_param}" in local) == (rank == 1), local


def _skip_worker(rank, world_size, schedule, min_fuse_numel, optimizer):
    messages = log_messages(level=30)
    (model, opt), (ref, ref_opt) = _pair(schedule, "skip", min_fuse_numel, optimizer)
    for m, o in ((model, opt), (ref, ref_opt)):
        _step(m, o, rank, 0)
    before, state_before = _params(model), _opt_state(opt)
    _loss(model, rank, 1, poisoned_rank=1).backward()  # does not raise
    assert all(p.grad is None for p in model.parameters()), "the skipped step left gradients behind"
    opt.step()
    opt.zero_grad(set_to_none=True)
    after, state_after = _params(model), _opt_state(opt)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    assert state_after.keys() == state_before.keys()
    for key, entry in state_before.items():
        assert state_after[key].keys() == entry.keys()
        for k, v in entry.items():
            torch.testing.assert_close(torch.as_tensor(state_after[key][k]), torch.as_tensor(v), rtol=0, atol=0)
    skipped_after_bad = handle_of(model).engine.stats.current().skipped_steps  # step 1's figures, still running
    for m, o in ((model, opt), (ref, ref_opt)):
        _step(m, o, rank, 2)
    _assert_same_params(model, ref, "after the clean step")
    warnings = [m for m in messages if "non-finite gradients" in m]
    return {"warnings": warnings, "skipped": cf.step_stats(model).skipped_steps,  # the last finished step: 1
            "skipped_after_bad": skipped_after_bad, "ref_skipped": cf.step_stats(ref).skipped_steps}


@pytest.mark.parametrize("schedule,min_fuse_numel,optimizer", [
    ("fused", 0, "adamw"), ("slicing", 0, "sgd"), ("fused", BIG, "adamw"),
], ids=["fused-adamw", "slicing-sgd-momentum", "fsdp2-only-adamw"])
@pytest.mark.slow
def test_skip_on_every_rank_changes_nothing(schedule, min_fuse_numel, optimizer):
    for result in run_ranks(_skip_worker, 2, (schedule, min_fuse_numel, optimizer), timeout=150):
        assert len(result["warnings"]) == 1, result["warnings"]
        assert "step 1: non-finite gradients on rank(s) [0, 1]" in result["warnings"][0]
        assert "1 step(s) skipped so far" in result["warnings"][0]
        assert result["skipped"] == 1 and result["ref_skipped"] == 0
        assert result["skipped_after_bad"] == 1


def _accumulation_worker(rank, world_size, schedule):
    (model, opt), (ref, ref_opt) = _pair(schedule, "raise")
    # Micro-batch 0 (no_sync) has rank 1's infinite loss: no check there (the shards are not final), ...
    with model.no_sync():
        _loss(model, rank, 0, poisoned_rank=1).backward()
    # ... and the clean synced micro-batch 1 carries the accumulated non-finite values into the shards: caught.
    try:
        _loss(model, rank, 1).backward()
    except FloatingPointError as err:
        caught = str(err)
    else:
        raise AssertionError("the synced backward after a non-finite accumulation micro-batch did not raise")
    opt.zero_grad(set_to_none=True)
    # A clean accumulation window afterwards trains like the reference's.
    for m, o in ((model, opt), (ref, ref_opt)):
        with m.no_sync():
            (_loss(m, rank, 2) / 2).backward()
        (_loss(m, rank, 3) / 2).backward()
        o.step()
        o.zero_grad(set_to_none=True)
    _assert_same_params(model, ref, "after a clean accumulation window")
    return caught


@pytest.mark.parametrize("schedule", ["fused", "slicing"])
def test_accumulation_checks_at_the_synced_backward(schedule):
    for caught in run_ranks(_accumulation_worker, 2, (schedule,), timeout=150):
        assert "step 1: the gradients are non-finite" in caught, caught


def _off_worker(rank, world_size):
    out = {}
    for label, config in (("off", cf.CommFuseConfig(schedule="fused", min_fuse_numel=0, nonfinite_grads="off")),
                          ("auto-fp16", cf.CommFuseConfig(schedule="fused", min_fuse_numel=0, param_dtype="fp16")),
                          ("auto-fp32", cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))):
        model = hf_models.build("llama")
        cf.shard(model, config)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        try:
            _loss(model, rank, 1, poisoned_rank=1).backward()
        except FloatingPointError:
            out[label] = "raised"
            continue
        opt.step()
        out[label] = "nan params" if any(not torch.isfinite(_full(p)).all() for p in model.parameters()) else "finite"
    return out


def test_off_lets_nan_through_and_auto_stands_aside_in_fp16():
    for result in run_ranks(_off_worker, 2, (), timeout=150):
        assert result == {"off": "nan params", "auto-fp16": "nan params", "auto-fp32": "raised"}, result


def test_callbacks_queued_by_a_callback_run_after_those_queued_before():
    """The ordering the check rests on (torch's autograd engine): final callbacks run in queue order, a callback
    queued by a running callback runs after every one queued before it, and none runs after a failed backward."""
    engine = torch.autograd.Variable._execution_engine
    order = []
    x = torch.ones(2, requires_grad=True)

    class Late(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.clone()

        @staticmethod
        def backward(ctx, g):
            engine.queue_callback(lambda: order.append("queued later in the backward"))
            return g

    out = Late.apply(x * 2) * 3  # the hook on out fires first in the backward, Late's backward after it
    out.register_hook(lambda g: engine.queue_callback(lambda: (order.append("first"),
                                                               engine.queue_callback(lambda: order.append("last")))))
    out.sum().backward()
    assert order == ["first", "queued later in the backward", "last"]

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    order.clear()
    z = Boom.apply(x) * 2
    z.register_hook(lambda g: engine.queue_callback(lambda: order.append("ran")))
    with pytest.raises(RuntimeError, match="boom"):
        z.sum().backward()
    assert order == []
    (x * 2).sum().backward()
    assert order == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_any_nonfinite_finds_every_nan_and_infinity(dtype):
    """The check's reduction (the CPU's aminmax, not _foreach_norm) against isfinite, value by value: NaN, +inf and
    -inf at the head, inside the vectorised body and in the tail of contiguous tensors, in a transposed view and in
    a 0-d tensor, among finite tensors, some of them huge (no overflow to a false alarm)."""
    from commfuse_dp.nonfinite import _any_nonfinite

    gen = torch.Generator().manual_seed(0)
    finite = [torch.randn(1000, generator=gen).to(dtype), torch.tensor(2.5, dtype=dtype),
              torch.full((300,), torch.finfo(dtype).max, dtype=dtype), torch.empty(0, dtype=dtype)]
    assert not bool(_any_nonfinite(finite))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for shape, index in (((4099,), 0), ((4099,), 2050), ((4099,), 4098), ((64, 48), (47, 3)), ((), ())):
            t = torch.randn(shape, generator=gen).to(dtype)
            if len(shape) == 2:
                t = t.t()  # not contiguous
            t[index] = bad
            assert not bool(torch.isfinite(t).all())
            assert bool(_any_nonfinite([*finite[:2], t, *finite[2:]])), (bad, shape, index)


def _hsdp_worker(rank, world_size, schedule):
    """HSDP, 2 copies of 2 shards (ranks 0-1 and 2-3): the ranks of one copy agree (the copies hold the same
    shards), so a fault that reaches one shard position reaches it in both copies and every rank acts alike."""
    from commfuse_dp.nonfinite import _agreeing_ring

    models = []
    for nonfinite in ("raise", "off"):
        model = hf_models.build("llama")
        cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0, replicate=2, nonfinite_grads=nonfinite))
        models.append((model, torch.optim.AdamW(model.parameters(), lr=1e-2)))
    (model, opt), (ref, ref_opt) = models
    ring, one_copy = _agreeing_ring(model, handle_of(model).engine)
    assert one_copy and torch.distributed.get_process_group_ranks(ring.group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    for m, o in models:
        _step(m, o, rank, 0)
    errors = []
    try:
        _loss(model, rank, 1, poisoned_rank=1).backward()  # rank 1's batch: every shard of every copy
    except FloatingPointError as err:
        errors.append(str(err))
    opt.zero_grad(set_to_none=True)
    # the same shard position of both copies (ranks 1 and 3) gets an inf, as summed gradients would give it
    param = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]

    def poison(p):
        if p.grad is not None:
            p.grad.to_local().view(-1)[0] = float("inf")

    hook = param.register_post_accumulate_grad_hook(poison) if rank % 2 == 1 else None
    try:
        _loss(model, rank, 2).backward()
    except FloatingPointError as err:
        errors.append(str(err))
    if hook is not None:
        hook.remove()
    opt.zero_grad(set_to_none=True)
    for m, o in models:
        _step(m, o, rank, 3)
    _assert_same_params(model, ref, "after the clean step")
    return errors


@pytest.mark.parametrize("schedule", ["fused", "fsdp2"])
def test_hsdp_copies_agree_within_a_copy_and_act_alike(schedule):
    for rank, errors in enumerate(run_ranks(_hsdp_worker, 4, (schedule,), timeout=200)):
        assert len(errors) == 2, errors
        copy = [rank // 2 * 2, rank // 2 * 2 + 1]
        assert f"step 1: the gradients are non-finite (NaN or inf) on rank(s) {copy} of the 2 ranks of this " \
               f"model copy" in errors[0], errors[0]
        assert f"step 2: the gradients are non-finite (NaN or inf) on rank(s) [{copy[1]}] of the 2" in errors[1]
        assert ("on rank %d: model.layers.0.self_attn.q_proj.weight" % rank in errors[1]) == (rank % 2 == 1)
