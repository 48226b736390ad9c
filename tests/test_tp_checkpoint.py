"""Sharded checkpoints of a tensor-parallel model (``commfuse_dp.checkpoint``, ``tp_state.py``): saved at TP 2 x
FSDP 2, a resume is bit for bit the uninterrupted run, and the folder loads at TP 4, at FSDP 4 without TP and in
one process to the saved model's loss; also through ``AsyncSaver``, for a tied Gemma and beside HSDP copies. The
vocabulary (97 rows) and the MLP's inner size (42) do not divide over 4 ranks. A model built on the meta device
and made TP 2 x FSDP 2 reads its slices of a Hugging Face folder (``load_hf_weights``) to one process's loss."""

import os

import pytest
import torch

from harness import run_ranks

VOCAB = 97


def _model(family: str = "llama"):
    import transformers

    kinds = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
             "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {"tie_word_embeddings": True})}
    config_cls, model_cls, extra = kinds[family]
    config = config_cls(vocab_size=VOCAB, hidden_size=16, intermediate_size=42, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, head_dim=4, max_position_embeddings=64,
                        pad_token_id=0, **extra)
    torch.manual_seed(0)
    return model_cls(config)


def _sharded(family: str, tp: int, replicate: int = 1, meta: bool = False):
    import commfuse_dp as cf

    if meta:
        with torch.device("meta"):
            model = _model(family)
    else:
        model = _model(family)
    if tp == 0:  # one process, not sharded
        return model
    return cf.shard(model, cf.CommFuseConfig(tp_size=tp, replicate=replicate, min_fuse_numel=0))


def _batch(step: int, row: int):
    gen = torch.Generator().manual_seed(1000 * step + row)
    ids = torch.randint(1, VOCAB, (2, 10), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _steps(model, opt, row: int, start: int, count: int) -> list[float]:
    losses = []
    for step in range(start, start + count):
        loss = model(**_batch(step, row)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _probe(model) -> float:
    with torch.no_grad():
        return model(**_batch(99, 0)).loss.item()


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_resume_reshard(rank, world, path, family, replicate, asynchronous):
    from commfuse_dp import checkpoint as ck
    model = _sharded(family, 2, replicate)
    row = rank // 2  # (TP groups are consecutive ranks: each data-parallel rank its own batch rows)
    opt = _opt(model)
    _steps(model, opt, row, 0, 2)
    saved_probe = _probe(model)
    if asynchronous:
        saver = ck.AsyncSaver()
        saver.save(path, [model], [(model, opt)])
        saver.close()
    else:
        ck.save_sharded(path, [model], [(model, opt)])
    go_on = _steps(model, opt, row, 2, 3)  # the optimizer's own state must be intact after the save
    resumed = _sharded(family, 2, replicate)
    resumed_opt = _opt(resumed)
    ck.load_sharded(path, [resumed], [(resumed, resumed_opt)])
    out = {"saved_probe": saved_probe, "go_on": go_on, "resumed": _steps(resumed, resumed_opt, row, 2, 3)}
    for tp_size in (4, 1):
        other = _sharded(family, tp_size)
        other_opt = _opt(other)
        ck.load_sharded(path, [other], [(other, other_opt)])
        out[f"tp{tp_size}"] = _probe(other)
        out[f"tp{tp_size}_step"] = _steps(other, other_opt, 0, 2, 1)  # (its optimizer state loaded: it steps)
    return out


def _one_process(path, family):
    from commfuse_dp import checkpoint as ck

    model = _model(family)
    ck.load_sharded(path, [model])
    return _probe(model)


@pytest.mark.slow
@pytest.mark.parametrize("family,replicate,asynchronous", [("llama", 1, False), ("gemma", 1, True),
                                                           ("llama", 2, False)])
def test_tensor_parallel_checkpoint_resumes_exactly_and_reshards(tmp_path, family, replicate, asynchronous):
    path = os.fspath(tmp_path / "ckpt")
    results = run_ranks(_save_resume_reshard, 4, args=(path, family, replicate, asynchronous), timeout=400)
    for r in results:
        assert r["resumed"] == r["go_on"], "a resume must repeat the uninterrupted run bit for bit"
    want = results[0]["saved_probe"]
    assert all(r["saved_probe"] == want for r in results)
    for key in ("tp4", "tp1"):
        for r in results:
            assert abs(r[key] - want) < 1e-5, (key, r[key], want)
    assert abs(_one_process(path, family) - want) < 1e-5


def _meta_load(rank, world, folder, family):
    from commfuse_dp import checkpoint as ck

    model = _sharded(family, 2, meta=True)
    assert all(p.device.type == "cpu" for p in model.parameters())
    ck.load_hf_weights(model, folder)
    return _probe(model)


@pytest.mark.parametrize("family", ["llama", pytest.param("gemma", marks=pytest.mark.slow)])
def test_a_meta_model_made_tensor_parallel_reads_its_slices_of_a_hf_folder(tmp_path, family):
    reference = _model(family)
    reference.save_pretrained(tmp_path / "hf")
    want = _probe(reference)
    for got in run_ranks(_meta_load, 4, args=(str(tmp_path / "hf"), family), timeout=300):
        assert abs(got - want) < 1e-5, (got, want)
