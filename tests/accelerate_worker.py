"""One rank of an accelerate training loop, launched by tests/test_accelerate.py through torchrun.

    torchrun --nproc_per_node 2 tests/accelerate_worker.py OUT_DIR commfuse,ddp,resume KIND

commfuse: CommFuseAccelerator; the optimizer is built on the full parameters BEFORE prepare (prepare re-points
it); 6 optimizer steps of 2 accumulated micro-batches with clipping and a linear LR schedule; save_state after
step 3; a consolidated save_pretrained at the end. ddp: the same loop with a plain Accelerator(cpu=True) (DDP).
resume: a fresh CommFuseAccelerator run that load_state()s the step-3 checkpoint, skips the batches already
consumed and runs steps 4..6. async / asyncresume: commfuse / resume with CommFuseConfig(async_save=True): the
sharded part of the state is written in the background while steps 4..6 change every weight, and read back by
asyncresume (OUT_DIR/state-after-3-async). ef / efresume: commfuse / resume with int8 gradients and error
feedback (CommFuseConfig(reduce_format="int8", error_feedback=True)): the residuals travel with the state
(OUT_DIR/state-after-3-ef). The modes run one after another in the same processes, each with an
Accelerator of its own. Rank 0 writes OUT_DIR/MODE.json.
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import hf_models  # noqa: E402

STEPS, ACCUM, SAVE_AFTER = 6, 2, 3


def main(out_dir: str, modes: str, kind: str) -> None:
    for mode in modes.split(","):
        acc = run(out_dir, mode, kind)
    acc.end_training()


def run(out_dir: str, mode: str, kind: str):
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor

    from commfuse_dp import CommFuseConfig
    from commfuse_dp.integrations.accelerate import CommFuseAccelerator
    from commfuse_dp.integrations.attach import attachments
    from commfuse_dp.ring.topology import drain_gloo_workers

    torch.set_num_threads(1)
    if mode == "ddp":
        acc = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    else:
        feedback = {"reduce_format": "int8", "error_feedback": True} if mode.startswith("ef") else {}
        acc = CommFuseAccelerator(commfuse=CommFuseConfig(schedule="fused", min_fuse_numel=0,
                                                          async_save=mode.startswith("async"), **feedback),
                                  gradient_accumulation_steps=ACCUM)
    model = hf_models.build(kind, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / (4 * STEPS))
    # 2 ranks x 2 per batch x 2 accumulation x 6 steps = 48 samples; no shuffling, so the data position is the
    # number of batches consumed.
    loader = torch.utils.data.DataLoader(hf_models.Synthetic(48, seed=1), batch_size=2)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    ckpt_dir = os.path.join(out_dir, "state-after-3-async" if mode.startswith("async") else
                            "state-after-3-ef" if mode.startswith("ef") else "state-after-3")
    first_step = 0
    batches = loader
    if mode in ("resume", "asyncresume", "efresume"):
        acc.load_state(ckpt_dir)
        first_step = SAVE_AFTER
        batches = acc.skip_first_batches(loader, SAVE_AFTER * ACCUM)
    losses, norms, step, window = [], [], first_step, []
    for batch in batches:
        with acc.accumulate(model):
            loss = model(**batch).loss
            window.append(loss.detach())
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if acc.sync_gradients:
            step += 1
            mean = acc.gather_for_metrics(torch.stack(window).mean().reshape(1)).mean()
            losses.append(float(mean))
            window = []
            if mode in ("commfuse", "async", "ef") and step == SAVE_AFTER:
                acc.save_state(ckpt_dir)
    result = {"losses": losses, "grad_norms": norms, "lr": scheduler.get_last_lr()[0],
              "world_size": acc.num_processes, "accelerator": type(acc).__name__,
              "model_type": type(model).__name__, "attachments": attachments(model),
              "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
              "optimizer_state_dtensor": all(isinstance(v, DTensor) for s in optimizer.state.values()
                                             for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")),
              "optimizer_is_model_params": {id(p) for g in optimizer.param_groups for p in g["params"]}
              == {id(p) for p in model.parameters()}}
    if mode == "async":
        acc.wait_for_save()
        result["checkpoint_files"] = sorted(os.listdir(ckpt_dir))
    if mode == "commfuse":
        saved = os.path.join(out_dir, "hf")
        acc.unwrap_model(model).save_pretrained(saved, state_dict=acc.get_state_dict(model),
                                                is_main_process=acc.is_main_process)
        acc.save_model(model, os.path.join(out_dir, "hf-save-model"))  # every rank writes its slices in place
        acc.wait_for_everyone()
        model.eval()
        with torch.no_grad():
            result["logits"] = model(**hf_models.batch(0, 99)).logits.tolist()
        result["saved_files"] = sorted(os.listdir(saved))
        result["checkpoint_files"] = sorted(os.listdir(ckpt_dir))
    result["optimizer_is_model_params"] = bool(result["optimizer_is_model_params"])
    if acc.is_main_process:
        with open(os.path.join(out_dir, f"{mode}.json"), "w") as f:
            json.dump(result, f)
    drain_gloo_workers()   # the plain Accelerator's DDP group too (commfuse_dp/ring/topology.py)
    return acc


if __name__ == "__main__":
    main(*sys.argv[1:4])
