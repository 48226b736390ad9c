"""``commfuse-dp bench``: every schedule on the same model and batch, on the emulated cluster, at several link rates.

    commfuse-dp bench --quick --json bench.json        # about 4 minutes here: 2 ranks, 3 rates, all variants
    commfuse-dp bench --link-gbps 0.125,0.25,0.5 --num-processes 2 --out-dir bench-out
    commfuse-dp bench --compute emulated --tflops 0.02 --num-processes 8   # 8 ranks on 2 cores (benchmarks/emulated.py)
    # 2 nodes x 2 ranks, HSDP: each node one NIC that its 2 ranks share, at 0.2, 0.1 and 0.05 GB/s
    commfuse-dp bench --num-machines 2 --num-processes 4 --compute emulated --nic-gbps 0.2,0.1,0.05

1. Calibration: compute alone at a reference rate, and communication alone at that rate and twice it, give the
   *balanced* rate, where the ZeRO-3 bytes of a step take as long as its compute (communication time fitted as
   a fixed part plus a part that scales as 1/rate).
2. The sweep: the balanced rate, twice it and half of it (communication from half to twice the compute), or
   ``--link-gbps``. At each rate one set of ranks runs all variants interleaved (``worker.py``).
3. Output: a table on the terminal, a JSON file (``records``: schedule, world_size, rate_mbit (the
   rate ``tc`` shaped, Mbit/s: GB/s x 8000), step_s, exposed_s,
   tokens_per_s, peak_mem_mb, ratio_to_limit, ratio_to_floor; ``paired``: fused's step over each other
   variant's, round by round, with the lowest and highest round), a PNG of the sweep, and a timeline of one fused,
   one fsdp2_overlap and one slicing step at the balanced rate (PNG and a Chrome/Perfetto trace).

Peak memory per rank (at the balanced rate, in a run of its own): what the variant holds between steps (parameter
shards, optimizer state) plus the peak of the process's resident size during a step above its size before it.

Exposed communication is a schedule's step time minus compute alone at the same rate; it includes the CPU time the
communication takes from compute on shared cores (the ``concurrent`` bound shows how much). ``waited`` (fused and
slicing) is the time the compute thread was blocked on hops (``commfuse_dp.step_stats``), medians of the
rank that waited most (``waited_min_s`` in the records: of the rank that waited least; where they differ, one rank
waited for another's slower compute, at a hop that both must enter). ``opt s`` is the optimizer's step (and ``zero_grad``) on the host, slowest rank: never emulated, so
under ``--compute emulated`` it is real CPU work on cores the ranks share, and HSDP's covers R times the parameters
of a flat shard (compute alone's covers a flat one): compare HSDP's step minus it. The overlap limit is max(compute
alone, communication alone) (``x limit``); the gather floor (``x floor``, ``gather_floor``) adds that a step's forward
cannot end before its all-gathers do, nor its backward begin before. Needs root (network namespaces); every run is bounded by ``--timeout``.

Several nodes (``--num-machines N``), machines as they are built (``--nic-gbps R``; ``benchmarks/cluster.py``,
``EmulatedNodes``): one network namespace per node, the node's M = world / N ranks talk over its loopback (unshaped,
or one cap for all of them with ``--intra-gbps``), and share its ``--nics-per-node`` K NICs of R GB/s each way
for traffic to other nodes: local rank l on NIC l % K. R is the figure swept (the ``rate GB/s`` column); when all
of a node's ranks send at once each gets R / (M / K) (``inter_mbit_per_rank``, given to the worker as its
``--link-mbit``). E.g. 8 GPUs on one 100 GbE NIC: M / K = 8, 1.56 GB/s a GPU; cloud H100 nodes, one 400 Gb NIC a GPU:
M / K = 1. ``--inter-fraction F`` with ``--link-gbps`` is the older emulation: one namespace per rank, every rank its own
link to other nodes at F times its link inside the node.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from commfuse_dp.cli_names import gbps_to_mbit, show_gbps, spelled
from .cluster import EmulatedCluster, EmulatedNodes
from .bench_model import MODEL_DEFAULTS
from .probes import MMAP_ENV
from .worker import EXTRA_VARIANTS, NODE_VARIANTS, OPTIMIZERS, VARIANTS

CPU_NOTES = {
    "defaults": "CommFuseConfig() told the link and the tokens: its \"auto\" schedule chose {chosen}",
    "defaults_nohints": "CommFuseConfig() told nothing (measures the link and GEMMs): it chose {chosen}",
    "fsdp2_overlap": "the peer: stock FSDP2 over torchtitan's units as it runs on a GPU (next unit gathered one "
                     "ahead, async; reduce-scatters waited at the backward's end), on the same rings",
    "fsdp2_coarse": "the same over each layer and a root holding embedding, norm and lm_head",
    "fsdp2_torch": "the peer's units and schedule on torch's own gloo collectives (no commfuse_dp code)",
    "fsdp2": "CPU artefact: stock FSDP2 runs its collectives synchronously on the main thread on CPU (no overlap)",
    "deepspeed_zero3": "CPU: DeepSpeed's gloo collectives; its prefetch/overlap as on CPU",
    "ddp": "DDP keeps the full model and optimizer on every rank (no sharding)",
    "comm_only": "the bytes shard() moves in a step (embedding as token rows) through the rings, back to back",
    "compute_only": "same per-rank work (optimizer on 1/N of the parameters), no communication",
    "concurrent": "compute alone and communication alone at once, independent: the CPU-shared limit",
    "hsdp_fused": "shard(), replicate = nodes: fused rings inside a node, gradients averaged across nodes",
    "hsdp_slicing": "the same with the slicing schedule",
    "fsdp2_hsdp": "the peer: FSDP2's HSDP as torchtitan builds it, on the same rings, run as on a GPU",
    "hsdp_fsdp2": "shard(), replicate = nodes, schedule='fsdp2': the peer's layout and schedule through shard()",
    "hsdp_fsdp2_nocheck": "the same with nonfinite_grads='off' (no per-step agreement on non-finite gradients)",
    "hpz_fsdp2": "shard(), hpz_size = ranks per node: one flat shard, FSDP2's units, the backward's gathers from "
                 "a second copy of the weights per node (ZeRO++'s hpZ)",
}
SHAPING_NOTE = ("tbf token buckets ({burst} KiB, --burst-kb) refill while a link is idle, so schedules with compute "
                "gaps get up to that many bytes above the rate after each gap, which back-to-back communication alone "
                "does not (tbf shaping); a real link has no such credit")


def run_rate(cluster: EmulatedCluster | EmulatedNodes, rate: float, variants: list[str], args, *, memory=False,
             timeline: str | None = None) -> dict:
    """One set of ranks at ``rate`` (with ``EmulatedNodes``: each NIC's): every variant, interleaved. Returns the
    worker's result (rank 0's JSON). ``memory``: instead of timing, measure each variant's peak memory (a run of its
    own, with large allocations mapped so that the resident size follows the live tensors; see
    ``probes.peak_step_bytes``)."""
    cluster.set_rate(rate)
    # the worker's --link-mbit: between nodes, a rank's share of its NIC when all of the node's ranks send
    link_mbit = cluster.inter_mbit_per_rank if isinstance(cluster, EmulatedNodes) else rate
    with tempfile.TemporaryDirectory(prefix="commfuse-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        port = 29500 + int(rate) % 400 + int(time.time()) % 50
        rounds, warmup = (0, 2) if memory else (args.rounds, args.warmup)
        argv = [sys.executable, "-m", "benchmarks.worker", "--world-size", str(cluster.world_size),
                "--master", f"{cluster.address(0)}:{port}", "--variants", ",".join(variants),
                "--rounds", str(rounds), "--steps", str(args.steps), "--warmup", str(warmup),
                "--settle", str(args.settle if rounds else 0),
                "--out", out, "--link-mbit", f"{link_mbit:g}", *args.model_args]
        env = worker_env()
        if memory:
            argv.append("--memory")
            env.update(MMAP_ENV)
        if timeline:
            argv += ["--timeline", timeline]
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(cluster.world_size)]
        procs = [cluster.popen(r, [*argv, "--rank", str(r)], env=env, stdout=logs[r], stderr=subprocess.STDOUT)
                 for r in range(cluster.world_size)]
        deadline = time.monotonic() + args.timeout
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if not os.path.exists(out):
            tails = []
            for r, log in enumerate(logs):
                log.seek(0)
                tails.append(f"--- rank {r} (exit {procs[r].returncode}):\n" + log.read()[-3000:])
            raise RuntimeError(f"benchmark at {show_gbps(rate)} GB/s produced no result (timeout {args.timeout}s or a rank "
                               f"failed):\n" + "\n".join(tails))
        with open(out) as f:
            return json.load(f)


def records_from(result: dict, rate: float, world: int) -> list[dict]:
    """One record per variant; ``compute`` says whether the CPU computed or an emulated accelerator waited."""
    variants = result["variants"]
    compute = variants.get("compute_only", {}).get("step_s")
    comm = variants.get("comm_only", {}).get("step_s")
    limit = max(compute, comm) if compute and comm else None
    floor = gather_floor(variants)
    tokens = result["tokens_per_rank"] * world
    rows = []
    for name, v in variants.items():
        step = v["step_s"]
        if name == "comm_only":
            exposed = step
        elif name == "compute_only":
            exposed = 0.0
        else:
            exposed = max(step - compute, 0.0) if compute else None
        rows.append({"schedule": name, "world_size": world, "rate_mbit": rate, "step_s": step, "exposed_s": exposed,
                     "tokens_per_s": tokens / step, "peak_mem_mb": v.get("peak_mem_mb"),
                     "ratio_to_limit": step / limit if limit else None, "floor_s": floor,
                     "ratio_to_floor": step / floor if floor else None, "steps_s": v["steps_s"],
                     **{key: v.get(key) for key in ("waited_s", "waited_min_s", "waited_ranks_s", "opt_s",
                                                    "forward_s", "cpu_s", "minor_faults", "steps_cpu_s",
                                                    "steps_minor_faults", "steps_gc_s")},
                     "compute": result.get("compute", "real"),
                     **({"lookahead_mb": result.get("lookahead_mb", "auto")} if name == "fused" else {}),
                     **({"chosen": result["chosen"][name]} if name in result.get("chosen", {}) else {})})
    return rows


def gather_floor(variants: dict) -> float | None:
    """The *gather floor*: no schedule that gathers every layer's weights during its forward can take less. The
    forward's all-gathers start with the step (the optimizer of the step before changed the shards) and end before
    the forward does (each layer needs all of its shards), and the backward and the optimizer compute after it; so
    a step is at least communication alone's forward part plus compute alone's backward and optimizer, besides at
    least each of compute alone and communication alone. At the balanced rate it exceeds max(compute, comm) by as
    much as the forward's gathers take longer than its compute. None without both parts measured."""
    compute, comm = variants.get("compute_only", {}), variants.get("comm_only", {})
    parts = (compute.get("step_s"), compute.get("forward_s"), comm.get("step_s"), comm.get("forward_s"))
    if None in parts:
        return None
    c, c_fwd, l, l_fwd = parts
    return max(c, l, l_fwd + c - c_fwd)


def paired_ratios(records: list[dict], rounds: int, of: str = "fused") -> dict:
    """``of``'s step over each other schedule's, paired round by round: the variants of a round run one after the
    other, so a slower spell of the machine slows both sides of a round's ratio, which the ratio of two medians over
    the whole run does not cancel. Per rate and schedule: the ratio of the two medians in each round, and the median,
    lowest and highest of those. Empty where ``of`` did not run or the rounds cannot be told apart."""
    out: dict = {}
    for rate in sorted({r["rate_mbit"] for r in records}):
        at = {r["schedule"]: r["steps_s"] for r in records if r["rate_mbit"] == rate and r.get("steps_s")}
        mine = at.get(of)
        if not mine or rounds < 1 or len(mine) % rounds:
            continue
        per = len(mine) // rounds
        for name, theirs in at.items():
            if name == of or len(theirs) != len(mine):
                continue
            ratios = [statistics.median(mine[i * per:(i + 1) * per]) / statistics.median(theirs[i * per:(i + 1) * per])
                      for i in range(rounds)]
            out.setdefault(f"{rate:g}", {})[f"{of}/{name}"] = {
                "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}
    return out


def print_paired(paired: dict, of: str = "fused") -> None:
    if not paired:
        return
    print(f"\n{of}'s step over each schedule's, round by round (median [lowest - highest] over the rounds):")
    for rate, ratios in sorted(paired.items(), key=lambda kv: -float(kv[0])):
        print(f"{show_gbps(float(rate)):>11}  " + "  ".join(f"{name} {r['median']:.3f} [{r['min']:.3f} - {r['max']:.3f}]"
                                                  for name, r in ratios.items()))


def print_table(records: list[dict], balanced: float, burst_kb: int) -> None:
    if records:
        print(f"\ncompute: {records[0]['compute']}")
    print(f"\n{'rate GB/s':>11} {'schedule':>16} {'step s':>7} {'exposed s':>9} {'waited s':>8} {'tokens/s':>9} "
          f"{'peak MiB':>9} {'x limit':>7} {'x floor':>7} {'opt s':>6} {'cpu s':>6} {'faults k':>8}")
    for rate in sorted({r["rate_mbit"] for r in records}, reverse=True):
        mark = "  <- balanced" if rate == balanced else ""
        for r in sorted((r for r in records if r["rate_mbit"] == rate), key=lambda r: (VARIANTS + EXTRA_VARIANTS).index(r["schedule"])):
            mem = f"{r['peak_mem_mb']:.0f}" if r["peak_mem_mb"] else "-"
            ratio = f"{r['ratio_to_limit']:.2f}" if r["ratio_to_limit"] else "-"
            floor = f"{r['ratio_to_floor']:.2f}" if r.get("ratio_to_floor") else "-"
            exposed = f"{r['exposed_s']:.3f}" if r["exposed_s"] is not None else "-"
            waited = f"{r['waited_s']:.3f}" if r.get("waited_s") is not None else "-"
            cpu = f"{r['cpu_s']:.3f}" if r.get("cpu_s") is not None else "-"
            opt = f"{r['opt_s']:.3f}" if r.get("opt_s") is not None else "-"
            faults = f"{r['minor_faults'] / 1000:.1f}" if r.get("minor_faults") is not None else "-"
            chosen = r.get("chosen", {})
            said = chosen.get("schedule", "?") + (f", replicate={chosen['replicate']}" if "replicate" in chosen else "")
            note = CPU_NOTES.get(r["schedule"], "").format(chosen=said)
            if r["schedule"] == "defaults" and r.get("nodes", 1) > 1 and r.get("nic_mbit") is not None:
                note = f"CommFuseConfig() told the tokens, both tiers measured at shard(): it chose {said}"
            print(f"{show_gbps(rate):>11} {r['schedule']:>16} {r['step_s']:>7.3f} {exposed:>9} {waited:>8} {r['tokens_per_s']:>9.0f} "
                  f"{mem:>9} {ratio:>7} {floor:>7} {opt:>6} {cpu:>6} {faults:>8}  {note}{mark}")
            mark = ""
    print(f"\nnote: {SHAPING_NOTE.format(burst=burst_kb)}")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout that holds benchmarks/


def worker_env() -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH``: the ranks run ``python -m
    benchmarks.worker`` from any folder (``benchmarks/`` is not installed with the package)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": ROOT + (os.pathsep + path if path else "")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commfuse-dp bench", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-processes", dest="world_size", metavar="N", type=int, default=2,
                        help="ranks in all, as accelerate launch's --num_processes (default 2: one core each here)")
    parser.add_argument("--link-gbps", dest="rates", metavar="R1,R2,...",
                        help="comma-separated link rates, GB/s each way (default: calibrated sweep)")
    parser.add_argument("--reference-gbps", dest="reference_rate", metavar="R", type=float, default=0.125,
                        help="calibration rate, GB/s (default %(default)s)")
    parser.add_argument("--variants", default=None,
                        help=f"subset of {','.join(VARIANTS)} (also: {','.join(EXTRA_VARIANTS)}); default: the first "
                             f"list, or with --num-machines {','.join(NODE_VARIANTS)}")
    parser.add_argument("--num-machines", dest="nodes", metavar="K", type=int, default=1,
                        help="emulated nodes (default 1): --num-processes ranks split into this many nodes of consecutive "
                             "ranks, for the HSDP variants. Give --nic-gbps (a namespace per node, its ranks sharing "
                             "its NICs) or --inter-fraction (a namespace per rank, each its own link between nodes)")
    parser.add_argument("--nic-gbps", dest="nic_mbit", metavar="R1,R2,...|balanced",
                        help="--num-machines: each NIC's rate, GB/s each way, comma-separated: the sweep (instead of "
                             "--link-gbps). All of a node's ranks share its NICs for traffic to other nodes: when all "
                             "send at once each gets NIC x NICs per node / ranks per node (printed); inside a node "
                             "they talk over its loopback. 'balanced': calibrated, the NIC rate at which HSDP's "
                             "exchange of a step's gradients across the nodes (fp32, 2 (K-1)/K of the model through "
                             "each node's NICs) takes as long as compute alone, then twice it and half it")
    parser.add_argument("--nics-per-node", type=int, default=1,
                        help="--nic-gbps: NICs (rails) K a node has, each at --nic-gbps; local rank l uses NIC "
                             "l %% K, its gloo bound to it (default 1: one NIC for the whole node; as many as its "
                             "ranks: a NIC each)")
    parser.add_argument("--intra-gbps", dest="intra_mbit", metavar="C", type=float, default=None,
                        help="--nic-gbps: cap on all traffic among a node's ranks together, GB/s (a PCIe-only "
                             "node, its ranks sharing the switch); default: unshaped loopback")
    parser.add_argument("--inter-fraction", type=float, default=None,
                        help="--num-machines with --link-gbps, the older emulation: every rank its own link to other nodes at "
                             "this fraction of --link-gbps, its rate inside the node (e.g. 0.25)")
    parser.add_argument("--quick", action="store_true", help="1 round of 2 steps per variant (about 4 minutes)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of interleaved variants per rate")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    parser.add_argument("--settle", type=int, default=1,
                        help="untimed steps per variant at the start of each round, so that no timed step follows "
                             "another variant's step (default 1; 0: none, a variant's first timed step follows "
                             "another's)")
    parser.add_argument("--json", help="write the records to this JSON file")
    parser.add_argument("--out-dir", default="bench-out", help="PNG plots and traces go here (default bench-out)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one rate may take before it is killed")
    parser.add_argument("--compute", choices=("real", "emulated"), default="real",
                        help="real: the CPU computes (default). emulated: each GEMM and attention kernel waits its "
                             "FLOPs at --tflops instead of computing, and returns zeros, so that 4-8 ranks run on 2 "
                             "cores with only communication competing for them (times schedules; numbers are not "
                             "a model's results)")
    parser.add_argument("--tflops", type=float, default=0.02,
                        help="--compute emulated: TFLOP/s of each emulated rank (default 0.02)")
    parser.add_argument("--emulated-host", choices=("ahead", "sync"), default="ahead",
                        help="--compute emulated: ahead (default): the host goes on while the emulated device computes, "
                             "as beside a GPU (ring work waits for the compute requested before it); sync: the host "
                             "sleeps until each GEMM is done")
    helps = {"kv-heads": "key/value heads (GQA); default: --heads", "min-fuse-numel": "CommFuseConfig.min_fuse_numel"}
    for name, default in MODEL_DEFAULTS:
        parser.add_argument(f"--{name}", type=int, default=default, help=helps.get(name))
    parser.add_argument("--burst-kb", type=int, default=128,
                        help="tc tbf burst of every link, KiB (default 128). After an idle gap a link sends up to "
                             "this much above its rate: schedules that leave the link idle get those bytes free, so "
                             "keep it small")
    parser.add_argument("--lookahead-mb", default="auto",
                        help="CommFuseConfig.lookahead_mb of the fused variant (fused_lockstep: always 0)")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="fused",
                        help="AdamW's implementation in every variant: fused (default; the Trainer's adamw_torch_fused) "
                             "or foreach (torch's default when constructed plainly), which costs a sharded rank more "
                             "host time per step (DTensor dispatch)")
    args = parser.parse_args(spelled(sys.argv[1:] if argv is None else list(argv), parser, "bench"))
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    if args.variants is None:
        args.variants = ",".join(NODE_VARIANTS if args.nodes > 1 else VARIANTS)
    variants = [v for v in args.variants.split(",") if v]
    if not 1 <= args.world_size <= 200:
        parser.error(f"--num-processes {args.world_size}: must be between 1 and 200 (a namespace each)")
    if args.nodes < 1 or args.world_size % args.nodes:
        parser.error(f"--num-machines {args.nodes} must divide --num-processes {args.world_size}")
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be at least 1")
    if args.warmup < 0 or args.timeout <= 0:
        parser.error("--warmup must be at least 0 and --timeout above 0")
    if args.nodes == 1:
        stray = [flag for flag, given in (("--nic-gbps", args.nic_mbit is not None),
                                          ("--nics-per-node", args.nics_per_node != 1),
                                          ("--intra-gbps", args.intra_mbit is not None)) if given]
        if stray:
            parser.error(f"{', '.join(stray)}: only with --num-machines 2 or more (they describe the links between "
                         f"nodes); add --num-machines N or leave {'it' if len(stray) == 1 else 'them'} out")
    elif args.nic_mbit is not None and args.inter_fraction is not None:
        parser.error("--num-machines: give --nic-gbps (a node's ranks share its NICs) or --inter-fraction (a link per rank "
                     "between nodes, with --link-gbps), not both")
    elif args.nic_mbit is None and args.inter_fraction is None:
        parser.error("--num-machines needs --nic-gbps R1,R2,... (each node's NIC rate, GB/s: the sweep), or the older "
                     "--inter-fraction F with --link-gbps")
    elif args.nic_mbit is not None:
        ranks_per_node = args.world_size // args.nodes
        if args.rates:
            parser.error("--nic-gbps is the sweep of --num-machines; drop --link-gbps (inside a node the ranks talk over its "
                         "loopback: --intra-gbps caps it)")
        if args.nics_per_node < 1 or ranks_per_node % args.nics_per_node:
            parser.error(f"--nics-per-node {args.nics_per_node} must divide the {ranks_per_node} ranks of a node "
                         f"(--num-processes {args.world_size} / --num-machines {args.nodes}), so that every NIC carries as many")
        if args.intra_mbit is not None and not args.intra_mbit > 0:
            parser.error(f"--intra-gbps {args.intra_mbit:g}: a rate must be above 0 GB/s (leave it out: unshaped)")
        if args.nic_mbit.strip().lower() != "balanced":
            args.rates = ",".join(str(r) for r in _rates(parser, "--nic-gbps", args.nic_mbit))
    else:
        if args.nics_per_node != 1 or args.intra_mbit is not None:
            parser.error("--nics-per-node and --intra-gbps go with --nic-gbps, not --inter-fraction")
        if not 0 < args.inter_fraction <= 1:
            parser.error(f"--inter-fraction {args.inter_fraction:g} must be in (0, 1]")
        if not args.rates:
            parser.error("--num-machines with --inter-fraction needs --link-gbps (intra-node GB/s): the calibration measures "
                         "flat rings only")
    if args.rates:  # from here on the rates are what tc shapes, Mbit/s (the records keep them so: rate_mbit)
        args.rates = ",".join(f"{gbps_to_mbit(r):g}" for r in _rates(
            parser, "--nic-gbps" if args.nic_mbit is not None else "--link-gbps", args.rates))
    if not args.reference_rate > 0:
        parser.error(f"--reference-gbps {args.reference_rate:g}: a rate must be above 0 GB/s")
    args.reference_rate = gbps_to_mbit(args.reference_rate)
    if args.intra_mbit is not None:
        args.intra_mbit = gbps_to_mbit(args.intra_mbit)
    if args.nodes == 1 and any(v.startswith("hsdp") or v == "fsdp2_hsdp" for v in variants):
        parser.error("the hsdp_* and fsdp2_hsdp variants need --num-machines 2 or more")
    unknown = sorted(set(variants) - set(VARIANTS) - set(EXTRA_VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {','.join(VARIANTS + EXTRA_VARIANTS)}")
    args.model_args = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
        "hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "seq", "batch", "min_fuse_numel", "compute",
        "tflops", "lookahead_mb", "emulated_host", "nodes", "optimizer")]
    os.makedirs(args.out_dir, exist_ok=True)
    started = time.monotonic()
    records: list[dict] = []
    if args.burst_kb * 1024 < 2 * 65000:
        parser.error("--burst-kb must hold two 65000-byte packets (the links' MTU): at least 127")
    if args.nic_mbit is not None:
        first = float(args.rates.split(",")[0]) if args.rates else args.reference_rate
        cluster = EmulatedNodes(args.nodes, args.world_size // args.nodes, first,
                                nics_per_node=args.nics_per_node, intra_mbit=args.intra_mbit,
                                burst_bytes=args.burst_kb * 1024)
        print(f"{args.nodes} nodes of {cluster.ranks_per_node} ranks, {_nics(args.nics_per_node)} each; inside a "
              f"node: {_intra(args.intra_mbit)}", flush=True)
    else:
        cluster = EmulatedCluster(args.world_size, args.reference_rate, burst_bytes=args.burst_kb * 1024,
                                  nodes=args.nodes, inter_fraction=args.inter_fraction or 0.25)
    with cluster:
        if args.rates:
            rates = [float(r) for r in args.rates.split(",")]
            balanced = rates[len(rates) // 2]
        elif args.nic_mbit is not None:  # --nic-gbps balanced: HSDP's exchange against compute alone
            print(f"calibrating compute alone (NICs at {show_gbps(args.reference_rate)} GB/s) ...", flush=True)
            calib_args = argparse.Namespace(**{**vars(args), "rounds": 1, "steps": 3, "warmup": 2})
            compute = run_rate(cluster, args.reference_rate, ["compute_only"], calib_args)["variants"][
                "compute_only"]["step_s"]
            balanced = balanced_nic_rate(args, compute)
            rates = [2 * balanced, balanced, balanced / 2]
            args.rates = ",".join(f"{r:g}" for r in rates)
            print(f"compute {compute:.3f}s per step; HSDP's exchange moves {exchange_bytes(args) / 1e6:.1f} MB "
                  f"through each node's NICs a step -> balanced NIC rate {show_gbps(balanced)} GB/s; sweep "
                  f"{', '.join(show_gbps(r) for r in rates)}", flush=True)
        else:
            print(f"calibrating at {show_gbps(args.reference_rate)} GB/s ...", flush=True)
            calib_args = argparse.Namespace(**{**vars(args), "rounds": 1, "steps": 3, "warmup": 2})
            reference = args.reference_rate
            calib = run_rate(cluster, reference, ["compute_only", "comm_only"], calib_args)["variants"]
            compute, comm = calib["compute_only"]["step_s"], calib["comm_only"]["step_s"]
            comm2 = run_rate(cluster, 2 * reference, ["comm_only"], calib_args)["variants"]["comm_only"]["step_s"]
            balanced = balanced_rate(reference, compute, comm, comm2)
            rates = [2 * balanced, balanced, balanced / 2]
            print(f"compute {compute:.3f}s, communication {comm:.3f}s at {show_gbps(reference)} and {comm2:.3f}s at "
                  f"{show_gbps(2 * reference)} GB/s per step -> balanced rate {show_gbps(balanced)} GB/s; sweep "
                  f"{', '.join(show_gbps(r) for r in rates)}", flush=True)
        timeline_path = os.path.join(args.out_dir, "timeline.json")
        for rate in rates:
            at_balance = rate == balanced
            if args.nic_mbit is not None:
                print(f"NIC {show_gbps(rate)} GB/s: {_share(rate, args)}", flush=True)
            print(f"running {len(variants)} variants at {show_gbps(rate)} GB/s ...", flush=True)
            result = run_rate(cluster, rate, variants, args, timeline=timeline_path if at_balance else None)
            if at_balance:
                print(f"measuring peak memory at {show_gbps(rate)} GB/s ...", flush=True)
                peaks = run_rate(cluster, rate, variants, args, memory=True)["variants"]
                for name, v in result["variants"].items():
                    v["peak_mem_mb"] = peaks[name]["peak_mem_mb"]
            records += [dict(r, **_node_fields(rate, args)) for r in records_from(result, rate, args.world_size)]
            if at_balance and result.get("timelines"):
                _write_timeline(result["timelines"], args.out_dir, rate, args.world_size)
    print_table(records, balanced, args.burst_kb)
    paired = paired_ratios(records, args.rounds)
    print_paired(paired)
    paired_defaults = paired_ratios(records, args.rounds, of="defaults")
    print_paired(paired_defaults, of="defaults")
    paired_peer = paired_ratios(records, args.rounds, of="fsdp2_hsdp")  # (above 1: the other is faster)
    print_paired(paired_peer, of="fsdp2_hsdp")
    if args.nic_mbit is not None:
        print(f"{args.nodes} nodes of {args.world_size // args.nodes} ranks, {_nics(args.nics_per_node)} each: the "
              f"rates are each NIC's; inside a node: {_intra(args.intra_mbit)}")
        for rate in sorted({r["rate_mbit"] for r in records}, reverse=True):
            print(f"{show_gbps(rate):>11}  {_share(rate, args)}")
    elif args.nodes > 1:
        print(f"{args.nodes} nodes of {args.world_size // args.nodes} ranks: the rates are inside a node; between "
              f"nodes each rank's link runs at {args.inter_fraction:g} of it")
    from commfuse_dp.config import CommFuseConfig

    payload = {"command": "commfuse-dp bench " + " ".join(sys.argv[1:] if argv is None else argv),
               "records": records, "paired": paired, "paired_defaults": paired_defaults, "paired_peer": paired_peer, "rounds": args.rounds, "balanced_rate_mbit": balanced,
               "world_size": args.world_size,
               "nodes": args.nodes, "inter_fraction": args.inter_fraction if args.nodes > 1 else None,
               **({"cluster": "a namespace per node, its ranks sharing its NICs (benchmarks/cluster.py EmulatedNodes)",
                   "nic_mbit": [float(r) for r in args.rates.split(",")], "nics_per_node": args.nics_per_node,
                   "ranks_per_node": args.world_size // args.nodes, "intra_mbit": args.intra_mbit,
                   "inter_mbit_per_rank": [_node_fields(float(r), args)["inter_mbit_per_rank"]
                                           for r in args.rates.split(",")]} if args.nic_mbit is not None else {}),
               "compute": "real" if args.compute == "real" else f"emulated at {args.tflops:g} TFLOP/s",
               **({"emulated_host": args.emulated_host} if args.compute == "emulated" else {}),
               "tbf_burst_kb": args.burst_kb, "optimizer": f"AdamW ({args.optimizer})",
               "model": {**{k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads",
                                                           "vocab", "seq", "batch", "min_fuse_numel")},
                         "direct_kb": CommFuseConfig().direct_kb,  # fused_ring: 0
                         # the ring embedding's rows in one round (a file without it: a ring)
                         "embedding_rows": "direct",
                         # fsdp2_overlap's units (a file without it: each layer and a root, now fsdp2_coarse)
                         "peer_units": "torchtitan"},
               "notes": {**CPU_NOTES, "shaping": SHAPING_NOTE.format(burst=args.burst_kb)}, "wall_s": time.monotonic() - started}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    from commfuse_dp.plots import sweep_png

    title = (f"{args.nodes} nodes of {args.world_size // args.nodes} ranks, {_nics(args.nics_per_node)} each "
             f"(rate: a NIC's): step time per schedule" if args.nic_mbit is not None
             else f"{args.world_size} ranks, emulated links: step time per schedule")
    sweep_png(records, os.path.join(args.out_dir, "sweep.png"), title)
    print(f"\nwrote {args.json or '(no JSON)'}, {args.out_dir}/sweep.png, {args.out_dir}/timeline.png, "
          f"{args.out_dir}/trace.json in {time.monotonic() - started:.0f}s")
    return 0


def _rates(parser: argparse.ArgumentParser, flag: str, text: str) -> list[float]:
    """``text``'s comma-separated rates, GB/s; a rate that is no number or not above 0 is the user's error."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        parser.error(f"{flag} {text}: give rates in GB/s separated by commas, e.g. 0.2,0.1,0.05")
    if not rates or any(not r > 0 for r in rates):
        parser.error(f"{flag} {text}: every rate must be above 0 GB/s")
    return rates


def _nics(k: int) -> str:
    return "one NIC" if k == 1 else f"{k} NICs"


def _intra(intra_mbit: float | None) -> str:
    return "loopback, unshaped" if intra_mbit is None else f"loopback capped at {show_gbps(intra_mbit)} GB/s for all its ranks"


def _share(nic_mbit: float, args) -> str:
    """What the NIC rate leaves each rank towards other nodes, in words."""
    ranks, k = args.world_size // args.nodes, args.nics_per_node
    per_nic = ranks // k
    on = f" ({k} NICs, {per_nic} rank{'s' if per_nic > 1 else ''} on each)" if k > 1 else ""
    return (f"each of a node's {ranks} ranks: {show_gbps(nic_mbit)}/{per_nic} = {show_gbps(nic_mbit / per_nic)} GB/s to "
            f"other nodes when all send at once{on}, {show_gbps(nic_mbit)} alone")


def _node_fields(rate: float, args) -> dict:
    """What a record says of the nodes at ``rate`` (with --nic-gbps: each NIC's)."""
    if args.nic_mbit is None:
        return {"nodes": args.nodes, "inter_rate_mbit": rate * args.inter_fraction if args.nodes > 1 else None}
    ranks = args.world_size // args.nodes
    per_rank = rate * args.nics_per_node / ranks
    return {"nodes": args.nodes, "nic_mbit": rate, "nics_per_node": args.nics_per_node, "ranks_per_node": ranks,
            "inter_mbit_per_rank": per_rank, "inter_rate_mbit": per_rank, "intra_mbit": args.intra_mbit}


def exchange_bytes(args) -> float:
    """Bytes HSDP's exchange sends through each node's NICs in a step: every rank's fp32 gradient shard summed over
    the K copies (a ring all-reduce: 2 (K-1)/K of it), for all of the node's ranks, so 2 (K-1)/K of the model."""
    import torch

    from .bench_model import build_model

    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(args).parameters())
    k = args.nodes
    return 2 * (k - 1) / k * params * 4


def balanced_nic_rate(args, compute_s: float) -> float:
    """The NIC rate, Mbit/s, at which ``exchange_bytes`` takes ``compute_s`` (each node's ``--nics-per-node`` NICs
    carry it together)."""
    return round(exchange_bytes(args) * 8 / compute_s / 1e6 / args.nics_per_node, -1)


def balanced_rate(reference: float, compute: float, comm: float, comm_at_double: float) -> float:
    """The rate at which communication alone takes as long as compute alone, from communication times at
    ``reference`` and twice it, fitted as ``fixed + bytes_term / rate`` (the fixed part: per-hop latencies and
    CPU work that a faster link does not shorten). Falls back to pure ``1/rate`` scaling when the two times do not
    fit that form (noise) or the fixed part alone exceeds the compute."""
    per_rate = 2 * reference * (comm - comm_at_double)  # seconds x Mbit/s
    fixed = comm - per_rate / reference
    if per_rate > 0 and 0 <= fixed < 0.9 * compute:
        return round(per_rate / (compute - fixed), -1)
    return round(reference * comm / compute, -1)


def _write_timeline(timelines: dict, out_dir: str, rate: float, world: int) -> None:
    from commfuse_dp.timeline import write_chrome_trace

    from commfuse_dp.plots import timeline_png

    timeline_png(timelines, os.path.join(out_dir, "timeline.png"), f"{world} ranks at {show_gbps(rate)} GB/s")
    ranks = max(len(v) for v in timelines.values())
    merged = [[dict(e, op=f"{name}:{e['op']}") for name, v in timelines.items() for e in (v[r] if r < len(v) else [])]
              for r in range(ranks)]
    write_chrome_trace(os.path.join(out_dir, "trace.json"), merged)


if __name__ == "__main__":
    raise SystemExit(main())
