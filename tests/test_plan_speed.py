"""The planner's choice at scale (``plan.decide``; [Note: a stand-in ring], ``commfuse_dp/planner/replay.py``): the lower
bounds it prunes piece widths with never exceed the played step, pruning never changes the choice, and on large rings
the stand-in ring plays the step within a stated tolerance of the full ring, with the same choice. How long the
choice takes is shown by ``benchmarks/startup.py``, not tested."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from commfuse_dp.planner import costs, plan
from commfuse_dp.planner.costs import Cluster, units_for

MODELS = {name: plan.KNOWN_MODELS[name] for name in ("bench", "gpt2", "llama3-8b", "llama3-70b")}
STAND_IN_STEP_TOLERANCE = {"fused": 1e-3, "lockstep": 1e-2}  # relative; see test_stand_in_ring_plays_the_full_ring


def _clusters(ranks: int, gbps: float, units: list) -> dict[str, Cluster]:
    """The cost models the planner runs on: a GPU's (``choose`` on CUDA: H200 GEMM pieces and host), its pieces
    alone, none, a CPU's (the host and the peer's copies on the computing thread), and narrow formats on the wire
    (one-byte gathers, two-byte gradients, a codec on the compute stream)."""
    gpu = Cluster(ranks, gbps * 1e9, 15e-6, 400e12, 2, 2, piece_fit=costs.H200_PIECE_FIT,
                  host_fit=costs.H200_HOST_FIT, peer_nccl=True)
    cpu = Cluster(ranks, gbps * 1e7, 100e-6, 5e12, 4, 4, host_fit=costs.CPU_HOST_FIT, host_on_compute=True)
    return {"gpu": gpu, "gpu pieces": replace(gpu, host_fit=None), "free": replace(gpu, piece_fit=None, host_fit=None),
            "cpu": replace(cpu, peer_host_s=costs.peer_host_on_cpu(units, cpu)),
            "int8 gathers": plan.with_formats(replace(gpu, host_fit=None), "int8", "bf16", 2,
                                              {"int8": 2e-12, "bf16": 1e-12}),
            "cpu bytes": replace(cpu, host_fit=None, cpu_s_per_byte=2e-11)}


@pytest.mark.parametrize("model", ["bench", "gpt2", "llama3-8b"])
@pytest.mark.slow
def test_the_bound_is_never_above_the_played_step(model):
    """``simulate(..., floor=True)`` against the play, for the elastic and the lockstep fused schedule, at every
    piece width, on small rings and a stand-in one, with nothing, some or every group below ``min_fuse_numel``."""
    checked = 0
    for ranks in (2, 3, 8, 128):
        for tokens in (512, 8192):
            units = units_for(*MODELS[model], tokens=tokens, seq=min(tokens, 4096))
            for gbps in (1.0, 50.0):
                for name, cl in _clusters(ranks, gbps, units).items():
                    for least in (0, costs.MIN_FUSE_NUMEL, 1 << 40):
                        for schedule in ("fused", "lockstep"):
                            for g in {1, 2, ranks} if schedule == "fused" else {1}:
                                c = replace(cl, min_fuse_numel=least, piece_shards=g)
                                floor = plan.simulate(units, c, schedule, floor=True)
                                step = plan.simulate(units, c, schedule)
                                assert floor["compute_s"] <= floor["step_s"] <= step["step_s"] * (1 + 1e-12), (
                                    ranks, tokens, gbps, name, least, schedule, g, floor["step_s"], step["step_s"])
                                checked += 1
    assert checked > 500


@pytest.mark.slow
def test_pruning_keeps_the_choice():
    """On rings the planner plays whole (up to 64 ranks), ``decide`` chooses what playing every width chooses, its
    figures for the widths it played are those, and its bound for the others is below each of their steps."""
    pruned = cells = 0
    for model in ("bench", "llama3-8b"):
        for ranks in (2, 3, 8, 64):
            for tokens in (512, 8192):
                units = units_for(*MODELS[model], tokens=tokens, seq=min(tokens, 4096))
                for gbps in (1.0, 25.0, 450.0):
                    for name, cl in _clusters(ranks, gbps, units).items():
                        for schedule in ("auto", "fused"):
                            got = plan.decide(units, cl, schedule)
                            want = plan.decide_by_playing_all(units, cl, schedule)
                            where = (model, ranks, tokens, gbps, name, schedule)
                            assert got[:2] == want[:2], (where, got, want)
                            unplayed = {k: v for k, v in want[2].items() if k not in got[2]}
                            assert all(k.startswith("fused, piece_shards=") for k in unplayed), (where, unplayed)
                            assert all(v == want[2][k] for k, v in got[2].items() if k != plan.UNPLAYED), where
                            assert (plan.UNPLAYED in got[2]) == bool(unplayed), where
                            if unplayed:
                                assert got[2][plan.UNPLAYED] <= min(unplayed.values()), (where, got[2], unplayed)
                            pruned += len(unplayed)
                            cells += 1
    assert pruned > cells  # (the bounds do prune)


@pytest.mark.parametrize("model", ["llama3-8b", "llama3-70b"])
@pytest.mark.slow
def test_stand_in_ring_plays_the_full_ring(model):
    """At 128 and 256 ranks (the full ring still affordable here) the stand-in of 64 ranks plays each fused step
    within ``STAND_IN_STEP_TOLERANCE`` of the full ring (measured on this grid: 0.003 % elastic and 0.23 % lockstep
    at most), and ``decide`` on it chooses what playing every width on the full ring chooses. Where GEMM pieces cost
    nothing (``free``, ``cpu``), piece widths up to N/64 differ by less than the stand-in resolves (one stand-in hop
    is N/64 of the ring's): there the width it picks must play on the full ring within 1e-4 of the best."""
    compared = 0
    for ranks in (128, 256):
        units = units_for(*MODELS[model], tokens=8192, seq=8192)
        for gbps in (6.25, 50.0, 450.0):
            clusters = _clusters(ranks, gbps, units)
            for name in ("gpu", "gpu pieces", "free", "cpu"):
                cl = clusters[name]
                full = replace(cl, stand_in_ranks=None)
                where = (ranks, gbps, name)
                for schedule in ("auto", "fused"):
                    want = plan.decide_by_playing_all(units, full, schedule)
                    got = plan.decide(units, cl, schedule)
                    assert got[0] == want[0], (where, got, want)
                    for key, seconds in got[2].items():
                        if key.startswith("fused, piece_shards="):
                            assert seconds == pytest.approx(want[2][key], rel=STAND_IN_STEP_TOLERANCE["fused"]), where
                            compared += 1
                    if got[0] != "fused":
                        continue
                    if cl.piece_fit is None:
                        best = want[2][f"fused, piece_shards={want[1]}"]
                        assert want[2][f"fused, piece_shards={got[1]}"] <= best * (1 + 1e-4), (where, got, want)
                    else:
                        assert got[1] == want[1], (where, got, want)
            lock = replace(clusters["gpu pieces"], lookahead_bytes=0)
            played = plan.simulate(units, lock, "lockstep")["step_s"]
            whole = plan.simulate(units, replace(lock, stand_in_ranks=None), "lockstep")["step_s"]
            assert played == pytest.approx(whole, rel=STAND_IN_STEP_TOLERANCE["lockstep"]), (ranks, gbps)
    assert compared > 50


def test_the_choice_at_scale_says_what_it_did_not_play():
    """At 1024 ranks on CUDA the host alone bounds every fused step above the peer's: the choice plays no fused
    width, reports none as played, and says that its fused figure is a lower bound; ``decide`` agrees with
    playing every width (on the same stand-in ring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import commfuse_dp as cf
    from commfuse_dp.planner.choose import choose

    shape = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=8192, **shape)).to(torch.bfloat16)
    config = cf.CommFuseConfig(link_gbps=50, ring_latency_us=15, tflops=400, tokens_per_rank=8192)
    c = choose(model, config, 1024, torch.device("cuda"))
    assert c.schedule == "fsdp2" and not any(k.startswith("fused, piece_shards=") for k in c.predicted_s), c
    assert c.predicted_s[plan.UNPLAYED] > c.predicted_s["fsdp2"] and "at least" in c.reason, c
    assert plan.decide_by_playing_all(c.plan.units, c.plan.cluster)[:2] == (c.schedule, c.piece_shards)
    cpu = choose(model, config, 1024, torch.device("cpu"))  # (the CPU's host and copies: fused wins, played)
    assert cpu.schedule == "fused" and f"fused, piece_shards={cpu.piece_shards}" in cpu.predicted_s, cpu
    assert plan.decide_by_playing_all(cpu.plan.units, cpu.plan.cluster)[:2] == (cpu.schedule, cpu.piece_shards)
