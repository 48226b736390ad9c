"""The values of ``CommFuseConfig``'s fields: the allowed names, and the parsers that turn what a user writes
(Python, YAML, ``COMMFUSE_*`` environment text) into a field's value, each raising ``ValueError`` naming the field."""

from __future__ import annotations

import json
from typing import Any

import torch

ENV_PREFIX = "COMMFUSE_"

SCHEDULES = ("auto", "fused", "slicing", "fsdp2")
FSDP2_COLLECTIVES = ("auto", "rings", "torch")
MIN_FUSE_NUMEL = 1 << 16  # CommFuseConfig.min_fuse_numel's default (also the planner's)
GRAD_DIVIDES = ("post", "pre", "split")
NONFINITE_MODES = ("auto", "raise", "skip", "off")

# ``COMMFUSE_*`` variables that are not config fields: read by the integrations (``COMMFUSE_ENABLE`` turns them on,
# ``COMMFUSE_CONFIG`` names a YAML file, ``COMMFUSE_LAUNCH_CONFIG`` the accelerate part of the config file of
# ``commfuse-dp launch`` for a launcher it runs once). ``from_env`` accepts and ignores them; any other unknown one is
# a typo.
ENV_RESERVED = ("COMMFUSE_ENABLE", "COMMFUSE_CONFIG", "COMMFUSE_LAUNCH_CONFIG")

# Names a user may write for a dtype (YAML, environment, CLI), and the torch dtype each means.
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _auto_or_count(name: str, value: Any, meaning: str) -> int | str:
    """``"auto"``, or an integer >= 1 (``meaning`` says what it counts, in the error)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    value = _number(name, value, int)
    if value < 1:
        raise ValueError(f"CommFuseConfig.{name}={value!r}: must be \"auto\" or an integer >= 1 ({meaning})")
    return value


def _number(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"CommFuseConfig.{name}={value!r}: must be a number")
    if kind is int and (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"CommFuseConfig.{name}={value!r}: must be a whole number")
    return kind(value)


def _dtype(name: str, value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype) and value in _FLOAT_DTYPES:
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in ("none", ""):
            return None
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
    raise ValueError(f"CommFuseConfig.{name}={value!r}: allowed values are None, float32, bfloat16, float16 "
                     f"(also written fp32, bf16, fp16)")


FEEDBACK_DTYPES = ("float32", "bfloat16")  # CommFuseConfig.feedback_dtype's values


def _feedback_dtype(value: Any) -> str:
    """``feedback_dtype``'s name (``"float32"`` or ``"bfloat16"``) from a name, an alias or a torch dtype."""
    key = value
    if isinstance(value, str):
        key = _DTYPE_NAMES.get(value.strip().lower().removeprefix("torch."))
    if isinstance(key, torch.dtype) and key in (torch.float32, torch.bfloat16):
        return str(key).removeprefix("torch.")
    raise ValueError(f"CommFuseConfig.feedback_dtype={value!r}: allowed values are {FEEDBACK_DTYPES} (also written "
                     f"fp32, bf16): the dtype error feedback keeps its residuals in")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
FORWARD_BUNDLES_ABOVE = 512  # forward_bundles="auto": (ranks - 1) x units² above this bundles the forward


def forward_bundles_auto(world: int, units: int) -> bool:
    """``forward_bundles="auto"`` on ``world`` ranks for ``units`` units with fused groups (also the planner's)."""
    return (world - 1) * units * units > FORWARD_BUNDLES_ABOVE

_BOOL_FIELDS = ("stats", "prefetch_next", "ring_embeddings", "exclude_data_dependent", "shard_frozen",
                "error_feedback", "auto_resume", "async_save")


def _patterns(name: str, value: Any) -> tuple[str, ...]:
    """A tuple of module-name patterns from a tuple/list of strings or one comma-separated string."""
    if isinstance(value, str):
        value = [part for part in (p.strip() for p in value.split(",")) if part]
    if not isinstance(value, (tuple, list)) or not all(isinstance(p, str) for p in value):
        raise ValueError(f"CommFuseConfig.{name}={value!r}: must be a list of module-name patterns (strings, "
                         f"fnmatch style, e.g. ['*.experts.*', 'lm_head']) or one comma-separated string")
    patterns = tuple(p.strip() for p in value)
    bad = [p for p in patterns if not p or "," in p]
    if bad:
        raise ValueError(f"CommFuseConfig.{name}: patterns {bad!r} are empty or contain a comma; module names have "
                         f"neither, and a comma separates patterns in the environment")
    return patterns


def _env_text(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(value)
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def _parse_env(name: str, raw: str) -> Any:
    """Turn one environment string into the type of field ``name``; validation proper is ``__post_init__``'s."""
    var = ENV_PREFIX + name.upper()
    text = raw.strip()
    if name in _BOOL_FIELDS or (name == "forward_bundles" and text.lower() != "auto"):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"{var}={raw!r}: must be one of {_TRUE + _FALSE}")
    if name == "tp_plan" and text.startswith("{"):
        try:
            return json.loads(text)
        except ValueError:
            raise ValueError(f"{var}={raw!r}: must be 'auto' or a JSON mapping of module names to style names") \
                from None
    if name in ("lookahead_mb", "forward_bundles", "piece_shards", "replicate", "hpz_size") and text.lower() == "auto":
        return "auto"
    if name in ("link_gbps", "ring_latency_us", "tflops", "tokens_per_rank") and text.lower() in ("none", ""):
        return None
    if name in ("bucket_mb", "direct_kb", "timeout_s", "min_fuse_numel", "prefetch_depth", "lookahead_mb", "replicate",
                "piece_shards", "link_gbps", "ring_latency_us", "tflops", "tokens_per_rank", "format_block", "tp_size",
                "hpz_size"):
        try:
            return float(text) if name not in ("min_fuse_numel", "prefetch_depth", "replicate", "piece_shards",
                                               "tokens_per_rank", "format_block", "tp_size", "hpz_size") \
                else int(float(text))
        except ValueError:
            raise ValueError(f"{var}={raw!r}: must be a number") from None
    return text  # strings and dtype names
