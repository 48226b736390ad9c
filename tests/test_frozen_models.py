"""A second, frozen model sharded beside the trained one on the same group (a DPO reference): ``shard()`` on both,
a DPO-style loss whose reference runs under ``no_grad``, and the TR-DPO mix of the policy into the reference
(``ref.data.mul_(1 - a).add_(policy.data, alpha=a)``, as TRL's ``SyncRefModelCallback`` does), shard against
shard. Both models' hops share one ring; the losses must equal one process running the same arithmetic,
and each rank must hold 1/N of the reference."""

import pytest
import torch

from harness import run_ranks

STEPS, MIX_AT, ALPHA, LR = 3, 1, 0.5, 0.01


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _log_probs(model, ids):
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


def _mix(reference, policy):
    with torch.no_grad():
        for target, source in zip(reference.parameters(), policy.parameters(), strict=True):
            target.data.mul_(1.0 - ALPHA).add_(source.data, alpha=ALPHA)


def _batch(world_size):
    return torch.randint(0, 128, (2 * world_size, 16), generator=torch.Generator().manual_seed(1))


def _train(policy, reference, batches) -> list[float]:
    """One process, or one rank: ``batches`` are the micro-batches whose mean loss is the step's."""
    optimizer = torch.optim.SGD(policy.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = 0.0
        for ids in batches:
            with torch.no_grad():
                ref = _log_probs(reference, ids)
            loss = loss + -(_log_probs(policy, ids) - ref).sigmoid().log().mean() / len(batches)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        if step == MIX_AT:
            _mix(reference, policy)
    return losses


def _worker(rank, world_size, schedule):
    import torch.distributed as dist

    import commfuse_dp as cf

    ids = _batch(world_size)[2 * rank:2 * rank + 2]
    config = cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0)
    policy, reference = cf.shard(_model(), config), _model()
    reference.requires_grad_(False)
    reference = cf.shard(reference, config)
    losses = _train(policy, reference, [ids])
    for loss in losses:
        dist.all_reduce(loss)
    held = sum(p.to_local().numel() for p in reference.parameters())
    # the most one rank holds when every parameter is split by rows as torch.chunk splits them (Shard(0))
    most = sum(-(-p.shape[0] // world_size) * (p.numel() // p.shape[0]) for p in reference.parameters())
    return [float(loss) / world_size for loss in losses], held, sum(p.numel() for p in reference.parameters()), most


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.slow
def test_frozen_reference_beside_the_policy(world_size):
    ids = _batch(world_size)
    policy, reference = _model(), _model()
    reference.requires_grad_(False)
    expected = [float(loss) for loss in _train(policy, reference, list(ids.split(2)))]
    for schedule in ("fused", "slicing"):
        results = run_ranks(_worker, world_size, (schedule,), timeout=300)
        total, most = results[0][2], results[0][3]
        print(f"\n{world_size} ranks, {schedule}: losses {results[0][0]} (one process {expected}); the reference's "
              f"elements held per rank {[r[1] for r in results]} of {total}")
        for losses, held, _, _ in results:
            assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
            assert held <= most  # its 1/N share, rows split as torch.chunk splits them
        assert sum(r[1] for r in results) == total  # nothing held twice


def _accelerator_worker(rank, world_size):
    from commfuse_dp.integrations.accelerate import CommFuseAccelerator

    accelerator = CommFuseAccelerator(cpu=True, commfuse={"schedule": "fused", "min_fuse_numel": 0})
    ids = _batch(world_size)
    whole = _model()
    expected = _log_probs(whole, ids).detach()
    early = accelerator.prepare_model(_model().requires_grad_(False), evaluation_mode=True)  # nothing trained yet
    accelerator.prepare(_model())  # the model to train
    reference = _model().requires_grad_(False)
    reference = accelerator.prepare_model(reference, evaluation_mode=True)
    with torch.no_grad():
        got = _log_probs(reference, ids)
    with torch.inference_mode():
        again = _log_probs(reference, ids)
        again = _log_probs(reference, ids)
    sharded = [type(p).__name__ == "DTensor" for p in reference.parameters()]
    return (torch.allclose(got, expected, rtol=1e-5, atol=1e-5), torch.equal(got, again), all(sharded),
            sum(p.to_local().numel() for p in reference.parameters()),
            not any(type(p).__name__ == "DTensor" for p in early.parameters()))


def test_commfuse_accelerator_shards_a_model_prepared_for_evaluation():
    """``CommFuseAccelerator.prepare_model(m, evaluation_mode=True)`` (how TRL prepares a reference) shards ``m``
    like the trained model once one was prepared (before, it stays whole, as for a script that only evaluates):
    each rank holds its share, and its forwards under ``no_grad`` and then
    ``inference_mode`` equal one process. (A forward under ``no_grad`` after one under ``inference_mode`` fails in
    FSDP2's all-gather of the unfused parameters: its buffers were made inference tensors.)"""
    results = run_ranks(_accelerator_worker, 2, timeout=300)
    total = sum(p.numel() for p in _model().parameters())
    assert [r[:3] + r[4:] for r in results] == [(True, True, True, True)] * 2, results
    assert sum(r[3] for r in results) == total


def test_a_trainers_accelerator_shards_frozen_models_and_still_pickles():
    """``shard_frozen_models`` makes a Trainer's plain ``Accelerator`` a ``FrozenModels`` one (a subclass made once
    per class and named in the module, so that it pickles); ``None`` leaves a plain one as it is."""
    import pickle

    from accelerate import Accelerator

    import commfuse_dp as cf
    from commfuse_dp.integrations.accelerate import FrozenModels, shard_frozen_models

    accelerator = Accelerator(cpu=True)
    shard_frozen_models(accelerator, None)
    assert type(accelerator) is Accelerator
    shard_frozen_models(accelerator, cf.CommFuseConfig())
    assert isinstance(accelerator, FrozenModels) and isinstance(accelerator, Accelerator)
    assert type(pickle.loads(pickle.dumps(accelerator))) is type(accelerator)
    shard_frozen_models(accelerator, None)
    assert accelerator.commfuse_frozen is None
