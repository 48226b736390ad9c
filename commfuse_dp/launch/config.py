"""The config file of ``commfuse-dp launch``: an accelerate config plus a ``commfuse:`` block, read, checked and
turned into the workers' environment. ``launch`` and ``launch.commands`` both read it through here."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
from collections.abc import Mapping


class LaunchError(Exception):
    """A wrong use found before anything was started: printed as one line, exit status 2."""


def load_config_file(path: str) -> tuple[dict, dict]:
    """(the accelerate part, the commfuse part) of an accelerate config file (YAML or JSON)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    except FileNotFoundError:
        raise LaunchError(f"--config_file {path}: no such file") from None
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LaunchError(f"{path}: not a readable YAML/JSON file: {' '.join(str(e).split())}") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise LaunchError(f"{path}: expected a mapping of accelerate config keys, got {type(data).__name__}")
    data = dict(data)
    block = data.pop("commfuse", None)
    if block is None:
        block = {}
    if not isinstance(block, Mapping):
        raise LaunchError(f"{path}: commfuse: must be a mapping of CommFuseConfig fields (key: value lines under "
                          f"commfuse:), got {type(block).__name__} {block!r}")
    return data, dict(block)


def commfuse_config(path: str | None, block: dict):
    from commfuse_dp.config import CommFuseConfig

    where = f"{path}: commfuse:" if path else "commfuse:"
    known = [f.name for f in dataclasses.fields(CommFuseConfig)]
    unknown = sorted(set(block) - set(known), key=str)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise LaunchError(f"{where} unknown key {key!r}{' (and ' + str(unknown[1:]) + ')' if unknown[1:] else ''}; "
                          f"{hint}known keys are {known}")
    try:
        return CommFuseConfig.from_dict(block)
    except ValueError as e:
        raise LaunchError(f"{where} {' '.join(str(e).split())}") from None


def has_accelerator() -> bool:
    import torch

    try:
        return bool(torch.accelerator.is_available())
    except (AttributeError, RuntimeError):
        return torch.cuda.is_available()


def worker_env(cfg) -> dict[str, str]:
    """``COMMFUSE_ENABLE=1`` and the config's variables, checked the way the workers will read them."""
    from commfuse_dp.config import CommFuseConfig

    env = {"COMMFUSE_ENABLE": "1", **cfg.to_env()}
    merged = {**os.environ, **env}
    try:
        back = CommFuseConfig.from_env(merged)
    except ValueError as e:  # a stray COMMFUSE_* variable in this shell would stop every worker
        raise LaunchError(f"environment: {' '.join(str(e).split())}") from None
    if back != cfg:
        raise LaunchError(f"commfuse: the config does not survive the environment round trip: {cfg} became {back}")
    return env


def accelerate_part_file(path: str, accel_part: dict, tmp: str) -> str:
    """Write the accelerate part of ``path`` into ``tmp`` and check it the way accelerate will read it."""
    import yaml
    from accelerate.commands.config import load_config_from_file

    out = os.path.join(tmp, "accelerate" + (".json" if path.endswith(".json") else ".yaml"))
    with open(out, "w", encoding="utf-8") as f:
        if path.endswith(".json"):
            json.dump(accel_part, f)
        else:
            yaml.safe_dump(accel_part, f, sort_keys=False)
    try:
        load_config_from_file(out)
    except (ValueError, TypeError, KeyError) as e:
        hint = ""
        if "distributed_type" not in accel_part:
            hint = (" Add `distributed_type: MULTI_CPU` (with `use_cpu: true`) on a CPU machine, or `MULTI_GPU` on "
                    "GPUs (`accelerate config` writes a complete file).")
        raise LaunchError(f"{path} (the accelerate part): {' '.join(str(e).split())}".replace(out, path) + hint
                          ) from None
    return out


def read_config(path: str | None, *, nested: bool = False, replicate_flag: int = 1):
    """(accelerate part, CommFuseConfig, worker environment) of a config file. ``nested``: a file without a
    ``commfuse:`` block keeps the configuration already in the environment (the outer commfuse-dp launch's).
    ``replicate_flag``: ``--parallelism_config_dp_replicate_size`` from the command line."""
    from commfuse_dp.config import CommFuseConfig

    accel_part, block = load_config_file(path) if path else ({}, {})
    if nested and not block:
        try:
            cfg = CommFuseConfig.from_env()
        except ValueError as e:
            raise LaunchError(f"environment: {' '.join(str(e).split())}") from None
    else:
        cfg = commfuse_config(path, block)
    cfg = replicate_from_parallelism(accel_part, cfg, replicate_flag, path)
    return accel_part, cfg, worker_env(cfg)


def replicate_from_parallelism(accel_part: dict, cfg, replicate_flag: int, path: str | None):
    """accelerate's HSDP setting (``parallelism_config: {parallelism_config_dp_replicate_size: R}`` in the config
    file, or ``--parallelism_config_dp_replicate_size R``) as ``CommFuseConfig.replicate``. accelerate itself allows
    a parallelism config only with FSDP2, which commfuse replaces, so the block is taken out of what accelerate
    reads; ``tp_size`` becomes ``CommFuseConfig.tp_size``, ``dp_shard_size`` is then world / (R x TP), and context
    or sequence parallel sizes are refused."""
    from commfuse_dp.config import with_parallelism

    block = accel_part.pop("parallelism_config", None) or {}
    sizes = {key.removeprefix("parallelism_config_"): value for key, value in block.items()}
    replicate = int(sizes.get("dp_replicate_size") or 1)
    if replicate_flag and replicate_flag > 1:
        if replicate > 1 and replicate != replicate_flag:
            raise LaunchError(f"--parallelism_config_dp_replicate_size {replicate_flag} disagrees with the config "
                              f"file's dp_replicate_size {replicate}: give one")
        sizes["dp_replicate_size"] = replicate_flag
    try:
        return with_parallelism(cfg, sizes, f"{path}: accelerate's parallelism_config", "the commfuse: block's")
    except ValueError as err:
        raise LaunchError(str(err)) from None


def is_cpu(args: argparse.Namespace, accel_part: dict) -> bool:
    return (bool(getattr(args, "cpu", False)) or bool(accel_part.get("use_cpu"))
            or accel_part.get("distributed_type") == "MULTI_CPU" or not has_accelerator())
