"""Fused sequence-parallel TP against DTensor's, on the emulated cluster.

    sudo python -m benchmarks.tp_bench --tp 2,4 --rounds 3 --json benchmarks/results/tp-emulated.json

For each TP size N: N ranks (with ``--dp D``, D x N: TP beside data parallelism), each in its own network namespace with its own ``tc``-shaped link
(``benchmarks/cluster.py``), GEMMs and attention on the emulated accelerator (``benchmarks/emulated.py``, the host
waiting for each). The link's "balanced" rate is the one at which a step's TP traffic takes as long as a rank's
compute alone: the traffic a rank sends in a step (8 ring operations a decoder layer and 4 for the embedding and
lm_head, each (N-1) shards of B x ceil(S/N) x H fp32 activations; DTensor's schedule moves the same) over the
compute_only step measured first at that N. Then at 1/2x, 1x and 2x that rate, ``benchmarks/tp_worker.py`` runs
fused, dtensor, hf_tp (transformers' own TP plan), unfused (DTensor's schedule on this library's rings),
compute_only and comm_only interleaved, ``--rounds`` rounds of ``--steps`` timed steps each.

Printed and written per rate: each variant's median step with its spread (min-max of the per-round medians),
DTensor's, transformers' and unfused's steps over fused's paired by round (median and spread), fused against the limit max(compute_only,
comm_only), the exposed TP communication of each schedule (its step less compute_only), and each variant's
saved activations per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.bench import worker_env
from benchmarks.probes import MMAP_ENV
from benchmarks.cluster import EmulatedCluster

MODEL_FLAGS = ("hidden", "heads", "inner", "layers", "vocab", "seq", "batch")


def run(cluster: EmulatedCluster, rate_mbit: float, variants: str, args, rounds: int, memory: bool = False) -> dict:
    """One worker run at ``rate_mbit``: rank 0's JSON (``memory``: each variant's peak step bytes instead)."""
    cluster.set_rate(rate_mbit)
    with tempfile.TemporaryDirectory(prefix="commfuse-tp-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        port = 29700 + int(time.time() * 10) % 200
        argv = [sys.executable, "-m", "benchmarks.tp_worker", "--world-size", str(cluster.world_size),
                "--master", f"{cluster.address(0)}:{port}", "--variants", variants, "--rounds", str(rounds),
                "--steps", str(args.steps), "--warmup", "1", "--tflops", str(args.tflops), "--out", out,
                "--dp", str(args.dp),
                *[x for flag in MODEL_FLAGS for x in (f"--{flag}", str(getattr(args, flag)))],
                *(["--memory"] if memory else [])]
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(cluster.world_size)]
        env = {**worker_env(), **(MMAP_ENV if memory else {})}
        procs = [cluster.popen(r, [*argv, "--rank", str(r)], env=env, stdout=logs[r],
                               stderr=subprocess.STDOUT) for r in range(cluster.world_size)]
        for p in procs:
            try:
                p.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                p.kill()
        if not os.path.exists(out):
            tails = []
            for r, log in enumerate(logs):
                log.seek(0)
                tails.append(f"--- rank {r}:\n{log.read()[-3000:]}")
            raise RuntimeError(f"tp bench at {rate_mbit:g} Mbit/s gave no result:\n" + "\n".join(tails))
        with open(out) as f:
            return json.load(f)


def traffic_bytes(args, world: int) -> int:
    """What one rank sends in a step over the TP group's rings (module docstring)."""
    rows = -(-args.seq // world)
    return (8 * args.layers + 4) * (world - 1) * args.batch * rows * args.hidden * 4


def round_medians(times: list[float], steps: int) -> list[float]:
    return [statistics.median(times[i:i + steps]) for i in range(0, len(times), steps)]


def summarize(result: dict, steps: int) -> dict:
    per_round = {name: round_medians(t, steps) for name, t in result["times"].items()}
    out = {name: {"median_s": statistics.median(r), "spread_s": [min(r), max(r)]} for name, r in per_round.items()}
    paired = {f"{name}_over_fused": _spread([d / f for d, f in zip(per_round[name], per_round["fused"])])
              for name in ("dtensor", "hf_tp", "unfused") if name in per_round}
    limit = [max(c, m) for c, m in zip(per_round["compute_only"], per_round["comm_only"])]
    over = [f / lim for f, lim in zip(per_round["fused"], limit)]
    compute = out["compute_only"]["median_s"]
    return {"variants": out, "per_round_s": per_round,
            **paired, "fused_over_limit": _spread(over),
            "exposed_s": {name: out[name]["median_s"] - compute for name in ("fused", "dtensor", "hf_tp", "unfused")
                          if name in out},
            "saved_bytes": result["saved_bytes"], "flops_per_step": result["flops_per_step"]}


def _line(summary: dict) -> str:
    v = summary["variants"]
    parts = [f"{n} {v[n]['median_s']:.3f} [{v[n]['spread_s'][0]:.3f}-{v[n]['spread_s'][1]:.3f}]" for n in v]
    for key in ("dtensor_over_fused", "hf_tp_over_fused", "unfused_over_fused"):
        if key in summary:
            r = summary[key]
            parts.append(f"{key.replace('_over_', '/')} {r['median']:.2f}x [{r['spread'][0]:.2f}-{r['spread'][1]:.2f}]")
    parts.append(f"fused/limit {summary['fused_over_limit']['median']:.2f}")
    parts.append("exposed " + ", ".join(f"{n} {s:.3f} s" for n, s in summary["exposed_s"].items()))
    return "; ".join(parts)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "spread": [min(values), max(values)]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tp_bench", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", default="2,4", help="TP sizes, comma-separated (default 2,4)")
    parser.add_argument("--fractions", default="0.5,1,2", help="link rates as fractions of the balanced rate")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    parser.add_argument("--tflops", type=float, default=0.02, help="TFLOP/s of an emulated rank")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--variants", default="fused,dtensor,hf_tp,unfused,compute_only,comm_only")
    parser.add_argument("--memory", action="store_true",
                        help="also each variant's peak memory a step at the balanced rate, in a run of its own "
                             "(large allocations mapped: probes.MMAP_ENV)")
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel ranks beside TP: D x N ranks, fused through shard(tp_size=N) against "
                             "DTensor's TP with FSDP2 units (variants fused, dtensor, compute_only, comm_only)")
    for flag, default in (("hidden", 512), ("heads", 8), ("inner", 1408), ("layers", 2), ("vocab", 4096),
                          ("seq", 512), ("batch", 1)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("the emulated cluster needs root (network namespaces and tc)")
    began = time.time()
    runs = []
    for world in [int(x) for x in args.tp.split(",")]:
        with EmulatedCluster(world_size=world * args.dp, rate_mbit=10000) as cluster:
            calib = run(cluster, 10000, "compute_only", args, 1)
            compute = statistics.median(calib["times"]["compute_only"])
            balanced = traffic_bytes(args, world) * 8 / compute / 1e6
            print(f"TP {world}: compute alone {compute:.3f} s, {traffic_bytes(args, world) / 1e6:.1f} MB a rank a "
                  f"step: balanced link {balanced:.0f} Mbit/s", flush=True)
            for fraction in [float(x) for x in args.fractions.split(",")]:
                rate = balanced * fraction
                summary = summarize(run(cluster, rate, args.variants, args, args.rounds),
                                    args.steps)
                if args.memory and fraction == 1:
                    peaks = run(cluster, rate, args.variants, args, args.rounds, True)["peak_step_bytes"]
                    summary["peak_step_bytes"] = {name: _spread(p) for name, p in peaks.items()}
                    print("  peak MB a step: " + ", ".join(f"{name} {statistics.median(p) / 1e6:.1f}"
                                                          for name, p in peaks.items()), flush=True)
                runs.append({"tp": world, "dp": args.dp, "fraction": fraction, "rate_mbit": rate, "balanced_mbit": balanced,
                             **summary})
                print(f"  {fraction:g}x ({rate:.0f} Mbit/s): {_line(summary)}", flush=True)
    if args.json:
        import torch

        record = {"command": "python -m benchmarks.tp_bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
                  "where": "emulated cluster (one namespace per rank, tc tbf links; emulated GEMMs, host synced)",
                  "versions": {"torch": torch.__version__, "python": platform.python_version()},
                  "model": {flag: getattr(args, flag) for flag in MODEL_FLAGS}, "tflops": args.tflops,
                  "rounds": args.rounds, "steps": args.steps, "wall_s": time.time() - began, "runs": runs}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
