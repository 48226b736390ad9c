"""Two versions of the library, benched one after the other in turn (a, b, a, b, ...): the record behind a
"not slower" claim for a change to the hot path.

    python -m benchmarks.checkout_ab --a 4a90a51 --b HEAD --alternations 3 \\
        --json benchmarks/results/2ranks-real-layer-call-ab.json -- \\
        --num-processes 2 --link-gbps 0.265 --rounds 2 --steps 3 --variants fused,fsdp2_overlap,compute_only

Each version is a ``git worktree`` of its commit in ``--work-dir``; each run is ``commfuse-dp bench ARGS`` from
that worktree (its ``commfuse_dp`` and ``benchmarks`` first on ``PYTHONPATH``, for the bench and its ranks). The
file keeps every run's bench file whole and, per version, the median, lowest and highest over its runs of the
step of each variant, of the fused step over ``compute_only`` and of the peer (``fsdp2_overlap``) over the fused
step.
Run it on an otherwise idle machine; alternating spreads what drifts over the run evenly on both versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def checkout(commit: str, work: str, name: str) -> tuple[str, str]:
    """A worktree of ``commit`` at ``work/name``; returns its path and the full commit."""
    full = _git("rev-parse", commit)
    path = os.path.join(work, name)
    if os.path.exists(path):
        _git("worktree", "remove", "--force", path)
    _git("worktree", "add", "--detach", path, full)
    return path, full


def venv(tree: str) -> str:
    """A virtual environment beside ``tree`` that sees this interpreter's packages, with ``tree`` installed
    editable (for versions whose ``benchmarks`` a ``package-dir`` mapping installed as ``commfuse_dp.benchmarks``);
    returns its python."""
    path = tree + "-venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", path], check=True)
    python = os.path.join(path, "bin", "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", tree],
                   check=True, capture_output=True)
    return python


def bench(tree: str, args: list[str], out: str, python: str | None = None) -> dict:
    """``commfuse-dp bench ARGS --json out`` from the worktree ``tree`` (``python``: a venv's, which has it
    installed; else this one, with ``tree`` first on ``PYTHONPATH``); its results file."""
    env = dict(os.environ)
    if python is None:
        env["PYTHONPATH"] = os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [python or sys.executable, "-m", "commfuse_dp.cli", "bench", *args, "--json", out,
               "--out-dir", out.removesuffix(".json") + "-out"]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"checkout_ab: {' '.join(command)} failed in {tree} (exit {done.returncode}):\n"
                         f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def figures(result: dict) -> dict[str, float]:
    """Each variant's step, fused over compute_only and the peer over fused, from one bench file (first rate)."""
    steps: dict[str, float] = {}
    for record in result["records"]:
        steps.setdefault(record["schedule"], record["step_s"])
    out = {f"{name}_step_s": step for name, step in steps.items() if name != "compute_only"}
    if "compute_only" in steps:
        out["fused_over_compute_only"] = steps["fused"] / steps["compute_only"]
    if "fsdp2_overlap" in steps:
        out["peer_over_fused"] = steps["fsdp2_overlap"] / steps["fused"]
    return out


def summary(runs: list[dict[str, float]]) -> dict[str, list[float]]:
    return {key: [round(statistics.median(r[key] for r in runs), 4), round(min(r[key] for r in runs), 4),
                  round(max(r[key] for r in runs), 4)] for key in runs[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkout_ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="the version before (a commit)")
    parser.add_argument("--b", default="HEAD", help="the version after (default: HEAD)")
    parser.add_argument("--alternations", type=int, default=3, help="runs of each version, in turn (default 3)")
    parser.add_argument("--work-dir", default=None, help="where the worktrees and the runs go (default: a temporary "
                                                          "folder)")
    parser.add_argument("--json", required=True, help="the results file to write")
    parser.add_argument("--venvs", action="store_true", help="install each version into a virtual environment of "
                                                             "its own (versions older than the package's folder layout)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the arguments of commfuse-dp bench")
    args = parser.parse_args(argv)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if args.alternations < 1:
        parser.error(f"--alternations must be at least 1, got {args.alternations}")
    work = args.work_dir or tempfile.mkdtemp(prefix="checkout-ab-")
    trees = {name: checkout(commit, work, name) for name, commit in (("a", args.a), ("b", args.b))}
    runs: dict[str, dict] = {}
    began = time.perf_counter()
    try:
        pythons = {name: venv(tree) if args.venvs else None for name, (tree, _) in trees.items()}
        for i in range(1, args.alternations + 1):
            for name in ("a", "b"):
                out = os.path.join(work, f"{name}-{i}.json")
                print(f"checkout_ab: {name}-{i} ({trees[name][1][:7]}) ...", flush=True)
                runs[f"{name}-{i}"] = bench(trees[name][0], bench_args, out, pythons[name])
                print(f"checkout_ab: {name}-{i}: " + ", ".join(f"{k} {v:.4g}" for k, v in
                                                             figures(runs[f'{name}-{i}']).items()), flush=True)
    finally:
        for tree, _ in trees.values():
            _git("worktree", "remove", "--force", tree)
    record = {
        "command": "python -m benchmarks.checkout_ab " + " ".join(argv if argv is not None else sys.argv[1:]),
        "versions": {name: full for name, (_, full) in trees.items()},
        "summary_format": "median, lowest, highest over the runs of each version",
        "summary": {name: summary([figures(runs[f"{name}-{i}"]) for i in range(1, args.alternations + 1)])
                    for name in ("a", "b")},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "wall_s": round(time.perf_counter() - began, 1),
        "runs": runs,
    }
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
    for name in ("a", "b"):
        print(f"checkout_ab: {name} {record['versions'][name][:7]}: " +
              ", ".join(f"{k} {v[0]} [{v[1]}-{v[2]}]" for k, v in record["summary"][name].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
