"""A plain ``accelerate`` training loop that knows nothing of commfuse (``Accelerator()``, no commfuse import).

    torchrun --nproc_per_node 2 tests/launch_accelerate_script.py OUT_JSON         (DDP; ACCELERATE_USE_CPU=true)
    commfuse-dp launch --config_file accel.yaml tests/launch_accelerate_script.py OUT_JSON [MODEL]

tests/test_launch.py runs it both ways and compares. Rank 0 writes every rank's per-step losses and what the
model, the optimizer and the Accelerator looked like; every rank writes OUT_JSON.rank<R> (its own view).
"""

import json
import sys
import time

import hf_models  # tests/ is sys.path[0]: the script's own folder
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader


def main(out: str, kind: str = "gpt2") -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = hf_models.build(kind, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(hf_models.Synthetic(32, seed=1), batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses, grad_norms = [], []
    for batch in loader:  # 32 samples / (2 ranks x 2) = 8 micro-batches, 4 optimizer steps
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                grad_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach().reshape(1))
    all_losses = accelerator.gather(torch.cat(losses)).reshape(accelerator.num_processes, -1)
    params = list(model.parameters())
    with open(f"{out}.rank{accelerator.process_index}", "w") as f:   # every rank: what it trained
        json.dump({"rank": accelerator.process_index, "num_processes": accelerator.num_processes,
                   "accelerator_class": type(accelerator).__name__,
                   "param_types": sorted({type(p.data).__name__ for p in params})}, f)
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump({
                "num_processes": accelerator.num_processes,
                "distributed_type": str(accelerator.distributed_type),
                "accelerator_class": type(accelerator).__name__,
                "model_type": type(model).__name__,
                # what commfuse_dp.integrations.attach recorded on the model's handle (read as attributes: no commfuse import)
                "attachments": getattr(getattr(model, "_commfuse", None), "attachments", []),
                "param_types": sorted({type(p.data).__name__ for p in params}),
                "optimizer_param_types": sorted({type(p.data).__name__ for g in optimizer.param_groups
                                                 for p in g["params"]}),
                "optimizer_state_types": sorted({type(v).__name__ for s in optimizer.state.values()
                                                 for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}),
                "losses": all_losses.tolist(), "grad_norms": grad_norms,
            }, f, indent=1)
    time.sleep(0.1)   # torch's gloo workers free their last work with the GIL (commfuse_dp/ring/topology.py)


if __name__ == "__main__":
    main(*sys.argv[1:3])
