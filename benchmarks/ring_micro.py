"""Micro-benchmark: ring all-gather / reduce-scatter against torch's native collectives, over loopback.

    python benchmarks/ring_micro.py                      # 2 ranks, 4 KiB .. 64 MiB per rank, gloo
    python benchmarks/ring_micro.py --num-processes 3 --sizes 4K,1M,16M --repeats 9 --json out.json

Each size is the shard one rank holds (all-gather input, reduce-scatter output), fp32. For every size the ring and
the native collective alternate (native, ring, native, ring, ...) so that both see the same machine state; the
table shows the median over ``--repeats`` timed calls after ``--warmup`` untimed ones, and the bus bandwidth
(N-1)/N x gathered bytes / time. This is a transport benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from commfuse_dp.cli_names import spelled

try:
    from .loopback import run_loopback
except ImportError:  # run as a script: python benchmarks/ring_micro.py
    from loopback import run_loopback

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        return int(float(text[:-1]) * _UNITS[text[-1]]) if text[-1] in _UNITS else int(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"bad size {text!r}: write bytes like 4096, 4K, 16M") from None


def human(nbytes: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        scale = _UNITS[unit[0]]
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _timed(fn, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace, queue) -> None:
    from commfuse_dp.ring import ring_all_gather, ring_reduce_scatter

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    rows = []
    for size in args.sizes:
        n = max(1, size // 4)
        shard, gathered = torch.randn(n), torch.empty(world_size * n)
        full, out = torch.randn(world_size * n), torch.empty(n)
        repeats = args.repeats if size <= (16 << 20) else max(3, args.repeats // 2)
        calls = {
            ("all_gather", "native"): lambda: dist.all_gather_into_tensor(gathered, shard),
            ("all_gather", "ring"): lambda: ring_all_gather(gathered, shard, bucket_mb=args.bucket_mb),
            ("reduce_scatter", "native"): lambda: dist.reduce_scatter_tensor(out, full),
            ("reduce_scatter", "ring"): lambda: ring_reduce_scatter(out, full, bucket_mb=args.bucket_mb),
        }
        samples: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
        for key, fn in calls.items():
            _timed(fn, args.warmup, 0)
        for _ in range(repeats):  # interleaved, one call of each per round
            for key, fn in calls.items():
                samples[key] += _timed(fn, 0, 1)
        for (op, impl), times in samples.items():
            median = statistics.median(times)
            bus = (world_size - 1) / world_size * world_size * n * 4 / median
            rows.append({"op": op, "impl": impl, "bytes_per_rank": n * 4, "median_s": median, "bus_gbps": bus / 1e9})
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--num-processes", dest="world_size", metavar="N", type=int, default=2, help="ranks on this machine (default 2)")
    parser.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M",
                        help="comma-separated bytes per rank (default 4K..64M)")
    parser.add_argument("--repeats", type=int, default=11, help="timed calls per size and implementation")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="ring bucket size in MiB (default 25)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(spelled(sys.argv[1:] if argv is None else list(argv), parser, "ring_micro"))
    if args.world_size < 2:
        parser.error("--num-processes must be at least 2 (a ring of one rank sends nothing)")
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]

    rows = run_loopback(_rank, args.world_size, args)
    if rows is None:
        print("a rank failed; see its output above", file=sys.stderr)
        return 1

    print(f"ring vs native, gloo over loopback, {args.world_size} ranks, fp32, median of {args.repeats} "
          f"(bus bandwidth = (N-1)/N x gathered bytes / time)")
    print(f"{'size/rank':>10} | {'all-gather native':>18} {'ring':>18} {'ring/native':>11} | "
          f"{'reduce-scatter native':>21} {'ring':>18} {'ring/native':>11}")
    by_key = {(r["op"], r["impl"], r["bytes_per_rank"]): r for r in rows}
    for size in sorted({r["bytes_per_rank"] for r in rows}):
        cells = []
        for op in ("all_gather", "reduce_scatter"):
            nat, ring = by_key[(op, "native", size)], by_key[(op, "ring", size)]
            cells.append(f"{_fmt(nat):>{21 if op == 'reduce_scatter' else 18}} {_fmt(ring):>18} "
                         f"{ring['median_s'] / nat['median_s']:>10.2f}x")
        print(f"{human(size):>10} | {cells[0]} | {cells[1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": args.world_size, "rows": rows}, f, indent=1)
    return 0


def _fmt(row: dict) -> str:
    t = row["median_s"]
    text = f"{t * 1e6:.0f} us" if t < 1e-2 else f"{t * 1e3:.1f} ms"
    return f"{text} {row['bus_gbps']:.2f}GB/s"


if __name__ == "__main__":
    raise SystemExit(main())
