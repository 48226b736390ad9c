"""Host overhead of one hop on gloo: the time this thread spends issuing a hop and waiting for it when the
bytes have already arrived (the cost a fused layer pays per hop on top of its compute).

    python benchmarks/step_overhead.py                    # 2 ranks over loopback, 4 KiB and 1 MiB shards
    python benchmarks/step_overhead.py --fake-worlds 2,4,8,16   # a whole training step's host time, no peers

Per size, ``--steps`` hops run with a busy compute piece of ``--piece-ms`` between start and wait (long enough
for the bytes to land), and the table shows the median time inside ``start_hop`` (issue) and inside ``wait``.
Their sum is the host overhead per hop. It also times what a fused layer adds once per ring *operation*
(not per hop) to name it: ``StepState.ring_op`` (the identity tag and the label for errors) against the plain
counter tag it replaced (``Ring.next_tag``). This is a measurement, not a test.

``--fake-worlds``: the host time of whole training steps of a tiny Llama (2 layers, hidden 64, 2 x 64 tokens) in
one process that is rank 0 of W on torch's ``fake`` process group (every send and receive completes at once and
moves nothing; one thread), per schedule, against the same model unsharded. With compute this small, the
difference is the library's host work per step (on a GPU the host issues it ahead of the device; it shows once it
exceeds the device's time). Divided by the hops started and compute pieces run per step (counted with
``observe_ring``), it gives a host cost per hop, the floor a hop costs whatever the link.
``--bench-model``: the same with the bench's default model and batch under the emulated accelerator (its GEMMs
cost neither CPU nor time): the host work one rank of ``commfuse-dp bench --compute emulated`` does per step
(less the ring embedding, which a fake group cannot run). ``--bench-model real``: its GEMMs on this CPU, so the
extra is also what computing them in pieces costs: what a rank of ``commfuse-dp bench`` (real compute) spends on
the schedule besides its compute and communication.

    python benchmarks/step_overhead.py --fake-worlds 8 --schedules fused,slicing --bench-model
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import os
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist
from commfuse_dp.cli_names import spelled

if __package__ in (None, ""):  # run as a script (python benchmarks/step_overhead.py): the checkout's root, for benchmarks.*
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    from .loopback import run_loopback
except ImportError:  # run as a script: python benchmarks/step_overhead.py
    from loopback import run_loopback


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    from commfuse_dp.ring.topology import get_ring
    from commfuse_dp.ring.transport import start_hop

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    ring = get_ring()
    rows = []
    for size in args.sizes:
        send, recv = torch.randn(size // 4), torch.empty(size // 4)
        issue, wait = [], []
        for i in range(args.steps + 20):
            dist.barrier() if i % 50 == 0 else None
            t0 = time.perf_counter()
            handle = start_hop(ring, [send], [recv], tag=ring.next_tag(), op="probe", k=0, hops=1,
                               timeout_s=60)
            t1 = time.perf_counter()
            _busy(args.piece_ms / 1e3)
            t2 = time.perf_counter()
            handle.wait()
            t3 = time.perf_counter()
            if i >= 20:
                issue.append(t1 - t0)
                wait.append(t3 - t2)
        rows.append((size, statistics.median(issue), statistics.median(wait)))
    if rank == 0:
        queue.put((rows, _identity_cost(ring, world)))
    dist.barrier()
    dist.destroy_process_group()


def _identity_cost(ring, world: int, calls: int = 100_000) -> tuple[float, float]:
    """Seconds per call of ``StepState.ring_op`` and of ``Ring.next_tag``, best of 5 runs of ``calls``."""
    import timeit

    from torch.distributed.device_mesh import init_device_mesh

    from commfuse_dp import CommFuseConfig
    from commfuse_dp.fused import step_state
    from commfuse_dp.runtime.engine import Engine

    steps = step_state(Engine(ring, init_device_mesh("cpu", (world,)), CommFuseConfig()))
    owners = [steps.register(f"model.layers.{i}.mlp.down_proj") for i in range(256)]
    op = min(timeit.repeat(lambda: steps.ring_op(owners[7], "forward"), number=calls, repeat=5)) / calls
    tag = min(timeit.repeat(ring.next_tag, number=calls, repeat=5)) / calls
    return op, tag


def fake_rank0(world: int) -> None:
    """This process as rank 0 of ``world`` on torch's ``fake`` group (every send and receive completes at once and
    moves nothing), with ``shard()``'s agreement check between ranks off (a fake group moves no objects). Its works
    say so when asked (``is_completed``: a fake work answers False forever, as if its bytes never landed; a gloo
    work answers True once they have)."""
    from torch._C._distributed_c10d import FakeWork
    from torch.testing._internal.distributed.fake_pg import FakeStore

    FakeWork.is_completed = lambda self: True

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    importlib.import_module("commfuse_dp.shard").check_ranks_agree = lambda *a, **k: None


def _fake_world(world: int, schedules: list[str], reps: int, device: str = "cpu", bench_model: str | None = None
                ) -> dict:
    """One process, rank 0 of ``world`` on a fake group: seconds per training step per schedule, and counts.
    ``bench_model``: the bench's default model and batch instead of the tiny Llama, under the emulated accelerator
    ("emulated") or on this CPU ("real")."""
    import contextlib

    from transformers import LlamaConfig, LlamaForCausalLM

    import commfuse_dp as cf
    from commfuse_dp.ring.transport import observe_ring

    torch.set_num_threads(1)
    fake_rank0(world)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=224, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    accelerator, min_fuse_numel = contextlib.nullcontext, 0
    if bench_model:
        from benchmarks import bench_model as bench_shapes
        from benchmarks.emulated import EmulatedAccelerator

        shape = bench_shapes.default_shape()
        cfg, ids = bench_shapes.model_config(shape), bench_shapes.make_batch(shape, 0)["input_ids"]
        min_fuse_numel = shape.min_fuse_numel
        if bench_model == "emulated":
            accelerator = functools.partial(EmulatedAccelerator, 1e6, host_ahead=True)  # GEMMs: no CPU, no time
    if device != "cpu":
        torch.cuda.set_device(torch.device(device).index or 0)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)

    def step(model) -> float:
        t0 = time.perf_counter()
        with accelerator():
            model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        sync()  # (on a GPU: the device's time too, which this small a model keeps far below the host's)
        return time.perf_counter() - t0

    torch.manual_seed(0)
    models = {"unsharded": LlamaForCausalLM(cfg).to(device)}
    counts: dict[str, dict] = {}
    for schedule in schedules:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(device)
        # ring embeddings and the non-finite check exchange counts and flags, which a fake group never delivers
        options = dict(min_fuse_numel=min_fuse_numel, ring_embeddings=False, nonfinite_grads="off")
        config = (cf.CommFuseConfig(schedule="fused", lookahead_mb=0, **options) if schedule == "lockstep"
                  else cf.CommFuseConfig(schedule=schedule, **options))
        models[schedule] = cf.shard(model, config)
        for _ in range(2):  # the first records the layer order, the second runs the lookahead
            step(models[schedule])
        counts[schedule] = {}
        with observe_ring(lambda event, op, k, c=counts[schedule]: c.__setitem__(event, c.get(event, 0) + 1)):
            step(models[schedule])
    step(models["unsharded"])
    # The models take turns, step by step, so that a machine whose speed drifts slows them all alike.
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(reps):
        for name, model in models.items():
            times[name].append(step(model))
    result = {"unsharded": statistics.median(times["unsharded"])}
    for schedule in schedules:
        result[schedule] = (statistics.median(times[schedule]), counts[schedule],
                            len(cf.describe(models[schedule]).fused_groups))
    dist.destroy_process_group()
    return result


def _fake_table(args) -> int:
    import json
    import subprocess

    model = (f"the bench's model (4 layers x 512, 512 tokens), {args.bench_model} compute" if args.bench_model
             else "tiny Llama (2 layers, hidden 64, 128 tokens)")
    print(f"host time per training step, {model} on {args.device}, rank 0 of "
          f"W on a fake group (nothing moves), one thread, median of {args.reps} steps, the models taking turns")
    print(f"{'W':>3} {'schedule':>9} {'step ms':>8} {'unsharded':>9} {'extra ms':>9} {'hops':>10} "
          f"{'pieces':>7} {'us per hop+piece':>17}")
    per_group: dict[str, list[tuple[int, float]]] = {}  # schedule: (W, extra seconds per fused group)
    extras: dict[str, dict[str, float]] = {}  # W: {schedule: extra seconds per step} (--json)
    for world in args.fake_worlds:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one-fake", str(world),
                               "--schedules", ",".join(args.schedules), "--reps", str(args.reps),
                               "--device", args.device] + (["--bench-model", args.bench_model] if args.bench_model else []),
                              capture_output=True, text=True, timeout=600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"W={world} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
            return 1
        result = json.loads(lines[-1][7:])
        base = result.pop("unsharded")
        for schedule, (seconds, counts, groups) in result.items():
            hops, pieces = counts.get("start", 0), counts.get("compute", 0)
            extra = seconds - base
            per_group.setdefault(schedule, []).append((world, extra / max(groups, 1)))
            extras.setdefault(str(world), {})[schedule] = extra
            per = extra / max(1, hops + pieces)
            print(f"{world:>3} {schedule:>9} {seconds * 1e3:>8.1f} {base * 1e3:>9.1f} {extra * 1e3:>9.1f} "
                  f"{hops:>10} {pieces:>7} {per * 1e6:>17.0f}")
    for schedule, points in per_group.items():
        if len(points) > 1:  # least squares: extra per fused group = a + b * W (``commfuse-dp plan --host-fit A,B``)
            a, b = _line(points)
            print(f"{schedule}: {a * 1e3:.2f} + {b * 1e3:.3f} N ms per fused group per step "
                  f"(plan --host-fit {a:.2e},{b:.2e})")
    if args.json:
        with open(args.json, "w") as f:
            command = "python benchmarks/step_overhead.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
            json.dump({"command": command, "model": "bench" if args.bench_model else "tiny",
                       "compute": args.bench_model or "real", "device": args.device, "extra_s": extras}, f, indent=1)
        print(f"wrote {args.json} (commfuse-dp plan --calibrate BENCH_JSON --overhead {args.json})")
    return 0


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Intercept and slope of the least-squares line through ``points``."""
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-processes", dest="world_size", metavar="N", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--sizes", default="4096,1048576", help="bytes per shard, comma-separated")
    parser.add_argument("--steps", type=int, default=500, help="hops timed per size")
    parser.add_argument("--piece-ms", type=float, default=2.0, help="busy compute between start and wait")
    parser.add_argument("--fake-worlds", default=None,
                        help="instead: whole training steps' host time on a fake group of each of these sizes")
    parser.add_argument("--schedules", default="fused,lockstep,slicing", help="with --fake-worlds")
    parser.add_argument("--reps", type=int, default=20, help="timed steps per schedule, with --fake-worlds")
    parser.add_argument("--device", default="cpu", help="with --fake-worlds: cpu, or cuda (kernel launches too)")
    parser.add_argument("--bench-model", nargs="?", const="emulated", choices=("emulated", "real"), default=None,
                        help="with --fake-worlds: the bench's default model and batch (4 layers x 512, 512 tokens, "
                             "its min_fuse_numel), on the CPU: 'emulated' (the default; GEMMs cost no CPU: the host "
                             "work a rank of `commfuse-dp bench --compute emulated` does per step) or 'real' (GEMMs "
                             "on this CPU, in pieces as the schedule computes them)")
    parser.add_argument("--json", default=None,
                        help="with --fake-worlds: write each schedule's extra seconds per step here (with "
                             "--bench-model, for `commfuse-dp plan --calibrate BENCH_JSON --overhead FILE`)")
    parser.add_argument("--one-fake", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(spelled(sys.argv[1:] if argv is None else list(argv), parser, "step_overhead"))
    args.schedules = args.schedules.split(",")
    if args.one_fake:
        import json

        print("RESULT " + json.dumps(_fake_world(args.one_fake, args.schedules, args.reps, args.device,
                                                 args.bench_model)), flush=True)
        return 0
    if args.bench_model and args.device != "cpu":
        parser.error("--bench-model runs on the CPU (as `commfuse-dp bench` does)")
    if args.fake_worlds:
        args.fake_worlds = [int(w) for w in args.fake_worlds.split(",")]
        return _fake_table(args)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    result = run_loopback(_rank, args.world_size, args, timeout=600)
    if result is None:
        print("a rank failed; see its output above")
        return 1
    rows, (op_s, tag_s) = result
    print(f"host time per hop, gloo over loopback, {args.world_size} ranks, median of {args.steps} hops, "
          f"{args.piece_ms:g} ms of compute between start and wait")
    print(f"{'shard':>10} {'issue us':>9} {'wait us':>8} {'total us':>9}")
    for size, issue, wait in rows:
        print(f"{size:>10} {issue * 1e6:>9.1f} {wait * 1e6:>8.1f} {(issue + wait) * 1e6:>9.1f}")
    print(f"per ring operation: identity tag and label (StepState.ring_op) {op_s * 1e6:.2f} us, plain counter tag "
          f"(Ring.next_tag) {tag_s * 1e6:.2f} us (best of 5 x 100000 calls)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
