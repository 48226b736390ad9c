"""Test probe for tests/test_launch_nested.py: every Trainer worker reports what it trained, one JSON per rank.

tests/test_launch_nested.py puts this folder on ``PYTHONPATH`` with ``LAUNCH_PROBE_OUT=DIR``. In a distributed worker
(``RANK`` set) a ``Probe`` callback is added to ``transformers.trainer.DEFAULT_CALLBACKS`` when transformers.trainer
is imported; at the end of training it writes ``DIR/rank<R>.json``: the world size, the parameter types (DTensor
when commfuse sharded the model), the Trainer's callbacks and its per-step losses in full precision. It observes
unchanged commands (``trl sft``, ``torchrun -m trl.scripts.sft``); under ``commfuse-dp launch`` the activation's own
``sitecustomize`` runs first and then this one (the one it hides on ``sys.path``). ``LAUNCH_PROBE_EXIT_DRAIN=1``
(the DDP references): a drain at exit, below.
"""

import json
import os


def _patch(module) -> None:
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def on_train_end(self, args, state, control, model=None, **kwargs):
            import torch.distributed as dist

            trainer = getattr(self, "trainer", None)
            params = list(model.parameters())
            logs = [e for e in state.log_history if "loss" in e and "step" in e]
            report = {
                "rank": int(os.environ["RANK"]), "world_size": args.world_size,
                "dist_world_size": dist.get_world_size() if dist.is_initialized() else None,
                "param_types": sorted({type(p.data).__name__ for p in params}),
                "model_class": type(model).__name__,
                "callbacks": [type(c).__name__ for c in trainer.callback_handler.callbacks] if trainer else None,
                "losses": [e["loss"] for e in logs], "grad_norms": [e.get("grad_norm") for e in logs],
                "steps": [e["step"] for e in logs], "hops": [e.get("commfuse/hops") for e in logs],
            }
            with open(os.path.join(os.environ["LAUNCH_PROBE_OUT"], f"rank{report['rank']}.json"), "w") as f:
                json.dump(report, f)

    module.DEFAULT_CALLBACKS.append(Probe)
    init = module.Trainer.__init__

    def __init__(self, *args, **kwargs):  # the probe learns its Trainer (for the callback list)
        init(self, *args, **kwargs)
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, Probe):
                cb.trainer = self

    module.Trainer.__init__ = __init__


class _Hook:
    """Patch transformers.trainer right after its import (self-contained: no commfuse_dp import)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "transformers.trainer":
            return None
        import importlib.util
        import sys

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


if os.environ.get("LAUNCH_PROBE_OUT") and "RANK" in os.environ:
    import sys

    sys.meta_path.insert(0, _Hook())
    if os.environ.get("LAUNCH_PROBE_EXIT_DRAIN") == "1":
        # Only for the stock DDP reference runs: plain torch + gloo can abort at interpreter exit after the run is
        # done ("terminate called without an active exception": a gloo worker frees a finished work while the
        # interpreter finalizes; a `torchrun -m trl.scripts.sft` reference run was lost to it in CI). The
        # same 0.1 s release of the GIL at exit that commfuse's first gloo ring registers ([Note: the abort at
        # exit], commfuse_dp/ring/topology.py), registered first so it runs last. The commfuse runs do not get it:
        # their clean exit is the product's own.
        import atexit
        import time

        atexit.register(time.sleep, 0.1)
