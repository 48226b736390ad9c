"""The bench's model and batch: a Llama-style decoder built from a config (``MODEL_DEFAULTS``, each a ``bench``
option), and each rank's batch of random tokens."""

from __future__ import annotations

import torch

MODEL_DEFAULTS = (("hidden", 512), ("intermediate", 1408), ("layers", 4), ("heads", 8), ("kv-heads", 0),
                  ("vocab", 4096), ("seq", 256), ("batch", 2), ("min-fuse-numel", 1 << 16))


def default_shape():
    """The bench's default model and batch (``MODEL_DEFAULTS``) as the arguments ``model_config`` and ``make_batch``
    read."""
    from types import SimpleNamespace

    return SimpleNamespace(**{name.replace("-", "_"): value for name, value in MODEL_DEFAULTS})


def model_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads or args.heads, max_position_embeddings=args.seq,
                       tie_word_embeddings=False)


def build_model(args):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(model_config(args))


def make_batch(args, rank):
    gen = torch.Generator().manual_seed(1234 + rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    return {"input_ids": ids, "labels": ids}
