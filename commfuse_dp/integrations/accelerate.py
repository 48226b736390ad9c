"""accelerate with CommFuse sharding: ``CommFuseAccelerator``, a drop-in ``Accelerator``.

    from commfuse_dp import CommFuseConfig
    from commfuse_dp.integrations.accelerate import CommFuseAccelerator

    accelerator = CommFuseAccelerator(commfuse=CommFuseConfig(bucket_mb=25), gradient_accumulation_steps=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)          # before or after prepare: both work
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")                                       # every rank's shards (resume: load_state)
    accelerator.unwrap_model(model).save_pretrained(                     # one consolidated HF folder
        "out", state_dict=accelerator.get_state_dict(model), is_main_process=accelerator.is_main_process)

Launch it like any accelerate script (``torchrun --nproc_per_node N``, ``accelerate launch`` on GPUs, or
``commfuse-dp launch``). The one line that changes is ``Accelerator(...)`` -> ``CommFuseAccelerator(commfuse=...,
...)``; ``commfuse=None`` reads the config from the ``COMMFUSE_*`` environment (``CommFuseConfig.from_env()``).

What differs from ``Accelerator`` (accelerate 1.15):

* ``prepare`` / ``prepare_model`` shard each model in place with :func:`commfuse_dp.shard` (after moving it to
  ``accelerator.device``; both through :func:`commfuse_dp.integrations.attach.attach`, the path every integration
  takes, which refuses a model another library shards already) instead of wrapping it in DDP; mixed precision
  (autocast) and ``torch.compile`` settings are applied as accelerate applies them. An optimizer passed to the same
  ``prepare`` call that was built on the full parameters is re-pointed at the sharded ones, by parameter name (as
  accelerate does for FSDP2); its state -- built at the first ``step`` -- is then sharded too.
* ``prepare_model(m, evaluation_mode=True)`` -- a reference, reward or teacher model beside the one trained, as TRL
  prepares them -- shards ``m`` too once a model to train was sharded (:class:`FrozenModels`; nothing of it is
  reduced, every rank must run its forwards alike); ``CommFuseConfig(shard_frozen=False)`` leaves it whole.
* ``save_state`` / ``load_state``: the sharded models and their optimizers go to ``<dir>/commfuse`` through
  ``torch.distributed.checkpoint``, every rank writing its own shards (never rank 0's alone); schedulers, RNG
  states, the data loaders' positions, the step and custom objects go through accelerate's own code.
* ``get_state_dict(model)`` gathers the full state dict onto rank 0 (CPU memory; ``{}`` on the other ranks), as
  accelerate does for FSDP2, so ``save_pretrained(state_dict=...)`` and ``save_model`` write consolidated weights.
  It is collective: call it on every rank.
* On a machine without CUDA, launched with several processes (``WORLD_SIZE`` > 1), ``cpu=True`` is implied: a
  plain ``Accelerator`` would otherwise run each rank as a separate single process there.
* A single process with no ``torch.distributed`` group has nothing to shard: the model is prepared as by
  ``Accelerator`` (with a warning).

With DeepSpeed (a ``deepspeed_plugin``, or an accelerate config with ``distributed_type: DEEPSPEED``, as under
``commfuse-dp launch``) DeepSpeed partitions the model and CommFuseAccelerator shards nothing: ``prepare`` builds
accelerate's DeepSpeed engine and then routes its ZeRO collectives through the rings
(``attach(engine.module, config, backend="deepspeed", engine=engine)``, as
:func:`commfuse_dp.integrations.deepspeed.enable_ring_collectives` does, with this config's ``bucket_mb`` /
``timeout_s``), as ``CommFuseCallback`` does for a Trainer. accelerate 1.15 runs DeepSpeed only on GPUs (with
``cpu=True`` it turns DeepSpeed off, and without it a CPU worker counts one process while DeepSpeed counts N), so
this is refused on a machine without CUDA; on CPU, DeepSpeed runs on rings through ``deepspeed.initialize`` and
``enable_ring_collectives`` directly. This path has not yet run on a GPU.

Refused before anything is sharded: an accelerate config that enables FSDP (it would shard the model a second time;
for stock FSDP2 on rings see :mod:`commfuse_dp.integrations.fsdp`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from accelerate.utils import DistributedType, convert_to_fp32, get_mixed_precision_context_manager

from commfuse_dp import checkpoint as ckpt
from commfuse_dp.amp import autocast_root
from commfuse_dp.config import CommFuseConfig
from commfuse_dp.handle import engine_of, handle_of
from commfuse_dp.integrations.attach import attach, resolve_config
from commfuse_dp.ring.topology import drain_gloo_workers
from commfuse_dp.tp import clip_grad_norm_ as tp_clip_grad_norm_

__all__ = ["CommFuseAccelerator", "FrozenModels", "resolve_config", "shard_frozen_models"]

logger = logging.getLogger("commfuse_dp")

CHECKPOINT_SUBDIR = "commfuse"


_REFUSED = {
    "deepspeed": "CommFuseAccelerator with DeepSpeed (deepspeed_plugin= or ACCELERATE_USE_DEEPSPEED / a "
                 "deepspeed_config in the accelerate config) needs CUDA: accelerate 1.15 runs DeepSpeed only on GPUs "
                 "(with cpu=True it is off, and without it each CPU worker counts one process while DeepSpeed counts "
                 "all of them). On CPU, run DeepSpeed through deepspeed.initialize and route its collectives through "
                 "rings with commfuse_dp.integrations.deepspeed.enable_ring_collectives(engine), or drop the "
                 "DeepSpeed settings to let CommFuseAccelerator shard the model itself",
    "fsdp": "CommFuseAccelerator shards the model itself, and FSDP was asked for too (fsdp_plugin= or "
            "ACCELERATE_USE_FSDP / an fsdp_config in the accelerate config), which would shard it again. Remove the "
            "FSDP settings, or keep FSDP with a plain Accelerator and call "
            "commfuse_dp.integrations.fsdp.use_ring_collectives(model) after prepare",
}


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _refuse_other_sharding(kwargs: dict) -> None:
    # Checked before Accelerator.__init__: on a CPU machine accelerate drops an FSDP plugin silently.
    if (kwargs.get("deepspeed_plugin") is not None or kwargs.get("deepspeed_plugins")
            or _env_true("ACCELERATE_USE_DEEPSPEED")) and (kwargs.get("cpu") or not torch.cuda.is_available()):
        raise ValueError(_REFUSED["deepspeed"])
    if kwargs.get("fsdp_plugin") is not None or _env_true("ACCELERATE_USE_FSDP"):
        raise ValueError(_REFUSED["fsdp"])


def _implied_cpu(kwargs: dict) -> None:
    if "cpu" in kwargs or torch.cuda.is_available():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        kwargs["cpu"] = True


class FrozenModels:
    """An ``Accelerator`` mixin: ``prepare_model(model, evaluation_mode=True)`` -- how TRL's trainers prepare a
    reference, reward or teacher model beside the one they train -- shards ``model`` with ``commfuse_frozen`` (the
    trained model's config) instead of leaving it whole on every rank, and applies mixed precision as for the
    trained model (:func:`prepare_sharded`). Nothing of it is reduce-scattered: its parameters are frozen
    (``requires_grad_(False)``), and its hops are requested on the same ring as the trained model's, in
    program order. ``commfuse_frozen`` None: accelerate's own ``prepare_model``. ``CommFuseAccelerator`` is one,
    from the first model it shards to train on; a Trainer's Accelerator becomes one in
    ``CommFuseCallback.on_init_end`` (:func:`shard_frozen_models`)."""

    commfuse_frozen: CommFuseConfig | None = None

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        config = self.commfuse_frozen
        if not evaluation_mode or config is None or not _shardable(model):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        # It takes no gradient (TRL leaves a teacher's parameters requiring one, and reads its lm_head weight outside
        # its forward, where a gradient would reach the shard): nothing of it can be reduced or need a reduction.
        model.requires_grad_(False)
        attach(model, config, who="prepare_model(evaluation_mode=True)", place=_placer(self, device_placement))
        return prepare_sharded(self, model)


def _placer(accelerator: Accelerator, device_placement: bool | None):
    """What ``attach`` runs before sharding: the model to ``accelerator.device``, as accelerate places it."""
    place = accelerator.device_placement if device_placement is None else device_placement

    def to_device(module: torch.nn.Module) -> None:
        if place and not accelerator.verify_device_map(module):
            module.to(accelerator.device)

    return to_device


def _shardable(model) -> bool:
    """A plain module with parameters that nothing has sharded, prepared or quantised (bitsandbytes and the like:
    left whole, as accelerate leaves them)."""
    return isinstance(model, torch.nn.Module) and not ckpt.is_sharded(model) \
        and not getattr(model, "_is_accelerate_prepared", False) \
        and not isinstance(model, torch.nn.parallel.DistributedDataParallel) \
        and getattr(model, "hf_quantizer", None) is None and not getattr(model, "is_quantized", False) \
        and any(True for _ in model.parameters())


def frozen_config(config: CommFuseConfig, trained: torch.nn.Module) -> CommFuseConfig:
    """The config a frozen model is sharded with: ``config`` (what ``trained`` was sharded with) with the schedule,
    piece width and fsdp2 collectives chosen for ``trained``, so that a reference copy of it is laid out as it is (TRL's
    ``sync_ref_model`` mixes the two parameter by parameter)."""
    engine = engine_of(trained)
    if engine is None:
        return config
    return config.replace(schedule=engine.config.schedule, piece_shards=engine.config.piece_shards,
                          fsdp2_collectives=engine.config.fsdp2_collectives)


_FROZEN_CLASSES: dict[type, type] = {}


def shard_frozen_models(accelerator: Accelerator, config: CommFuseConfig | None) -> None:
    """From now on ``accelerator.prepare_model(m, evaluation_mode=True)`` shards ``m`` with ``config`` (None: leaves
    it whole again). A Trainer builds a plain ``Accelerator`` in its ``__init__`` and prepares its frozen models
    with it right after (TRL): the instance becomes one of a subclass of its own class with :class:`FrozenModels`
    first, made once per class and named in this module (so that it pickles); nothing else of it changes. Not
    under DeepSpeed or FSDP, which prepare frozen models their own way."""
    if config is not None and not isinstance(accelerator, FrozenModels) \
            and accelerator.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        cls = type(accelerator)
        if cls not in _FROZEN_CLASSES:
            name = f"FrozenModels{cls.__name__}"
            _FROZEN_CLASSES[cls] = globals()[name] = type(name, (FrozenModels, cls), {"__module__": __name__})
        accelerator.__class__ = _FROZEN_CLASSES[cls]
    if isinstance(accelerator, FrozenModels):
        accelerator.commfuse_frozen = config


class CommFuseAccelerator(FrozenModels, Accelerator):
    """``Accelerator`` whose ``prepare`` shards models with :func:`commfuse_dp.shard` (see the module docs).

    ``commfuse``: a :class:`CommFuseConfig`, a dict of its fields, or ``None`` for ``CommFuseConfig.from_env()``.
    Every other argument is ``Accelerator``'s.
    """

    def __init__(self, *args, commfuse: CommFuseConfig | Mapping | None = None, **kwargs) -> None:
        self.commfuse_config = resolve_config(commfuse)   # a bad config fails before accelerate starts anything
        _refuse_other_sharding(kwargs)
        _implied_cpu(kwargs)
        super().__init__(*args, **kwargs)
        if self.distributed_type == DistributedType.FSDP or self.is_fsdp2:
            raise ValueError(_REFUSED["fsdp"])
        self.commfuse_rings = None  # DeepSpeed: the RingCollectives handle, once prepare built the engine
        self.commfuse_active = dist.is_available() and dist.is_initialized() \
            and self.distributed_type != DistributedType.DEEPSPEED
        # prepare_model(m, evaluation_mode=True) shards m too (FrozenModels) once a model to train was sharded
        # (_shard): before, such a model stays whole, as for a script that only evaluates
        self.commfuse_frozen = None
        self._commfuse_saver = ckpt.AsyncSaver()   # async_save: save_state's sharded part written in the background
        self._commfuse_warned_sync = False         # async_save without a commfuse-sharded model: said once
        if self.distributed_type != DistributedType.DEEPSPEED and not self.commfuse_active:
            logger.warning("CommFuseAccelerator: no torch.distributed process group (a single process): models are "
                           "prepared as by Accelerator, unsharded. Launch with torchrun, accelerate launch or "
                           "commfuse-dp launch to shard them.")

    # ---- preparing ------------------------------------------------------------------------------------------

    def _shard(self, model: torch.nn.Module, device_placement: bool | None) -> None:
        if ckpt.is_sharded(model) or getattr(model, "_is_accelerate_prepared", False):
            return
        attach(model, self.commfuse_config, who="CommFuseAccelerator.prepare", place=_placer(self, device_placement))
        tp = handle_of(model).tp if ckpt.is_sharded(model) else None
        if tp is not None and tp.mesh is not None:
            # the dataloaders prepared from here on are sharded by the mesh's data-parallel dimensions
            # (accelerate's prepare_data_loader): the ranks of a TP group read one batch
            self.state.device_mesh = tp.mesh
        if self.commfuse_frozen is None and self.commfuse_config.shard_frozen and ckpt.is_sharded(model):
            self.commfuse_frozen = frozen_config(self.commfuse_config, model)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        if not self.commfuse_active or evaluation_mode or getattr(model, "_is_accelerate_prepared", False):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        self._shard(model, device_placement)
        return prepare_sharded(self, model)

    def prepare(self, *args, device_placement=None):
        if self.distributed_type == DistributedType.DEEPSPEED:
            result = super().prepare(*args, device_placement=device_placement)
            if self.commfuse_rings is None and getattr(self, "deepspeed_engine_wrapped", None) is not None:
                engine = self.deepspeed_engine_wrapped.engine
                self.commfuse_rings = attach(engine.module, self.commfuse_config, who="CommFuseAccelerator.prepare",
                                             backend="deepspeed", engine=engine).rings
            return result
        if not self.commfuse_active:
            return super().prepare(*args, device_placement=device_placement)
        places = device_placement if device_placement is not None else [None] * len(args)
        models = [(obj, place) for obj, place in zip(args, places) if isinstance(obj, torch.nn.Module)
                  and not ckpt.is_sharded(obj) and not getattr(obj, "_is_accelerate_prepared", False)]
        optimizers = [obj for obj in args if isinstance(obj, torch.optim.Optimizer)]
        # Names of the full parameters, before shard() replaces them with DTensor shards.
        before = {id(p): (p, model, name) for model, _ in models
                  for name, p in model.named_parameters(remove_duplicate=False)}
        for model, place in models:
            self._shard(model, place)
        self._repoint(optimizers, before)
        return super().prepare(*args, device_placement=device_placement)

    def _repoint(self, optimizers: list[torch.optim.Optimizer], before: dict) -> None:
        after = {id(model): dict(model.named_parameters(remove_duplicate=False)) for _, model, _ in before.values()}
        for optimizer in optimizers:
            optimizer = ckpt.unwrap_optimizer(optimizer)
            for group in optimizer.param_groups:
                new_params = []
                for p in group["params"]:
                    entry = before.get(id(p))
                    if entry is not None and entry[0] is p:
                        if optimizer.state.get(p):
                            raise ValueError("CommFuseAccelerator.prepare: the optimizer already holds state for the "
                                             "full parameters (it has stepped); create it, or reload its state, "
                                             "after prepare so that the state is sharded")
                        new_params.append(after[id(entry[1])][entry[2]])
                    else:
                        new_params.append(p)
                group["params"] = new_params
            sharded = {id(p) for m in self._commfuse_models() for p in m.parameters()}
            stray = [p for g in optimizer.param_groups for p in g["params"]
                     if id(p) not in sharded and not isinstance(p, DTensor)]
            if stray and sharded:
                raise ValueError(
                    f"CommFuseAccelerator.prepare: the optimizer holds {len(stray)} parameter(s) that are not the "
                    "sharded model's (probably the model was prepared in an earlier prepare() call, so its full "
                    "parameters were replaced). Pass the model and its optimizer to the same prepare() call, or "
                    "create the optimizer from model.parameters() after prepare(model)")

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """A tensor-parallel model's whole parameters: the norm over every rank's parts
        (``commfuse_dp.tp.clip_grad_norm_``); anything else as ``Accelerator``'s."""
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for model in self._commfuse_models():
            if handle_of(model).tp is None:
                continue
            mine = {id(p) for p in model.parameters()}
            given = {id(p) for p in parameters}
            if given == mine and norm_type == 2:
                return tp_clip_grad_norm_(model, max_norm)
            if given & mine:
                raise NotImplementedError(
                    "CommFuseAccelerator.clip_grad_norm_: a tensor-parallel model's gradients are clipped as a "
                    "whole (the 2-norm over every rank's parts): pass model.parameters() and norm_type=2")
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    def _commfuse_models(self) -> list[torch.nn.Module]:
        return [m for m in self._models if ckpt.is_sharded(m)]

    def end_training(self):
        """Lets gloo's worker threads free their finished work before accelerate destroys the process group
        (:func:`commfuse_dp.ring.topology.drain_gloo_workers`: otherwise the last group's destructor can deadlock or
        abort the process at exit). With ``async_save``, first waits for the last ``save_state``'s write."""
        self.wait_for_save()
        drain_gloo_workers()
        super().end_training()

    # ---- state dicts and checkpoints ------------------------------------------------------------------------

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True):
        """A sharded Hugging Face model: :func:`commfuse_dp.checkpoint.save_pretrained` (every rank writes its own
        slices into the safetensors; nothing is gathered). Collective for such a model: call it on every rank.
        Anything else: ``Accelerator.save_model``."""
        if ckpt.is_sharded(model) and hasattr(ckpt._unwrap(model), "save_pretrained") and safe_serialization:
            ckpt.save_pretrained(model, save_directory, is_main_process=self.is_main_process,
                                 max_shard_size=max_shard_size)
            return
        return super().save_model(model, save_directory, max_shard_size=max_shard_size,
                                  safe_serialization=safe_serialization)

    def get_state_dict(self, model, unwrap: bool = True):
        if ckpt.is_sharded(model):
            return ckpt.full_state_dict(model)
        return super().get_state_dict(model, unwrap=unwrap)

    def _split(self):
        """The sharded models, and (model, optimizer) pairs for the optimizers that update them."""
        models = self._commfuse_models()
        pairs = []
        for optimizer in self._optimizers:
            owner = ckpt.optimizer_model(optimizer, models)
            if owner is not None:
                pairs.append((owner, optimizer))
        return models, pairs

    @contextlib.contextmanager
    def _hidden(self, models, pairs):
        """accelerate's save_state/load_state skip what commfuse checkpoints itself (models, optimizers)."""
        saved_models, saved_optimizers = self._models, self._optimizers
        hidden_opts = {id(opt) for _, opt in pairs}
        self._models = [m for m in saved_models if all(m is not c for c in models)]
        self._optimizers = [o for o in saved_optimizers if id(o) not in hidden_opts]
        try:
            yield
        finally:
            self._models, self._optimizers = saved_models, saved_optimizers

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs):
        """accelerate's ``save_state``, with the sharded models' and their optimizers' state written by every rank
        into ``<output_dir>/commfuse`` (:func:`commfuse_dp.checkpoint.save_sharded`). With
        ``CommFuseConfig.async_save`` that part is copied to host memory here and written in the background
        (:class:`commfuse_dp.checkpoint.AsyncSaver`): ``save_state`` returns while it is written, and
        ``<output_dir>/commfuse`` appears, complete, once every rank's write finished (``wait_for_save``; the
        next ``save_state``, ``load_state`` and ``end_training`` wait for it)."""
        models, pairs = self._split()
        if not models:
            if self.commfuse_config.async_save and not self._commfuse_warned_sync:
                self._commfuse_warned_sync = True
                logger.warning("CommFuseAccelerator: async_save writes commfuse-sharded state in the background; "
                               "no prepared model is commfuse-sharded (DeepSpeed's, or a single process), so "
                               "save_state writes everything on the training thread")
            return super().save_state(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)
        self.wait_for_save()   # (accelerate's own files of this state must not overtake the write before)
        with self._hidden(models, pairs):
            location = super().save_state(output_dir, safe_serialization=safe_serialization,
                                          **save_model_func_kwargs)
        folder = os.path.join(location, CHECKPOINT_SUBDIR)
        if self.commfuse_config.async_save:
            self._commfuse_saver.save(folder, models, pairs)
        else:
            ckpt.save_sharded(folder, models, pairs)
        return location

    def wait_for_save(self) -> None:
        """Blocks until the sharded state of the last ``save_state`` is written and complete; raises its error
        (:class:`commfuse_dp.checkpoint.CheckpointError`, alike on every rank) if the write failed. Collective;
        returns at once without ``async_save``."""
        self._commfuse_saver.wait()

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs):
        self.wait_for_save()   # (the state to load may be the one still being written)
        models, pairs = self._split()
        if not models:
            return super().load_state(input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)
        resolved = []
        handle = self.register_load_state_pre_hook(lambda _models, path: resolved.append(path))
        try:
            with self._hidden(models, pairs):
                result = super().load_state(input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)
        finally:
            handle.remove()
        ckpt.load_sharded(os.path.join(resolved[0], CHECKPOINT_SUBDIR), models, pairs)
        return result


def prepare_sharded(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """``accelerator.prepare_model`` for a model ``shard()`` sharded: accelerate's compile and other wrappers
    without the DDP wrap (``evaluation_mode=True``), and its mixed precision (autocast, outputs to fp32) entered by
    the model's own forward hooks (``commfuse_dp.amp.autocast_root``) instead of a wrapper around
    ``model.forward``, so that it holds when a library replaces ``forward`` afterwards (TRL's fused LM head)."""
    amp = accelerator.native_amp
    accelerator.native_amp = False  # read by prepare_model only to install the forward wrapper
    try:
        model = Accelerator.prepare_model(accelerator, model, device_placement=False, evaluation_mode=True)
    finally:
        accelerator.native_amp = amp
    if amp:
        handler = accelerator.autocast_handler
        autocast_root(model, lambda: get_mixed_precision_context_manager(True, handler), convert_to_fp32)
    return model
