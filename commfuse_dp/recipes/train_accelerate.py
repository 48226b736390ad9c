"""The causal-LM fine-tune of finetune_clm.py as a plain accelerate training loop.

    # Unchanged accelerate script, commfuse from the config file's commfuse: block (2 CPU processes):
    commfuse-dp launch --config_file commfuse_dp/recipes/configs/accelerate_cpu_commfuse.yaml \\
        commfuse_dp/recipes/train_accelerate.py --output_dir runs/accel
    # CommFuseAccelerator in code instead (--commfuse), launched by torchrun:
    torchrun --nproc_per_node 2 commfuse_dp/recipes/train_accelerate.py --commfuse --output_dir runs/accel
    # Plain accelerate (DDP), for comparison:
    torchrun --nproc_per_node 2 commfuse_dp/recipes/train_accelerate.py --output_dir runs/accel-ddp
    # One process:
    python commfuse_dp/recipes/train_accelerate.py --output_dir runs/accel-1proc
    # Installed (no checkout): -m commfuse_dp.recipes.train_accelerate instead of the path

Same embedded default and data options as finetune_clm.py (``--model_name_or_path``, ``--dataset_name``, ...). The loop uses
``accelerator.accumulate``, ``backward``, ``clip_grad_norm_``, ``gather_for_metrics``, a tqdm bar on rank 0,
``save_state`` every ``--save_steps`` (``--resume_from`` a saved state folder continues from it; ``--auto_resume``
the newest complete one in ``--output_dir``, if any, so that a job ``commfuse-dp launch --max_restarts N`` restarts
carries on; ``--async_save`` writes the sharded part of each state in the background), and writes what
finetune_clm.py writes: ``model/`` (consolidated, with the tokenizer), ``loss.png``, ``timeline.png``,
``trace.json`` and ``summary.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from commfuse_dp.handle import engine_of
from commfuse_dp.launch import bootstrap
from commfuse_dp.recipes import common
from commfuse_dp.recipes.finetune_clm import ClmArguments, prepare_inputs


@dataclass
class LoopArguments(ClmArguments):
    output_dir: str = field(default="runs/accel", metadata={"help": "where the model, figures and states go"})
    commfuse: bool = field(default=False, metadata={
        "help": "use CommFuseAccelerator in code (config from --commfuse_config or COMMFUSE_*); without it the "
                "script is a plain accelerate script, sharded only when launched by commfuse-dp launch"})
    max_steps: int = field(default=60, metadata={"help": "optimizer steps"})
    per_device_train_batch_size: int = field(default=4)
    per_device_eval_batch_size: int = field(default=4)
    gradient_accumulation_steps: int = field(default=1)
    learning_rate: float = field(default=2e-3)
    max_grad_norm: float = field(default=1.0)
    logging_steps: int = field(default=5)
    save_steps: int = field(default=0, metadata={"help": "save_state every N steps (0: never)"})
    resume_from: str | None = field(default=None, metadata={"help": "a save_state folder to continue from"})
    mixed_precision: str = field(default="no", metadata={"help": "no | bf16 | fp16 (accelerate's)"})
    seed: int = field(default=0)


def _accelerator(args: LoopArguments, cfg):
    from accelerate import Accelerator

    kwargs = {"gradient_accumulation_steps": args.gradient_accumulation_steps}
    if args.mixed_precision != "no":
        kwargs["mixed_precision"] = args.mixed_precision
    if args.commfuse:
        from commfuse_dp.integrations.accelerate import CommFuseAccelerator

        return CommFuseAccelerator(commfuse=cfg, **kwargs)
    if not torch.cuda.is_available():
        kwargs["cpu"] = True
    return Accelerator(**kwargs)


def main(argv: list[str] | None = None) -> int:
    from transformers import HfArgumentParser

    common.warn_renamed(argv)
    (args,) = HfArgumentParser(LoopArguments, description=__doc__.split("\n\n")[0]).parse_args_into_dataclasses(
        args=argv)
    rank, world = common.world()
    try:
        if args.async_save and not (args.commfuse or bootstrap.enabled()):
            raise common.RecipeError("--async_save writes commfuse's sharded state in the background, and this run "
                                     "is not sharded: add --commfuse, or launch with commfuse-dp launch")
        if args.auto_resume and not args.save_steps:
            raise common.RecipeError("--auto_resume resumes from this run's states, and --save_steps 0 writes none: "
                                     "add --save_steps N")
        if args.auto_resume and args.resume_from is None:
            args.resume_from = newest_state(args.output_dir)   # None: start at step 0
        if args.resume_from is None:
            common.check_output_dir(args.output_dir, args.overwrite_output_dir or args.auto_resume)
        elif not os.path.isdir(args.resume_from):
            raise common.RecipeError(f"--resume_from {args.resume_from} is not a folder")
        model, tokenizer, train, evaluation, info = prepare_inputs(
            args, world, args.per_device_train_batch_size, args.gradient_accumulation_steps,
            args.per_device_eval_batch_size)
        cfg = common.commfuse_config(args.commfuse_config) if args.commfuse else None
        if args.async_save and cfg is not None:
            cfg = cfg.replace(async_save=True)
        elif args.async_save:   # commfuse-dp launch: the CommFuseAccelerator that replaces Accelerator reads this
            os.environ["COMMFUSE_ASYNC_SAVE"] = "1"
    except common.RecipeError as exc:
        common.fail(str(exc))
    return run(args, model, tokenizer, train, evaluation, cfg, info)


def evaluate(accelerator, model, loader) -> float:
    model.eval()
    losses = []
    with torch.no_grad():
        for batch in loader:
            loss = model(**batch).loss
            losses.append(accelerator.gather_for_metrics(loss.detach().reshape(1)))
    model.train()
    return float(torch.cat(losses).mean())


def _prepared(args, model, train, evaluation, cfg):
    """The accelerator and what it prepared: the model, AdamW, the loaders and the schedule."""
    torch.manual_seed(args.seed)
    accelerator = _accelerator(args, cfg)
    # before prepare: re-pointed. fused: one kernel per step, as the Trainer's default (adamw_torch_fused); torch's
    # default foreach path dispatches each of its list operations through the DTensor shards (docs/performance.md)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, fused=True)
    # linear decay; accelerate steps a prepared scheduler once per process for every optimizer step
    total = args.max_steps * accelerator.num_processes + 1
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1.0 - s / total))
    # In order (no shuffling): the data position after a resume is the number of batches consumed.
    train_loader = torch.utils.data.DataLoader(train, batch_size=args.per_device_train_batch_size)
    eval_loader = torch.utils.data.DataLoader(evaluation, batch_size=args.per_device_eval_batch_size)
    return (accelerator, *accelerator.prepare(model, optimizer, train_loader, eval_loader, scheduler))


class _Window:
    """The logging window: the losses, tokens and exposed communication since the last log line."""

    def __init__(self) -> None:
        self.start, self.tokens, self.losses, self.exposed = time.perf_counter(), 0, [], []

    def entry(self, accelerator, step: int, scheduler) -> dict:
        """The log line of the window, which starts again."""
        mean = float(accelerator.gather_for_metrics(torch.stack(self.losses).mean().reshape(1)).mean())
        now = time.perf_counter()
        entry = {"step": step, "loss": mean, "learning_rate": scheduler.get_last_lr()[0],
                 "tokens_per_s": self.tokens / (now - self.start)}
        if self.exposed:
            entry["commfuse/exposed_comm_s"] = sum(self.exposed) / len(self.exposed)
        self.start, self.tokens, self.losses, self.exposed = now, 0, [], []
        return entry


def _save(accelerator, args, step: int, sharded: bool) -> None:
    folder = os.path.join(args.output_dir, f"state-{step}")
    accelerator.save_state(folder)   # (--async_save: folder/commfuse completes in the background)
    accelerator.wait_for_everyone()   # step.json, written last, marks a state every rank finished
    if accelerator.is_main_process:
        with open(os.path.join(folder, "step.json"), "w") as f:
            json.dump({"step": step, "sharded": sharded}, f)


def _train(args, accelerator, model, optimizer, train_loader, scheduler, step: int, sharded: bool):
    """The loop from ``step`` to ``--max_steps``: (the last step, the log, one step's timeline or None)."""
    from tqdm.auto import tqdm

    import commfuse_dp as cf
    from commfuse_dp.timeline import record_timeline

    history: list[dict] = []
    timeline = None
    bar = tqdm(total=args.max_steps, initial=step, disable=not accelerator.is_main_process, desc="training")
    window = _Window()
    skip = (step * args.gradient_accumulation_steps) % len(train_loader)
    while step < args.max_steps:
        batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        skip = 0
        for batch in batches:
            recording = record_timeline() if step + 1 == args.timeline_step and timeline is None else None
            events = recording.__enter__() if recording is not None else None
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window.losses.append(loss.detach())
            window.tokens += batch["input_ids"].numel() * accelerator.num_processes
            if sharded:
                window.exposed.append(cf.step_stats(model).exposed_comm_s)
            if recording is not None:
                recording.__exit__(None, None, None)
                timeline = _gather(accelerator, events.events)
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            if step % args.logging_steps == 0 or step == args.max_steps:
                history.append(window.entry(accelerator, step, scheduler))
                if accelerator.is_main_process:
                    bar.write(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in history[-1].items()}))
            if args.save_steps and step % args.save_steps == 0:
                _save(accelerator, args, step, sharded)
            if step >= args.max_steps:
                break
    bar.close()
    return step, history, timeline


def run(args, model, tokenizer, train, evaluation, cfg, info) -> int:
    from commfuse_dp.ring.topology import drain_gloo_workers

    accelerator, model, optimizer, train_loader, eval_loader, scheduler = _prepared(args, model, train, evaluation, cfg)
    sharded = engine_of(model) is not None
    accelerator.print(f"{type(accelerator).__name__}, {accelerator.num_processes} process(es), "
                      f"{'commfuse-sharded' if sharded else 'not sharded'} model")
    step = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        step = _saved_step(args.resume_from)
        accelerator.print(f"resuming from {args.resume_from} (step {step})")
    elif args.auto_resume:
        accelerator.print(f"auto_resume: no complete state in {args.output_dir}; starting at step 0")
    before = evaluate(accelerator, model, eval_loader)
    step, history, timeline = _train(args, accelerator, model, optimizer, train_loader, scheduler, step, sharded)
    after = evaluate(accelerator, model, eval_loader)
    model_dir = os.path.join(args.output_dir, "model")
    state = accelerator.get_state_dict(model)          # every rank: gathered onto rank 0 for a sharded model
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(model_dir, state_dict=state)
        tokenizer.save_pretrained(model_dir)
        history.append({"step": step, "eval_loss": after})
        paths = common.write_figures(args.output_dir, history, timeline,
                                     f"train_accelerate: {accelerator.num_processes} process(es)")
        summary = {**info, "world_size": accelerator.num_processes, "accelerator": type(accelerator).__name__,
                   "sharded": sharded, "async_save": bool(getattr(accelerator, "commfuse_config", None)
                                                          and accelerator.commfuse_config.async_save),
                   "eval_loss_before": before, "eval_loss_after": after,
                   "train_losses": [e["loss"] for e in history if "loss" in e], "steps": step,
                   "tokens_per_s": common.mean_recent(history, "tokens_per_s", 10),
                   "exposed_comm_s": common.mean_recent(history, "commfuse/exposed_comm_s", 10),
                   "model_dir": model_dir, **paths,
                   "generate": f"python -m commfuse_dp.recipes.generate {model_dir} --prompt \"The assert statement\""}
        common.write_summary(args.output_dir, summary)
        print(json.dumps(summary, indent=1))
    accelerator.wait_for_everyone()
    drain_gloo_workers()   # before the groups go, also a plain Accelerator's (commfuse_dp/ring/topology.py)
    accelerator.end_training()
    return 0


def newest_state(output_dir: str) -> str | None:
    """The ``state-N`` folder of ``output_dir`` with the highest N that is complete: its ``step.json`` was written
    (the state's last file, written once every rank's part was) and, for a sharded run, its ``commfuse`` folder is
    complete (with ``--async_save`` it is written in the background after ``step.json``). A state whose save was
    cut short is passed over."""
    import re

    from commfuse_dp import checkpoint as ck
    from commfuse_dp.integrations.accelerate import CHECKPOINT_SUBDIR

    def complete(folder: str) -> bool:
        try:
            with open(os.path.join(folder, "step.json")) as f:
                sharded = json.load(f).get("sharded", False)
        except (OSError, ValueError):
            return False
        return not sharded or ck.is_complete(os.path.join(folder, CHECKPOINT_SUBDIR))

    found = [(int(m.group(1)), name) for name in (os.listdir(output_dir) if os.path.isdir(output_dir) else ())
             if (m := re.fullmatch(r"state-(\d+)", name)) and complete(os.path.join(output_dir, name))]
    return os.path.join(output_dir, max(found)[1]) if found else None


def _saved_step(folder: str) -> int:
    path = os.path.join(folder, "step.json")
    if not os.path.isfile(path):
        common.fail(f"--resume_from {folder} has no step.json (not a state saved by this recipe)")
    with open(path) as f:
        return int(json.load(f)["step"])


def _gather(accelerator, events: list[dict]) -> list[list[dict]]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [events]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, events)
    return gathered


if __name__ == "__main__":
    sys.exit(main())
