"""Launch N ranks on this machine over loopback for a micro-benchmark; rank 0 puts its rows on a queue."""

from __future__ import annotations

import socket

import torch.multiprocessing as mp


def run_loopback(target, world_size: int, args, timeout: float = 1800.0):
    """Run ``target(rank, world_size, port, args, queue)`` on ``world_size`` spawned processes and return what
    rank 0 put on the queue, or ``None`` if a rank failed (its output is on this terminal)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=timeout)
    for p in procs:
        p.join()
    return None if any(p.exitcode for p in procs) else rows
