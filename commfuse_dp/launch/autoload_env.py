"""Where the activation of ``commfuse-dp launch`` lives and the variable it reads: what both sides share.

``commfuse-dp launch`` (``commfuse_dp/launch/__init__.py``, ``commfuse_dp/launch/commands.py``) puts :func:`folder` first
on ``PYTHONPATH`` and names its config file in :data:`LAUNCH_CONFIG_ENV`; the activation in that folder
(``commfuse_dp/launch/autoload``) sends a nested ``accelerate launch`` back to ``commfuse_dp.launch``. This module
imports neither, so both import it. It is not in the autoload folder itself: every module there would be
importable by its bare name in every process beneath the launch.
"""

from __future__ import annotations

import os

LAUNCH_CONFIG_ENV = "COMMFUSE_LAUNCH_CONFIG"  # the accelerate part of the commfuse-dp launch config file


def folder() -> str:
    """The folder that goes first on ``PYTHONPATH`` (``autoload``, which holds ``sitecustomize.py``)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "autoload")


def pythonpath(environ=None) -> str:
    """``PYTHONPATH`` with :func:`folder` first (once)."""
    current = (os.environ if environ is None else environ).get("PYTHONPATH", "")
    rest = [p for p in current.split(os.pathsep) if p and os.path.abspath(p) != folder()]
    return os.pathsep.join([folder(), *rest])
