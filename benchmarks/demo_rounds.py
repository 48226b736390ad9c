"""``commfuse-dp demo`` run several times, one after another, and what it printed each time: the record behind the
figures README quotes.

    python -m benchmarks.demo_rounds --rounds 3 --json benchmarks/results/demo-2cpu.json

Each round is a fresh ``commfuse-dp demo`` (its defaults: 2 CPU processes, 60 steps, the embedded model and data,
into ``runs/demo``) in ``--work-dir``, each replacing the one before (``--overwrite_output_dir``). ``demo_s`` is
the time the demo prints ("N s in all", from its start of the recipe to its end); ``wall_s`` adds the command's
own start-up. The file keeps each round's summary (``summary.json``'s figures
and the demo's own wall time), the median and range of each figure over the rounds, the machine it ran on, and
the summary lines of the median round (by wall time) as the demo printed them (``shown``), which README shows.
Run it on an otherwise idle machine: the rounds time the machine as much as the library.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

FIGURES = ("wall_s", "demo_s", "eval_loss_before", "eval_loss_after", "perplexity_before", "perplexity_after",
           "tokens_per_s", "exposed_comm_s", "step_wall_s", "tokens_seen")


def run_round(work: str, extra: list[str]) -> dict:
    """One ``commfuse-dp demo`` as README runs it (into ``runs/demo``, here under ``work``): its summary's figures,
    its wall time and what it printed at the end."""
    out_dir = os.path.join("runs", "demo")
    command = [sys.executable, "-m", "commfuse_dp.cli", "demo", "--overwrite_output_dir", *extra]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=work)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise SystemExit(f"demo_rounds: the demo failed (status {done.returncode}): " + " | ".join(tail))
    with open(os.path.join(work, out_dir, "summary.json")) as f:
        summary = json.load(f)
    lines = done.stdout.splitlines()
    first = max(i for i, line in enumerate(lines) if line.startswith("commfuse-dp demo: ") and " fine-tuned on " in line)
    said = re.search(r", (\d+) s in all$", lines[first + 1])
    return {"wall_s": wall, "demo_s": int(said.group(1)) if said else None,
            **{k: summary.get(k) for k in FIGURES if k not in ("wall_s", "demo_s")},
            "chose": summary.get("schedule"),  # what CommFuseConfig()'s auto settings became, and why
            "shown": lines[first:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo_rounds",
                                     description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.partition("\n\n")[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="demo runs, one after another (default %(default)s)")
    parser.add_argument("--json", help="write the record to this file")
    parser.add_argument("--work-dir", default=None, help="the rounds' output folders go here (default: a temporary one)")
    parser.add_argument("demo_args", nargs=argparse.REMAINDER, help="after --: more arguments for `commfuse-dp demo`")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    extra = [a for a in args.demo_args if a != "--"]
    work = args.work_dir or tempfile.mkdtemp(prefix="demo-rounds-")
    rounds = []
    for i in range(args.rounds):
        print(f"round {i + 1} of {args.rounds} ...", flush=True)
        rounds.append(run_round(work, extra))
        r = rounds[-1]
        print(f"  {r['wall_s']:.0f} s, eval loss {r['eval_loss_after']:.3f}, {r['tokens_per_s']:.0f} tokens/s, "
              f"exposed {r['exposed_comm_s']:.3f} s of {r['step_wall_s']:.3f} s", flush=True)
    spread = {}
    for k in FIGURES:
        values = [r[k] for r in rounds if r.get(k) is not None]
        if values:
            spread[k] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    by_wall = sorted(range(len(rounds)), key=lambda i: rounds[i]["wall_s"])
    shown = rounds[by_wall[len(by_wall) // 2]]["shown"]
    record = {"command": "python -m benchmarks.demo_rounds " + " ".join(sys.argv[1:] if argv is None
                                                                                      else argv),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "torch": __import__("torch").__version__},
              "rounds": rounds, "spread": spread, "shown": shown}
    print("\nover the rounds, median [lowest - highest]:")
    for k, s in spread.items():
        print(f"  {k:<18} {s['median']:.4g} [{s['min']:.4g} - {s['max']:.4g}]")
    print("\nthe median round printed:\n" + "\n".join(shown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
