"""One rank of a real ``transformers.Trainer`` run, launched by tests/test_trainer_callback.py through torchrun.

    torchrun --nproc_per_node 2 tests/trainer_worker.py OUT_DIR commfuse,ddp,resume,peer,commfuse:bf16,ddp:bf16

The modes run one after another in the same processes (one launch, one process group), each with a Trainer of its
own. Same seeds and data in every mode; rank 0 writes OUT_DIR/MODE-PRECISION.json: the per-step losses, eval_loss
and what the model looked like.
commfuse also saves a checkpoint every 3 steps and, at the end, trainer.save_model() into run-commfuse/final plus
the logits of a fixed batch; resume is a fresh commfuse Trainer resumed from run-commfuse/checkpoint-3.
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# hf_models from tests/, and this checkout's commfuse_dp (`python tests/trainer_worker.py` puts only tests/ on
# sys.path).
sys.path[:0] = [HERE, ROOT]

import hf_models  # noqa: E402


def main(out_dir: str, modes: str) -> None:
    for item in modes.split(","):  # MODE or MODE:PRECISION (fp32 by default)
        mode, _, precision = item.partition(":")
        precision = precision or "fp32"
        run(os.path.join(out_dir, f"{mode}-{precision}.json"), mode, precision)
    from commfuse_dp.ring.topology import drain_gloo_workers

    drain_gloo_workers()   # before the Trainer's groups are freed (commfuse_dp/ring/topology.py)


def run(out: str, mode: str, precision: str) -> None:
    from transformers import Trainer, TrainingArguments

    from commfuse_dp import CommFuseConfig

    from commfuse_dp.handle import handle_of
    from commfuse_dp.integrations.attach import attachments
    from commfuse_dp.integrations.transformers import CommFuseCallback, CommFuseTrainer

    torch.set_num_threads(1)
    model = hf_models.build("llama", seed=0)
    run_dir = os.path.join(os.path.dirname(out), "run-commfuse" if mode == "resume" else f"run-{mode}"
                           + ("-bf16" if precision == "bf16" else ""))
    saving = {"save_strategy": "steps", "save_steps": 3} if mode != "ddp" else {"save_strategy": "no"}
    args = TrainingArguments(
        output_dir=run_dir, use_cpu=True, report_to=[], bf16=precision == "bf16", **saving,
        per_device_train_batch_size=2, per_device_eval_batch_size=2, gradient_accumulation_steps=2,
        max_grad_norm=1.0, optim="adamw_torch", learning_rate=1e-2, max_steps=6, logging_steps=1,
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        lr_scheduler_type="constant",
        # No padding of the last eval batch: rank 1 evaluates a batch of 1 at the end (11 samples, 2 ranks x 2).
        accelerator_config={"even_batches": False})
    # "peer": the schedule the defaults run where fusing cannot win (stock FSDP2's units, its GPU schedule)
    schedule = "fsdp2" if mode == "peer" else "fused"
    callbacks = [CommFuseCallback(CommFuseConfig(schedule=schedule, min_fuse_numel=0))] if mode != "ddp" else []
    # 2 ranks x 2 per device x 2 accumulation = 8 samples per optimizer step: 48 samples for 6 steps.
    # Eval: 11 samples over 2 ranks x 2 per device, so the last batch is short.
    trainer_class = Trainer if mode == "ddp" else CommFuseTrainer   # CommFuseTrainer saves every rank's shards
    trainer = trainer_class(model=model, args=args, train_dataset=hf_models.Synthetic(48, seed=1),
                            eval_dataset=hf_models.Synthetic(11, seed=2), callbacks=callbacks)
    from torch.distributed.tensor import DTensor

    dtensor_params = [isinstance(p, DTensor) for p in trainer.model.parameters()]
    # Count how often accelerate's no_sync(model) enters the model's own no_sync (the sharded model's, or DDP's).
    no_sync_calls = [0]
    target = trainer.model
    inner = getattr(target, "no_sync", None)
    if mode == "commfuse" and inner is not None:
        def counting_no_sync():
            no_sync_calls[0] += 1
            return inner()
        target.no_sync = counting_no_sync
    trainer.train(resume_from_checkpoint=os.path.join(run_dir, "checkpoint-3") if mode == "resume" else None)
    extra = {}
    if mode == "commfuse":
        trainer.save_model(os.path.join(run_dir, "final"))
        trainer.model.eval()
        with torch.no_grad():
            extra["logits"] = trainer.model(**hf_models.batch(0, 99)).logits.tolist()
        extra["checkpoint_files"] = sorted(os.listdir(os.path.join(run_dir, "checkpoint-3")))
    eval_sizes = []
    hook = trainer.model.register_forward_pre_hook(
        lambda mod, args, kwargs: eval_sizes.append(int(kwargs["input_ids"].shape[0])), with_kwargs=True)
    metrics = trainer.evaluate()
    hook.remove()
    all_eval_sizes = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(all_eval_sizes, eval_sizes)
    if int(os.environ["RANK"]) == 0:
        logs = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
        with open(out, "w") as f:
            json.dump({
                "world_size": trainer.args.world_size,
                "parallel_mode": str(trainer.args.parallel_mode),
                "distributed_type": str(trainer.accelerator.distributed_type),
                "model_type": type(trainer.model_wrapped).__name__,
                "all_dtensor": all(dtensor_params), "any_dtensor": any(dtensor_params),
                "optimizer_state_dtensor": all(isinstance(v, DTensor) for s in trainer.optimizer.state.values()
                                               for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")),
                "losses": [e["loss"] for e in logs], "grad_norms": [e.get("grad_norm") for e in logs],
                "steps": [e["step"] for e in logs], "logs": logs, "eval_loss": metrics["eval_loss"],
                "no_sync_calls": no_sync_calls[0], "eval_batch_sizes": all_eval_sizes,
                "attachments": attachments(trainer.model), **extra,
                "machine": getattr(getattr(handle_of(trainer.model), "choice", None), "machine", None),
            }, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
