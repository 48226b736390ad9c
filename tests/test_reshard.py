"""Training goes on after a reshard: a sharded checkpoint saved at one world size and loaded at another continues
the same run. Real 2-, 3- and 4-rank gloo groups (tests/harness.py), a Llama-style decoder with tied embeddings
sharded with ``min_fuse_numel=0`` -- fused linear groups (q/k/v, o, gate/up, down, lm_head), the ring embedding
(its table is the lm_head weight: tied), and FSDP2 units (the RMSNorm weights of each layer and the root) --
and AdamW.

Every run trains on the same global batch of 12 sequences per step, split evenly over its ranks (12 divides by 2, 3
and 4), so every world size computes the same global mean loss and the same mean gradient, up to fp32 rounding.
A run at W1 trains ``N_STEPS`` steps and saves (model + AdamW + the step number) after step ``SAVE_AT``; a fresh
run at W2 loads that folder and trains steps ``SAVE_AT+1 .. N_STEPS``. Its losses are compared with the
uninterrupted runs at W1 and at W2.

Tolerance: the world sizes differ in how the loss and the gradients are summed (ring order over 2, 3 or 4 ranks,
local means over 6, 4 or 3 sequences), so the same step gives losses a few fp32 ulps apart (observed here: at most
2.3e-7 relative over the two resumed steps, one or two ulps; 0 for some pairs). ``rtol=1e-5`` leaves well over an
order of magnitude for other thread counts and hardware and stays far below the loss's step-to-step change, which
the test checks is above 100 x rtol.
"""

import pytest
import torch
import torch.distributed as dist

import commfuse_dp as cf
import harness
import hf_models
from commfuse_dp import checkpoint as ck
from harness import run_ranks

# Nine launches of up to 4 ranks: have the fork server import transformers' Llama and commfuse_dp once, so a
# rank does not spend seconds importing them on a shared 2-core machine (no effect if an earlier test module of
# this pytest run already started the fork server).
harness._context().set_forkserver_preload(["torch", "torch.distributed", "harness", "hf_models", "commfuse_dp",
                                           "transformers.models.llama.modeling_llama"])

GLOBAL_BATCH = 12
N_STEPS = 4
SAVE_AT = 2
RTOL = 1e-5


def _model(layout: str):
    """``layout``: a schedule, or ``"<schedule>/r<R>"`` for HSDP with R copies of the model (the ranks split into
    R groups of consecutive ranks, as nodes hold them)."""
    schedule, _, copies = layout.partition("/r")
    model = hf_models.build("llama", seed=0, tie_word_embeddings=True)
    cf.shard(model, cf.CommFuseConfig(min_fuse_numel=0, schedule=schedule, replicate=int(copies or 1)))
    return model


def _global_batch(step: int) -> dict:
    # Learnable sequences (a random start, then a stride of 1..3), so the loss falls quickly: a random start
    # each row, so the twelve rows differ.
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, hf_models.VOCAB, (GLOBAL_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=gen)
    ids = (start + stride * torch.arange(hf_models.SEQ)) % hf_models.VOCAB
    return {"input_ids": ids, "labels": ids.clone()}


def _local_batch(step: int, rank: int, world_size: int) -> dict:
    per_rank = GLOBAL_BATCH // world_size
    return {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in _global_batch(step).items()}


def _train_worker(rank, world_size, schedule, save_path, load_path):
    """Trains up to N_STEPS, from step 0 or from ``load_path``; saves after SAVE_AT when ``save_path`` is given.
    Returns {step: global mean loss} and what the model looks like (on rank 0)."""
    torch.set_num_threads(1)
    model = _model(schedule)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = 1
    if load_path is not None:
        extra = {"step": -1}
        ck.load_sharded(load_path, [model], [(model, opt)], extra=extra)
        first = int(extra["step"]) + 1
    losses = {}
    for step in range(first, N_STEPS + 1):
        loss = model(**_local_batch(step, rank, world_size)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)          # equal sequence lengths: the global mean is the mean of the local means
        losses[step] = (total / world_size).item()
        if step == SAVE_AT and save_path is not None:
            ck.save_sharded(save_path, [model], [(model, opt)], extra={"step": step})
    report = cf.describe(model)
    shape = {"fused_groups": len(report.fused_groups), "embeddings": [e.module for e in report.ring_embeddings],
             "units": len(report.fsdp_units), "tied": model.lm_head.weight is model.model.embed_tokens.weight}
    return (losses, shape, first) if rank == 0 else None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(schedule, world size) -> (losses, folder saved after step SAVE_AT)."""
    tmp = tmp_path_factory.mktemp("reshard")
    runs = {}
    for schedule, world in [("fused", 2), ("fused", 3), ("fused", 4), ("slicing", 4), ("fused/r2", 4)]:
        path = str(tmp / f"{schedule}-{world}")
        losses, shape, first = run_ranks(_train_worker, world, (schedule, path, None), timeout=240)[0]
        assert first == 1 and sorted(losses) == list(range(1, N_STEPS + 1))
        runs[schedule, world] = (losses, path, shape)
    return runs


@pytest.mark.slow
def test_every_kind_of_sharded_parameter_is_covered(uninterrupted):
    for losses, _, shape in uninterrupted.values():
        assert shape["tied"], "the lm_head must share the embedding table"
        assert shape["fused_groups"] >= 8 and shape["units"] >= 2
        assert shape["embeddings"] == ["model.embed_tokens"]


def test_world_sizes_agree_before_any_reshard(uninterrupted):
    """The premise: the same global batch gives the same losses at 2, 3 and 4 ranks (up to fp32 rounding), and the
    model trains (the loss moves by far more than the tolerance)."""
    base = uninterrupted["fused", 2][0]
    steps = range(1, N_STEPS + 1)
    for key, (losses, _, _) in uninterrupted.items():
        torch.testing.assert_close(torch.tensor([losses[s] for s in steps]), torch.tensor([base[s] for s in steps]),
                                   rtol=RTOL, atol=0, msg=f"{key} against fused at 2 ranks")
    moves = [abs(base[s + 1] - base[s]) / abs(base[s]) for s in range(1, N_STEPS)]
    assert min(moves) > 100 * RTOL, moves


@pytest.mark.parametrize("schedule, saved_at, loaded_at", [
    ("fused", 4, 2), ("fused", 4, 3), ("fused", 2, 4), ("fused", 3, 2), ("slicing", 4, 2)])
@pytest.mark.slow
def test_losses_continue_after_reshard(uninterrupted, schedule, saved_at, loaded_at):
    before, path, _ = uninterrupted[schedule, saved_at]
    resumed, _, first = run_ranks(_train_worker, loaded_at, (schedule, None, path), timeout=240)[0]
    assert first == SAVE_AT + 1, "the step number saved in `extra` should come back"
    steps = list(range(SAVE_AT + 1, N_STEPS + 1))
    assert sorted(resumed) == steps
    got = torch.tensor([resumed[s] for s in steps])
    references = [before]
    if (schedule, loaded_at) in uninterrupted:
        references.append(uninterrupted[schedule, loaded_at][0])
    for ref in references:
        expected = torch.tensor([ref[s] for s in steps])
        print(f"{schedule} {saved_at}->{loaded_at}: max relative difference "
              f"{((got - expected).abs() / expected.abs()).max().item():.3g}")
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=0)


@pytest.mark.parametrize("loaded_as", ["fused", "fused/r4"], ids=["1x4", "4x1"])
@pytest.mark.slow
def test_hsdp_checkpoint_resumes_as_one_copy_and_as_four(uninterrupted, loaded_as):
    """Saved by HSDP at 2 copies x 2 shards (two nodes of two ranks), resumed on the same four ranks as one flat
    sharding (one node of four) and as four copies of one shard each (four nodes of one): the same losses as the
    uninterrupted 2 x 2 run and the uninterrupted flat one."""
    before, path, _ = uninterrupted["fused/r2", 4]
    resumed, _, first = run_ranks(_train_worker, 4, (loaded_as, None, path), timeout=240)[0]
    assert first == SAVE_AT + 1
    steps = list(range(SAVE_AT + 1, N_STEPS + 1))
    got = torch.tensor([resumed[s] for s in steps])
    for ref in (before, uninterrupted["fused", 4][0]):
        torch.testing.assert_close(got, torch.tensor([ref[s] for s in steps]), rtol=RTOL, atol=0)
