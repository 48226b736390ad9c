"""commfuse_dp.describe(model) and shard()'s warning when little is fused: figures checked by hand on the tiny Llama
of hf_models (hidden 32, kv heads 2 (k/v 16 rows), intermediate 56, vocab 96, 2 layers, untied lm_head)."""

import json
import re

import pytest
import torch.nn as nn

import commfuse_dp as cf
import hf_models
from harness import run_ranks
from commfuse_dp.handle import handle_of


def _describe_worker(rank, world_size):
    # Default min_fuse_numel=65536: nothing of this model is big enough; logging left at its defaults (the warning
    # must reach stderr through logging's last-resort handler).
    quiet = cf.shard(hf_models.build("llama"))
    assert cf.describe(quiet).fused_groups == []
    quiet_text = str(cf.describe(quiet))
    report = cf.describe(cf.shard(hf_models.build("llama"), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0)))
    excluding = cf.describe(cf.shard(hf_models.build("llama"), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0,
                                                                                  exclude=("lm_head",))))
    from commfuse_dp.planner import measure
    links = len(measure._LINKS)  # measured once, by the first shard() above, for this group and device
    peer = cf.describe(cf.shard(hf_models.build("llama", num_hidden_layers=3), cf.CommFuseConfig(schedule="fsdp2")))
    hinted = cf.shard(hf_models.build("llama"), cf.CommFuseConfig(link_gbps=1.0, ring_latency_us=50, tflops=0.05,
                                                                 tokens_per_rank=24, min_fuse_numel=0))
    inputs = (handle_of(quiet).choice.machine, handle_of(hinted).choice.machine, links, len(measure._LINKS))
    return report.as_dict(), str(report), excluding.as_dict(), quiet_text, peer.as_dict(), inputs


def _chunk(rows, world):
    return -(-rows // world)


@pytest.mark.parametrize("world_size", [2, 3])
def test_describe_and_little_fused_warning(world_size):
    results = run_ranks(_describe_worker, world_size, timeout=300, check=False)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results if not r.ok)
    # the warning: once, on rank 0 only
    warning = "commfuse_dp.shard: only 0 B of 90.6 KiB parameter bytes (0%) are in fused linears and ring embeddings"
    assert results[0].log.count(warning) == 1, results[0].log
    assert all(warning not in r.log for r in results[1:])
    line = next(line for line in results[0].log.splitlines() if warning in line)
    # 2 layers x (q, k, v, o, gate, up, down) + lm_head; the smallest weight shard is k's / v's: 16 x 32 / N
    smallest, largest = 16 * 32 // world_size, 96 * 32 // world_size
    # the default schedule "auto" keeps the peer where fusing is predicted to lose, so the setting names the schedule
    assert (f"15 linears were left out for weight shards below min_fuse_numel=65536 elements (largest {largest}, "
            f"smallest {smallest}); CommFuseConfig(schedule='fused', min_fuse_numel={smallest}) would fuse them all "
            f"(the planner predicts ") in line
    then, now = map(float, re.search(r"predicts ([\d.e-]+) s a step with them fused, against ([\d.e-]+) s now",
                                     line).groups())
    assert ("cost more in hops than they hide" in line) == (then > now), line
    assert "no layer reaches min_fuse_numel=65536, so none is fused" in results[0].value[3], results[0].value[3]
    assert results[0].log.count("commfuse_dp.shard: only") == 1, "min_fuse_numel=0 fuses ~99%: no second warning"

    report, text, excluding, _, peer, (measured, given, links, links_after) = results[0].value
    # the defaults' inputs: measured where not told (the link at two hop sizes, the GEMM rate on the model's
    # layer shapes), given where told; the link measured once per group
    assert re.search(r"link [\d.e+-]+ GB/s \(measured: hops of 4 KiB and \d+ [KM]iB\), \d+ us a hop "
                     r"\(measured\), [\d.e+-]+ TFLOP/s \(measured: \d+ rows on the model's layer shapes\)", measured), \
        measured
    assert "256 tokens per rank (assumed: 8 sequences of the model's context, at most 8192)" in measured, measured
    assert given.count("(given)") == 4 and "measured" not in given, given
    assert links == links_after == 1
    # the peer's units (schedule="fsdp2"): torchtitan's; the root holds nothing
    kept = {u["module"]: "kept gathered" in u["note"] for u in peer["fsdp_units"]}
    assert kept == {"": False, "model.embed_tokens": False, "model.layers.0": False, "model.layers.1": False,
                    "model.layers.2": True, "model.norm+lm_head": True}, kept
    by_name = {u["module"]: u for u in peer["fsdp_units"]}
    assert by_name[""]["params"] == 0 and by_name["model.norm+lm_head"]["numel"] == 32 + 96 * 32
    assert by_name["model.layers.2"]["backward_gather_bytes"] == 0 < by_name["model.layers.1"]["backward_gather_bytes"]
    assert all(r.value[0] == report for r in results), "every rank describes the same model"
    json.dumps(report)
    n, f32 = world_size, 4
    assert report["world"] == n and report["schedule"] == "fused"

    def moved(elems, keeps=False):
        one = (n - 1) * elems * f32
        return one, (0 if keeps else one), one

    groups = {tuple(g["modules"]): g for g in report["fused_groups"]}
    expected = {}
    for layer in range(2):
        p = f"model.layers.{layer}."
        expected[(p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj")] = (
            [(32, 32), (16, 32), (16, 32)], (_chunk(32, n) + 2 * _chunk(16, n)) * 32)
        expected[(p + "self_attn.o_proj",)] = ([(32, 32)], _chunk(32, n) * 32)
        expected[(p + "mlp.gate_proj", p + "mlp.up_proj")] = ([(56, 32), (56, 32)], 2 * _chunk(56, n) * 32)
        expected[(p + "mlp.down_proj",)] = ([(32, 56)], _chunk(32, n) * 56)
    expected[("lm_head",)] = ([(96, 32)], _chunk(96, n) * 32)
    assert set(groups) == set(expected)
    for names, (shapes, elems) in expected.items():
        g = groups[names]
        assert [tuple(s) for s in g["weight_shapes"]] == shapes and g["shard_numel"] == elems, names
        keeps = names == ("lm_head",)  # the last fused group of the forward keeps its weight for its backward
        assert (g["forward_gather_bytes"], g["backward_gather_bytes"], g["reduce_scatter_bytes"]) == \
            moved(elems, keeps), names
        assert ("keeps its weight" in g["note"]) == keeps
    (emb,) = report["ring_embeddings"]
    assert emb["module"] == "model.embed_tokens" and emb["shard_numel"] == _chunk(96, n) * 32
    assert (emb["forward_gather_bytes"], emb["backward_gather_bytes"], emb["reduce_scatter_bytes"]) == \
        (moved(_chunk(96, n) * 32)[0], 0, moved(_chunk(96, n) * 32)[0])
    assert "upper bound" in emb["note"]
    # FSDP2: the root holds the final norm (32), each layer its two norms (2 x 32); rows padded to N
    units = {u["module"]: u for u in report["fsdp_units"]}
    assert set(units) == {"", "model.layers.0", "model.layers.1"}
    assert (units[""]["params"], units[""]["numel"]) == (1, 32)
    root = (n - 1) * _chunk(32, n) * f32
    assert (units[""]["forward_gather_bytes"], units[""]["backward_gather_bytes"],
            units[""]["reduce_scatter_bytes"]) == (root, 0, root)
    assert units["model.layers.0"]["numel"] == 64 and units["model.layers.0"]["backward_gather_bytes"] == 2 * root
    linears = sum(sum(moved(e, names == ("lm_head",))) for names, (_, e) in expected.items())
    assert report["bytes_per_step"] == {"fused_linears": linears, "ring_embeddings": 2 * moved(_chunk(96, n) * 32)[0],
                                        "fsdp_units": 2 * root + 2 * 3 * 2 * root,
                                        "total": report["bytes_per_step"]["total"]}
    assert report["bytes_per_step"]["total"] == sum(v for k, v in report["bytes_per_step"].items() if k != "total")
    assert report["total_param_bytes"] == 23200 * f32
    assert report["fused_param_bytes"] == (23200 - 5 * 32) * f32  # all but the five norm weights
    assert report["excluded"] == {}
    assert "model.layers.0.self_attn.{q_proj,k_proj,v_proj}  32x32 16x32 16x32" in text
    assert "FSDP2 units (3):" in text and "(root)" in text and "excluded from the fused path (0): none" in text

    assert excluding["excluded"] == {"lm_head": "exclude pattern 'lm_head'"}
    assert ["lm_head"] not in [g["modules"] for g in excluding["fused_groups"]]
    root = next(u for u in excluding["fsdp_units"] if u["module"] == "")
    assert (root["params"], root["numel"]) == (2, 32 + 96 * 32)


def test_describe_needs_a_sharded_model():
    with pytest.raises(ValueError, match="not sharded with commfuse_dp.shard"):
        cf.describe(nn.Linear(2, 2))


def _gqa_worker(rank, world_size):
    # q: 64x64, k and v: 16x64 (one kv head). At 2 ranks with min_fuse_numel=2000: q's shard (2048) is big
    # enough alone, k's and v's (512) are not, the q/k/v group's (3072) is.
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=hf_models.VOCAB, hidden_size=64, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1))
    cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=2000))
    attn = model.model.layers[0].self_attn
    return {name: (type(getattr(attn, name)).__name__, getattr(attn, name)._cf_group.names
                   if hasattr(getattr(attn, name), "_cf_group") else None) for name in ("q_proj", "k_proj", "v_proj")}


def test_small_projections_are_judged_with_the_linears_that_share_their_input():
    result = run_ranks(_gqa_worker, 2, timeout=120)[0]
    group = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    assert result == {name: ("RingLinear", group) for name in ("q_proj", "k_proj", "v_proj")}, result


def _unit_worker(rank, world_size):
    # The same layer: q/k/v (3072-element group shard) and o_proj (2048) reach min_fuse_numel=2000 at 2 ranks; the
    # MLP's gate/up group (1024) and down_proj (512) do not, but they sit in the decoder layer's unit.
    from transformers import LlamaConfig, LlamaForCausalLM

    kinds = {}
    for label, options in (("elastic", {}), ("lockstep", {"lookahead_mb": 0}), ("slicing", {"schedule": "slicing"})):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=hf_models.VOCAB, hidden_size=64, intermediate_size=16,
                                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1))
        cf.shard(model, cf.CommFuseConfig(**{"schedule": "fused", "min_fuse_numel": 2000, **options}))
        mlp = model.model.layers[0].mlp
        kinds[label] = {name: type(getattr(mlp, name)).__name__ for name in ("gate_proj", "up_proj", "down_proj")}
    return kinds


def test_small_linears_ride_their_units_bundles_under_the_elastic_schedule():
    kinds = run_ranks(_unit_worker, 2, timeout=180)[0]
    assert set(kinds["elastic"].values()) == {"RingLinear"}, kinds  # fused with the unit's larger groups
    assert set(kinds["lockstep"].values()) == {"Linear"}, kinds  # each ring of its own: judged alone
    assert set(kinds["slicing"].values()) == {"Linear"}, kinds
