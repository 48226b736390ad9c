"""Fine-tuning recipes for Hugging Face models with commfuse_dp, installed as ``commfuse_dp.recipes``.

Run them from a checkout (``torchrun --nproc_per_node 2 commfuse_dp/recipes/finetune_clm.py ...``) or installed
(``torchrun --nproc_per_node 2 -m commfuse_dp.recipes.finetune_clm ...``); each file's docstring has its commands.
"""
