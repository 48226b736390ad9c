"""A model transformers sharded at load time (``from_pretrained(..., distributed_config=DistributedConfig(...))``),
trained with stock FSDP2 collectives and with ``use_ring_collectives``; launched by tests/test_fsdp_transformers.py.

    torchrun --nproc_per_node 2 tests/fsdp_hf_worker.py MODEL_DIR OUT_DIR fsdp    # fsdp_size=2
    torchrun --nproc_per_node 4 tests/fsdp_hf_worker.py MODEL_DIR OUT_DIR hsdp    # dp_replicate_size=2, fsdp_size=2;
                                                                                  # then own fully_shard calls
    python tests/fsdp_hf_worker.py - OUT_DIR reload                               # fresh single process

``fsdp`` runs four trainings from the same saved model, seeds and batches: stock / rings, each in fp32 and with
transformers' ``fsdp_mixed_precision`` (bf16 parameters, fp32 reductions); the fp32 ring run then evaluates a batch
per rank (logits gathered on rank 0), saves through ``model.save_pretrained`` on every rank, and rank 0 writes the
trained parameters. It also makes the wrong calls of ``use_ring_collectives`` that need a process group.
``hsdp`` trains stock / rings with HSDP, then with the model's own ``fully_shard`` calls (decoder layers
``reshard_after_forward=2``: their backward all-gathers run on groups of 2). ``reload`` loads the saved folder with
``from_pretrained`` alone and compares. Rank 0 (the reload: the process) writes OUT_DIR/<mode>.json.
"""

import json
import os
import sys
from collections import Counter

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]  # hf_models, and this checkout's commfuse_dp (`python tests/x.py` puts only tests/ first)

import hf_models  # noqa: E402

STEPS = 4
LR = 1e-2


def _load(model_dir: str, **distributed):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    return AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(**distributed))


def _count_ring_adapter_calls():
    """Count every call of the ring adapters, per unit label, by wrapping the classes' ``__call__`` (the call
    itself runs unchanged)."""
    from commfuse_dp.ring import RingAllGather, RingReduceScatter

    calls, group_sizes = Counter(), Counter()
    for cls in (RingAllGather, RingReduceScatter):
        original = cls.__call__

        def counted(self, *args, _original=original, **kwargs):
            group = kwargs["group"] if "group" in kwargs else args[2]
            calls[self.label] += 1
            group_sizes[f"{self.label} on {group.size()} ranks"] += 1
            return _original(self, *args, **kwargs)

        cls.__call__ = counted
    return calls, group_sizes


def _units(model):
    """Per FSDP2 unit with parameters (named as the ring adapters' labels name it): whether FSDP2 re-gathers it
    in the backward (reshard_after_forward) and the dtype it all-gathers in (its MixedPrecisionPolicy)."""
    from commfuse_dp.ring.fsdp_comm import _units

    return {f"FSDP2 unit {name}": {"reshard": state._fsdp_param_groups[0].post_forward_mesh_info is not None,
                                   "param_dtype": str(state._fsdp_param_groups[0].mp_policy.param_dtype)}
            for name, _, state in _units(model) if state._fsdp_param_groups}


def _describe_params(model, optimizer):
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    return {
        "all_dtensor": all(isinstance(p, DTensor) for p in params.values()),
        "placements": sorted({str(p.placements) for p in params.values() if isinstance(p, DTensor)}),
        "mesh": sorted({(tuple(p.device_mesh.mesh_dim_names or ()), tuple(p.device_mesh.shape))
                        for p in params.values() if isinstance(p, DTensor)}),
        # every rank's local shard holds ceil(rows / shard ranks) rows or fewer
        "local_rows": {n: [p.to_local().shape[0], p.shape[0]] for n, p in params.items() if isinstance(p, DTensor)},
        "optimizer_state_dtensor": all(isinstance(v, DTensor) for s in optimizer.state.values()
                                       for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")),
        "param_dtype": str(next(iter(params.values())).dtype),
    }


def _train(make_model, dp_rank, rings, counters):
    import torch.distributed as dist

    from commfuse_dp import CommFuseConfig
    from commfuse_dp.integrations.fsdp import use_ring_collectives
    from commfuse_dp.ring import observe_ring

    model = make_model()
    if rings:
        # bucket_mb of 1 KiB: several ring buckets per unit, as larger units have on real models
        use_ring_collectives(model, CommFuseConfig(bucket_mb=1 / 1024, timeout_s=60))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    calls, group_sizes = counters
    calls.clear()
    group_sizes.clear()
    ring_events = []
    losses, norms = [], []
    with observe_ring(lambda event, op, k: ring_events.append(op)):
        for step in range(STEPS):
            # one batch per data-parallel rank (HSDP: the replicas see different batches too)
            batch = hf_models.batch(dp_rank, step)
            loss = model(**batch).loss
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    result = {"losses": losses, "grad_norms": norms, "ring_events": len(ring_events), "calls": dict(calls),
              "group_sizes": dict(group_sizes), "units": _units(model), **_describe_params(model, optimizer)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"losses": losses, "grad_norms": norms})
    result["per_rank"] = gathered
    return model, result


def _own_fully_shard(model_dir, reshard_after_forward):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    return model


def _eval_and_save(model, out_dir, rank):
    """Each rank evaluates its own batch on the trained sharded model; rank 0 gathers the logits. Then the
    parameters (full, on rank 0) and transformers' own save on every rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    full = {name: p.full_tensor() for name, p in model.named_parameters()}  # collective: every rank
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=hf_models.batch(rank, 1000)["input_ids"]).logits
    # FSDP2 leaves the units with reshard_after_forward=False (transformers' norm + lm_head) unsharded after a
    # forward without backward; their parameters are plain tensors until the next reshard.
    sharded_after_eval = all(isinstance(p, DTensor) for p in model.parameters())
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(logits, gathered, dst=0)
    model.save_pretrained(os.path.join(out_dir, "saved"))  # every rank: transformers gathers, rank 0 writes
    if rank == 0:
        torch.save({"logits": gathered, "params": full}, os.path.join(out_dir, "trained.pt"))
    return {"sharded_after_eval": sharded_after_eval,
            "sharded_after_save": all(isinstance(p, DTensor) for p in model.parameters())}


def _wrong_calls(model_dir, world_size):
    """Calls of use_ring_collectives that must be refused (they need a process group); name -> error text."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
    from transformers import AutoModelForCausalLM

    import commfuse_dp as cf
    from commfuse_dp.integrations.fsdp import use_ring_collectives

    errors = {}

    def refused(name, call):
        try:
            call()
        except (ValueError, TypeError) as err:
            errors[name] = f"{type(err).__name__}: {err}"
        else:
            errors[name] = None

    # from_pretrained without a distributed_config: nothing was fully_shard-ed
    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    refused("not_sharded", lambda: use_ring_collectives(plain))
    # a model commfuse_dp.shard() sharded: its FSDP2 units run on rings already, with the config shard() got
    sharded = cf.shard(hf_models.build("llama", 0), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0, timeout_s=60))
    before = {type(s._fsdp_param_groups[0]._all_gather_comm).__name__ for _, _, s in _cf_units(sharded)}
    refused("shard_model", lambda: use_ring_collectives(sharded))
    refused("shard_submodule", lambda: use_ring_collectives(sharded.model))

    # a unit that already has a custom all-gather of someone else's
    class OwnAllGather(DefaultAllGather):  # e.g. a user's all-gather that logs or allocates differently
        pass

    own = hf_models.build("llama", 0)
    for layer in own.model.layers:
        fully_shard(layer)
    fully_shard(own)
    own.model.layers[1].set_custom_all_gather(OwnAllGather())
    refused("foreign_comm", lambda: use_ring_collectives(own))
    untouched = type(own.model.layers[0]._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm).__name__
    # the other way round: commfuse_dp.shard() on a model transformers sharded at load time
    loaded = _load(model_dir, fsdp_size=world_size)
    refused("shard_on_fsdp_model", lambda: cf.shard(loaded, cf.CommFuseConfig(schedule="fused")))
    # the shard()ed model still trains after the refusals (nothing was changed)
    loss = sharded(**hf_models.batch(dist.get_rank(), 0)).loss
    loss.backward()
    return {"errors": errors, "shard_comm_types": sorted(before), "layer0_comm_after_refusal": untouched,
            "shard_model_still_trains": bool(torch.isfinite(loss))}


def _cf_units(model):
    from commfuse_dp.ring.fsdp_comm import _units

    return [u for u in _units(model) if u[2]._fsdp_param_groups]


def main(model_dir: str, out_dir: str, mode: str) -> None:
    if mode == "reload":
        return reload(out_dir)
    import torch.distributed as dist

    torch.set_num_threads(1)
    counters = _count_ring_adapter_calls()
    dist.init_process_group("gloo")  # transformers would do it too (_ensure_torch_distributed); explicit here
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"world_size": world, "steps": STEPS}
    if mode == "fsdp":
        layout = {"fsdp_size": world}
        for precision, extra in (("fp32", {}), ("mixed", {"fsdp_mixed_precision": True})):
            for rings in (False, True):
                model, run = _train(lambda extra=extra: _load(model_dir, **layout, **extra), rank, rings, counters)
                run["is_distributed_loading_by_transformers"] = model.is_distributed_loading_by_transformers
                result[f"{'rings' if rings else 'stock'}_{precision}"] = run
                if rings and precision == "fp32":
                    # the eval forward below calls the all-gathers once more: count the training only
                    run["after_training"] = _eval_and_save(model, out_dir, rank)
                del model
        result["wrong_calls"] = _wrong_calls(model_dir, world)
    elif mode == "hsdp":
        layout = {"dp_replicate_size": 2, "fsdp_size": world // 2}
        for rings in (False, True):
            model, run = _train(lambda: _load(model_dir, **layout), rank, rings, counters)
            result["rings_fp32" if rings else "stock_fp32"] = run
            del model
        # Own fully_shard code on the same 4 ranks: decoder layers reshard after forward to groups of 2
        # (reshard_after_forward=2), so their backward all-gathers run on the smaller post-forward group.
        for rings in (False, True):
            model, run = _train(lambda: _own_fully_shard(model_dir, reshard_after_forward=2), rank, rings, counters)
            result["own_rings" if rings else "own_stock"] = run
            del model
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    if rank == 0:
        with open(os.path.join(out_dir, f"{mode}.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def reload(out_dir: str) -> None:
    """Fresh single process: transformers' from_pretrained on the saved folder, no distributed_config."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    saved = os.path.join(out_dir, "saved")
    trained = torch.load(os.path.join(out_dir, "trained.pt"))
    model = AutoModelForCausalLM.from_pretrained(saved).eval()
    state = dict(model.named_parameters())
    diffs = {}
    with torch.no_grad():
        for rank, expected in enumerate(trained["logits"]):
            logits = model(input_ids=hf_models.batch(rank, 1000)["input_ids"]).logits
            diffs[f"logits_rank{rank}"] = (logits - expected).abs().max().item()
            diffs[f"logits_rank{rank}_equal"] = torch.equal(logits, expected)
            diffs[f"logits_rank{rank}_scale"] = expected.abs().max().item()
    params_equal = {n: torch.equal(state[n].detach(), p) for n, p in trained["params"].items()}
    initial = dict(hf_models.build("llama", 0).named_parameters())
    moved = max((initial[n].detach() - p).abs().max().item() for n, p in trained["params"].items())
    with open(os.path.join(saved, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out_dir, "reload.json"), "w") as f:
        json.dump({"diffs": diffs, "params_equal": params_equal, "moved": moved,
                   "missing": sorted(set(trained["params"]) - set(state)),
                   "is_distributed_loading_by_transformers": model.is_distributed_loading_by_transformers,
                   "distributed_in_config": "distributed_config" in config,
                   "architectures": config.get("architectures"),
                   "dist_initialized": torch.distributed.is_initialized(),
                   "files": sorted(os.listdir(saved))}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
