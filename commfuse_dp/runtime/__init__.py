"""The runtime under the fused ops: the link scheduler (``link.py``, ``engine.py``), the per-step state
(``step.py``, ``group.py``), the schedules (``schedule.py``: fused elastic and lockstep; ``slicing.py``), the layer
rings and their exchanges (``layer_rings.py``, ``exchange.py``) and the replica exchange of HSDP (``replicas.py``).
It never imports the ops (``commfuse_dp/fused``), which are built on it."""

from __future__ import annotations

