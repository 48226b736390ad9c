"""``commfuse-dp plan``: predict step time, exposed communication and MFU of the schedules on a real cluster.

    commfuse-dp plan --model llama-7b --ranks 8 --link-gbps 50 --tflops 400 --tokens 8192
    commfuse-dp plan --model path/to/config.json --ranks 16 --link-gbps 25 --latency-us 20 --tflops 300
    commfuse-dp plan --calibrate bench.json          # predictions against the emulated cluster's measurements

The model is a list of units in execution order: the embedding, per decoder layer the fused groups (q/k/v,
o, gate/up, down; attention itself as compute only), the final norm and the lm_head. Each group has forward
compute ``2·T·out·in / F`` and backward twice that; a ring step costs ``α + bytes / B``. The simulation has two
resources per rank, the compute stream and the link, and plays each schedule on them:
- ``no_overlap``: every collective, then the compute that needs it.
- ``slicing``: the link all-gathers unit i+1 while unit i computes (one unit ahead), and reduce-scatters unit i
  during unit i-1's backward; the first all-gather and the last reduce-scatter are exposed.
- ``fused``: inside each unit N compute pieces run beside N-1 ring steps (forward) or N ring steps (backward:
  weight shards and gradient partial sums together); a piece waits for the ring step before it. Parameters that are
  not fused (embedding, norms) take the bucketed path at the unit's edges, as ``shard()`` does.
Calibration fits F (compute alone) and B (communication alone) per rate from a ``commfuse-dp bench`` JSON and
compares the prediction for every schedule with its measured step time.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

KNOWN_MODELS = {
    # name: hidden, intermediate, layers, heads, kv heads, vocab
    "llama-7b": (4096, 11008, 32, 32, 32, 32000),
    "llama-13b": (5120, 13824, 40, 40, 40, 32000),
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256),
    "gpt2": (768, 3072, 12, 12, 12, 50257),
    "gpt2-xl": (1600, 6400, 48, 25, 25, 50257),
    "bench": (512, 1408, 4, 8, 8, 4096),  # the default model of ``commfuse-dp bench``
}


@dataclass(frozen=True)
class Unit:
    name: str
    fused_numel: int  # weight elements of fused linears (all ranks together)
    other_numel: int  # parameters through the bucketed rings (embedding, norms)
    flops: float  # forward FLOPs of this rank's tokens


@dataclass(frozen=True)
class Cluster:
    ranks: int
    bytes_per_s: float
    latency_s: float
    flops_per_s: float
    param_bytes: int = 2
    grad_bytes: int = 2


def units_for(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
              tokens: int, seq: int) -> list[Unit]:
    kv = hidden * kv_heads // heads
    groups = [hidden * (hidden + 2 * kv), hidden * hidden, 2 * hidden * intermediate, intermediate * hidden]
    attention = 4 * tokens * seq * hidden  # QK^T and AV, causal halves ignored
    units = [Unit("embedding", 0, vocab * hidden, 0.0)]
    for i in range(layers):
        numel = sum(groups)
        units.append(Unit(f"layer{i}", numel, 2 * hidden, 2.0 * tokens * numel + attention))
    units.append(Unit("lm_head", vocab * hidden, hidden, 2.0 * tokens * vocab * hidden))
    return units


def simulate(units: list[Unit], cl: Cluster, schedule: str) -> dict:
    """Step time (s), its compute, and the model FLOPs of one step on one rank."""
    n = cl.ranks
    steps = n - 1

    def coll(numel: int, nbytes: int) -> float:  # one ring all-gather or reduce-scatter of numel elements
        return 0.0 if numel == 0 or n == 1 else steps * (cl.latency_s + numel / n * nbytes / cl.bytes_per_s)

    fwd = [u.flops / cl.flops_per_s for u in units]
    bwd = [2 * f for f in fwd]
    compute = sum(fwd) + sum(bwd)
    flops = 3 * sum(u.flops for u in units)
    if schedule == "no_overlap":
        comm = sum(2 * coll(u.fused_numel + u.other_numel, cl.param_bytes) +
                   coll(u.fused_numel + u.other_numel, cl.grad_bytes) for u in units)
        return {"step_s": compute + comm, "compute_s": compute, "flops": flops}
    if schedule == "slicing":
        # The link serves requests in issue order (the ring thread): unit i+1's gather is issued when unit i
        # starts computing; in backward, unit i's reduce-scatter is issued when its backward compute ends.
        ag = [coll(u.fused_numel + u.other_numel, cl.param_bytes) for u in units]
        rs = [coll(u.fused_numel + u.other_numel, cl.grad_bytes) for u in units]
        link = comp = 0.0
        gathered = {0: ag[0]}
        link = ag[0]
        for i in range(len(units)):
            start = max(comp, gathered[i])
            if i + 1 < len(units):
                link = max(link, start) + ag[i + 1]
                gathered[i + 1] = link
            comp = start + fwd[i]
        order = list(reversed(range(len(units))))
        gathered = {order[0]: comp}  # the last unit keeps its forward gather for the backward
        for j, i in enumerate(order):
            start = max(comp, gathered[i])
            if j + 1 < len(order):
                link = max(link, start) + ag[order[j + 1]]
                gathered[order[j + 1]] = link
            comp = start + bwd[i]
            link = max(link, comp) + rs[i]
        return {"step_s": max(comp, link), "compute_s": compute, "flops": flops}
    if schedule == "fused":
        t = 0.0
        step_fwd = lambda u: cl.latency_s + u.fused_numel / n * cl.param_bytes / cl.bytes_per_s  # noqa: E731
        step_bwd = lambda u, nbytes: cl.latency_s + u.fused_numel / n * nbytes / cl.bytes_per_s  # noqa: E731
        other = [u for u in units if u.other_numel]
        t += sum(coll(u.other_numel, cl.param_bytes) for u in other)  # bucketed, at the start of forward
        for u, f in zip(units, fwd):
            if u.fused_numel == 0 or n == 1:
                t += f
                continue
            piece = f / n
            t += piece + steps * max(piece, step_fwd(u))
        for u, b in zip(reversed(units), reversed(bwd)):
            if u.fused_numel == 0 or n == 1:
                t += b
                continue
            piece = b / n
            ring = [step_bwd(u, cl.param_bytes)] + [step_bwd(u, cl.param_bytes + cl.grad_bytes)] * (n - 2) + \
                   [step_bwd(u, cl.grad_bytes)]
            t += sum(max(piece, r) for r in ring)
        t += sum(coll(u.other_numel, cl.grad_bytes) for u in other)  # bucketed, at the end of backward
        return {"step_s": t, "compute_s": compute, "flops": flops}
    raise ValueError(f"unknown schedule {schedule!r}")


def recommend(cl: Cluster) -> dict:
    """Bucket and min_fuse_numel for which the per-step latency stays under 5% / 10% of the transfer."""
    bucket_bytes = 20 * cl.latency_s * cl.bytes_per_s
    fuse_bytes = 10 * cl.latency_s * cl.bytes_per_s
    return {"bucket_mb": max(1.0, round(bucket_bytes / 2**20, 1)),
            "min_fuse_numel": int(2 ** math.ceil(math.log2(max(fuse_bytes / cl.param_bytes, 1))))}


def predict(model: tuple, cl: Cluster, tokens: int, seq: int) -> dict[str, dict]:
    units = units_for(*model, tokens=tokens, seq=seq)
    out = {}
    for schedule in ("no_overlap", "slicing", "fused"):
        r = simulate(units, cl, schedule)
        r["exposed_s"] = max(r["step_s"] - r["compute_s"], 0.0)
        r["mfu"] = r["flops"] / (r["step_s"] * cl.flops_per_s)
        out[schedule] = r
    return out


def load_model(spec: str) -> tuple:
    if spec in KNOWN_MODELS:
        return KNOWN_MODELS[spec]
    try:
        with open(spec) as f:
            c = json.load(f)
    except OSError:
        raise SystemExit(f"plan: --model {spec!r} is neither a known shape ({', '.join(KNOWN_MODELS)}) nor a "
                         f"readable HF config.json") from None
    try:
        hidden = c.get("hidden_size", c.get("n_embd"))
        heads = c.get("num_attention_heads", c.get("n_head"))
        return (hidden, c.get("intermediate_size", c.get("n_inner") or 4 * hidden),
                c.get("num_hidden_layers", c.get("n_layer")), heads, c.get("num_key_value_heads", heads),
                c["vocab_size"])
    except (KeyError, TypeError):
        raise SystemExit(f"plan: {spec} lacks hidden_size / num_hidden_layers / num_attention_heads / "
                         f"vocab_size") from None


def calibrate(path: str, latency_us: float) -> int:
    with open(path) as f:
        bench = json.load(f)
    m = bench["model"]
    model = (m["hidden"], m["intermediate"], m["layers"], m["heads"], m["heads"], m["vocab"])
    tokens, seq, world = m["batch"] * m["seq"], m["seq"], bench["world_size"]
    units = units_for(*model, tokens=tokens, seq=seq)
    flops = 3 * sum(u.flops for u in units)
    zero3_bytes = sum(3 * (u.fused_numel + u.other_numel) * 4 * (world - 1) / world for u in units)
    names = {"fused": "fused", "slicing": "slicing"}
    print(f"calibration against {path}: {world} ranks, fp32, {tokens} tokens per rank")
    print(f"{'rate Mbit/s':>11} {'F GFLOP/s':>10} {'B MB/s':>8} {'schedule':>9} {'predicted s':>11} {'measured s':>10} "
          f"{'error':>7}")
    worst = 0.0
    for rate in sorted({r["rate_mbit"] for r in bench["records"]}):
        rows = {r["schedule"]: r for r in bench["records"] if r["rate_mbit"] == rate}
        if "compute_only" not in rows or "comm_only" not in rows:
            continue
        f_rate = flops / rows["compute_only"]["step_s"]
        b_rate = zero3_bytes / rows["comm_only"]["step_s"]
        cl = Cluster(world, b_rate, latency_us * 1e-6, f_rate, param_bytes=4, grad_bytes=4)
        for schedule, measured_name in names.items():
            if measured_name not in rows:
                continue
            predicted = simulate(units, cl, schedule)["step_s"]
            measured = rows[measured_name]["step_s"]
            error = predicted / measured - 1
            worst = max(worst, abs(error))
            print(f"{rate:>11g} {f_rate / 1e9:>10.1f} {b_rate / 1e6:>8.1f} {schedule:>9} {predicted:>11.3f} "
                  f"{measured:>10.3f} {error:>+7.1%}")
    print(f"worst error {worst:.1%}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commfuse-dp plan", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-7b", help=f"known shape ({', '.join(KNOWN_MODELS)}) or an HF "
                                                            f"config.json path")
    parser.add_argument("--ranks", type=int, default=8, help="data-parallel ranks")
    parser.add_argument("--link-gbps", type=float, default=50.0, help="per-rank link, GB/s (bytes)")
    parser.add_argument("--latency-us", type=float, default=15.0, help="fixed cost of one ring step, microseconds")
    parser.add_argument("--tflops", type=float, default=400.0, help="achievable TFLOP/s per rank")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank per step")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes per parameter / gradient element")
    parser.add_argument("--calibrate", metavar="BENCH_JSON", help="compare with a `commfuse-dp bench --json` file")
    args = parser.parse_args(argv)
    if args.calibrate:
        return calibrate(args.calibrate, args.latency_us)
    for name in ("ranks", "tokens", "seq", "dtype_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("link_gbps", "tflops"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    model = load_model(args.model)
    cl = Cluster(args.ranks, args.link_gbps * 1e9, args.latency_us * 1e-6, args.tflops * 1e12,
                 args.dtype_bytes, args.dtype_bytes)
    results = predict(model, cl, args.tokens, args.seq)
    print(f"{args.model}: {args.ranks} ranks, {args.link_gbps:g} GB/s links, {args.latency_us:g} us per ring step, "
          f"{args.tflops:g} TFLOP/s, {args.tokens} tokens per rank")
    print(f"{'schedule':>11} {'step s':>8} {'exposed comm s':>14} {'MFU':>6}")
    for schedule, r in results.items():
        print(f"{schedule:>11} {r['step_s']:>8.3f} {r['exposed_s']:>14.3f} {r['mfu']:>6.1%}")
    rec = recommend(cl)
    print(f"recommended: CommFuseConfig(bucket_mb={rec['bucket_mb']:g}, min_fuse_numel={rec['min_fuse_numel']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
