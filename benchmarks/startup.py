"""What ``shard()``'s ``schedule="auto"`` costs at start-up on large rings: ``choose.choose`` on a Llama built on the
meta device, with the link, latency, GEMM rate and tokens given (so no process group and no measurement), as every
rank runs it once before sharding.

    python -m benchmarks.startup                        # Llama-3-8B and -70B at 1024 and 4096 ranks
    python -m benchmarks.startup --models llama3-8b --num-processes 1024 --rounds 5 --json FILE
    python -m benchmarks.startup --full-at none          # without the full replay's comparison
    python -m benchmarks.startup --per-node 8 --nic-gbps 12.5   # a launch over nodes of 8 ranks

Each round starts cold (``replay.forget_traces``: no trace kept from an earlier round, as in a fresh process) and
times ``choose`` alone (the model is built once, before the rounds); the table shows the median and the range over
``--rounds``. Two cost models, as ``choose`` picks them by device: ``cuda`` (the H200's GEMM pieces and host) and
``cpu`` (this library's host time and FSDP2's copies on the computing thread); where fused can win, its piece
widths are played (on the stand-in ring beyond 64 ranks, ``replay.py``'s [Note: a stand-in ring]). At the ranks of
``--full-at`` it also times, once, the choice that plays every piece width on the full ring
(``plan.decide_by_playing_all`` with ``stand_in_ranks=None``), and says whether it chose the same. This is a
measurement, not a test: it asserts nothing about speed.

``--per-node N``: the launch is over nodes of N ranks, each node's ranks sharing ``--nic-gbps`` of NIC, and the
choice timed is ``choose_nodes.plan_nodes`` (``shard()``'s ``replicate="auto"`` once the tiers are known: HSDP or
one flat ring, each schedule played), with the tiers given as ``measure.measure_tiers`` would report them (the
link inside a node at ``--link-gbps``, a rank's share of the NIC, one flow at the NIC's rate); the measurement of
the tiers themselves (ring all-gathers on the node and replicate groups) is not in it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import replace

import torch

from commfuse_dp.planner import plan, replay
from commfuse_dp.planner.choose import choose
from commfuse_dp.config import CommFuseConfig
from commfuse_dp.cli_names import spelled

SHAPES = {  # transformers LlamaConfig fields of the planner's known shapes (plan.KNOWN_MODELS)
    name: dict(hidden_size=h, intermediate_size=i, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv, vocab_size=vocab)
    for name, (h, i, layers, heads, kv, vocab) in plan.KNOWN_MODELS.items() if name.startswith("llama3")}


def meta_llama(name: str, context: int) -> torch.nn.Module:
    """A transformers Llama of ``SHAPES[name]`` on the meta device (no memory), in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(max_position_embeddings=context, **SHAPES[name])).to(torch.bfloat16)


def time_choice(model: torch.nn.Module, config: CommFuseConfig, ranks: int, device: str, rounds: int) -> dict:
    """``rounds`` cold runs of ``choose``: their seconds and what it chose."""
    seconds = []
    for _ in range(rounds):
        replay.forget_traces()
        start = time.perf_counter()
        choice = choose(model, config, ranks, torch.device(device))
        seconds.append(time.perf_counter() - start)
    played = sum(k.startswith("fused, piece_shards=") for k in choice.predicted_s)
    return {"seconds": seconds, "median_s": statistics.median(seconds), "min_s": min(seconds),
            "max_s": max(seconds), "schedule": choice.schedule, "piece_shards": choice.piece_shards,
            "widths_played": played, "reason": choice.reason, "choice": choice}


def time_nodes_choice(model: torch.nn.Module, config: CommFuseConfig, ranks: int, per_node: int, nic_gbps: float,
                      device: str, rounds: int) -> dict:
    """``rounds`` cold runs of ``plan_nodes`` for ``ranks`` ranks in nodes of ``per_node``: their seconds and what it
    chose."""
    from commfuse_dp.planner.choose_nodes import plan_nodes
    from commfuse_dp.planner.measure import LinkFit, Tiers

    hop = (4 << 10, 16 << 20)
    tiers = Tiers(LinkFit(config.link_gbps * 1e9, config.ring_latency_us * 1e-6, hop),
                  LinkFit(nic_gbps * 1e9 / per_node, 20e-6, hop), LinkFit(nic_gbps * 1e9, 20e-6, hop))
    seconds = []
    for _ in range(rounds):
        replay.forget_traces()
        start = time.perf_counter()
        resolved, choice = plan_nodes(model, config, ranks // per_node, per_node, torch.device(device), tiers)
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds, "median_s": statistics.median(seconds), "min_s": min(seconds),
            "max_s": max(seconds), "schedule": choice.schedule, "piece_shards": choice.piece_shards,
            "replicate": choice.replicate, "hpz_size": choice.hpz_size, "widths_played": 0, "reason": choice.reason,
            "choice": None}


def time_full_replay(choice) -> dict:
    """The same choice with every piece width played on the full ring, timed once from cold."""
    units, cl = choice.plan.units, replace(choice.plan.cluster, stand_in_ranks=None)
    replay.forget_traces()
    start = time.perf_counter()
    schedule, width, _ = plan.decide_by_playing_all(units, cl)
    seconds = time.perf_counter() - start
    replay.forget_traces()  # (its traces are large)
    return {"seconds": seconds, "schedule": schedule, "piece_shards": width,
            "agrees": (schedule, width) == (choice.schedule, choice.piece_shards)}


def _machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    return f"{cpu or platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python " \
           f"{platform.python_version()}, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(spelled(sys.argv[1:] if argv is None else list(argv), parser, "startup"))
    if args.rounds < 3:
        raise SystemExit("--rounds must be at least 3 (a median and a spread)")
    unknown = [m for m in args.models if m not in SHAPES]
    if unknown:
        raise SystemExit(f"--models {','.join(unknown)}: known are {', '.join(SHAPES)}")
    config = CommFuseConfig(link_gbps=args.link_gbps, ring_latency_us=args.latency_us, tflops=args.tflops,
                            tokens_per_rank=args.tokens)
    what = f"plan_nodes() (nodes of {args.per_node}, {args.nic_gbps:g} GB/s NIC)" if args.per_node else "choose()"
    print(f"{what} from cold, {args.rounds} rounds each: {args.link_gbps:g} GB/s, {args.latency_us:g} us a hop, "
          f"{args.tflops:g} TFLOP/s, {args.tokens} tokens per rank; {_machine()}")
    print(f"{'model':>10} {'ranks':>5} {'device':>6} {'median s':>9} {'min - max s':>15} {'chosen':>16} "
          f"{'widths played':>13}")
    records, full = [], []
    for name in args.models:
        model = meta_llama(name, args.tokens)
        for ranks in args.ranks:
            for device in args.devices:
                if args.per_node:
                    r = time_nodes_choice(model, config, ranks, args.per_node, args.nic_gbps, device, args.rounds)
                else:
                    r = time_choice(model, config, ranks, device, args.rounds)
                chosen = f"{r['schedule']}" + (f", ps={r['piece_shards']}" if r["schedule"] == "fused" else "") + (
                    f", R={r['replicate']}" if r.get("replicate") else "") + (
                    f", hpZ {r['hpz_size']}" if r.get("hpz_size", 1) > 1 else "")
                print(f"{name:>10} {ranks:>5} {device:>6} {r['median_s']:>9.3f} "
                      f"{r['min_s']:>7.3f} - {r['max_s']:<5.3f} {chosen:>16} {r['widths_played']:>13}")
                choice = r.pop("choice")
                records.append({"model": name, "ranks": ranks, "device": device, **r})
                if ranks in args.full_at and choice is not None:
                    f = time_full_replay(choice)
                    full.append({"model": name, "ranks": ranks, "device": device, **f})
    for f in full:
        print(f"every width played on the full ring: {f['model']} {f['ranks']} ranks {f['device']}: "
              f"{f['seconds']:.2f} s, {f['schedule']}" + (f", ps={f['piece_shards']}" if f["schedule"] == "fused"
                                                         else "")
              + (": the same choice" if f["agrees"] else ": a DIFFERENT choice"))
    if args.json:
        given = sys.argv[1:] if argv is None else argv
        command = "python -m benchmarks.startup " + " ".join(shlex.quote(a) for a in given)
        with open(args.json, "w") as out:
            json.dump({"command": command, "machine": _machine(), "rounds": args.rounds,
                       "link_gbps": args.link_gbps, "latency_us": args.latency_us, "tflops": args.tflops,
                       "tokens_per_rank": args.tokens, "per_node": args.per_node,
                       "nic_gbps": args.nic_gbps if args.per_node else None, "choices": records, "full_replay": full},
                      out, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(f["agrees"] for f in full) else 1


def _ints(text: str) -> list[int]:
    return [] if text == "none" else [int(x) for x in text.split(",")]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=lambda s: s.split(","), default=["llama3-8b", "llama3-70b"],
                        help=f"comma-separated, of {', '.join(SHAPES)} (default: both)")
    parser.add_argument("--num-processes", dest="ranks", metavar="N1,N2,...", type=_ints, default=[1024, 4096], help="comma-separated (default 1024,4096)")
    parser.add_argument("--devices", type=lambda s: s.split(","), default=["cuda", "cpu"],
                        help="the cost models choose() uses for these device types (default cuda,cpu; no device "
                             "is touched)")
    parser.add_argument("--rounds", type=int, default=5, help="cold runs per case (at least 3; default 5)")
    parser.add_argument("--link-gbps", type=float, default=50.0, help="CommFuseConfig.link_gbps (default 50)")
    parser.add_argument("--ring-latency-us", dest="latency_us", metavar="US", type=float, default=15.0, help="CommFuseConfig.ring_latency_us (default 15)")
    parser.add_argument("--tflops", type=float, default=400.0, help="CommFuseConfig.tflops (default 400)")
    parser.add_argument("--tokens-per-rank", dest="tokens", metavar="T", type=int, default=8192, help="CommFuseConfig.tokens_per_rank (default 8192)")
    parser.add_argument("--full-at", type=_ints, default=[1024],
                        help="ranks at which to time, once, the choice with every width played on the full ring "
                             "(default 1024; 'none': skip)")
    parser.add_argument("--per-node", type=int, default=None,
                        help="a launch over nodes of this many ranks: time the choice across nodes (default: one "
                             "ring over all ranks)")
    parser.add_argument("--nic-gbps", type=float, default=12.5,
                        help="--per-node: a node's NIC, GB/s, shared by its ranks (default 12.5: 100 Gb Ethernet)")
    parser.add_argument("--json", default=None, help="write the results and the command to this file")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
