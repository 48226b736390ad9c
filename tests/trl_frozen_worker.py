"""One rank of TRL trainer runs that hold a second, frozen model beside the policy, launched by
tests/test_trl_frozen.py:

    torchrun --nproc_per_node N tests/trl_frozen_worker.py OUT_JSON TOKENIZER_DIR MODE [MODE ...]

MODE is ``{ddp|fused|slicing|tp}-{dpo|trdpo|precompute|grpo|rloo|kto|reward|distill}[-whole][-bf16][-bema][-refused]``
(``-whole``: ``CommFuseConfig(shard_frozen=False)``, the frozen model left whole on every rank; ``-bf16``:
``bf16=True``, TRL's default, else fp32; ``-bema``: TRL's ``BEMACallback`` too; ``-refused``: the run is expected to
be refused with a ``ValueError``, whose text every rank reports, and the launch goes on with the next mode):
- ``dpo``: ``DPOTrainer`` with a ``ref_model``; ``trdpo``: the same with ``sync_ref_model=True``
  (``ref_model_sync_steps=2``, ``ref_model_mixup_alpha=0.5``); ``precompute``: ``precompute_ref_log_probs=True``
  (the reference runs over the data set before training);
- ``grpo``: ``GRPOTrainer`` with ``beta=0.04`` (a reference) and a rule reward; ``reward``: the same with
  ``beta=0`` and a sequence-classification reward model as its reward function; ``rloo``: ``RLOOTrainer`` as
  ``grpo``;
- ``kto``: ``KTOTrainer`` with a ``ref_model``; ``distill``: ``DistillationTrainer`` with a teacher (another
  seed), completions generated on-policy.
DDP is what the trainer does without commfuse (the policy in DistributedDataParallel, the frozen model whole on
every rank); the others are ``commfuse_trainer(Trainer)`` with a ``CommFuseCallback`` (every linear fused; ``tp``:
``CommFuseConfig(tp_size=2)``, the frozen model made TP as well). Every
mode builds its models from the same seed and trains 4 steps. Rank 0 writes, per mode, the logged
figures and, from every rank, how many of the frozen model's elements it holds.
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

STEPS = 4
LOGGED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
          "reward", "kl", "grad_norm")


def _llama(tokenizer, seed: int, cls=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        initializer_range=0.1, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, num_labels=1)
    return (cls or LlamaForCausalLM)(config)


def _on_disk(data, name: str):
    """``data`` saved under the run's folder and loaded back: its cache files are then shared by the ranks (TRL's
    ``precompute_ref_log_probs`` writes its results on the main process and reads them on every rank)."""
    from accelerate import PartialState
    from datasets import load_from_disk

    folder = os.path.join(os.path.dirname(OUT), "data", name)
    with PartialState().main_process_first():
        if PartialState().is_main_process:
            data.save_to_disk(folder)
        return load_from_disk(folder)


def _preferences(n: int):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(5)
    words = [f"w{i}" for i in range(40)]

    def text(k):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (k,), generator=gen))

    return Dataset.from_dict({"prompt": [text(4) for _ in range(n)], "chosen": [text(5) for _ in range(n)],
                              "rejected": [text(3) for _ in range(n)]})


def _length_reward(completions, **kwargs):
    return [float(len(c)) / 10.0 for c in completions]


def run(mode: str, tokenizer_dir: str) -> dict:
    import torch.distributed as dist
    from accelerate.state import AcceleratorState
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    import commfuse_dp as cf
    from commfuse_dp.integrations.transformers import CommFuseCallback, commfuse_trainer

    schedule, kind, *flags = mode.split("-")
    whole = "whole" in flags
    AcceleratorState._reset_state()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    policy = _llama(tokenizer, 0)
    common = dict(output_dir=os.path.join(os.path.dirname(OUT), f"run-{mode}"), use_cpu=True, report_to=[],
                  bf16="bf16" in flags,  # else fp32 (TRL's configs default to bf16 autocast)
                  learning_rate=1e-3, adam_epsilon=1e-3, lr_scheduler_type="constant", logging_steps=1,
                  save_strategy="no", seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
                  max_steps=STEPS, ddp_timeout=180)  # a rank left waiting fails in minutes, not at the launch's end
    callbacks = [] if schedule == "ddp" else [CommFuseCallback(
        cf.CommFuseConfig(tp_size=2, min_fuse_numel=0) if schedule == "tp" else
        cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0, shard_frozen=not whole))]
    frozen_of = None
    if kind in ("dpo", "trdpo", "precompute"):
        from trl import DPOConfig, DPOTrainer

        cls, frozen = DPOTrainer, _llama(tokenizer, 0)
        args = DPOConfig(**common, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_length=32,
                         sync_ref_model=kind == "trdpo", ref_model_sync_steps=2, ref_model_mixup_alpha=0.5,
                         precompute_ref_log_probs=kind == "precompute")
        kwargs = dict(ref_model=frozen, train_dataset=_on_disk(_preferences(64), mode))
        frozen_of = lambda trainer: trainer.ref_model  # noqa: E731
    elif kind == "distill":
        from trl import DistillationConfig, DistillationTrainer

        cls = DistillationTrainer
        args = DistillationConfig(**common, per_device_train_batch_size=2, max_completion_length=8,
                                  temperature=1.0)
        kwargs = dict(teacher_model=_llama(tokenizer, 7),
                      train_dataset=_on_disk(_preferences(32).remove_columns(["chosen", "rejected"]), mode))
        frozen_of = lambda trainer: trainer.teacher_model  # noqa: E731
    elif kind == "kto":
        from datasets import Dataset
        from trl import KTOConfig, KTOTrainer

        prefs = _preferences(32).to_dict()
        data = Dataset.from_dict({"prompt": prefs["prompt"] * 2, "completion": prefs["chosen"] + prefs["rejected"],
                                  "label": [True] * 32 + [False] * 32})
        cls, frozen = KTOTrainer, _llama(tokenizer, 0)
        args = KTOConfig(**common, per_device_train_batch_size=4, max_length=32)
        kwargs = dict(ref_model=frozen, train_dataset=data)
        frozen_of = lambda trainer: trainer.ref_model  # noqa: E731
    else:
        from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

        reward_model = _llama(tokenizer, 7, LlamaForSequenceClassification) if kind == "reward" else None
        cls, config = (RLOOTrainer, RLOOConfig) if kind == "rloo" else (GRPOTrainer, GRPOConfig)
        args = config(**common, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      beta=0.0 if kind == "reward" else 0.04, temperature=1.0)
        # GRPO loads its reference from the policy's path: the policy is saved and given by path
        from accelerate import PartialState

        folder = os.path.join(os.path.dirname(OUT), "policy")
        with PartialState().main_process_first():
            if PartialState().is_main_process and not os.path.isdir(folder):
                policy.save_pretrained(folder)
        policy = folder
        kwargs = dict(reward_funcs=[reward_model or _length_reward],
                      train_dataset=_preferences(32).remove_columns(["chosen", "rejected"]))
        if reward_model is not None:
            kwargs["reward_processing_classes"] = [tokenizer]
            frozen_of = lambda trainer: trainer.reward_funcs[0]  # noqa: E731
        else:
            frozen_of = lambda trainer: trainer.ref_model  # noqa: E731
    if "bema" in flags:  # TRL's BEMACallback: refused with a sharded model
        from trl import BEMACallback

        callbacks.append(BEMACallback())
    trainer_class = cls if schedule == "ddp" else commfuse_trainer(cls)
    trainer = trainer_class(model=policy, args=args, processing_class=tokenizer, callbacks=callbacks, **kwargs)
    frozen = frozen_of(trainer)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in frozen.parameters())
    total = sum(p.numel() for p in frozen.parameters())
    sharded = sum(1 for p in frozen.parameters() if hasattr(p, "to_local"))
    # the most one rank may hold: each sharded dimension split as torch.chunk splits it
    most = 0
    for p in frozen.parameters():
        dims = [pl.dim for pl in getattr(p, "placements", ()) if hasattr(pl, "dim")]
        most += -(-p.shape[dims[0]] // dist.get_world_size()) * (p.numel() // p.shape[dims[0]]) if dims \
            else p.numel()
    trainer.train()
    if "refused" in flags:
        raise AssertionError(f"{mode}: trained, expected a refusal")
    holdings = [None] * dist.get_world_size()
    dist.all_gather_object(holdings, held)
    logs = [e for e in trainer.state.log_history if "step" in e and any(k in e for k in LOGGED)]
    return {"logs": [{k: e[k] for k in LOGGED if k in e} for e in logs], "held": holdings, "total": total,
            "sharded": sharded, "params": sum(1 for _ in frozen.parameters()), "most": most}


def refused(mode: str, tokenizer_dir: str) -> dict:
    """A mode that must be refused on every rank before its first step: what each rank raised."""
    import torch.distributed as dist

    try:
        run(mode, tokenizer_dir)
        said = "no error"
    except ValueError as err:
        said = f"{type(err).__name__}: {err}"
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, said)
    return {"refused": every}


if __name__ == "__main__":
    OUT, tokenizer_dir, *modes = sys.argv[1:]
    torch.set_num_threads(1)
    results = {mode: (refused if mode.endswith("-refused") else run)(mode, tokenizer_dir) for mode in modes}
    if int(os.environ["RANK"]) == 0:
        with open(OUT, "w") as f:
            json.dump(results, f)
    from commfuse_dp.ring.topology import drain_gloo_workers

    drain_gloo_workers()  # gloo's threads free their last works before the interpreter ends (see its Note)
