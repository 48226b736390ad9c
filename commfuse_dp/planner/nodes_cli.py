"""``commfuse-dp plan --num-machines``: the planner past one machine on the command line (``nodes.py``): one cluster of
nodes that share their NICs, the map over nodes and NICs (``--sweep nodes``), and calibration against a
``commfuse-dp bench --num-machines --nic-gbps`` file. ``planner/cli.py`` parses the options and calls these."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from . import nodes, plan
from .costs import Cluster, units_for
from .nodes import Machines
from ..cli_names import show_gbps
from .files import load_model, read_bench


def machines_of(args) -> Machines:
    """The tier between nodes that ``--num-machines``, ``--nic-gbps`` / ``--inter-gbps``, ``--nics-per-node`` and
    ``--inter-latency-us`` describe (``nodes.Machines``)."""
    per_node = args.ranks // args.nodes
    if args.inter_gbps is not None:  # each rank its own link: a NIC per rank
        return Machines.of_nics(args.nodes, per_node, args.inter_gbps * 1e9, per_node, args.inter_latency_us * 1e-6)
    return Machines.of_nics(args.nodes, per_node, args.nic_gbps * 1e9, args.nics_per_node,
                            args.inter_latency_us * 1e-6)


NODE_LAYOUTS = {"hsdp/fsdp2": "the peer: FSDP2's HSDP as torchtitan builds it (fully_shard on a 2-D mesh)",
                "hsdp/fused": "HSDP, the fused rings inside a node, each group's gradient across nodes as it lands",
                "flat/fsdp2": "one flat ring over every rank, FSDP2's units",
                "flat/fused": "one flat ring over every rank, fused",
                "hpz/fsdp2": "a flat ring, the backward's gathers from a second copy of the weights per node "
                             "(ZeRO++'s hpZ: hpz_size=ranks per node)"}


def print_nodes(args, model: tuple, intra: Cluster, machines: Machines, codec: dict[str, float] | None = None,
                said: str | None = None) -> None:
    """One multi-node cluster: each layout's step (``nodes.predict``), then with ``--formats`` each narrow format's
    best, and the line of what ``CommFuseConfig()``'s defaults run there (``nodes.decide``)."""
    units = units_for(*model, tokens=args.tokens, seq=args.seq)
    results = nodes.predict(units, intra, machines)
    chosen, steps = nodes.decide(units, intra, machines)
    flops = 3 * sum(u.flops for u in units)
    print(f"{args.model}: {machines.describe()}; {args.link_gbps:g} GB/s a rank inside a node ({args.latency_us:g} "
          f"us a hop), {args.tflops:g} TFLOP/s achievable of {args.peak_tflops:g} peak, {args.tokens} tokens per rank")
    print(f"{'layout':>7} {'schedule':>8} {'step s':>8} {'tok/s/rank':>10} {'MFU':>6} {'x peer':>7} {'shard of':>8}")
    peer = steps[nodes.PEER]
    for key, r in results.items():
        layout, schedule = key.split("/")
        print(f"{layout:>7} {schedule:>8} {r['step_s']:>8.3f} {args.tokens / r['step_s']:>10.0f} "
              f"{flops / (r['step_s'] * args.peak_tflops * 1e12):>6.1%} {peer / r['step_s']:>6.3f}x "
              f"{r['shard_of']:>8}  {NODE_LAYOUTS[key]}")
    for layout in nodes.unplayed_fused(units, intra, machines):
        print(f"{layout:>7} {'fused':>8}  not played: on its {machines.per_node if layout == 'hsdp' else machines.ranks} "
              f"ranks decoder layers' groups fall below --min-fuse-numel, so shard() would leave whole layers "
              f"unfused; the defaults leave it out")
    print("x peer: the peer's step over this one (above 1: faster); shard of: the ranks one copy of the parameters "
          "and optimizer state is split over (its memory per rank: 1/that; hpZ keeps a second copy of the weights "
          f"split over a node's {machines.per_node} ranks besides)")
    if codec is not None:
        rows = nodes.formats(units, intra, machines, args.dtype_bytes, codec)
        print(f"narrow formats on the wire, inside a node and between nodes (codec: {said}):")
        print(f"{'format':>10} {'best':>11} {'step s':>8} {'x peer':>7} {'peer with it':>12} {'x defaults':>10}")
        for name, r in rows.items():
            print(f"{name:>10} {r['best']:>11} {r['step_s']:>8.3f} {r['over_peer']:>6.3f}x {r['peer_s']:>12.3f} "
                  f"{r['gain']:>9.3f}x")
        print("best: the fastest layout/schedule with that format; peer with it: FSDP2's HSDP with the same format "
              "on the rings; x defaults: the exact defaults' step over the format's best")
    layout, schedule = chosen.split("/")
    replicate = {"hsdp": f"replicate={machines.nodes} (HSDP)", "flat": "replicate=1 (one flat ring)",
                 "hpz": f"replicate=1, hpz_size={machines.per_node} (one flat ring, hpZ)"}[layout]
    why = ("the peer's layout and schedule: nothing is predicted faster by 2%" if chosen == nodes.PEER else
           f"predicted {steps[chosen]:.3f} s against the peer's {peer:.3f} s: {1 - steps[chosen] / peer:.0%} faster")
    print(f"CommFuseConfig()'s defaults on this cluster: {replicate}, schedule={schedule!r}: {why} "
          f"(commfuse_dp/planner/nodes.py; exact: no narrow format unless asked)")


NODE_SWEEP_NODES = (2, 4, 8, 16, 32)
NODE_SWEEP_NIC_GBIT = (25, 100, 200, 400)
NODE_SWEEP_NICS = (1, 2, 8)


def nodes_sweep(model_name: str, per_node: int, intra: Cluster, tokens: int, seq: int, dtype_bytes: int,
                codec: dict[str, float], said: str, latency_s: float, json_path: str | None = None,
                command: str = "") -> list[dict]:
    """The map for users: over ``NODE_SWEEP_NODES`` nodes of ``per_node`` ranks with ``NODE_SWEEP_NICS`` NICs of
    ``NODE_SWEEP_NIC_GBIT`` Gb/s (line rate: / 8 for GB/s) each, what the exact defaults run and how their step compares with FSDP2's HSDP,
    and the best narrow format's (``nodes.formats``)."""
    model = load_model(model_name)
    units = units_for(*model, tokens=tokens, seq=min(seq, tokens))
    names = tuple(plan.FORMAT_PLAYS)
    print(f"{model_name}: {per_node} ranks a node at {intra.bytes_per_s / 1e9:g} GB/s each, {tokens} tokens per rank, "
          f"{intra.flops_per_s / 1e12:g} TFLOP/s, {dtype_bytes}-byte values; the peer is FSDP2's HSDP; each cell: "
          f"FSDP2 HSDP's step over the setting's (above 1: faster) and, for exact, the layout/schedule the defaults "
          f"run; hpZ: the peer's step over hpZ's, exact; codec {said}")
    print(f"{'nodes':>5} {'NIC GB/s':>8} {'NICs':>4} {'GB/s/rank':>9} {'peer s':>7} " +
          " ".join(f"{n:>20}" for n in names) + f" {'hpZ':>7}")
    records = []
    for k in NODE_SWEEP_NODES:
        for gbit in NODE_SWEEP_NIC_GBIT:
            for nics in NODE_SWEEP_NICS:
                machines = Machines.of_nics(k, per_node, gbit / 8 * 1e9, nics, latency_s)
                rows = nodes.formats(units, intra, machines, dtype_bytes, codec, names)
                peer = rows["exact"]["steps"][nodes.PEER]
                chosen = nodes.decide(units, intra, machines)[0]
                cells = []
                for n in names:
                    r = rows[n]
                    label = chosen if n == "exact" else r["best"]
                    step = r["steps"][chosen] if n == "exact" else r["step_s"]
                    cells.append(f"{peer / step:.3f}x {label:>11}")
                hpz = peer / nodes.hpz_step(units, intra, machines)
                records.append({"nodes": k, "nic_gbit": gbit, "nics_per_node": nics, "per_rank_gbps":
                                machines.share / 1e9, "peer_s": peer, "defaults": chosen, "hpz_over_peer": hpz,
                                **{n: {"best": rows[n]["best"], "step_s": rows[n]["step_s"],
                                       "over_peer": peer / rows[n]["step_s"]} for n in names}})
                print(f"{k:>5} {gbit / 8:>8g} {nics:>4} {machines.share / 1e9:>9.3g} {peer:>7.3f} " + " ".join(
                    f"{c:>20}" for c in cells) + f" {hpz:>6.3f}x")
    for n in names:
        gains = sorted(r[n]["over_peer"] for r in records)
        print(f"{n}: {gains[0]:.3f}x - {gains[-1]:.3f}x over FSDP2's HSDP (median {gains[len(gains) // 2]:.3f}x)")
    wins = [r for r in records if r["hpz_over_peer"] > 1 / (1 - plan.MARGIN)]
    print(f"hpZ (exact, the peer's schedule, hpz_size={per_node}): beats FSDP2's HSDP by 2 % or more in "
          f"{len(wins)} of {len(records)} cells" + (f", at most {max(r['hpz_over_peer'] for r in wins):.3f}x" if wins
                                                   else ""))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"command": command, "model": model_name,
                       "per_node": per_node, "tokens": tokens, "records": records}, f, indent=1)
    return records


def machines_checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Machines:
    """``--num-machines`` and the NICs read and checked; a wrong one is a usage error (one line)."""
    if args.nodes < 1 or args.ranks % args.nodes:
        parser.error(f"--num-machines {args.nodes} must divide --num-processes {args.ranks}: every node holds as many ranks")
    for name in ("nic_gbps", "inter_gbps"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')} {value:g}: a link's rate must be > 0 GB/s")
    per_node = args.ranks // args.nodes
    if args.nics_per_node < 1 or (per_node >= args.nics_per_node and per_node % args.nics_per_node):
        parser.error(f"--nics-per-node {args.nics_per_node}: must be >= 1 and divide the {per_node} ranks of a node")
    if args.inter_latency_us < 0:
        parser.error(f"--inter-latency-us {args.inter_latency_us:g}: must be >= 0")
    return machines_of(args)


# bench --num-machines variants the planner plays: name -> (layout/schedule, narrow format of the worker's NARROW)
NODE_VARIANTS = {"fsdp2_hsdp": ("hsdp/fsdp2", None), "hsdp_fused": ("hsdp/fused", None),
                 "hpz_fsdp2": ("hpz/fsdp2", None),
                 **{f"{kind}_{fmt}": (play, fmt) for kind, play in (("fsdp2_hsdp", "hsdp/fsdp2"),
                                                                    ("hsdp_fused", "hsdp/fused"))
                    for fmt in ("bf16", "int8", "int8_int8")}}
NODE_FORMATS = {"bf16": ("bf16", "bf16"), "int8": ("int8", "bf16"), "int8_int8": ("int8", "int8")}


def calibrate_nodes(path: str, raw: dict, on_compute: bool) -> int:
    """A ``commfuse-dp bench --num-machines --nic-gbps`` file against the planner across nodes (``nodes.py``), each rate
    played on the figures it ran on: the GEMM rate from compute alone, the NIC's share and one flow from the
    shaping (``nic_mbit``, ``nics_per_node``, ``ranks_per_node``), and the link inside a node and both hops' fixed
    costs as the ``defaults`` variant measured them at ``shard()`` (its ``chosen``'s ``played``). Prints each HSDP
    variant's and the defaults' predicted step beside the measured one; the worst error of the defaults and the
    peer (``fsdp2_hsdp``)."""
    from .costs import CPU_HOST_FIT, peer_host_on_cpu
    from ..wire import bytes_per_element

    bench = read_bench(raw)
    per_node, k = raw["ranks_per_node"], raw["nodes"]
    nics = raw.get("nics_per_node", 1)
    print(f"calibration against {path}: {k} nodes x {per_node} ranks, {nics} NIC(s) a node, fp32, {bench.tokens} "
          f"tokens per rank")
    print(f"{'NIC GB/s':>10} {'F GFLOP/s':>10} {'schedule':>22} {'played':>11} {'predicted s':>11} "
          f"{'measured s':>10} {'error':>7}")
    worst = 0.0
    for rate, rows in sorted(bench.by_rate.items()):
        played = (rows.get("defaults", {}).get("chosen") or {}).get("played")
        if "compute_only" not in rows or not played or "between_nodes" not in played:
            print(f"{show_gbps(rate):>10}: no compute_only, or no defaults variant that recorded the tiers it measured "
                  f"(`played`): not calibrated")
            continue
        f_rate = bench.flops / rows["compute_only"]["step_s"]
        nic = rate * 1e6 / 8
        machines = nodes.Machines(k, per_node, nic * min(nics, per_node) / per_node, nic,
                                  played["between_nodes"]["latency_us"] * 1e-6, f"{nics} NIC(s) of {show_gbps(rate)} GB/s")
        cl = Cluster(per_node, played["link_gbps"] * 1e9, played["latency_us"] * 1e-6, f_rate, 4, 4,
                     host_fit=CPU_HOST_FIT, host_on_compute=on_compute, direct_bytes=bench.direct_bytes,
                     rows_ring=bench.rows_ring, min_fuse_numel=bench.min_fuse_numel)
        cl = replace(cl, peer_host_s=peer_host_on_cpu(bench.units, cl))
        chosen = rows["defaults"]["chosen"]
        layout = "hsdp" if chosen.get("replicate", 1) > 1 else "hpz" if chosen.get("hpz_size", 1) > 1 else "flat"
        plays = {"defaults": (f"{layout}/{chosen['schedule']}", None), **NODE_VARIANTS}
        for name, (key, fmt) in plays.items():
            if name not in rows:
                continue
            narrow, grad_bytes = cl, None
            if fmt is not None:
                gather, reduce = NODE_FORMATS[fmt]
                narrow = plan.with_formats(cl, gather, reduce, 4, {})
                grad_bytes = min(4, bytes_per_element(reduce, 4))
            which, schedule = key.split("/")
            predicted = (nodes.hpz_step(bench.units, narrow, machines) if which == "hpz" else
                         nodes.layouts(bench.units, narrow, machines, grad_bytes, (which,), (schedule,))[key])
            measured = rows[name]["step_s"]
            error = predicted / measured - 1
            if name in ("defaults", "fsdp2_hsdp"):
                worst = max(worst, abs(error))
            print(f"{show_gbps(rate):>10} {f_rate / 1e9:>10.3g} {name:>22} {key:>11} {predicted:>11.3f} {measured:>10.3f} "
                  f"{error:>+7.1%}")
    print(f"worst error of the defaults and the peer (fsdp2_hsdp): {worst:.1%}; the codec's compute is not played")
    return 0
