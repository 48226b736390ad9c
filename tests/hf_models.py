"""Tiny Hugging Face models and batches shared by the tests: real model classes built from small configs."""

import torch

VOCAB = 96
SEQ = 12


def build(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM)

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = GPT2Config(**{**dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0), **overrides})
        model = GPT2LMHeadModel(cfg)
    elif kind == "llama":
        cfg = LlamaConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32),
                             **overrides})
        model = LlamaForCausalLM(cfg)
    elif kind == "bert":
        cfg = BertConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=44, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0), **overrides})
        model = BertForMaskedLM(cfg)
    else:
        raise ValueError(kind)
    return model


def batch(rank: int, step: int, micro: int = 0, size: int = 2) -> dict:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def concat(batches: list[dict]) -> dict:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


class Synthetic(torch.utils.data.Dataset):
    """``n`` random token rows of length SEQ (seeded), each its own label: the launch tests' training data."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}
