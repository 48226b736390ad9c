"""Transformers' tensor-parallel plans and ``DistributedConfig`` on the fused TP layers (``commfuse_dp.tp.plan``):
each family's own plan is taken, a user's rules that say the same split are taken, and a rule naming a module the
model lacks or asking another split is refused, before the model changes, on every rank; ``from_distributed_config``
runs what a ``DistributedConfig`` asks (the same losses as ``tp_size``), and a model transformers made
tensor-parallel itself is refused with the way to the fused layers."""

import pytest
import torch

from harness import run_ranks
from test_tp_models import _model

FAMILIES = ("llama", "qwen2", "mistral", "gemma")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_s_own_plan_is_taken(family):
    from commfuse_dp.tp import check_plan

    model = _model(family, 4, 2)
    own = dict(model._tp_plan)
    assert own and check_plan(model, "auto") == own and check_plan(model, None) == own
    assert "model.layers.*.self_attn.q_proj" in own  # (the rules the check read are the model's)


def test_rules_that_say_the_fused_split_are_taken_from_the_root_or_the_base_model():
    from commfuse_dp.tp import check_plan

    model = _model("llama", 4, 2)
    plan = {"layers.*.mlp.down_proj": "rowwise", "model.layers.*.self_attn.q_proj": "colwise_rep",
            "model.norm": "sequence_parallel", "model.layers.*.input_layernorm.weight": "replicate",
            "lm_head": "colwise_gather_output", "model.rotary_emb": "replicate"}
    merged = check_plan(model, plan)
    assert merged["layers.*.mlp.down_proj"] == "rowwise" and merged["model.norm"] == "sequence_parallel"


@pytest.mark.parametrize("rule, fragment", [
    ({"model.layers.*.self_attn.qkv_proj": "colwise"}, "names no module or parameter of LlamaForCausalLM"),
    ({"model.layers.*.self_attn.q_proj": "rowwise"}, "split model.layers.*.self_attn.q_proj by output rows"),
    ({"model.embed_tokens": "embedding_colwise"}, "split model.embed_tokens by vocabulary rows"),
    ({"model.norm": "colwise"}, "split model.norm whole"),
    ({"model.rotary_emb": "colwise"}, "have no split for model.rotary_emb"),
    ({"model.layers.*.mlp.up_proj": "colwse"}, "'colwse': the fused TP layers split"),
])
def test_a_rule_the_fused_layers_cannot_run_is_refused_naming_it(rule, fragment):
    from commfuse_dp.tp import check_plan

    with pytest.raises(ValueError, match="tp_plan rule") as info:
        check_plan(_model("llama", 4, 2), rule)
    assert fragment in str(info.value), str(info.value)


def test_tp_plan_in_the_config_and_its_environment():
    from commfuse_dp import CommFuseConfig

    plan = {"model.layers.*.mlp.down_proj": "rowwise"}
    cfg = CommFuseConfig(tp_size=2, tp_plan=plan)
    assert CommFuseConfig.from_env(cfg.to_env()) == cfg and CommFuseConfig().tp_plan == "auto"
    assert CommFuseConfig(tp_plan=None).tp_plan == "auto"
    with pytest.raises(ValueError, match="tp_plan=.*must be 'auto'"):
        CommFuseConfig(tp_plan="colwise")
    with pytest.raises(ValueError, match="COMMFUSE_TP_PLAN=.*JSON mapping"):
        CommFuseConfig.from_env({"COMMFUSE_TP_PLAN": "{bad"})


def test_from_distributed_config_takes_its_sizes_and_plan():
    from transformers.distributed import DistributedConfig

    from commfuse_dp import CommFuseConfig
    from commfuse_dp.tp import from_distributed_config

    plan = {"model.layers.*.mlp.down_proj": "rowwise"}
    cfg = from_distributed_config(DistributedConfig(tp_size=2, tp_plan=plan, dp_replicate_size=2),
                                  CommFuseConfig(min_fuse_numel=0))
    assert (cfg.tp_size, cfg.tp_plan, cfg.replicate, cfg.min_fuse_numel) == (2, plan, 2, 0)
    assert from_distributed_config(DistributedConfig(tp_size=4)).tp_plan == "auto"
    with pytest.raises(ValueError, match="pp_size=2 is not supported"):
        from_distributed_config(DistributedConfig(tp_size=2, pp_size=2))


def _plans_worker(rank, world_size, model_dir):
    import hf_models
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import commfuse_dp as cf
    from commfuse_dp.tp import from_distributed_config

    def losses(config):
        model = cf.shard(hf_models.build("llama"), config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for step in range(3):
            loss = model(**hf_models.batch(rank // 2, step)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    base = cf.CommFuseConfig(min_fuse_numel=0)
    by_size = losses(base.replace(tp_size=2))
    asked = DistributedConfig(tp_size=2, tp_plan={"layers.*.mlp.down_proj": "rowwise", "model.norm": "replicate"})
    by_plan = losses(from_distributed_config(asked, base))
    with pytest.raises(ValueError, match="tp_plan rule 'model.layers.\\*.mlp.gate_proj': 'rowwise'"):
        cf.shard(hf_models.build("llama"), base.replace(tp_size=2, tp_plan={"model.layers.*.mlp.gate_proj": "rowwise"}))
    # what transformers itself makes of a DistributedConfig with TP (its DTensor layers, FSDP2 on top) is not
    # taken silently: the message says how to get the fused layers instead
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(tp_size=2,
                                                                                                   fsdp_size=2))
    with pytest.raises(ValueError, match="transformers made this model tensor-parallel itself .*tp_size=2.*"
                                         "from_distributed_config"):
        cf.shard(theirs, base)
    return by_size, by_plan


def test_a_distributed_config_s_plan_runs_the_fused_layers_and_bad_rules_fail_on_every_rank(tmp_path):
    """4 CPU ranks, TP 2 x data 2: a ``DistributedConfig``'s TP size and plan give the losses ``tp_size`` gives
    (3 AdamW steps); a bad rule and a model transformers sharded with TP are refused on every rank."""
    import hf_models

    hf_models.build("llama").save_pretrained(tmp_path / "llama")
    results = run_ranks(_plans_worker, 4, (str(tmp_path / "llama"),), timeout=300)
    for by_size, by_plan in results:
        assert by_size == by_plan, (by_size, by_plan)
    assert results[0][0] != results[2][0]  # (the two data-parallel ranks read different batches)
