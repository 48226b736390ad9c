"""One rank of a benchmark run (started by ``benchmarks/bench.py`` inside its network namespace).

Every variant is built once, on the same model (same seed) and the same per-rank batch, then the variants take turns
(``--rounds`` rounds, each running ``--steps`` timed steps of every variant after a warm-up), so that all of them see
the same machine. In each round a variant first runs ``--settle`` untimed steps (default 1), so that its timed steps
follow a step of its own, as in training: a step that follows another variant's was slower (at 8 emulated ranks
on 2 cores, fused 0.2-0.3 s of 5.3: its memory is touched afresh, about twice the page faults, while 8 processes
share the cores). A step is forward + backward + optimizer step (AdamW), timed on this rank between a barrier and
its end; rank 0 gathers every rank's times and keeps the slowest rank per step.

Compute: real (default; the CPU computes) or ``--compute emulated --tflops X`` (benchmarks/emulated.py: every GEMM
and attention kernel waits its FLOPs at X TFLOP/s instead of using the CPU, and returns zeros; for timing schedules at
more ranks than cores, not for training).

Variants (``bench --help`` and docs/performance.md say more):
- ``defaults``: ``shard`` with ``CommFuseConfig()`` told the link (``link_gbps``) and a rank's tokens
  (``tokens_per_rank``); its ``"auto"`` schedule is fused or the peer's, and the result says which (``chosen``).
  ``defaults_nohints``: told nothing (it measures the link and the GEMM rate at ``shard()``, assumes the tokens).
  Under ``--compute emulated`` every variant is built with the emulated accelerator on, so that what the defaults
  measure is its rate.
- ``fused``, ``slicing``: ``shard`` with that schedule; ``fused_noprefetch``, ``fused_lockstep`` (``lookahead_mb=0``),
  ``fused_bundles`` (``forward_bundles=True``), ``fused_ring`` (``direct_kb=0``): variants of it, when asked for.
  Narrow formats on the wire: ``fused_bf16`` (bf16 gathers and gradients), ``fused_fp8`` (fp8 gathers, bf16
  gradients), ``fused_int8`` (int8 gathers, bf16 gradients), ``fused_int8_int8`` (int8 gathers, int8 gradients
  with error feedback); ``fsdp2_bf16``, ``fsdp2_int8``, ``fsdp2_int8_int8``: the peer with the same formats.
- ``fsdp2_overlap``, the peer: stock ``fully_shard`` over torchtitan's units (the embedding, each decoder layer, the
  final norm with the lm_head; ``fsdp_units.peer_plan``, what ``schedule="fsdp2"`` runs) on the same rings, run as
  FSDP2 runs on a GPU (``use_ring_collectives(model, overlap=True)``: gathers one unit ahead, asynchronous, in
  forward and backward, the backward's first as it begins; reduce-scatters behind the backward's compute,
  waited for at its end). ``fsdp2_coarse``: the same over each layer and a root holding the embedding, the final
  norm and the lm_head. ``fsdp2_torch``: torchtitan's units and the same schedule on torch's own gloo collectives,
  no code of commfuse_dp (``fsdp2_torch.py``).
- ``fsdp2``: stock ``fully_shard`` with its own gloo collectives, synchronous on CPU (a CPU artefact).
- ``deepspeed_zero3``: a DeepSpeed ZeRO-3 engine (gloo, torch AdamW); ``ddp``: ``DistributedDataParallel``.
- ``compute_only``: the unsharded model, same batch, no communication, the optimizer on 1/N of the parameters (the
  compute bound); ``comm_only``: the bytes ``shard()`` moves in a step through the rings, no compute (the
  communication bound); ``concurrent`` (when asked for): both at once on two threads, the best any overlap can do
  on this machine.
- ``hsdp_fused``, ``hsdp_slicing``, ``fsdp2_hsdp`` (``--nodes K``): K copies of the model sharded over each node's
  ranks, gradients averaged across them. ``fsdp2_hsdp`` is FSDP2's HSDP as torchtitan builds it: stock
  ``fully_shard`` over torchtitan's units (``fsdp_units.peer_plan``) on the 2-D mesh ``(replicate, shard)``, its
  collectives on the same rings run as FSDP2 runs on a GPU (``use_ring_collectives(overlap=True)``: gathers one
  unit ahead, reduce-scatters and each unit's all-reduce across the copies behind the backward's compute). With a
  narrow format: ``hsdp_fused_<format>``, ``fsdp2_hsdp_<format>`` (``NARROW``), the format on both tiers.
  Under ``--nodes`` the ``defaults`` variant is told only the tokens: its ``replicate="auto"`` measures both tiers.

``compute_only`` and ``comm_only`` also time their forward part (``forward_s``: the forward, and the embedding's
exchange with the forward all-gathers), for the bench's *gather floor* (``bench.records_from``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from .bench_model import MODEL_DEFAULTS, build_model, make_batch
from .probes import MMAP_ENV, CollectorClock, peak_step_bytes, resident_bytes
from commfuse_dp.handle import handle_of

OPTIMIZERS = {"fused": {"fused": True}, "foreach": {}}  # --optimizer: AdamW's keyword arguments
VARIANTS = ("defaults", "fused", "fsdp2_overlap", "fsdp2_torch", "slicing", "fsdp2", "deepspeed_zero3", "ddp",
            "compute_only", "comm_only")
# for A/B measurements and the multi-node bench (--num-machines); not in the default set
EXTRA_VARIANTS = ("defaults_nohints", "fsdp2_coarse", "fused_noprefetch", "fused_lockstep", "fused_bundles",
                  "fused_ring", "fused_bf16", "fused_fp8", "fused_int8", "fused_int8_int8", "fsdp2_bf16", "fsdp2_int8",
                  "fsdp2_int8_int8", "concurrent", "hsdp_fused", "hsdp_slicing", "fsdp2_hsdp", "hsdp_fsdp2", "hsdp_fsdp2_nocheck", "hpz_fsdp2",
                  *(f"{kind}_{fmt}" for kind in ("hsdp_fused", "fsdp2_hsdp") for fmt in ("bf16", "int8", "int8_int8")))
# Narrow formats on the wire (commfuse_dp/wire.py) of the fused_<name> and fsdp2_<name> variants
NARROW = {"bf16": dict(gather_format="bf16", reduce_format="bf16"),
          "fp8": dict(gather_format="fp8", reduce_format="bf16"),
          "int8": dict(gather_format="int8", reduce_format="bf16"),
          "int8_int8": dict(gather_format="int8", reduce_format="int8", error_feedback=True)}
NODE_VARIANTS = ("defaults", "hsdp_fused", "fsdp2_hsdp", "compute_only")  # bench --num-machines's default
TIMELINE_VARIANTS = ("fused", "fsdp2_overlap", "slicing", "hsdp_fused")  # --timeline records one step of each present


# The bench's default model and batch (its --hidden ... --min-fuse-numel)
class Runner:
    """A variant: ``step()`` runs one training step on the fixed batch."""

    def __init__(self, name, args, rank, world):
        self.name, self.args, self.rank, self.world = name, args, rank, world
        self.batch = make_batch(args, rank)
        self.model = None
        self.opt_s: float | None = None  # the last step's optimizer time (None: no optimizer of ours runs)
        self.forward_s: float | None = None  # compute_only, comm_only: the last step's forward part
        self._began = 0.0
        self.accelerator = None  # --compute emulated: an EmulatedAccelerator (benchmarks/emulated.py)
        if getattr(args, "compute", "real") == "emulated":
            from .emulated import EmulatedAccelerator

            self.accelerator = EmulatedAccelerator(args.tflops,
                                                   host_ahead=getattr(args, "emulated_host", "sync") == "ahead")
            with self.accelerator:  # (what shard() measures of the device is the emulated one's)
                self._builder(name)()
                self._synchronize()
        else:
            self._builder(name)()

    def _builder(self, name):
        """The build method of variant ``name``; ``fused_<format>`` and ``fsdp2_<format>``: fused or the peer with
        a narrow format on the wire (``NARROW``); ``hsdp_fused_<format>``, ``fsdp2_hsdp_<format>``: HSDP so."""
        for prefix, build in (("hsdp_fused_", self._build_hsdp_fused), ("fsdp2_hsdp_", self._build_fsdp2_hsdp)):
            if name.startswith(prefix) and name[len(prefix):] in NARROW:
                return lambda: build(**NARROW[name[len(prefix):]])
        schedule, _, fmt = name.partition("_")
        if schedule in ("fused", "fsdp2") and fmt in NARROW:
            build = self._build_fused if schedule == "fused" else self._build_fsdp2_overlap
            return lambda: build(**NARROW[fmt])
        return getattr(self, f"_build_{name}")

    def _optimizer(self, params):
        # fused: torch's one-kernel AdamW, the Trainer's default (optim="adamw_torch_fused"); foreach: torch's
        # default when constructed plainly, which dispatches each of its list ops through DTensor
        return torch.optim.AdamW(params, lr=1e-4, **OPTIMIZERS[getattr(self.args, "optimizer", "fused")])

    def _build_fused(self, schedule="fused", **options):
        import commfuse_dp as cf

        if schedule == "fused" and "lookahead_mb" not in options:
            la = getattr(self.args, "lookahead_mb", "auto")
            options["lookahead_mb"] = la if la == "auto" else float(la)
        options.setdefault("replicate", 1)  # (one flat ring also across --nodes; the hsdp_* variants say otherwise)
        config = cf.CommFuseConfig(schedule=schedule, timeout_s=600, min_fuse_numel=self.args.min_fuse_numel,
                                   **options)
        self.model = cf.shard(build_model(self.args), config)
        self.opt = self._optimizer(self.model.parameters())

    def _build_defaults(self, hints=True):
        import commfuse_dp as cf

        told = dict(tokens_per_rank=self.args.batch * self.args.seq) if hints else {}
        if hints and self.args.nodes == 1:  # (across nodes the two tiers are measured: replicate="auto")
            told["link_gbps"] = self.args.link_mbit / 8000 if self.args.link_mbit else None
        config = cf.CommFuseConfig(timeout_s=600, min_fuse_numel=self.args.min_fuse_numel, **told)
        self.model = cf.shard(build_model(self.args), config)
        self.opt = self._optimizer(self.model.parameters())

    def _build_defaults_nohints(self):
        self._build_defaults(hints=False)

    def _build_hsdp_fused(self, schedule="fused", **formats):
        self._build_fused(schedule, replicate=self.args.nodes, **formats)

    def _build_hsdp_slicing(self):
        self._build_hsdp_fused("slicing")

    def _build_hsdp_fsdp2(self):
        self._build_fused("fsdp2", replicate=self.args.nodes)

    def _build_hsdp_fsdp2_nocheck(self):
        self._build_fused("fsdp2", replicate=self.args.nodes, nonfinite_grads="off")

    def _build_hpz_fsdp2(self):
        self._build_fused("fsdp2", hpz_size=self.world // self.args.nodes)

    def _build_fsdp2_hsdp(self, **formats):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import commfuse_dp as cf
        from commfuse_dp import fsdp_units
        from commfuse_dp.integrations.fsdp import use_ring_collectives

        nodes = self.args.nodes
        mesh = init_device_mesh("cpu", (nodes, self.world // nodes), mesh_dim_names=("dp_replicate", "dp_shard"))
        self.model = build_model(self.args)
        layers = list(self.model.model.layers)[::-1]  # (innermost first, as shard() lists units)
        fsdp_units.apply(fsdp_units.peer_plan(self.model, layers, set()), mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        use_ring_collectives(self.model, cf.CommFuseConfig(timeout_s=600, **formats), overlap=True)
        self.opt = self._optimizer(self.model.parameters())

    def _build_fused_noprefetch(self):
        self._build_fused(prefetch_next=False)

    def _build_fused_lockstep(self):
        self._build_fused(lookahead_mb=0)

    def _build_fused_bundles(self):
        self._build_fused(forward_bundles=True)

    def _build_fused_ring(self):
        self._build_fused(direct_kb=0)

    def _build_slicing(self):
        self._build_fused("slicing")

    def _build_fsdp2(self):
        from torch.distributed.fsdp import fully_shard

        self.model = build_model(self.args)
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.opt = self._optimizer(self.model.parameters())

    def _build_fsdp2_overlap(self, coarse=False, **formats):
        from torch.distributed.fsdp import fully_shard

        import commfuse_dp as cf
        from commfuse_dp import fsdp_units
        from commfuse_dp.integrations.fsdp import use_ring_collectives

        self.model = build_model(self.args)
        layers = list(self.model.model.layers)[::-1]  # (innermost first, as shard() lists units)
        fsdp_units.apply((fsdp_units.coarse_plan if coarse else fsdp_units.peer_plan)(self.model, layers, set()))
        fully_shard(self.model)
        use_ring_collectives(self.model, cf.CommFuseConfig(timeout_s=600, **formats), overlap=True)
        self.opt = self._optimizer(self.model.parameters())

    def _build_fsdp2_coarse(self):
        self._build_fsdp2_overlap(coarse=True)

    def _build_fsdp2_torch(self):
        from .fsdp2_torch import build

        self.model = build(build_model(self.args))
        self.opt = self._optimizer(self.model.parameters())

    def _build_ddp(self):
        from torch.nn.parallel import DistributedDataParallel

        self.model = DistributedDataParallel(build_model(self.args))
        self.opt = self._optimizer(self.model.parameters())

    def _build_compute_only(self):
        # The per-rank work of a sharded rank: forward and backward of the whole model on this rank's batch, and the
        # optimizer step on this rank's 1/N of every parameter (views into the parameters and their grads).
        self.model = build_model(self.args)
        chunks = [(p, p.detach().view(-1).chunk(self.world)) for p in self.model.parameters()]
        self._owned = [(p, c[self.rank]) for p, c in chunks if self.rank < len(c)]
        self.opt = self._optimizer([view for _, view in self._owned])

    def _build_deepspeed_zero3(self):
        import deepspeed

        model = build_model(self.args)
        config = {"train_micro_batch_size_per_gpu": self.args.batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 10**9, "wall_clock_breakdown": False}
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=self._optimizer(model.parameters()),
                                                 config=config)
        self.model, self.opt, self.engine = engine, opt, engine

    def _build_comm_only(self):
        from commfuse_dp.ring import ring_all_gather, ring_reduce_scatter

        model = build_model(self.args)
        embed = model.model.embed_tokens.weight
        units = [list(layer.parameters()) for layer in model.model.layers]
        units += [list(model.model.norm.parameters()) + list(model.lm_head.parameters())]
        numels = [sum(p.numel() for p in unit) for unit in units]
        shards = [torch.zeros(-(-n // self.world)) for n in numels]
        fulls = [torch.zeros(self.world * s.numel()) for s in shards]
        # The embedding moves what shard()'s ring embedding moves: the token ids and then, each way, the rows of
        # its tokens that other ranks own (ids spread evenly: T/N rows with each peer, in one direct round), where
        # those are fewer than the table ring's (N-1) shards (costs.Unit.exchange); else the table forward and its
        # gradient backward.
        tokens, chunk = self.args.batch * self.args.seq, -(-embed.shape[0] // self.world)
        rows = tokens * (self.world - 1) // self.world <= (self.world - 1) * chunk
        width = (-(-tokens // self.world) if rows else chunk) * embed.shape[1]
        e_shard, e_full = torch.zeros(width), torch.zeros(self.world * width)
        ids, all_ids = torch.zeros(tokens, dtype=torch.int64), torch.zeros(self.world * tokens, dtype=torch.int64)
        del model

        def step():
            if rows:
                ring_all_gather(all_ids, ids)
                ring_all_gather(e_full, e_shard, direct_kb=math.inf)  # (T/N rows to and from every peer)
            else:
                ring_all_gather(e_full, e_shard)
            for shard, full in zip(shards, fulls):  # forward all-gathers
                ring_all_gather(full, shard)
            if self.name == "comm_only":
                self.forward_s = time.perf_counter() - self._began
            for shard, full in zip(reversed(shards), reversed(fulls)):  # backward: all-gather + reduce-scatter
                ring_all_gather(full, shard)
                ring_reduce_scatter(shard, full)
            if rows:
                ring_all_gather(e_full, e_shard, direct_kb=math.inf)
            else:
                ring_reduce_scatter(e_shard, e_full)

        self._comm_step = step

    def _build_concurrent(self):
        import threading

        self._build_comm_only()
        comm_step = self._comm_step
        self._build_compute_only()
        failure: list[BaseException] = []

        def run_comm():
            try:
                comm_step()
            except BaseException as err:  # surfaced on the main thread below
                failure.append(err)

        def step():
            thread = threading.Thread(target=run_comm, daemon=True)
            thread.start()
            self._compute_step()
            thread.join(timeout=600)
            if thread.is_alive() or failure:
                raise RuntimeError(f"concurrent: the communication thread failed: {failure or 'still running'}")

        self._comm_step = step

    def step(self) -> None:
        self._began = time.perf_counter()
        if self.name in ("comm_only", "concurrent"):
            self._comm_step()
            return
        self._compute_step()

    def _compute_step(self) -> None:
        if self.accelerator is None:
            self._compute()
            return
        with self.accelerator:  # this thread only: a communication thread (concurrent) is not affected
            self._compute()

    def _synchronize(self) -> None:
        if self.accelerator is not None:
            self.accelerator.synchronize()

    def _compute(self) -> None:
        if self.name == "deepspeed_zero3":
            loss = self.engine(**self.batch).loss
            self.engine.backward(loss)
            self._synchronize()
            began = time.perf_counter()
            self.engine.step()
            self.opt_s = time.perf_counter() - began
            return
        loss = self.model(**self.batch).loss
        if self.name == "compute_only":
            self._synchronize()  # (an emulated device's forward ends here)
            self.forward_s = time.perf_counter() - self._began
        loss.backward()
        self._synchronize()  # the optimizer runs on the host after the emulated backward, as a GPU's after its own
        began = time.perf_counter()
        if self.name in ("compute_only", "concurrent"):
            for p, view in self._owned:
                view.grad = p.grad.view(-1).chunk(self.world)[self.rank]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.name in ("compute_only", "concurrent"):
            self.model.zero_grad(set_to_none=True)
        self.opt_s = time.perf_counter() - began


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master", required=True, help="host:port of rank 0's rendezvous")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--settle", type=int, default=1, help="untimed steps of each variant in each round, before "
                        "its timed ones (the bench's --settle)")
    parser.add_argument("--memory", action="store_true",
                        help="also measure peak memory per variant (start the process with MMAP_ENV)")
    parser.add_argument("--timeline", help="write fused/slicing ring timelines of one step to this JSON file")
    parser.add_argument("--out", required=True)
    parser.add_argument("--compute", choices=("real", "emulated"), default="real")
    parser.add_argument("--tflops", type=float, default=0.02, help="--compute emulated: TFLOP/s of a rank")
    parser.add_argument("--emulated-host", choices=("ahead", "sync"), default="ahead",
                        help="--compute emulated: the host runs ahead of the emulated device (default) or waits for "
                             "each GEMM (benchmarks/emulated.py)")
    parser.add_argument("--lookahead-mb", default="auto", help="CommFuseConfig.lookahead_mb of the fused variant")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="fused", help="AdamW's implementation")
    parser.add_argument("--nodes", type=int, default=1, help="copies for the hsdp_* variants (the bench's --nodes)")
    parser.add_argument("--link-mbit", type=float, default=None,
                        help="the link's rate, Mbit/s, told to the defaults variant (CommFuseConfig.link_gbps)")
    for name, default in MODEL_DEFAULTS:
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # one core per rank
    host, port = args.master.rsplit(":", 1)
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, RANK=str(args.rank), WORLD_SIZE=str(args.world_size))
    # what a launcher tells a rank of its node (the emulated cluster sets them under --nodes): one node of every rank,
    # each with its own link, else ``--nodes`` nodes of consecutive ranks
    per_node = args.world_size // args.nodes
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(per_node))
    os.environ.setdefault("LOCAL_RANK", str(args.rank % per_node))
    os.environ.setdefault("GROUP_RANK", str(args.rank // per_node))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=600))
    rank, world = args.rank, args.world_size
    names = [v for v in args.variants.split(",") if v]
    runners = {name: Runner(name, args, rank, world) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    waited: dict[str, list[float]] = {name: [] for name in names}  # fused/slicing: time blocked on the rings
    # the optimizer's step on the host (never emulated: real CPU, which 4-8 ranks share here; HSDP's works on
    # R times the parameters of a flat shard)
    opt: dict[str, list[float | None]] = {name: [] for name in names}
    forward: dict[str, list[float | None]] = {name: [] for name in names}  # compute_only, comm_only
    # Host work per step: this process's CPU seconds (user + system, every thread: compute, the ring's thread, gloo)
    # and minor page faults (first touches of freshly allocated memory). Under --compute emulated the GEMMs sleep,
    # so CPU seconds are the host work of the schedule itself.
    host: dict[str, list[tuple[float, int, float]]] = {name: [] for name in names}
    collector = CollectorClock()  # and the seconds Python's garbage collector ran (every thread)
    for _ in range(args.warmup):
        for runner in runners.values():
            runner.step()
    for _ in range(args.rounds):
        for name, runner in runners.items():
            for _ in range(args.settle):  # untimed: the timed steps follow a step of their own variant
                runner.step()
            for _ in range(args.steps):
                dist.barrier()
                before = resource.getrusage(resource.RUSAGE_SELF)
                collector.take()
                start = time.perf_counter()
                runner.step()
                times[name].append(time.perf_counter() - start)
                opt[name].append(runner.opt_s)
                forward[name].append(runner.forward_s)
                after = resource.getrusage(resource.RUSAGE_SELF)
                host[name].append((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
                                   after.ru_minflt - before.ru_minflt, collector.take()))
                engine = getattr(handle_of(runner.model), "engine", None)
                if engine is not None and not (runner.accelerator is not None and runner.accelerator.host_ahead):
                    # (with the host ahead of an emulated device, time blocked on rings is the host's, not the
                    # device's: not recorded)
                    waited[name].append(engine.stats.current().exposed_comm_s)
    memory = {}
    if args.memory:
        missing = {k: v for k, v in MMAP_ENV.items() if os.environ.get(k) != v}
        if missing:
            raise SystemExit(f"worker --memory: start the process with {missing} in its environment "
                             f"(bench.py does); without them freed memory stays resident and peaks are wrong")
        for name, runner in runners.items():
            dist.barrier()
            memory[name] = resident_bytes(runner) + peak_step_bytes(runner.step)
    timelines = {}
    if args.timeline:
        from commfuse_dp.timeline import record_timeline

        for name in TIMELINE_VARIANTS:
            if name in runners:
                dist.barrier()
                accelerator = runners[name].accelerator
                if accelerator is not None:
                    accelerator.spans = []
                with record_timeline() as timeline:
                    runners[name].step()
                if accelerator is not None:  # the emulated device's busy time (back-to-back pieces merged)
                    busy: list[list[float]] = []
                    for t0, t1 in accelerator.spans:
                        if busy and t0 <= busy[-1][1] + 1e-6:
                            busy[-1][1] = t1
                        else:
                            busy.append([t0, t1])
                    timeline.events += [{"lane": "device", "op": "busy", "k": i, "t0": t0 - timeline.origin,
                                         "t1": t1 - timeline.origin} for i, (t0, t1) in enumerate(busy)]
                    accelerator.spans = None
                timelines[name] = timeline.events
    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, {"times": times, "waited": waited, "memory": memory, "timelines": timelines,
                                      "host": host, "opt": opt, "forward": forward})
    if rank == 0:
        result = {"variants": {}}
        for name in names:
            per_step = [max(g["times"][name][i] for g in gathered) for i in range(len(times[name]))]
            result["variants"][name] = {
                "step_s": statistics.median(per_step) if per_step else None, "steps_s": per_step,
                "waited_s": statistics.median(max(g["waited"][name][i] for g in gathered)
                                              for i in range(len(waited[name]))) if waited[name] else None,
                # the rank that waited least: the rest of the most's is a rank waiting for a slower one's compute
                "waited_min_s": statistics.median(min(g["waited"][name][i] for g in gathered)
                                                  for i in range(len(waited[name]))) if waited[name] else None,
                # each rank's own median: one rank always waiting more means an asymmetry in the work, not noise
                "waited_ranks_s": [statistics.median(g["waited"][name]) for g in gathered] if waited[name] else None,
                "peak_mem_mb": (max(g["memory"].get(name, 0) for g in gathered) / 2**20) if args.memory else None,
                # medians over steps of the mean over ranks
                "opt_s": statistics.median(max(g["opt"][name][i] for g in gathered)
                                           for i in range(len(opt[name]))) if opt[name] and None not in opt[name]
                else None,
                "forward_s": statistics.median(max(g["forward"][name][i] for g in gathered)
                                               for i in range(len(forward[name])))
                if forward[name] and None not in forward[name] else None,
                "cpu_s": statistics.median(sum(g["host"][name][i][0] for g in gathered) / world
                                           for i in range(len(host[name]))) if host[name] else None,
                "minor_faults": statistics.median(sum(g["host"][name][i][1] for g in gathered) / world
                                                  for i in range(len(host[name]))) if host[name] else None,
                # per timed step, in the order of steps_s: the mean over ranks (a step that differs shows why)
                "steps_cpu_s": [sum(g["host"][name][i][0] for g in gathered) / world for i in range(len(host[name]))],
                "steps_minor_faults": [sum(g["host"][name][i][1] for g in gathered) / world
                                       for i in range(len(host[name]))],
                "steps_gc_s": [max(g["host"][name][i][2] for g in gathered) for i in range(len(host[name]))],
            }
        result["tokens_per_rank"] = args.batch * args.seq
        result["compute"] = args.compute if args.compute == "real" else f"emulated at {args.tflops:g} TFLOP/s"
        result["lookahead_mb"] = args.lookahead_mb  # the fused variant's (fused_lockstep: 0)
        result["optimizer"] = f"AdamW ({args.optimizer})"
        result["chosen"] = {name: handle_of(runner.model).choice.as_dict() for name, runner in runners.items()
                            if getattr(handle_of(runner.model), "choice", None) is not None}
        result["timelines"] = {name: [g["timelines"].get(name, []) for g in gathered]
                               for name in TIMELINE_VARIANTS if name in names and args.timeline}
        with open(args.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
