"""Causal-LM fine-tuning with commfuse_dp: the Hugging Face ``Trainer`` as ``CommFuseTrainer``.

    # The embedded default, 2 CPU processes (what `commfuse-dp demo` runs): a small Llama-style decoder built from a
    # config (tied embeddings, grouped-query attention) trained on the Python reference manual that ships with
    # every Python (pydoc_data), tokenised by a byte-level BPE trained on it in a few seconds. Nothing is downloaded.
    torchrun --nproc_per_node 2 commfuse_dp/recipes/finetune_clm.py --output_dir runs/clm
    # Installed (no checkout): the same module
    torchrun --nproc_per_node 2 -m commfuse_dp.recipes.finetune_clm --output_dir runs/clm
    # One process (no sharding: a plain Trainer run, for comparison)
    python commfuse_dp/recipes/finetune_clm.py --output_dir runs/clm-1proc
    # Your model and data: a local Hugging Face causal-LM folder (a hub name works only if it is in the local cache)
    # and a .txt file, a folder of .txt / .jsonl files, or JSON lines with a "text" field
    torchrun --nproc_per_node 2 commfuse_dp/recipes/finetune_clm.py --model_name_or_path path/to/model --dataset_name corpus/ --output_dir runs/mine
    # GPUs: the same with torchrun (NCCL), or `accelerate launch --num_processes N commfuse_dp/recipes/finetune_clm.py ...`
    # A run that carries on after a lost rank: a checkpoint every 50 steps, written in the background, and a
    # restarted worker group resumes from the newest complete one
    torchrun --nproc_per_node 2 --max-restarts 3 commfuse_dp/recipes/finetune_clm.py --output_dir runs/clm \
        --save_strategy steps --save_steps 50 --auto_resume --async_save

Any ``TrainingArguments`` flag works (``--max_steps``, ``--learning_rate``, ``--bf16``, ``--save_steps``,
``--resume_from_checkpoint``, ...); ``--help`` lists them after the recipe's own. The commfuse settings come from
``COMMFUSE_*`` variables (e.g. ``COMMFUSE_SCHEDULE=slicing``) or ``--commfuse_config file.yaml``.

It shows the Trainer's progress bar and logs loss, ``tokens_per_s`` and ``commfuse/exposed_comm_s`` per logging step;
at the end ``--output_dir`` holds ``model/`` (consolidated, ``from_pretrained``-loadable, with its tokenizer),
``loss.png``, ``timeline.png`` (hops and compute pieces of one training step, per rank), ``trace.json`` (the
same for Perfetto) and ``summary.json``. Generate from the model with
``python -m commfuse_dp.recipes.generate OUTPUT_DIR/model --prompt "..."``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field

import torch

from commfuse_dp.handle import handle_of
from commfuse_dp.recipes import common

EOS = "<|endoftext|>"


@dataclass
class ClmArguments:
    model_name_or_path: str | None = field(default=None, metadata={
        "aliases": ["--model"],  # (deprecated)
        "help": "a local Hugging Face causal-LM folder; default: a small Llama-style decoder built from a config"})
    dataset_name: str | None = field(default=None, metadata={
        "aliases": ["--data"],  # (deprecated)
        "help": "a .txt file, a .jsonl file (one JSON object per line, text in --text_field), or a folder of them; "
                "default: the Python reference manual shipped with Python (pydoc_data)"})
    text_field: str = field(default="text", metadata={"help": "the text field of JSON-lines data"})
    block_size: int = field(default=128, metadata={"help": "tokens per training sample"})
    eval_fraction: float = field(default=0.05, metadata={"help": "share of the blocks held out for evaluation"})
    vocab_size: int = field(default=4096, metadata={"help": "embedded default only: the BPE vocabulary size"})
    hidden_size: int = field(default=512, metadata={"help": "embedded default only: the decoder's width"})
    num_layers: int = field(default=4, metadata={"help": "embedded default only: the decoder's depth"})
    commfuse_config: str | None = field(default=None, metadata={
        "help": "a YAML file with the CommFuseConfig (a flat mapping or a commfuse: block); default: COMMFUSE_* "
                "variables, else the defaults"})
    tp_size: int = field(default=1, metadata={
        "help": "tensor parallelism: groups of this many consecutive ranks share each layer, the data sharded over "
                "world / tp_size ranks (CommFuseConfig.tp_size); Llama, Qwen2, Mistral and Gemma models"})
    timeline_step: int = field(default=3, metadata={"help": "the training step whose timeline is drawn"})
    auto_resume: bool = field(default=False, metadata={
        "help": "resume from the newest complete checkpoint in --output_dir, if there is one, else start at step 0: "
                "a job restarted by torchrun --max-restarts carries on (CommFuseConfig.auto_resume)"})
    async_save: bool = field(default=False, metadata={
        "help": "write each --save_steps checkpoint's sharded state off the training thread "
                "(CommFuseConfig.async_save)"})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "write into an existing, non-empty --output_dir (files of the same names are replaced)"})


def read_corpus(args: ClmArguments) -> tuple[list[str], str]:
    """The documents, and a description of where they came from. Raises RecipeError for unusable data."""
    if args.dataset_name is None:
        from pydoc_data.topics import topics

        return [topics[k] for k in sorted(topics)], "the Python reference manual (pydoc_data, shipped with Python)"
    path = args.dataset_name
    if not os.path.exists(path):
        raise common.RecipeError(f"--dataset_name {path} does not exist")
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*.txt"), recursive=True)
                       + glob.glob(os.path.join(path, "**", "*.jsonl"), recursive=True))
        if not files:
            raise common.RecipeError(f"--dataset_name {path} is a folder with no .txt or .jsonl files")
    else:
        files = [path]
    docs = []
    for name in files:
        try:
            with open(name, encoding="utf-8") as f:
                if name.endswith((".jsonl", ".json")):
                    for number, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        try:
                            record = json.loads(line)
                        except json.JSONDecodeError as exc:
                            raise common.RecipeError(f"--dataset_name {name} line {number} is not JSON ({exc.msg})") from None
                        if not isinstance(record, dict) or not isinstance(record.get(args.text_field), str):
                            raise common.RecipeError(f"--dataset_name {name} line {number} has no text field "
                                                     f"{args.text_field!r} (set --text_field)")
                        docs.append(record[args.text_field])
                else:
                    docs.append(f.read())
        except (OSError, UnicodeDecodeError) as exc:
            raise common.RecipeError(f"--dataset_name {name} cannot be read: {exc}") from None
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise common.RecipeError(f"--dataset_name {path} holds no text (an empty corpus)")
    return docs, f"{len(docs)} document(s) from {path}"


def embedded_tokenizer(docs: list[str], vocab_size: int):
    """A byte-level BPE trained on the corpus (deterministic: every rank trains the same one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                   unk_token=EOS)


def load_model_and_tokenizer(args: ClmArguments, docs: list[str]):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if args.model_name_or_path is None:
        tokenizer = embedded_tokenizer(docs, args.vocab_size)
        heads = max(args.hidden_size // 64, 2)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size,
                             intermediate_size=int(args.hidden_size * 8 / 3) // 16 * 16,
                             num_hidden_layers=args.num_layers, num_attention_heads=heads,
                             num_key_value_heads=max(heads // 4, 1), max_position_embeddings=max(args.block_size, 256),
                             tie_word_embeddings=True, bos_token_id=tokenizer.eos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        torch.manual_seed(0)
        return LlamaForCausalLM(config), tokenizer, "a Llama-style decoder built from a config (embedded default)"
    try:
        AutoConfig.from_pretrained(args.model_name_or_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not os.path.exists(args.model_name_or_path):
            raise common.RecipeError(f"--model_name_or_path {args.model_name_or_path}: no such folder, and not loadable from the Hugging Face "
                                     f"cache ({first}); nothing is downloaded: pass a local model folder") from None
        raise common.RecipeError(f"--model_name_or_path {args.model_name_or_path} is not a Hugging Face model folder ({first})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise common.RecipeError(f"--model_name_or_path {args.model_name_or_path} has no usable tokenizer ({str(exc).splitlines()[0]})") \
            from None
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise common.RecipeError(f"--model_name_or_path {args.model_name_or_path} is not a causal-LM model ({str(exc).splitlines()[0]})") \
            from None
    if tokenizer.eos_token is None:
        tokenizer.eos_token = EOS
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, args.model_name_or_path


class Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i].clone()}


def tokenize(docs: list[str], tokenizer, block_size: int, eval_fraction: float) -> tuple[Blocks, Blocks]:
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for doc in docs:
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        ids.append(eos)
    count = len(ids) // block_size
    if count < 2:
        raise common.RecipeError(f"the corpus has {len(ids)} tokens: fewer than two blocks of --block_size "
                                 f"{block_size}; use more data or a smaller --block_size")
    blocks = torch.tensor(ids[: count * block_size]).view(count, block_size)
    held = max(1, round(count * eval_fraction))
    return Blocks(blocks[: count - held]), Blocks(blocks[count - held:])


def prepare_inputs(args: ClmArguments, world: int, train_batch: int, accumulation: int, eval_batch: int):
    """The corpus, model, tokenizer and train/eval blocks, checked so that every rank gets a batch: everything
    before any output is written. Raises RecipeError for bad input."""
    docs, source = read_corpus(args)
    model, tokenizer, model_source = load_model_and_tokenizer(args, docs)
    train, evaluation = tokenize(docs, tokenizer, args.block_size, args.eval_fraction)
    common.check_batches("training", len(train), world, train_batch, accumulation)
    common.check_batches("evaluation", len(evaluation), world, eval_batch)
    return model, tokenizer, train, evaluation, {"data": source, "model": model_source}


def parser():
    """The recipe's argument parser (``parse`` builds its dataclasses; ``commfuse-dp demo`` checks arguments with it
    before starting any process, building nothing)."""
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser((ClmArguments, TrainingArguments), description=__doc__.split("\n\n")[0])
    defaults = {"output_dir": "runs/clm", "max_steps": 60, "per_device_train_batch_size": 4,
                "per_device_eval_batch_size": 4, "learning_rate": 2e-3, "warmup_steps": 5, "logging_steps": 5,
                "lr_scheduler_type": "cosine", "save_strategy": "no", "eval_strategy": "no", "report_to": "none",
                "include_num_input_tokens_seen": True, "seed": 0, "dataloader_num_workers": 0,
                # pinned host memory only helps a copy to a GPU; without one torch warns once per rank
                "dataloader_pin_memory": torch.cuda.is_available()}
    parser.set_defaults(**defaults)
    return parser


def parse(argv: list[str] | None):
    if not torch.cuda.is_available():
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")   # several CPU ranks under torchrun (DESIGN: accelerate)
    common.warn_renamed(argv)
    return parser().parse_args_into_dataclasses(args=argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args, targs = parse(argv)
    except ValueError as exc:   # TrainingArguments.__post_init__ refusals
        common.fail(str(exc).strip().splitlines()[0])
    rank, world = common.world()
    try:
        cfg = common.commfuse_config(args.commfuse_config)
        cfg = cfg.replace(auto_resume=cfg.auto_resume or args.auto_resume, async_save=cfg.async_save or args.async_save)
        cfg = _with_tp_size(cfg, args.tp_size, targs, world)
        if cfg.auto_resume and str(getattr(targs.save_strategy, "value", targs.save_strategy)) == "no":
            raise common.RecipeError("--auto_resume resumes from this run's checkpoints, and --save_strategy no "
                                     "writes none: add --save_strategy steps --save_steps N")
        # (a run that resumes by itself writes into the folder of the run it carries on)
        common.check_output_dir(targs.output_dir, args.overwrite_output_dir or cfg.auto_resume)
        model, tokenizer, train, evaluation, info = prepare_inputs(  # (each TP group reads one batch)
            args, world // cfg.tp_size, targs.per_device_train_batch_size, targs.gradient_accumulation_steps,
            targs.per_device_eval_batch_size)
    except common.RecipeError as exc:
        common.fail(str(exc))
    return train_and_report(args, targs, model, tokenizer, train, evaluation, cfg,
                            {**info, "world_size": world, "rank": rank})


def _with_tp_size(cfg, tp_size: int, targs, world: int):
    """``--tp_size`` into the config, refused where the run cannot carry it."""
    if tp_size < 1:
        raise common.RecipeError(f"--tp_size {tp_size}: must be at least 1")
    if tp_size == 1:
        return cfg
    if cfg.tp_size not in (1, tp_size):
        raise common.RecipeError(f"--tp_size {tp_size} disagrees with the CommFuseConfig's tp_size {cfg.tp_size}: "
                                 f"give one")
    if world % tp_size:
        raise common.RecipeError(f"--tp_size {tp_size} does not divide the {world} processes (launch with "
                                 f"torchrun --nproc_per_node N, N a multiple of it)")
    return cfg.replace(tp_size=tp_size)


def _check_same_corpus(train, evaluation) -> None:
    """Every rank tokenised its own copy of the corpus: they must agree before training on it."""
    import torch.distributed as dist

    digest = hashlib.sha256(train.blocks.numpy().tobytes() + evaluation.blocks.numpy().tobytes()).hexdigest()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) != 1:
        common.fail("the ranks tokenised the corpus differently (different data or tokenizer per rank)")


def _summary(trainer, result, before: float, after: float, model_dir: str, paths: dict, cfg, info: dict) -> dict:
    """What ``summary.json`` holds: the run, its losses, throughput, exposed communication and the schedule."""
    history = trainer.state.log_history
    return {
        **{k: v for k, v in info.items() if k != "rank"},
        "eval_loss_before": before, "eval_loss_after": after,
        "perplexity_before": common.perplexity(before), "perplexity_after": common.perplexity(after),
        "train_loss_first": next((e["loss"] for e in history if "loss" in e), None),
        "train_loss_last": common.mean_recent(history, "loss", 1),
        "train_losses": [[e["step"], e["loss"]] for e in history if "loss" in e],
        "wire": {"gather_format": cfg.gather_format, "reduce_format": cfg.reduce_format,
                 "error_feedback": cfg.error_feedback},
        "steps": trainer.state.global_step, "train_runtime_s": result.metrics.get("train_runtime"),
        "tokens_per_s": common.mean_recent(history, "tokens_per_s", 10),
        "tokens_seen": trainer.state.num_input_tokens_seen,
        "exposed_comm_s": common.mean_recent(history, "commfuse/exposed_comm_s", 10),
        "comm_s": common.mean_recent(history, "commfuse/comm_s", 10),
        "step_wall_s": common.mean_recent(history, "commfuse/wall_s", 10),
        "model_dir": model_dir, **paths,
        # what CommFuseConfig's "auto" settings became, and why (commfuse_dp/planner/choose.py)
        "schedule": getattr(getattr(handle_of(trainer.model), "choice", None), "as_dict", lambda: None)(),
        "generate": f"python -m commfuse_dp.recipes.generate {model_dir} --prompt \"The assert statement\"",
    }


def train_and_report(args, targs, model, tokenizer, train, evaluation, cfg, info) -> int:
    import torch.distributed as dist
    from transformers import Trainer

    from commfuse_dp.ring.topology import drain_gloo_workers

    report = common.RecipeReport(timeline_step=args.timeline_step)
    callbacks = [report]
    trainer_class = Trainer
    if info["world_size"] > 1:
        # CommFuseTrainer: the Trainer with its CommFuseCallback, which shards the model, and its checkpoint
        # methods, which save and load every rank's shards (save_model below, --save_steps, --resume_from_checkpoint)
        from commfuse_dp.integrations.transformers import CommFuseCallback, CommFuseTrainer

        callbacks.insert(0, CommFuseCallback(cfg))
        trainer_class = CommFuseTrainer
    else:
        print("one process: a plain Trainer run, nothing to shard (launch with torchrun --nproc_per_node N)")
    trainer = trainer_class(model=model, args=targs, train_dataset=train, eval_dataset=evaluation,
                            processing_class=tokenizer, callbacks=callbacks)
    if dist.is_initialized():
        _check_same_corpus(train, evaluation)
    before = trainer.evaluate()["eval_loss"]
    result = trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    after = trainer.evaluate()["eval_loss"]
    model_dir = os.path.join(targs.output_dir, "model")
    trainer.save_model(model_dir)              # every rank: the sharded weights are gathered, rank 0 writes them
    if trainer.is_world_process_zero():
        paths = common.write_figures(targs.output_dir, trainer.state.log_history, report.timeline,
                                     f"finetune_clm: {info['world_size']} process(es)")
        summary = _summary(trainer, result, before, after, model_dir, paths, cfg, info)
        summary["summary_json"] = common.write_summary(targs.output_dir, summary)
        print(json.dumps(summary, indent=1))
    if dist.is_initialized():
        dist.barrier()
        drain_gloo_workers()   # before the Trainer and its groups are freed (commfuse_dp/ring/topology.py)
    return 0

if __name__ == "__main__":
    sys.exit(main())
