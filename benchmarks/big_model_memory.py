"""Peak memory of a big model that never exists whole on one rank, against the model's own size.

    torchrun --nproc_per_node 2 benchmarks/big_model_memory.py [--dir runs/big_model] [--layers 10] [--compare]

1. If ``<dir>/pretrained`` holds no weights yet, a separate single process builds the decoder normally and writes
   it with ``save_pretrained`` (its memory is not counted: it is what a hub download would be).
2. meta path, per rank: ``with torch.device("meta")`` build, ``commfuse_dp.shard`` (each rank allocates its own
   shards), ``checkpoint.load_hf_weights`` (each rank reads its slices), then ``checkpoint.save_pretrained`` into
   ``<dir>/exported`` (each rank writes its slices in place).
3. ``--compare``: the former path in the same processes: build the full model on every rank, shard it, load the
   same weights, export by gathering the full state dict on rank 0 (``full_state_dict`` + the model's
   ``save_pretrained``).

Printed per rank and phase: the model's size in bytes (fp32), this rank's parameter shard bytes, and the peak
resident memory of the phase (``VmHWM`` of /proc/self/status, reset with /proc/self/clear_refs before each phase)
above the resident memory before it, also as a multiple of the model's size, and the peak of the process's anonymous memory
(``RssAnon``, sampled: tensors without the safetensors file pages that mmap maps in); ``ru_maxrss`` is the
process's peak since it started. The shards ``to_empty`` allocates are untouched (not resident) until loaded. Memory only; the timings are printed for orientation, not as a benchmark.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Self

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=layers,
                       num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=512,
                       tie_word_embeddings=False)


def _write_pretrained(folder: str, layers: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(layers))
    model.save_pretrained(folder)


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class Phase:
    """Peak resident memory of a block, above the resident memory at its start: ``VmHWM`` (all resident pages,
    file-backed ones included: safetensors reads through mmap, so the pages of the file a rank reads count while
    mapped) and the peak of ``RssAnon`` (the process's own memory: tensors, buffers), sampled every 2 ms."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.anon_peak = max(self.anon_peak, _kib("RssAnon"))

    def __enter__(self) -> Self:
        import gc

        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        self.start_rss, self.t0 = _kib("VmRSS"), time.perf_counter()
        self.start_anon = self.anon_peak = _kib("RssAnon")
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, _kib("RssAnon"))
        self.peak, self.seconds = _kib("VmHWM"), time.perf_counter() - self.t0


def _report(rank: int, phase: Phase, model_bytes: int, shard_bytes: int) -> None:
    above, anon = phase.peak - phase.start_rss, phase.anon_peak - phase.start_anon
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mib = 2**20
    print(f"rank {rank} {phase.name:<29} model {model_bytes / mib:6.0f} MiB, shards {shard_bytes / mib:5.0f} MiB | "
          f"VmHWM {phase.peak / mib:5.0f} MiB (+{above / mib:5.0f} = {above / model_bytes:4.2f} x model) | "
          f"RssAnon peak +{anon / mib:5.0f} MiB = {anon / model_bytes:4.2f} x model | ru_maxrss {maxrss / mib:5.0f} MiB"
          f" | {phase.seconds:4.1f} s", flush=True)


def _shard_bytes(model) -> int:
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="runs/big_model")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--compare", action="store_true", help="also run the former path (full model per rank)")
    parser.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    pretrained, exported = os.path.join(args.dir, "pretrained"), os.path.join(args.dir, "exported")
    if args.write_only:
        _write_pretrained(pretrained, args.layers)
        return

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0 and not os.path.isfile(os.path.join(pretrained, "config.json")):
        print(f"writing {pretrained} in a separate process ...", flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--dir", args.dir, "--layers", str(args.layers),
                        "--write-only"], check=True)
    dist.barrier()

    from transformers import AutoModelForCausalLM

    import commfuse_dp as cf
    from commfuse_dp import checkpoint as ck

    config = cf.CommFuseConfig(stats=False)
    ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(0))

    with Phase("meta: build + shard") as build:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_config(args.layers))
        cf.shard(model, config)
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    shards = _shard_bytes(model)
    _report(rank, build, model_bytes, shards)
    with Phase("meta: load_hf_weights") as load:
        ck.load_hf_weights(model, pretrained)
    _report(rank, load, model_bytes, shards)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1, :4].tolist()
    with Phase("meta: save_pretrained") as save:
        ck.save_pretrained(model, exported)
    _report(rank, save, model_bytes, shards)
    print(f"rank {rank} meta path: logits[-1, :4] {[round(x, 5) for x in logits]}", flush=True)
    del model

    if args.compare:
        with Phase("full: build + shard") as build:
            model = AutoModelForCausalLM.from_config(_config(args.layers))
            cf.shard(model, config)
        _report(rank, build, model_bytes, _shard_bytes(model))
        with Phase("full: load_hf_weights") as load:
            ck.load_hf_weights(model, pretrained)
        _report(rank, load, model_bytes, _shard_bytes(model))
        with Phase("full: gathered save (former)") as save:
            ck._save_pretrained_gathered(model, exported + "-gathered", rank == 0)
        _report(rank, save, model_bytes, _shard_bytes(model))
        del model

    dist.barrier()
    if rank == 0:
        total = sum(os.path.getsize(os.path.join(exported, f)) for f in os.listdir(exported) if
                    f.endswith(".safetensors"))
        print(f"exported {exported}: {total / 2**20:.1f} MiB of safetensors", flush=True)
        back = AutoModelForCausalLM.from_pretrained(exported)  # after the measurements: a whole copy on rank 0
        with torch.no_grad():
            again = back(input_ids=ids).logits[0, -1, :4].tolist()
        print(f"from_pretrained({exported}): logits[-1, :4] {[round(x, 5) for x in again]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
