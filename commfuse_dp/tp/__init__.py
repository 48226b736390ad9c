"""Sequence-parallel tensor parallelism on rings fused with the GEMM's pieces: the layer functions
(``rings.py``), the vocabulary-parallel loss (``loss.py``), the modules a Hugging Face decoder's own are replaced
with (``modules.py``) and ``tensor_parallel`` that does it (``parallelize.py``)."""

from .parallelize import FAMILIES, TensorParallel, clip_grad_norm_, tensor_parallel
from .rings import ColumnParallelFn, RowParallelFn, TPState, VocabEmbeddingFn, seq_split

__all__ = ["FAMILIES", "ColumnParallelFn", "RowParallelFn", "TPState", "TensorParallel", "VocabEmbeddingFn",
           "clip_grad_norm_", "seq_split", "tensor_parallel"]
