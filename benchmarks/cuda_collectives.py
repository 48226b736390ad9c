"""``benchmarks/cuda_check.py --parts collectives``: NCCL's own all-gather and reduce-scatter (what FSDP2 runs as
shipped) against the library's rings (N-1 hops issued from Python, one send/recv pair per hop), on every GPU
of the machine, at the sizes of FSDP2 units; and what ``shard()``'s defaults measure of the link there
(``commfuse_dp/planner/measure.py``). The planner plays the fsdp2 schedule on both (``CommFuseConfig.fsdp2_collectives``);
this part is what it should be checked against.

Needs two GPUs or more (NCCL refuses two ranks on one device). ``--device cpu`` runs the same on 2 CPU processes
over gloo (a dry run: gloo's collectives against the rings).

    python benchmarks/cuda_check.py --parts collectives --out DIR
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

UNIT_MB = (4, 64, 436)  # whole tensors: a decoder layer's norms, a small layer, Llama-3-8B's layer in bf16
QUICK_MB = (1, 4)
ROUNDS = 5


def part_collectives(args) -> dict:
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    ranks = torch.cuda.device_count() if cuda else 2
    if ranks < 2:
        raise RuntimeError(f"the collectives part needs 2 GPUs or more (NCCL refuses two ranks on one device); this "
                           f"machine has {ranks}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "collectives.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(29600 + os.getpid() % 300), os.path.abspath(__file__), "cuda" if cuda else "cpu", out,
               "quick" if args.quick else "full"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"torchrun failed (rc {proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
        with open(out) as f:
            return json.load(f)


def _seconds(run, device: torch.device) -> float:
    """The median over ``ROUNDS`` of one call, after two untimed, each bracketed by synchronisations."""
    times = []
    for i in range(ROUNDS + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        began = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - began)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's
    return t.item()


def _worker(kind: str, out: str, sizes: str) -> None:
    from commfuse_dp.planner.measure import measure_machine
    from commfuse_dp.ring import ring_all_gather, ring_reduce_scatter

    local = int(os.environ["LOCAL_RANK"])
    if kind == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    n, dtype = dist.get_world_size(), torch.bfloat16 if kind == "cuda" else torch.float32
    rows = []
    for mb in (QUICK_MB if sizes == "quick" else UNIT_MB):
        numel = (mb << 20) // dtype.itemsize // n
        shard = torch.randn(numel, device=device).to(dtype)
        whole = torch.empty(n * numel, device=device, dtype=dtype)
        part = torch.empty(numel, device=device, dtype=dtype)
        bucket = 2 * mb + 1  # one bucket: the rings' hops whole, as FSDP2's unit goes
        row = {"whole_mb": mb, "ranks": n, "dtype": str(dtype)}
        row["torch_all_gather_s"] = _seconds(lambda: dist.all_gather_into_tensor(whole, shard), device)
        row["ring_all_gather_s"] = _seconds(lambda: ring_all_gather(whole, shard, bucket_mb=bucket), device)
        row["torch_reduce_scatter_s"] = _seconds(lambda: dist.reduce_scatter_tensor(part, whole), device)
        row["ring_reduce_scatter_s"] = _seconds(lambda: ring_reduce_scatter(part, whole, bucket_mb=bucket), device)
        moved = (n - 1) * numel * dtype.itemsize
        row.update({f"{k[:-2]}_gbps": moved / row[k] / 1e9 for k in list(row) if k.endswith("_s")})
        rows.append(row)
    link = measure_machine(dist.group.WORLD, device, dtype, None, 0, link=True, gemm=False).link
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows, "measured_link": {"gbps": link.bytes_per_s / 1e9,
                                                      "latency_us": link.latency_s * 1e6, "sizes": link.sizes}}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _worker(*sys.argv[1:4])
