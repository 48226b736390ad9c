"""commfuse_dp: sharded data parallelism whose collectives run as peer-to-peer rings fused with compute.

Public names: ``CommFuseConfig``; the ring layer in ``commfuse_dp.ring``; the integrations in
``commfuse_dp.integrations`` (``fsdp.use_ring_collectives`` today); ``shard(model, config)`` and
``step_stats(model)`` for the fused engine; ``describe(model)`` for what ``shard()`` fused and what each part moves;
``tensor_parallel(model, group)`` for sequence-parallel tensor parallelism on rings (``commfuse_dp.tp``).

The names are imported on first use (PEP 562), so that ``commfuse-dp launch`` and ``plan`` start without loading
FSDP2, DTensor and dynamo, which the engine needs and a launcher does not.
"""

import importlib
import importlib.util
import sys
import types

from .config import CommFuseConfig

__version__ = "0.1.0.dev0"

_WHERE = {
    "ShardReport": ".describe", "describe": ".describe", "shard": ".shard", "step_stats": ".shard",
    "StepStats": ".stats", "tensor_parallel": ".tp",
    **{name: ".ring" for name in ("RingAllGather", "RingCommError", "RingReduceScatter", "ring_all_gather",
                                  "ring_all_gather_coalesced", "ring_reduce_scatter",
                                  "ring_reduce_scatter_coalesced")},
}

__all__ = ["CommFuseConfig", *_WHERE]


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")  # a subpackage, as ``commfuse_dp.ring.<name>``
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


class _Package(types.ModuleType):
    """``commfuse_dp.shard`` and ``commfuse_dp.describe`` name functions, as they did when this package imported
    them eagerly: importing the submodule of the same name (``from commfuse_dp.shard import ...``) must not bind the
    module over the function, which the import system would otherwise do on the package."""

    def __setattr__(self, name: str, value) -> None:
        if name in ("shard", "describe") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
