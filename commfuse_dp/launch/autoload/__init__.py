"""The activation that travels through the environment: how ``commfuse-dp launch`` reaches workers it does not start.

``commfuse-dp launch`` gives every process it starts ``COMMFUSE_ENABLE=1``, the ``COMMFUSE_<FIELD>`` variables and
this folder first on ``PYTHONPATH``. The folder holds a ``sitecustomize.py``, which Python imports at start-up in every
process (the way ``opentelemetry-instrument`` reaches the processes of an unchanged command), and so in every Python
process beneath the command: a launcher, the workers it starts, the workers of a launcher that a launcher starts
(``trl sft`` runs ``accelerate launch``). ``sitecustomize`` calls :func:`activate`, then runs any ``sitecustomize``
further along ``sys.path`` that it hides. Why this and not a wrapper around each worker: a console script such as
``trl sft`` builds its worker command inside accelerate (``trl/cli/accelerate_launcher.py`` calls accelerate's
``launch_command`` in-process, whose simple launcher runs ``python trl/scripts/sft.py``), so the only thing that
reaches those workers unchanged is the environment. A ``.pth`` file would do the same but must sit in site-packages,
i.e. change the installation for every run; ``PYTHONPATH`` is this run's alone.

:func:`activate` does, by the process's role:

* A distributed worker (``RANK`` and ``WORLD_SIZE`` in its environment, as torchrun and accelerate's launchers set
  them): the bootstrap's hooks, installed lazily so that a worker that never imports accelerate or transformers
  pays nothing: ``accelerate.Accelerator`` becomes ``CommFuseAccelerator`` when accelerate is imported, and
  ``transformers.Trainer`` becomes ``CommFuseTrainer`` when ``transformers.trainer`` is imported, so every Trainer
  class built on it is one (``commfuse_dp/launch/bootstrap.py``). A launcher started
  inside a worker (``accelerate launch``, torchrun) is refused with one line and exit status 2: its workers would
  inherit this worker's ``RANK``/``WORLD_SIZE`` and rendezvous variables, so they would not join this run (with an
  accelerate config, its simple launcher sets ``MASTER_PORT=29500`` while torchrun's ``TORCHELASTIC_USE_AGENT_STORE``
  makes rank 0 a client of a store nobody hosts: a hang), and without one they would run unsharded.
* Any other process (a launcher that ``commfuse-dp launch`` ran once): accelerate's ``launch_command`` (what
  ``accelerate launch`` and ``trl sft``/``dpo``/... call) becomes ``commfuse_dp.launch.run_nested``: the launch of
  ``commfuse-dp launch`` itself, with that launcher's own options and config file, the ``commfuse-dp launch``
  config file filling in what they do not say (``COMMFUSE_LAUNCH_CONFIG``). On CPU it therefore starts
  ``num_processes`` ranks instead of accelerate's one; on GPUs accelerate's launcher starts them as usual.
"""

from __future__ import annotations

import os
import sys

from commfuse_dp.launch import bootstrap


def is_worker(environ=None) -> bool:
    env = os.environ if environ is None else environ
    return "RANK" in env and "WORLD_SIZE" in env


def _install_accelerator(module) -> None:
    bootstrap.install_accelerator()


def _refuse_nested_launch(launcher: str) -> None:
    command = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    print(f"commfuse-dp launch: {launcher} was started inside rank {os.environ.get('RANK')} of "
          f"{os.environ.get('WORLD_SIZE')} (by `{command}`): its workers would not join this run (a hang or an "
          f"unsharded run). Give the launcher as the command itself, e.g. `commfuse-dp launch --config_file cfg.yaml "
          f"trl sft ...` or `... accelerate launch train.py` or `... torchrun --nproc_per_node N train.py`, which "
          f"runs it once; or give commfuse-dp launch the Python script it runs", file=sys.stderr)
    raise SystemExit(2)


def _guard_accelerate_launch(module) -> None:
    def launch_command(args):
        _refuse_nested_launch("`accelerate launch`")
    module.launch_command = launch_command


def _guard_torchrun(module) -> None:
    def run(args):
        _refuse_nested_launch("torchrun (torch.distributed.run)")
    module.run = run


def _redirect_accelerate_launch(module) -> None:
    original = getattr(module.launch_command, "__wrapped__", module.launch_command)

    def launch_command(args):
        from commfuse_dp.launch import run_nested

        code = run_nested(args)
        if code:
            raise SystemExit(code)

    launch_command.__wrapped__ = original
    module.launch_command = launch_command


def activate(environ=None) -> None:
    """Install the hooks of this process's role (see the module docstring). Only imports are hooked here."""
    if not bootstrap.enabled(environ):
        return
    if is_worker(environ):
        bootstrap.after_import("accelerate", _install_accelerator)
        bootstrap.install_trainer_callback()
        bootstrap.after_import("accelerate.commands.launch", _guard_accelerate_launch)
        bootstrap.after_import("torch.distributed.run", _guard_torchrun)
    else:
        bootstrap.after_import("accelerate.commands.launch", _redirect_accelerate_launch)
