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
from commfuse_dp.handle import handle_of


def _hsdp_worker(rank, world_size, cases):
    from commfuse_dp.runtime.replicas import Replicas

    exchanged = []
    original = Replicas._summed

    def counting(self, flat, what, async_op=False, tags=(None, None), narrow=False, key=None):
        exchanged.append(threading.current_thread().name.startswith("commfuse-ring"))  # on the replicate ring's
        return original(self, flat, what, async_op, tags, narrow, key)                  # thread: at landing

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
@pytest.mark.slow
def test_two_copies_of_two_shards_match_one_process(kind):
    cases = [(kind, "fused", 1), (kind, "slicing", 1), (kind, "fused", 2)]
    assert all(run_ranks(_hsdp_worker, 4, (cases,), timeout=600))


def _placements_worker(rank, world_size):
    import hf_models

    model = cf.shard(hf_models.build("llama"), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0, replicate=2))
    q = model.model.layers[0].self_attn.q_proj.weight
    engine = handle_of(model).engine
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
@pytest.mark.slow
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


def _fsdp2_hsdp_worker(rank, world_size, cases):
    """The fsdp2 schedule under HSDP: FSDP2's units on the 2-D mesh, each unit's all-reduce across the copies on the
    replicate group's ring (``RingReplicaGroup``), behind the backward's compute where FSDP2 leaves the sum unread."""
    for kind, accum in cases:
        config = cf.CommFuseConfig(schedule="fsdp2", min_fuse_numel=0, replicate=2)
        result = run_case(rank, world_size, kind, "fsdp2", accum=accum, config=config)
        assert_parity(result, label=f"{kind}/fsdp2/accum {accum}")
    return True


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.slow
def test_fsdp2_schedule_hsdp_matches_one_process(kind):
    assert all(run_ranks(_fsdp2_hsdp_worker, 4, ([(kind, 1), (kind, 2)],), timeout=600))


def _rings_hsdp_worker(rank, world_size, formats):
    """A model sharded by stock ``fully_shard`` on a 2-D mesh (as torchtitan builds HSDP), its collectives then put
    on the rings with FSDP2's GPU schedule (``use_ring_collectives(overlap=True)``): its gradients equal FSDP2's own
    (gloo's all-reduce) over the same steps, and the all-reduces across the copies ran on the rings, behind the
    compute."""
    import hf_models
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from commfuse_dp.integrations.fsdp import use_ring_collectives
    from commfuse_dp.ring.fsdp_comm import replica_groups

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    runs = {}
    for name in ("torch", *formats):
        model = hf_models.build("llama")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if name != "torch":
            use_ring_collectives(model, cf.CommFuseConfig(reduce_format=name), overlap=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(4):
            loss = model(**hf_models.batch(rank, step)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
        served = [(g.exchanges, g.deferred_exchanges) for g in replica_groups(model)]
        runs[name] = (torch.stack(losses), params, served)
    ref_losses, ref_params, served = runs["torch"]
    assert served == []  # FSDP2's own all-reduce
    for name in formats:
        losses, params, served = runs[name]
        assert len(served) == 1 and served[0][0] == 4 * 3 and served[0][1] > 0, served  # 3 units, 4 steps
        tol = dict(rtol=1e-5, atol=1e-5) if name == "exact" else dict(rtol=0, atol=2e-2)
        torch.testing.assert_close(losses, ref_losses, **tol)
        for n in ref_params:
            torch.testing.assert_close(params[n], ref_params[n], **tol, msg=lambda m: f"{name} {n}: {m}")
    return True


def test_fsdp2_hsdp_on_the_rings_matches_fsdp2s_own():
    assert all(run_ranks(_rings_hsdp_worker, 4, (("exact", "bf16"),), timeout=600))


def _narrow_worker(rank, world_size):
    """Narrow formats across the copies, for both schedules: int8 gradients (one rounding per contribution, owners
    summing in float32) train within int8's error of one process, and error feedback keeps residuals for the
    exchange across the copies and changes what crosses."""
    from commfuse_dp.feedback import residuals_of
    from commfuse_dp.ring.fsdp_comm import replica_groups

    out = {}
    for schedule in ("fused", "fsdp2"):
        for feedback in (False, True):
            config = cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0, replicate=2, reduce_format="int8",
                                       error_feedback=feedback)
            result = run_case(rank, world_size, "llama", schedule, config=config)
            assert_parity(result, tol=dict(rtol=0, atol=3e-2), label=f"{schedule}/int8/feedback {feedback}")
            model = result["model"]
            if schedule == "fsdp2":
                assert len(replica_groups(model)) == 1
            # the exchange across the copies keeps its own residuals (besides each shard ring's)
            kept = sum(t.numel() for name, t in residuals_of(model).tensors.items() if "copies" in name)
            assert (kept > 0) == feedback, (schedule, feedback, kept)
            out[(schedule, feedback)] = result["params"][0]
    for schedule in ("fused", "fsdp2"):
        plain, fed = out[(schedule, False)], out[(schedule, True)]
        assert any(not torch.equal(plain[n], fed[n]) for n in plain), schedule  # the residuals were added in
    return True


@pytest.mark.slow
def test_narrow_formats_cross_the_copies_with_error_feedback():
    assert all(run_ranks(_narrow_worker, 4, timeout=600))
