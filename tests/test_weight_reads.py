"""A fused parameter read from outside its fused forward: exact (the full weight, its gradient summed over ranks)
or refused on every rank, never silently different. See commfuse_dp/fused/reads.py."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from transformers.modeling_outputs import CausalLMOutput

import commfuse_dp as cf
import hf_models
from harness import run_ranks
from test_shard_parity import FP32, _full, assert_parity, run_case
from test_tied_embeddings import TIED


def chunked_head(model, chunk=7):
    """Liger's / TRL's pattern: the forward runs the backbone and projects with ``lm_head.weight`` itself, in chunks
    of tokens (``.full_tensor()`` when it is a DTensor, as TRL's ``add_fused_lm_head`` does)."""
    import types

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        weight = self.lm_head.weight
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        target = labels[:, 1:].reshape(-1) if labels is not None else None
        loss = 0.0
        for lo in range(0, h.shape[0], chunk):
            if target is not None:
                loss = loss + F.cross_entropy(F.linear(h[lo:lo + chunk], weight), target[lo:lo + chunk],
                                              reduction="sum")
        logits = F.linear(hidden, weight)
        return CausalLMOutput(loss=loss / max(h.shape[0], 1) if target is not None else None, logits=logits)

    model.forward = types.MethodType(forward, model)
    return model


def _head_worker(rank, world_size, cases):
    for schedule, accum in cases:
        config = cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0)

        def prepare(model):  # tied: the table is read by the head and looked up by the ring embedding
            return chunked_head(hf_models.build("llama", tie_word_embeddings=True))

        result = run_case(rank, world_size, "llama", schedule, accum=accum, prepare=prepare, config=config)
        assert_parity(result, tol=TIED, label=f"chunked head {schedule} accum{accum}")
    return True


@pytest.mark.parametrize("world_size,cases", [(2, [("fused", 1), ("slicing", 1), ("fused", 2)]),
                                              (3, [("fused", 1), ("slicing", 2)])])
@pytest.mark.slow
def test_chunked_loss_head_reading_lm_head_weight_matches_single_process(world_size, cases):
    run_ranks(_head_worker, world_size, (cases,), timeout=500)


def _after_forward_worker(rank, world_size):
    """A custom loss computed after ``model(...)`` returned, from ``model.lm_head.weight``, and the logits'
    gradient flowing through the fused lm_head too: both uses of the table sum over ranks."""
    results = {}
    for schedule in ("fused", "slicing"):
        model = hf_models.build("llama", tie_word_embeddings=True)
        ref = hf_models.build("llama", tie_word_embeddings=True)
        cf.shard(model, cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))

        def step_of(m, batch):
            out = m(**batch, output_hidden_states=True)
            extra = F.linear(out.hidden_states[-1], m.lm_head.weight).logsumexp(-1).mean()
            return out.loss + 0.1 * extra

        def losses(m, batches):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            seen = []
            for step in range(3):
                loss = step_of(m, batches(step))
                loss.backward()
                opt.step()
                opt.zero_grad()
                seen.append(loss.detach())
            return torch.stack(seen)

        ours = losses(model, lambda s: hf_models.batch(rank, s))
        theirs = losses(ref, lambda s: hf_models.concat([hf_models.batch(r, s) for r in range(world_size)]))
        dist.all_reduce(ours)
        torch.testing.assert_close(ours / world_size, theirs, **FP32)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(_full(dict(model.named_parameters())[name]), p.detach(), **TIED,
                                       msg=lambda m: f"{schedule} {name}: {m}")
        # outside a step the attribute is the DTensor parameter itself, as model.parameters() has it
        assert model.lm_head.weight is dict(model.named_parameters())["model.embed_tokens.weight"]
        results[schedule] = True
    return results


def test_weight_read_after_forward_matches_single_process():
    run_ranks(_after_forward_worker, 2, timeout=300)


def _audit_worker(rank, world_size):
    """What else touches a fused parameter after shard(): each exact, or refused with a message that says what."""
    outcomes = {}
    config = cf.CommFuseConfig(schedule="fused", min_fuse_numel=0)

    def sharded():
        return cf.shard(hf_models.build("llama", tie_word_embeddings=True), config)

    def refused(action, words):
        model = sharded()
        try:
            action(model)
            model(**hf_models.batch(rank, 0)).loss.backward()
        except RuntimeError as e:
            assert all(w in str(e) for w in words), str(e)
            return True
        return False

    # tie_weights() on a table tied already rebinds the same parameter: allowed, training stays exact
    model = sharded()
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    outcomes["tie_weights"] = "kept"
    outcomes["resize"] = refused(lambda m: m.resize_token_embeddings(128), ["resize_token_embeddings", "before shard"])
    outcomes["new tie"] = refused(lambda m: setattr(m.lm_head, "weight", torch.nn.Parameter(torch.zeros(3))),
                                  ["lm_head.weight", "after shard()"])
    outcomes["set_input_embeddings"] = refused(
        lambda m: m.set_input_embeddings(torch.nn.Embedding(hf_models.VOCAB, 32)), ["replaced in its parent"])

    def parametrize(m):
        from torch.nn.utils import parametrize as P

        class Scale(torch.nn.Module):
            def forward(self, w):
                return 2 * w

        P.register_parametrization(m.model.layers[0].mlp.down_proj, "weight", Scale())

    outcomes["parametrize"] = refused(parametrize, ["down_proj", "shard()"])

    def weight_norm(m):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.nn.utils.weight_norm(m.model.layers[0].mlp.down_proj)

    outcomes["weight_norm"] = refused(weight_norm, ["down_proj", "shard()"])

    # an EMA of the sharded parameters (detached DTensor copies) equals one process's EMA
    model, ref = sharded(), hf_models.build("llama", tie_word_embeddings=True)
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    ema_ref = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for m, e, batches in ((model, ema, lambda s: hf_models.batch(rank, s)),
                          (ref, ema_ref, lambda s: hf_models.concat([hf_models.batch(r, s) for r in range(2)]))):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for step in range(3):
            m(**batches(step)).loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for n, p in m.named_parameters():
                    e[n].lerp_(p.detach(), 0.1)
    for n in ema_ref:
        torch.testing.assert_close(_full(ema[n]), ema_ref[n], **TIED)
    outcomes["ema"] = "exact"

    # state_dict() between forward and backward: the values of the step's parameters, and the step stays exact
    model, ref = sharded(), hf_models.build("llama", tie_word_embeddings=True)
    out = model(**hf_models.batch(rank, 0))
    state = {k: _full(v) for k, v in model.state_dict().items()}
    out.loss.backward()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v)
    ref(**hf_models.concat([hf_models.batch(r, 0) for r in range(2)])).loss.backward()
    for n, p in ref.named_parameters():
        grad = dict(model.named_parameters())[n].grad
        torch.testing.assert_close(_full(grad), p.grad, **FP32, msg=lambda m: f"grad {n}: {m}")
    outcomes["state_dict in a step"] = "exact"
    return outcomes


def test_what_else_touches_a_fused_parameter():
    results = run_ranks(_audit_worker, 2, timeout=300)
    assert results[0] == results[1]
    assert all(v is True or v in ("kept", "exact") for v in results[0].values()), results[0]

