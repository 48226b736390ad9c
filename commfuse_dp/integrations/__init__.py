"""Integrations of commfuse_dp with stock FSDP2 (and, as they land, accelerate, transformers and DeepSpeed).

Installed as ``commfuse_dp.integrations``; each module imports its framework only when it is imported itself.
"""
