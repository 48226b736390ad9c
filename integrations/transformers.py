"""Hugging Face ``Trainer`` with CommFuse sharding: one callback.

    import torch
    from transformers import Trainer, TrainingArguments
    from commfuse_dp import CommFuseConfig
    from commfuse_dp.integrations.transformers import CommFuseCallback

    trainer = Trainer(model=model, args=TrainingArguments(..., use_cpu=True),   # or a GPU run
                      train_dataset=ds, callbacks=[CommFuseCallback(CommFuseConfig(...))])
    trainer.train()

Launch it with ``torchrun --nproc_per_node N script.py`` (or ``accelerate launch``). On CPU, ``use_cpu=True`` in the
``TrainingArguments`` is enough: ``TrainingArguments`` then builds accelerate's state with ``cpu=True``
(transformers/training_args.py, ``if self.use_cpu or ACCELERATE_USE_CPU``), and accelerate picks ``MULTI_CPU`` (gloo)
because torchrun set ``LOCAL_RANK`` / ``WORLD_SIZE`` (accelerate/state.py, ``PartialState.__init__``).
``ACCELERATE_USE_CPU=true`` in the environment does the same without ``use_cpu``.

How it works (transformers 5.23, accelerate 1.15):

* Callbacks receive ``model`` (``Trainer.model``), ``optimizer``, ... as keyword arguments, never the Trainer or its
  Accelerator (``CallbackHandler.call_event``). ``on_init_end`` runs at the end of ``Trainer.__init__``: the
  Accelerator and the process group exist, the optimizer does not. There the callback shards the model in place
  with :func:`commfuse_dp.shard` and marks it ``model._is_accelerate_prepared = True``, so that
  ``Accelerator.prepare_model`` hands it back untouched instead of wrapping it in DDP. ``Trainer.train`` then
  builds its optimizer from the sharded (DTensor) parameters: the optimizer state is sharded too.
* Gradient accumulation: for every micro-batch but the last of an accumulation window the Trainer enters
  ``accelerator.no_sync(model)``, which (not FSDP2, not DeepSpeed, distributed) uses ``getattr(model, "no_sync")``
  -- the sharded model's own ``no_sync()``. So gradients are accumulated locally and reduce-scattered once, on
  the last micro-batch; the callback does not need to do anything per step.
* Gradient clipping: ``Trainer._clip_grad_norm`` -> ``accelerator.clip_grad_norm_`` ->
  ``Accelerator._clip_grad_norm_dtensor_aware`` on the DTensor gradients, which reduces the norm over the mesh
  (the Trainer's own mixed-mesh path is not taken: fused shards and FSDP2 units share one mesh).
* Evaluation runs the sharded forward on every rank, so every rank must run the same number of eval batches.
  accelerate's default ``even_batches=True`` guarantees that; with ``even_batches=False`` only a last batch that
  is shorter (not missing) on some ranks is fine.
* Step figures: commfuse counts a step per forward (:func:`commfuse_dp.step_stats` gives the last *finished*
  forward+backward, i.e. one micro-batch, and at ``on_log`` that is the window's first one, run under
  ``no_sync``). So the callback reads the running micro-batch's figures itself after each one's backward
  (``on_substep_end`` for all but the last micro-batch of the window, ``on_step_end`` for the last) and sums them
  over the accumulation window. ``on_log`` adds ``commfuse/exposed_comm_s``, ``commfuse/comm_s``,
  ``commfuse/compute_s``, ``commfuse/wall_s`` and ``commfuse/ring_steps`` of this rank's last optimizer step
  (all its micro-batches) to each training log. ``Trainer.log`` appends a *copy* of ``logs`` (plus ``step``) to
  ``state.log_history`` before it calls ``on_log``, and the reporting callbacks (``report_to``) come before the
  ones passed as ``callbacks=``; so the callback writes the figures into ``state.log_history[-1]`` and into
  ``logs`` in place, where callbacks after it see them. To have a reporter record them, move it behind:
  ``trainer.pop_callback(TensorBoardCallback); trainer.add_callback(TensorBoardCallback)``.

* Checkpoints: the Trainer saves the model on rank 0 alone and the optimizer as one ``optimizer.pt`` of rank 0's
  state, which for a sharded model would keep rank 0's shards only. A callback is handed no reference to its
  Trainer, so at ``on_init_end`` the callback finds the Trainer whose ``__init__`` is calling it (up the call stack)
  and replaces, on that one instance, the five methods that write and read checkpoints:

  - ``_save`` (``save_model()`` and every checkpoint): every rank joins the gather of the full weights
    (:func:`commfuse_dp.checkpoint.full_state_dict`, rank 0 only holds them, in CPU memory), then the Trainer's own
    ``_save`` writes them on rank 0 with ``save_pretrained``: an ordinary consolidated Hugging Face folder.
  - ``_save_optimizer_and_scheduler``: every rank writes its model and optimizer shards into
    ``checkpoint-N/commfuse`` (``torch.distributed.checkpoint``, keyed by parameter names; renamed into place once
    every rank has finished); the scheduler goes to ``scheduler.pt`` as before. RNG states (one file per rank),
    ``trainer_state.json`` and the data position are the Trainer's own.
  - ``_load_from_checkpoint`` / ``_load_best_model``: the shards from ``checkpoint-N/commfuse`` (or, for a
    ``save_only_model`` checkpoint, the consolidated safetensors, each rank keeping its slices).
  - ``_load_optimizer_and_scheduler``: the optimizer shards and the scheduler. A checkpoint holding a single
    ``optimizer.pt`` (written without commfuse) is refused rather than half-loaded.

  And two more, wrapped rather than replaced (the instance's own versions run inside), so that a checkpoint is
  atomic (see the comment above ``_require_complete`` for what transformers 5.23 does without them):

  - ``_save_checkpoint``: ``checkpoint-N/commfuse_complete`` is written once every rank has written all of
    ``checkpoint-N``, and older checkpoints are rotated away (``save_total_limit``) only then, among complete
    ones. A rank killed mid-save leaves ``checkpoint-N`` without the marker and the previous checkpoint intact.
  - ``train``: ``resume_from_checkpoint=True`` takes the last *complete* checkpoint of ``output_dir`` (an
    incomplete newer one is passed over with a warning); a checkpoint named explicitly without the marker is
    refused (``ValueError`` naming it and the last complete one).

  ``save_model()`` is collective like everything else here: call it on every rank (the Trainer's own checkpoints
  do), not inside ``if trainer.is_world_process_zero()``. A subclass that overrides one of the five replaced
  methods gets a warning: for this trainer, commfuse's version runs instead.

* DeepSpeed (``TrainingArguments(deepspeed=...)``): DeepSpeed shards the model, and the callback switches
  DeepSpeed's data-parallel collectives to the rings when training begins
  (:func:`commfuse_dp.integrations.deepspeed.attach_to_trainer_callback`); saving and resuming stay DeepSpeed's own.

Refused: a run without an initialised ``torch.distributed``, and ``TrainingArguments`` that ask for FSDP (it would
shard the model a second time).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import shutil
import types

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

from commfuse_dp import checkpoint as ckpt
from commfuse_dp.config import CommFuseConfig, with_parallelism
from commfuse_dp.integrations.accelerate import prepare_sharded
from commfuse_dp.shard import shard

__all__ = ["CommFuseCallback"]

_STAT_KEYS = ("exposed_comm_s", "comm_s", "compute_s", "wall_s", "ring_steps")

logger = logging.getLogger("commfuse_dp")

CHECKPOINT_SUBDIR = "commfuse"     # checkpoint-N/commfuse: every rank's model and optimizer shards (DCP)
SCHEDULER_NAME = "scheduler.pt"    # as the Trainer names it (transformers/trainer.py)
TRAINING_ARGS_NAME = "training_args.bin"
OPTIMIZER_NAME = "optimizer.pt"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def _find_trainer(callback: TrainerCallback) -> Trainer | None:
    """The Trainer whose ``__init__`` is calling ``on_init_end`` on ``callback`` (found up the call stack: the
    one place a callback can meet its Trainer; transformers passes callbacks no reference to it)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer) and \
                    callback in getattr(getattr(candidate, "callback_handler", None), "callbacks", ()):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame


# ---- the Trainer's checkpoint methods, for a commfuse-sharded model (bound to one Trainer instance) -----------

def _save(self: Trainer, output_dir: str | None = None, state_dict: dict | None = None) -> None:
    # A PreTrainedModel: commfuse_dp.checkpoint.save_pretrained, every rank writing its own slices into the
    # safetensors in place (no rank holds the full model), then the rest of Trainer._save on the writing rank
    # (tokenizer, training_args.bin). Anything else (a state_dict passed in, a model without save_pretrained):
    # every rank gathers (the full copy lands on rank 0, in CPU memory) and Trainer._save writes it.
    output_dir = output_dir if output_dir is not None else self.args.output_dir
    if state_dict is None and hasattr(self.model, "save_pretrained"):
        ckpt.save_pretrained(self.model, output_dir, is_main_process=self.args.should_save)
        if self.args.should_save:
            tokenizer = self.processing_class
            if tokenizer is None and self.data_collator is not None:
                tokenizer = getattr(self.data_collator, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        dist.barrier()
        return
    if state_dict is None:
        state_dict = ckpt.full_state_dict(self.model)
    Trainer._save(self, output_dir, state_dict=state_dict)
    del state_dict
    dist.barrier()


def _save_optimizer_and_scheduler(self: Trainer, output_dir: str) -> None:
    # Every rank writes its own model and optimizer shards (DCP); no optimizer.pt of rank 0's shard alone.
    ckpt.save_sharded(os.path.join(output_dir, CHECKPOINT_SUBDIR), [self.model], [(self.model, self.optimizer)])
    if self.args.should_save and self.lr_scheduler is not None:
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def _load_from_checkpoint(self: Trainer, resume_from_checkpoint: str, model=None) -> None:
    _require_complete(resume_from_checkpoint)
    folder = os.path.join(resume_from_checkpoint, CHECKPOINT_SUBDIR)
    if ckpt.is_complete(folder):
        ckpt.load_sharded(folder, [self.model])       # exact: the shards as they were, under the model's own names
    else:                                             # a save_only_model checkpoint, or a consolidated folder
        ckpt.load_pretrained_weights(self.model, resume_from_checkpoint)


def _load_optimizer_and_scheduler(self: Trainer, checkpoint: str | None) -> None:
    if checkpoint is None:
        return
    folder = os.path.join(checkpoint, CHECKPOINT_SUBDIR)
    if not ckpt.is_complete(folder):
        if os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
            raise ValueError(f"{checkpoint} holds a single {OPTIMIZER_NAME} written without commfuse (or by an "
                             "older run); its optimizer state cannot be split into this run's shards. Resume it "
                             "without CommFuseCallback, or start from its weights alone (a fresh run with "
                             "model=from_pretrained(checkpoint))")
        logger.warning("CommFuseCallback: %s has no optimizer state (saved with save_only_model=True?): the "
                       "optimizer and scheduler start fresh", checkpoint)
        return
    ckpt.load_sharded(folder, [], [(self.model, self.optimizer)])
    scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
    if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
        self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


def _load_best_model(self: Trainer) -> None:
    logger.info("Loading best model from %s (score: %s).", self.state.best_model_checkpoint, self.state.best_metric)
    _load_from_checkpoint(self, self.state.best_model_checkpoint)


_CHECKPOINT_METHODS = {"_save": _save, "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
                       "_load_from_checkpoint": _load_from_checkpoint,
                       "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
                       "_load_best_model": _load_best_model}


# ---- atomic checkpoints: checkpoint-N counts only once every rank has written all of it --------------------
#
# Trainer._save_checkpoint (transformers 5.23) writes straight into checkpoint-N (no temporary folder, no rename):
# the weights, checkpoint-N/commfuse, scheduler.pt, one rng_state_<rank>.pth per rank, trainer_state.json last on
# rank 0, and then rank 0 alone deletes older checkpoints (trainer_utils.rotate_checkpoints, save_total_limit),
# without waiting for the other ranks. trainer_utils.get_last_checkpoint (resume_from_checkpoint=True) takes the
# highest checkpoint-N folder whatever it holds. So a rank killed while checkpoint-N is written leaves a folder
# that resume_from_checkpoint=True picks (the Trainer then fails on a missing trainer_state.json, or resumes without
# some rank's RNG state), and the previous checkpoint may already be deleted by then.
#
# The callback wraps two more methods of the same Trainer instance (the instance's own bound methods, so a
# subclass's versions still run inside):
# - _save_checkpoint: the marker of checkpoint-N is removed first (re-saving a step overwrites in place), the
#   Trainer saves with save_total_limit set to None for the duration of that call (its rotation skipped), every
#   rank meets at a barrier, and only then does the saving process write checkpoint-N/commfuse_complete and
#   rotate, counting complete checkpoints only and never deleting the one just written or the best one.
# - train: resume_from_checkpoint=True resumes from the last *complete* checkpoint (passing over, with a warning,
#   the ones a killed save left behind); a checkpoint named explicitly must be complete or is refused, as it is
#   in _load_from_checkpoint.

def _require_complete(checkpoint: str) -> None:
    if ckpt.is_complete(checkpoint):
        return
    checkpoint = os.fspath(checkpoint)
    if not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"CommFuseCallback: checkpoint {checkpoint} does not exist")
    parent = os.path.dirname(os.path.abspath(checkpoint))
    last = ckpt.latest_complete(parent, PREFIX_CHECKPOINT_DIR)
    if os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
        why = (f"it holds a single {OPTIMIZER_NAME}: it was written without CommFuseCallback (or by an older "
               "version), and its optimizer state cannot be split into this run's shards")
    else:
        why = ("it has no commfuse_complete marker, which CommFuseCallback writes once every rank has written its "
               "part: its save did not finish (a rank stopped while the Trainer was writing it), or it was "
               "written without CommFuseCallback (then start a fresh run from its weights alone: "
               "Trainer(model=AutoModel....from_pretrained(checkpoint), ...))")
    raise ValueError(f"CommFuseCallback: {checkpoint} is not a complete checkpoint: {why}. Resume from "
                     + (f"the last complete one, {last}" if last else "another checkpoint (there is no complete one "
                        f"in {parent})")
                     + ", or pass resume_from_checkpoint=True, which takes the last complete checkpoint of "
                     "output_dir")


def _last_complete_checkpoint(output_dir: str) -> str:
    last = ckpt.latest_complete(output_dir, PREFIX_CHECKPOINT_DIR)
    if last is None:
        raise ValueError(f"No valid checkpoint found in output directory ({output_dir}): CommFuseCallback "
                         "resumes only from complete checkpoints (with a commfuse_complete marker)")
    newer = [name for name in sorted(os.listdir(output_dir))
             if _CHECKPOINT_RE.match(name) and os.path.isdir(os.path.join(output_dir, name))
             and int(_CHECKPOINT_RE.match(name).group(1)) > int(_CHECKPOINT_RE.match(os.path.basename(last)).group(1))]
    if newer:
        logger.warning("CommFuseCallback: %s in %s %s incomplete (a save was interrupted); resuming from %s",
                       ", ".join(newer), output_dir, "is" if len(newer) == 1 else "are", last)
    return last


def _rotate_complete(run_dir: str, limit: int | None, best: str | None, newest: str) -> None:
    """transformers' rotation (oldest first, by mtime as Trainer._save_checkpoint asks), among complete
    checkpoints only; the one just written and the best one are kept. A checkpoint loses its marker before its
    files go, so a deletion cut short never leaves a folder that looks complete."""
    if limit is None or limit <= 0:
        return
    complete = [c for c in sort_checkpoints(run_dir, PREFIX_CHECKPOINT_DIR, use_mtime=True) if ckpt.is_complete(c)]
    protected = {os.path.abspath(newest)} | ({os.path.abspath(best)} if best else set())
    keep = max(limit, len(protected & {os.path.abspath(c) for c in complete}))
    remaining = len(complete)
    for folder in complete:
        if remaining <= keep:
            break
        if os.path.abspath(folder) not in protected:
            ckpt.unmark_complete(folder)
            shutil.rmtree(folder, ignore_errors=True)
            remaining -= 1


def _wrap_save_checkpoint(trainer: Trainer) -> None:
    inner = trainer._save_checkpoint

    def _save_checkpoint(model, trial):
        run_dir = trainer._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
        should_save = trainer.args.should_save
        if should_save:
            ckpt.unmark_complete(output_dir)
        dist.barrier()
        limit = trainer.args.save_total_limit
        trainer.args.save_total_limit = None   # no rotation before every rank has finished this checkpoint
        try:
            inner(model, trial)
        finally:
            trainer.args.save_total_limit = limit
        dist.barrier()   # every rank has written its part (its rng_state_<rank>.pth is its last file)
        if should_save:
            ckpt.mark_complete(output_dir)
            _rotate_complete(run_dir, limit, trainer.state.best_model_checkpoint, output_dir)
        dist.barrier()

    trainer._save_checkpoint = _save_checkpoint


def _wrap_train(trainer: Trainer) -> None:
    inner = trainer.train

    @functools.wraps(inner)
    def train(resume_from_checkpoint=None, *args, **kwargs):
        if isinstance(resume_from_checkpoint, bool):
            if resume_from_checkpoint:
                resume_from_checkpoint = _last_complete_checkpoint(trainer.args.output_dir)
        elif resume_from_checkpoint is not None:
            _require_complete(resume_from_checkpoint)
        return inner(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train


def _take_over_checkpoints(trainer: Trainer) -> None:
    for name, method in _CHECKPOINT_METHODS.items():
        if getattr(type(trainer), name) is not getattr(Trainer, name):
            logger.warning("CommFuseCallback: %s overrides Trainer.%s; this trainer now uses commfuse's sharded "
                           "version instead", type(trainer).__name__, name)
        setattr(trainer, name, types.MethodType(method, trainer))
    _wrap_save_checkpoint(trainer)
    _wrap_train(trainer)


class CommFuseCallback(TrainerCallback):
    """Shards ``Trainer.model`` with :func:`commfuse_dp.shard` before the Trainer prepares it (see module docs).

    ``cfg``: the :class:`CommFuseConfig`; ``None`` reads it from the ``COMMFUSE_*`` environment
    (``CommFuseConfig.from_env()``, what ``commfuse-dp launch`` sets).
    """

    def __init__(self, cfg: CommFuseConfig | None = None) -> None:
        self.explicit = cfg is not None
        self.cfg = cfg if cfg is not None else CommFuseConfig.from_env()
        self.inert = False    # another CommFuseCallback of the same Trainer does the work (see _defer)
        self.model = None
        self._window: dict[str, float] = {}   # the accumulation window running now, summed over micro-batches
        self._last_window: dict[str, float] | None = None   # the last finished optimizer step

    def _defer(self, trainer: Trainer | None) -> bool:
        """Two CommFuseCallbacks on one Trainer (``commfuse-dp launch`` adds one to every Trainer, and the script
        passed its own): the one given a config explicitly wins, else the first; the other does nothing."""
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
        if self._defer(_find_trainer(self)):
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
        trainer = _find_trainer(self)
        saves = getattr(args.save_strategy, "value", args.save_strategy) != "no"
        if trainer is None and saves:
            raise ValueError("CommFuseCallback: on_init_end was not called by a Trainer's __init__, so the "
                             "callback cannot make the Trainer save every rank's shards; pass the callback in "
                             "Trainer(callbacks=[...]) or set save_strategy='no'")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("CommFuseCallback: torch.distributed is not initialised. Launch the script with "
                               "`torchrun --nproc_per_node N` (or `accelerate launch`); on CPU also pass "
                               "use_cpu=True to TrainingArguments (or set ACCELERATE_USE_CPU=true)")
        if getattr(model, "_commfuse_engine", None) is None:
            shard(model, self._with_parallelism(args))
        if trainer is not None:
            _take_over_checkpoints(trainer)
            # accelerate's mixed precision is applied in prepare_model, which returns a model flagged as prepared
            # untouched: apply it here, without the DDP wrap, from the model's own forward hooks (so that it holds
            # when TRL replaces model.forward after this callback ran).
            prepare_sharded(trainer.accelerator, model)
        elif getattr(args, "bf16", False) or getattr(args, "fp16", False):
            raise ValueError("CommFuseCallback: on_init_end was not called by a Trainer's __init__, so the "
                             "callback cannot apply the Trainer's bf16/fp16 autocast; pass the callback in "
                             "Trainer(callbacks=[...])")
        # Accelerator.prepare_model returns a model carrying this flag as it is (no DDP wrap on top of the shards).
        model._is_accelerate_prepared = True
        self.model = model
        return control

    def _with_parallelism(self, args) -> CommFuseConfig:
        """The config, with HSDP from ``TrainingArguments(parallelism_config=ParallelismConfig(dp_replicate_size=R,
        dp_shard_size=S))`` as ``replicate=R`` (accelerate builds its own mesh of it but, without FSDP, shards
        nothing). Only the user's own field is read: the Accelerator's copy, when none was given, says
        ``dp_replicate_size = world`` (its DDP default)."""
        pc = getattr(args, "parallelism_config", None)
        if pc is None:
            return self.cfg
        sizes = {k: getattr(pc, k, None) for k in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size",
                                                   "sp_size")}
        return with_parallelism(self.cfg, sizes, "CommFuseCallback: TrainingArguments.parallelism_config",
                                "the callback's CommFuseConfig")

    def _add_micro_batch(self, model) -> None:
        engine = getattr(model if model is not None else self.model, "_commfuse_engine", None)
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
