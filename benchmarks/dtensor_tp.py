"""The peer of fused TPSP: DTensor's sequence-parallel tensor parallelism as torchtitan applies it
(``parallelize_module`` with ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel`` and
``PrepareModuleInput``), on a Hugging Face Llama-family model. Its all-gathers and reduce-scatters are the process
group's collectives, each waited for where it is issued.

The model is called with ``position_ids`` (the whole sequence's positions): between the blocks its hidden states
are this rank's rows of the sequence, from which the model would otherwise number the positions. The lm_head's
logits stay split over the vocabulary (a DTensor), and the model's own loss runs on them inside
``torch.distributed.tensor.parallel.loss_parallel()`` (forward and backward), as torchtitan's loss does.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)


def dtensor_sequence_parallel(model, mesh) -> None:
    """Apply torchtitan's TP plan with sequence parallelism to ``model`` (a Llama-family causal LM) over the 1-D
    ``mesh``, in place."""
    base = model.get_decoder()
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for layer in base.layers:
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
