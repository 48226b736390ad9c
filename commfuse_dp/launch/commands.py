"""What ``commfuse-dp launch`` does with the command it is given: each rank runs it, or it runs once.

* A Python file, ``-m MODULE``, or the console script of a Python package (``my-train``, found on ``PATH``): the N
  ranks run it, each through ``commfuse_dp.launch.worker`` (``commfuse_dp/launch/__init__.py``).
* A launcher, i.e. a command that starts its own workers: ``accelerate`` (``accelerate launch ...``), ``trl``
  (``trl sft|dpo|grpo|... ...``, which run ``accelerate launch`` in-process), ``torchrun``, or ``-m`` one of
  :data:`LAUNCHER_MODULES`: it runs ONCE (:func:`run_once`), with the activation in its environment
  (``commfuse_dp/launch/autoload``): its workers are sharded. Run once per rank instead, each copy would
  start workers of its own that do not join the run (a hang or an unsharded run).

  - ``accelerate launch`` (also inside ``trl``) becomes the launch of ``commfuse-dp launch`` with its own options;
    what they do not say comes from the ``commfuse-dp launch`` config file. On CPU it therefore starts
    ``num_processes`` ranks (plain ``accelerate launch`` starts one), on GPUs accelerate's launcher starts them.
  - ``torchrun`` starts its own ``--nproc_per_node`` workers; with ``use_cpu`` in the config they get
    ``ACCELERATE_USE_CPU=true`` as commfuse-dp launch's own CPU ranks do. A world size that differs from the config
    file's ``num_processes`` is refused (exit 2): say the same number in both, or drop ``num_processes``.
  - Options of ``accelerate launch`` other than ``--config_file`` before a launcher are refused: give them to the
    launcher itself.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile

from commfuse_dp.launch.autoload_env import LAUNCH_CONFIG_ENV, pythonpath
from commfuse_dp.launch.config import LaunchError, accelerate_part_file, is_cpu, read_config

LAUNCHERS = ("accelerate", "trl", "torchrun")
LAUNCHER_MODULES = ("torch.distributed.run", "accelerate.commands.launch", "accelerate.commands.accelerate_cli",
                    "trl.cli", "trl.cli.main")
_OWN_OPTIONS = {"config_file", "training_script", "training_script_args", "module", "nondefault"}


def _is_python_file(path: str) -> bool:
    if path.endswith(".py"):
        return True
    try:
        with open(path, "rb") as f:
            first = f.readline(256)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def launcher_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str] | None:
    """The command line to run once when ``args`` names a launcher, else None (each rank runs the target). A
    console script that is not a launcher is resolved on ``PATH`` in place (``args.training_script``)."""
    target, rest = args.training_script, list(args.training_script_args)
    if args.module:
        if target not in LAUNCHER_MODULES:
            return None
        command, name = [sys.executable, "-m", target, *rest], target
    else:
        path = target if os.path.isfile(target) else shutil.which(target)
        if path is None:
            raise LaunchError(f"{target}: no such file, and no command of that name on PATH; give a Python script, "
                              f"-m MODULE, a console script, or one of the launchers {list(LAUNCHERS)}")
        name = os.path.basename(path)
        if name not in LAUNCHERS or path.endswith(".py"):
            if not _is_python_file(path):
                raise LaunchError(f"{target} ({path}) is not a Python script: commfuse-dp launch runs a Python "
                                  f"script, -m MODULE, a Python console script, or one of the launchers "
                                  f"{list(LAUNCHERS)}")
            args.training_script = path
            return None
        command = [path, *rest]
    defaults = vars(parser.parse_args([target]))
    given = sorted(k for k, v in vars(args).items() if k not in _OWN_OPTIONS and defaults.get(k) != v)
    if given:
        raise LaunchError(f"--{given[0]} before the launcher {name}: commfuse-dp launch reads only --config_file "
                          f"when the command is a launcher; give --{given[0]} to {name} itself (or put it in the "
                          f"config file)")
    return command


def _torchrun_world_size(command: list[str]) -> int | None:
    """nproc_per_node x nnodes of a torchrun command line, when both are plain numbers."""
    import torch.distributed.run as distrib_run

    rest = command[3:] if command[1:2] == ["-m"] else command[1:]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed = distrib_run.get_args_parser().parse_args(rest)
    except SystemExit:
        return None  # torchrun itself reports its wrong options
    nproc, nnodes = str(parsed.nproc_per_node), str(parsed.nnodes).split(":")
    if not nproc.isdigit() or len(set(nnodes)) != 1 or not nnodes[0].isdigit():
        return None  # "auto", "gpu", an elastic range: torchrun decides
    return int(nproc) * int(nnodes[0])


def run_once(args: argparse.Namespace, command: list[str]) -> int:
    """Run a launcher once with the activation in its environment; its exit status is ours."""
    from accelerate.commands.config import default_config_file

    path = args.config_file
    if path is None and os.path.isfile(default_config_file):
        path = default_config_file
    accel_part, _, env = read_config(path)
    cpu = is_cpu(args, accel_part)
    is_torchrun = os.path.basename(command[0]) == "torchrun" or command[1:3] == ["-m", "torch.distributed.run"]
    if is_torchrun and accel_part.get("num_processes"):
        world = _torchrun_world_size(command)
        if world is not None and world != accel_part["num_processes"]:
            raise LaunchError(f"{path} says num_processes: {accel_part['num_processes']} but the torchrun command "
                              f"starts {world} workers (--nproc_per_node x --nnodes); give torchrun "
                              f"--nproc_per_node {accel_part['num_processes']}, or drop num_processes")
    env["PYTHONPATH"] = pythonpath()
    if cpu:
        env["ACCELERATE_USE_CPU"] = "true"  # what commfuse-dp launch gives its own CPU ranks (torchrun's workers)
    with tempfile.TemporaryDirectory(prefix="commfuse-launch-") as tmp:
        if path is not None:
            env[LAUNCH_CONFIG_ENV] = accelerate_part_file(path, accel_part, tmp)
        proc = subprocess.run(command, env={**os.environ, **env}, check=False)
    code = proc.returncode
    return code if code >= 0 else 128 - code
