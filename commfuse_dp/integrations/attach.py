"""One way onto the rings: ``attach(model, config, who=..., backend=...)``, which every integration calls.

Who calls it, and with what (each keeps only what reads its own library's settings):

* ``CommFuseCallback.on_init_end`` (``CommFuseTrainer``, ``commfuse_trainer(...)``, and every Trainer under
  ``commfuse-dp launch``): ``backend="shard"`` with ``parallelism=`` from ``TrainingArguments.parallelism_config``;
  with ``TrainingArguments(deepspeed=...)`` ``backend="deepspeed"`` with the DeepSpeed config dict and no engine yet
  (``commfuse_dp/integrations/deepspeed.py``, :func:`attach_to_trainer_callback`: the rings start at ``on_train_begin``).
* ``CommFuseAccelerator.prepare`` / ``prepare_model`` (and every ``Accelerator`` under ``commfuse-dp launch``):
  ``backend="shard"`` with ``place=`` (the model to ``accelerator.device``); with DeepSpeed ``backend="deepspeed"``
  with the engine that ``Accelerator.prepare`` built.
* ``enable_ring_collectives(engine)``: ``backend="deepspeed"`` with the engine.
* ``commfuse_dp.integrations.fsdp.use_ring_collectives(model)``: ``backend="fsdp2"`` (a model FSDP2 sharded).

``commfuse-dp launch`` has no attach code of its own: its hooks (``commfuse_dp/launch/bootstrap.py``) make the script's
``Accelerator`` a ``CommFuseAccelerator`` and its ``Trainer`` a ``CommFuseTrainer``, which attach through here.

What :func:`attach` decides for all of them, by ``backend``:

1. The model against the backend, before anything changes: ``"shard"`` refuses a ``DistributedDataParallel`` and a
   model DeepSpeed or FSDP2 shards already (``commfuse_dp.checks.check_not_sharded_elsewhere``: the same message
   as ``shard()``, naming what to do instead) and takes a model ``shard()`` sharded as it is (nothing is done
   twice); ``"deepspeed"`` refuses a model ``shard()`` sharded; ``"fsdp2"`` one without FSDP2 units or sharded by
   ``shard()`` (``use_ring_collectives``'s checks).
2. The config: ``config`` is the entry's own (``None``: none given; the entries that read the ``COMMFUSE_*``
   environment resolve it when they are made, :func:`resolve_config`). ``"shard"``: with ``parallelism`` applied
   (``dp_replicate_size`` becomes ``replicate``, ``tp_size`` stays ``tp_size``; context parallel sizes refused).
   ``"deepspeed"``: merged with the
   DeepSpeed config's ``"commfuse"`` section (``own_wins``: the entry's config, or the section, wins; see
   ``deepspeed_backend.ring_config``).
3. The install: ``commfuse_dp.shard``; DeepSpeed's backend replaced on the engine's data-parallel groups (now, or
   at :meth:`Attachment.start` without an engine); ``use_ring_collectives`` on the FSDP2 units.
4. The record: every successful call appends ``(who, backend)`` to the model's handle (``handle_of(model).attachments``)
   (:func:`attachments`), so a run can tell which entry put a model on the rings, and how often.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from commfuse_dp.checkpoint import is_sharded
from commfuse_dp.checks import check_not_sharded_elsewhere
from commfuse_dp.config import CommFuseConfig, with_parallelism
from commfuse_dp.handle import engine_of, handle_of
from commfuse_dp.integrations import deepspeed_backend as ds
from commfuse_dp.ring.fsdp_comm import use_ring_collectives
from commfuse_dp.shard import shard

__all__ = ["BACKENDS", "Attachment", "Parallelism", "attach", "attachments", "resolve_config"]

BACKENDS = ("shard", "deepspeed", "fsdp2")


def resolve_config(commfuse: CommFuseConfig | Mapping | None) -> CommFuseConfig:
    """A ``CommFuseConfig`` from what a user passed to an integration: a config, a mapping of its fields, or
    ``None`` (the ``COMMFUSE_*`` environment, what ``commfuse-dp launch`` sets)."""
    if commfuse is None:
        return CommFuseConfig.from_env()
    if isinstance(commfuse, CommFuseConfig):
        return commfuse
    if isinstance(commfuse, Mapping):
        return CommFuseConfig.from_dict(commfuse)
    raise TypeError(f"commfuse= takes a CommFuseConfig, a dict of its fields or None, not {type(commfuse).__name__}")


class Parallelism(NamedTuple):
    """A library's parallelism settings (accelerate's ``ParallelismConfig`` sizes: ``dp_replicate_size``,
    ``dp_shard_size``, ``tp_size``, ``cp_size``, ``sp_size``), and the names its errors give them."""

    sizes: Mapping[str, Any]
    where: str        # e.g. "CommFuseCallback: TrainingArguments.parallelism_config"
    config_name: str  # e.g. "the callback's CommFuseConfig"

    def apply(self, config: CommFuseConfig) -> CommFuseConfig:
        return with_parallelism(config, self.sizes, self.where, self.config_name)


@dataclass
class Attachment:
    """What :func:`attach` did: ``who`` (the entry point, as messages name it), ``backend``, ``config`` (what the
    rings run with), ``source`` (where it came from) and, for DeepSpeed, ``rings`` (the ``RingCollectives``
    handle, once DeepSpeed's collectives run on the rings)."""

    who: str
    backend: str
    config: CommFuseConfig
    source: str
    rings: ds.RingCollectives | None = None

    def start(self, model: torch.nn.Module | None, optimizer: Any) -> ds.RingCollectives:
        """DeepSpeed attached before its engine existed (a Trainer's ``on_init_end``): route the data-parallel
        groups of ``model``'s ZeRO-3 parameters, of ``optimizer`` and of DeepSpeed's registry to the rings now."""
        if self.backend != "deepspeed":
            raise ValueError(f"Attachment.start: {self.who} attached with {self.backend!r}, which starts at attach")
        ds.refuse_commfuse_sharded(model, self.who)
        ds.require_deepspeed_comm()
        self.rings = ds.install(self.config, ds.dp_groups(model, optimizer), self.source)
        return self.rings


def attach(model: torch.nn.Module, config: CommFuseConfig | Mapping[str, Any] | None = None, *, who: str,
           backend: str = "shard", parallelism: Parallelism | None = None,
           place: Callable[[torch.nn.Module], None] | None = None, engine: Any = None,
           ds_config: Mapping[str, Any] | None = None, own_wins: bool = True, overlap: bool = False) -> Attachment:
    """Put ``model``'s collectives on the rings with ``backend`` (module docs) and record it on the model.

    ``who``: the entry point, named in errors. ``config``: the entry's own config (``None``: none; a mapping: its
    fields). ``backend="shard"``: ``parallelism`` (:class:`Parallelism`) applied to the config, ``place(model)``
    run after the checks and before ``shard()`` (device placement). ``backend="deepspeed"``: ``engine`` (the
    ``DeepSpeedEngine``: the rings start now) or ``ds_config`` (the DeepSpeed config dict an engine will be built
    from: :meth:`Attachment.start` later); ``own_wins`` as in ``deepspeed_backend.ring_config``.
    ``backend="fsdp2"``: ``overlap`` as in ``use_ring_collectives``."""
    if backend == "shard":
        done = _attach_shard(model, config, who, parallelism, place)
    elif backend == "deepspeed":
        done = _attach_deepspeed(model, config, who, engine, ds_config, own_wins)
    elif backend == "fsdp2":
        config = _config(config)
        use_ring_collectives(model, config, overlap=overlap)
        done = Attachment(who, backend, config or CommFuseConfig(), "cfg" if config is not None else "defaults")
    else:
        raise ValueError(f"attach: backend={backend!r}; one of {list(BACKENDS)}")
    _record(model, done)
    return done


def attachments(model: Any) -> list[tuple[str, str]]:
    """``(who, backend)`` of every :func:`attach` call that put ``model`` on the rings, in order."""
    handle = handle_of(model)
    return list(handle.attachments) if handle is not None else []


def _attach_shard(model, config, who: str, parallelism: Parallelism | None, place) -> Attachment:
    config = _config(config) or CommFuseConfig()
    if is_sharded(model):  # shard() ran already (the script's own call, or another entry): nothing to do twice
        engine = engine_of(model)   # (or its wrapper's)
        return Attachment(who, "shard", engine.config, "the model's shard()")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(f"{who} got a DistributedDataParallel model; pass the plain module")
    check_not_sharded_elsewhere(model)
    if parallelism is not None:
        config = parallelism.apply(config)
    if place is not None:
        place(model)
    shard(model, config)
    return Attachment(who, "shard", config, who)


def _attach_deepspeed(model, config, who: str, engine: Any, ds_config: Mapping | None,
                      own_wins: bool) -> Attachment:
    ds.refuse_commfuse_sharded(model, who)
    if engine is not None:
        param_dict = getattr(getattr(engine, "_config", None), "_param_dict", None)
        ds_config = param_dict if isinstance(param_dict, Mapping) else None
    section = ds.config_from_deepspeed(ds_config)
    config, source = ds.ring_config(ds.ring_config_arg(config), section, who, own_wins)
    done = Attachment(who, "deepspeed", config, source)
    if engine is not None:
        ds.require_deepspeed_comm()
        done.rings = ds.install(config, ds.dp_groups(model, getattr(engine, "optimizer", None), engine), source)
    return done


def _config(config: CommFuseConfig | Mapping[str, Any] | None) -> CommFuseConfig | None:
    if config is None or isinstance(config, CommFuseConfig):
        return config
    if isinstance(config, Mapping):
        return CommFuseConfig.from_dict(config)
    raise TypeError(f"attach: config must be a CommFuseConfig, a mapping of its fields or None, got "
                    f"{type(config).__name__}")


def _record(model: Any, done: Attachment) -> None:
    handle = handle_of(model) or handle_of(model, create=True)  # (the wrapped model's, where it has one)
    handle.attachments.append((done.who, done.backend))
