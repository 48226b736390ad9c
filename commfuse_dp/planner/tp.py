"""The planner's play of sequence-parallel tensor parallelism (``commfuse-dp plan --tp N``): fused TPSP (each
activation hop beside a GEMM piece, ``commfuse_dp/tp/rings.py``) against the schedule that waits for each
collective where it is issued (DTensor's sequence parallelism, as torchtitan applies it).

Per decoder layer, the forward has four ring operations (q/k/v gathered, o reduce-scattered, gate/up gathered,
down reduce-scattered) and the model two more (the embedding's reduce-scatter, the lm_head's gather); the backward
the same with gather and reduce-scatter swapped. Each is N-1 hops of one rank's rows (``T/N x H`` activations, a
hop costing ``latency + bytes / link``) beside N pieces of its GEMM (``c = FLOPs / N / rate``). A fused operation
takes ``(N-1) max(c, h) + c``: a gather's last piece and a reduce-scatter's first have no hop beside them. In the
backward a column-parallel operation's pieces also carry the weight gradient (one piece later, so that the first
is the input gradient alone) and a row-parallel one's the output gradient's two GEMMs. The embedding has no GEMM:
its hops are exposed. Attention is compute alone (``4 T S H / N`` FLOPs forward, as torch's flop counter counts
the full score matrix), twice that backward. The waiting schedule takes compute plus every hop.

What is not played: norms, activations, softmax and the optimizer (host work, the same for both), and async TP
(CUDA only); its published end-to-end gain (1.09-1.10x in torchtitan, Llama 3 8B and 70B at TP 8) is printed
beside the fused one.
"""

from __future__ import annotations

from dataclasses import dataclass

ASYNC_TP_GAIN = 1.10  # torchtitan's async TP, end to end (Llama 3 8B FSDP8xTP8 on 64 H100, 70B FSDP32xTP8 on 256)


@dataclass(frozen=True)
class TPCluster:
    tp: int
    link_bytes_per_s: float  # each rank's link to its TP neighbours, one way
    latency_s: float  # fixed cost of one hop
    flops_per_s: float  # achievable, per rank
    dtype_bytes: int  # activations on the wire


def _op(c: float, h: float, n: int, pieces: list[float] | None = None) -> float:
    """One ring operation of N-1 hops of ``h`` beside N pieces: ``pieces`` (default N of ``c``), the first beside
    hop 0 for a gather, the last alone; given explicitly for a reduce-scatter (the first alone)."""
    if pieces is None:  # a gather: piece k beside hop k, the last alone
        return sum(max(c, h) for _ in range(n - 1)) + c
    return pieces[0] + sum(max(p, h) for p in pieces[1:])


def play(shape: tuple, tokens: int, seq: int, cl: TPCluster) -> dict:
    """Seconds of one step (forward and backward) of the model ``shape`` (hidden, intermediate, layers, heads, kv
    heads, vocab) on ``tokens`` tokens in sequences of ``seq``: fused, waiting, compute alone, communication
    alone, and the fused step's exposed communication."""
    hidden, inner, layers, heads, kv, vocab = shape
    n, rate = cl.tp, cl.flops_per_s
    head_dim = hidden // heads
    rows = -(-tokens // n)
    h = cl.latency_s + rows * hidden * cl.dtype_bytes / cl.link_bytes_per_s if n > 1 else 0.0

    def gemm(out: int, inp: int) -> float:  # one piece: the rows of one shard
        return 2 * rows * inp * out / n / rate

    qkv, o = gemm((heads + 2 * kv) * head_dim, hidden), gemm(hidden, heads * head_dim)
    gate_up, down, head = gemm(2 * inner, hidden), gemm(hidden, inner), gemm(vocab, hidden)
    attention = 4 * tokens * seq * heads * head_dim / n / rate
    columns, row_ops = (qkv, gate_up), (o, down)
    fwd = layers * (sum(_op(c, h, n) for c in columns) + sum(_op(c, h, n, [c] * n) for c in row_ops)
                    + attention) + (n - 1) * h + _op(head, h, n)

    def column_back(c: float) -> float:  # dx part, then dx part + the weight gradient of the shard before
        return _op(c, h, n, [c] + [2 * c] * (n - 2) + [3 * c] if n > 1 else [2 * c])

    bwd = layers * (sum(column_back(c) for c in columns) + sum(_op(2 * c, h, n) for c in row_ops)
                    + 2 * attention) + (n - 1) * h + column_back(head)
    compute = 3 * (layers * (n * sum(columns + row_ops)) + n * head) + 3 * layers * attention
    comm = (8 * layers + 4) * (n - 1) * h
    fused = fwd + bwd
    return {"fused_s": fused, "waiting_s": compute + comm, "compute_s": compute, "comm_s": comm,
            "exposed_s": fused - compute, "gain": (compute + comm) / fused}


def print_play(name: str, shape: tuple, tokens: int, seq: int, clusters: dict[str, TPCluster]) -> list[dict]:
    """One line per cluster: both schedules' steps, the fused gain and async TP's published one."""
    records = []
    print(f"{name} at TP {next(iter(clusters.values())).tp}, {tokens} tokens a step in sequences of {seq}:")
    for label, cl in clusters.items():
        r = play(shape, tokens, seq, cl)
        beats = "beats" if r["gain"] > ASYNC_TP_GAIN else "does not beat"
        print(f"  {label}: fused {r['fused_s'] * 1e3:.1f} ms, waiting (DTensor) {r['waiting_s'] * 1e3:.1f} ms "
              f"(compute {r['compute_s'] * 1e3:.1f}, communication {r['comm_s'] * 1e3:.1f}, exposed when fused "
              f"{r['exposed_s'] * 1e3:.1f}): {r['gain']:.2f}x, {beats} async TP's published {ASYNC_TP_GAIN:.2f}x")
        records.append({"cluster": label, **r})
    return records


def calibrate(path: str, latency_us: float | None) -> int:
    """Compare the play with ``benchmarks/tp_bench.py``'s results file: the bench's model and links, float32
    activations, compute at its emulated rate plus the host work its compute_only step measured over the FLOPs'
    time (added to both schedules), and the hop's fixed cost ``latency_us`` or, without it, fitted from the
    comm_only steps (their time per hop less the bytes' time, the median over the runs). Prints predicted and
    measured steps and their ratio."""
    import json
    import statistics

    with open(path) as f:
        record = json.load(f)
    m = record["model"]
    shape = (m["hidden"], m["inner"], m["layers"], m["heads"], m["heads"], m["vocab"])
    tokens = m["batch"] * m["seq"]
    hop_bytes = {run["tp"]: -(-tokens // run["tp"]) * m["hidden"] * 4 for run in record["runs"]}
    if latency_us is None:
        latency_us = max(0.0, statistics.median(
            (run["variants"]["comm_only"]["median_s"] / ((8 * m["layers"] + 4) * (run["tp"] - 1))
             - hop_bytes[run["tp"]] * 8 / (run["rate_mbit"] * 1e6)) * 1e6 for run in record["runs"]
            if run.get("dp", 1) == 1))
        said = f"hop latency {latency_us:.0f} us, fitted from comm_only"
    else:
        said = f"hop latency {latency_us:g} us"
    worst = 0.0
    runs = [run for run in record["runs"] if run.get("dp", 1) == 1]  # (the play has no data-parallel traffic)
    if not runs:
        raise SystemExit(f"commfuse-dp plan --tp --calibrate: {path} has no run of TP alone (--dp 1); the play "
                         f"leaves out the data-parallel traffic")
    for run in runs:
        cl = TPCluster(run["tp"], run["rate_mbit"] * 1e6 / 8, latency_us * 1e-6, record["tflops"] * 1e12, 4)
        r = play(shape, tokens, m["seq"], cl)
        host = run["variants"]["compute_only"]["median_s"] - r["compute_s"]
        for name, key in (("fused", "fused_s"), ("unfused", "waiting_s")):
            if name not in run["variants"]:
                continue
            got, want = run["variants"][name]["median_s"], r[key] + host
            worst = max(worst, abs(want / got - 1))
            print(f"TP {run['tp']} at {run['fraction']:g}x ({run['rate_mbit']:.0f} Mbit/s) {name}: predicted "
                  f"{want:.3f} s, measured {got:.3f} s ({want / got:.3f})")
    print(f"largest error {worst * 100:.1f} % (host work per step from compute_only; {said})")
    return 0
