"""One rank of a run in which rank 1 stops early (uneven inputs), for tests/test_early_stop.py.

Every rank shards a tiny GPT-2 with a short ring timeout and trains step 1 together; then rank 1 stops while the
others run step 2. How rank 1 stops is the case:

- ``"exit"``: it returns (the process exits normally, destroying its process group);
- ``"barrier"``: it calls ``dist.barrier()`` (accelerate's ``wait_for_everyone``), then returns;
- ``"gather"``: it calls ``dist.all_gather_object`` and an ``all_reduce`` (what ``gather_for_metrics`` does),
  then returns;
- ``"no_shard"``: it never reaches ``shard()``: it calls ``dist.barrier()`` instead while the others are in
  ``shard()``'s check that the ranks agree.

A rank that raises prints ``EARLY_STOP {...}`` (the error's type and the seconds from the start of the step it
was in) to its log, then re-raises, so that the harness reports the error as such.
"""

import json
import time

import torch
import torch.distributed as dist

import hf_models

STOPPER = 1


def _report(phase: str, began: float, err: BaseException) -> None:
    print("EARLY_STOP " + json.dumps({"phase": phase, "elapsed": time.monotonic() - began,
                                      "type": type(err).__name__}), flush=True)


def _train_step(model, opt, rank: int, step: int) -> None:
    loss = model(**hf_models.batch(rank, step)).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def worker(rank: int, world_size: int, case: str, schedule: str, timeout_s: float) -> str:
    import commfuse_dp as cf

    config = cf.CommFuseConfig(timeout_s=timeout_s, schedule=schedule, min_fuse_numel=0)
    model = hf_models.build("gpt2")
    if case == "no_shard" and rank == STOPPER:
        dist.barrier()
        return "stopped"
    began = time.monotonic()
    try:
        cf.shard(model, config)
    except BaseException as err:
        _report("shard", began, err)
        raise
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt, rank, 0)
    if rank == STOPPER:
        if case == "barrier":
            dist.barrier()
        elif case == "gather":
            metrics: list = [None] * world_size
            dist.all_gather_object(metrics, {"rank": rank})
            dist.all_reduce(torch.ones(1))
        return "stopped"
    began = time.monotonic()
    try:
        _train_step(model, opt, rank, 1)
    except BaseException as err:
        _report("step", began, err)
        raise
    return "finished"
