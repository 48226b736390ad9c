"""One rank of ``benchmarks/tp_bench.py``: the variants of a tensor-parallel step, interleaved round by round.

Variants (every one a forward and backward of a Llama-family causal LM on the whole batch; GEMMs and attention on
the emulated accelerator, ``--emulated-host sync``: the host waits for each, so that no schedule's collectives
start before the compute they follow, as on a GPU whose communication waits for its compute stream):

- ``fused``: ``commfuse_dp.tensor_parallel``: the activation rings beside the GEMM pieces.
- ``dtensor``: DTensor's sequence-parallel TP as torchtitan applies it (``benchmarks/dtensor_tp.py``) on gloo over
  the same links.
- ``hf_tp``: transformers' own TP plan (``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N,
  tp_plan="auto"))``: q/k/v/gate/up column-wise, o/down row-wise ending in an all-reduce, the lm_head's logits
  gathered; no sequence parallelism), on gloo over the same links.
- ``unfused``: ``tensor_parallel(fused=False)``: DTensor's schedule (each gather waited for before its GEMM, each
  reduce-scatter after it) on this library's rings, so that the gain of fusing shows apart from the transport's.
- ``compute_only``: a rank's compute alone: one process runs the model with 1/N of the heads, of the MLP's width
  and of the vocabulary on the whole sequence, and nothing moves.
- ``comm_only``: the fused variant's rings alone: its compute emulated at 10^6 times the rate.

With ``--dp D`` > 1, the world is D x (world / D): fused through ``shard(CommFuseConfig(tp_size=...))``,
dtensor with FSDP2 units over the data-parallel dimension (``beside_data_parallel``), each data-parallel rank its
own batch; compute_only is one TP rank's compute alone.

Rank 0 writes each variant's step times (seconds, one per timed step) and its saved activations (the bytes autograd
keeps for the backward, counted once per storage) to ``--out`` as JSON. ``--memory`` (started with ``probes.MMAP_ENV``):
instead of timing, each variant's peak resident bytes during a step above what the process held before it
(``probes.peak_step_bytes``), the largest over the ranks, one a round, after the warm-up steps.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

VARIANTS = ("fused", "dtensor", "hf_tp", "unfused", "compute_only", "comm_only")


def build(args, tp: int = 1):
    """The bench's model, its heads, MLP width and vocabulary divided by ``tp`` (compute_only's rank)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab // tp, hidden_size=args.hidden, intermediate_size=args.inner // tp,
        num_hidden_layers=args.layers, num_attention_heads=args.heads // tp, num_key_value_heads=args.heads // tp,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def transformers_tp(args, world: int):
    """The bench's model through transformers' own TP: rank 0 saves it, every rank loads it with
    ``DistributedConfig(tp_size=world, tp_plan="auto")``."""
    import tempfile

    import transformers
    from transformers.distributed import DistributedConfig

    folder = os.path.join(tempfile.gettempdir(), f"commfuse-tp-bench-model-{os.environ['MASTER_PORT']}")
    if dist.get_rank() == 0:
        build(args).save_pretrained(folder)
    dist.barrier()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(tp_size=world, tp_plan="auto"), attn_implementation="sdpa")
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return model


def beside_data_parallel(name: str, args, world: int):
    """``--dp D``: the variant's model on the mesh ``(dp, tp)``: fused through ``shard(tp_size=...)``, DTensor's
    TP with FSDP2 units (each decoder layer and the root) over the data-parallel dimension, as torchtitan does."""
    from torch.distributed.device_mesh import init_device_mesh

    tp = world // args.dp
    if name in ("fused", "comm_only"):
        from commfuse_dp import CommFuseConfig, shard

        return shard(build(args), CommFuseConfig(schedule="fused", tp_size=tp))
    if name == "dtensor":
        from torch.distributed.fsdp import fully_shard

        from benchmarks.dtensor_tp import dtensor_sequence_parallel

        mesh = init_device_mesh("cpu", (args.dp, tp), mesh_dim_names=("dp", "tp"))
        model = build(args)
        dtensor_sequence_parallel(model, mesh["tp"])
        for layer in model.get_decoder().layers:
            fully_shard(layer, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"])
    raise ValueError(f"--dp {args.dp}: variant {name!r} runs on one data-parallel rank only")


class Variant:
    def __init__(self, name: str, args, world: int) -> None:
        from benchmarks.emulated import EmulatedAccelerator

        self.name = name
        if args.dp > 1 and name != "compute_only":
            self.model = beside_data_parallel(name, args, world)
        elif name == "compute_only":
            self.model = build(args, world // args.dp)
        elif name == "hf_tp":
            self.model = transformers_tp(args, world)
        else:
            self.model = build(args)
            if name == "dtensor":
                from torch.distributed.device_mesh import init_device_mesh

                from benchmarks.dtensor_tp import dtensor_sequence_parallel

                dtensor_sequence_parallel(self.model, init_device_mesh("cpu", (world,)))
            else:
                from commfuse_dp import tensor_parallel

                tensor_parallel(self.model, fused=name != "unfused")
        self.accelerator = EmulatedAccelerator(args.tflops * (1e6 if name == "comm_only" else 1.0), host_ahead=False)
        gen = torch.Generator().manual_seed(1 + dist.get_rank() // (world // args.dp))  # a batch per DP rank
        vocab = self.model.config.vocab_size
        self.ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
        self.positions = torch.arange(args.seq)[None]
        self.context = contextlib.nullcontext
        if name == "dtensor":
            from torch.distributed.tensor.parallel import loss_parallel

            self.context = loss_parallel

    def step(self) -> None:
        before = self.accelerator.flops
        with self.accelerator, self.context():
            loss = self.model(input_ids=self.ids, labels=self.ids, position_ids=self.positions).loss
            loss.backward()
            self.accelerator.synchronize()
        self.model.zero_grad(set_to_none=True)
        self.step_flops = self.accelerator.flops - before

    def saved_bytes(self) -> int:
        """The bytes autograd saves for one step's backward on this rank (each storage once)."""
        storages: dict[int, int] = {}

        def pack(t):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                local = t.to_local() if hasattr(t, "to_local") else t
                try:
                    storage = local.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
                except RuntimeError:  # a wrapper (a collective's pending output): its own bytes
                    storages[id(local)] = local.numel() * local.element_size()
            return t

        with self.accelerator, self.context(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self.model(input_ids=self.ids, labels=self.ids, position_ids=self.positions).loss
        params = {p.data_ptr() for p in self.model.parameters()}
        params |= {p.to_local().untyped_storage().data_ptr() for p in self.model.parameters()
                   if isinstance(p, DTensor)}
        del loss
        return sum(n for ptr, n in storages.items() if ptr not in params)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master", required=True, help="host:port of rank 0's rendezvous")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tflops", type=float, default=0.02)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--inner", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks beside TP (world / dp TP ranks)")
    parser.add_argument("--memory", action="store_true", help="peak memory of a step instead of timing")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    host, port = args.master.rsplit(":", 1)
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, RANK=str(args.rank), WORLD_SIZE=str(args.world_size))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    names = [v for v in args.variants.split(",") if v]
    variants = {name: Variant(name, args, args.world_size) for name in names}
    saved = {name: v.saved_bytes() for name, v in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.warmup):
        for v in variants.values():
            v.step()
    if args.memory:
        return _peaks(variants, args)
    for _ in range(args.rounds):
        for name, v in variants.items():
            v.step()  # (untimed: the timed steps follow a step of their own variant)
            for _ in range(args.steps):
                dist.barrier()
                began = time.perf_counter()
                v.step()
                took = torch.tensor([time.perf_counter() - began])
                dist.all_reduce(took, dist.ReduceOp.MAX)  # the step ends when its slowest rank's does
                times[name].append(took.item())
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"times": times, "saved_bytes": saved, "flops_per_step": {
                name: v.step_flops for name, v in variants.items()}}, f)
    dist.destroy_process_group()
    return 0


def _peaks(variants: dict, args) -> int:
    """Each variant's peak step bytes (the largest rank's), one a round, to ``--out``."""
    from benchmarks.probes import peak_step_bytes

    peaks: dict[str, list[int]] = {name: [] for name in variants}
    for _ in range(max(args.rounds, 1)):
        for name, v in variants.items():
            dist.barrier()
            peak = torch.tensor([float(peak_step_bytes(v.step))])
            dist.all_reduce(peak, dist.ReduceOp.MAX)
            peaks[name].append(int(peak.item()))
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"peak_step_bytes": peaks}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
