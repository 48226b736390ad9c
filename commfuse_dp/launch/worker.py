"""``python -m commfuse_dp.launch.worker SCRIPT.py [ARGS...]`` (or ``-m MODULE [ARGS...]``): what
``commfuse-dp launch`` starts each worker with. It runs :func:`commfuse_dp.launch.bootstrap.main`.

A module of its own: the activation hook (``commfuse_dp/launch/autoload``) imports ``commfuse_dp.launch.bootstrap``
before the worker's main module runs, so ``python -m commfuse_dp.launch.bootstrap`` would execute that file a
second time as ``__main__``, a copy with its own globals beside the imported module (runpy warns: "found in
sys.modules ... this may result in unpredictable behaviour"). Through this module the bootstrap exists once.
"""

from commfuse_dp.launch.bootstrap import main

if __name__ == "__main__":
    main()
