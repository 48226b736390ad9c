"""One rank of TRL ``SFTTrainer`` runs (full fine-tune, TRL's default fused LM head), launched by tests/test_trl.py:

    torchrun --nproc_per_node N tests/trl_worker.py OUT_JSON TOKENIZER_DIR MODE [MODE ...]

MODE is ``{ddp|fused|slicing|tp}-{fp32|bf16}[-lora]`` (``tp``: ``CommFuseConfig(tp_size=2)``, under which TRL's
fused LM head is refused; ``-lora``: TRL's ``peft_config``, LoRA on the attention and MLP projections; the tied
table is frozen). Every mode trains a fresh tiny tied Llama (hidden 128, GQA) from the
same seed on the same pre-tokenized data, in this one process group, one after another: DDP is what
``SFTTrainer`` does without commfuse (accelerate wraps the model in DistributedDataParallel on multi-process
CPU); the others are ``commfuse_trainer(SFTTrainer)`` with a ``CommFuseCallback`` (every linear fused, ring
embeddings on, the tied table fused in both).
Rank 0 writes, per mode, the logged losses and grad norms and every parameter after training.
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

STEPS = 5


def data(vocab: int):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, vocab, (int(n),), generator=gen).tolist()
            for n in torch.randint(6, 14, (48,), generator=gen)]
    return Dataset.from_dict({"input_ids": rows})


def run(mode: str, tokenizer_dir: str) -> dict:
    from accelerate.state import AcceleratorState
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    import commfuse_dp as cf
    from commfuse_dp.integrations.transformers import CommFuseCallback, commfuse_trainer

    schedule, precision, *lora = mode.split("-")
    AcceleratorState._reset_state()  # each Trainer builds its Accelerator anew: another mixed precision is allowed
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, initializer_range=0.1,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None))
    args = SFTConfig(
        output_dir=os.path.join(os.path.dirname(OUT), f"run-{mode}"), use_cpu=True, report_to=[],
        bf16=precision == "bf16", per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
        # AdamW (TRL's default) divides each gradient by its running RMS: with the default eps=1e-8 an element whose
        # gradient is ~0 turns float rounding into a step of ~lr (seen: 1.5e-5 on one element of 32768). eps=1e-3
        # keeps such steps proportional to the gradient, so parameters compare at 1e-5.
        learning_rate=1e-3, adam_epsilon=1e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True, max_length=32)
    callbacks = [] if schedule in ("ddp", "tp") else [
        CommFuseCallback(cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))]
    extra = {"commfuse": cf.CommFuseConfig(tp_size=2, min_fuse_numel=0)} if schedule == "tp" else {}
    peft = None
    if lora:
        from peft import LoraConfig

        peft = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    trainer_class = SFTTrainer if schedule == "ddp" else commfuse_trainer(SFTTrainer)   # bf16: the Trainer's autocast
    trainer = trainer_class(model=model, args=args, train_dataset=data(len(tokenizer)), processing_class=tokenizer,
                            callbacks=callbacks, peft_config=peft, **extra)
    if schedule not in ("ddp", "tp") and not lora:
        assert type(model.lm_head).__name__ == "RingLinear", type(model.lm_head)
        assert type(model.model.embed_tokens).__name__ == "RingEmbedding"
        assert model.lm_head._parameters["weight"] is model.model.embed_tokens._parameters["weight"]
    trainer.train()
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).float().tolist()
              for n, p in unwrapped.named_parameters() if (p.requires_grad or not lora) and schedule != "tp"}
    logs = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
    return {"losses": [e["loss"] for e in logs], "grad_norms": [e["grad_norm"] for e in logs], "params": params,
            "entropy": [e.get("entropy") for e in logs], "accuracy": [e.get("mean_token_accuracy") for e in logs]}


if __name__ == "__main__":
    OUT, tokenizer_dir, *modes = sys.argv[1:]
    torch.set_num_threads(1)
    results = {mode: run(mode, tokenizer_dir) for mode in modes}
    if int(os.environ["RANK"]) == 0:
        with open(OUT, "w") as f:
            json.dump(results, f)
