"""What ``CommFuseConfig``'s ``"auto"`` settings become for one model on its ranks.

``schedule="auto"`` (the default) runs the fused schedule only where the planner's plays (``plays.py``, the same
that ``commfuse-dp plan`` prints) predict it faster than the peer, stock FSDP2 as it runs on a GPU
(``schedule="fsdp2"``), by at least ``MARGIN``; elsewhere the model runs the peer's shape. ``piece_shards="auto"``
takes the piece width with the shortest predicted fused step (on a GPU thin GEMM pieces cost time; on a CPU
they do not, and 1 is kept). The plays read:

- the model's shapes: its transformers config (hidden, intermediate and vocabulary sizes, layers, heads);
- the ranks of the shard group;
- the device: a CUDA device plays the GEMM-piece cost and host time measured on an H200 (the host issuing ahead of
  the device), bf16/fp16 at 400 TFLOP/s and fp32 at 50; the CPU plays whole-GEMM pieces, this library's host time
  and FSDP2's copies into and out of its flat buffers on the computing thread (both measured on this project's
  2-core machines), at 50 GFLOP/s per rank;
- the link: ``CommFuseConfig.link_gbps`` where given; else NVLink's 450 GB/s on CUDA inside one node, 50 GB/s
  across nodes, and 1.25 GB/s (10 Gb Ethernet) on CPU;
- the tokens of one rank's step: ``CommFuseConfig.tokens_per_rank`` where given, else the model's context
  (``max_position_embeddings``, at most 4096).

The choice depends on nothing measured at run time, so every rank makes the same one (``shard()`` checks that the
ranks agree after it). ``describe(model)`` prints it with its predictions; an explicit setting is kept as given.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from .config import CommFuseConfig
from .plan import MARGIN, decide
from .costs import CPU_HOST_FIT, H200_HOST_FIT, H200_PIECE_FIT, Cluster, peer_host_on_cpu, placed, units_for

__all__ = ["MARGIN", "Choice", "choose", "decide", "resolve"]

DEFAULT_TOKENS_CAP = 4096


@dataclass(frozen=True)
class Choice:
    """What ``"auto"`` became, and why (``describe`` prints it)."""

    schedule: str
    piece_shards: int
    reason: str
    predicted_s: dict[str, float] = field(default_factory=dict)  # step seconds per candidate
    machine: str = ""  # the cluster the plays ran on, in words

    def as_dict(self) -> dict:
        return {"schedule": self.schedule, "piece_shards": self.piece_shards, "reason": self.reason,
                "predicted_s": dict(self.predicted_s), "machine": self.machine}


def model_shape(model: nn.Module) -> tuple[int, int, int, int, int, int] | None:
    """(hidden, intermediate, layers, heads, kv heads, vocab) from a transformers config, or None."""
    c = getattr(model, "config", None)
    if c is None:
        return None
    get = lambda *names: next((getattr(c, n) for n in names if isinstance(getattr(c, n, None), int)), None)  # noqa
    hidden, layers = get("hidden_size", "n_embd", "d_model"), get("num_hidden_layers", "n_layer", "num_layers")
    heads, vocab = get("num_attention_heads", "n_head", "num_heads"), get("vocab_size")
    if None in (hidden, layers, heads, vocab) or min(hidden, layers, heads, vocab) < 1:
        return None
    intermediate = get("intermediate_size", "n_inner", "d_ff") or 4 * hidden
    return hidden, intermediate, layers, heads, get("num_key_value_heads") or heads, vocab


def tokens_of(model: nn.Module, config: CommFuseConfig) -> int:
    if config.tokens_per_rank is not None:
        return config.tokens_per_rank
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(context, DEFAULT_TOKENS_CAP) if isinstance(context, int) and context > 0 else 2048


def machine(config: CommFuseConfig, ranks: int, device: torch.device, dtype: torch.dtype,
            one_node: bool) -> tuple[Cluster, str]:
    """The cluster the plays run on, and how it was described."""
    nbytes = torch.empty((), dtype=config.param_dtype or dtype).element_size()
    low = nbytes <= 2
    if device.type == "cuda":
        link = config.link_gbps if config.link_gbps is not None else (450.0 if one_node else 50.0)
        flops = 400e12 if low else 50e12
        cl = Cluster(ranks, link * 1e9, 15e-6, flops, nbytes, nbytes, piece_fit=H200_PIECE_FIT,
                     host_fit=H200_HOST_FIT, min_fuse_numel=config.min_fuse_numel)
        where = "given" if config.link_gbps is not None else ("NVLink, one node" if one_node else "across nodes")
    else:
        link = config.link_gbps if config.link_gbps is not None else 1.25
        cl = Cluster(ranks, link * 1e9, 100e-6, 50e9, nbytes, nbytes, host_fit=CPU_HOST_FIT, host_on_compute=True,
                     min_fuse_numel=config.min_fuse_numel)
        where = "given" if config.link_gbps is not None else "assumed: 10 Gb Ethernet"
    cl = replace(cl, lookahead_bytes=None if config.lookahead_mb == "auto" else config.lookahead_mb * 2**20,
                 prefetch_depth=config.prefetch_depth)
    return cl, (f"{device.type}, {ranks} ranks, link {link:g} GB/s ({where}), {cl.flops_per_s / 1e12:g} TFLOP/s, "
                f"{nbytes}-byte elements")


def choose(model: nn.Module, config: CommFuseConfig, ranks: int, device: torch.device, one_node: bool = True
           ) -> Choice:
    """The schedule and piece width that ``config``'s ``"auto"`` settings stand for on this model and machine."""
    explicit_pieces = config.piece_shards != "auto"
    pieces = config.piece_shards if explicit_pieces else 1
    fixed = config.schedule if config.schedule != "auto" else None
    if fixed not in (None, "fused") or (fixed is not None and explicit_pieces):
        return Choice(fixed, pieces, f"schedule={fixed!r} as given")
    if ranks == 1:
        return Choice(fixed or "fused", pieces, "one rank: nothing moves")
    if config.replicate > 1 and fixed is None:
        return Choice("fused", pieces, "HSDP (replicate > 1): the fused rings inside each copy, gradients across them")
    shape = model_shape(model)
    if shape is None:
        return Choice(fixed or "fused", pieces, "the model has no transformers config giving its shapes: "
                                                "fused, not planned")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    cl, described = machine(config, ranks, device, dtype, one_node)
    tokens = tokens_of(model, config)
    seq = min(tokens, getattr(model.config, "max_position_embeddings", tokens) or tokens)
    described += f", {tokens} tokens per rank" + ("" if config.tokens_per_rank is not None else " (assumed)")
    units = units_for(*shape, tokens=tokens, seq=seq)
    if device.type != "cuda":  # FSDP2's copies on the computing thread
        cl = replace(cl, peer_host_s=peer_host_on_cpu(units, cl))
    schedule, width, predicted = decide(units, cl, config.schedule, config.piece_shards)
    fused_s = predicted[f"fused, piece_shards={width}"] if schedule == "fused" else min(
        v for k, v in predicted.items() if k != "fsdp2")
    if fixed is not None:
        reason = f"schedule='fused' as given; piece_shards={width}: the shortest predicted fused step"
    elif schedule == "fused" and not any(u.groups or u.table for u in placed(units, cl, elastic=True)):
        reason = (f"no layer reaches min_fuse_numel={config.min_fuse_numel}, so none is fused: the FSDP2 units on "
                  f"the library's rings predicted {fused_s:.3g} s a step, the peer (fsdp2) "
                  f"{predicted['fsdp2']:.3g} s: {1 - fused_s / predicted['fsdp2']:.0%} faster")
    elif schedule == "fused":
        reason = (f"fused predicted {fused_s:.3g} s a step, the peer (fsdp2) {predicted['fsdp2']:.3g} s: "
                  f"{1 - fused_s / predicted['fsdp2']:.0%} faster")
    else:
        reason = (f"the peer (fsdp2) predicted {predicted['fsdp2']:.3g} s a step, fused at best {fused_s:.3g} s: "
                  f"fusing does not win by {MARGIN:.0%} here")
    return Choice(schedule, width, reason, predicted, described)


def resolve(model: nn.Module, config: CommFuseConfig, ranks: int, device: torch.device, one_node: bool = True
            ) -> tuple[CommFuseConfig, Choice]:
    """``config`` with its ``"auto"`` schedule and piece width replaced by what ``choose`` picks."""
    choice = choose(model, config, ranks, device, one_node)
    return config.replace(schedule=choice.schedule, piece_shards=choice.piece_shards), choice
