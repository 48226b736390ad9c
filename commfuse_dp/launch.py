"""``commfuse-dp launch``: ``accelerate launch`` with a ``commfuse:`` block in its config file.

    commfuse-dp launch --config_file accel.yaml train.py ARGS...

The config file is an ordinary accelerate config plus a ``commfuse:`` block of :class:`CommFuseConfig` fields
(accelerate itself rejects unknown top-level keys). This command

1. reads the file, takes the ``commfuse:`` block out and validates it (``CommFuseConfig.from_dict``; an unknown
   key or a bad value prints one line naming it and exits with status 2, before anything is started);
2. writes the rest to a temporary file that accelerate reads as ``--config_file``, untouched;
3. hands the commfuse settings to the workers as ``COMMFUSE_ENABLE=1`` plus the ``COMMFUSE_<FIELD>`` variables of
   ``CommFuseConfig.to_env()`` (the parent environment reaches accelerate's workers);
4. starts each worker as ``python -m commfuse_dp.integrations.bootstrap train.py ARGS`` instead of
   ``python train.py ARGS``. The bootstrap makes a plain ``accelerate.Accelerator()`` a ``CommFuseAccelerator`` and
   gives every plain ``transformers.Trainer`` a ``CommFuseCallback``, then runs the script unchanged as
   ``__main__`` (see ``commfuse_dp/integrations/bootstrap.py``).

Which launcher starts the workers (accelerate 1.15, ``accelerate/commands/launch.py``):

* With a GPU (or another accelerator torch knows): accelerate's own ``launch_command`` with the options parsed by
  accelerate's own parser, exactly what ``accelerate launch`` does, with the bootstrap as the ``--module``.
* On CPU (``use_cpu: true`` / ``--cpu``, or no accelerator available): ``accelerate launch`` would take its simple
  launcher and start ONE process whatever ``num_processes`` says (it only starts N through an mpirun hostfile).
  So this command starts the N = ``num_processes`` ranks itself through ``torch.distributed.run``, as
  accelerate's multi-GPU launcher does (``multi_gpu_launcher``): the same ``_validate_launch_command`` (config
  values into the options), ``prepare_multi_gpu_env`` (``ACCELERATE_MIXED_PRECISION``, the dynamo variables,
  ``OMP_NUM_THREADS``, rendezvous options) and ``_filter_args``, plus ``ACCELERATE_USE_CPU=true``, under which a
  plain ``Accelerator()`` in a torchrun worker is ``MULTI_CPU`` with N processes (gloo). Without
  ``main_process_port`` a free port is taken.

The exit status is the workers' (the first failed rank's).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import inspect
import itertools
import json
import os
import re
import sys
import tempfile
from collections.abc import Mapping

BOOTSTRAP = "commfuse_dp.integrations.bootstrap"

_EXAMPLE = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU          # MULTI_CPU with use_cpu: true on a CPU machine
num_processes: 2
mixed_precision: 'no'
use_cpu: false
commfuse:                            # read by commfuse-dp launch, removed before accelerate sees the file
  schedule: fused
  bucket_mb: 25
  param_dtype: bf16
  reduce_dtype: fp32
  exclude: ["*.experts.*", "lm_head"]"""


class LaunchError(Exception):
    """A wrong use found before anything was started: printed as one line, exit status 2."""


def _field_docs() -> list[tuple[str, str, str]]:
    """(name, default, first sentence of its docstring) of each ``CommFuseConfig`` field, read from config.py."""
    from commfuse_dp import config

    docs: dict[str, str] = {}
    try:
        tree = ast.parse(inspect.getsource(config))
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CommFuseConfig")
        body = cls.body
        for node, after in itertools.pairwise(body):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                text = " ".join(after.value.value.split()).replace("``", "")
                docs[node.target.id] = re.split(r"\.\s+(?=[A-Z])", text)[0].rstrip(".") + "."
    except (OSError, StopIteration, SyntaxError):  # no source (frozen install): names and defaults only
        pass
    out = []
    for f in dataclasses.fields(config.CommFuseConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = "none" if default is None else str(default).lower() if isinstance(default, bool) else (
            "[]" if default == () else str(default))
        out.append((f.name, shown, docs.get(f.name, "")))
    return out


def help_text() -> str:
    import textwrap

    lines = [
        "usage: commfuse-dp launch [ACCELERATE LAUNCH OPTIONS] [--config_file FILE] SCRIPT.py [SCRIPT ARGS]",
        "       commfuse-dp launch [ACCELERATE LAUNCH OPTIONS] -m MODULE [MODULE ARGS]",
        "",
        "Runs an unchanged training script with commfuse sharding, the way a deepspeed_config block in an accelerate",
        "config enables DeepSpeed: `accelerate launch` plus a `commfuse:` block in the same config file.",
        "",
        "In the workers a plain `accelerate.Accelerator()` becomes "
        + "commfuse_dp.integrations.accelerate.CommFuseAccelerator",
        "(prepare() shards the model and points the optimizer at the shards), and every plain `transformers.Trainer`",
        "gets a CommFuseCallback (it shards the model before the Trainer prepares it). Nothing else in the script",
        "changes.",
        "",
        "The config file (--config_file, else accelerate's default config if there is one) is an ordinary accelerate",
        "config plus a `commfuse:` block. The block is validated first: an unknown key or a bad value prints one",
        "line and exits with status 2 before any worker starts. The rest of the file goes to `accelerate launch`",
        "untouched; all other options are those of `accelerate launch` (see `accelerate launch --help`). Without a",
        "`commfuse:` block the defaults below apply.",
        "",
        "commfuse: keys (CommFuseConfig fields; default in brackets):",
    ]
    for name, default, doc in _field_docs():
        lines.append(f"  {name} [{default}]")
        if doc:
            lines.extend(textwrap.wrap(doc, width=108, initial_indent="      ", subsequent_indent="      "))
    lines += [
        "  Dtypes: float32/fp32, bfloat16/bf16, float16/fp16 or none. exclude: a list of fnmatch patterns of module",
        "  names, or one comma-separated string.",
        "",
        "Example accel.yaml:",
        *("  " + line for line in _EXAMPLE.splitlines()),
        "",
        "  commfuse-dp launch --config_file accel.yaml train.py --epochs 1",
        "",
        "GPU: the workers are started by accelerate's own launcher, as `accelerate launch` would.",
        "CPU (use_cpu: true or --cpu, or no GPU on the machine): `accelerate launch` itself starts one process",
        "whatever num_processes says, so commfuse-dp launch starts the num_processes ranks itself with",
        "torch.distributed.run (gloo), with ACCELERATE_USE_CPU=true and the environment accelerate gives its",
        "workers; a free port unless main_process_port is set. A Trainer script on CPU needs nothing else.",
        "",
        "The workers receive COMMFUSE_ENABLE=1 and COMMFUSE_<FIELD> variables (CommFuseConfig.from_env() reads",
        "them). With a DeepSpeed config (GPUs only) DeepSpeed partitions the model and its ZeRO collectives run on",
        "the rings. FSDP and Megatron-LM configs are refused: commfuse shards the model itself.",
        "Exit status: the workers' (the first failed rank's); 2 for a wrong config or wrong options.",
    ]
    return "\n".join(lines)


# ---- argument handling --------------------------------------------------------------------------------------------

def _wants_help(argv: list[str], parser: argparse.ArgumentParser) -> bool:
    """True when -h/--help comes before the script (after it, it is the script's own option)."""
    actions = parser._option_string_actions  # argparse's map of option strings; stable across Python versions
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("-h", "--help"):
            return True
        if not token.startswith("-") or token == "--":
            return False  # the script
        action = actions.get(token.split("=", 1)[0])
        if action is None:
            return False  # an unknown option: accelerate's parser reports it
        if "=" not in token and action.nargs != 0:
            i += 1  # its value
        i += 1
    return False


def _load_config_file(path: str) -> tuple[dict, dict]:
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


def _commfuse_config(path: str | None, block: dict):
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


def _has_accelerator() -> bool:
    import torch

    try:
        return bool(torch.accelerator.is_available())
    except (AttributeError, RuntimeError):
        return torch.cuda.is_available()


def _worker_env(cfg) -> dict[str, str]:
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


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _exit_status(exc: BaseException) -> int:
    code = getattr(exc, "returncode", None)  # subprocess.CalledProcessError (accelerate's simple launcher)
    if code is None and hasattr(exc, "get_first_failure"):  # torch.distributed.elastic ChildFailedError
        _, failure = exc.get_first_failure()
        code = failure.exitcode
    if not isinstance(code, int) or code == 0:
        return 1
    return code if code > 0 else 128 - code  # killed by a signal: the shell's convention


def _refuse_other_sharding(args: argparse.Namespace, cpu: bool) -> None:
    if getattr(args, "use_deepspeed", False) and cpu:
        raise LaunchError("the accelerate config asks for DeepSpeed, and accelerate runs DeepSpeed only on GPUs (with "
                          "use_cpu it turns DeepSpeed off). On CPU, drop the deepspeed settings (use distributed_type "
                          "MULTI_CPU with use_cpu: true: commfuse shards the model itself), or run DeepSpeed with its "
                          "own launcher and commfuse_dp.integrations.deepspeed.enable_ring_collectives(engine)")
    for flag, name in (("use_fsdp", "FSDP"), ("use_megatron_lm", "Megatron-LM"), ("tpu", "TPU")):
        if getattr(args, flag, False):
            raise LaunchError(f"the accelerate config asks for {name} (distributed_type / --{flag}); commfuse shards "
                              f"the model itself: use distributed_type MULTI_GPU (GPUs) or MULTI_CPU with "
                              f"use_cpu: true (CPU), or run `accelerate launch` without commfuse")


def _launch_cpu(args: argparse.Namespace) -> None:
    """Start ``num_processes`` CPU ranks through torch.distributed.run, as accelerate's multi-GPU launcher does."""
    import torch.distributed.run as distrib_run
    from accelerate.utils import _filter_args, prepare_multi_gpu_env

    if not args.num_processes or args.num_processes < 1:
        raise LaunchError("on CPU give the number of ranks: num_processes in the config file or --num_processes N")
    if args.num_machines is None:
        args.num_machines = 1
    if args.main_process_port is None and args.num_machines <= 1:
        args.main_process_port = 0  # prepare_multi_gpu_env: 0 means a free port
    env = prepare_multi_gpu_env(args)
    env["ACCELERATE_USE_CPU"] = "true"
    run_args = _filter_args(args, distrib_run.get_args_parser(),
                            ["--training_script", args.training_script,
                             "--training_script_args", args.training_script_args])
    with _environment(env):
        distrib_run.run(run_args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from accelerate.commands.config import default_config_file
        from accelerate.commands.launch import (
            _validate_launch_command,
            launch_command,
            launch_command_parser,
        )
    except ImportError as e:
        print(f"commfuse-dp launch needs accelerate ({e}); pip install 'commfuse_dp[accelerate]'", file=sys.stderr)
        return 2
    parser = launch_command_parser()
    if not argv or _wants_help(argv, parser):
        print(help_text())
        return 0 if argv else 2
    args = parser.parse_args(argv)  # accelerate's own options; a wrong one: its usage line, exit 2
    try:
        if args.no_python:
            raise LaunchError("--no_python: the workers must run a Python script or module for commfuse to hook "
                              "accelerate and transformers in them; drop --no_python")
        path = args.config_file
        if path is None and os.path.isfile(default_config_file):
            path = default_config_file  # what accelerate launch reads without --config_file
        accel_part, block = _load_config_file(path) if path else ({}, {})
        cfg = _commfuse_config(path, block)
        env = _worker_env(cfg)
        with tempfile.TemporaryDirectory(prefix="commfuse-launch-") as tmp:
            accel_config = None
            if path is not None:
                import yaml

                accel_config = os.path.join(tmp, "accelerate" + (".json" if path.endswith(".json") else ".yaml"))
                with open(accel_config, "w", encoding="utf-8") as f:
                    if path.endswith(".json"):
                        json.dump(accel_part, f)
                    else:
                        yaml.safe_dump(accel_part, f, sort_keys=False)
                try:
                    from accelerate.commands.config import load_config_from_file

                    load_config_from_file(accel_config)
                except (ValueError, TypeError, KeyError) as e:
                    raise LaunchError(f"{path} (the accelerate part): {' '.join(str(e).split())}".replace(
                        accel_config, path)) from None
            # The workers run the bootstrap module, which runs the user's script or module.
            target = ["-m", args.training_script] if args.module else [args.training_script]
            args.config_file = accel_config
            args.module = True
            args.training_script = BOOTSTRAP
            args.training_script_args = target + list(args.training_script_args)
            cpu = (args.cpu or bool(accel_part.get("use_cpu")) or accel_part.get("distributed_type") == "MULTI_CPU"
                   or not _has_accelerator())
            # accelerate's own validation fills the options from the config file; on a copy, because
            # launch_command validates the options it is given once more.
            checked = argparse.Namespace(**vars(args))
            if hasattr(args, "nondefault"):
                checked.nondefault = set(args.nondefault)
            with _environment(env):
                checked, _, _ = _validate_launch_command(checked)
                _refuse_other_sharding(checked, cpu)
                if cpu and not getattr(checked, "mpirun_hostfile", None):
                    _launch_cpu(checked)
                else:  # a GPU, or mpirun on CPU: accelerate starts the N processes itself
                    launch_command(args)
    except LaunchError as e:
        print(f"commfuse-dp launch: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the workers failed: their status is ours
        if type(e).__name__ in ("ChildFailedError", "CalledProcessError"):
            return _exit_status(e)
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
