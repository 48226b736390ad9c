"""commfuse_dp's activation hook: ``commfuse-dp launch`` puts this folder first on ``PYTHONPATH``.

Python imports ``sitecustomize`` at start-up in every process, so every Python process started beneath
``commfuse-dp launch`` (launchers, their workers, their workers' workers) runs this. With ``COMMFUSE_ENABLE=1`` it
calls ``commfuse_dp.launch.autoload.activate()`` (see that module); then it runs the ``sitecustomize`` this
one hides, if there is one further along ``sys.path``. It never stops the process: a failure is one line on stderr.
"""

import os
import sys


def _activate() -> None:
    if os.environ.get("COMMFUSE_ENABLE", "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    try:
        from commfuse_dp.launch.autoload import activate
    except Exception as e:  # another Python than the launcher's, without commfuse_dp: say so, run without it
        print(f"commfuse_dp: COMMFUSE_ENABLE is set but {sys.executable} cannot import commfuse_dp "
              f"({type(e).__name__}: {e}); this process runs without commfuse", file=sys.stderr)
        return
    activate()


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` (the one this folder, first on PYTHONPATH, hides)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    _activate()
finally:
    _chain()
