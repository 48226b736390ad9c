"""0-d parameters (commfuse_dp/scalars.py): kept out of fully_shard, replicated, averaged; train like one process.

torch's fully_shard refuses them ("doesn't support scalar parameters"); accelerate's RegressionModel has two.
"""

import os

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

import commfuse_dp as cf
from harness import run_ranks

TOL = dict(rtol=1e-5, atol=1e-6)
PER_RANK = 4


class Temperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1.5))  # read by the parent: this module's forward never runs


class ScaledRegression(nn.Module):
    """y = a * head(tanh(proj(x))) + b / t, with a, b and t 0-d."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Parameter(torch.tensor(2.0))
        self.b = nn.Parameter(torch.tensor(0.5))
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.temperature = Temperature()

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x))).sum(-1) * self.a + self.b / self.temperature.t


def _data(step: int, micro: int, rank: int):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(PER_RANK, 16, generator=gen), torch.randn(PER_RANK, generator=gen)


def _train(model, steps: int, accum: int, world: int, rank: int | None, no_sync=None):
    """3 AdamW steps with clipping; ``rank`` None: one process on every rank's rows."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(steps):
        for micro in range(accum):
            ranks = range(world) if rank is None else [rank]
            x = torch.cat([_data(step, micro, r)[0] for r in ranks])
            y = torch.cat([_data(step, micro, r)[1] for r in ranks])
            loss = nn.functional.mse_loss(model(x), y) / accum
            if no_sync is not None and micro < accum - 1:
                with no_sync():
                    loss.backward()
            else:
                loss.backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        opt.step()
        opt.zero_grad()
    return losses, norms


def _full(model) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def _worker(rank, world_size, schedule, accum):
    import torch.distributed as dist

    reference = ScaledRegression()
    ref_losses, ref_norms = _train(reference, 3, accum, world_size, None)
    model = ScaledRegression()
    if rank != 0:
        with torch.no_grad():
            model.a.fill_(-7.0)  # rank 0's value must win, as DDP broadcasts it
    cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))
    assert isinstance(model.a, DTensor) and model.a.placements == (Replicate(),), type(model.a)
    assert float(model.a.to_local()) == 2.0
    assert type(model.proj).__name__ == "RingLinear"
    losses, norms = _train(model, 3, accum, world_size, rank, no_sync=model.no_sync)
    assert isinstance(model.a, DTensor), "outside a step a 0-d parameter reads as its DTensor"
    everyone = [None] * world_size
    dist.all_gather_object(everyone, losses)
    mean_losses = [sum(col) / world_size for col in zip(*everyone)]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(ref_losses), **TOL)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOL)
    full, expected = _full(model), dict(reference.named_parameters())
    assert set(full) == set(expected)
    for name, value in full.items():
        torch.testing.assert_close(value, expected[name].detach(), **TOL, msg=lambda m, n=name: f"{n}: {m}")
    for name in ("a", "b", "temperature.t"):  # the replicas stayed equal
        values = [None] * world_size
        dist.all_gather_object(values, float(full[name]))
        assert len(set(values)) == 1, (name, values)
    return True


@pytest.mark.parametrize("world_size,schedule,accum", [(2, "fused", 1), (2, "slicing", 2), (3, "fused", 2)])
def test_scalar_params_train_like_one_process(world_size, schedule, accum):
    run_ranks(_worker, world_size, (schedule, accum), timeout=240)


def _checkpoint_worker(rank, world_size, folder):
    from commfuse_dp import checkpoint as ck

    model = ScaledRegression()
    cf.shard(model)
    _train(model, 1, 1, world_size, rank)
    saved = _full(model)
    ck.save_sharded(os.path.join(folder, "ck"), [model])
    again = ScaledRegression()
    cf.shard(again)
    ck.load_sharded(os.path.join(folder, "ck"), [again])
    loaded = _full(again)
    for name in saved:
        torch.testing.assert_close(loaded[name], saved[name], rtol=0, atol=0)
    full = ck.full_state_dict(again)
    if rank == 0:
        assert full["a"].dim() == 0 and float(full["a"]) == float(saved["a"])
    return True


def test_scalar_params_checkpoint_round_trip(tmp_path):
    run_ranks(_checkpoint_worker, 2, (str(tmp_path),), timeout=180)
