"""What a checkpoint after every step costs: the step time and peak memory of training the demo's model (the CLM
recipe's embedded default: a Llama-style decoder, hidden 512, 4 layers, 4096 tokens, tied embeddings; 4 sequences
of 128 tokens per rank, AdamW) at 2 CPU ranks, with no checkpoint, with ``save_sharded`` after every step, and with
``AsyncSaver`` after every step (``--every N``: after every N-th). Each (round, variant) is its own ``torchrun``
launch, the variants interleaved round by round; a launch times ``--steps`` steps after 2 warm-up steps and reports
their mean, its peak resident memory (``VmHWM``, rank 0) and the bytes the asynchronous save's host copy holds.
``--variants`` picks some (``none`` always runs: the ratios are to it).

    python -m benchmarks.checkpoint_overhead --rounds 3 --out benchmarks/results/checkpoint-every-step.json
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

VARIANTS = ("none", "sync", "async")


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(variant: str, steps: int, folder: str, every: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import commfuse_dp as cf
    from commfuse_dp import checkpoint as ck

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1360, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = cf.shard(LlamaForCausalLM(config), cf.CommFuseConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saver = ck.AsyncSaver()
    path = os.path.join(folder, "ckpt")
    times, write_cpu = [], []
    for step in range(steps + 2):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, 4096, (4, 128), generator=gen)
        dist.barrier()
        began = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if step % every:
            pass
        elif variant == "sync":
            ck.save_sharded(path, [model], [(model, opt)], extra={"step": step})
        elif variant == "async":
            saver.save(path, [model], [(model, opt)], extra={"step": step})
            write_cpu.append(saver.write_cpu_s)  # (the write before this one: save() waited for it)
        times.append(time.perf_counter() - began)
    saver.wait()
    if rank == 0:
        print("RESULT " + json.dumps({"variant": variant, "step_s": statistics.fmean(times[2:]),
                                      "peak_bytes": _hwm_bytes(), "staged_bytes": saver.staged_bytes,
                                      "write_cpu_s": statistics.median(write_cpu[1:]) if len(write_cpu) > 1 else 0.0}),
              flush=True)
    dist.destroy_process_group()


def _launch(variant: str, steps: int, every: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="commfuse-ckpt-bench-", dir=os.environ.get("TMPDIR", "/var/tmp")) as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
               "--worker", variant, "--steps", str(steps), "--dir", tmp, "--every", str(every)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              timeout=900, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{variant}: the launch failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _summary(rows: list[dict], variants: list[str]) -> dict:
    out = {}
    base = [r for r in rows if r["variant"] == "none"]
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        ratios = [m["step_s"] / b["step_s"] for m, b in zip(mine, base)]  # paired by round
        out[variant] = {"step_s_median": statistics.median(r["step_s"] for r in mine),
                        "vs_none_median": statistics.median(ratios), "vs_none_range": [min(ratios), max(ratios)],
                        "peak_mib_median": statistics.median(r["peak_bytes"] for r in mine) / 2**20,
                        "peak_over_none_mib": [(m["peak_bytes"] - b["peak_bytes"]) / 2**20
                                               for m, b in zip(mine, base)],
                        "staged_mib": max(r["staged_bytes"] for r in mine) / 2**20,
                        "write_cpu_s_median": statistics.median(r["write_cpu_s"] for r in mine)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every variant once (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per launch, after 2 warm-up steps")
    parser.add_argument("--every", type=int, default=1, help="a checkpoint after every N-th step (default 1)")
    parser.add_argument("--variants", default="sync,async",
                        help=f"comma-separated, among {', '.join(VARIANTS)}; none always runs (default: sync,async)")
    parser.add_argument("--out", help="write the rows and the summary to this JSON file")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.steps, args.dir, args.every)
    variants = ["none"] + [v for v in VARIANTS if v != "none" and v in args.variants.split(",")]
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose among {', '.join(VARIANTS)}")
    rows = []
    for round_ in range(args.rounds):
        for variant in variants:
            row = {"round": round_, "every": args.every, **_launch(variant, args.steps, args.every)}
            rows.append(row)
            print(f"round {round_} {variant:5s}: {row['step_s'] * 1e3:7.1f} ms a step, peak "
                  f"{row['peak_bytes'] / 2**20:6.1f} MiB, host copy {row['staged_bytes'] / 2**20:5.1f} MiB",
                  flush=True)
    summary = _summary(rows, variants)
    for variant, s in summary.items():
        print(f"{variant:5s}: step {s['step_s_median'] * 1e3:.1f} ms, {s['vs_none_median']:.3f}x none "
              f"[{s['vs_none_range'][0]:.3f}-{s['vs_none_range'][1]:.3f}], peak {s['peak_mib_median']:.1f} MiB "
              f"(+{statistics.median(s['peak_over_none_mib']):.1f} MiB over none), "
              f"host copy {s['staged_mib']:.1f} MiB, a write's CPU {s['write_cpu_s_median'] * 1e3:.0f} ms")
    if args.out:
        command = "python -m benchmarks.checkpoint_overhead " + " ".join(argv or sys.argv[1:])
        with open(args.out, "w") as f:
            json.dump({"command": command, "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
