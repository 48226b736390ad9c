"""One rank of a run that a launcher restarts after a fault, launched by tests/faults/test_restarts.py:

    torchrun --nproc_per_node 2 --max-restarts 1 tests/faults/restart_worker.py FAULT WORKDIR

The fault worker's model and seeded batches (tests/faults/fault_worker.py), trained by a plain loop for STEPS
steps, with a checkpoint after every step written off the training thread (``checkpoint.AsyncSaver``, one folder,
WORKDIR/ckpt, that each save replaces once it is complete). A worker that finds a complete checkpoint resumes from
it, as a user's loop would: ``checkpoint.is_complete`` and ``checkpoint.load_sharded`` with the step in ``extra``.
The fault happens in the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0): a rank killed (SIGKILL) or silent
in a hop of step FAULT_STEP, or killed while its background write of that step's checkpoint runs (a wrapped DCP
write function: the one forced fault), or a disk that fills (a size-limited tmpfs the test mounts). What each
attempt saw goes to WORKDIR/rank<R>.json; the final weights of a finished run to WORKDIR/final.pt (rank 0).
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

import fault_worker
import torch
import torch.distributed as dist

STEPS = 6
FAULT_STEP = 3
VICTIM = fault_worker.VICTIM


def train(fault: str, workdir: str) -> None:
    import commfuse_dp as cf
    from commfuse_dp import checkpoint as ck

    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    live = fault if attempt == 0 else "none"  # a restarted attempt meets no fault
    torch.manual_seed(0)
    model = cf.shard(fault_worker._model(rank, "none"), fault_worker._config(rank, "none"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = os.path.join(os.environ.get("FAULT_CKPT_DIR", workdir), "ckpt")
    start = 0
    if ck.is_complete(path):
        extra = {"step": -1}
        ck.load_sharded(path, [model], [(model, opt)], extra=extra)
        start = extra["step"] + 1
        print(f"rank {rank}: resumed from {path} (step {extra['step']})", flush=True)
    fault_worker._append(workdir, rank, "attempts", {"attempt": attempt, "start": start})
    saver = ck.AsyncSaver()
    watcher, state = fault_worker._die_in_ring(rank, live.replace("_restart", ""), workdir)
    with watcher:
        for step in range(start, STEPS):
            state["step"] = fault_worker.FAULT_STEP if step == FAULT_STEP else -1  # (what its observer waits for)
            loss = model(**fault_worker.hf_models.batch(rank, step)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if live == "kill_during_async_save" and step == FAULT_STEP and rank == VICTIM:
                fault_worker._record(workdir, rank, fault_time=time.time(), fault_at=f"checkpoint of step {step}")
                fault_worker._die_while_saving()  # (in the background write: the thread that writes)
            saver.save(path, [model], [(model, opt)], extra={"step": step})
            fault_worker._append(workdir, rank, "saved", step)
    saver.wait()
    final = {n: p.full_tensor().clone() for n, p in model.named_parameters()}  # collective
    if rank == 0:
        torch.save(final, os.path.join(workdir, "final.pt"))


def main(fault: str, workdir: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    try:
        dist.init_process_group("gloo")
        train(fault, workdir)
    except BaseException as err:
        fault_worker._record(workdir, rank, error_type=type(err).__name__, error=str(err), error_time=time.time())
        raise
    fault_worker._record(workdir, rank, finished=True)
    from commfuse_dp.ring.topology import drain_gloo_workers

    drain_gloo_workers()


if __name__ == "__main__":
    main(*sys.argv[1:3])
