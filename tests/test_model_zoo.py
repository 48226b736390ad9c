"""shard() on Hugging Face families beyond GPT-2, Llama and BERT (test_shard_parity.py): parity with one process.

Each family is a tiny model built offline from its real HF class (hidden 32, 2 layers, vocabulary 96, no dropout,
eager attention, GQA where the family has it), sharded at 2 and 3 ranks with both fused schedules and
``min_fuse_numel=0``, and with the peer (``schedule="fsdp2"``: torchtitan's units, placed by module order and tied
parameters, which T5's and OPT's tables and Mixtral's experts put to the test), trained 3 AdamW steps with gradient
clipping against one process on the concatenated batch: losses, grad norms, every parameter and eval logits within
fp32 1e-5. Each case also checks that training moved the parameters (else equality proves nothing) and that some
layers really were fused (``Ring*`` modules; not under the peer).

Why these families: each brings something the covered three do not.

- Mistral: sliding-window attention (window 8 < sequence 12), untied embeddings (the table a ring embedding).
- Phi-3: packed ``qkv_proj`` and ``gate_up_proj`` linears (one fused layer instead of a shared-input group).
- Gemma 2 / Gemma 3: a scaled-embedding subclass (not ``nn.Embedding`` itself, so left to FSDP2), a sliding and
  a global layer, attention and final logit soft-capping (Gemma 2), q/k norms (Gemma 3); tied and untied.
- OPT: biases everywhere, a learned positional embedding subclass, ``project_in``/``project_out`` linears
  (``word_embed_proj_dim`` 16 < hidden 32), tied embeddings.
- Qwen2: q/k/v biases with tied embeddings.
- T5: encoder-decoder (``decoder_input_ids`` and ``labels``), cross-attention (k/v read the encoder output), one
  table shared by encoder and decoder (and the lm_head when tied; untied, the lm_head is fused and the decoder
  output is not rescaled), and the tiny ``relative_attention_bias`` embeddings (8 x 4 tables looked up with a 2-D
  bucket tensor) that become ring embeddings at ``min_fuse_numel=0``.
- Qwen2-MoE and Mixtral: experts are 3-D parameters left to FSDP2 while attention (and Qwen2-MoE's shared
  expert and its 1-row gate, an empty shard on some ranks) are fused. Random tokens route differently on every
  rank; the test checks that they did and reports whether every expert got tokens in every step on every rank.
  Qwen2-MoE (4 experts, top 2) runs the default ``grouped_mm`` experts and every expert gets tokens; Mixtral (16
  experts, top 2) runs the ``eager`` loop over the experts hit, so an expert without tokens on a rank is skipped
  there (data-dependent, but inside one FSDP2 unit) and gets a zero gradient from that rank. The load-balancing
  loss is off (the default): it is not additive over ranks, so no data-parallel run could match one process.

All families of a world size run in a few ``run_ranks`` calls (starting ranks and importing transformers there
costs seconds); a parity failure is collected per family and schedule so that one report lists them all, and
``pytest -s`` prints per case the Ring modules, the share of the tolerance used, the time and the MoE routing.

generate(): greedy ``generate(synced_gpus=True)`` at 2 ranks, a different prompt on each rank and an eos that
makes one rank stop early, equals one process decoding each prompt: tied Qwen2, and T5, whose generate() calls
its encoder directly (shard() registers ``generate`` as an FSDP2 forward method of the root for that).
"""

import time

import pytest
import torch
import torch.distributed as dist

import commfuse_dp as cf
import harness
import hf_models
from harness import run_ranks
from test_shard_parity import FP32, _full, assert_parity

STEPS = 3
V = hf_models.VOCAB
SCHEDULES = ("fused", "slicing", "fsdp2")  # fsdp2: the peer, torchtitan's units (nothing fused)


# ---- the families ------------------------------------------------------------------------------------------

def _common(**overrides):
    """Fields every decoder config here shares (names differ for OPT and T5, which spell out their own)."""
    return dict(dict(vocab_size=V, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager"), **overrides)


def _gemma(version, tied):
    def build():
        import transformers as T

        cls, config = ((T.Gemma2ForCausalLM, T.Gemma2Config) if version == 2
                       else (T.Gemma3ForCausalLM, T.Gemma3TextConfig))
        return cls(config(**_common(head_dim=8, sliding_window=8, query_pre_attn_scalar=8, pad_token_id=0,
                                    bos_token_id=2, eos_token_id=1, tie_word_embeddings=tied,
                                    layer_types=["sliding_attention", "full_attention"])))
    return build


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**_common(sliding_window=8)))


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM
    return Phi3ForCausalLM(Phi3Config(**_common(original_max_position_embeddings=32, resid_pdrop=0.0,
                                                embd_pdrop=0.0, attention_dropout=0.0, pad_token_id=0,
                                                bos_token_id=1, eos_token_id=2)))


def _opt():
    from transformers import OPTConfig, OPTForCausalLM
    return OPTForCausalLM(OPTConfig(vocab_size=V, hidden_size=32, ffn_dim=56, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=16,
                                    dropout=0.0, attention_dropout=0.0, pad_token_id=1, bos_token_id=2,
                                    eos_token_id=2, attn_implementation="eager"))


def _qwen2_tied():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**_common(tie_word_embeddings=True)))


def _t5(tied):
    def build():
        from transformers import T5Config, T5ForConditionalGeneration
        return T5ForConditionalGeneration(T5Config(
            vocab_size=V, d_model=32, d_kv=8, d_ff=56, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=tied,
            attn_implementation="eager"))
    return build


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**_common(moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                                        num_experts=4, num_experts_per_tok=2)))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(**_common(intermediate_size=32, num_local_experts=16,
                                                      num_experts_per_tok=2, experts_implementation="eager")))


FAMILIES = {
    "mistral": _mistral,
    "phi3": _phi3,
    "gemma2-tied": _gemma(2, tied=True),
    "gemma2-untied": _gemma(2, tied=False),
    "gemma3-tied": _gemma(3, tied=True),
    "gemma3-untied": _gemma(3, tied=False),
    "opt": _opt,
    "qwen2-tied": _qwen2_tied,
    "t5-tied": _t5(tied=True),
    "t5-untied": _t5(tied=False),
    "qwen2-moe": _qwen2_moe,
    "mixtral": _mixtral,
}

# Families per run_ranks call: a crash in one call leaves the others to run and report.
CALLS = (("mistral", "phi3", "gemma2-tied", "gemma2-untied"),
         ("gemma3-tied", "gemma3-untied", "opt", "qwen2-tied"),
         ("t5-tied", "t5-untied", "qwen2-moe", "mixtral"))
assert sorted(sum(CALLS, ())) == sorted(FAMILIES)


def build(name, seed=0):
    torch.manual_seed(seed)
    return FAMILIES[name]()


def batch(model, rank, step, micro=0, size=2):
    """A rank's batch: random tokens as input and labels (decoder-only) or source and target (encoder-decoder)."""
    if not model.config.is_encoder_decoder:
        return hf_models.batch(rank, step, micro, size)
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    source = torch.randint(0, V, (size, hf_models.SEQ), generator=gen)
    target = torch.randint(0, V, (size, 8), generator=gen)
    start = torch.full((size, 1), model.config.decoder_start_token_id)
    return {"input_ids": source, "decoder_input_ids": torch.cat([start, target[:, :-1]], 1), "labels": target}


# ---- one case ------------------------------------------------------------------------------------------------

def _train(model, batch_of_step, steps=STEPS):
    """AdamW with clipping, like test_shard_parity's, at lr=1e-4 instead of 1e-3. AdamW's update lr*m/(sqrt(v)+eps)
    turns a float summation-order difference dg in a small gradient g into an update difference of about
    lr*dg/(|g|+eps), so at lr=1e-3 some of these models end up 1-3e-5 apart after 3 steps without any bug.
    Measured at 3 ranks, lr=1e-3: Qwen2-MoE gradients within 5e-7 of the largest one at the first step, yet one
    o_proj weight whose first gradient is -1.9e-8 sharded and -1.7e-8 in one process ends 2.5e-5 apart after 3
    AdamW steps (1e-8 apart after 3 SGD steps). The gain is proportional to lr: at 1e-4 the closest case (Gemma 3
    tied, 2 ranks) uses 37 % of the tolerance, and training still moves weights by about 3e-4 (30x it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    losses, norms = [], []
    for step in range(steps):
        loss = model(**batch_of_step(step)).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        norms.append(_full(norm))
    return torch.stack(losses), torch.stack(norms)


def _reference(rank, world_size, name):
    """One process on the concatenated batch, computed on rank 0 and sent to all: (losses, grad norms, params,
    eval logits of every rank's probe, how far training moved the parameters)."""
    summary = [None]
    if rank == 0:
        ref = build(name)
        initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
        losses, norms = _train(ref, lambda s: hf_models.concat([batch(ref, r, s) for r in range(world_size)]))
        params = {n: p.detach() for n, p in ref.named_parameters()}
        moved = max((params[n] - p).abs().max().item() for n, p in initial.items())
        ref.eval()
        with torch.no_grad():
            logits = [ref(**batch(ref, r, 99)).logits for r in range(world_size)]
        summary = [(losses, norms, params, logits, moved)]
    dist.broadcast_object_list(summary, src=0)
    return summary[0]


def _count_routing(model):
    """Per MoE router: per forward that follows, the tokens routed to each expert (top-k slots counted)."""
    counts = {}

    def hook(name, experts):
        def record(module, args, output):
            counts.setdefault(name, []).append(torch.bincount(output[-1].reshape(-1), minlength=experts).tolist())
        return record

    for name, module in model.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(hook(name, module.num_experts))
    return counts


def run_zoo_case(rank, world_size, name, schedule, reference):
    """The sharded run of one case, in run_case's format (``test_shard_parity``) against ``reference``."""
    ref_losses, ref_norms, ref_params, ref_logits, moved = reference
    model = build(name)
    cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))
    ring_modules = sum(type(m).__name__.startswith("Ring") for m in model.modules())
    routing = _count_routing(model)
    losses, norms = _train(model, lambda s: batch(model, rank, s))
    routed = {layer: list(steps) for layer, steps in routing.items()}  # the training forwards only
    if any(p.ndim == 3 for p in model.parameters()):
        assert routed, f"{name}: no MoE router found (class names ending in TopKRouter) to count the routing"
    dist.all_reduce(losses)
    losses /= world_size
    params = {n: _full(p) for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        logits = model(**batch(model, rank, 99)).logits
    return {"losses": (losses, ref_losses), "norms": (norms, ref_norms), "params": (params, ref_params),
            "logits": (logits, ref_logits[rank]), "moved": moved, "ring_modules": ring_modules, "routing": routed}


def _tolerance_used(result):
    """The largest |ours - ref| / (atol + rtol |ref|) over everything assert_parity compares (1: at the limit)."""
    def used(ours, ref):
        return ((ours.double() - ref.double()).abs() / (FP32["atol"] + FP32["rtol"] * ref.double().abs())).max().item()

    ours, ref = result["params"]
    return max([used(*result[k]) for k in ("losses", "norms", "logits")]
               + [used(ours[n], ref[n]) for n in ref if n in ours and ours[n].shape == ref[n].shape])


def _zoo_worker(rank, world_size, names):
    """Every case of ``names``. A parity failure (checked after the case's last collective) is recorded, not
    raised, so that the other cases still run. Returns {"family/schedule": summary of this rank}."""
    # One intra-op thread a rank: ranks share the machine's cores, and a parallel op on tiny tensors then waits
    # for descheduled threads (index_add_ in Mixtral's expert loop: 60 ms a call with 2 threads here, 5 us with 1).
    torch.set_num_threads(1)
    summary = {}
    for name in names:
        began = time.perf_counter()
        reference = _reference(rank, world_size, name)
        for schedule in SCHEDULES:
            label = f"{name}/{schedule}"
            result = run_zoo_case(rank, world_size, name, schedule, reference)
            seconds, began = time.perf_counter() - began, time.perf_counter()
            try:
                assert_parity(result, tol=FP32, label=label)
                assert result["moved"] > 10 * FP32["atol"], \
                    f"{label}: training moved the parameters by {result['moved']:.1e} only"
                assert result["ring_modules"] > 0 or schedule == "fsdp2", f"{label}: no layer was fused"
                failure = None
            except AssertionError as err:
                failure = str(err)
            summary[label] = {"failure": failure, "rings": result["ring_modules"], "routing": result["routing"],
                              "used": _tolerance_used(result), "seconds": seconds}
    return summary


MODEL_MODULES = [f"transformers.models.{m}.modeling_{m}"
                 for m in ("mistral", "phi3", "gemma2", "gemma3", "opt", "qwen2", "t5", "qwen2_moe", "mixtral")]


def _preload():
    """Ranks start from harness's fork server. If this file starts it (run alone), have it import transformers and
    the model modules once, instead of every rank of every call (~3 s of CPU a rank; it took 110 s instead of 66 s
    for the two parity tests here). No effect if it runs already (other test files first); a module that fails to
    import there is skipped (multiprocessing's rule), so this changes only the time."""
    harness._context().set_forkserver_preload(["torch", "torch.distributed", "harness", "test_model_zoo",
                                               *MODEL_MODULES])


def _routing_note(label, by_rank):
    """(failure or None, note) on the routing of a MoE case: it must differ between ranks."""
    failure = None
    if all(r == by_rank[0] for r in by_rank):
        failure = f"{label}: every rank routed its tokens alike; the MoE case proves less than meant"
    idle = [(r, layer.split(".")[2], step, e) for r, routing in enumerate(by_rank) for layer, steps in routing.items()
            for step, counts in enumerate(steps) for e, n in enumerate(counts) if n == 0]
    if not idle:
        return failure, "every expert got tokens in every step on every rank"
    return failure, (f"{len(idle)} times an expert got no tokens in a step on a rank, e.g. (rank, layer, step, "
                     f"expert) {idle[:3]}")


def _check_world(world_size):
    _preload()
    failures, report = [], []
    for names in CALLS:
        began = time.perf_counter()
        try:
            per_rank = run_ranks(_zoo_worker, world_size, (names,), timeout=300)
        except AssertionError as err:  # a rank raised or hung: every case of the call fails with its error
            failures.append(f"{'/'.join(names)} at {world_size} ranks: {err}")
            continue
        for label, first in per_rank[0].items():
            cases = [summary[label] for summary in per_rank]
            failed = [f"rank {r} {label}: {case['failure']}" for r, case in enumerate(cases) if case["failure"]]
            line = (f"{world_size} ranks {label}: {'FAIL' if failed else 'ok'}, {first['rings']} Ring modules, "
                    f"{max(case['used'] for case in cases):.0%} of the tolerance used, {first['seconds']:.1f} s")
            if first["routing"]:
                failure, note = _routing_note(label, [case["routing"] for case in cases])
                failed += [failure] if failure else []
                line += f"; {note}"
            failures += failed
            report.append(line)
        report.append(f"{world_size} ranks: {', '.join(names)} in {time.perf_counter() - began:.1f} s")
    print("\n".join(report))
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
def test_model_zoo_two_ranks():
    _check_world(2)


@pytest.mark.slow
def test_model_zoo_three_ranks():
    _check_world(3)


# ---- generate() ------------------------------------------------------------------------------------------------

def _generation_model(name):
    """Tied Qwen2 or T5 with larger initial weights: at the default scale greedy decoding of these tiny models
    repeats one token (for Qwen2 the prompt's last one: the residual stream is still its embedding)."""
    torch.manual_seed(0)
    if name == "qwen2-tied":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        model = Qwen2ForCausalLM(Qwen2Config(**_common(tie_word_embeddings=True, initializer_range=0.3)))
    else:
        from transformers import T5Config, T5ForConditionalGeneration
        model = T5ForConditionalGeneration(T5Config(
            vocab_size=V, d_model=32, d_kv=8, d_ff=56, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, initializer_factor=15.0,
            attn_implementation="eager"))
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _prompt(rank):
    """One prompt a rank, of a different length on every rank."""
    return torch.randint(0, V, (1, 5 + 2 * rank), generator=torch.Generator().manual_seed(500 + rank))


def _greedy(model, prompt, eos=None, **kwargs):
    """Greedy decoding of 6 tokens: the new tokens (the decoder's, from its start token, for encoder-decoders)."""
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                         eos_token_id=eos, **kwargs)
    return out[0, 0 if model.config.is_encoder_decoder else prompt.shape[1]:]


def _stopping_token(free):
    """A token that ends one rank's greedy continuation early (at step 2 or later) and appears nowhere in the
    others', so that the ranks stop at different steps; the same choice on every rank."""
    for r, tokens in enumerate(free):
        for pos in range(1, len(tokens) - 1):
            token = int(tokens[pos])
            if token not in tokens[:pos].tolist() and all(token not in other.tolist()
                                                          for s, other in enumerate(free) if s != r):
                return token
    raise AssertionError(f"no token ends one rank's continuation early: {[t.tolist() for t in free]}")


def _generate_worker(rank, world_size, name):
    torch.set_num_threads(1)
    ref = _generation_model(name)
    free = [_greedy(ref, _prompt(r)) for r in range(world_size)]
    eos = _stopping_token(free)
    expected = [_greedy(ref, _prompt(r), eos) for r in range(world_size)]
    assert len({len(e) for e in expected}) > 1, "the ranks would stop at the same step"
    seen = {}
    for schedule in SCHEDULES:
        model = cf.shard(_generation_model(name), cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))
        assert schedule == "fsdp2" or any(type(m).__name__.startswith("Ring") for m in model.modules()), \
            "no layer was fused"
        for label, stop in (("no eos", None), ("eos", eos)):
            ours = _greedy(model, _prompt(rank), stop, synced_gpus=True)
            want = free[rank] if stop is None else expected[rank]
            assert torch.equal(ours, want), f"{schedule}, {label}: rank {rank} decoded {ours.tolist()}, " \
                                            f"one process {want.tolist()}"
            seen[f"{schedule}/{label}"] = ours.tolist()
    return seen


@pytest.mark.parametrize("name", ["qwen2-tied", "t5-tied"])  # T5: generate() calls its encoder directly
def test_generate_greedy_matches_one_process(name):
    """Greedy ``generate(synced_gpus=True)`` of a sharded model at 2 ranks, a different prompt on each rank and an
    eos that one rank produces early (it keeps running forwards until the other is done), equals one process
    decoding each prompt alone. ``synced_gpus`` is needed when ranks stop at different steps: transformers turns
    it on by itself when the model has FSDP's ``_is_fsdp_managed_module`` flag, which ``fully_shard`` sets on the
    root today; with ``synced_gpus=False`` the rank still decoding waits in its next ring for ``timeout_s``."""
    seen = run_ranks(_generate_worker, 2, (name,), timeout=120)
    print(name, seen)
