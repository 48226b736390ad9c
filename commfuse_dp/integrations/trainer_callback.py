"""``CommFuseCallback``: shards ``Trainer.model`` at the end of the Trainer's ``__init__`` and adds the step figures
to its logs (``commfuse_dp/integrations/transformers.py`` describes the Trainer integration as a whole)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from commfuse_dp import checkpoint as ckpt
from commfuse_dp.checks import check_same_layout
from commfuse_dp.handle import engine_of
from commfuse_dp.planner.choose import batch_tokens
from commfuse_dp.config import CommFuseConfig
from commfuse_dp.integrations.accelerate import frozen_config, prepare_sharded, shard_frozen_models
from commfuse_dp.integrations.attach import Parallelism, attach, resolve_config

logger = logging.getLogger("commfuse_dp")

_STAT_KEYS = ("exposed_comm_s", "comm_s", "compute_s", "wall_s", "hops")
_USE_INSTEAD = ("write CommFuseTrainer(...) instead of Trainer(...): `from commfuse_dp.integrations.transformers "
                "import CommFuseTrainer`; it takes the Trainer's arguments and the CommFuseCallback in callbacks= "
                "(or commfuse=CommFuseConfig(...) in its place). For TRL's or another Trainer class: "
                "`commfuse_trainer(SFTTrainer)(...)` (from the same module). `commfuse-dp launch` does this for "
                "every Trainer")


def first_batch_tokens(trainer, args) -> tuple[int, str] | None:
    """A rank's tokens per step from a batch of the Trainer's, for the defaults' plan: its data collator on the
    first ``per_device_train_batch_size`` examples of a map-style ``train_dataset`` (with the columns the model does
    not take removed, as the Trainer's data loader removes them), the elements of ``input_ids``. None where that
    cannot be read (an iterable data set, no ``input_ids``, a collator that refuses): the defaults then assume."""
    dataset, collator = getattr(trainer, "train_dataset", None), getattr(trainer, "data_collator", None)
    if dataset is None or collator is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return None
    try:
        if getattr(args, "remove_unused_columns", False) and hasattr(dataset, "column_names"):  # datasets
            dataset = trainer._remove_unused_columns(dataset, description="training")
        batch = collator([dataset[i] for i in range(min(args.per_device_train_batch_size, len(dataset)))])
        ids = batch["input_ids"]
    except Exception as err:  # (a hint only: the defaults assume then)
        logger.debug("CommFuseCallback: the first batch's tokens could not be read (%r); the defaults assume them",
                     err)
        return None
    if not isinstance(ids, torch.Tensor) or ids.numel() == 0:
        return None
    return ids.numel(), f"the Trainer's first {ids.shape[0]} examples, {' x '.join(map(str, ids.shape))}"


def _needs_trainer(args) -> list[str]:
    """What in ``args`` a callback cannot do without its Trainer."""
    needs = []
    strategy = getattr(getattr(args, "save_strategy", "no"), "value", getattr(args, "save_strategy", "no"))
    if strategy != "no":
        needs.append(f"save_strategy={strategy!r} (checkpoints of every rank's shards; the Trainer's default is "
                     "'steps')")
    if getattr(args, "resume_from_checkpoint", None):
        needs.append("resume_from_checkpoint")
    for flag in ("bf16", "fp16"):
        if getattr(args, flag, False):
            needs.append(f"{flag}=True (the Trainer's autocast, applied through its Accelerator)")
    if getattr(args, "sync_ref_model", False):
        needs.append("sync_ref_model=True (TRL mixes the policy into its reference model, which only the "
                     "Trainer's Accelerator can shard like the policy)")
    return needs


class CommFuseCallback(TrainerCallback):
    """Shards ``Trainer.model`` (:func:`commfuse_dp.integrations.attach.attach`) before the Trainer prepares it (see
    module docs).

    ``cfg``: the :class:`CommFuseConfig` (or a dict of its fields); ``None`` reads it from the ``COMMFUSE_*``
    environment (``CommFuseConfig.from_env()``, what ``commfuse-dp launch`` sets).

    ``trainer``: the Trainer this callback belongs to, set by :class:`CommFuseTrainerMixin` (``CommFuseTrainer``,
    :func:`commfuse_trainer`) before the Trainer's ``__init__`` runs. ``None`` on a plain ``Trainer``: then the
    callback refuses what needs the Trainer (see module docs).
    """

    def __init__(self, cfg: CommFuseConfig | None = None) -> None:
        self.explicit = cfg is not None
        self.cfg = resolve_config(cfg)
        self.trainer = None   # set by CommFuseTrainerMixin.__init__
        self.inert = False    # another CommFuseCallback of the same Trainer does the work (see _defer)
        self.model = None
        self._window: dict[str, float] = {}   # the accumulation window running now, summed over micro-batches
        self._last_window: dict[str, float] | None = None   # the last finished optimizer step

    def _defer(self, trainer) -> bool:
        """Two CommFuseCallbacks on one Trainer (a script that passed two, or one from a config and one made by
        hand): the one given a config explicitly wins, else the first; the other does nothing."""
        if trainer is None:
            return False
        callbacks = list(trainer.callback_handler.callbacks)
        mine = callbacks.index(self)
        for i, other in enumerate(callbacks):
            if not isinstance(other, CommFuseCallback) or other is self:
                continue
            if (other.explicit and not self.explicit) or (other.explicit == self.explicit and i < mine):
                if other.cfg != self.cfg:
                    logger.warning("CommFuseCallback: this Trainer has two CommFuseCallbacks with different configs; "
                                   "the one %s is used", "passed to the Trainer" if other.explicit else "listed first")
                return True
        return False

    def on_init_end(self, args, state, control, model=None, **kwargs):
        trainer = self.trainer
        if self._defer(trainer):
            self.inert = True
            return control
        if model is None:
            raise ValueError("CommFuseCallback: the Trainer has no model to shard; pass model=... to Trainer "
                             "(model_init= is not supported with CommFuseCallback)")
        if getattr(args, "fsdp", None):
            raise ValueError("CommFuseCallback shards the model itself: remove `fsdp` / `fsdp_config` from the "
                             "TrainingArguments, or drop CommFuseCallback to use accelerate's FSDP")
        if getattr(args, "deepspeed", None):  # DeepSpeed shards; its collectives go to the rings at on_train_begin
            from commfuse_dp.integrations.deepspeed import attach_to_trainer_callback

            return attach_to_trainer_callback(self, args, model, control)
        if trainer is None:
            needs = _needs_trainer(args) + [f"CommFuseConfig.{name}=True" for name in ("auto_resume", "async_save")
                                             if getattr(self.cfg, name)] + (
                [f"CommFuseConfig.tp_size={self.cfg.tp_size} (a TP group's ranks read one batch, and the gradient "
                 f"norm spans their parts)"] if self.cfg.tp_size > 1 else [])
            if needs:   # the same arguments on every rank: every rank raises here
                raise ValueError("CommFuseCallback: on_init_end was not called by a Trainer with commfuse's "
                                 "checkpoint methods (a plain transformers Trainer hands its callbacks no "
                                 "reference to itself), and " + "; ".join(needs) + " need that Trainer. "
                                 + _USE_INSTEAD[0].upper() + _USE_INSTEAD[1:])
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("CommFuseCallback: torch.distributed is not initialised. Launch the script with "
                               "`torchrun --nproc_per_node N` (or `accelerate launch`); on CPU also pass "
                               "use_cpu=True to TrainingArguments (or set ACCELERATE_USE_CPU=true)")
        if trainer is None and getattr(args, "process_index", 0) == 0:
            logger.warning("CommFuseCallback on a plain Trainer: the model is sharded, but trainer.save_model() "
                           "cannot save it (the Trainer writes on rank 0 alone), and models the Trainer prepares "
                           "beside it (TRL's reference, reward or teacher model) stay whole on every rank. To save "
                           "and shard those, %s; or call commfuse_dp.checkpoint.save_pretrained(trainer.model, "
                           "folder) on every rank", _USE_INSTEAD)
        if trainer is not None and self.cfg.tokens_per_rank is None:
            first = first_batch_tokens(trainer, args)
            if first is not None:  # what the defaults plan with (commfuse_dp/planner/choose.py)
                batch_tokens(model, *first)
        done = attach(model, self.cfg, who="CommFuseCallback", parallelism=self._parallelism(args))
        if trainer is not None:
            # accelerate's mixed precision is applied in prepare_model, which returns a model flagged as prepared
            # untouched: apply it here, without the DDP wrap, from the model's own forward hooks (so that it holds
            # when TRL replaces model.forward after this callback ran).
            prepare_sharded(trainer.accelerator, model)
            # the models the Trainer prepares next for evaluation (TRL's reference, reward, teacher) are sharded
            # like this one (commfuse_dp/integrations/accelerate.py, FrozenModels)
            shard_frozen_models(trainer.accelerator, frozen_config(done.config, model) if done.config.shard_frozen
                                else None)
        # Accelerator.prepare_model returns a model carrying this flag as it is (no DDP wrap on top of the shards).
        model._is_accelerate_prepared = True
        self.model = model
        return control

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """A callback of the Trainer that mixes the trained model into another (TRL's ``SyncRefModelCallback``:
        ``sync_ref_model=True``) gets two models laid out alike, or an error on every rank before the first step;
        TRL's ``BEMACallback``, which copies the shards into a whole model, is refused there."""
        trainer = self.trainer
        if self.inert or trainer is None or not ckpt.is_sharded(model):
            return control
        for callback in trainer.callback_handler.callbacks:
            target = getattr(callback, "ref_model", None)
            if type(callback).__name__ == "SyncRefModelCallback" and isinstance(target, torch.nn.Module):
                check_same_layout(target, trainer.accelerator.unwrap_model(model),
                                  f"{type(trainer).__name__}: sync_ref_model=True mixes the policy into ref_model")
            if type(callback).__name__ == "BEMACallback":
                raise ValueError(
                    f"{type(trainer).__name__}: TRL's BEMACallback builds a whole copy of the model on every rank, "
                    "copies the sharded parameters into it and saves it on rank 0 alone, which a sharded model "
                    "cannot feed. Remove the callback; to average weights, keep detached "
                    "clones of the sharded parameters, update them with lerp_ after each step (exact, shard against "
                    "shard), and copy them into the parameters (param.data.copy_(ema)) before saving the average")
        return control

    def _parallelism(self, args) -> Parallelism | None:
        """HSDP from ``TrainingArguments(parallelism_config=ParallelismConfig(dp_replicate_size=R,
        dp_shard_size=S))``, which :func:`attach` makes ``replicate=R`` (accelerate builds its own mesh of it but,
        without FSDP, shards nothing). Only the user's own field is read: the Accelerator's copy, when none was
        given, says ``dp_replicate_size = world`` (its DDP default)."""
        pc = getattr(args, "parallelism_config", None)
        if pc is None:
            return None
        sizes = {k: getattr(pc, k, None) for k in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size",
                                                   "sp_size")}
        return Parallelism(sizes, "CommFuseCallback: TrainingArguments.parallelism_config",
                           "the callback's CommFuseConfig")

    def _with_parallelism(self, args) -> CommFuseConfig:
        """The config the callback shards with, :meth:`_parallelism` applied."""
        parallelism = self._parallelism(args)
        return self.cfg if parallelism is None else parallelism.apply(self.cfg)

    def _add_micro_batch(self, model) -> None:
        engine = engine_of(model if model is not None else self.model)
        if engine is None or not engine.stats.enabled:
            return
        stats = engine.stats.current().as_dict()   # the micro-batch whose backward just finished
        for key in _STAT_KEYS:
            self._window[key] = self._window.get(key, 0) + stats[key]
        self._window["skipped_steps"] = stats["skipped_steps"]  # a running count (nonfinite_grads="skip"): not summed

    def on_step_begin(self, args, state, control, **kwargs):
        if self.inert:
            return control
        self._window = {}
        return control

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        if self.inert:
            return control
        self._add_micro_batch(model)
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.inert:
            return control
        self._add_micro_batch(model)
        if self._window:
            self._last_window, self._window = self._window, {}
        return control

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if self.inert:
            return control
        if logs is None or "loss" not in logs or self._last_window is None:
            return control
        figures = {f"commfuse/{key}": self._last_window[key] for key in (*_STAT_KEYS, "skipped_steps")}
        logs.update(figures)
        # Trainer.log stored {**logs, "step": global_step} in log_history just before calling on_log.
        if state.log_history and state.log_history[-1].get("step") == state.global_step \
                and state.log_history[-1].get("loss") == logs["loss"]:
            state.log_history[-1].update(figures)
        return control
