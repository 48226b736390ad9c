"""How much the narrow formats on the wire cost in accuracy: the demo's fine-tune (``commfuse_dp/recipes/finetune_clm.py`` on its
embedded default, 2 CPU processes) once per setting, same data and seed, and each lossy setting's eval loss against
the exact run's.

    python -m benchmarks.wire_accuracy --max_steps 60 --json wire-60.json --png wire-60.png
    python -m benchmarks.wire_accuracy --max_steps 300 --json wire-300.json --png wire-300.png
    python -m benchmarks.wire_accuracy --max_steps 300 --seeds 0,1,2 --settings bf16,int8
    python -m benchmarks.wire_accuracy --max_steps 300 --seeds 0,1,2 --num_processes 4 --replicate 2 \
        --settings bf16,int8_int8          # across 2 copies of 2 ranks (HSDP): the formats cross the copies too

A small model trained from scratch is chaotic: any change of rounding sends the run down another path, and the
eval loss after it differs from the exact run's by more than the rounding itself costs. ``--seeds`` runs every
setting with each data order (the recipe's ``--seed``) and compares each run with the exact run of the same
order; a setting's figure is the mean of those paired differences, with their range.

Each setting runs ``commfuse-dp demo --max_steps S`` with its ``COMMFUSE_*`` variables; the runs' summaries
(``summary.json``) give the eval loss after training and the training loss every ``logging_steps``. The JSON has
the command, every run's figures and the relative differences; the PNG draws the loss curves on one plot.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from commfuse_dp.cli_names import spelled

# name: the CommFuseConfig fields it sets (the first is the exact reference)
SETTINGS = {
    "exact": {},
    "bf16": {"gather_format": "bf16", "reduce_format": "bf16"},
    "fp8": {"gather_format": "fp8", "reduce_format": "bf16"},
    "int8": {"gather_format": "int8", "reduce_format": "bf16"},
    "int8_int8": {"gather_format": "int8", "reduce_format": "int8", "error_feedback": True},
    "int8_int8_nofeedback": {"gather_format": "int8", "reduce_format": "int8"},
    "int8_b256": {"gather_format": "int8", "reduce_format": "bf16", "format_block": 256},
    "int8_int8_b256": {"gather_format": "int8", "reduce_format": "int8", "error_feedback": True, "format_block": 256},
    "int8_b64": {"gather_format": "int8", "reduce_format": "bf16", "format_block": 64},
    # exact controls: the same arithmetic in another order (the peer's schedule; lockstep's pieces), to show how far
    # apart exact runs land
    "exact_fsdp2": {"schedule": "fsdp2"},
    "exact_lockstep": {"lookahead_mb": 0},
}
LIMITS = {"bf16": 0.002}  # the most a setting's eval loss may differ from the exact run's, relative; else 1 %
DEFAULT_LIMIT = 0.01


def run(name: str, fields: dict, steps: int, out_dir: str, schedule: str, seed: int = 0, nproc: int = 2,
        replicate: int = 1) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMFUSE_")}
    env["COMMFUSE_SCHEDULE"] = schedule
    env["COMMFUSE_REPLICATE"] = str(replicate)
    for field, value in fields.items():
        env["COMMFUSE_" + field.upper()] = str(value).lower()
    where = os.path.join(out_dir, f"{name}-seed{seed}")
    argv = [sys.executable, "-m", "commfuse_dp.demo", "--max_steps", str(steps), "--nproc", str(nproc),
            "--output_dir", where, "--overwrite_output_dir", "--", "--seed", str(seed)]
    began = time.time()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: the demo failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(os.path.join(where, "summary.json")) as f:
        summary = json.load(f)
    return {"setting": name, "seed": seed, "config": fields, "nproc": nproc, "replicate": replicate, "eval_loss_before": summary["eval_loss_before"],
            "eval_loss_after": summary["eval_loss_after"], "train_losses": summary["train_losses"],
            "wire": summary.get("wire"), "step_wall_s": summary.get("step_wall_s"),
            "seconds": round(time.time() - began, 1)}


def plot(records: list[dict], path: str, steps: int) -> None:
    """The loss curves of the first data order's runs, one line per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = records[0]["seed"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in records:
        if r["seed"] != first:
            continue
        xs, ys = zip(*r["train_losses"])
        ax.plot(xs, ys, label=f"{r['setting']} (eval {r['eval_loss_after']:.4f})", linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ranks, copies = records[0].get("nproc", 2), records[0].get("replicate", 1)
    where = f"{copies} copies x {ranks // copies} ranks (HSDP)" if copies > 1 else f"{ranks} ranks"
    ax.set_title(f"finetune_clm, embedded default, {where}, {steps} steps, seed {first}: formats on the wire")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(records: list[dict]) -> list[dict]:
    """Per setting: each run's eval loss relative to the exact run of the same data order, their mean and range,
    and whether the mean is within the setting's limit (``LIMITS``; exact controls always are)."""
    exact = {r["seed"]: r["eval_loss_after"] for r in records if r["setting"] == "exact"}
    for r in records:
        r["relative_to_exact"] = r["eval_loss_after"] / exact[r["seed"]] - 1
    rows = []
    for name in dict.fromkeys(r["setting"] for r in records):
        rel = [r["relative_to_exact"] for r in records if r["setting"] == name]
        mean, limit = sum(rel) / len(rel), LIMITS.get(name, DEFAULT_LIMIT)
        control = name.startswith("exact")
        rows.append({"setting": name, "runs": len(rel), "relative_mean": mean, "relative_min": min(rel),
                     "relative_max": max(rel), "limit": None if control else limit,
                     "within": True if control else abs(mean) <= limit})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max_steps", type=int, default=60, help="optimizer steps per run (default 60, the demo's)")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated subset of {','.join(SETTINGS)} (exact always runs first)")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated data orders (the recipe's --seed); every setting runs with each, and "
                             "is compared with the exact run of the same order (default 0)")
    parser.add_argument("--schedule", default="fused", help="COMMFUSE_SCHEDULE of every run (default fused)")
    parser.add_argument("--num_processes", dest="nproc", metavar="N", type=int, default=2, help="ranks of every run (default 2)")
    parser.add_argument("--replicate", type=int, default=1,
                        help="CommFuseConfig.replicate of every run: copies of the model (HSDP), each sharded over "
                             "nproc / replicate ranks, the formats crossing the copies too (default 1)")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--png", help="draw the loss curves (of the first seed) here")
    parser.add_argument("--work_dir", help="where the runs' output folders go (default: a temporary folder)")
    args = parser.parse_args(spelled(sys.argv[1:] if argv is None else list(argv), parser, "wire_accuracy"))
    names = ["exact"] + [n for n in args.settings.split(",") if n and n != "exact"]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {','.join(SETTINGS)}")
    if args.nproc < 1 or args.replicate < 1 or args.nproc % args.replicate:
        parser.error(f"--replicate {args.replicate} must divide --num_processes {args.nproc} (copies of equal size)")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: give comma-separated integers, e.g. 0,1,2")
    records = []
    with tempfile.TemporaryDirectory(prefix="wire-accuracy-") as tmp:
        out_dir = args.work_dir or tmp
        for seed in seeds:
            for name in names:
                print(f"{name}, seed {seed}: {args.max_steps} steps ...", flush=True)
                records.append(run(name, SETTINGS[name], args.max_steps, out_dir, args.schedule, seed, args.nproc,
                                   args.replicate))
                print(f"  eval loss {records[-1]['eval_loss_after']:.5f} ({records[-1]['seconds']:.0f} s)",
                      flush=True)
    rows = summarize(records)
    print(f"\neval loss after {args.max_steps} steps, relative to the exact run of the same seed "
          f"(seeds {','.join(map(str, seeds))}): mean [min, max]")
    for row in rows:
        verdict = "" if row["setting"] == "exact" else "  (exact: a control)" if row["limit"] is None else \
            f"  (limit {100 * row['limit']:.1f} %: {'ok' if row['within'] else 'OVER'})"
        print(f"  {row['setting']:<22} {100 * row['relative_mean']:+.3f} % [{100 * row['relative_min']:+.3f}, "
              f"{100 * row['relative_max']:+.3f}]{verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python -m benchmarks.wire_accuracy", *(argv or sys.argv[1:])]),
                       "max_steps": args.max_steps, "seeds": seeds, "nproc": args.nproc, "replicate": args.replicate, "summary": rows, "records": records}, f, indent=1)
    if args.png:
        plot(records, args.png, args.max_steps)
    return 0 if all(row["within"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
