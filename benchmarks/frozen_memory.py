"""Peak memory per rank of a TRL DPO run whose reference model is sharded, against the same run with the reference
left whole on every rank (``CommFuseConfig(shard_frozen=False)``).

    python benchmarks/frozen_memory.py [--num-processes 2] [--layers 8] [--hidden 512] [--json FILE]

Each variant runs in its own ``torchrun`` launch (peak resident memory only grows within a process): a Llama of
the given shape as policy and as reference, ``commfuse_trainer(DPOTrainer)`` with ``CommFuseCallback``, 3 steps
on CPU in fp32 (``bf16=False``: TRL's configs default to bf16 autocast). Every rank reports the largest resident
set (``/proc/self/statm``) it had from the start of training to its end, sampled after every micro-batch with
glibc's free pages returned (both models are built whole before the Trainer shards them, so the process's own peak
is the same in both), and the reference's elements it holds.
The difference between the variants should be about the reference's size times (N-1)/N.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
from commfuse_dp.cli_names import spelled
from commfuse_dp.handle import handle_of


def _resident_mib() -> float:
    """This process's resident set now, after glibc returned the free pages it keeps (so freed tensors do not
    count)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _rank(out: str, frozen: str, layers: int, hidden: int) -> None:
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    import commfuse_dp as cf
    from commfuse_dp.integrations.transformers import CommFuseCallback, commfuse_trainer
    from commfuse_dp.recipes.finetune_clm import embedded_tokenizer

    torch.set_num_threads(1)
    words = [f"w{i}" for i in range(50)]
    gen = torch.Generator().manual_seed(0)

    def text(k):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (k,), generator=gen))

    rows = {"prompt": [text(6) for _ in range(48)], "chosen": [text(8) for _ in range(48)],
            "rejected": [text(5) for _ in range(48)]}
    tokenizer = embedded_tokenizer(rows["prompt"] + rows["chosen"] + rows["rejected"], 300)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

    def llama():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 11 // 4,
            num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None))

    args = DPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to=[],
                     per_device_train_batch_size=2, max_steps=3, save_strategy="no", logging_steps=1,
                     disable_tqdm=True, max_length=48)
    reference = llama()
    trainer = commfuse_trainer(DPOTrainer)(
        model=llama(), ref_model=reference, args=args, train_dataset=Dataset.from_dict(rows),
        processing_class=tokenizer,
        callbacks=[CommFuseCallback(cf.CommFuseConfig(schedule="fused", shard_frozen=frozen == "sharded"))])
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in trainer.ref_model.parameters())
    samples = []

    class Resident(TrainerCallback):  # the resident set after every training step (and micro-batch)
        def on_substep_end(self, *args, **kwargs):
            samples.append(_resident_mib())

        on_step_end = on_substep_end

    trainer.add_callback(Resident())
    gc.collect()
    samples.append(_resident_mib())
    trainer.train()
    peak_mib = max(samples)
    # what the sharded reference keeps between steps besides its shards: the gathered-weight buffers that the CPU
    # schedule pools for the next step (runtime/layer_rings.py, SlotPool)
    pool = getattr(getattr(getattr(handle_of(trainer.ref_model), "steps", None), "schedule", None), "_pool", None)
    pooled = [b for bufs in (pool._free.values() if pool is not None else ()) for b in bufs]
    pooled_mib = sum(b.numel() * b.element_size() for b in pooled) / 2**20
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"peak_mib": peak_mib, "held": held, "pooled_mib": pooled_mib,
                                   "total": sum(p.numel() for p in reference.parameters())})
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(every, f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-processes", dest="ranks", metavar="N", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--json", help="write the figures (and this command) here")
    parser.add_argument("--rank-run", nargs=2, metavar=("OUT", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(spelled(sys.argv[1:] if argv is None else list(argv), parser, "frozen_memory"))
    if args.rank_run:
        _rank(args.rank_run[0], args.rank_run[1], args.layers, args.hidden)
        return 0
    import socket

    results = {}
    for variant in ("whole", "sharded"):
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "rank.json")
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks),
                                   "--master_addr", "127.0.0.1", "--master_port", str(port), os.path.abspath(__file__),
                                   "--layers", str(args.layers), "--hidden", str(args.hidden),
                                   "--rank-run", out, variant], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-4000:], file=sys.stderr)
                return 1
            with open(out) as f:
                results[variant] = json.load(f)
    total = results["whole"][0]["total"]
    ref_mib = total * 4 / 2**20
    expected = ref_mib * (args.ranks - 1) / args.ranks
    print(f"reference: {total} elements, {ref_mib:.1f} MiB in fp32; {args.ranks} ranks")
    print(f"{'rank':>4} {'whole: MiB':>16} {'sharded: MiB':>18} {'saved MiB':>10} {'held (sharded)':>15}")
    for rank in range(args.ranks):
        whole, sharded = results["whole"][rank], results["sharded"][rank]
        print(f"{rank:>4} {whole['peak_mib']:>16.1f} {sharded['peak_mib']:>18.1f} "
              f"{whole['peak_mib'] - sharded['peak_mib']:>10.1f} {sharded['held']:>15}")
    print(f"expected saving: the reference's size x (N-1)/N = {expected:.1f} MiB; the sharded reference's gathered-"
          f"weight buffers pooled for the next step (CPU): {results['sharded'][0]['pooled_mib']:.1f} MiB on rank 0")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/frozen_memory.py " + " ".join(argv or sys.argv[1:]),
                       "ranks": args.ranks, "reference_elements": total, "expected_saving_mib": expected,
                       "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
