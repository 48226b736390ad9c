"""DeepSpeed ZeRO-1/2/3 with commfuse's ring collectives: ``enable_ring_collectives(engine)``.

What changes in a user's script: one call after ``deepspeed.initialize``, one at the end (and, optionally, a
``"commfuse"`` section in the DeepSpeed JSON)::

    import deepspeed
    from commfuse_dp.integrations.deepspeed import enable_ring_collectives, shutdown

    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
        "commfuse": {"bucket_mb": 25, "timeout_s": 300},    # optional; these keys and direct_kb only
    }
    deepspeed.init_distributed()                              # "gloo" on CPU
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config)
    rings = enable_ring_collectives(engine)                   # <- the one new line
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
    print(rings.stats.as_dict())   # calls and elements that went through the rings, per collective
    shutdown(rings)                # at the end, on every rank: DeepSpeed's backend back, groups destroyed

``rings.disable()`` alone puts DeepSpeed's own backend back (``with enable_ring_collectives(engine):`` too).
``shutdown`` also avoids an abort at interpreter exit that torch's gloo backend can cause after the work is done
([Note: the abort at exit] in :func:`drain_gloo_workers`; the first ring on a gloo group registers the same drain at
exit, so a script that just ends is covered too, short of the group destruction).

With the Hugging Face ``Trainer`` nothing else changes either: keep ``TrainingArguments(deepspeed=ds_config)`` and
pass ``callbacks=[CommFuseCallback()]`` (``commfuse_dp.integrations.transformers``); with DeepSpeed the callback
does not shard the model itself, it switches DeepSpeed's collectives to the rings at ``on_train_begin``
(:func:`attach_to_trainer_callback`) and leaves them on for ``evaluate()`` and ``save_model()`` after training
(``trainer.save_model`` with ZeRO-3 gathers the weights through the rings); ``callback.rings`` is the handle.

How (checked in deepspeed 0.19.8): every ``deepspeed.comm`` function calls the backend object
``deepspeed.comm.comm.cdb`` (a ``TorchBackend``) at call time (``global cdb; return cdb.<op>(...)``); nothing in
DeepSpeed keeps its own reference to it. ``enable_ring_collectives`` replaces ``cdb`` by a thin wrapper that
routes four operations to the rings when they run on a data-parallel group, and hands everything else, attribute
reads included, to the previous backend:

* ``all_gather_into_tensor`` -> :func:`commfuse_dp.ring_all_gather`. ZeRO-3 fetches parameters with it,
  ``async_op=True`` (``partition_parameters._dist_allgather_fn`` via ``comm.allgather_fn``), and waits on the
  returned handle's ``wait()``; the ring then runs on the group's ring thread (a ``RingWork``) while DeepSpeed
  goes on. ZeRO-1/2 gather the updated parameter partitions with it after the step
  (``runtime/utils.all_gather_into_tensor_dp_groups``).
* ``reduce_scatter_tensor`` -> :func:`commfuse_dp.ring_reduce_scatter`. ZeRO-3 reduces gradients through
  ``runtime/comm/coalesced_collectives.reduce_scatter_coalesced`` -> ``comm.reduce_scatter_fn``, with the
  output a view of the input (the rank's own chunk), which the ring allows.
* ``all_reduce`` with SUM or AVG -> a ring reduce-scatter followed by a ring all-gather in place (the tensor padded
  to a multiple of the group size when needed). ZeRO-1/2 reduce gradient buckets with it
  (``stage_1_and_2.allreduce_bucket`` / ``gradient_reduction_w_predivide``, ``use_multi_rank_bucket_allreduce``
  on by default), and the gradient norm's scalar goes the same way. MAX/MIN/PRODUCT (overflow checks) stay with
  DeepSpeed.
* ``reduce`` with SUM or AVG (ZeRO-2 with ``"use_multi_rank_bucket_allreduce": false``: each bucket reduced to its
  owner) -> the same ring all-reduce: the owner gets its sum, the other ranks get it too (DeepSpeed reads the
  result only on the owner), so it moves 2(N-1)/N of the bucket per rank instead of (N-1)/N.

The data-parallel groups are the engine's ``data_parallel_group`` and ``seq_data_parallel_group``, the ZeRO
optimizer's ``dp_process_group`` and, for ZeRO-3, every parameter's ``ds_process_group`` (without a model-parallel
``mpu`` that is the world group itself: ``zero.Init`` uses ``dist.get_world_group()``). Calls on any other group
(expert, model or pipeline parallel groups) and every other collective go to DeepSpeed's backend unchanged. A
routed call that the rings cannot serve (a non-contiguous tensor, CPU tensors on a non-gloo group or CUDA tensors
on a non-NCCL one, a group of one rank) is passed to DeepSpeed's backend as well and counted in ``stats.passed``.

Numerics: the ring reduce-scatter sums in ring order, so results may differ from gloo's/NCCL's by float rounding
(with 2 ranks a sum of two values does not depend on order: the tests see equal losses).

Configuration: the ``"commfuse"`` top-level section of the DeepSpeed config (DeepSpeed keeps unknown top-level
keys; it is read from ``engine._config._param_dict``), or ``cfg=`` (a :class:`commfuse_dp.CommFuseConfig` or a
mapping). Only the ring fields apply here: ``bucket_mb`` (ring bucket / chunk size), ``direct_kb`` (a collective
of at most this many KiB is one direct round with every peer instead of N-1 ring steps) and ``timeout_s`` (a
stalled or dead peer raises :class:`commfuse_dp.RingCommError` within it instead of hanging). Any other key is an error
naming the key. Without either, the defaults of ``CommFuseConfig``.

Refused: an engine whose model was sharded by :func:`commfuse_dp.shard` (both would shard one model; DeepSpeed
0.19.8 itself already fails to initialise ZeRO-1 on such a model, "_apply(): Couldn't swap RingEmbedding.weight"),
and a second ``enable_ring_collectives`` while one is active. The other direction, ``commfuse_dp.shard`` on a
DeepSpeed engine or on a model whose parameters ZeRO-3 partitioned, is refused by ``shard`` itself
(``commfuse_dp/checks.py``).

Not tested: ZeRO++ (its int8 weight gathers on the data-parallel group would go through the rings, a byte-exact
copy; hpZ's gathers on its intra-node group and qgZ's all-to-all stay with DeepSpeed), CPU/NVMe offload, and the
NCCL path, which has not run on a GPU yet.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist

from commfuse_dp.config import CommFuseConfig
from commfuse_dp.ring.topology import drain_gloo_workers, register_exit_drain
from commfuse_dp.integrations.deepspeed_backend import RingBackend, RingStats, group_name

__all__ = ["RING_FIELDS", "RingCollectives", "RingStats", "attach_to_trainer_callback", "config_from_deepspeed",
           "drain_gloo_workers", "enable_ring_collectives", "shutdown"]

RING_FIELDS = ("bucket_mb", "direct_kb", "timeout_s")
"""The ``CommFuseConfig`` fields that apply to DeepSpeed's collectives (the rest configure ``commfuse_dp.shard``)."""

_lock = threading.Lock()


# ---- configuration -------------------------------------------------------------------------------------------

def config_from_deepspeed(ds_config: Mapping[str, Any] | None) -> CommFuseConfig | None:
    """The ``CommFuseConfig`` of the ``"commfuse"`` section of a DeepSpeed config dict, or ``None`` without one.

    Only :data:`RING_FIELDS` are accepted; an unknown key, a ``CommFuseConfig`` field that does nothing to
    DeepSpeed's collectives, or a bad value raises ``ValueError`` naming it."""
    if not ds_config or "commfuse" not in ds_config:
        return None
    section = ds_config["commfuse"]
    where = 'DeepSpeed config, "commfuse" section'
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ValueError(f"{where}: expected a mapping such as {{\"bucket_mb\": 25}}, got {type(section).__name__} "
                         f"{section!r}")
    known = {f.name for f in fields(CommFuseConfig)}
    for key in section:
        if key not in known:
            close = difflib.get_close_matches(str(key), RING_FIELDS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"{where}: unknown key {key!r}; {hint}the section takes {list(RING_FIELDS)}")
        if key not in RING_FIELDS:
            raise ValueError(f"{where}: {key!r} configures commfuse_dp.shard() and does nothing to DeepSpeed's "
                             f"collectives; remove it (the section takes {list(RING_FIELDS)})")
    try:
        return CommFuseConfig.from_dict(section)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err


def _ring_config(cfg: CommFuseConfig | Mapping[str, Any] | None) -> CommFuseConfig | None:
    if cfg is None or isinstance(cfg, CommFuseConfig):
        return cfg
    if isinstance(cfg, Mapping):
        return config_from_deepspeed({"commfuse": cfg})
    raise TypeError(f"enable_ring_collectives: cfg must be a CommFuseConfig, a mapping of {list(RING_FIELDS)} or "
                    f"None, got {type(cfg).__name__}")


# ---- what a run reports ----------------------------------------------------------------------------------------

class RingCollectives:
    """The handle :func:`enable_ring_collectives` returns: ``stats``, ``config``, ``group_ranks`` (the ranks of each
    data-parallel process group routed to the rings), ``disable()`` (DeepSpeed's previous backend again); also a
    context manager that disables on exit."""

    def __init__(self, config: CommFuseConfig, groups: tuple[dist.ProcessGroup, ...], source: str) -> None:
        self.config = config
        # Ranks only: a reference to a group would keep it (and gloo's worker threads) alive after
        # destroy_process_group() for as long as this handle lives.
        self.group_ranks = [dist.get_process_group_ranks(g) for g in groups]
        self.source = source  # where the config came from, for messages
        self.stats = RingStats()
        self._backend: RingBackend | None = None

    @property
    def enabled(self) -> bool:
        return self._backend is not None

    def disable(self) -> None:
        """Put DeepSpeed's previous backend back. Idempotent. Raises if something replaced the backend since."""
        import deepspeed.comm.comm as ds_comm

        with _lock:
            if self._backend is None:
                return
            if ds_comm.cdb is not self._backend:
                raise RuntimeError(f"RingCollectives.disable: deepspeed.comm.comm.cdb was replaced since the rings "
                                   f"were enabled (it is now {type(ds_comm.cdb).__name__}); disable whatever replaced "
                                   f"it first, in reverse order")
            ds_comm.cdb = self._backend._inner
            self._backend = None

    def __enter__(self) -> RingCollectives:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disable()

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return (f"RingCollectives({state}, bucket_mb={self.config.bucket_mb:g}, direct_kb={self.config.direct_kb:g}, "
                f"timeout_s={self.config.timeout_s:g}, groups={self.group_ranks}, calls={dict(self.stats.calls)})")


# ---- which groups are data-parallel ---------------------------------------------------------------------------

def _dp_groups(module: torch.nn.Module | None, optimizer: Any, engine: Any = None) -> tuple[dist.ProcessGroup, ...]:
    from deepspeed.utils import groups as ds_groups

    found: list[Any] = []
    if engine is not None:
        found += [getattr(engine, "data_parallel_group", None), getattr(engine, "seq_data_parallel_group", None)]
    else:
        found += [ds_groups._get_data_parallel_group(), ds_groups._get_sequence_data_parallel_group()]
    while optimizer is not None:  # accelerate's DeepSpeedOptimizerWrapper -> the ZeRO optimizer
        found.append(getattr(optimizer, "dp_process_group", None))
        inner = getattr(optimizer, "optimizer", None)
        optimizer = inner if inner is not optimizer else None
    if module is not None:
        found += [getattr(p, "ds_process_group", None) for p in module.parameters()]  # ZeRO-3
    if engine is None and module is None:
        # Before an engine exists: ZeRO-3 / zero.Init partition over dist.get_world_group() when no mpu is given,
        # so the world is a data-parallel group whenever DeepSpeed's data-parallel group spans it.
        dp = found[0]
        if dp is not None and dist.get_world_size(dp) == dist.get_world_size():
            found.append(dist.group.WORLD)
    out: dict[str, dist.ProcessGroup] = {}
    for g in found:
        if isinstance(g, dist.ProcessGroup):
            out.setdefault(group_name(g), g)
    return tuple(out.values())


# ---- public entry points --------------------------------------------------------------------------------------

def enable_ring_collectives(engine: Any = None, cfg: CommFuseConfig | Mapping[str, Any] | None = None
                            ) -> RingCollectives:
    """Route DeepSpeed's data-parallel parameter all-gathers and gradient reductions through commfuse's rings
    (module docs) and return the :class:`RingCollectives` handle (``stats``, ``disable()``).

    ``engine``: the ``DeepSpeedEngine`` from ``deepspeed.initialize``; its config's ``"commfuse"`` section and its
    data-parallel groups are used. ``None``: DeepSpeed's default data-parallel groups (for use before
    ``deepspeed.initialize``; needs ``deepspeed.init_distributed()``). ``cfg``: a ``CommFuseConfig`` or a mapping
    of :data:`RING_FIELDS`; it wins over the engine config's section.

    Call it on every rank of the data-parallel groups, at the same point: a rank that runs DeepSpeed's own
    collective while its peers run the ring makes both wait, and the rings raise ``RingCommError`` after
    ``timeout_s``.
    """
    section = None
    module = None
    if engine is not None:
        module = getattr(engine, "module", None)
        if not isinstance(module, torch.nn.Module) or not hasattr(engine, "data_parallel_group"):
            raise TypeError(f"enable_ring_collectives: engine must be the DeepSpeedEngine returned by "
                            f"deepspeed.initialize, got {type(engine).__name__}")
        _refuse_commfuse_sharded(module, "enable_ring_collectives")
        param_dict = getattr(getattr(engine, "_config", None), "_param_dict", None)
        section = config_from_deepspeed(param_dict if isinstance(param_dict, Mapping) else None)
    config = _ring_config(cfg)
    source = "cfg" if config is not None else "the DeepSpeed config" if section is not None else "defaults"
    config = config or section or CommFuseConfig()
    _require_deepspeed_comm()
    groups = _dp_groups(module, getattr(engine, "optimizer", None), engine) if engine is not None \
        else _dp_groups(None, None)
    return _install(config, groups, source)


def attach_to_trainer_callback(callback: Any, args: Any, model: Any, control: Any) -> Any:
    """``CommFuseCallback.on_init_end`` when the ``TrainingArguments`` ask for DeepSpeed: check now, and switch
    DeepSpeed's collectives to the rings at ``on_train_begin``, when the engine exists.

    DeepSpeed shards the model then, so the callback does not shard it (nor mark it prepared). The Trainer passes
    callbacks the HF model and accelerate's ``DeepSpeedOptimizerWrapper``, not the engine: the data-parallel
    groups come from DeepSpeed's group registry, the ZeRO optimizer and (ZeRO-3) the parameters, the ring config
    from the ``"commfuse"`` section of ``args.hf_deepspeed_config`` if present, else the callback's ``cfg`` (a
    ring field that the callback's config sets to a non-default value different from the section's: an error)."""
    if model is None:
        raise ValueError("CommFuseCallback: the Trainer has no model; pass model=... to Trainer")
    _refuse_commfuse_sharded(model, "CommFuseCallback")
    hf_ds = getattr(args, "hf_deepspeed_config", None)
    ds_dict = getattr(hf_ds, "config", None)
    section = config_from_deepspeed(ds_dict if isinstance(ds_dict, Mapping) else None)
    own = _ring_config(getattr(callback, "cfg", None))
    if section is not None and own is not None:
        # The callback's config always exists (CommFuseConfig.from_env() without an argument): only its ring fields
        # that differ from the defaults were set by the user, and those must not contradict the section.
        default = CommFuseConfig()
        clash = [f for f in RING_FIELDS
                 if getattr(own, f) != getattr(default, f) and getattr(own, f) != getattr(section, f)]
        if clash:
            diff = ", ".join(f"{f}: DeepSpeed config {getattr(section, f)!r}, CommFuseCallback {getattr(own, f)!r}"
                             for f in clash)
            raise ValueError(f"CommFuseCallback: the DeepSpeed config's \"commfuse\" section and the callback's "
                             f"CommFuseConfig disagree ({diff}); set the ring fields in one place")
    config = section or own or CommFuseConfig()
    source = "the DeepSpeed config" if section is not None else "CommFuseCallback"
    class_hook = type(callback).on_train_begin

    def on_train_begin(args, state, control, model=None, optimizer=None, **kwargs):
        result = class_hook(callback, args, state, control, model=model, optimizer=optimizer, **kwargs)
        rings = getattr(callback, "rings", None)
        if rings is None or not rings.enabled:
            _refuse_commfuse_sharded(model, "CommFuseCallback")
            _require_deepspeed_comm()
            callback.rings = _install(config, _dp_groups(model, optimizer), source)
        return result if result is not None else control

    callback.on_train_begin = on_train_begin  # the instance's hook; the class's own one still runs first
    callback.rings = None
    callback.model = model
    return control


# ---- helpers -------------------------------------------------------------------------------------------------

def _install(config: CommFuseConfig, groups: tuple[dist.ProcessGroup, ...], source: str) -> RingCollectives:
    import deepspeed.comm.comm as ds_comm

    if not groups:
        raise RuntimeError("enable_ring_collectives: found no data-parallel process group of DeepSpeed to route")
    handle = RingCollectives(config, groups, source)
    with _lock:
        current = ds_comm.cdb
        if isinstance(current, RingBackend):
            raise ValueError(f"enable_ring_collectives: DeepSpeed's collectives already run on the rings "
                             f"({current._handle!r}); call .disable() on that handle first")
        handle._backend = RingBackend(current, handle, groups)
        ds_comm.cdb = handle._backend
        register_exit_drain()
    return handle


def shutdown(rings: RingCollectives | None = None) -> None:
    """End of a run: disable ``rings`` (if given), let gloo's worker threads release their finished work
    (:func:`drain_gloo_workers`) and destroy DeepSpeed's process groups (``deepspeed.comm.destroy_process_group``).
    Call it on every rank after the last collective, instead of just leaving the script."""
    import deepspeed.comm as ds_dist

    if rings is not None:
        rings.disable()
    drain_gloo_workers()
    if dist.is_initialized():
        ds_dist.destroy_process_group()


def _require_deepspeed_comm() -> None:
    import deepspeed.comm.comm as ds_comm

    if ds_comm.cdb is None or not ds_comm.cdb.is_initialized() or not dist.is_initialized():
        raise RuntimeError("enable_ring_collectives: deepspeed.comm is not initialised; call "
                           "deepspeed.init_distributed() (or deepspeed.initialize(...)) first, in a process started "
                           "by torchrun or the deepspeed launcher")


def _refuse_commfuse_sharded(module: Any, who: str) -> None:
    if getattr(module, "_commfuse_engine", None) is not None:
        raise ValueError(f"{who}: this model was sharded by commfuse_dp.shard(), and DeepSpeed ZeRO shards it too; "
                         f"one model cannot be sharded twice. Either give DeepSpeed the plain (unsharded) model and "
                         f"let enable_ring_collectives switch DeepSpeed's collectives to the rings, or drop DeepSpeed "
                         f"and train the commfuse-sharded model with a torch optimizer")
