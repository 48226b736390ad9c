"""One rank of a ``transformers.Trainer`` run with tensor parallelism, launched by tests/test_tp_trainer.py.

    torchrun --nproc_per_node 4 tests/tp_trainer_worker.py OUT_DIR tp      # CommFuseTrainer, TP 2 x data 2
    torchrun --nproc_per_node 4 tests/tp_trainer_worker.py OUT_DIR resume  # the same from tp's step-5 checkpoint
    torchrun --nproc_per_node 2 tests/tp_trainer_worker.py OUT_DIR ddp     # the plain Trainer, data 2

Same seeds, data and batch per data-parallel rank in both; rank 0 writes OUT_DIR/MODE.json: the per-step losses,
grad norms, the eval loss and the trained model's loss on a fixed batch; tp also saves its sharded state every 5
steps and the model with ``trainer.save_model`` (a consolidated Hugging Face folder) into OUT_DIR/final.
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import hf_models  # noqa: E402


def main(out_dir: str, mode: str) -> None:
    from transformers import Trainer, TrainingArguments

    from commfuse_dp import CommFuseConfig
    from commfuse_dp.handle import handle_of
    from commfuse_dp.integrations.transformers import CommFuseTrainer

    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, f"run-{mode}"), use_cpu=True, report_to=[],
        save_strategy="no" if mode == "ddp" else "steps", save_steps=5,
        per_device_train_batch_size=2, per_device_eval_batch_size=2, gradient_accumulation_steps=2,
        max_grad_norm=0.5, optim="adamw_torch", learning_rate=1e-3, max_steps=10, logging_steps=1, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True, lr_scheduler_type="constant",
        include_num_input_tokens_seen="all")
    data = dict(train_dataset=hf_models.Synthetic(80, seed=1), eval_dataset=hf_models.Synthetic(12, seed=2))
    model = hf_models.build("llama", seed=0)
    if mode != "ddp":
        trainer = CommFuseTrainer(model=model, args=args, commfuse=CommFuseConfig(tp_size=2, min_fuse_numel=0),
                                  **data)
    else:
        trainer = Trainer(model=model, args=args, **data)
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, "run-tp", "checkpoint-5") if mode == "resume"
                  else None)
    metrics = trainer.evaluate()
    if mode == "tp":  # the consolidated Hugging Face folder (tests/test_tp_trainer.py loads it in one process)
        trainer.save_model(os.path.join(out_dir, "final"))
    trainer.model.eval()
    with torch.no_grad():
        probe = trainer.model(**hf_models.batch(0, 99)).loss.item()
    if int(os.environ["RANK"]) == 0:
        logs = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
        tp = handle_of(trainer.model).tp if mode != "ddp" else None
        with open(os.path.join(out_dir, f"{mode}.json"), "w") as f:
            json.dump({"losses": [e["loss"] for e in logs], "grad_norms": [e["grad_norm"] for e in logs],
                       "eval_loss": metrics["eval_loss"], "tp_size": tp.size if tp is not None else 1,
                       "steps": trainer.state.global_step, "probe_loss": probe,
                       "tokens_seen": trainer.state.num_input_tokens_seen}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
