"""Saving and loading a commfuse-sharded model: every rank's shards, nothing kept from rank 0 alone.

Two kinds of output, both built on ``torch.distributed.checkpoint`` (DCP) and its state-dict helpers, so nothing
here gathers by hand:

* **Sharded state, to resume** -- :func:`save_sharded` / :func:`load_sharded`: the models' and optimizers' DTensor
  shards of every rank, written by every rank in parallel into one DCP folder
  (``get_model_state_dict`` / ``get_optimizer_state_dict`` keyed by parameter names, so optimizer state belongs to a
  name, not to a position), and each rank's error-feedback residuals (``feedback.py``) under its rank. DCP reshards
  on load: the folder can be read back by another world size (with error feedback on: by the same world size).
* **A consolidated Hugging Face folder** -- :func:`save_pretrained`: every rank takes part in gathering the full
  parameters (``StateDictOptions(full_state_dict=True, cpu_offload=True)``: the full copy exists on rank 0 only, in
  CPU memory), and rank 0 writes it with the model's own ``save_pretrained`` (config, safetensors, tied weights
  and weight-name conversions handled by transformers), so ``from_pretrained`` loads it in one process.
  :func:`full_state_dict` is the gather alone (what ``Accelerator.get_state_dict`` returns for such a model), and
  :func:`load_full_state_dict` the reverse: a full state dict present on every rank, each keeping its own slices.

Every function here is collective: call it on every rank of the model's process group, in the same order.

The modules: ``hf.py`` (Hugging Face folders, with ``slices.py``: safetensors slice by slice), ``state.py``
(sharded DCP state), ``saver.py`` (``AsyncSaver``), ``markers.py`` (completion and integrity).
"""

from .common import _unwrap, is_sharded  # noqa: F401  (_unwrap: for the integrations)
from .hf import (full_state_dict, load_full_state_dict, load_hf_weights, load_pretrained_weights, mark_initialised,
                 save_pretrained)
from .markers import CheckpointError, is_complete, latest_complete, mark_complete, unmark_complete, verify
from .saver import AsyncSaver
from .state import load_sharded, optimizer_model, save_sharded, unwrap_optimizer

__all__ = ["CheckpointError", "is_sharded", "is_complete", "mark_complete", "unmark_complete", "latest_complete",
           "full_state_dict", "load_full_state_dict", "load_hf_weights", "load_pretrained_weights",
           "mark_initialised", "save_pretrained", "save_sharded", "AsyncSaver", "load_sharded", "verify",
           "optimizer_model", "unwrap_optimizer"]
