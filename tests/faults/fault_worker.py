"""One rank of a training run that meets a fault, launched by tests/faults/test_faults.py through a real launcher.

    torchrun --nproc_per_node 2 tests/faults/fault_worker.py FAULT WORKDIR
    commfuse-dp launch --config_file accel.yaml tests/faults/fault_worker.py FAULT WORKDIR   (accelerate modes)

A Llama-style decoder (untied embeddings: a ring embedding, fused linears, FSDP2 units) sharded with a short ring
timeout, trained by a plain loop (or a CommFuseAccelerator loop) on seeded batches. The fault is made for real:
a rank kills itself (SIGKILL) or stops answering inside a hop, feeds a bad batch, disagrees about its config
or model, or dies while a checkpoint is written; a full disk is a size-limited tmpfs the test mounts. The only
forced fault is the death in the middle of a checkpoint write (a wrapped DCP write function), which cannot be timed
otherwise. What each rank saw goes to WORKDIR/rank<R>.json; errors are left to propagate, so that the process
exits non-zero and the launcher reports it, as in a user's job.
"""

import contextlib
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]  # hf_models, and this checkout's commfuse_dp

import hf_models
import torch
import torch.distributed as dist

RING_TIMEOUT_S = float(os.environ.get("FAULT_RING_TIMEOUT_S", "6"))
FAULT_STEP = 2  # the step in which a rank meets its fault (steps 0 and 1 are clean)
VICTIM = 1


def _read(workdir: str, rank: int) -> dict:
    file = os.path.join(workdir, f"rank{rank}.json")
    if not os.path.exists(file):
        return {}
    with open(file) as f:
        return json.load(f)


def _record(workdir: str, rank: int, **values) -> None:
    # Whole or not at all (written beside, then renamed): the launcher may kill this rank while it records.
    old = _read(workdir, rank)
    file = os.path.join(workdir, f"rank{rank}.json")
    with open(file + ".tmp", "w") as f:
        json.dump({**old, **values}, f)
    os.replace(file + ".tmp", file)


def _append(workdir: str, rank: int, key: str, value) -> None:
    _record(workdir, rank, **{key: [*_read(workdir, rank).get(key, []), value]})


def _config(rank: int, fault: str):
    from commfuse_dp import CommFuseConfig

    values = {"schedule": "fused", "min_fuse_numel": 0, "timeout_s": RING_TIMEOUT_S}
    if fault == "mismatched_config" and rank == VICTIM:
        values["bucket_mb"] = 5.0
    if fault == "nan_grads_skip":
        values["nonfinite_grads"] = "skip"
    if fault == "nan_grads_raise":
        values["nonfinite_grads"] = "raise"
    return CommFuseConfig(**values)


def _model(rank: int, fault: str) -> torch.nn.Module:
    extra = {"mlp_bias": True} if fault == "mismatched_model" and rank == VICTIM else {}
    return hf_models.build("llama", seed=0, tie_word_embeddings=False, **extra)


def _batch(rank: int, step: int, fault: str) -> dict:
    batch = hf_models.batch(rank, step)
    if step == FAULT_STEP and rank == VICTIM:
        if fault == "bad_token_ids":
            batch["input_ids"][0, 3] = hf_models.VOCAB + 7
        if fault.startswith("nan_grads"):
            batch["nan"] = True
    return batch


def _forward(model, batch: dict):
    if batch.pop("nan", False):
        # A real non-finite value in this rank's activations (as an fp16 overflow or a bad sample would make):
        # the embedding's output gets one inf, so this rank's loss and gradients turn NaN.
        handle = model.get_input_embeddings().register_forward_hook(
            lambda module, args, out: out.index_fill(1, torch.tensor([0]), float("inf")))
        try:
            return model(**batch).loss
        finally:
            handle.remove()
    return model(**batch).loss


def _die_in_ring(rank: int, fault: str, workdir: str):
    """An observer of the hops: the victim dies (SIGKILL) or stops answering at its third hop of the
    fault step, i.e. in the middle of the fused rings, with its peer waiting on it."""
    from commfuse_dp.ring.transport import observe_ring

    seen = {"starts": 0}
    state = {"step": -1}
    if "_mid_ring" not in fault:
        return contextlib.nullcontext(), state

    def callback(event: str, op: str, k: int) -> None:
        if state["step"] != FAULT_STEP or rank != VICTIM or event != "start":
            return
        seen["starts"] += 1
        if seen["starts"] == 3:
            _record(workdir, rank, fault_time=time.time(), fault_at=f"{op} hop {k}")
            if fault.startswith("kill"):
                os.kill(os.getpid(), signal.SIGKILL)
            # hang: alive but silent for two ring timeouts (a launcher ends it sooner; without one it then
            # goes on into a ring its peer has left, and fails too)
            time.sleep(2 * RING_TIMEOUT_S)

    return observe_ring(callback), state


def _die_while_saving() -> None:
    """The victim is killed in the middle of writing its checkpoint files: its first item is written, then it
    dies while writing the second (a wrapped DCP write function: the one fault that cannot be timed otherwise)."""
    import torch.distributed.checkpoint.filesystem as fs

    original, count = fs._write_item, {"n": 0}

    def write_then_die(*args, **kwargs):
        count["n"] += 1
        if count["n"] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    fs._write_item = write_then_die


def plain_loop(fault: str, workdir: str) -> None:
    import commfuse_dp as cf
    from commfuse_dp import checkpoint as ck

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = cf.shard(_model(rank, fault), _config(rank, fault))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = os.path.join(os.environ.get("FAULT_CKPT_DIR", workdir), "ckpt")
    watcher, state = _die_in_ring(rank, fault, workdir)
    with watcher:
        for step in range(4):
            state["step"] = step
            if fault in ("kill_during_save", "full_disk", "save") and step in (FAULT_STEP, 3):
                # Two checkpoints into one folder: before the fault step's update, and after it. The second one
                # meets the fault (the victim killed while writing, or the disk full); the first must survive.
                if fault == "kill_during_save" and step == 3 and rank == VICTIM:
                    _die_while_saving()
                ck.save_sharded(ckpt, [model], [(model, opt)])
                _append(workdir, rank, "saved", {"step": step, "params": _sums(model)})
            loss = _forward(model, _batch(rank, step, fault))
            loss.backward()
            opt.step()
            opt.zero_grad()
            _append(workdir, rank, "losses", loss.item())
            _record(workdir, rank, skipped=cf.step_stats(model).as_dict().get("skipped_steps"))


def _sums(model) -> dict:
    return {n: p.full_tensor().double().sum().item() for n, p in model.named_parameters()}  # collective


def load_only(fault: str, workdir: str) -> None:
    """Load WORKDIR/ckpt into a freshly sharded model: the corrupted / truncated checkpoint faults."""
    import commfuse_dp as cf
    from commfuse_dp import checkpoint as ck

    rank = dist.get_rank()
    model = cf.shard(_model(rank, fault), _config(rank, fault))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck.load_sharded(os.path.join(os.environ.get("FAULT_CKPT_DIR", workdir), "ckpt"), [model], [(model, opt)])
    _record(workdir, rank, loaded=_sums(model))


def accelerate_loop(fault: str, workdir: str) -> None:
    """The same training under a plain ``Accelerator()`` -- run by ``commfuse-dp launch``, which makes it a
    CommFuseAccelerator with the YAML's ``commfuse:`` block."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = _model(rank, fault)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    _record(workdir, rank, accelerator=type(accelerator).__name__)
    watcher, state = _die_in_ring(rank, fault, workdir)
    with watcher:
        for step in range(4):
            state["step"] = step
            loss = _forward(model, _batch(rank, step, fault))
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
    accelerator.end_training()


def in_process_group(rank: int, world_size: int, fault: str, workdir: str) -> None:
    """The plain loop without a launcher (tests/harness.run_ranks starts the ranks and their process group): no
    launcher ends the survivors for them, so the rings must."""
    torch.set_num_threads(1)
    try:
        plain_loop(fault, workdir)
    except BaseException as err:
        _record(workdir, rank, error_type=type(err).__name__, error=str(err), error_time=time.time())
        raise


def main(fault: str, workdir: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    try:
        if fault.endswith("_accelerate"):
            accelerate_loop(fault, workdir)
        else:
            dist.init_process_group("gloo")
            if fault in ("corrupt_shard", "truncate_shard", "load"):
                load_only(fault, workdir)
            else:
                plain_loop(fault, workdir)
    except BaseException as err:
        _record(workdir, rank, error_type=type(err).__name__, error=str(err), error_time=time.time())
        raise
    _record(workdir, rank, finished=True)
    from commfuse_dp.ring.topology import drain_gloo_workers

    drain_gloo_workers()


if __name__ == "__main__":
    main(*sys.argv[1:3])
