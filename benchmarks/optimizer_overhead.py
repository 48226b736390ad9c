"""What the optimizer step costs over DTensor parameters (what ``shard()`` and FSDP2 leave the optimizer) against
the same local shards as plain tensors, on this CPU, per world size: one process, rank 0 of W on torch's ``fake``
process group (nothing moves), the bench's default model sharded by ``shard()``, random gradients, AdamW over each set
(torch's default ``foreach`` path, and its one-kernel ``fused=True``), the two sets stepping in turn. This is a measurement, not a test.

    python benchmarks/optimizer_overhead.py --worlds 2,8

The bench's ``opt s`` column (the optimizer and ``zero_grad`` on the slowest rank) is this on cores that 4-8 ranks
share: compare a schedule's with compute alone's, whose optimizer works on plain views.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script (python benchmarks/optimizer_overhead.py): the checkout's root, for benchmarks.*
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def measure(world: int, steps: int, impl: str = "foreach") -> tuple[int, float, float]:
    """(parameters, median ms of AdamW over the DTensor parameters, over plain clones of their local shards).
    ``impl``: the bench's name for AdamW's implementation (``worker.OPTIMIZERS``: foreach, fused)."""
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM

    import commfuse_dp as cf
    from benchmarks import bench_model, worker
    from benchmarks.step_overhead import fake_rank0

    fake_rank0(world)
    try:
        shape = bench_model.default_shape()
        torch.manual_seed(0)
        model = cf.shard(LlamaForCausalLM(bench_model.model_config(shape)),
                         cf.CommFuseConfig(min_fuse_numel=shape.min_fuse_numel, ring_embeddings=False))
        params = list(model.parameters())
        plain = [_local(p).detach().clone().requires_grad_() for p in params]
        for p, q in zip(params, plain):
            grad = torch.randn_like(_local(p))
            q.grad = grad.clone()
            p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride()) if isinstance(p, DTensor) else grad
        kwargs = worker.OPTIMIZERS[impl]
        opts = [torch.optim.AdamW(params, lr=1e-4, **kwargs), torch.optim.AdamW(plain, lr=1e-4, **kwargs)]
        times: list[list[float]] = [[], []]
        for i in range(steps + 3):
            for opt, out in zip(opts, times):
                began = time.perf_counter()
                opt.step()
                if i >= 3:  # warm-up first
                    out.append(time.perf_counter() - began)
        return len(params), statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,8", help="comma-separated world sizes (default 2,8)")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per set (default 20)")
    parser.add_argument("--impls", default="foreach,fused",
                        help="AdamW implementations, comma-separated: foreach (torch's default), fused (fused=True, "
                             "the Trainer's adamw_torch_fused); default both")
    args = parser.parse_args(argv)
    from benchmarks.worker import OPTIMIZERS

    unknown = sorted(set(args.impls.split(",")) - set(OPTIMIZERS))
    if unknown:
        parser.error(f"--impls: unknown implementation(s) {unknown}; choose from {', '.join(OPTIMIZERS)}")
    torch.set_num_threads(1)
    for world in (int(w) for w in args.worlds.split(",")):
        for impl in args.impls.split(","):
            count, dtensor_ms, plain_ms = measure(world, args.steps, impl)
            print(f"world {world}: AdamW ({impl}) over {count} DTensor parameters {dtensor_ms:.1f} ms, over their "
                  f"local shards as plain tensors {plain_ms:.1f} ms (+{dtensor_ms - plain_ms:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
