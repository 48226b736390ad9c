"""``commfuse-dp plan``: the command line of the planner (``plan.py``): predictions for one cluster, the sweep over
ranks, links and tokens, and calibration against a ``commfuse-dp bench`` file.

    commfuse-dp plan --model llama-7b --num-processes 8 --link-gbps 50 --tflops 400 --tokens-per-rank 8192
    commfuse-dp plan --model path/to/config.json --num-processes 16 --link-gbps 25 --ring-latency-us 20 --tflops 300
    commfuse-dp plan --calibrate bench.json          # predictions against the emulated cluster's measurements
    commfuse-dp plan --model llama3-8b --sweep      # the defaults over the peer: ranks, links, tokens per rank
    commfuse-dp plan --model llama3-8b --num-processes 64 --link-gbps 25 --formats --codec-ns 0.002   # narrow formats
    commfuse-dp plan --model llama3-8b --sweep --formats --codec-ns 0.002   # their gain at 16-256 ranks
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from . import costs, plan
from ..config import MIN_FUSE_NUMEL
from .costs import Cluster, units_for
from ..cli_names import show_gbps, spelled
from .files import Bench, load_model, read_bench, read_bench_file
from .nodes_cli import (NODE_SWEEP_NIC_GBIT, NODE_SWEEP_NICS, NODE_SWEEP_NODES, calibrate_nodes, machines_checked,
                        nodes_sweep, print_nodes)
from .plan import ALIASES, KNOWN_MODELS, decide, predict, recommend, simulate, unplayed


def _fixed_cost(by_rate: dict[float, dict[str, dict]]) -> tuple[float, float] | None:
    """The least-squares line ``comm_only(rate) = A / rate + C`` through the bench's rates: ``(A, C)``, ``C`` (at
    least 0) the part of communication alone that does not shrink with the link's rate, in seconds per step. None
    with fewer than two rates, or where communication alone does not shrink as the rate grows (``A`` <= 0)."""
    points = [(rate, rows["comm_only"]["step_s"]) for rate, rows in by_rate.items() if "comm_only" in rows]
    if len(points) < 2:
        return None
    xs, ys = [1.0 / rate for rate, _ in points], [seconds for _, seconds in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return (slope, max(my - slope * mx, 0.0)) if slope > 0 else None


def calibrate(path: str, latency_us: float | None = None, overhead_path: str | None = None) -> int:
    """``overhead_path``: what each schedule adds per step to the same model's compute on the bench's machine, with
    nothing moving (``benchmarks/step_overhead.py --fake-worlds W --bench-model real --json FILE``: its host work
    and its GEMMs in pieces). ``latency_us`` None: the fixed cost of a hop is fitted from the bench's
    ``comm_only`` rows (what does not shrink with the rate, over the planner's count of hops), and each rate's
    bandwidth from the rest. With real compute one thread computes and issues, so it adds to the compute; with the
    emulated accelerator the host runs ahead (the step is at least that long). A schedule it does not name plays
    with the planner's own model of a CPU host (what ``choose`` plans with on CPU): ``costs.CPU_HOST_FIT`` per fused
    group for fused, lockstep and slicing, ``costs.peer_host_on_cpu`` for the peer."""
    raw = read_bench_file(path)
    on_compute = raw.get("compute", "real") == "real"  # else "emulated at X TFLOP/s"
    if raw.get("nic_mbit"):  # nodes sharing their NICs (EmulatedNodes)
        return calibrate_nodes(path, raw, on_compute)
    extra = _overhead(overhead_path, raw) if overhead_path else {}
    bench = read_bench(raw)
    print(f"calibration against {path}: {bench.world} ranks, fp32, {bench.tokens} tokens per rank")
    # ``concurrent`` (compute and communication at once, independent) measures the CPU the communication takes from
    # compute on this machine, per byte; it shows only where compute, not the link, bounds that run (communication
    # alone shorter than compute alone). Without such a rate, none is assumed.
    per_byte = [max(rows["concurrent"]["step_s"] - rows["compute_only"]["step_s"], 0.0) / bench.zero3_bytes
                for rows in bench.by_rate.values()
                if {"concurrent", "compute_only", "comm_only"} <= set(rows)
                and rows["comm_only"]["step_s"] < rows["compute_only"]["step_s"]]
    cpu_per_byte = sorted(per_byte)[len(per_byte) // 2] if per_byte else 0.0
    fit = _fixed_cost(bench.by_rate) if latency_us is None else None
    slope, fixed = fit if fit is not None else (None, 0.0)
    latency_us = _hop_latency(bench, latency_us, fit is not None, fixed)
    print(f"CPU taken from compute by communication: {cpu_per_byte * 1e9:.2f} s per GB moved"
          f"{'' if per_byte else ' (no concurrent run where compute bounds: none assumed)'}")
    _print_host_work(bench, on_compute, extra, overhead_path)
    print(f"{'rate GB/s':>11} {'F GFLOP/s':>10} {'B GB/s':>8} {'schedule':>9} {'predicted s':>11} {'measured s':>10} "
          f"{'error':>7}")
    worst = 0.0
    for rate, rows in sorted(bench.by_rate.items()):
        if "compute_only" not in rows or "comm_only" not in rows:
            continue
        compute, comm = rows["compute_only"]["step_s"], rows["comm_only"]["step_s"]
        # the bytes' time at this rate: communication alone less the fixed part, or the fitted line's where noise
        # leaves too little of it
        transfer = comm - fixed if slope is None or comm - fixed > 0.5 * slope / rate else slope / rate
        f_rate, b_rate = bench.flops / compute, bench.zero3_bytes / transfer
        cl = Cluster(bench.world, b_rate, latency_us * 1e-6, f_rate, param_bytes=4, grad_bytes=4,
                     cpu_s_per_byte=cpu_per_byte, direct_bytes=bench.direct_bytes, rows_ring=bench.rows_ring,
                     host_on_compute=on_compute, min_fuse_numel=bench.min_fuse_numel)
        worst = max(worst, _print_rate(bench, rate, rows, cl, extra))
    print(f"worst error {worst:.1%}")
    return 0


def _hop_latency(bench: Bench, latency_us: float | None, fitted: bool, fixed: float) -> float:
    """The fixed cost of a hop in microseconds (``--ring-latency-us``, else fitted, else the default), said."""
    if latency_us is None and not fitted:
        latency_us = 15.0
        print(f"fixed cost of a hop: {latency_us:g} us, the default (the file's communication alone does not "
              f"shrink over two or more link rates, so none could be fitted; --ring-latency-us sets it)")
    elif latency_us is None:
        hops = simulate(bench.units, Cluster(bench.world, 1e30, 1.0, 1e30, 4, 4, direct_bytes=bench.direct_bytes,
                                             rows_ring=bench.rows_ring, min_fuse_numel=bench.min_fuse_numel),
                        "no_overlap")["step_s"]  # (1 s per hop, nothing else costs)
        latency_us = fixed / hops * 1e6
        print(f"fixed cost of a hop: {latency_us:.0f} us, fitted (communication alone is {fixed * 1e3:.0f} ms "
              f"a step longer than its bytes over the rate, over {hops:.0f} hops)")
    else:
        print(f"fixed cost of a hop: {latency_us:g} us (--ring-latency-us)")
    return latency_us


def _print_host_work(bench: Bench, on_compute: bool, extra: dict[str, float], overhead_path: str | None) -> None:
    where = 'on the computing thread: added to compute' if on_compute else 'the host ahead of the device'
    groups, world = sum(len(u.groups) for u in bench.units), bench.world
    a, b = costs.CPU_HOST_FIT
    print(f"each schedule's own host work per step (the planner's CPU model; {where}): fused, lockstep and slicing "
          f"{groups} groups x ({a * 1e3:g} + {b * 1e3:g} x {world}) ms = {groups * (a + b * world) * 1e3:.0f} ms, "
          f"the peer's copies {costs.peer_host_on_cpu(bench.units, Cluster(world, 1.0, 0.0, 1.0, 4, 4)) * 1e3:.0f} ms"
          + (f"; measured instead ({overhead_path}): " + ", ".join(f"{name} {seconds * 1e3:.0f} ms"
                                                                   for name, seconds in extra.items()) if extra else ""))


def _print_rate(bench: Bench, rate: float, rows: dict[str, dict], cl: Cluster, extra: dict[str, float]) -> float:
    """One link rate's rows of the calibration table: each schedule predicted on ``cl`` against its measured step.
    Returns the largest error."""
    groups = sum(len(u.groups) for u in bench.units)
    worst = 0.0
    for schedule, measured_name in bench.names.items():
        if measured_name not in rows:
            continue
        # a schedule the overhead file measured plays with that (as a + b N per fused group), the others with
        # the planner's CPU model
        host = (extra[schedule] / groups, 0.0) if schedule in extra else costs.CPU_HOST_FIT
        peer = extra.get(schedule, costs.peer_host_on_cpu(bench.units, cl, coarse=schedule == "fsdp2_coarse"))
        predicted = simulate(bench.units, replace(cl, host_fit=host, peer_host_s=peer), schedule)["step_s"]
        measured = rows[measured_name]["step_s"]
        error = predicted / measured - 1
        worst = max(worst, abs(error))
        print(f"{show_gbps(rate):>11} {cl.flops_per_s / 1e9:>10.1f} {cl.bytes_per_s / 1e9:>8.4f} {schedule:>9} "
              f"{predicted:>11.3f} {measured:>10.3f} {error:>+7.1%}")
    return worst


def _overhead(path: str, bench: dict) -> dict[str, float]:
    """Seconds per step each schedule adds (``step_overhead.py --json``) at the bench's world size, for its model and
    compute; a file that does not fit the bench is an error (it would bias every prediction)."""
    with open(path) as f:
        data = json.load(f)
    compute, world = bench.get("compute", "real").split()[0], str(bench["world_size"])  # "emulated at X TFLOP/s"
    if data.get("model") != "bench" or data.get("compute") != compute or world not in data.get("extra_s", {}):
        raise SystemExit(f"--overhead {path}: measured for model {data.get('model')!r}, compute "
                         f"{data.get('compute')!r}, worlds {sorted(data.get('extra_s', {}))}; the bench ran the bench "
                         f"model with {compute} compute on {world} ranks: run benchmarks/step_overhead.py "
                         f"--fake-worlds {world} --bench-model {compute} --json FILE")
    return {name: max(seconds, 0.0) for name, seconds in data["extra_s"][world].items()}


SWEEP_RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SWEEP_LINKS_GBPS = (6.25, 12.5, 25.0, 50.0, 100.0, 200.0, 450.0)
SWEEP_TOKENS = (2048, 4096, 8192, 16384)


def _pair(text: str, h200: tuple[float, float]) -> tuple[float, float] | None:
    """``--piece-fit`` / ``--host-fit``: 'h200', 'none' or two non-negative numbers 'A,B'."""
    if text == "none":
        return None
    if text == "h200":
        return h200
    a, b = (float(x) for x in text.split(","))
    if a < 0 or b < 0:
        raise ValueError(text)
    return a, b


def sweep(model_name: str, latency_us: float, tflops: float, dtype_bytes: int, seq: int,
          against: str = "fsdp2", piece_fit: tuple[float, float] | None = None,
          host_fit: tuple[float, float] | None = None, min_fuse_numel: int = MIN_FUSE_NUMEL) -> int:
    """What ``CommFuseConfig()``'s defaults run (``decide``: fused at its best ``piece_shards`` where that is
    predicted at least 2% faster than the peer, else the peer), over ``against``'s step time (``fsdp2``, the peer,
    or ``slicing``), for every (ranks, link, tokens per rank) of the sweep grid; prints a table (``f``: the defaults
    fuse there; ``=``: they run the peer) and returns the number of cells where the defaults are slower. With
    ``piece_fit`` GEMM pieces cost time (slicing gathers whole layers: computes whole GEMMs); with ``host_fit`` each
    fused step is at least the host's time to issue it."""
    against = ALIASES.get(against, against)
    model = load_model(model_name)
    peer = " (torchtitan's units, on NCCL's collectives or the rings, whichever is predicted faster)"
    print(f"{model_name}: CommFuseConfig()'s defaults, step time / {against}'s{peer if against == 'fsdp2' else ''}; "
          f"{latency_us:g} us per hop, "
          f"{tflops:g} TFLOP/s, {dtype_bytes}-byte elements, seq {seq}, min_fuse_numel {min_fuse_numel}; tokens per "
          f"rank across, ranks x GB/s down; f: fused chosen, =: the peer chosen"
          + (f"; GEMM pieces cost 1 + {piece_fit[0]:g} (256/w)^{piece_fit[1]:g}" if piece_fit else "")
          + (f"; the host needs {host_fit[0] * 1e3:g} + {host_fit[1] * 1e3:g} N ms per fused group per step"
             if host_fit else ""))
    print(f"{'ranks':>6} {'GB/s':>6} " + " ".join(f"{t:>7}" for t in SWEEP_TOKENS))
    ratios: list[float] = []
    fused_ratios: list[float] = []  # fused at its best piece width over the peer, wherever played
    unknown: list[str] = []
    chose_fused = 0
    for ranks in SWEEP_RANKS:
        for gbps in SWEEP_LINKS_GBPS:
            cl = Cluster(ranks, gbps * 1e9, latency_us * 1e-6, tflops * 1e12, dtype_bytes, dtype_bytes,
                         piece_fit=piece_fit, host_fit=host_fit, min_fuse_numel=min_fuse_numel, peer_nccl=True)
            cells = []
            for tokens in SWEEP_TOKENS:
                units = units_for(*model, tokens=tokens, seq=min(seq, tokens))
                schedule, width, predicted = decide(units, cl)
                fused_s = predicted.get(f"fused, piece_shards={width}")  # (width 1 where the peer is chosen)
                if fused_s is None:  # a width decide bounded out without playing it
                    fused_s = simulate(units, replace(cl, piece_shards=width), "fused")["step_s"]
                mine = fused_s if schedule == "fused" else predicted["fsdp2"]
                theirs = predicted["fsdp2"] if against == "fsdp2" else simulate(
                    units, replace(cl, piece_shards=ranks), against)["step_s"]
                ratio = mine / theirs
                mark = "f" if schedule == "fused" else "="
                if schedule == "fused" and unplayed(units, cl, "fused"):
                    unknown.append(f"{ranks} ranks, {gbps:g} GB/s, {tokens} tokens")
                    cells.append(f"{ratio:>6.3f}?")
                    continue
                chose_fused += schedule == "fused"
                ratios.append(ratio)
                fused_ratios.append(fused_s / predicted["fsdp2"])
                cells.append(f"{ratio:>6.3f}{'*' if ratio > 1.0 + 1e-9 else mark}")
            print(f"{ranks:>6} {gbps:>6g} " + " ".join(cells))
    if unknown:
        print(f"?: {len(unknown)} cells where the defaults fuse but a decoder layer's groups below min_fuse_numel "
              f"{min_fuse_numel} add up to an FSDP2 unit of their own in shard() (gathered per layer), which the "
              f"planner does not play: " + "; ".join(unknown))
    slower = [x for x in ratios if x > 1.0 + 1e-9]
    print(f"{model_name}: the defaults fuse in {chose_fused} of {len(ratios)} cells played and are slower than "
          f"{against} in {len(slower)}" + (f", at most {max(slower):.3f}x (*)" if slower else "")
          + f"; fused at its best piece width alone would be slower than fsdp2 in "
          f"{sum(x > 1.0 + 1e-9 for x in fused_ratios)}")
    return len(slower)


FORMAT_SWEEP_RANKS = (16, 32, 64, 128, 256)
FORMAT_SWEEP_LINKS_GBPS = (12.5, 25.0, 50.0)  # 100 Gb and 200 Gb Ethernet, 400 Gb InfiniBand per GPU


def codec_costs(spec: str, dtype_bytes: int) -> tuple[dict[str, float], str]:
    """Compute seconds per element and codec pass of each lossy format (the mean of encoding and decoding): measured
    on this machine (``spec`` "measure": the GPU where torch has one, else the CPU) or one figure in ns for all."""
    import torch

    from ..wire import measure_codec

    if spec != "measure":
        ns = float(spec)
        return {f: ns * 1e-9 for f in ("bf16", "fp8", "int8")}, f"{ns:g} ns an element and pass (given)"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dtype_bytes == 2 else torch.float32
    costs_ = {f: sum(measure_codec(f, device, dtype)) / 2 for f in ("bf16", "fp8", "int8")}
    said = ", ".join(f"{f} {c * 1e9:.3g}" for f, c in costs_.items())
    return costs_, f"ns an element and pass measured on this machine's {device}: {said}"


def print_formats(units: list, cl: Cluster, dtype_bytes: int, codec: dict[str, float], said: str) -> None:
    rows = plan.formats_table(units, cl, dtype_bytes, codec)
    print(f"narrow formats on the wire (codec: {said}):")
    print(f"{'format':>10} {'gather B':>8} {'grad B':>7} {'fused s':>8} {'fsdp2 s':>8} {'best / exact defaults':>22}")
    for name, r in rows.items():
        print(f"{name:>10} {r['param_bytes']:>8.3g} {r['grad_bytes']:>7.3g} {r['fused_s']:>8.3f} {r['fsdp2_s']:>8.3f} "
              f"{r['exact_defaults_s'] / r['best_s']:>21.3f}x")
    print("format: gathers/gradients (plan's FORMAT_PLAYS); fsdp2: the peer on the rings with the same format (exact: "
          "as the defaults would run it); x: the exact defaults' step over the format's best step")


def formats_sweep(model_name: str, latency_us: float, tflops: float, dtype_bytes: int, tokens: int, seq: int,
                  codec: dict[str, float], said: str, piece_fit=None, host_fit=None,
                  min_fuse_numel: int = MIN_FUSE_NUMEL) -> list[dict]:
    """Each format's best step (fused or the peer, with that format) against the exact defaults' over
    ``FORMAT_SWEEP_RANKS`` x ``FORMAT_SWEEP_LINKS_GBPS``: one row per (ranks, link), one column per format."""
    model = load_model(model_name)
    units = units_for(*model, tokens=tokens, seq=min(seq, tokens))
    names = tuple(plan.FORMAT_PLAYS)[1:]
    print(f"{model_name}: the exact defaults' step over each narrow format's best (fused or fsdp2 with it), "
          f"{tokens} tokens per rank, {tflops:g} TFLOP/s, {latency_us:g} us a hop, {dtype_bytes}-byte values; "
          f"codec {said}")
    print(f"{'ranks':>6} {'GB/s':>6} " + " ".join(f"{n:>10}" for n in names))
    records = []
    for ranks in FORMAT_SWEEP_RANKS:
        for gbps in FORMAT_SWEEP_LINKS_GBPS:
            cl = Cluster(ranks, gbps * 1e9, latency_us * 1e-6, tflops * 1e12, dtype_bytes, dtype_bytes,
                         piece_fit=piece_fit, host_fit=host_fit, min_fuse_numel=min_fuse_numel, peer_nccl=True)
            rows = plan.formats_table(units, cl, dtype_bytes, codec)
            records.append({"ranks": ranks, "link_gbps": gbps, **{n: rows[n]["gain"] for n in rows}})
            print(f"{ranks:>6} {gbps:>6g} " + " ".join(f"{rows[n]['gain']:>9.3f}x" for n in names))
    for n in names:
        gains = [r[n] for r in records]
        print(f"{n}: {min(gains):.3f}x - {max(gains):.3f}x (median {sorted(gains)[len(gains) // 2]:.3f}x)")
    return records


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(spelled(sys.argv[1:] if argv is None else list(argv), parser, "plan"))
    fit, host_fit = _fits(parser, args)
    if args.min_fuse_numel < 0:
        parser.error("--min-fuse-numel must be at least 0")
    if args.overhead and not args.calibrate:
        parser.error("--overhead is read with --calibrate FILE only (it corrects the calibration's host work)")
    if args.tp is not None:
        return _tensor_parallel(parser, args)
    if args.calibrate:  # (the bench file says what min_fuse_numel it ran with)
        return calibrate(args.calibrate, args.latency_us, args.overhead)
    if args.latency_us is None:
        args.latency_us = 15.0
    codec = said = None
    if args.formats:
        try:
            codec, said = codec_costs(args.codec_ns, args.dtype_bytes)
        except ValueError:
            parser.error(f"--codec-ns {args.codec_ns!r}: give 'measure' or a number of ns (e.g. 0.002)")
    if args.sweep == "nodes":
        if args.ranks_per_node < 1:
            parser.error("--nproc-per-node must be at least 1")
        if codec is None:
            try:
                codec, said = codec_costs(args.codec_ns, args.dtype_bytes)
            except ValueError:
                parser.error(f"--codec-ns {args.codec_ns!r}: give 'measure' or a number of ns (e.g. 0.002)")
        intra = Cluster(args.ranks_per_node, args.link_gbps * 1e9, args.latency_us * 1e-6, args.tflops * 1e12,
                        args.dtype_bytes, args.dtype_bytes, piece_fit=fit, host_fit=host_fit,
                        min_fuse_numel=args.min_fuse_numel, peer_nccl=True)
        nodes_sweep(args.model, args.ranks_per_node, intra, args.tokens, args.seq, args.dtype_bytes, codec, said,
                    args.inter_latency_us * 1e-6, args.json,
                    "commfuse-dp plan " + " ".join(sys.argv[1:] if argv is None else argv))
        return 0
    if args.sweep and args.formats:
        formats_sweep(args.model, args.latency_us, args.tflops, args.dtype_bytes, args.tokens, args.seq, codec, said,
                      fit, host_fit, args.min_fuse_numel)
        return 0
    if args.sweep:
        sweep(args.model, args.latency_us, args.tflops, args.dtype_bytes, args.seq, args.against, fit, host_fit,
              args.min_fuse_numel)
        return 0
    _check_cluster(parser, args)
    model = load_model(args.model)
    cl = Cluster(args.ranks, args.link_gbps * 1e9, args.latency_us * 1e-6, args.tflops * 1e12,
                 args.dtype_bytes, args.dtype_bytes, piece_fit=fit, piece_shards=args.piece_shards, host_fit=host_fit,
                 min_fuse_numel=args.min_fuse_numel, peer_nccl=True)
    if args.nodes != 1:
        print_nodes(args, model, cl, machines_checked(parser, args), codec, said)
        return 0
    print_predictions(args, model, cl, codec, said)
    return 0


def _tensor_parallel(parser: argparse.ArgumentParser, args) -> int:
    """``--tp N``: the TP play (``planner/tp.py``), or its calibration against a TP bench file."""
    from . import tp

    if args.tp < 2:
        parser.error(f"--tp {args.tp}: give at least 2 ranks of tensor parallelism")
    if args.calibrate:
        return tp.calibrate(args.calibrate, args.latency_us)
    latency = 15.0 if args.latency_us is None else args.latency_us
    model = load_model(args.model)
    heads, kv = model[3], model[4]
    if heads % args.tp or kv % args.tp:
        parser.error(f"--tp {args.tp}: {args.model} has {heads} heads and {kv} key/value heads; both must divide "
                     f"over the TP ranks (tensor_parallel() refuses it otherwise)")
    clusters = {f"{label} ({gbps:g} GB/s a rank)": tp.TPCluster(args.tp, gbps * 1e9, latency * 1e-6,
                                                                args.tflops * 1e12, args.dtype_bytes)
                for label, gbps in (("NVLink", 450.0), ("PCIe", 25.0), ("--link-gbps", args.link_gbps))}
    tp.print_play(args.model, model, args.tokens, args.seq, clusters)
    return 0


def _parser() -> argparse.ArgumentParser:
    first, _, rest = __doc__.partition("\n\n")  # the help shows each once, without the docstring's markup
    model = plan.__doc__.partition("\n\n")[2].replace("The command line is ``planner/cli.py``.\n\n", "")
    parser = argparse.ArgumentParser(prog="commfuse-dp plan", description=first.replace("``", ""),
                                     epilog=(rest + "\n" + model).replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _cluster_arguments(parser)
    _mode_arguments(parser)
    return parser


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and the cluster planned for."""
    parser.add_argument("--model", default="llama-7b", help=f"known shape ({', '.join(KNOWN_MODELS)}) or an HF "
                                                            f"config.json path (default %(default)s)")
    parser.add_argument("--num-processes", dest="ranks", metavar="N", type=int, default=8,
                        help="data-parallel ranks in all, as accelerate launch's --num_processes (default %(default)s)")
    parser.add_argument("--link-gbps", type=float, default=50.0, help="per-rank link, GB/s (bytes; default %(default)s)")
    parser.add_argument("--ring-latency-us", dest="latency_us", metavar="US", type=float, default=None,
                        help="fixed cost of one hop, one exchange with the ring's neighbours (a ring over N ranks "
                             "takes N-1), microseconds (default 15; with --calibrate, fitted from the bench's "
                             "comm_only rows over its link rates)")
    parser.add_argument("--tflops", type=float, default=400.0, help="achievable TFLOP/s per rank (default %(default)s)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the hardware's peak TFLOP/s per rank, for MFU (default 989: an H100 SXM, dense bf16)")
    parser.add_argument("--tokens-per-rank", dest="tokens", metavar="T", type=int, default=8192, help="tokens per rank per step (default %(default)s)")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length (default %(default)s)")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes per parameter / gradient element (default %(default)s)")
    parser.add_argument("--num-machines", dest="nodes", metavar="K", type=int, default=1,
                        help="nodes the --num-processes are split into, alike (HSDP and one flat ring played; default 1); "
                             "--link-gbps is then each rank's link inside a node")
    parser.add_argument("--nic-gbps", type=float, default=12.5,
                        help="--num-machines: one NIC's rate between nodes, GB/s (bytes; default 12.5: 100 Gb Ethernet; 50 "
                             "for 400 Gb InfiniBand), shared by the node's ranks (docs/performance.md, 'Past one "
                             "machine', says which figure to give)")
    parser.add_argument("--nics-per-node", type=int, default=1,
                        help="--num-machines: NICs per node, each serving as many of its ranks (default 1; 8 on a node "
                             "with a NIC per GPU)")
    parser.add_argument("--inter-gbps", type=float, default=None,
                        help="--num-machines: each rank's own link between nodes, GB/s (as a NIC per rank of that rate; "
                             "instead of --nic-gbps and --nics-per-node)")
    parser.add_argument("--inter-latency-us", type=float, default=20.0,
                        help="--num-machines: the fixed cost of one hop between nodes, microseconds (default 20)")
    parser.add_argument("--piece-fit", default="h200",
                        help="what a GEMM cut into N pieces of w output rows costs (the fused and slicing schedules "
                             "compute so): 'h200' (default: 1 + 0.645 (256/w)^0.89, measured on an H200 in bf16 at "
                             "8192 tokens, benchmarks/cuda_check.py), 'A,P' for 1 + A (256/w)^P, or 'none' (as fast "
                             "as the whole GEMM)")
    parser.add_argument("--min-fuse-numel", type=int, default=MIN_FUSE_NUMEL,
                        help="CommFuseConfig.min_fuse_numel (default %(default)s, the library's): a group of linears "
                             "whose weight shard is smaller is not fused, in either schedule, except that the fused "
                             "schedule's elastic lookahead lets it share a larger group's hops in its decoder "
                             "layer; what is not fused is gathered at the step's head and reduce-scattered at its "
                             "tail. 0: every linear fused in both")
    parser.add_argument("--piece-shards", type=int, default=1,
                        help="CommFuseConfig.piece_shards of the fused schedule: weight shards per compute piece "
                             "(default 1)")
    parser.add_argument("--host-fit", default="h200",
                        help="the host's time per fused group per step, a + b * ranks seconds (fused and slicing "
                             "issue ~3 (N-1) hops and 2N pieces per group; the step cannot be shorter): 'h200' "
                             "(default: 1.7 ms + 0.30 ms x ranks, measured on an H200's host with "
                             "benchmarks/step_overhead.py --fake-worlds), 'none' (not modelled) or 'A,B' in seconds (that script "
                             "prints this machine's)")


def _mode_arguments(parser: argparse.ArgumentParser) -> None:
    """What to print instead of one cluster's predictions: calibration, sweeps, narrow formats."""
    parser.add_argument("--calibrate", metavar="BENCH_JSON", help="compare with a `commfuse-dp bench --json` file")
    parser.add_argument("--tp", type=int, default=None, metavar="N",
                        help="play sequence-parallel tensor parallelism over N ranks instead (fused against DTensor's "
                             "schedule; --tokens-per-rank is then the TP group's tokens a step) on NVLink (450 GB/s "
                             "a GPU), PCIe (25 GB/s) and --link-gbps; with --calibrate, FILE is a "
                             "benchmarks/tp_bench.py results file")
    parser.add_argument("--overhead", metavar="JSON",
                        help="--calibrate: each schedule's own work per step on the bench's machine, from "
                             "benchmarks/step_overhead.py --fake-worlds W --bench-model real|emulated --json JSON")
    parser.add_argument("--sweep", nargs="?", const="ranks", choices=("ranks", "nodes"), default=None,
                        help=f"'ranks' (the default with no value): the step of CommFuseConfig()'s defaults over the "
                             f"peer's (--against) at ranks {SWEEP_RANKS[0]}-{SWEEP_RANKS[-1]}, links "
                             f"{SWEEP_LINKS_GBPS[0]:g}-{SWEEP_LINKS_GBPS[-1]:g} GB/s and {SWEEP_TOKENS[0]}-"
                             f"{SWEEP_TOKENS[-1]} tokens per rank, for --model (--seq caps at the tokens). 'nodes': "
                             f"the map past one machine, {NODE_SWEEP_NODES[0]}-{NODE_SWEEP_NODES[-1]} nodes of "
                             f"--nproc-per-node ranks on --link-gbps, NICs of {NODE_SWEEP_NIC_GBIT[0] / 8:g}-"
                             f"{NODE_SWEEP_NIC_GBIT[-1] / 8:g} GB/s, {NODE_SWEEP_NICS[0]}-{NODE_SWEEP_NICS[-1]} a node: "
                             f"what the defaults run, each narrow format's best, and their step over FSDP2's HSDP "
                             f"(--codec-ns for the formats; --json writes the records)")
    parser.add_argument("--nproc-per-node", dest="ranks_per_node", metavar="N", type=int, default=8,
                        help="--sweep nodes: ranks (GPUs) in each node (default %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="--sweep nodes: write its records to this JSON file")
    parser.add_argument("--formats", action="store_true",
                        help="add a row per narrow format on the wire (gather_format / reduce_format: bf16, fp8, "
                             "int8 gathers; bf16 or int8 gradients); with --sweep: the formats' gain over the exact "
                             f"defaults at {FORMAT_SWEEP_RANKS[0]}-{FORMAT_SWEEP_RANKS[-1]} ranks and "
                             f"{FORMAT_SWEEP_LINKS_GBPS[0]:g}-{FORMAT_SWEEP_LINKS_GBPS[-1]:g} GB/s links, --tokens-per-rank per "
                             f"rank")
    parser.add_argument("--codec-ns", default="measure",
                        help="--formats: compute ns per element and pass to encode or decode a narrow format; "
                             "'measure' (default): timed on this machine (its GPU where torch has one, else the "
                             "CPU), which a plan for other hardware should replace with that hardware's figure")
    parser.add_argument("--against", choices=("fsdp2", "unit_slicing", "slicing"), default="fsdp2",
                        help="--sweep: the schedule the defaults' step is divided by (default fsdp2, also named "
                             "unit_slicing: the peer, stock FSDP2 as it runs on a GPU; slicing: this library's "
                             "layer-level prefetch)")


def _fits(parser: argparse.ArgumentParser, args: argparse.Namespace
          ) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
    """``--piece-fit`` and ``--host-fit`` read; a wrong one is a usage error."""
    try:
        fit = _pair(args.piece_fit, costs.H200_PIECE_FIT)
    except ValueError:
        parser.error(f"--piece-fit {args.piece_fit!r}: give 'h200', 'none' or two numbers 'A,P' (e.g. 0.645,0.89)")
    try:
        host_fit = _pair(args.host_fit, costs.H200_HOST_FIT)
    except ValueError:
        parser.error(f"--host-fit {args.host_fit!r}: give 'h200', 'none' or two numbers 'A,B' (e.g. 1.7e-3,3e-4)")
    return fit, host_fit


def _check_cluster(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    flag = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}  # (dest -> --the-option)
    for name in ("ranks", "tokens", "seq", "dtype_bytes", "piece_shards"):
        if getattr(args, name) < 1:
            parser.error(f"{flag[name]} must be at least 1")
    for name in ("link_gbps", "tflops", "peak_tflops"):
        if getattr(args, name) <= 0:
            parser.error(f"{flag[name]} must be > 0")
    if args.tflops > args.peak_tflops:
        parser.error(f"--tflops {args.tflops:g} (achievable) is above --peak-tflops {args.peak_tflops:g} (the "
                     f"hardware's peak); give the peak of the accelerator you plan for")


def _recommended(model: tuple, cl: Cluster, args: argparse.Namespace, chosen: str, best: int,
                 predicted: dict[str, float]) -> str:
    """The config to run, with its predicted step and why: what the defaults choose, and ``min_fuse_numel`` raised to
    where a hop's fixed cost is under 10 % of a fused group's transfer (``plan.recommend``) only where the planner
    predicts that faster by at least 0.5 %."""
    def said(chosen: str, best: int, predicted: dict[str, float]) -> tuple[float, list[str], str]:
        fused = {k: v for k, v in predicted.items() if k.startswith("fused")}
        if chosen == "fused":
            step = predicted[f"fused, piece_shards={best}"]
            return step, [f"piece_shards={best}"], f"{step:.3f} s a step against {predicted['fsdp2']:.3f} s for fsdp2"
        step = predicted["fsdp2"]
        return step, ["schedule='fsdp2'"], (f"{step:.3f} s a step; fused at best {min(fused.values()):.3f} s, not "
                                            f"{plan.MARGIN:.0%} faster")

    step, words, why = said(chosen, best, predicted)
    why = "what the defaults choose: " + why
    numel = recommend(cl)["min_fuse_numel"]
    if numel != args.min_fuse_numel:
        step2, words2, why2 = said(*decide(units_for(*model, tokens=args.tokens, seq=args.seq),
                                           replace(cl, min_fuse_numel=numel)))
        if step2 <= 0.995 * step:
            words, why = words2 + [f"min_fuse_numel={numel}"], (
                f"with min_fuse_numel={numel} (a hop's fixed cost under 10 % of a fused group's transfer) the "
                f"defaults choose {', '.join(words2)}: {why2}; with the default {args.min_fuse_numel}, {step:.3f} s")
        else:
            why += (f"; min_fuse_numel={numel}, which keeps a hop's fixed cost under 10 % of a fused group's "
                    f"transfer, predicts {step2:.3f} s, no faster, so the default {args.min_fuse_numel} stays")
    return f"recommended: CommFuseConfig({', '.join(words)}): {why}"


def print_predictions(args: argparse.Namespace, model: tuple, cl: Cluster, codec: dict[str, float] | None,
                      said: str | None) -> None:
    """One cluster's table: each schedule's step, exposed communication, pieces, host time and MFU, what
    ``CommFuseConfig()``'s defaults run there and the recommended config (with ``--formats``: the formats' rows)."""
    results = predict(model, cl, args.tokens, args.seq, args.peak_tflops * 1e12)
    results = {**{k: v for k, v in results.items() if k != "fsdp2"}, "fsdp2 NCCL": results["fsdp2"],
               "fsdp2 rings": predict(model, replace(cl, peer_nccl=False), args.tokens, args.seq,
                                      args.peak_tflops * 1e12)["fsdp2"]}
    chosen, best, predicted = decide(units_for(*model, tokens=args.tokens, seq=args.seq), cl)
    if best != args.piece_shards:  # what the recommended config below would give, beside what was asked
        results[f"fused, ps={best}"] = predict(model, replace(cl, piece_shards=best), args.tokens, args.seq,
                                               args.peak_tflops * 1e12)["fused"]
    print(f"{args.model}: {args.ranks} ranks, {args.link_gbps:g} GB/s links, {args.latency_us:g} us per hop, "
          f"{args.tflops:g} TFLOP/s achievable of {args.peak_tflops:g} peak, {args.tokens} tokens per rank")
    print(f"{'schedule':>12} {'step s':>8} {'exposed comm s':>14} {'pieces s':>8} {'host s':>7} {'MFU':>6} "
          f"{'of achievable':>13}")
    for schedule, r in results.items():
        print(f"{schedule:>12} {r['step_s']:>8.3f} {r['exposed_s']:>14.3f} {r['pieces_s']:>8.3f} {r['host_s']:>7.3f} "
              f"{r['mfu']:>6.1%} {r['of_achievable']:>13.1%}")
    print("MFU: model FLOPs per second against --peak-tflops; of achievable: against --tflops (compute alone)")
    for schedule, r in results.items():
        if r.get("unplayed"):
            print(f"not played: under {schedule}, {len(r['unplayed'])} decoder layers' groups below --min-fuse-numel "
                  f"{args.min_fuse_numel} add up to an FSDP2 unit of their own in shard() (gathered per layer); the "
                  f"planner shows them gathered at the step's head, so its {schedule} figures are not what runs")
    print(f"pieces: what computing each GEMM in {args.ranks // args.piece_shards if args.piece_shards <= args.ranks else 1}"
          f" pieces adds (fused and slicing, lockstep in {args.ranks}; --piece-shards {args.piece_shards}, --piece-fit "
          f"{args.piece_fit})")
    print(f"host: the host's time to issue the fused groups' hops and pieces (--host-fit {args.host_fit}); "
          f"a step is at least that long")
    print("fsdp2: the peer, stock FSDP2 over torchtitan's units as it runs on a GPU (the embedding, each decoder "
          "layer, the final norm with the lm_head; the next unit gathered one ahead, reduce-scatters behind the "
          "backward; CommFuseConfig(schedule='fsdp2')), on NCCL's own collectives or on the rings "
          f"({args.latency_us:g} us a hop, {Cluster.nccl_latency_s * 1e6:g} us a NCCL "
          "collective, the same bandwidth)")
    if best != args.piece_shards:
        pieces = max(1, args.ranks // best)
        print(f"fused, ps={best}: the fused schedule with piece_shards={best} (each GEMM "
              f"{f'in {pieces} pieces' if pieces > 1 else 'whole, once its weight is gathered'}), the recommended "
              f"one below; --piece-shards {best} plays it throughout")
    on = ("rings" if predicted["fsdp2"] == predicted["fsdp2 on the rings"] else "NCCL") if chosen == "fsdp2" else ""
    print(f"CommFuseConfig()'s defaults on this cluster: schedule={chosen!r}"
          + (f", piece_shards={best}" if chosen == "fused" else f" on {on}'s collectives") + " (commfuse_dp/planner/choose.py: "
          "fused only where predicted at least 2% faster than fsdp2)")
    print(_recommended(model, cl, args, chosen, best, predicted))
    if args.formats:
        print_formats(units_for(*model, tokens=args.tokens, seq=args.seq), cl, args.dtype_bytes, codec, said)


if __name__ == "__main__":
    raise SystemExit(main())
