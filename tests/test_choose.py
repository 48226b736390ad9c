"""CommFuseConfig()'s "auto" settings (commfuse_dp/planner/choose.py): what they become, why, and that ``commfuse-dp plan``
recommends the same."""

import contextlib
import io
import re

import pytest
import torch

import commfuse_dp as cf
from commfuse_dp.planner import cli as plan_cli
from commfuse_dp.planner.choose import MARGIN, choose
from harness import run_ranks
import hf_models
from commfuse_dp.handle import handle_of

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)


def _meta(max_positions=8192, dtype=torch.bfloat16, **shape):
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(max_position_embeddings=max_positions, **shape)).to(dtype)


def _bench_model():
    return _meta(256, torch.float32, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                 num_attention_heads=8, vocab_size=4096)


def test_fused_where_the_peer_leaves_its_head_and_tail_exposed():
    """The bench model on 2 CPU ranks at the 2-rank bench's balanced rate: fused predicted well ahead."""
    c = choose(_bench_model(), cf.CommFuseConfig(tokens_per_rank=512, link_gbps=0.18), 2, torch.device("cpu"))
    assert c.schedule == "fused" and c.piece_shards == 1, c
    assert c.predicted_s["fused, piece_shards=1"] <= (1 - MARGIN) * c.predicted_s["fsdp2"]
    assert "faster" in c.reason and "given" in c.machine


@pytest.mark.parametrize("ranks,one_node", [(8, True), (64, False)])
def test_the_peer_where_fusing_cannot_win(ranks, one_node):
    """Llama-3-8B in bf16 on CUDA at 8192 tokens: over NVLink at 8 ranks fused at its best piece width only ties the
    peer; at 64 ranks the host cannot issue fused's hops in time. Both run the peer's shape."""
    c = choose(_meta(**LLAMA3_8B), cf.CommFuseConfig(tokens_per_rank=8192), ranks, torch.device("cuda"), one_node)
    assert c.schedule == "fsdp2", c
    fused = min(v for k, v in c.predicted_s.items() if k.startswith("fused"))
    assert fused > (1 - MARGIN) * c.predicted_s["fsdp2"]
    assert ("NVLink" if one_node else "across nodes") in c.machine and "does not win" in c.reason
    # the peer's collectives: NCCL's own (FSDP2 as shipped), the rings' N-1 host-issued steps predicted no faster
    assert c.collectives == "torch" and "on NCCL's own collectives" in c.reason, c
    assert c.predicted_s["fsdp2"] == c.predicted_s["fsdp2 on NCCL"] <= c.predicted_s["fsdp2 on the rings"]
    given = choose(_meta(**LLAMA3_8B), cf.CommFuseConfig(tokens_per_rank=8192, fsdp2_collectives="rings"), ranks,
                   torch.device("cuda"), one_node)
    assert given.schedule == "fsdp2" and given.collectives == "rings", given


def test_gpu_pieces_are_widened_where_fused_is_kept():
    """On CUDA thin GEMM pieces cost time: schedule='fused' as given keeps fused with the piece width that plays
    fastest, which at 8 ranks over NVLink is wider than one shard."""
    c = choose(_meta(**LLAMA3_8B), cf.CommFuseConfig(schedule="fused", tokens_per_rank=8192), 8, torch.device("cuda"))
    assert c.schedule == "fused" and c.piece_shards > 1, c
    assert c.predicted_s[f"fused, piece_shards={c.piece_shards}"] < c.predicted_s["fused, piece_shards=1"]


def test_explicit_settings_win():
    model = _bench_model()
    cpu = torch.device("cpu")
    for schedule in ("fused", "slicing", "fsdp2"):
        assert choose(model, cf.CommFuseConfig(schedule=schedule, piece_shards=2), 4, cpu).schedule == schedule
    c = choose(model, cf.CommFuseConfig(piece_shards=2, tokens_per_rank=512, link_gbps=0.18), 4, cpu)
    assert c.piece_shards == 2 and list(c.predicted_s) == ["fused, piece_shards=2", "fsdp2"]
    assert choose(hf_models.build("llama"), cf.CommFuseConfig(), 1, cpu).reason.startswith("one rank")


@pytest.mark.parametrize("ranks,gbps,tokens", [(8, 450, 8192), (8, 6.25, 2048), (16, 12.5, 4096), (64, 50, 8192)])
def test_plan_recommends_what_the_defaults_run(ranks, gbps, tokens):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_cli.main(["--model", "llama3-8b", "--num-processes", str(ranks), "--link-gbps", str(gbps), "--tokens-per-rank", str(tokens),
                   "--seq", str(tokens)])
    line = next(l for l in out.getvalue().splitlines() if l.startswith("CommFuseConfig()'s defaults"))
    schedule = re.search(r"schedule='(\w+)'", line).group(1)
    pieces = re.search(r"piece_shards=(\d+)", line)
    c = choose(_meta(max_positions=tokens, **LLAMA3_8B), cf.CommFuseConfig(link_gbps=gbps, tokens_per_rank=tokens),
               ranks, torch.device("cuda"), one_node=True)
    assert (schedule, int(pieces.group(1)) if pieces else 1) == (c.schedule, c.piece_shards), (line, c)


def _describe_worker(rank, world_size):
    model = cf.shard(hf_models.build("llama"), cf.CommFuseConfig(tokens_per_rank=24))
    text = str(cf.describe(model))
    return handle_of(model).engine.config.schedule, handle_of(model).choice.schedule, text


def test_shard_runs_the_choice_and_describe_says_why():
    schedule, chosen, text = run_ranks(_describe_worker, 2, timeout=120)[0]
    assert schedule == chosen != "auto"
    assert f"chosen: schedule '{chosen}'" in text and "predicted step s" in text, text


@pytest.mark.parametrize("ranks,one_node,link", [(8, True, None), (64, False, 1.56)])
def test_a_narrow_format_is_played_not_assumed_to_fuse(ranks, one_node, link):
    """schedule="auto" with int8 gradients plays both schedules with the format (its bytes and its codec, both on
    the rings, the only collectives that carry it) and keeps the rule it has without one: fused only where predicted
    faster than the peer by MARGIN."""
    config = cf.CommFuseConfig(tokens_per_rank=8192, reduce_format="int8", error_feedback=True, link_gbps=link)
    c = choose(_meta(**LLAMA3_8B), config, ranks, torch.device("cuda"), one_node)
    exact = choose(_meta(**LLAMA3_8B), config.replace(reduce_format="exact", error_feedback=False,
                                                      fsdp2_collectives="rings"), ranks, torch.device("cuda"),
                   one_node)
    fused = min(v for k, v in c.predicted_s.items() if k.startswith("fused"))  # (unplayed: a lower bound)
    assert (c.schedule == "fused") == (fused <= (1 - MARGIN) * c.predicted_s["fsdp2"]), c
    assert "reduce_format='int8'" in c.reason and "ns an element and pass, assumed" in c.machine, c
    assert c.collectives == "rings"
    # the format's bytes and codec played: on NVLink the codec costs more than the bytes save, where the link is
    # the limit the bytes win
    slower = c.predicted_s["fsdp2"] > exact.predicted_s["fsdp2"]
    assert slower == one_node, (c.predicted_s, exact.predicted_s)
