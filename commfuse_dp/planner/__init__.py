"""The planner: ``commfuse-dp plan`` (``cli.py``), and what ``CommFuseConfig``'s ``"auto"`` settings
choose (``choose.py``), both from the same plays of the schedules (``plays.py``) on a model of one rank
(``costs.py``).
"""
