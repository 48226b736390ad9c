"""Sequence-parallel tensor parallelism on rings fused with the GEMM's pieces: the layer functions
(``rings.py``), the vocabulary-parallel loss (``loss.py``), the modules a Hugging Face decoder's own are replaced
with (``modules.py``), ``tensor_parallel`` that does it (``parallelize.py``), and transformers' plans and
``DistributedConfig`` read against it (``plan.py``)."""

from .parallelize import FAMILIES, TensorParallel, clip_grad_norm_, tensor_parallel
from .plan import check_plan, from_distributed_config
from .rings import ColumnParallelFn, RowParallelFn, TPState, VocabEmbeddingFn, seq_split

__all__ = ["FAMILIES", "ColumnParallelFn", "RowParallelFn", "TPState", "TensorParallel", "VocabEmbeddingFn",
           "check_plan", "clip_grad_norm_", "from_distributed_config", "seq_split", "tensor_parallel"]
