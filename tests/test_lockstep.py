"""Lockstep by construction: MoE experts and LayerDrop layers stay out of the fused path and out of FSDP2 units of
their own, and training them matches one process, though the ranks call different modules."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from transformers.modeling_outputs import CausalLMOutput

import commfuse_dp as cf
from commfuse_dp import data_dependence
from harness import log_messages, run_ranks
from commfuse_dp.handle import handle_of

VOCAB, HIDDEN, FFN, EXPERTS, SEQ, STEPS = 64, 16, 24, 4, 8, 4
FP32 = dict(rtol=1e-5, atol=1e-5)


# ---- a small MoE causal LM ------------------------------------------------------------------------------

class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-1 hash routing (Roller et al. 2021, "Hash Layers"): token id mod E picks the expert, the gate's softmax
    weighs its output. Routing by id lets a test choose which experts get tokens on which rank."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.tokens_per_expert = []  # per forward: how many tokens each expert got

    def forward(self, x, ids):
        route = ids % EXPERTS
        weight = torch.softmax(self.gate(x), dim=-1).gather(-1, route.unsqueeze(-1))
        out = torch.zeros_like(x)
        counts = torch.bincount(route.flatten(), minlength=EXPERTS)
        self.tokens_per_expert.append(counts.tolist())
        for e, expert in enumerate(self.experts):
            mask = route == e
            if counts[e]:
                out = out.index_put((mask,), expert(x[mask]))
        return out * weight


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE()

    def forward(self, x, ids):
        h = self.mix(self.norm1(x))
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        x = x + h.cumsum(dim=1) / steps  # causal: position t sees positions <= t
        return x + self.moe(self.norm2(x), ids)


class MoECausalLM(nn.Module):
    """No ``_no_split_modules``: shard() falls back to the longest ModuleList whose entries are not data-dependent
    (``layers``, not a list of experts)."""

    def __init__(self, seed=0, layers=2):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, input_ids)
        logits = self.lm_head(self.norm(x))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)  # a pytree: FSDP2 hooks the root's backward through it


def moe_batch(rank, step, world_size):
    """Rank 0 routes tokens to every expert; rank r > 0 sends none to expert E - r (mod E), so in the concatenated
    batch every expert gets tokens, but on each other rank one expert gets none."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    if rank == 0:
        ids[0, :EXPERTS] = torch.arange(EXPERTS)
    else:
        starved = EXPERTS - rank
        ids = torch.where(ids % EXPERTS == starved, (ids + 1) % VOCAB, ids)
    return {"input_ids": ids, "labels": ids.clone()}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def train(model, batch_of_step, steps=STEPS):
    """Per step: (loss, grad norm before clipping), AdamW with weight decay."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    record = []
    for step in range(steps):
        loss = model(**batch_of_step(step)).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        record.append((loss.detach(), _full(norm)))
    return record


def compare(rank, world_size, model, ref, ours, theirs, label):
    losses = torch.stack([loss for loss, _ in ours])
    dist.all_reduce(losses)
    torch.testing.assert_close(losses / world_size, torch.stack([loss for loss, _ in theirs]), **FP32,
                               msg=lambda m: f"{label} losses: {m}")
    torch.testing.assert_close(torch.stack([n for _, n in ours]), torch.stack([n for _, n in theirs]), **FP32,
                               msg=lambda m: f"{label} grad norms: {m}")
    mine = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(_full(mine[name]), p.detach(), **FP32, msg=lambda m: f"{label} {name}: {m}")


def _moe_worker(rank, world_size):
    starved_seen = {}
    for schedule in ("fused", "slicing"):
        model, ref = MoECausalLM(), MoECausalLM()
        cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))
        for layer in model.layers:
            assert type(layer.mix).__name__ == "RingLinear" and type(layer.moe.gate).__name__ == "RingLinear"
            assert all(type(e.up) is nn.Linear and type(e.down) is nn.Linear for e in layer.moe.experts)
            assert isinstance(layer, FSDPModule) and not any(isinstance(e, FSDPModule) for e in layer.moe.experts)
            groups = layer._get_fsdp_state()._fsdp_param_groups
            assert groups and groups[0].reduce_scatter_unused_params, "the unit holding the experts must reduce zeros"
        assert all(getattr(m, "_is_fsdp_managed_module", False) for m in model.modules())
        ours = train(model, lambda step: moe_batch(rank, step, world_size))
        theirs = train(ref, lambda step: {k: torch.cat([moe_batch(r, step, world_size)[k] for r in range(world_size)])
                                          for k in ("input_ids", "labels")})
        counts = torch.tensor([layer.moe.tokens_per_expert for layer in model.layers])  # (layers, steps, experts)
        starved_seen[schedule] = int((counts == 0).any(dim=-1).sum())
        ref_counts = torch.tensor([layer.moe.tokens_per_expert for layer in ref.layers])
        assert (ref_counts > 0).all(), "every expert must get tokens in the concatenated batch"
        compare(rank, world_size, model, ref, ours, theirs, f"moe/{schedule}")
    return starved_seen


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.slow
def test_moe_experts_without_tokens_on_some_rank_match_single_process(world_size):
    starved = run_ranks(_moe_worker, world_size, timeout=300)
    assert starved[0] == {"fused": 0, "slicing": 0}, "rank 0 routes to every expert"
    for rank in range(1, world_size):
        # every forward of every layer on this rank had an expert with no tokens
        assert starved[rank] == {"fused": 2 * STEPS, "slicing": 2 * STEPS}, starved


# ---- LayerDrop --------------------------------------------------------------------------------------------

class DropBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class LayerDropLM(nn.Module):
    """LayerDrop as in fairseq/transformers, but the layers to skip are set by the test (``skip``), so that a
    single process can replay every rank's choice."""

    def __init__(self, seed=0, layers=3):
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(layerdrop=0.5, hidden_size=HIDDEN)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(DropBlock() for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.skip = set()

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            if not (self.training and i in self.skip):
                x = layer(x)
        logits = self.lm_head(self.norm(x))
        return CausalLMOutput(loss=F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)), logits=logits)


def _skipped(rank, step):
    return {(rank + step) % 3}  # every rank skips another layer at every step


def _layerdrop_worker(rank, world_size):
    model, ref = LayerDropLM(), LayerDropLM()
    cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
    assert type(model.lm_head).__name__ == "RingLinear" and type(model.embed).__name__ == "RingEmbedding"
    assert all(type(layer.up) is nn.Linear and not isinstance(layer, FSDPModule) for layer in model.layers)
    assert model._get_fsdp_state()._fsdp_param_groups[0].reduce_scatter_unused_params
    assert set(handle_of(model).excluded) == {"layers.0", "layers.1", "layers.2"}
    assert handle_of(model).excluded["layers.0"] == "LayerDrop (config.layerdrop=0.5)"

    def ours(step):
        model.skip = _skipped(rank, step)
        return moe_batch(rank, step, world_size)

    def theirs(step):  # the mean of every rank's loss, each with its own skipped layer
        losses = []
        for r in range(world_size):
            ref.skip = _skipped(r, step)
            losses.append(ref(**moe_batch(r, step, world_size)).loss)
        return torch.stack(losses).mean()

    class Replay(nn.Module):
        def __init__(self):
            super().__init__()
            self.ref = ref

        def forward(self, step):
            return SimpleNamespace(loss=theirs(step))

    mine = train(model, ours)
    replayed = Replay()
    opt_ref = train(replayed, lambda step: {"step": step})
    compare(rank, world_size, model, ref, mine, opt_ref, "layerdrop")
    return True


def test_layerdrop_layers_join_their_parent_unit_and_match_single_process():
    run_ranks(_layerdrop_worker, 2, timeout=300)


# ---- what is found, what is excluded ---------------------------------------------------------------------

class RoutedFFNs(nn.Module):
    """Experts not named so: found by the router beside them (a Linear with one output per entry)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(HIDDEN, 3)
        self.ffns = nn.ModuleList(Expert() for _ in range(3))
        self.mixed = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN)])
        self.pair = nn.ModuleList(Expert() for _ in range(2))  # no router with 2 outputs, not named experts


def test_data_dependent_modules_found_from_structure():
    found = data_dependence.data_dependent_modules(MoECausalLM())
    assert found == {f"layers.{i}.moe.experts.{e}": f"MoE expert of layers.{i}.moe"
                     for i in range(2) for e in range(EXPERTS)}
    assert data_dependence.data_dependent_modules(RoutedFFNs()) == {
        f"ffns.{e}": "MoE expert of (root), routed by router" for e in range(3)}
    found = data_dependence.data_dependent_modules(LayerDropLM())
    assert found == {f"layers.{i}": "LayerDrop (config.layerdrop=0.5)" for i in range(3)}
    no_drop = LayerDropLM()
    no_drop.config.layerdrop = 0.0
    assert data_dependence.data_dependent_modules(no_drop) == {}


def test_data_dependent_modules_of_hf_moe_models():
    from transformers import (NllbMoeConfig, NllbMoeForConditionalGeneration, SwitchTransformersConfig,
                              SwitchTransformersForConditionalGeneration)

    switch = SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=4, expert_capacity=8, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1))
    found = data_dependence.data_dependent_modules(switch)
    assert len(found) == 8  # one sparse block in the encoder, one in the decoder, 4 experts each
    assert found["encoder.block.1.layer.1.mlp.experts.expert_3"] == "MoE expert of encoder.block.1.layer.1.mlp"
    nllb = NllbMoeForConditionalGeneration(NllbMoeConfig(
        vocab_size=VOCAB, d_model=16, encoder_ffn_dim=24, decoder_ffn_dim=24, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, num_experts=4, expert_capacity=8,
        encoder_sparse_step=2, decoder_sparse_step=2, max_position_embeddings=32, encoder_layerdrop=0.1,
        decoder_layerdrop=0.0))
    found = data_dependence.data_dependent_modules(nllb)
    experts = {n for n, why in found.items() if why.startswith("MoE expert")}
    assert experts == {f"model.{side}.layers.1.ffn.experts.expert_{e}" for side in ("encoder", "decoder")
                       for e in range(4)}
    assert found["model.encoder.layers.0"] == "LayerDrop (config.encoder_layerdrop=0.1)"
    assert {n for n, why in found.items() if why.startswith("LayerDrop")} == {"model.encoder.layers.0",
                                                                               "model.encoder.layers.1"}


def test_exclusions_cover_what_is_inside_an_excluded_module():
    model = MoECausalLM()
    excluded = data_dependence.exclusions(model, ("layers.1", "lm_*"), {}, exclude_data_dependent=True)
    assert excluded.reasons == {"layers.1": "exclude pattern 'layers.1'", "lm_head": "exclude pattern 'lm_*'"}
    assert excluded.why("layers.1.moe.experts.0.up") == "exclude pattern 'layers.1'"
    assert excluded.why("layers.10") is None and excluded.why("layers.0.mix") is None and excluded.why("") is None
    found = data_dependence.data_dependent_modules(model)
    assert not data_dependence.exclusions(model, (), found, exclude_data_dependent=False)
    excluded = data_dependence.exclusions(model, (), found, exclude_data_dependent=True)
    assert excluded.why("layers.0.moe.experts.2.down") == "MoE expert of layers.0.moe"


def _exclusion_worker(rank, world_size):
    import hf_models

    messages = log_messages()

    llama = cf.shard(hf_models.build("llama"), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0,
                                                                 exclude=("*.mlp.*", "lm_head")))
    for layer in llama.model.layers:
        assert type(layer.self_attn.q_proj).__name__ == "RingLinear"
        assert all(type(getattr(layer.mlp, n)) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj"))
    assert type(llama.lm_head) is nn.Linear
    assert handle_of(llama).excluded["model.layers.1.mlp.down_proj"] == "exclude pattern '*.mlp.*'"
    assert handle_of(llama).excluded["lm_head"] == "exclude pattern 'lm_head'"
    about = [m for m in messages if "CommFuseConfig.exclude" in m and "stay out of the fused path" in m]
    assert len(about) == 1 and about[0].startswith("commfuse_dp: 9 modules matching CommFuseConfig.exclude"), messages
    loss = llama(**hf_models.batch(rank, 0)).loss
    loss.backward()

    messages.clear()
    cf.shard(MoECausalLM(), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
    about = [m for m in messages if "MoE experts" in m]
    assert len(about) == 1 and about[0].startswith("commfuse_dp: 8 MoE experts"), messages  # one line, not eight
    assert "MoE expert of layers.0.moe" in about[0]

    anyway = cf.shard(MoECausalLM(), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0,
                                                       exclude_data_dependent=False))
    for layer in anyway.layers:
        assert all(type(e.up).__name__ == "RingLinear" and type(e.down).__name__ == "RingLinear"
                   for e in layer.moe.experts)
    assert handle_of(anyway).excluded == {}

    from transformers.distributed.fsdp import is_fsdp_managed_module

    fused_only = cf.shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), cf.CommFuseConfig(schedule="fused",
                                                                                             min_fuse_numel=0))
    assert not isinstance(fused_only, FSDPModule)  # every parameter fused: no FSDP2 root marks the modules
    assert all(is_fsdp_managed_module(m) for m in fused_only.modules())  # generate() then syncs the ranks itself
    return True


def test_exclude_patterns_and_data_dependent_switch():
    run_ranks(_exclusion_worker, 2, timeout=300)


def _wav2vec2_worker(rank, world_size):
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC
    from transformers.distributed.fsdp import is_fsdp_managed_module

    torch.manual_seed(0)
    config = Wav2Vec2Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
                            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                            num_conv_pos_embedding_groups=2, vocab_size=12, layerdrop=0.9,
                            mask_time_prob=0.0)  # SpecAugment writes into the fused projection's output in place,
    # which a fused linear's output (a view made inside an autograd Function) does not allow yet
    model = cf.shard(Wav2Vec2ForCTC(config), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
    layers = model.wav2vec2.encoder.layers
    assert all(type(layer.attention.q_proj) is nn.Linear and not isinstance(layer, FSDPModule) for layer in layers)
    assert type(model.lm_head).__name__ == "RingLinear"
    assert is_fsdp_managed_module(model) and is_fsdp_managed_module(model.wav2vec2.encoder)
    calls = []
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda *_, i=i: calls.append(i))
    model.train()
    torch.manual_seed(rank)  # each rank's LayerDrop draws differ
    out = model(input_values=torch.randn(2, 400), labels=torch.randint(1, 12, (2, 5)))
    out.loss.backward()
    assert calls == [0, 1, 2], "with the model marked FSDP-managed, wav2vec2 runs every layer on every rank"
    return True


def test_wav2vec2_layerdrop_layers_unfused_and_run_on_every_rank():
    run_ranks(_wav2vec2_worker, 2, timeout=300)


def _experts_fused_anyway_worker(rank, world_size):
    import time

    model = MoECausalLM()
    cf.shard(model, cf.CommFuseConfig(schedule="fused", min_fuse_numel=0, exclude_data_dependent=False, timeout_s=4.0))
    assert type(model.layers[0].moe.experts[0].up).__name__ == "RingLinear"
    start = time.monotonic()
    try:
        model(**moe_batch(rank, 0, world_size)).loss.backward()
    except cf.RingCommError as err:
        return time.monotonic() - start, str(err)
    raise AssertionError("ranks ran different experts and no error was raised")


@pytest.mark.slow
def test_experts_fused_anyway_fail_loudly_on_every_rank():
    # With the exclusion off, rank 1 skips the expert it routes no token to while rank 0 runs it: before ring ops
    # carried their identity this paired different layers' bytes (wrong numbers, then a gloo abort).
    results = run_ranks(_experts_fused_anyway_worker, 2, timeout=60)
    for rank, (elapsed, message) in enumerate(results):
        assert elapsed < 6.0, (elapsed, message)
        assert f"This rank is rank {rank}, in " in message and "layers." in message, message
        assert f"rank {1 - rank} was in " in message, message  # a fused layer, or the next FSDP2 unit's gather
    assert "moe.experts." in results[0][1], results[0][1]  # rank 0 ran an expert rank 1 had no token for
