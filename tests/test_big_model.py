"""Big models that never exist whole on one rank, on real 2-rank gloo groups: a model built on the meta device is
sharded (each rank allocating only its own shards), its weights are streamed from a Hugging Face folder written by
a plain single-process ``save_pretrained`` (each rank reading only its slices), and it then computes and trains
exactly as the same model built normally and sharded; ``checkpoint.save_pretrained`` writes each rank's slices into
a folder that ``from_pretrained`` loads in this process."""

import json
import os

import hf_models
import pytest
import torch
from harness import run_ranks
from safetensors.torch import load_file, save_file

import commfuse_dp as cf
from commfuse_dp import checkpoint as ck

CONFIG = {"schedule": "fused", "min_fuse_numel": 0}
OVERRIDES = {"llama": {"tie_word_embeddings": True}, "gpt2": {}, "bert": {}}


def _auto(kind):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    return AutoModelForMaskedLM if kind == "bert" else AutoModelForCausalLM


def _meta_model(kind):
    with torch.device("meta"):
        model = hf_models.build(kind, **OVERRIDES[kind])
    return cf.shard(model, cf.CommFuseConfig(**CONFIG))


def _train_step(model, rank):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = model(**hf_models.batch(rank, 1))
    out.loss.backward()
    opt.step()
    return out.loss.detach()


def _stream_worker(rank, world_size, folder, out_dir, kind, max_shard_size):
    model = _meta_model(kind)
    local = {}
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and hasattr(p, "to_local"), name
        local[name] = (p.to_local().numel(), p.numel())
    with pytest.raises(RuntimeError, match="uninitialised"):
        model(**hf_models.batch(rank, 0))
    ck.load_hf_weights(model, folder)
    buffers = {n: b.clone() for n, b in model.named_buffers()}

    reference = hf_models.build(kind, seed=3, **OVERRIDES[kind])   # the weights the folder holds, built whole
    cf.shard(reference, cf.CommFuseConfig(**CONFIG))
    batch = hf_models.batch(rank, 0)
    with torch.no_grad():
        same_logits = torch.equal(model(**batch).logits, reference(**batch).logits)
    losses = (_train_step(model, rank), _train_step(reference, rank))
    after = {n: p.full_tensor() for n, p in model.named_parameters()}
    reference_after = {n: p.full_tensor() for n, p in reference.named_parameters()}

    ck.save_pretrained(model, out_dir, max_shard_size=max_shard_size)
    with torch.no_grad():
        logits = model(**hf_models.batch(0, 9)).logits  # every rank the same batch: rank 0's is returned
    if rank:
        return local
    return {"local": local, "buffers": buffers, "same_logits": same_logits, "losses": losses, "after": after,
            "reference_after": reference_after, "logits": logits}


@pytest.mark.parametrize("kind,max_shard_size", [("llama", None), ("gpt2", "24KB"), ("bert", None)])
@pytest.mark.slow
def test_meta_build_stream_load_and_export(tmp_path, kind, max_shard_size):
    folder, out_dir = str(tmp_path / "pretrained"), str(tmp_path / "exported")
    whole = hf_models.build(kind, seed=3, **OVERRIDES[kind])
    whole.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json")) == bool(max_shard_size)

    res, local_1 = run_ranks(_stream_worker, 2, (folder, out_dir, kind, max_shard_size or "50GB"), timeout=180)

    # each rank allocated its own shards only: together exactly one copy, each rank about half of it
    for name, (n0, full) in res["local"].items():
        n1 = local_1[name][0]
        assert n0 + n1 == full and max(n0, n1) < full, name
    total = sum(full for _, full in res["local"].values())
    assert sum(n for n, _ in res["local"].values()) <= 0.55 * total
    expected_buffers = dict(whole.named_buffers())
    assert res["buffers"].keys() == expected_buffers.keys()
    for name, buf in expected_buffers.items():   # recomputed after leaving the meta device (rotary inv_freq, ...)
        assert torch.equal(res["buffers"][name], buf), name
    assert res["same_logits"]
    assert torch.equal(*res["losses"])
    for name, value in res["reference_after"].items():
        assert torch.equal(res["after"][name], value), name

    files = sorted(os.listdir(out_dir))
    weights = [f for f in files if f.endswith(".safetensors")]
    assert ("generation_config.json" in files) == (kind != "bert") and "config.json" in files
    if max_shard_size:
        assert len(weights) > 1 and "model.safetensors.index.json" in files
        with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
            assert set(json.load(f)["weight_map"].values()) == set(weights)
    else:
        assert weights == ["model.safetensors"]
    stored = {}
    for name in weights:
        stored.update(load_file(os.path.join(out_dir, name)))
    tied = set(whole.all_tied_weights_keys)
    assert not tied & stored.keys()     # a tied copy is written once, under the name transformers keeps
    for name, value in stored.items():
        assert torch.equal(value, res["after"][name]), name

    loaded = _auto(kind).from_pretrained(out_dir)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), res["after"][name]), name
    with torch.no_grad():
        torch.testing.assert_close(loaded(**hf_models.batch(0, 9)).logits, res["logits"], rtol=1e-5, atol=1e-6)


def _mismatch_worker(rank, world_size, folder):
    with pytest.raises(ValueError, match="device= is for a model on the meta device"):
        cf.shard(hf_models.build("gpt2"), cf.CommFuseConfig(**CONFIG), device="cpu")
    model = _meta_model("gpt2")
    with pytest.raises(KeyError) as err:
        ck.load_hf_weights(model, folder)
    message = str(err.value)
    assert "missing ['transformer.h.0.mlp.c_fc.weight']" in message and "not.a.weight" in message, message
    ck.load_hf_weights(model, folder, strict=False)   # what is there is loaded; the rest stays as it was
    return model.transformer.wte.weight.full_tensor()


def test_missing_and_unexpected_keys_raise(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    state = {k: v.clone() for k, v in hf_models.build("gpt2", seed=4).state_dict().items() if k != "lm_head.weight"}
    del state["transformer.h.0.mlp.c_fc.weight"]
    state["not.a.weight"] = torch.zeros(3)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    wte = run_ranks(_mismatch_worker, 2, (str(folder),), timeout=120)
    for value in wte:
        assert torch.equal(value, state["transformer.wte.weight"])
