"""Runs one of accelerate's own test scripts (``accelerate/test_utils/scripts/*.py``) unchanged, with one change
around it: ``torch.testing.assert_close`` of a DTensor against a plain tensor compares the DTensor's full value
(``full_tensor()``) instead of raising ``TypeError: Comparing a DTensor to a non-DTensor is ambiguous``, and each
such comparison is printed as ``DTENSOR-VS-PLAIN <file>:<line>``; ``torch.allclose`` with a DTensor (DTensor has
no rule for ``aten.allclose``) compares full values too and prints ``DTENSOR-ALLCLOSE <file>:<line>``. Those checks compare a sharded parameter with
a copy from an unsharded model, which stock FSDP2 fails the same way; everything else the script checks runs
as written. Used by tests/test_accelerate_scripts.py:

    commfuse-dp launch --config_file cfg.yaml tests/accelerate_scripts_wrapper.py <accelerate script> [args]
"""

import runpy
import sys
import traceback

import torch
from torch.distributed.tensor import DTensor

_assert_close = torch.testing.assert_close
_allclose = torch.allclose


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def assert_close(actual, expected, *args, **kwargs):
    if isinstance(actual, DTensor) != isinstance(expected, DTensor):
        caller = traceback.extract_stack(limit=2)[0]
        print(f"DTENSOR-VS-PLAIN {caller.filename.rsplit('/', 1)[-1]}:{caller.lineno}", flush=True)
        actual, expected = _full(actual), _full(expected)
    return _assert_close(actual, expected, *args, **kwargs)


def allclose(input, other, *args, **kwargs):
    if isinstance(input, DTensor) or isinstance(other, DTensor):  # DTensor has no rule for aten.allclose
        caller = traceback.extract_stack(limit=2)[0]
        print(f"DTENSOR-ALLCLOSE {caller.filename.rsplit('/', 1)[-1]}:{caller.lineno}", flush=True)
        input, other = _full(input), _full(other)
    return _allclose(input, other, *args, **kwargs)


if __name__ == "__main__":
    torch.testing.assert_close = assert_close
    torch.allclose = allclose
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
