"""One rank of a ``transformers.Trainer`` run with DeepSpeed ZeRO-3, launched by tests/test_deepspeed_rings.py.

    torchrun --nproc_per_node 2 tests/deepspeed_trainer_worker.py OUT_DIR

Two Trainers in this one process, same seeds and data: stock DeepSpeed, then DeepSpeed with ``CommFuseCallback``
(which switches DeepSpeed's collectives to the rings at ``on_train_begin``). The second one saves the model through
DeepSpeed's own path (``trainer.save_model``, ZeRO-3 gathering the 16-bit weights) into OUT_DIR/model, and rank 0
writes the logits of the trained engine on a fixed batch, the per-step losses of both runs and the ring counters
into OUT_DIR/result.json; the test reloads the saved model with ``from_pretrained`` in another process.
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]  # hf_models, and this checkout's commfuse_dp

import hf_models  # noqa: E402

KIND = "gpt2"


def ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 1000,
            "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                  "stage3_prefetch_bucket_size": 2000, "reduce_bucket_size": 8000,
                                  "stage3_param_persistence_threshold": 0},
            "commfuse": {"bucket_mb": 1 / 256}}


def run(out_dir: str, mode: str) -> dict:
    from transformers import Trainer, TrainingArguments

    from commfuse_dp.integrations.attach import attachments
    from commfuse_dp.integrations.transformers import CommFuseCallback

    model = hf_models.build(KIND, seed=0)
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, f"run-{mode}"), use_cpu=True, report_to=[], deepspeed=ds_config(),
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=1.0, optim="adamw_torch",
        learning_rate=1e-2, max_steps=4, logging_steps=1, save_strategy="no", seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True, lr_scheduler_type="constant")
    callback = CommFuseCallback() if mode == "rings" else None
    trainer = Trainer(model=model, args=args, train_dataset=hf_models.Synthetic(32, seed=1),
                      callbacks=[callback] if callback is not None else [])
    trainer.train()
    result = {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
              "engine": type(trainer.model_wrapped).__name__,
              "zero_stage": trainer.model_wrapped.zero_optimization_stage(),
              "all_ds_tensor": all(hasattr(p, "ds_tensor") for p in trainer.model.parameters()),
              "attachments": attachments(trainer.model)}
    if callback is not None:
        import deepspeed.comm.comm as ds_comm

        rings = callback.rings
        result["stats"] = rings.stats.as_dict()
        result["config_source"] = rings.source
        result["bucket_mb"] = rings.config.bucket_mb
        result["backend_during"] = type(ds_comm.cdb).__name__
        trainer.save_model(os.path.join(out_dir, "model"))  # DeepSpeed's path: ZeRO-3 gathers the weights
        engine = trainer.model_wrapped
        engine.eval()
        with torch.no_grad():
            result["logits"] = engine(input_ids=hf_models.batch(0, 99)["input_ids"]).logits.tolist()
        result["stats_after_save"] = rings.stats.as_dict()
        rings.disable()
    return result


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    result = {"stock": run(out_dir, "stock"), "rings": run(out_dir, "rings")}
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
    from commfuse_dp.integrations.deepspeed import shutdown

    shutdown()  # see [Note: the abort at exit] in commfuse_dp/integrations/deepspeed.py; the test checks the exit status


if __name__ == "__main__":
    main(sys.argv[1])
