"""One rank of the DeepSpeed runs of tests/test_deepspeed_rings.py, launched by torchrun (2 CPU ranks, gloo).

    torchrun --nproc_per_node 2 tests/deepspeed_worker.py OUT_JSON CASE [CASE ...]

CASE: a ZeRO stage (1, 2, 3) or 2r (ZeRO-2, gradients reduced to their owner). For each case, in this one
process: a stock DeepSpeed run, then the same run (same model seed, same data) with
``enable_ring_collectives(engine)``; per step the loss of every rank, at the end the full parameters
(gathered by DeepSpeed for ZeRO-3) compared between the two runs, what the parameters look like (ZeRO-3:
``ds_tensor`` partitions), and the rings' counters. Then the refusals that need a real process group and a real
engine. Rank 0 writes everything to OUT_JSON; every rank ends with ``shutdown()`` and must exit with status 0.
"""

import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]  # hf_models, and this checkout's commfuse_dp

import hf_models  # noqa: E402

STEPS = 3
KIND = "gpt2"


def ds_config(case: str | int, commfuse: dict | None = None) -> dict:
    """``case``: the ZeRO stage, or "2r": ZeRO-2 reducing each gradient bucket to its owner (``reduce``) instead of
    all-reducing it."""
    stage = int(str(case)[0])
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    if stage in (1, 2):
        # Small buckets: several gradient all-reduces per step, not one.
        cfg["zero_optimization"].update(reduce_bucket_size=8000, allgather_bucket_size=8000)
    if case == "2r":
        cfg["zero_optimization"]["use_multi_rank_bucket_allreduce"] = False
    if stage == 3:
        # Small prefetch/bucket sizes: many parameter all-gathers, several of them in flight at once.
        cfg["zero_optimization"].update(stage3_prefetch_bucket_size=2000, reduce_bucket_size=8000,
                                        stage3_param_persistence_threshold=0)
    if commfuse is not None:
        cfg["commfuse"] = commfuse
    return cfg


def full_params(engine, stage: int) -> dict[str, torch.Tensor]:
    import deepspeed

    module = engine.module
    params = list(module.parameters())
    ctx = deepspeed.zero.GatheredParameters(params) if stage == 3 else _null()
    with ctx:
        return {n: p.detach().clone() for n, p in module.named_parameters()}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def train(case: str, rings: bool) -> dict:
    import deepspeed

    from commfuse_dp.integrations.attach import attachments
    from commfuse_dp.integrations.deepspeed import enable_ring_collectives

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = hf_models.build(KIND, seed=0)
    numels = {n: p.numel() for n, p in model.named_parameters()}
    # bucket_mb from the DeepSpeed config: 4 KiB chunks, so the larger all-gathers/reductions pipeline through
    # the ring in several chunks.
    commfuse = {"bucket_mb": 1 / 256} if rings else None
    stage = int(case[0])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(case, commfuse))
    handle = enable_ring_collectives(engine) if rings else None
    layout = {}
    if stage == 3:
        ds_params = list(engine.module.named_parameters())
        layout = {
            "all_have_ds_tensor": all(hasattr(p, "ds_tensor") for _, p in ds_params),
            "partition_numel_ok": all(p.ds_tensor.numel() == math.ceil(numels[n] / world) for n, p in ds_params),
            "data_released": all(p.data.numel() == 0 for _, p in ds_params),  # outside forward: only the shard
        }
    losses = []
    for step in range(STEPS):
        loss = engine(**hf_models.batch(rank, step)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, losses)
    out = {"losses": everyone, "layout": layout, "params": full_params(engine, stage),
           "attachments": attachments(engine.module)}
    if stage in (1, 2):
        opt = engine.optimizer
        out["layout"] = {"fp32_partition_numel": sum(t.numel() for t in opt.single_partition_of_fp32_groups),
                         "model_numel": sum(numels.values())}
    if handle is not None:
        handle.disable()
        import deepspeed.comm.comm as ds_comm

        out["stats"] = handle.stats.as_dict()
        out["bucket_mb"] = handle.config.bucket_mb
        out["config_source"] = handle.source
        out["restored"] = type(ds_comm.cdb).__name__
        out["groups"] = handle.group_ranks
    engine.destroy()
    return out


def refusals() -> dict:
    """The refusals that need a process group and a DeepSpeed engine: each must raise, with the expected word."""
    import deepspeed

    import commfuse_dp as cf
    from commfuse_dp.integrations.deepspeed import enable_ring_collectives
    from commfuse_dp.integrations.transformers import CommFuseCallback

    seen = {}

    def expect(name, fn):
        try:
            fn()
        except (ValueError, TypeError, RuntimeError) as err:
            seen[name] = f"{type(err).__name__}: {err}"
        else:
            seen[name] = None

    model = hf_models.build(KIND, seed=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(3))
    # commfuse sharding on top of ZeRO-3: the engine itself, and the module ZeRO-3 partitioned.
    expect("shard_engine", lambda: cf.shard(engine))
    expect("shard_zero3_module", lambda: cf.shard(engine.module))
    handle = enable_ring_collectives(engine)
    expect("enable_twice", lambda: enable_ring_collectives(engine))
    handle.disable()
    engine.destroy()
    # A commfuse-sharded model given to DeepSpeed: the Trainer callback refuses at on_init_end, and
    # enable_ring_collectives refuses an engine built around it (ZeRO-1 initialises on DTensor parameters here).
    sharded = cf.shard(hf_models.build(KIND, seed=0), cf.CommFuseConfig(schedule="fused", min_fuse_numel=0))

    class Args:
        fsdp = []
        deepspeed = ds_config(3)
        save_strategy = "no"

    expect("callback_on_sharded", lambda: CommFuseCallback(cf.CommFuseConfig(schedule="fused")).on_init_end(
        Args(), None, None, model=sharded))
    try:
        engine1, _, _, _ = deepspeed.initialize(model=sharded, model_parameters=sharded.parameters(),
                                                config=ds_config(1))
    except Exception as err:  # DeepSpeed may reject DTensor parameters itself; say so in the report
        seen["deepspeed_on_sharded"] = f"deepspeed.initialize raised {type(err).__name__}: {err}"
    else:
        expect("enable_on_sharded", lambda: enable_ring_collectives(engine1))
        engine1.destroy()
    # A bad "commfuse" section: read from the engine's config at enable time.
    model = hf_models.build(KIND, seed=0)
    engine2, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                            config=ds_config(2, {"schedule": "fused"}))
    expect("non_ring_key", lambda: enable_ring_collectives(engine2))
    engine2.destroy()
    return seen


def without_engine() -> dict:
    """``enable_ring_collectives()`` before any engine: DeepSpeed's default data-parallel groups, here the world
    and DeepSpeed's clone of it; a deepspeed.comm all-reduce on the world then runs on the rings."""
    import deepspeed.comm as ds_dist

    from commfuse_dp.integrations.deepspeed import enable_ring_collectives

    with enable_ring_collectives(cfg={"bucket_mb": 1}) as handle:
        t = torch.arange(5.0) * (torch.distributed.get_rank() + 1)
        ds_dist.all_reduce(t)  # 5 elements over 2 ranks: padded to 6 inside the ring all-reduce
        ds_dist.all_reduce(t, op=ds_dist.ReduceOp.MAX)  # not a sum: DeepSpeed's own collective
        stats = handle.stats.as_dict()
        groups = handle.group_ranks
    return {"groups": groups, "stats": stats, "result": t.tolist(), "bucket_mb": handle.config.bucket_mb,
            "enabled_after": handle.enabled}


def main(out: str, cases: list[str]) -> None:
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    result = {"world_size": torch.distributed.get_world_size(), "stages": {}}
    for case in cases:
        stock = train(case, rings=False)
        ring = train(case, rings=True)
        diffs = {n: (stock["params"][n] - ring["params"][n]).abs().max().item() for n in stock["params"]}
        init = hf_models.build(KIND, seed=0).state_dict()
        changed = {n: (stock["params"][n] - init[n]).abs().max().item() for n in stock["params"]}
        for run in (stock, ring):
            del run["params"]
        result["stages"][case] = {"stock": stock, "rings": ring, "param_max_abs_diff": max(diffs.values()),
                                  "param_max_abs_change": max(changed.values())}
    result["refusals"] = refusals()
    result["no_engine"] = without_engine()
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    from commfuse_dp.integrations.deepspeed import shutdown

    shutdown()  # see [Note: the abort at exit] in commfuse_dp/integrations/deepspeed.py; the test checks the exit status


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
