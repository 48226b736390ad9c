"""The ring-fused linear alone against torch.nn.functional.linear + autograd, on real gloo groups."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from commfuse_dp import CommFuseConfig
from commfuse_dp.runtime.engine import Engine
from commfuse_dp.fused import attach_group, convert_linear, step_state
from commfuse_dp.ring import get_ring
from harness import run_ranks

# (out_features per member, in_features, bias): padding (7 rows over 2..4 ranks), ranks without rows (3 over 4),
# a lone row, and a q/k/v-like group of unequal widths.
CASES = [((7,), 5, True), ((16,), 8, False), ((3,), 4, True), ((1,), 3, False), ((12, 6, 6), 10, True)]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _data(rank, members, in_features, dtype, tokens=6):
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(2, tokens // 2, in_features, generator=gen).to(dtype)
    grads = [torch.randn(2, tokens // 2, out, generator=gen).to(dtype) for out in members]
    return x, grads


def _worker(rank, world_size, transposed):
    from transformers.pytorch_utils import Conv1D

    mesh = init_device_mesh("cpu", (world_size,))
    engine = Engine(get_ring(), mesh, CommFuseConfig(schedule="fused"))
    steps = step_state(engine)
    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        for members, in_features, bias in CASES:
            torch.manual_seed(0)
            if transposed:
                refs = [Conv1D(out, in_features).to(dtype) for out in members]
                for r in refs:
                    r.bias.data.normal_()
            else:
                refs = [nn.Linear(in_features, out, bias=bias, dtype=dtype) for out in members]
            mods = [type(r)(*((r.nf, r.weight.shape[0]) if transposed else (in_features, r.out_features)),
                            **({} if transposed else {"bias": bias, "dtype": dtype})).to(dtype) for r in refs]
            for m, r in zip(mods, refs):
                m.load_state_dict(r.state_dict())
                convert_linear(m, engine, transposed)
            attach_group(steps, mods, [f"member{i}" for i in range(len(mods))])

            x, grads = _data(rank, members, in_features, dtype)
            x.requires_grad_(True)
            outs = [m(x) for m in mods]
            sum(((o * g).sum() for o, g in zip(outs, grads)), torch.zeros((), dtype=dtype)).backward()

            # Reference: unsharded F.linear on every rank's data; the weight gradient is the mean over ranks.
            for src in range(world_size):
                xs, gs = _data(src, members, in_features, dtype)
                xs.requires_grad_(True)
                ys = [r(xs) for r in refs]
                sum(((y * g).sum() for y, g in zip(ys, gs)), torch.zeros((), dtype=dtype)).backward()
                if src == rank:
                    for o, y in zip(outs, ys):
                        torch.testing.assert_close(o, y, **TOLERANCE[dtype])
                    torch.testing.assert_close(x.grad, xs.grad, **TOLERANCE[dtype])
            for m, r in zip(mods, refs):
                for name in ("weight", "bias"):
                    p = getattr(m, name)
                    if p is None:
                        continue
                    expected = getattr(r, name).grad / world_size
                    torch.testing.assert_close(p.grad.full_tensor(), expected, **TOLERANCE[dtype],
                                               msg=lambda s: f"{members} {name} {dtype}: {s}")
                    assert p.grad.to_local().shape == p.to_local().shape
            checked += 1
    return checked


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fused_linear_matches_f_linear(world_size):
    assert run_ranks(_worker, world_size, (False,)) == [2 * len(CASES)] * world_size


@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_conv1d_matches(world_size):
    assert run_ranks(_worker, world_size, (True,)) == [2 * len(CASES)] * world_size
