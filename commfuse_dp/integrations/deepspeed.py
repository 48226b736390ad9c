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
of at most this many KiB is one direct round with every peer instead of N-1 hops) and ``timeout_s`` (a
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

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from commfuse_dp.config import CommFuseConfig
from commfuse_dp.integrations.attach import attach
from commfuse_dp.integrations.deepspeed_backend import (RING_FIELDS, RingCollectives, RingStats, config_from_deepspeed,
                                                        dp_groups, install, require_deepspeed_comm, ring_config_arg)
from commfuse_dp.ring.topology import drain_gloo_workers

__all__ = ["RING_FIELDS", "RingCollectives", "RingStats", "attach_to_trainer_callback", "config_from_deepspeed",
           "drain_gloo_workers", "enable_ring_collectives", "shutdown"]


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
    if engine is None:  # before deepspeed.initialize: no model to attach, DeepSpeed's default groups
        config = ring_config_arg(cfg)
        require_deepspeed_comm()
        return install(config or CommFuseConfig(), dp_groups(None, None), "cfg" if config is not None else "defaults")
    module = getattr(engine, "module", None)
    if not isinstance(module, torch.nn.Module) or not hasattr(engine, "data_parallel_group"):
        raise TypeError(f"enable_ring_collectives: engine must be the DeepSpeedEngine returned by "
                        f"deepspeed.initialize, got {type(engine).__name__}")
    return attach(module, cfg, who="enable_ring_collectives", backend="deepspeed", engine=engine).rings


def attach_to_trainer_callback(callback: Any, args: Any, model: Any, control: Any) -> Any:
    """``CommFuseCallback.on_init_end`` when the ``TrainingArguments`` ask for DeepSpeed: :func:`attach` checks the
    model and decides the ring config now; DeepSpeed's collectives switch to the rings at ``on_train_begin``, when
    the engine exists (``Attachment.start``).

    DeepSpeed shards the model then, so the callback does not shard it (nor mark it prepared). The Trainer passes
    callbacks the HF model and accelerate's ``DeepSpeedOptimizerWrapper``, not the engine: the data-parallel
    groups come from DeepSpeed's group registry, the ZeRO optimizer and (ZeRO-3) the parameters, the ring config
    from the ``"commfuse"`` section of ``args.hf_deepspeed_config`` if present, else the callback's ``cfg`` (a
    ring field that the callback's config sets to a non-default value different from the section's: an error)."""
    if model is None:
        raise ValueError("CommFuseCallback: the Trainer has no model; pass model=... to Trainer")
    ds_dict = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    attachment = attach(model, getattr(callback, "cfg", None), who="CommFuseCallback", backend="deepspeed",
                        ds_config=ds_dict if isinstance(ds_dict, Mapping) else None, own_wins=False)
    class_hook = type(callback).on_train_begin

    def on_train_begin(args, state, control, model=None, optimizer=None, **kwargs):
        result = class_hook(callback, args, state, control, model=model, optimizer=optimizer, **kwargs)
        rings = getattr(callback, "rings", None)
        if rings is None or not rings.enabled:
            callback.rings = attachment.start(model, optimizer)
        return result if result is not None else control

    callback.on_train_begin = on_train_begin  # the instance's hook; the class's own one still runs first
    callback.rings = None
    callback.model = model
    return control


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
