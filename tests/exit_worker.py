"""One rank of a minimal run that ends right after its last collectives, for tests/test_deepspeed_rings.py.

    python tests/exit_worker.py {guarded|drain|rings|bare} OUT_PREFIX [slow]

(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment.)

init (gloo) + one "step": commfuse ring collectives (not in ``bare``), a burst of async gloo all-reduces waited, and
one blocking all-reduce at the end (what a ZeRO step ends with), then by mode:

- ``guarded``: what ``commfuse_dp.integrations.deepspeed.shutdown()`` does (``drain_gloo_workers()``, then
  ``dist.destroy_process_group()``); OUT_PREFIX.RANK gets the names of this process's native threads after it;
- ``drain``: ``drain_gloo_workers()`` alone (what a DeepSpeed run gets at exit: its engine keeps its groups alive,
  so they cannot be destroyed);
- ``rings``: nothing at the end, as a script that never calls ``destroy_process_group`` (``trl sft``, transformers'
  examples): the drain that making the first gloo ring registered at exit is all it has;
- ``bare``: plain torch + gloo, no rings and nothing at the end (no file either: I/O at the end releases the GIL and
  lets the gloo workers finish, hiding the race).

``slow``: every thread of the process on one CPU and gloo's workers at the lowest priority (``delay_gloo_workers``).

Why: a gloo worker thread (``ProcessGroupGloo::runLoop``) frees a finished work after ``wait()`` has returned; the
work's tensors have Python objects, so freeing them takes the GIL (``TensorImpl::decref_pyobject``). When the main
thread has meanwhile started finalizing the interpreter, ``take_gil`` ends the worker with ``pthread_exit``, whose
forced unwind through the work's ``noexcept`` destructor calls ``std::terminate``: "terminate called without an
active exception", SIGABRT, after all the work was done (core dump of such an abort: frames
``runLoop -> ~AsyncAllreduceWork -> decref_pyobject -> gil_scoped_acquire -> take_gil -> pthread_exit ->
std::terminate``). ``destroy_process_group()`` destroys the groups while the interpreter is alive: the gloo
destructor drains the queue and joins its workers with the GIL released, so no worker is left to free anything
during finalization (see [Note: the abort at exit] in commfuse_dp/integrations/deepspeed.py).
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]  # this checkout's commfuse_dp

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Before init_process_group, as scripts do: torch.distributed.nn (imported by torch.distributed.fsdp, which
# commfuse_dp imports) binds group.WORLD as a default argument when it is first imported, and imported after
# init_process_group that would keep the world group alive past destroy_process_group().
import commfuse_dp as cf  # noqa: E402
from commfuse_dp.integrations.deepspeed import drain_gloo_workers  # noqa: E402


def native_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sorted(names)


def delay_gloo_workers(rank: int) -> None:
    """Make the race likely instead of rare (it needs the gloo worker to reach the GIL only after the main thread
    began finalizing, which on an idle machine seldom happens): every thread of this process on one CPU, gloo's
    worker threads at the lowest priority, so the main thread runs on into finalization before they get the CPU
    back. Only the scheduling changes."""
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[rank % len(cpus)]
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cpu})
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().startswith("pt_gloo_runloop"):
                os.setpriority(os.PRIO_PROCESS, int(tid), 19)


def main(mode: str, out_prefix: str, slow: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = torch.full((1000,), float(rank))
    full = torch.empty(world * 1000)
    if mode != "bare":
        cf.ring_all_gather(full, shard)
        cf.ring_reduce_scatter(shard, full)
        assert torch.equal(shard, torch.full((1000,), float(rank * world)))  # every rank gathered the same
    works = []
    for i in range(50):
        t = torch.full((1000,), float(i))
        works.append((dist.all_reduce(t, async_op=True), t))
    for work, t in works:
        work.wait()
    assert all(t[0].item() == i * world for i, (_, t) in enumerate(works))
    if slow:
        delay_gloo_workers(rank)
    # The step's last collective is a blocking one (as ZeRO's gradient-norm all-reduce is): the Python side lets go
    # of its work at once, so the gloo worker holds the last reference and frees it (taking the GIL) just after.
    norm = torch.ones(1)
    dist.all_reduce(norm)
    if mode == "guarded":
        drain_gloo_workers()
        dist.destroy_process_group()
        with open(f"{out_prefix}.{rank}", "w") as f:
            f.write("\n".join(native_threads()))
    elif mode == "drain":  # what a DeepSpeed run gets when its engine keeps the groups alive (no destruction)
        drain_gloo_workers()
    elif mode not in ("rings", "bare"):
        raise SystemExit(f"mode must be guarded, drain, rings or bare, got {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], slow=len(sys.argv) > 3 and sys.argv[3] == "slow")
