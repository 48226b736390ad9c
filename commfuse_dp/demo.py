"""``commfuse-dp demo``: the main job on its embedded default, then a short summary.

    commfuse-dp demo                                   # 2 CPU processes, about 2-3 minutes on 2 cores
    commfuse-dp demo --max_steps 200 --output_dir runs/longer
    commfuse-dp demo --overwrite_output_dir -- --learning_rate 1e-3    # after --: more finetune_clm flags

It runs ``commfuse_dp/recipes/finetune_clm.py`` (``commfuse_dp.recipes.finetune_clm``) through ``torch.distributed.run`` with
``--nproc_per_node 2``: a small Llama-style decoder (tied embeddings, grouped-query attention) built from a config,
fine-tuned with commfuse sharding (``CommFuseTrainer``, the Trainer with ``CommFuseCallback``) on the Python
reference manual that ships with Python, tokenised by a BPE trained on it. Nothing is downloaded. It then prints
the eval loss before and after, tokens/s, the exposed communication per step, where the model, the logs and the
figures went, and the command that generates text from the saved model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import socket
import subprocess
import sys
import time

from .cli_names import spelled


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="commfuse-dp demo", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="runs/demo", help="where the model, figures and logs go "
                        "(default: %(default)s; must be empty or new unless --overwrite_output_dir)")
    parser.add_argument("--overwrite_output_dir", action="store_true", help="write into a non-empty --output_dir")
    parser.add_argument("--num_processes", type=int, default=2, help="processes (ranks) to start (default: %(default)s)")
    parser.add_argument("--max_steps", type=int, default=60, help="optimizer steps (default: %(default)s)")
    parser.add_argument("recipe_args", nargs=argparse.REMAINDER,
                        help="after --: more arguments for the recipe (see `python -m commfuse_dp.recipes."
                             "finetune_clm --help`)")
    return parser


def _line(label: str, text: str) -> str:
    return f"  {label:<14}{text}"


def summary_lines(summary: dict, log_path: str, summary_path: str, elapsed: float) -> list[str]:
    s = summary
    lines = [f"commfuse-dp demo: {s['model']}, fine-tuned on {s['data']}",
             f"  {s['world_size']} processes, {s['steps']} optimizer steps, {s['tokens_seen']} tokens, "
             f"{elapsed:.0f} s in all"]
    loss = f"{s['eval_loss_before']:.3f} -> {s['eval_loss_after']:.3f}"
    if s.get("perplexity_before") and s.get("perplexity_after"):
        loss += f"   (perplexity {s['perplexity_before']:.0f} -> {s['perplexity_after']:.0f})"
    lines.append(_line("eval loss", loss))
    if s.get("tokens_per_s"):
        lines.append(_line("throughput", f"{s['tokens_per_s']:.0f} tokens/s (all ranks)"))
    if s.get("exposed_comm_s") is not None and s.get("step_wall_s"):
        share = 100 * s["exposed_comm_s"] / s["step_wall_s"]
        lines.append(_line("exposed comm", f"{s['exposed_comm_s']:.3f} s of a {s['step_wall_s']:.3f} s step "
                           f"({share:.0f} %); the rest of the ring traffic ran under compute"))
    lines.append(_line("model", f"{s['model_dir']}   (consolidated; from_pretrained loads it)"))
    figures = [s[k] for k in ("loss_png", "timeline_png", "trace_json") if s.get(k)]
    lines.append(_line("figures", ", ".join(figures)))
    lines.append(_line("logs", f"{log_path}, {summary_path}"))
    lines.append(_line("generate", s["generate"]))
    return lines


def _refused(recipe_args: list[str]) -> str | None:
    """What the recipe's own argument parser says of ``recipe_args`` (its one error line), or None if it takes them.
    Only the parsing: the ranks build the arguments (``TrainingArguments`` sets up devices and accelerate's state,
    which this process must not). ``--help`` prints the recipe's help and exits 0 here."""
    from commfuse_dp.recipes.finetune_clm import parser

    recipe_parser, said = parser(), io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            _, left = recipe_parser.parse_known_args(recipe_args)
    except SystemExit as exc:
        if not exc.code:
            raise
        errors = [line for line in said.getvalue().splitlines() if ": error: " in line]
        return errors[-1].split(": error: ", 1)[1] if errors else said.getvalue().strip()[-300:]
    return f"not the recipe's: {' '.join(left)}" if left else None


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(spelled(sys.argv[1:] if argv is None else list(argv), parser, "demo"))
    extra = [a for a in args.recipe_args if a != "--"]
    if args.num_processes < 1 or args.max_steps < 1:
        print(f"commfuse-dp demo: {'--num_processes' if args.num_processes < 1 else '--max_steps'} must be at least 1",
              file=sys.stderr)
        return 2
    from commfuse_dp.recipes.common import RecipeError, check_output_dir

    try:  # before any process starts (the recipe checks it too, on every rank)
        check_output_dir(args.output_dir, args.overwrite_output_dir or "--overwrite_output_dir" in extra)
    except RecipeError as e:
        print(f"commfuse-dp demo: {e}", file=sys.stderr)
        return 2
    recipe_args = ["--output_dir", args.output_dir, "--max_steps", str(args.max_steps)]
    if args.overwrite_output_dir:
        recipe_args.append("--overwrite_output_dir")
    recipe_args += extra
    refused = _refused(recipe_args)
    if refused:  # before any process starts, rather than once per rank under the launcher's report
        print(f"commfuse-dp demo: the recipe's arguments: {refused} (python -m commfuse_dp.recipes.finetune_clm "
              f"--help lists them)", file=sys.stderr)
        return 2
    recipe = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.num_processes),
              "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
              "-m", "commfuse_dp.recipes.finetune_clm", *recipe_args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.num_processes)))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"commfuse-dp demo: {shlex.join([os.path.basename(sys.executable), *recipe[1:]])}", flush=True)
    began = time.perf_counter()
    chunks: list[bytes] = []
    with subprocess.Popen(recipe, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        # raw bytes, as they come: the progress bar's carriage returns reach the terminal unchanged
        while chunk := proc.stdout.read1(65536):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
            chunks.append(chunk)
        code = proc.wait()
    output = b"".join(chunks).decode("utf-8", "replace").splitlines(keepends=True)
    elapsed = time.perf_counter() - began
    summary_path = os.path.join(args.output_dir, "summary.json")
    if code != 0 or not os.path.isfile(summary_path):
        errors = [line.strip() for line in output if line.startswith("error: ")]
        reason = errors[0] if errors else f"the recipe exited with status {code}"
        print(f"commfuse-dp demo failed: {reason}", file=sys.stderr)
        return code or 1
    log_path = os.path.join(args.output_dir, "train.log")
    with open(log_path, "w") as f:
        f.writelines(output)
    with open(summary_path) as f:
        summary = json.load(f)
    print()
    print("\n".join(summary_lines(summary, log_path, summary_path, elapsed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
