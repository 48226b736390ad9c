"""``commfuse-dp launch``: ``accelerate launch`` with a ``commfuse:`` block in its config file.

    commfuse-dp launch --config_file accel.yaml train.py ARGS...

The config file is an ordinary accelerate config plus a ``commfuse:`` block of :class:`CommFuseConfig` fields
(accelerate itself rejects unknown top-level keys). This command

1. reads the file, takes the ``commfuse:`` block out and validates it (``CommFuseConfig.from_dict``; an unknown
   key or a bad value prints one line naming it and exits with status 2, before anything is started);
2. writes the rest to a temporary file that accelerate reads as ``--config_file``, untouched;
3. hands the commfuse settings to the workers as ``COMMFUSE_ENABLE=1`` plus the ``COMMFUSE_<FIELD>`` variables of
   ``CommFuseConfig.to_env()`` (the parent environment reaches accelerate's workers);
4. starts each worker as ``python -m commfuse_dp.launch.worker train.py ARGS`` instead of
   ``python train.py ARGS``. The bootstrap makes a plain ``accelerate.Accelerator()`` a ``CommFuseAccelerator`` and
   ``transformers.Trainer`` (and so every Trainer class built on it) a ``CommFuseTrainer``, then runs the script
   unchanged as ``__main__`` (see ``commfuse_dp/launch/bootstrap.py``).

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

Commands that start their own workers (``trl sft ...``, ``accelerate launch ...``, ``torchrun ...``) run once
instead, and reach their workers through the environment: a ``sitecustomize.py`` folder on ``PYTHONPATH``
(``commfuse_dp/launch/commands.py`` says what runs once; ``commfuse_dp/launch/autoload`` why the
environment and what each process installs). An ``accelerate launch`` started that way comes back here
(``run_nested``) with its own options, so it starts the ranks as above.

The exit status is the workers' (the first failed rank's).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

from commfuse_dp.launch.help import _EXAMPLE, help_text  # noqa: F401  (launch.help_text, launch._EXAMPLE)

from commfuse_dp.launch.autoload_env import LAUNCH_CONFIG_ENV, pythonpath
from commfuse_dp.launch.config import LaunchError, accelerate_part_file, is_cpu, read_config

BOOTSTRAP = "commfuse_dp.launch.worker"   # runs commfuse_dp/launch/bootstrap.py's main()

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
    if getattr(args, "max_restarts", 0):
        # A restarted worker group needs a rendezvous store of its own: the static rendezvous, and a c10d one that
        # shares its store with the workers, keep the first attempt's keys, from which the next attempt's
        # init_process_group may read a dead rank's address (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if args.num_machines <= 1:
            args.standalone = True  # torchrun --standalone: a c10d rendezvous on a free local port
    run_args = _filter_args(args, distrib_run.get_args_parser(),
                            ["--training_script", args.training_script,
                             "--training_script_args", args.training_script_args])
    with _environment(env):
        distrib_run.run(run_args)


def _launch(args: argparse.Namespace, *, nested: bool = False) -> None:
    """Start the workers of ``args`` (accelerate launch's parsed options), each through the bootstrap."""
    from accelerate.commands import launch as accelerate_launch
    from accelerate.commands.config import default_config_file

    if args.no_python:
        raise LaunchError("--no_python: the workers must run a Python script or module for commfuse to hook "
                          "accelerate and transformers in them; drop --no_python")
    path = args.config_file
    if path is None and nested and os.environ.get(LAUNCH_CONFIG_ENV):
        path = os.environ[LAUNCH_CONFIG_ENV]  # the commfuse-dp launch config fills in what this launcher lacks
    if path is None and os.path.isfile(default_config_file):
        path = default_config_file  # what accelerate launch reads without --config_file
    accel_part, _, env = read_config(path, nested=nested,
                                      replicate_flag=getattr(args, "parallelism_config_dp_replicate_size", 1) or 1)
    args.parallelism_config_dp_replicate_size = 1  # it is commfuse's replicate now (in env): accelerate must not
    args.use_parallelism_config = False            # set up FSDP2's parallelism config
    env["PYTHONPATH"] = pythonpath()  # the activation: a launcher inside a worker is refused, not left to hang
    with tempfile.TemporaryDirectory(prefix="commfuse-launch-") as tmp:
        accel_config = accelerate_part_file(path, accel_part, tmp) if path is not None else None
        # The workers run the bootstrap module, which runs the user's script or module.
        target = ["-m", args.training_script] if args.module else [args.training_script]
        args.config_file = accel_config
        args.module = True
        args.training_script = BOOTSTRAP
        args.training_script_args = target + list(args.training_script_args)
        cpu = is_cpu(args, accel_part)
        # accelerate's own validation fills the options from the config file; on a copy, because
        # launch_command validates the options it is given once more.
        checked = argparse.Namespace(**vars(args))
        if hasattr(args, "nondefault"):
            checked.nondefault = set(args.nondefault)
        with _environment(env):
            try:
                checked, _, _ = accelerate_launch._validate_launch_command(checked)
            except (TypeError, ValueError) as e:  # e.g. num_processes: two, or options that conflict
                said = str(e).strip().splitlines()[0] if str(e).strip() else ""
                where = f"the accelerate part of {path} and the command line" if path else "the command line"
                kind = " (a value of the wrong type?)" if isinstance(e, TypeError) else ""
                raise LaunchError(f"accelerate refused the launch options ({where}): {type(e).__name__}: "
                                  f"{said}{kind}") from None
            _refuse_other_sharding(checked, cpu)
            if cpu and not getattr(checked, "mpirun_hostfile", None):
                _launch_cpu(checked)
            else:  # a GPU, or mpirun on CPU: accelerate starts the N processes itself (its own launch_command,
                # also where the activation replaced the module's name)
                launch_command = accelerate_launch.launch_command
                getattr(launch_command, "__wrapped__", launch_command)(args)


def _status_of(fn) -> int:
    """Run ``fn``; a LaunchError: one line, 2; the workers' failure: their status."""
    try:
        code = fn()
    except LaunchError as e:
        print(f"commfuse-dp launch: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the workers failed: their status is ours
        if type(e).__name__ in ("ChildFailedError", "CalledProcessError"):
            return _exit_status(e)
        raise
    return code or 0


def run_nested(args: argparse.Namespace) -> int:
    """accelerate's ``launch_command`` in a launcher that ``commfuse-dp launch`` ran once (``accelerate launch``,
    ``trl sft``): the same launch as ``commfuse-dp launch`` with that launcher's options (its config file, else the
    commfuse-dp launch one). See ``commfuse_dp/launch/autoload``."""
    return _status_of(lambda: _launch(args, nested=True))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from accelerate.commands.launch import launch_command_parser
    except ImportError as e:
        print(f"commfuse-dp launch needs accelerate ({e}); pip install 'commfuse_dp[accelerate]'", file=sys.stderr)
        return 2
    parser = launch_command_parser()
    if not argv:
        print("commfuse-dp launch: give the script (or -m MODULE, a console script, a launcher) to run, e.g. "
              "commfuse-dp launch --config_file accel.yaml train.py; commfuse-dp launch --help explains",
              file=sys.stderr)
        return 2
    if _wants_help(argv, parser):
        print(help_text())
        return 0
    args = parser.parse_args(argv)  # accelerate's own options; a wrong one: its usage line, exit 2

    def run() -> int | None:
        from . import commands

        command = commands.launcher_command(args, parser)
        if command is not None:  # accelerate launch, trl, torchrun: run once, the activation in its environment
            return commands.run_once(args, command)
        return _launch(args)

    return _status_of(run)


if __name__ == "__main__":
    raise SystemExit(main())
