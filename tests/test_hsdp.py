"""HSDP (``CommFuseConfig(replicate=R)``, or a 2-D mesh): fused rings inside each copy of the model, gradient shards
summed across copies (``commfuse_dp/runtime/replicas.py``). 4 ranks as 2 copies x 2 shards against one process on
the concatenated batch: losses, grad norms, parameters and logits, both schedules, a tied decoder (GPT-2) and one
with every fused shape (Llama), with gradient accumulation; and the accumulation micro-batches do not cross the
copies."""

import threading

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import commfuse_dp as cf
from harness import run_ranks
from test_checkpoint import _full, _trained
from test_shard_parity import assert_parity, run_case


def _hsdp_worker(rank, world_size, cases):
    from commfuse_dp.runtime.replicas import Replicas

    exchanged = []
    original = Replicas._summed

    def counting(self, flat, what, async_op=False, tags=(None, None), narrow=False):
        exchanged.append(threading.current_thread().name.startswith("commfuse-ring"))  # on the replicate ring's
        return original(self, flat, what, async_op, tags, narrow)                       # thread: at landing

    Replicas._summed = counting
    per_step = {}
    try:
        for kind, schedule, accum in cases:
            config = cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0, replicate=2)
            exchanged.clear()
            result = run_case(rank, world_size, kind, schedule, accum=accum, config=config)
            assert_parity(result, label=f"{kind}/{schedule}/accum {accum}")
            # The same exchanges in every synchronised backward (5 steps), none for the accumulation micro-batches;
            # the fused schedule hands each landing to the replicate ring's thread, which sums it when it lands.
            assert exchanged and len(exchanged) % 5 == 0, (kind, schedule, accum, exchanged)
            per_step.setdefault((kind, schedule), set()).add(len(exchanged) // 5)
            if schedule == "fused":
                assert sum(exchanged) >= len(exchanged) - 5, exchanged  # all but the end's flush: at landing
        assert all(len(counts) == 1 for counts in per_step.values()), per_step  # accumulation adds none
    finally:
        Replicas._summed = original
    return True


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_two_copies_of_two_shards_match_one_process(kind):
    cases = [(kind, "fused", 1), (kind, "slicing", 1), (kind, "fused", 2)]
    assert all(run_ranks(_hsdp_worker, 4, (cases,), timeout=600))


def _placements_worker(rank, world_size):
    import hf_models

    model = cf.shard(hf_models.build("llama"), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0, replicate=2))
    q = model.model.layers[0].self_attn.q_proj.weight
    engine = model._commfuse_engine
    return (tuple(q.placements), tuple(q.device_mesh.shape), engine.ring.size, engine.replicas.size,
            engine.world_ring.size)


def test_parameters_are_replicated_across_copies_and_sharded_inside():
    for placements, shape, ring, replicas, world in run_ranks(_placements_worker, 4, timeout=300):
        assert placements == (Replicate(), Shard(0)) and shape == (2, 2)
        assert (ring, replicas, world) == (2, 2, 4)


def _bad_replicate_worker(rank, world_size):
    import hf_models

    with pytest.raises(ValueError, match="does not divide the 3 ranks"):
        cf.shard(hf_models.build("llama"), cf.CommFuseConfig(schedule="fused", replicate=2))
    return True


def test_replicate_must_divide_the_world():
    assert all(run_ranks(_bad_replicate_worker, 3, timeout=120))


def _save_worker(rank, world_size, path, replicate):
    from commfuse_dp import checkpoint as ck

    model, opt = _trained("gpt2", rank, replicate=replicate)
    ck.save_sharded(path, [model], [(model, opt)])
    ck.save_pretrained(model, path + "-hf")  # consolidated: the first copy's ranks write their slices
    return _full(model, opt)  # collective: every rank


def _load_worker(rank, world_size, path, replicate):
    import hf_models
    from commfuse_dp import checkpoint as ck

    model = cf.shard(hf_models.build("gpt2", seed=1), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0,
                                                                        replicate=replicate))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck.load_sharded(path, [model], [(model, opt)])
    loaded = _full(model, opt)
    fresh = cf.shard(hf_models.build("gpt2", seed=2), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0,
                                                                        replicate=replicate))
    ck.load_pretrained_weights(fresh, path + "-hf")
    consolidated = {n: p.full_tensor().clone() for n, p in fresh.named_parameters()}
    loss = model(**hf_models.batch(rank, 5)).loss  # training goes on from the loaded state
    loss.backward()
    opt.step()
    return loaded, consolidated, loss.item()


@pytest.mark.parametrize("saved,loaded", [((4, 2), (4, 1)), ((4, 2), (4, 4)), ((4, 2), (2, 1)),
                                          ((4, 1), (4, 2)), ((4, 4), (4, 2)), ((2, 1), (4, 2))],
                         ids=["2x2-to-1x4", "2x2-to-4x1", "2x2-to-1x2", "1x4-to-2x2", "4x1-to-2x2", "1x2-to-2x2"])
def test_checkpoints_cross_mesh_shapes(tmp_path, saved, loaded):
    # (world size, replicate): 2x2 saved, loaded as 1x4, 4x1 and 1x2, and each of those saved, loaded as 2x2. DCP
    # reshards; the consolidated Hugging Face folder (save_pretrained) loads back too.
    path = str(tmp_path / "state")
    saved_params, saved_state = run_ranks(_save_worker, saved[0], (path, saved[1]), timeout=300)[0]
    (params, state), consolidated, loss = run_ranks(_load_worker, loaded[0], (path, loaded[1]), timeout=300)[0]
    assert params.keys() == saved_params.keys()
    for name in saved_params:
        assert torch.equal(params[name], saved_params[name]), name
        assert torch.equal(consolidated[name], saved_params[name]), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[name][key], saved_state[name][key]), (name, key)
    assert 0 < loss < 10
