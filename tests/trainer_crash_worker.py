"""One rank of a real ``transformers.Trainer`` run with commfuse (a ``CommFuseTrainer`` subclass), launched by
tests/test_trainer_atomic.py through torchrun: checkpoints every 2 steps, ``save_total_limit=1``, 6 steps.

    torchrun --nproc_per_node 2 tests/trainer_crash_worker.py OUT_DIR {full|crash|resume}[,...]

full:   the uninterrupted run (output OUT_DIR/run-full), per-step losses in OUT_DIR/full.json.
crash:  the same run (output OUT_DIR/run-crash), but rank 1 dies (os._exit) while checkpoint-4 is written: in the
        Trainer's _save_rng_state, after rank 0 has written checkpoint-4/trainer_state.json -- the last file a
        plain Trainer writes before it deletes older checkpoints -- and before rank 1's own rng_state_1.pth.
resume: a fresh run on OUT_DIR/run-crash: first resume_from_checkpoint=<checkpoint-4> (must be refused: the message
        is recorded), then resume_from_checkpoint=True; losses in OUT_DIR/resume.json.
asyncfull: the uninterrupted run with CommFuseConfig(async_save=True) (OUT_DIR/run-asyncfull, asyncfull.json).
auto:   CommFuseConfig(auto_resume=True, async_save=True) on OUT_DIR/run-auto: a first Trainer stops after step 4
        (its checkpoint-4 written in the background), then a second one, given no resume_from_checkpoint, resumes
        from checkpoint-4 by itself; auto.json holds the second one's steps and losses.
grow:   a first Trainer with auto_resume and async_save (OUT_DIR/run-grow) stops after step 4, then saves the full
        model and optimizer state it ended with (OUT_DIR/grow-state.pt).
grown:  launched at another world size on OUT_DIR/run-grow: a Trainer with auto_resume resumes from checkpoint-4
        by itself (DCP reshards); grown.json holds the largest difference between the state it resumed with and
        grow-state.pt, and the steps it ran.
effull, efauto: asyncfull and auto with int8 gradients and error feedback (CommFuseConfig(reduce_format="int8",
        error_feedback=True)): the residuals must come back with the checkpoint (run-effull, run-efauto).
Several modes run one after another in the same processes, each with a Trainer of its own.
"""

import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

import hf_models  # noqa: E402


def main(out_dir: str, modes: str) -> None:
    for mode in modes.split(","):
        run(out_dir, mode)
    from commfuse_dp.ring.topology import drain_gloo_workers

    drain_gloo_workers()


def run(out_dir: str, mode: str) -> None:
    from transformers import TrainerCallback, TrainingArguments

    from commfuse_dp import CommFuseConfig
    from commfuse_dp.integrations.transformers import CommFuseCallback, CommFuseTrainer

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    run_dir = os.path.join(out_dir, {"full": "run-full", "asyncfull": "run-asyncfull", "auto": "run-auto",
                                     "grow": "run-grow", "grown": "run-grow", "effull": "run-effull",
                                     "efauto": "run-efauto"}.get(mode, "run-crash"))
    feedback = {"reduce_format": "int8", "error_feedback": True} if mode in ("effull", "efauto") else {}
    config = CommFuseConfig(schedule="fused", min_fuse_numel=0,
                            async_save=mode in ("asyncfull", "auto", "grow", "grown", "effull", "efauto"),
                            auto_resume=mode in ("auto", "grow", "grown", "efauto"), **feedback)

    class CrashingTrainer(CommFuseTrainer):
        def _save_rng_state(self, output_dir):
            if mode == "crash" and rank == 1 and self.state.global_step == 4:
                deadline = time.monotonic() + 60
                while not os.path.exists(os.path.join(output_dir, "trainer_state.json")) \
                        and time.monotonic() < deadline:
                    time.sleep(0.02)
                os._exit(3)       # the forced fault: this rank dies in the middle of the checkpoint
            return super()._save_rng_state(output_dir)

    steps_run = []   # the optimizer steps this process ran (a resumed run's log_history also holds earlier ones)
    resumed_with = {}   # grown: the full state the resumed Trainer holds before its first step

    class ResumedState(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if mode == "grown" and "taken" not in resumed_with:   # (collective: every rank once)
                resumed_with.update(taken=True, state=full_state(model, optimizer))

    class StepsRun(TrainerCallback):
        def __init__(self, stop_at: int | None = None) -> None:
            self.stop_at = stop_at

        def on_step_end(self, args, state, control, **kwargs):
            steps_run.append(state.global_step)
            if state.global_step == self.stop_at:
                control.should_training_stop = True   # (after the step's checkpoint: as if the job were killed)

    args = TrainingArguments(
        output_dir=run_dir, use_cpu=True, report_to=[], save_strategy="steps", save_steps=2, save_total_limit=1,
        per_device_train_batch_size=2, gradient_accumulation_steps=1, max_grad_norm=1.0, optim="adamw_torch",
        learning_rate=1e-2, lr_scheduler_type="linear", max_steps=6, logging_steps=1, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True)

    def trainer_of(stop_at: int | None = None):
        return CrashingTrainer(model=hf_models.build("llama", seed=0), args=args,
                               train_dataset=hf_models.Synthetic(24, seed=1),
                               callbacks=[CommFuseCallback(config), StepsRun(stop_at), ResumedState()])

    trainer = trainer_of(4 if mode in ("auto", "grow", "efauto") else None)
    result = {}
    if mode == "grow":
        trainer.train()
        state = full_state(trainer.model, trainer.optimizer)
        if rank == 0:
            torch.save(state, os.path.join(out_dir, "grow-state.pt"))
        return
    if mode == "grown":
        trainer.train()
        if rank == 0:
            saved = torch.load(os.path.join(out_dir, "grow-state.pt"), weights_only=True)
            resumed = resumed_with["state"]
            result["keys"] = sorted(saved) == sorted(resumed) and len(saved) > 0
            result["max_abs_diff"] = max(float((saved[k].float() - resumed[k].float()).abs().max()) for k in saved)
            result["world_size"] = int(os.environ["WORLD_SIZE"])
    elif mode in ("auto", "efauto"):
        trainer.train()
        result["first_checkpoints"] = sorted(n for n in os.listdir(run_dir) if n.startswith("checkpoint-"))
        steps_run.clear()
        trainer = trainer_of()
        trainer.train()
    elif mode == "resume":
        try:
            trainer.train(resume_from_checkpoint=os.path.join(run_dir, "checkpoint-4"))
            result["explicit"] = None
        except ValueError as err:
            result["explicit"] = str(err)
        trainer.train(resume_from_checkpoint=True)
    else:
        trainer.train()
    if rank == 0:
        logs = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
        result.update(losses={e["step"]: e["loss"] for e in logs}, steps_run=steps_run,
                      grad_norms={e["step"]: e["grad_norm"] for e in logs},
                      checkpoints=sorted(n for n in os.listdir(run_dir) if n.startswith("checkpoint-")))
        with open(os.path.join(out_dir, f"{mode}.json"), "w") as f:
            json.dump(result, f, indent=1)


def full_state(model, optimizer) -> dict:
    """The model's weights and the optimizer's moments, whole (on rank 0; ``{}`` elsewhere), keyed by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from commfuse_dp import checkpoint as ck

    state = {f"model.{k}": v.clone() for k, v in ck.full_state_dict(model).items()}
    optim = get_optimizer_state_dict(ck._unwrap(model), ck.unwrap_optimizer(optimizer),
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for name, entry in optim.get("state", {}).items():
        for key, value in entry.items():
            state[f"optimizer.{name}.{key}"] = torch.as_tensor(value).clone()   # (AdamW's step: the live tensor)
    return state


if __name__ == "__main__":
    main(*sys.argv[1:3])
