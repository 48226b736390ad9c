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

Refused: a run without an initialised ``torch.distributed``, ``TrainingArguments`` that ask for FSDP or DeepSpeed
(both would shard the model a second time), and any ``save_strategy`` but ``"no"``: saving and resuming checkpoints
of the sharded model are not covered yet, and a save must not silently keep part of the state.
"""

from __future__ import annotations

from transformers import TrainerCallback

import torch.distributed as dist

from commfuse_dp.config import CommFuseConfig
from commfuse_dp.shard import shard

__all__ = ["CommFuseCallback"]

_STAT_KEYS = ("exposed_comm_s", "comm_s", "compute_s", "wall_s", "ring_steps")


class CommFuseCallback(TrainerCallback):
    """Shards ``Trainer.model`` with :func:`commfuse_dp.shard` before the Trainer prepares it (see module docs).

    ``cfg``: the :class:`CommFuseConfig`; ``None`` reads it from the ``COMMFUSE_*`` environment
    (``CommFuseConfig.from_env()``, what ``commfuse-dp launch`` sets).
    """

    def __init__(self, cfg: CommFuseConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else CommFuseConfig.from_env()
        self.model = None
        self._window: dict[str, float] = {}   # the accumulation window running now, summed over micro-batches
        self._last_window: dict[str, float] | None = None   # the last finished optimizer step

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("CommFuseCallback: the Trainer has no model to shard; pass model=... to Trainer "
                             "(model_init= is not supported with CommFuseCallback)")
        if getattr(args, "fsdp", None):
            raise ValueError("CommFuseCallback shards the model itself: remove `fsdp` / `fsdp_config` from the "
                             "TrainingArguments, or drop CommFuseCallback to use accelerate's FSDP")
        if getattr(args, "deepspeed", None):  # DeepSpeed shards; its collectives go to the rings at on_train_begin
            from commfuse_dp.integrations.deepspeed import attach_to_trainer_callback

            return attach_to_trainer_callback(self, args, model, control)
        if getattr(args.save_strategy, "value", args.save_strategy) != "no":
            raise ValueError("CommFuseCallback: saving checkpoints of a commfuse-sharded model through the Trainer "
                             "is not supported yet (it could keep only part of the sharded model and optimizer "
                             "state); set save_strategy='no' in the TrainingArguments, and do not call "
                             "trainer.save_model()")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("CommFuseCallback: torch.distributed is not initialised. Launch the script with "
                               "`torchrun --nproc_per_node N` (or `accelerate launch`); on CPU also pass "
                               "use_cpu=True to TrainingArguments (or set ACCELERATE_USE_CPU=true)")
        if getattr(model, "_commfuse_engine", None) is None:
            shard(model, self.cfg)
        # Accelerator.prepare_model returns a model carrying this flag as it is (no DDP wrap on top of the shards).
        model._is_accelerate_prepared = True
        self.model = model
        return control

    def _add_micro_batch(self, model) -> None:
        engine = getattr(model if model is not None else self.model, "_commfuse_engine", None)
        if engine is None or not engine.stats.enabled:
            return
        stats = engine.stats.current().as_dict()   # the micro-batch whose backward just finished
        for key in _STAT_KEYS:
            self._window[key] = self._window.get(key, 0) + stats[key]

    def on_step_begin(self, args, state, control, **kwargs):
        self._window = {}
        return control

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        self._add_micro_batch(model)
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._add_micro_batch(model)
        if self._window:
            self._last_window, self._window = self._window, {}
        return control

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if logs is None or "loss" not in logs or self._last_window is None:
            return control
        figures = {f"commfuse/{key}": self._last_window[key] for key in _STAT_KEYS}
        logs.update(figures)
        # Trainer.log stored {**logs, "step": global_step} in log_history just before calling on_log.
        if state.log_history and state.log_history[-1].get("step") == state.global_step \
                and state.log_history[-1].get("loss") == logs["loss"]:
            state.log_history[-1].update(figures)
        return control
