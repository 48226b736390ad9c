"""Hugging Face ``Trainer`` with CommFuse sharding: ``CommFuseTrainer``, or a Trainer class of your own made with
:func:`commfuse_trainer`.

    from transformers import TrainingArguments
    from commfuse_dp import CommFuseConfig
    from commfuse_dp.integrations.transformers import CommFuseTrainer

    trainer = CommFuseTrainer(model=model, args=TrainingArguments(..., use_cpu=True),   # or a GPU run
                              train_dataset=ds, commfuse=CommFuseConfig(...))
    trainer.train()
    trainer.save_model("out/model")          # on every rank: a consolidated Hugging Face folder

``CommFuseTrainer`` takes the ``Trainer``'s own arguments, plus ``commfuse=`` (a :class:`CommFuseConfig`; without it,
``CommFuseConfig.from_env()``, what ``commfuse-dp launch`` sets). ``callbacks=[CommFuseCallback(cfg)]`` instead of
``commfuse=cfg`` does the same. Any other ``Trainer`` class -- TRL's ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``,
a subclass of your own -- gets the same with ``commfuse_trainer(SFTTrainer)(model=..., args=..., ...)`` (a subclass
``class CommFuseSFTTrainer(CommFuseTrainerMixin, SFTTrainer)``, made once per class), or by subclassing
``CommFuseTrainerMixin`` first yourself. ``commfuse-dp launch`` does this for every Trainer of an unchanged script
(``commfuse_dp/launch/bootstrap.py``): ``transformers.Trainer`` is ``CommFuseTrainer`` in its workers, so TRL's trainers
and ``run_clm.py``, which subclass or use it, are sharded without a change.

Launch the script with ``torchrun --nproc_per_node N script.py`` (or ``accelerate launch``). On CPU, ``use_cpu=True``
in the ``TrainingArguments`` is enough: ``TrainingArguments`` then builds accelerate's state with ``cpu=True``
(transformers/training_args.py, ``if self.use_cpu or ACCELERATE_USE_CPU``), and accelerate picks ``MULTI_CPU`` (gloo)
because torchrun set ``LOCAL_RANK`` / ``WORLD_SIZE`` (accelerate/state.py, ``PartialState.__init__``).
``ACCELERATE_USE_CPU=true`` in the environment does the same without ``use_cpu``.

``CommFuseCallback`` alone, on a plain ``Trainer(callbacks=[CommFuseCallback(cfg)])``: transformers hands its
callbacks no reference to the Trainer, so the callback can shard the model and report its step figures but cannot
change how that Trainer saves and loads checkpoints nor reach its Accelerator. It therefore refuses, on every rank
at the end of ``Trainer.__init__``, ``TrainingArguments`` that need those -- ``save_strategy`` other than ``"no"``
(the Trainer's default is ``"steps"``), ``resume_from_checkpoint``, ``bf16`` / ``fp16`` -- with a ``ValueError`` that
says to write ``CommFuseTrainer(...)`` (or ``commfuse_trainer(SFTTrainer)(...)``) instead. Without them it runs,
and warns (once, on the main process) that ``trainer.save_model()`` needs ``CommFuseTrainer`` too: a plain
Trainer's ``save_model`` writes on rank 0 alone, which cannot gather a sharded model. With DeepSpeed the callback
alone is all there is to it (below).

How it works (transformers 5.23, accelerate 1.15):

* ``CommFuseTrainerMixin.__init__`` hands the ``CommFuseCallback`` (the one passed in ``callbacks=``, or a new one
  made of ``commfuse=``, inserted first among ``callbacks``) a reference to its Trainer, then runs the Trainer's
  ``__init__``. Callbacks receive ``model`` (``Trainer.model``), ``optimizer``, ... as keyword arguments, never the
  Trainer (``CallbackHandler.call_event``). ``on_init_end`` runs at the end of ``Trainer.__init__``: the Accelerator
  and the process group exist, the optimizer does not. There the callback shards the model in place with
  :func:`commfuse_dp.shard` (through :func:`commfuse_dp.integrations.attach.attach`) and marks it
  ``model._is_accelerate_prepared = True``, so that ``Accelerator.prepare_model`` hands it back untouched instead of
  wrapping it in DDP, and applies accelerate's mixed precision from the model's own forward hooks
  (``prepare_sharded(trainer.accelerator, model)``). ``Trainer.train`` then builds its optimizer from the sharded
  (DTensor) parameters: the optimizer state is sharded too.
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
  ``commfuse/compute_s``, ``commfuse/wall_s`` and ``commfuse/hops`` of this rank's last optimizer step
  (all its micro-batches) to each training log. ``Trainer.log`` appends a *copy* of ``logs`` (plus ``step``) to
  ``state.log_history`` before it calls ``on_log``, and the reporting callbacks (``report_to``) come before the
  ones passed as ``callbacks=``; so the callback writes the figures into ``state.log_history[-1]`` and into
  ``logs`` in place, where callbacks after it see them. To have a reporter record them, move it behind:
  ``trainer.pop_callback(TensorBoardCallback); trainer.add_callback(TensorBoardCallback)``.

* Checkpoints: the Trainer saves the model on rank 0 alone and the optimizer as one ``optimizer.pt`` of rank 0's
  state, which for a sharded model would keep rank 0's shards only. The mixin overrides the five methods that
  write and read checkpoints (its versions run instead of the Trainer's; when the model is not sharded by
  commfuse -- DeepSpeed -- each calls the Trainer's own):

  - ``_save`` (``save_model()`` and every checkpoint): a ``PreTrainedModel`` is written by
    :func:`commfuse_dp.checkpoint.save_pretrained`, every rank writing its own slices into the safetensors in
    place: an ordinary consolidated Hugging Face folder. Anything else: every rank joins the gather of the full
    weights (:func:`commfuse_dp.checkpoint.full_state_dict`, rank 0 only holds them, in CPU memory), then the
    Trainer's own ``_save`` writes them on rank 0.
  - ``_save_optimizer_and_scheduler``: every rank writes its model and optimizer shards into
    ``checkpoint-N/commfuse`` (``torch.distributed.checkpoint``, keyed by parameter names; renamed into place once
    every rank has finished); the scheduler goes to ``scheduler.pt`` as before. RNG states (one file per rank),
    ``trainer_state.json`` and the data position are the Trainer's own.
  - ``_load_from_checkpoint`` / ``_load_best_model``: the shards from ``checkpoint-N/commfuse`` (or, for a
    ``save_only_model`` checkpoint, the consolidated safetensors, each rank keeping its slices).
  - ``_load_optimizer_and_scheduler``: the optimizer shards and the scheduler. A checkpoint holding a single
    ``optimizer.pt`` (written without commfuse) is refused rather than half-loaded.

  And two more, which call the Trainer's own inside, so that a checkpoint is atomic (see the comment above
  ``require_complete`` for what transformers 5.23 does without them):

  - ``_save_checkpoint``: ``checkpoint-N/commfuse_complete`` is written once every rank has written all of
    ``checkpoint-N``, and older checkpoints are rotated away only then, among complete ones. A rank killed
    mid-save leaves ``checkpoint-N`` without the marker and the previous checkpoint intact.
  - ``train``: ``resume_from_checkpoint=True`` takes the last *complete* checkpoint of ``output_dir`` (an
    incomplete newer one is passed over with a warning); a checkpoint named explicitly without the marker is
    refused (``ValueError`` naming it and the last complete one).

  Rotation (``save_total_limit``): transformers 5.23 has no method to override for it (``_save_checkpoint`` calls
  ``trainer_utils.rotate_checkpoints`` with ``args.save_total_limit`` on rank 0, before the other ranks have
  finished). So the mixin keeps the limit itself: it gives the Trainer a copy of the ``TrainingArguments`` with
  ``save_total_limit=None`` (the caller's object is left as it is), and applies the limit after each complete
  save, and at the end of ``train`` as the Trainer does for ``save_total_limit=1`` with a best model. The limit
  asked for is ``trainer.commfuse_save_total_limit``.

  ``save_model()`` is collective like everything else here: call it on every rank (the Trainer's own checkpoints
  do), not inside ``if trainer.is_world_process_zero()``. A Trainer class that overrides one of the five replaced
  methods and is given to :func:`commfuse_trainer` gets a warning: commfuse's version runs instead (a subclass of
  ``CommFuseTrainer`` that overrides one and calls ``super()`` runs both).

* DeepSpeed (``TrainingArguments(deepspeed=...)``): DeepSpeed shards the model, and the callback switches
  DeepSpeed's data-parallel collectives to the rings when training begins
  (:func:`commfuse_dp.integrations.deepspeed.attach_to_trainer_callback`); saving and resuming stay DeepSpeed's own,
  so this works with ``CommFuseCallback`` on a plain ``Trainer`` as well as with ``CommFuseTrainer``.

Refused: a run without an initialised ``torch.distributed``, and ``TrainingArguments`` that ask for FSDP (it would
shard the model a second time).

This module does not import ``transformers.trainer`` when it is imported: ``CommFuseTrainer`` is made on first
use (``commfuse-dp launch`` imports this module while ``transformers.trainer`` is being imported).
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints, sort_checkpoints

from commfuse_dp import checkpoint as ckpt
from commfuse_dp.config import CommFuseConfig
from commfuse_dp.handle import handle_of

from commfuse_dp.integrations.trainer_callback import CommFuseCallback
from commfuse_dp.tp import clip_grad_norm_ as tp_clip_grad_norm_
from commfuse_dp.integrations.trainer_checkpoints import (OPTIMIZER_NAME, last_complete_checkpoint, require_complete,
                                                          rotate_complete)

__all__ = ["CommFuseCallback", "CommFuseTrainer", "CommFuseTrainerMixin", "commfuse_trainer"]

logger = logging.getLogger("commfuse_dp")

CHECKPOINT_SUBDIR = "commfuse"     # checkpoint-N/commfuse: every rank's model and optimizer shards (DCP)
SCHEDULER_NAME = "scheduler.pt"    # as the Trainer names it (transformers/trainer.py)
TRAINING_ARGS_NAME = "training_args.bin"


def _transformers_trainer() -> type:
    """transformers' own ``Trainer`` class (not the ``CommFuseTrainer`` that ``commfuse-dp launch`` puts in its
    place under the same name)."""
    import transformers.trainer

    current = transformers.trainer.Trainer
    return vars(current).get("_commfuse_base", current) if issubclass(current, CommFuseTrainerMixin) else current


# ---- the Trainer mixin ----------------------------------------------------------------------------------------

_REPLACED = ("_save", "_save_optimizer_and_scheduler", "_load_from_checkpoint", "_load_optimizer_and_scheduler",
             "_load_best_model")
_warned_overrides: set[tuple[type, str]] = set()


class _Arguments:
    """The arguments of the next ``__init__`` along the MRO, by name: a parameter of its own, or one that its
    ``**kwargs`` would take (``def __init__(self, *args, **kwargs)`` subclasses)."""

    def __init__(self, init, args: tuple, kwargs: dict) -> None:
        self.signature = inspect.signature(init)
        self.bound = self.signature.bind(*args, **kwargs)
        self.var_kw = next((p.name for p in self.signature.parameters.values()
                            if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    def _named(self, name: str) -> bool:
        p = self.signature.parameters.get(name)
        return p is not None and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)

    def get(self, name: str) -> Any:
        if self._named(name):
            return self.bound.arguments.get(name)
        return self.bound.arguments.get(self.var_kw, {}).get(name) if self.var_kw else None

    def set(self, name: str, value: Any) -> None:
        if self._named(name):
            self.bound.arguments[name] = value
        elif self.var_kw:
            self.bound.arguments.setdefault(self.var_kw, {})[name] = value
        else:
            raise TypeError(f"CommFuseTrainerMixin: {self.signature} takes no {name}= argument; the mixin goes "
                            "in front of a transformers.Trainer class, whose __init__ takes callbacks= and args=")


_TRL_FUSED_HEAD = ("SFTTrainer", "DPOTrainer")  # TRL trainers whose fused LM head a TP model answers (temperature 1)


class CommFuseTrainerMixin:
    """Saves, loads and rotates the checkpoints of a model that its :class:`CommFuseCallback` sharded (see the
    module docs). Put it first: ``class MyTrainer(CommFuseTrainerMixin, SFTTrainer)``, or
    ``commfuse_trainer(SFTTrainer)``.

    ``commfuse``: the :class:`CommFuseConfig` of a ``CommFuseCallback`` the mixin adds (first among ``callbacks``)
    when ``callbacks`` holds none; ``None`` reads it from the ``COMMFUSE_*`` environment. A ``CommFuseCallback``
    given in ``callbacks`` is used as it is (then ``commfuse=`` must not be given as well).
    """

    commfuse_save_total_limit: int | None = None   # save_total_limit as asked; the Trainer's copy says None

    def __init__(self, *args: Any, commfuse: CommFuseConfig | None = None, **kwargs: Any) -> None:
        if not isinstance(self, _transformers_trainer()):
            raise TypeError(f"CommFuseTrainerMixin: {type(self).__name__} is not a transformers.Trainer; put the "
                            "mixin in front of a Trainer class: class MyTrainer(CommFuseTrainerMixin, Trainer), "
                            "or commfuse_trainer(MyTrainer)")
        bound = _Arguments(super().__init__, args, kwargs)
        callbacks = list(bound.get("callbacks") or [])
        ours = []
        for i, cb in enumerate(callbacks):
            if isinstance(cb, type) and issubclass(cb, CommFuseCallback):
                callbacks[i] = cb = cb()     # the Trainer would make it; made here so that it can be handed self
            if isinstance(cb, CommFuseCallback):
                ours.append(cb)
        if ours and commfuse is not None:
            raise ValueError(f"{type(self).__name__}: pass the CommFuseConfig once, either commfuse=... or "
                             "callbacks=[CommFuseCallback(...)], not both")
        if not ours:
            ours = [CommFuseCallback(commfuse)]
            callbacks.insert(0, ours[0])
        for cb in ours:
            cb.trainer = self   # the callback's on_init_end shards the model and prepares it with this Trainer
        self._commfuse_callbacks = ours
        self._commfuse_saver = ckpt.AsyncSaver()   # async_save: checkpoint-N/commfuse written in the background
        self._commfuse_async_checkpoint = False    # set while _save_checkpoint runs with async_save
        bound.set("callbacks", callbacks)

        targs = bound.get("args")
        limit = getattr(targs, "save_total_limit", None)
        if limit is not None and not getattr(targs, "deepspeed", None):
            # transformers 5.23 rotates inside _save_checkpoint, on rank 0, before every rank has finished: the
            # Trainer gets a copy without the limit, and _save_checkpoint applies it once the checkpoint is
            # complete. The caller's object is left as it is. (DeepSpeed saves its own way: its limit stays.)
            targs = copy.copy(targs)
            targs.save_total_limit = None
            bound.set("args", targs)
            self.commfuse_save_total_limit = limit
        self._warn_bypassed_overrides()
        super().__init__(*bound.bound.args, **bound.bound.kwargs)
        tp = self._commfuse_tp()
        if tp is not None and any(c.__name__ in _TRL_FUSED_HEAD and c.__module__.startswith("trl.")
                                  for c in type(self).__mro__):
            # TRL's SFT and DPO trainers call their fused LM head (fused_lm_head=True, at temperature 1) on the
            # policy and DPO's reference: the TP models answer it over the vocabulary's parts
            # (commfuse_dp/tp/loss.py: fused_head_outputs)
            for model in (self.model, getattr(self, "ref_model", None)):
                handle = handle_of(model) if isinstance(model, torch.nn.Module) else None
                if handle is not None and handle.tp is not None:
                    handle.tp.trl_fused_head = True
        if tp is not None and tp.mesh is not None:
            # accelerate shards each dataloader by the data-parallel dimensions of the state's device mesh
            # (``prepare_data_loader``): the ranks of a TP group read one batch
            self.accelerator.state.device_mesh = tp.mesh

    def _commfuse_tp(self):
        """The model's tensor parallelism (``CommFuseConfig.tp_size``), or None."""
        handle = handle_of(getattr(self, "model", None)) if self._commfuse_sharded() else None
        return handle.tp if handle is not None else None

    def _clip_grad_norm(self, model):
        """Under tensor parallelism the norm spans every TP rank's parts (``commfuse_dp.tp.clip_grad_norm_``);
        otherwise the Trainer's own."""
        if self._commfuse_tp() is None:
            return super()._clip_grad_norm(model)
        return tp_clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and self._commfuse_tp() is not None:
            grad_norm = tp_clip_grad_norm_(self.model, float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    def _track_num_input_tokens(self, inputs):
        """The Trainer sums the tokens of every rank's batch; the ranks of a TP group read one batch, so under
        tensor parallelism each batch counts once (``num_input_tokens_seen``, ``train_tokens_per_second``)."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        tp = self._commfuse_tp()
        if tp is not None and tp.size > 1:
            self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // tp.size

    def _warn_bypassed_overrides(self) -> None:
        """A class after the mixin in the MRO that overrides one of the five replaced methods: its version does
        not run (the mixin's does not call it)."""
        mro = type(self).__mro__
        base = _transformers_trainer()
        after = mro[mro.index(CommFuseTrainerMixin) + 1:mro.index(base)] if base in mro else ()
        for klass in after:
            for name in _REPLACED:
                if name in vars(klass) and (klass, name) not in _warned_overrides:
                    _warned_overrides.add((klass, name))
                    logger.warning("CommFuseTrainerMixin: %s overrides Trainer.%s; %s uses commfuse's sharded "
                                   "version instead", klass.__name__, name, type(self).__name__)

    def _commfuse_sharded(self) -> bool:
        return ckpt.is_sharded(getattr(self, "model", None))

    @property
    def commfuse_config(self) -> CommFuseConfig:
        """The config of the CommFuseCallback that does the work (of two, the one ``_defer`` keeps)."""
        working = [cb for cb in self._commfuse_callbacks if not cb.inert]
        return (working or self._commfuse_callbacks)[0].cfg

    # ---- the five methods that write and read checkpoints --------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not self._commfuse_sharded():
            return super()._save(output_dir, state_dict=state_dict)
        # A PreTrainedModel: commfuse_dp.checkpoint.save_pretrained, every rank writing its own slices into the
        # safetensors in place (no rank holds the full model), then the rest of Trainer._save on the writing rank
        # (tokenizer, training_args.bin). Anything else (a state_dict passed in, a model without save_pretrained):
        # every rank gathers (the full copy lands on rank 0, in CPU memory) and Trainer._save writes it.
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if state_dict is None and (hasattr(self.model, "save_pretrained") or self._commfuse_async_checkpoint):
            if not self._commfuse_async_checkpoint:   # (async_save: the weights go with checkpoint-N/commfuse)
                ckpt.save_pretrained(self.model, output_dir, is_main_process=self.args.should_save)
            elif self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
            if self.args.should_save:
                tokenizer = self.processing_class
                if tokenizer is None and self.data_collator is not None:
                    tokenizer = getattr(self.data_collator, "tokenizer", None)
                if tokenizer is not None:
                    tokenizer.save_pretrained(output_dir)
                torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
            dist.barrier()
            return None
        if state_dict is None:
            state_dict = ckpt.full_state_dict(self.model)
        super()._save(output_dir, state_dict=state_dict)
        del state_dict
        dist.barrier()
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._commfuse_sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        # Every rank writes its own model and optimizer shards (DCP); no optimizer.pt of rank 0's shard alone.
        # (async_save: _save_checkpoint starts that write once the rest of the checkpoint is written.)
        if not self._commfuse_async_checkpoint:
            ckpt.save_sharded(os.path.join(output_dir, CHECKPOINT_SUBDIR), [self.model],
                              [(self.model, self.optimizer)])
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self._commfuse_sharded():
            return super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        self._commfuse_saver.wait()   # (the best checkpoint may be the one still being written)
        require_complete(resume_from_checkpoint)
        folder = os.path.join(resume_from_checkpoint, CHECKPOINT_SUBDIR)
        if ckpt.is_complete(folder):
            ckpt.load_sharded(folder, [self.model])    # exact: the shards as they were, under the model's own names
        else:                                          # a save_only_model checkpoint, or a consolidated folder
            ckpt.load_pretrained_weights(self.model, resume_from_checkpoint)
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._commfuse_sharded():
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return None
        folder = os.path.join(checkpoint, CHECKPOINT_SUBDIR)
        if not ckpt.is_complete(folder):
            if os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
                raise ValueError(f"{checkpoint} holds a single {OPTIMIZER_NAME} written without commfuse (or by an "
                                 "older run); its optimizer state cannot be split into this run's shards. Resume it "
                                 "without commfuse, or start from its weights alone (a fresh run with "
                                 "model=from_pretrained(checkpoint))")
            logger.warning("CommFuseTrainer: %s has no optimizer state (saved with save_only_model=True?): the "
                           "optimizer and scheduler start fresh", checkpoint)
            return None
        ckpt.load_sharded(folder, [], [(self.model, self.optimizer)])
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
        return None

    def _load_best_model(self) -> None:
        if not self._commfuse_sharded():
            return super()._load_best_model()
        logger.info("Loading best model from %s (score: %s).", self.state.best_model_checkpoint,
                    self.state.best_metric)
        CommFuseTrainerMixin._load_from_checkpoint(self, self.state.best_model_checkpoint)
        return None

    # ---- atomic checkpoints (see the comment above require_complete) ---------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = self._get_output_dir(trial=trial)
        limit = self.commfuse_save_total_limit
        if not self._commfuse_sharded():
            super()._save_checkpoint(model, trial)
            if limit is not None and self.args.should_save:   # the Trainer's own rotation, which its copy skipped
                rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                                   best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
            return
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        should_save = self.args.should_save
        if should_save:
            ckpt.unmark_complete(output_dir)
        dist.barrier()
        self._commfuse_async_checkpoint = self.commfuse_config.async_save
        try:
            super()._save_checkpoint(model, trial)   # no rotation in there: this Trainer's save_total_limit is None
        finally:
            self._commfuse_async_checkpoint = False
        dist.barrier()   # every rank has written its part (its rng_state_<rank>.pth is its last file)
        best = self.state.best_model_checkpoint

        def complete() -> None:
            if should_save:
                ckpt.mark_complete(output_dir)
                rotate_complete(run_dir, limit, best, output_dir)

        if self.commfuse_config.async_save:   # the sharded state is written in the background, then complete()
            pairs = [] if self.args.save_only_model else [(self.model, self.optimizer)]
            self._commfuse_saver.save(os.path.join(output_dir, CHECKPOINT_SUBDIR), [self.model], pairs,
                                      then=complete)
            return
        complete()
        dist.barrier()

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint is None and self.commfuse_config.auto_resume:
            resume_from_checkpoint = self._auto_resume_checkpoint()
        if self._commfuse_sharded():
            if isinstance(resume_from_checkpoint, bool):
                if resume_from_checkpoint:
                    resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            elif resume_from_checkpoint is not None:
                require_complete(resume_from_checkpoint)
        try:
            result = super().train(resume_from_checkpoint, trial, *args, **kwargs)
        finally:
            self._commfuse_saver.wait()   # the last checkpoint is complete when train() returns (or its error)
        self._rotate_at_train_end(trial)
        return result

    def _auto_resume_checkpoint(self) -> str | None:
        """``auto_resume``: the newest complete checkpoint of ``output_dir`` (None: there is none, start at 0)."""
        output_dir = self.args.output_dir
        last = ckpt.latest_complete(output_dir, PREFIX_CHECKPOINT_DIR) if os.path.isdir(output_dir) else None
        if self.is_world_process_zero():
            if last is None:
                logger.warning("CommFuseTrainer: auto_resume: no complete checkpoint in %s; starting at step 0",
                               output_dir)
            else:
                logger.warning("CommFuseTrainer: auto_resume: resuming from %s (step %s)", last,
                               last.rsplit("-", 1)[-1])
        return last if last is None else last_complete_checkpoint(output_dir)   # (warns of newer incomplete ones)

    def _rotate_at_train_end(self, trial) -> None:
        """What Trainer.train does at its end for save_total_limit=1 with a best model (keep the best checkpoint
        only), which this Trainer's copy of the arguments (save_total_limit=None) skipped."""
        best = self.state.best_model_checkpoint
        if self.commfuse_save_total_limit != 1 or best is None or not self.args.should_save:
            return
        for folder in sort_checkpoints(output_dir=self._get_output_dir(trial), best_model_checkpoint=best):
            if not os.path.samefile(folder, best):
                logger.info("Deleting older checkpoint [%s] due to save_total_limit=1", folder)
                ckpt.unmark_complete(folder)
                shutil.rmtree(folder, ignore_errors=True)


_made: dict[type, type] = {}


def commfuse_trainer(trainer_class: type, name: str | None = None) -> type:
    """``class CommFuse<Name>(CommFuseTrainerMixin, trainer_class)``, made once per class: e.g.
    ``commfuse_trainer(SFTTrainer)(model=..., args=SFTConfig(...), train_dataset=...)``. A class that already has
    the mixin (``CommFuseTrainer``, or any Trainer class under ``commfuse-dp launch``) is returned as it is."""
    if not isinstance(trainer_class, type) or not issubclass(trainer_class, _transformers_trainer()):
        raise TypeError(f"commfuse_trainer: {trainer_class!r} is not a transformers.Trainer class (give the class, "
                        "e.g. commfuse_trainer(SFTTrainer), not an instance)")
    if issubclass(trainer_class, CommFuseTrainerMixin):
        return trainer_class
    made = _made.get(trainer_class)
    if made is None:
        name = name or f"CommFuse{trainer_class.__name__}"
        made = type(name, (CommFuseTrainerMixin, trainer_class),
                    {"__module__": __name__, "__qualname__": name, "_commfuse_base": trainer_class,
                     "__doc__": f"{trainer_class.__name__} with commfuse sharding (CommFuseTrainerMixin first)."})
        _made[trainer_class] = made
    return made


def __getattr__(name: str) -> Any:
    # CommFuseTrainer is made on first use, so that importing this module does not import transformers.trainer.
    if name == "CommFuseTrainer":
        return commfuse_trainer(_transformers_trainer(), "CommFuseTrainer")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
