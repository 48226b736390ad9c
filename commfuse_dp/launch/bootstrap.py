"""Worker entry point of ``commfuse-dp launch``: turns commfuse on for an unchanged script, then runs it.

    python -m commfuse_dp.launch.worker SCRIPT.py [ARGS...]
    python -m commfuse_dp.launch.worker -m MODULE [ARGS...]

(``commfuse_dp/launch/worker.py`` calls :func:`main`; this module is imported by the activation hook first, so it is
not run as ``__main__`` itself.)

``commfuse-dp launch`` starts every worker this way (accelerate launch's ``--module`` option, or
``torch.distributed.run -m`` on CPU). Without ``COMMFUSE_ENABLE=1`` (also true/yes/on) in the environment it only
runs the script. With it, before the script runs:

1. The config is read from the ``COMMFUSE_*`` variables as the integrations will read it
   (``commfuse_dp.integrations.attach.resolve_config(None)``, i.e. ``CommFuseConfig.from_env()``); a wrong one
   stops the worker here with one line and exit status 2.
2. ``accelerate.Accelerator`` becomes ``commfuse_dp.integrations.accelerate.CommFuseAccelerator`` (a subclass;
   with no ``commfuse=`` argument it reads the same variables): the attribute is replaced on the ``accelerate``
   package and on every already imported ``accelerate.*`` module that holds the original class under that name
   (``accelerate.accelerator``). So ``from accelerate import Accelerator; Accelerator()`` in the script, run
   afterwards, builds a CommFuseAccelerator.
3. When ``transformers.trainer`` is imported (now or later: an import hook on that one module, so that scripts
   without a Trainer do not pay for importing it), its ``Trainer`` becomes ``CommFuseTrainer``
   (``commfuse_dp.integrations.transformers``: ``class CommFuseTrainer(CommFuseTrainerMixin, Trainer)``), on that
   module and on the ``transformers`` package, before any other module can subclass it. So ``Trainer(...)`` in the
   script, and every Trainer class defined afterwards on top of it (TRL's ``SFTTrainer``, ``DPOTrainer``, ...,
   transformers' ``Seq2SeqTrainer``), is a ``CommFuseTrainer``: each one gets a ``CommFuseCallback()`` (which reads
   the ``COMMFUSE_*`` variables) bound to it, or binds the one the script passed in ``callbacks=``, and saves and
   loads every rank's shards -- the same path as a script that writes ``CommFuseTrainer`` itself. That module's
   own ``Accelerator`` name is set back to accelerate's original class: a Trainer is sharded by the callback, not
   by a CommFuseAccelerator as well (the model reaches ``attach`` once); the callback then makes that Accelerator
   shard the models the Trainer prepares for evaluation (``commfuse_dp/integrations/accelerate.py``, ``FrozenModels``).
4. The script runs as ``__main__`` with ``runpy`` (``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT.py ARGS``
   would set them; ``-m``: as ``python -m MODULE ARGS``).

The launcher attaches nothing itself: the models of such a script go onto the rings through
``commfuse_dp.integrations.attach.attach``, called by ``CommFuseAccelerator.prepare`` or ``CommFuseCallback``, as in a
script that uses those classes itself.

A script that passes its own ``CommFuseCallback(cfg)`` to a Trainer keeps it (its config is used, the launcher's
``COMMFUSE_*`` variables are not); a script that already uses ``CommFuseTrainer`` or ``commfuse_trainer(...)`` gets
the same class (the mixin is never applied twice).
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys

_ENABLE = "COMMFUSE_ENABLE"
_TRUE = ("1", "true", "yes", "on")
_TRAINER_MODULE = "transformers.trainer"
_original_accelerator: type | None = None  # accelerate's own class, once install_accelerator() replaced it


def enabled(environ=None) -> bool:
    return (os.environ if environ is None else environ).get(_ENABLE, "").strip().lower() in _TRUE


def install_accelerator() -> type:
    """Step 2: ``accelerate.Accelerator`` (and ``accelerate.*`` modules holding it) -> ``CommFuseAccelerator``."""
    import accelerate
    import accelerate.accelerator

    from commfuse_dp.integrations.accelerate import CommFuseAccelerator

    global _original_accelerator
    original = accelerate.accelerator.Accelerator
    if original is CommFuseAccelerator:
        return _original_accelerator or original
    for name, module in list(sys.modules.items()):
        if (name == "accelerate" or name.startswith("accelerate.")) and module is not None \
                and vars(module).get("Accelerator") is original:
            module.Accelerator = CommFuseAccelerator
    _original_accelerator = original
    return original


def _patch_trainer_module(module) -> None:
    from commfuse_dp.integrations.transformers import CommFuseTrainerMixin, commfuse_trainer

    original = module.Trainer
    if not issubclass(original, CommFuseTrainerMixin):
        patched = commfuse_trainer(original, "CommFuseTrainer")
        module.Trainer = patched
        package = sys.modules.get("transformers")
        # transformers' lazy package caches a name once looked up (importing the integration looks up Trainer)
        if package is not None and vars(package).get("Trainer") is original:
            package.Trainer = patched
    if _original_accelerator is not None and "Accelerator" in vars(module):
        module.Accelerator = _original_accelerator  # the Trainer keeps accelerate's Accelerator; the callback shards


class _RunAfterExec:
    """Loader wrapper: the real loader executes the module, then ``after(module)`` runs."""

    def __init__(self, loader, after) -> None:
        self._loader, self._after = loader, after

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._after(module)


class _AfterImport:
    """``sys.meta_path`` finder that runs ``after(module)`` right after the first import of one module."""

    def __init__(self, fullname: str, after) -> None:
        self.fullname, self.after = fullname, after

    def find_spec(self, fullname, path, target=None):
        if fullname != self.fullname:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the other finders' answer (an editable install's too)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RunAfterExec(spec.loader, self.after)
        return spec


def after_import(fullname: str, after) -> None:
    """Run ``after(module)`` once ``fullname`` is imported: now if it already is, else right after its import."""
    module = sys.modules.get(fullname)
    if module is not None:
        after(module)
    elif not any(isinstance(f, _AfterImport) and f.fullname == fullname and f.after == after
                 for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(fullname, after))


def install_trainer_callback() -> None:
    """Step 3: ``transformers.Trainer`` becomes ``CommFuseTrainer`` (see the module docstring)."""
    after_import(_TRAINER_MODULE, _patch_trainer_module)


def _usage() -> str:
    return ("usage: python -m commfuse_dp.launch.worker SCRIPT.py [ARGS...] | -m MODULE [ARGS...] "
            "(started by `commfuse-dp launch`; see `commfuse-dp launch --help`)")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(_usage(), file=sys.stderr if not argv else sys.stdout)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if enabled():
        from commfuse_dp.integrations.attach import resolve_config

        try:
            resolve_config(None)  # what CommFuseAccelerator and CommFuseCallback will read: fail here, in one line
        except ValueError as e:
            print(f"commfuse_dp bootstrap: {' '.join(str(e).split())}", file=sys.stderr)
            raise SystemExit(2) from None
        install_accelerator()
        if importlib.util.find_spec("transformers") is not None:
            install_trainer_callback()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy sets sys.argv[0] to the module's file
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        if not os.path.isfile(script):
            print(f"commfuse_dp bootstrap: {script}: no such file", file=sys.stderr)
            raise SystemExit(2)
        sys.argv = [script, *argv[1:]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
