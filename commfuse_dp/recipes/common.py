"""What the recipes share: input checks that fail in one line, the report callback (tokens/s, one step's
timeline), and the figures written at the end (loss curve, timeline PNG, summary.json).

Every check here runs before anything is written, so bad input leaves no half-written output folder.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from transformers import TrainerCallback

SUMMARY = "summary.json"


class RecipeError(Exception):
    """Bad input to a recipe: printed as one line (on rank 0), exit code 2."""


def fail(message: str) -> None:
    """One line on stderr (rank 0 only, so N ranks do not print it N times), then exit 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(2)


# the recipes' deprecated option names, still accepted (HfArgumentParser aliases), and the names that replace them:
# transformers' examples' and TRL's
RENAMED = {"--model": "--model_name_or_path", "--data": "--dataset_name"}


def warn_renamed(argv: list[str] | None) -> None:
    """One warning line (rank 0 only) for each deprecated option name on the command line."""
    argv = sys.argv[1:] if argv is None else argv
    for arg in argv:
        if arg == "--":
            break
        name = arg.partition("=")[0]
        if name in RENAMED and int(os.environ.get("RANK", "0")) == 0:
            print(f"warning: {name} is deprecated; use {RENAMED[name]}", file=sys.stderr, flush=True)


def check_output_dir(path: str, overwrite: bool) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise RecipeError(f"--output_dir {path} exists and is not a folder")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise RecipeError(f"--output_dir {path} exists and is not empty; pass --overwrite_output_dir to replace it, "
                          "or choose another folder")


def check_batches(split: str, samples: int, world_size: int, per_device: int, accumulation: int = 1) -> int:
    """Every rank must get at least one full batch (a sharded model runs its collectives in lockstep: a rank
    without a batch would leave the others waiting). Returns the number of batches per rank."""
    flag = "train" if split in ("train", "training") else "eval"
    if per_device < 1:
        raise RecipeError(f"--per_device_{flag}_batch_size {per_device}: must be at least 1")
    if accumulation < 1:
        raise RecipeError(f"--gradient_accumulation_steps {accumulation}: must be at least 1")
    per_rank = samples // (world_size * per_device)
    if per_rank < accumulation or per_rank < 1:
        raise RecipeError(f"the {split} split has {samples} samples: with {world_size} ranks x batch size "
                          f"{per_device}{f' x {accumulation} accumulation steps' if accumulation > 1 else ''} "
                          f"a rank would get no full batch; use more data or a smaller batch size")
    return per_rank


def commfuse_config(path: str | None):
    """The CommFuseConfig of a YAML file (flat, or a commfuse: block), else of the COMMFUSE_* variables."""
    from commfuse_dp import CommFuseConfig

    try:
        return CommFuseConfig.from_yaml(path) if path else CommFuseConfig.from_env()
    except (OSError, ValueError) as exc:
        raise RecipeError(f"commfuse config{f' {path}' if path else ' (COMMFUSE_* variables)'}: {exc}") from None


def world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class RecipeReport(TrainerCallback):
    """Adds ``tokens_per_s`` (all ranks, since the last log) to each training log, and records the hops and
    compute pieces of training step ``timeline_step`` on every rank (gathered to rank 0 in ``self.timeline``)."""

    def __init__(self, timeline_step: int = 2) -> None:
        self.timeline_step = timeline_step
        self.timeline: list[list[dict]] | None = None
        self._recording = None
        self._last = (time.perf_counter(), 0)

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = (time.perf_counter(), state.num_input_tokens_seen)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.timeline_step and self._recording is None:
            from commfuse_dp.timeline import record_timeline

            self._recording = record_timeline()
            self._events = self._recording.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self._recording is not None:
            self._recording.__exit__(None, None, None)
            self._recording = None
            events = self._events.events
            if dist.is_initialized():
                gathered = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, events)
                self.timeline = gathered
            else:
                self.timeline = [events]

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:
            return
        now, tokens = time.perf_counter(), state.num_input_tokens_seen
        then, before = self._last
        if tokens > before and now > then:
            logs["tokens_per_s"] = round((tokens - before) / (now - then), 1)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1]["tokens_per_s"] = logs["tokens_per_s"]
        self._last = (now, tokens)


def write_figures(output_dir: str, log_history: list[dict], timeline: list[list[dict]] | None, title: str) -> dict:
    """loss.png (training loss per step, eval loss where evaluated) and timeline.png (one step, per rank)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    evals = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e and "step" in e]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths["loss_png"] = os.path.join(output_dir, "loss.png")
    fig.savefig(paths["loss_png"], dpi=110)
    plt.close(fig)
    if timeline and any(timeline):
        from commfuse_dp.plots import timeline_png
        from commfuse_dp.timeline import write_chrome_trace

        paths["timeline_png"] = os.path.join(output_dir, "timeline.png")
        timeline_png({"commfuse": timeline}, paths["timeline_png"], title)
        paths["trace_json"] = os.path.join(output_dir, "trace.json")
        write_chrome_trace(paths["trace_json"], timeline)
    return paths


def write_summary(output_dir: str, summary: dict) -> str:
    path = os.path.join(output_dir, SUMMARY)
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    return path


def mean_recent(log_history: list[dict], key: str, count: int = 3) -> float | None:
    values = [e[key] for e in log_history if key in e]
    return sum(values[-count:]) / len(values[-count:]) if values else None


def perplexity(loss: float | None) -> float | None:
    return math.exp(loss) if loss is not None and loss < 50 else None


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    torch.manual_seed(seed)
