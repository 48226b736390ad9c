"""commfuse_dp.checkpoint.AsyncSaver on real 2-rank gloo groups: the folder holds the state as it was when
``save`` returned, although training changed the weights while the write ran; ``then`` runs once the folder is
complete; the next save waits for the one before; the folder loads back like save_sharded's."""

import os
import threading

import torch

import commfuse_dp as cf
import hf_models
from commfuse_dp import checkpoint as ck
from harness import run_ranks


def _train(model, opt, rank, steps):
    for step in steps:
        model(**hf_models.batch(rank, step)).loss.backward()
        opt.step()
        opt.zero_grad()


def _full(model, opt):
    params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    state = {n: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in opt.state[p].items()}
             for n, p in model.named_parameters()}
    return params, state


def _async_worker(rank, world_size, path):
    model = cf.shard(hf_models.build("llama", seed=0), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, rank, range(2))
    snapshot = _full(model, opt)
    # Hold the writing thread until training has changed every weight: the folder must still hold the snapshot.
    gate, write = threading.Event(), ck.saver._write_sharded
    ck.saver._write_sharded = lambda *args: (gate.wait(), write(*args))[1]
    saver = ck.AsyncSaver()
    marks = []
    saver.save(path, [model], [(model, opt)], extra={"step": 2}, then=lambda: marks.append(ck.is_complete(path)))
    staged = saver.staged_bytes
    assert saver.writing and not ck.is_complete(path)
    _train(model, opt, rank, range(2, 4))
    gate.set()
    later = _full(model, opt)
    saver.save(path + "-b", [model], [(model, opt)], extra={"step": 4})  # waits for the first write
    first_done = marks == [True]
    saver.close()
    ck.saver._write_sharded = write
    return snapshot, later, first_done, staged


def _load_worker(rank, world_size, path):
    model = cf.shard(hf_models.build("llama", seed=1), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {"step": -1}
    ck.load_sharded(path, [model], [(model, opt)], extra=extra)
    return _full(model, opt), extra["step"]


def _equal(a, b) -> bool:
    params_a, state_a = a
    params_b, state_b = b
    return all(torch.equal(params_a[n], params_b[n]) for n in params_a) and all(
        torch.equal(state_a[n][k], state_b[n][k]) for n in state_a for k in state_a[n])


def test_async_save_writes_the_state_of_its_call_while_training_goes_on(tmp_path):
    path = str(tmp_path / "state")
    snapshot, later, first_done, staged = run_ranks(_async_worker, 2, (path,), timeout=240)[0]
    assert first_done, "the second save must wait for the first write, and its then() after the folder is complete"
    assert not _equal(snapshot, later)  # training did change the weights while the first write was held
    params = sum(t.numel() for t in snapshot[0].values())
    assert staged >= params * 4 * 3 // 2 * 0.9  # this rank's half of the weights and of AdamW's two moments, fp32
    assert ck.is_complete(path) and ck.is_complete(path + "-b") and not os.path.exists(path + ".partial")
    for folder, expected, step in ((path, snapshot, 2), (path + "-b", later, 4)):
        for world in (2, 3):
            loaded, loaded_step = run_ranks(_load_worker, world, (folder,), timeout=240)[0]
            assert loaded_step == step and _equal(loaded, expected), (folder, world)
