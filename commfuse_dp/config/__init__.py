"""``CommFuseConfig``: every knob of commfuse_dp in one validated dataclass.

A config comes from keyword arguments, a dict (``from_dict``), a YAML file (``from_yaml``; a top-level
``commfuse:`` block, as in an accelerate config that ``commfuse-dp launch`` reads, or a flat mapping) or
``COMMFUSE_*`` environment variables (``from_env``; this is how ``commfuse-dp launch`` hands the config to
the workers of ``accelerate launch``). Every field is checked in ``__post_init__``; a bad value raises
``ValueError`` naming the field, the value and what is allowed.

The dataclass is ``fields.py``; the names and parsers of its values are ``values.py``.
"""

from .fields import CommFuseConfig, with_parallelism
from .values import (ENV_PREFIX, ENV_RESERVED, FEEDBACK_DTYPES, FORWARD_BUNDLES_ABOVE, FSDP2_COLLECTIVES,
                     GRAD_DIVIDES, MIN_FUSE_NUMEL, NONFINITE_MODES, SCHEDULES, forward_bundles_auto)

__all__ = ["ENV_PREFIX", "ENV_RESERVED", "FEEDBACK_DTYPES", "FORWARD_BUNDLES_ABOVE", "FSDP2_COLLECTIVES",
           "GRAD_DIVIDES", "MIN_FUSE_NUMEL", "NONFINITE_MODES", "SCHEDULES", "CommFuseConfig",
           "forward_bundles_auto", "with_parallelism"]
