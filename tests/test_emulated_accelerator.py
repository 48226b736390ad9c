"""The bench's emulated accelerator (benchmarks/emulated.py): GEMMs and attention wait their FLOPs and return zeros.

Checked here: what it counts and returns (functional, ``out=`` and in-place GEMMs, attention), that the waits add
up to at least FLOPs / rate, and that a sharded model (fused linears writing into ``out=`` views, the ring
embedding, FSDP2 units) runs a full step under it at 2 ranks with finite gradients. How fast schedules are under
it is for ``commfuse-dp bench --compute emulated``, not for a test.
"""

import math
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

import commfuse_dp as cf
from benchmarks.emulated import EmulatedAccelerator
from harness import run_ranks


def test_gemms_cost_their_flops_and_return_zeros():
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    y = torch.full((64, 96), float("nan"))
    acc = torch.ones(64, 48)
    with EmulatedAccelerator(1e-3) as mode:  # 1 GFLOP/s: 4 GEMMs of 196,608 FLOPs each take >= 0.79 ms
        began = time.perf_counter()
        z = a @ b
        torch.mm(a, b, out=y[:, :48])  # the fused linear's pieces write into views of the output
        torch.addmm(torch.ones(48), a, b, out=y[:, 48:])
        same = acc.addmm_(a, b)  # the fused backward's dx.addmm_(dy, w): self plus a zero product
        elapsed = time.perf_counter() - began
    assert z.shape == (64, 48) and not z.any()
    assert not y.isnan().any() and not y.any()
    assert same is acc and torch.equal(acc, torch.ones(64, 48))
    assert mode.pieces == 4 and mode.flops == 4 * 2 * 64 * 32 * 48
    assert elapsed >= mode.flops / 1e9 * 0.999
    assert torch.equal(a @ b, torch.mm(a, b))  # outside the mode: real compute again


def test_counts_what_torch_counts():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(8, 32, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        mlp(x).sum().backward()
    with EmulatedAccelerator(1.0) as mode:
        mlp(x).sum().backward()
    assert mode.flops == counter.get_total_flops() > 0
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    with EmulatedAccelerator(1.0) as mode:  # the CPU attention kernel, forward and backward
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.sum().backward()
    assert mode.pieces == 2 and mode.flops > 0 and not out.any()


def _sharded_step_worker(rank, world_size):
    import hf_models

    vocab = hf_models.VOCAB
    for schedule in ("fused", "slicing"):
        model = cf.shard(hf_models.build("llama", tie_word_embeddings=True),
                         cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))
        with EmulatedAccelerator(0.05) as mode:
            loss = model(**hf_models.batch(rank, 0)).loss
            loss.backward()
        assert math.isclose(loss.item(), math.log(vocab), rel_tol=1e-5), loss.item()  # zero logits: uniform
        assert mode.pieces > 0
        for name, p in model.named_parameters():
            if p.grad is not None:
                assert torch.isfinite(p.grad.to_local()).all(), name
    return True


def test_sharded_model_runs_a_step_under_it():
    run_ranks(_sharded_step_worker, 2, timeout=180)


def test_host_ahead_returns_at_once_and_synchronize_waits():
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    with EmulatedAccelerator(1e-5, host_ahead=True) as mode:  # 10 MFLOP/s: one GEMM of 196,608 FLOPs is 19.7 ms
        began = time.perf_counter()
        for _ in range(5):
            a @ b
        issued = time.perf_counter() - began
        mode.synchronize()
        done = time.perf_counter() - began
    assert done >= mode.flops / 1e7 * 0.999  # the device's queue: five GEMMs, 98 ms
    assert issued < done / 2, (issued, done)  # the host went on without waiting for them


def _gate_worker(rank, world_size):
    from commfuse_dp.ring import ring_all_gather
    from commfuse_dp.ring.topology import set_device_clock

    out, shard = torch.empty(world_size * 4), torch.full((4,), float(rank))
    ring_all_gather(out, shard)  # the ring thread and gloo's pairs exist before timing
    try:
        t0 = time.perf_counter()
        set_device_clock(lambda: t0 + 0.3)
        ring_all_gather(out, shard, async_op=True).wait()  # on the ring thread, gated
        async_after = time.perf_counter() - t0
        t1 = time.perf_counter()
        set_device_clock(lambda: t1 + 0.3)
        ring_all_gather(out, shard)  # on this thread, gated
        sync_after = time.perf_counter() - t1
    finally:
        set_device_clock(None)
    return async_after, sync_after, out.tolist()


def test_ring_work_waits_for_the_emulated_device():
    # Ring work requested while the emulated device still computes starts when that compute ends, as a CUDA
    # communication stream waits for the compute stream's event.
    for async_after, sync_after, gathered in run_ranks(_gate_worker, 2, timeout=120):
        assert async_after >= 0.3 and sync_after >= 0.3, (async_after, sync_after)
        assert gathered == [0.0] * 4 + [1.0] * 4
