"""Host overhead of one ring step on gloo: the time this thread spends issuing a step and waiting for it when the
bytes have already arrived (the cost a fused layer pays per ring step on top of its compute).

    python benchmarks/step_overhead.py                    # 2 ranks over loopback, 4 KiB and 1 MiB shards

Per size, ``--steps`` ring steps run with a busy compute piece of ``--piece-ms`` between start and wait (long enough
for the bytes to land), and the table shows the median time inside ``start_step`` (issue) and inside ``wait``.
Their sum is the host overhead per ring step. It also times what a fused layer adds once per ring *operation*
(not per step) to name it: ``StepState.ring_op`` (the identity tag and the label for errors) against the plain
counter tag it replaced (``Ring.next_tag``). This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

try:
    from .loopback import run_loopback
except ImportError:  # run as a script: python benchmarks/step_overhead.py
    from loopback import run_loopback


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    from commfuse_dp.ring.topology import get_ring
    from commfuse_dp.ring.transport import start_step

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    ring = get_ring()
    rows = []
    for size in args.sizes:
        send, recv = torch.randn(size // 4), torch.empty(size // 4)
        issue, wait = [], []
        for i in range(args.steps + 20):
            dist.barrier() if i % 50 == 0 else None
            t0 = time.perf_counter()
            handle = start_step(ring, [send], [recv], tag=ring.next_tag(), op="probe", step=0, steps=1,
                                timeout_s=60)
            t1 = time.perf_counter()
            _busy(args.piece_ms / 1e3)
            t2 = time.perf_counter()
            handle.wait()
            t3 = time.perf_counter()
            if i >= 20:
                issue.append(t1 - t0)
                wait.append(t3 - t2)
        rows.append((size, statistics.median(issue), statistics.median(wait)))
    if rank == 0:
        queue.put((rows, _identity_cost(ring, world)))
    dist.barrier()
    dist.destroy_process_group()


def _identity_cost(ring, world: int, calls: int = 100_000) -> tuple[float, float]:
    """Seconds per call of ``StepState.ring_op`` and of ``Ring.next_tag``, best of 5 runs of ``calls``."""
    import timeit

    from torch.distributed.device_mesh import init_device_mesh

    from commfuse_dp import CommFuseConfig
    from commfuse_dp.engine import Engine
    from commfuse_dp.fused.step import StepState

    steps = StepState(Engine(ring, init_device_mesh("cpu", (world,)), CommFuseConfig()))
    owners = [steps.register(f"model.layers.{i}.mlp.down_proj") for i in range(256)]
    op = min(timeit.repeat(lambda: steps.ring_op(owners[7], "forward"), number=calls, repeat=5)) / calls
    tag = min(timeit.repeat(ring.next_tag, number=calls, repeat=5)) / calls
    return op, tag


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", default="4096,1048576", help="bytes per shard, comma-separated")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--piece-ms", type=float, default=2.0, help="busy compute between start and wait")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    result = run_loopback(_rank, args.world_size, args, timeout=600)
    if result is None:
        print("a rank failed; see its output above")
        return 1
    rows, (op_s, tag_s) = result
    print(f"host time per ring step, gloo over loopback, {args.world_size} ranks, median of {args.steps} steps, "
          f"{args.piece_ms:g} ms of compute between start and wait")
    print(f"{'shard':>10} {'issue us':>9} {'wait us':>8} {'total us':>9}")
    for size, issue, wait in rows:
        print(f"{size:>10} {issue * 1e6:>9.1f} {wait * 1e6:>8.1f} {(issue + wait) * 1e6:>9.1f}")
    print(f"per ring operation: identity tag and label (StepState.ring_op) {op_s * 1e6:.2f} us, plain counter tag "
          f"(Ring.next_tag) {tag_s * 1e6:.2f} us (best of 5 x 100000 calls)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
