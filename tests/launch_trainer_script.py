"""A plain ``transformers.Trainer`` script that knows nothing of commfuse (no callback, no commfuse import).

    torchrun --nproc_per_node 2 tests/launch_trainer_script.py OUT_JSON            (DDP; ACCELERATE_USE_CPU=true)
    commfuse-dp launch --config_file accel.yaml tests/launch_trainer_script.py OUT_JSON
    python tests/launch_trainer_script.py OUT_JSON 8     (one process, 8 a device: the batches of 4 ranks of 2)
    ... OUT_JSON [PER_DEVICE [SAMPLES]]                     (defaults 2 and 32)

tests/test_launch.py runs it both ways and compares. Rank 0 writes the per-step losses and what the model, the
optimizer and the Trainer looked like. CPU comes from the environment (ACCELERATE_USE_CPU), not from the script.
"""

import json
import sys
import time

import hf_models  # tests/ is sys.path[0]: the script's own folder
import torch
from transformers import Trainer, TrainingArguments


def main(out: str, per_device: int = 2, samples: int = 32) -> None:
    torch.set_num_threads(1)
    model = hf_models.build("gpt2", seed=0)
    args = TrainingArguments(
        output_dir=out + ".run", report_to=[], per_device_train_batch_size=per_device, gradient_accumulation_steps=2,
        max_grad_norm=1.0, optim="adamw_torch", learning_rate=1e-2, max_steps=4, logging_steps=1,
        save_strategy="no", seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        lr_scheduler_type="constant")
    # 2 ranks x 2 per device x 2 accumulation = 8 samples per optimizer step: 32 samples for 4 steps. One process
    # with 2 x W a device takes the batches of W ranks of 2 (where W x 4 divides the samples).
    trainer = Trainer(model=model, args=args, train_dataset=hf_models.Synthetic(samples, seed=1))
    trainer.train()
    params = list(trainer.model.parameters())
    trainer.save_model(out + ".model")           # every rank, as the Trainer's own checkpoints do
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(**hf_models.batch(0, 99)).logits.tolist()
    if trainer.args.process_index == 0:
        logs = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
        with open(out, "w") as f:
            json.dump({
                "world_size": trainer.args.world_size,
                "distributed_type": str(trainer.accelerator.distributed_type),
                "accelerator_class": type(trainer.accelerator).__name__,
                "callbacks": [type(cb).__name__ for cb in trainer.callback_handler.callbacks],
                "model_type": type(trainer.model_wrapped).__name__,
                # what commfuse_dp.integrations.attach recorded on the model's handle (read as attributes: no commfuse import)
                "attachments": getattr(getattr(trainer.model, "_commfuse", None), "attachments", []),
                "param_types": sorted({type(p.data).__name__ for p in params}),
                "placements": sorted({str(getattr(p, "placements", None)) for p in params}),
                "optimizer_state_types": sorted({type(v).__name__ for s in trainer.optimizer.state.values()
                                                 for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}),
                "losses": [e["loss"] for e in logs], "grad_norms": [e.get("grad_norm") for e in logs],
                "steps": [e["step"] for e in logs], "logs": logs, "logits": logits,
            }, f, indent=1)
    time.sleep(0.1)   # torch's gloo workers free their last work with the GIL (commfuse_dp/ring/topology.py)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
