"""Hugging Face decoders made tensor-parallel (``commfuse_dp.tp.tensor_parallel``): Llama, Qwen2, Mistral and a
tied Gemma at TP 2 and 4 (and 3, a sequence and a vocabulary that do not divide) give one process's losses and
gradients over 5 AdamW steps with gradient accumulation and clipping; a model whose key/value heads do not divide
is refused on every rank."""

import pytest
import torch

from harness import run_ranks

STEPS, MICRO, BATCH, VOCAB = 5, 2, 2, 101


def _model(family: str, heads: int, kv: int, seed: int = 0, attention: str = "sdpa"):
    import transformers

    kinds = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
             "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 8}),
             "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {"tie_word_embeddings": True})}
    config_cls, model_cls, extra = kinds[family]
    config = config_cls(vocab_size=VOCAB, hidden_size=4 * heads, intermediate_size=40, num_hidden_layers=2,
                        num_attention_heads=heads, num_key_value_heads=kv, head_dim=4, max_position_embeddings=64,
                        pad_token_id=0, attn_implementation=attention, **extra)
    torch.manual_seed(seed)
    return model_cls(config)


def _batches(seq: int, batch: int = BATCH):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS * MICRO):
        ids = torch.randint(1, VOCAB, (batch, seq), generator=gen)
        labels = ids.clone()
        labels[:, :2] = -100  # (some tokens not counted)
        out.append((ids, labels))
    return out


def _train(model, seq, clip, rows=slice(None), batch=BATCH):
    """5 AdamW steps of 2 micro-batches each (``rows`` of each); the losses and each step's clipped gradients."""
    # (a fine-tuning rate: at 1e-2, AdamW's per-element normalisation lifts the float32 reordering of the group's
    # sums past 1e-5 in a few gradient elements by the third step)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = iter(_batches(seq, batch))
    losses, grads = [], []
    for _ in range(STEPS):
        for _ in range(MICRO):
            ids, labels = next(batches)
            loss = model(input_ids=ids[rows], labels=labels[rows]).loss
            (loss / MICRO).backward()
            losses.append(loss.item())
        clip()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def _assert_grads(grads, want_grads, sharded):
    """Each step's gradients of this rank against one process's, narrowed to this rank's parts."""
    assert set(grads[0]) == set(want_grads[0])
    for step, (got, want) in enumerate(zip(grads, want_grads)):
        for name, g in got.items():
            w = want[name]
            if name in sharded:
                dim, start, count, _ = sharded[name]
                w = w.narrow(dim, start, count)
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step} {name}: {m}")


def _tp_worker(rank, world_size, family, heads, kv, seq, attention):
    from commfuse_dp.handle import handle_of
    from commfuse_dp.tp import clip_grad_norm_, tensor_parallel

    model = tensor_parallel(_model(family, heads, kv, attention=attention))
    tp = handle_of(model).tp
    losses, grads = _train(model, seq, lambda: clip_grad_norm_(model, 1.0))
    return losses, grads, dict(tp.sharded)


CASES = [("llama", 2, 8, 4, 12, "sdpa"), ("qwen2", 2, 8, 4, 12, "sdpa"), ("mistral", 2, 8, 4, 12, "sdpa"),
         ("gemma", 2, 8, 4, 12, "sdpa"), ("llama", 2, 8, 4, 12, "eager"), ("llama", 4, 8, 4, 12, "sdpa"),
         ("gemma", 4, 8, 4, 12, "sdpa"), ("qwen2", 4, 8, 4, 12, "sdpa"), ("mistral", 4, 8, 4, 12, "sdpa"),
         ("qwen2", 3, 6, 3, 13, "sdpa")]
FAST = {CASES[0], CASES[3]}


@pytest.mark.parametrize("family,world_size,heads,kv,seq,attention", [
    c if c in FAST else pytest.param(*c, marks=pytest.mark.slow) for c in CASES])
def test_tensor_parallel_model_trains_as_one_process(family, world_size, heads, kv, seq, attention):
    reference = _model(family, heads, kv, attention=attention)
    want_losses, want_grads = _train(reference, seq,
                                     lambda: torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0))
    for losses, grads, sharded in run_ranks(_tp_worker, world_size, (family, heads, kv, seq, attention), timeout=300):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-5)
        _assert_grads(grads, want_grads, sharded)


def _refused_worker(rank, world_size):
    from commfuse_dp.tp import tensor_parallel

    try:
        tensor_parallel(_model("llama", 8, 2))
    except ValueError as err:
        return str(err)
    return None


def test_key_value_heads_that_do_not_divide_are_refused_on_every_rank():
    for message in run_ranks(_refused_worker, 4):
        assert message is not None and "2 key/value heads" in message and "not replicated" in message


def _reference_schedule_worker(rank, world_size):
    from commfuse_dp.tp import tensor_parallel

    fused = tensor_parallel(_model("llama", 8, 4))
    plain = tensor_parallel(_model("llama", 8, 4), fused=False)
    ids, labels = _batches(13)[0]
    out = []
    for model in (fused, plain):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    return out


def test_fused_rings_match_the_reference_schedule():
    """The fused schedule (each hop beside a GEMM piece) against the reference on the same rings (every gather
    waited for before its GEMM, every reduce-scatter after it), at TP 2 on a sequence that does not divide."""
    for (loss, grads), (want_loss, want_grads) in run_ranks(_reference_schedule_worker, 2):
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(g, want_grads[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _tp_dp_worker(rank, world_size, family):
    """TP 2 x data parallel 2: ``tensor_parallel`` over the TP group, then ``shard()`` over the data-parallel one;
    each data-parallel rank its half of every micro-batch."""
    from torch.distributed.device_mesh import init_device_mesh

    from commfuse_dp import CommFuseConfig, shard
    from commfuse_dp.handle import handle_of
    from commfuse_dp.tp import clip_grad_norm_, tensor_parallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tensor_parallel(_model(family, 8, 4), mesh["tp"].get_group())
    shard(model, CommFuseConfig(schedule="fused"), mesh=mesh["dp"])
    half = mesh["dp"].get_local_rank()
    losses, grads = _train(model, 12, lambda: clip_grad_norm_(model, 1.0), rows=slice(half, half + 1))
    whole = [{n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in step.items()} for step in grads]
    return losses, whole, dict(handle_of(model).tp.sharded)


@pytest.mark.parametrize("family", ["llama", *(pytest.param(f, marks=pytest.mark.slow)
                                               for f in ("gemma", "qwen2", "mistral"))])
def test_tensor_parallel_beside_data_parallel_trains_as_one_process(family):
    """Each data-parallel rank's loss is the mean over its half of the batch, and the gradients are averaged over
    the data-parallel group: one process's gradients of the mean of the two halves' losses."""
    reference = _model(family, 8, 4)
    halves = [_train_halves(reference, 12)]
    want_losses, want_grads = halves[0]
    for rank, (losses, grads, sharded) in enumerate(run_ranks(_tp_dp_worker, 4, (family,), timeout=300)):
        half = rank // 2
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses[half::2]), rtol=1e-5, atol=1e-5)
        _assert_grads(grads, want_grads, sharded)


def _train_halves(model, seq, parts=2):
    """One process's run of what ``parts`` data-parallel ranks do: each micro-batch's rows, one a rank, their
    losses averaged (the losses of every part are returned, interleaved)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = iter(_batches(seq, parts))
    losses, grads = [], []
    for _ in range(STEPS):
        for _ in range(MICRO):
            ids, labels = next(batches)
            halves = [model(input_ids=ids[h:h + 1], labels=labels[h:h + 1]).loss for h in range(parts)]
            (sum(halves) / parts / MICRO).backward()
            losses += [h.item() for h in halves]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def _tp_size_worker(rank, world_size, replicate):
    from commfuse_dp import CommFuseConfig, describe, shard
    from commfuse_dp.handle import handle_of
    from commfuse_dp.tp import clip_grad_norm_

    # (min_fuse_numel=0: every linear big enough to fuse, so the TP layers must be kept off the fused path)
    model = shard(_model("llama", 8, 4), CommFuseConfig(schedule="fused", tp_size=2, replicate=replicate,
                                                        min_fuse_numel=0))
    tp = handle_of(model).tp
    part, parts = rank // 2, world_size // 2  # (consecutive ranks share a TP group)
    losses, grads = _train(model, 12, lambda: clip_grad_norm_(model, 1.0), rows=slice(part, part + 1), batch=parts)
    whole = [{n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in step.items()} for step in grads]
    return losses, whole, dict(tp.sharded), str(describe(model))


@pytest.mark.parametrize("world_size,replicate", [(4, 1), pytest.param(8, 2, marks=pytest.mark.slow)])
def test_shard_with_tp_size_builds_the_mesh_and_trains_as_one_process(world_size, replicate):
    """``shard(model, CommFuseConfig(tp_size=2))`` on 4 ranks (and with ``replicate=2`` on 8: HSDP beside TP):
    TP over consecutive pairs, the data-parallel engine over the ranks of each TP position; describe() shows
    both."""
    parts = world_size // 2
    reference = _model("llama", 8, 4)
    want_losses, want_grads = _train_halves(reference, 12, parts)
    results = run_ranks(_tp_size_worker, world_size, (replicate,), timeout=300)
    for rank, (losses, grads, sharded, text) in enumerate(results):
        part = rank // 2
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses[part::parts]), rtol=1e-5,
                                   atol=1e-5)
        _assert_grads(grads, want_grads, sharded)
        assert "tensor parallel: 2 ranks" in text and f"this rank's TP group [{rank - rank % 2}, " in text, text
        assert "model.layers.1.mlp" in text and "tensor-parallel: its TP rings read its weights" in text, text
        # 2 decoder layers x (2 + 2) ops x 2 ways + (embedding, lm_head) x 2 ways = 20, each (2-1)/2 x 32 x 4 B a token
        assert "20 ring operations a step, 1.2 KiB sent per token" in text, text
        if replicate > 1:
            assert "in each of 2 copies (HSDP)" in text and "dp_replicate 2 x dp_shard 2 x tp 2" in text, text


def _tp_size_refused_worker(rank, world_size, changes):
    from commfuse_dp import CommFuseConfig, shard

    try:
        shard(_model("llama", 8, 4), CommFuseConfig(schedule="fused", **changes))
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("changes,says", [({"tp_size": 3}, "does not divide the 4 ranks"),
                                          ({"tp_size": 2, "replicate": 4}, "does not divide the 2 data-parallel")])
def test_shard_refuses_a_tp_size_it_cannot_run_on_every_rank(changes, says):
    for message in run_ranks(_tp_size_refused_worker, 4, (changes,)):
        assert message is not None and says in message, message


def _checkpointing_worker(rank, world_size):
    from commfuse_dp.tp import clip_grad_norm_, tensor_parallel

    model = _model("llama", 8, 4)
    model.activation_checkpointing_enable()
    model.train()
    tensor_parallel(model)
    from commfuse_dp.handle import handle_of

    return (*_train(model, 12, lambda: clip_grad_norm_(model, 1.0)), dict(handle_of(model).tp.sharded))


def test_gradient_checkpointing_recomputes_the_tp_rings_exactly():
    """transformers' gradient checkpointing re-runs each decoder layer's forward (its TP rings included, on every
    rank in the same order) in the backward: one process's losses and gradients."""
    reference = _model("llama", 8, 4)
    reference.activation_checkpointing_enable()
    reference.train()
    want_losses, want_grads = _train(reference, 12, lambda: torch.nn.utils.clip_grad_norm_(reference.parameters(),
                                                                                          1.0))
    for losses, grads, sharded in run_ranks(_checkpointing_worker, 2):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-5)
        _assert_grads(grads, want_grads, sharded)


def _lora_worker(rank, world_size):
    import peft

    from commfuse_dp.tp import tensor_parallel

    model = tensor_parallel(_model("llama", 8, 4))
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    ids, labels = _batches(12)[0]
    try:
        model(input_ids=ids, labels=labels)
    except RuntimeError as err:
        return str(err)
    return None


def test_an_adapter_on_a_tp_projection_is_refused_on_every_rank():
    """PEFT's LoRA replaces q_proj with its own module, which the TP layer would not call: refused, not skipped."""
    pytest.importorskip("peft")
    for message in run_ranks(_lora_worker, 2):
        assert message is not None and "peft" in message.lower() and "not supported under tensor parallelism" in \
            message, message


def _different_batches_worker(rank, world_size, embeds):
    from commfuse_dp.tp import tensor_parallel

    model = tensor_parallel(_model("llama", 8, 4))
    ids, labels = _batches(12)[rank]  # each rank its own batch: the mistake
    try:
        if embeds:
            model(inputs_embeds=torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(rank)), labels=labels)
        else:
            model(input_ids=ids, labels=labels)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize("embeds", [False, True])
def test_tp_ranks_given_different_batches_are_refused_on_every_rank(embeds):
    for message in run_ranks(_different_batches_worker, 2, (embeds,)):
        assert message is not None and "every rank of a TP group must get the same batch" in message, message
