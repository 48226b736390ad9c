"""The CUDA path on one GPU: what a machine with a single GPU can check of it, in one script.

    python benchmarks/cuda_check.py --out DIR            # every part; DIR/cuda_check.json holds the figures
    python benchmarks/cuda_check.py --parts linear,gemm  # some of them
    python benchmarks/cuda_check.py --device cpu --quick # a dry run of the same code on the CPU (gloo)

Parts (each in its own process, with its own timeout, so that one failure or hang does not hide the others):
- ``linear``: the fused linear at world size 1 (NCCL) against ``F.linear`` + autograd, fp32 (TF32 off) and bf16.
- ``shard``: ``shard()`` at world size 1 on tiny GPT-2 / Llama / BERT, the fused (elastic and lockstep) and
  slicing schedules, 5 AdamW steps against the unsharded model: losses, grad norms and parameters; Llama under
  bf16 autocast too; the step statistics; and ``torch.cuda.set_sync_debug_mode``'s count of host synchronisations
  inside a training step. AdamW is torch's default (foreach); ``CUDA_CHECK_ADAMW=fused`` takes ``fused=True``.
- ``fake``: 4 ranks (``--fake-world``) in this one process on a ``fake`` process group (``torch.testing``'s: every
  send and receive completes at once and moves nothing). The numbers are meaningless; it runs the multi-rank CUDA code
  (communication streams, events, buffers that cross streams) that NCCL cannot run on one GPU (NCCL refuses two
  ranks on one device), HSDP (2 copies) included, and counts host synchronisations inside a step. It runs on the
  CPU too (the dry run: the same schedules on the CPU transport).
- ``sanitizer``: ``linear``, ``shard`` and ``fake`` again under ``TORCH_CUDA_SANITIZER=1`` (stream races between
  kernels).
- ``pieces``: the library's fused layers on 8 fake ranks (Llama-3-8B layer shapes, 2 layers, bf16, 8192 tokens),
  forward + backward for ``piece_shards`` 1, 2, 4, 8 against the unsharded model: what the pieces cost as the
  library computes them (no bytes move; with ``--quick`` on the CPU, tiny shapes: only a dry run).
- ``host``: the host's time per training step on 8 fake ranks, tiny Llama (where a real step would be host-bound),
  fused and slicing against the unsharded model, and where it goes: a ``cProfile`` of 20 steps (calls per step of
  torch's device lookups, the top functions by own time). ``CUDA_CHECK_PACKAGE=DIR`` imports ``commfuse_dp`` from
  DIR instead (another checkout: before and after in one run).
- ``gemm``: one GEMM cut into N shard-sized pieces (as the fused linear cuts it: output columns in the forward,
  ``dx`` accumulated piece by piece, ``dW`` shard by shard) against the whole GEMM, Llama-3-8B shapes, bf16, timed
  with CUDA events.
- ``collectives`` (2 GPUs or more): NCCL's all-gather and reduce-scatter against the rings at FSDP2 units' sizes,
  and the link ``shard()``'s defaults measure (``cuda_collectives.py``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist

try:
    from .cuda_gemm import device_of, hold_freed_buffers, part_gemm, seconds_per_call  # noqa: F401 (--one gemm)
    from .cuda_collectives import part_collectives  # noqa: F401 (--one collectives)
except ImportError:  # run as a script: python benchmarks/cuda_check.py
    from cuda_gemm import device_of, hold_freed_buffers, part_gemm, seconds_per_call  # noqa: F401
    from cuda_collectives import part_collectives  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.environ.get("CUDA_CHECK_PACKAGE") or os.path.dirname(HERE),  # the package
                os.path.join(os.path.dirname(HERE), "tests")]  # hf_models
PARTS = ("env", "linear", "shard", "fake", "gemm", "pieces", "sanitizer", "host", "collectives")
# CUDA_CHECK_SYNC_ERRORS=1: a synchronisation inside a step raises (with TORCH_SHOW_CPP_STACKTRACES=1, its C++ stack)
SYNC_MODE = "error" if os.environ.get("CUDA_CHECK_SYNC_ERRORS") else "warn"
TIMEOUT_S = {"env": 60, "linear": 120, "shard": 180, "fake": 120, "gemm": 120, "pieces": 240, "host": 180,
             "collectives": 180}


def _init_world(device: torch.device, fake_world: int = 0) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=fake_world)
    else:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def _init_fake_world(device: torch.device, world: int) -> None:
    """``world`` ranks of torch's fake process group in this process (rank 0). A fake group moves no bytes, so
    ``shard()``'s cross-rank agreement check (a gather of pickled objects) cannot run: it is switched off."""
    _init_world(device, fake_world=world)
    importlib.import_module("commfuse_dp.shard").check_ranks_agree = lambda *a, **k: None


# A Llama small enough that a step is host time (the pieces part's --quick shapes, the host part's model)
TINY_LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def part_env(args) -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def part_linear(args) -> dict:
    """The fused linear at world size 1 against F.linear: outputs, dx, dW, db."""
    import torch.nn as nn
    from commfuse_dp import CommFuseConfig
    from commfuse_dp.runtime.engine import Engine
    from commfuse_dp.fused import attach_group, convert_linear, step_state
    from commfuse_dp.ring import get_ring
    from torch.distributed.device_mesh import init_device_mesh

    device = device_of(args)
    _init_world(device)
    engine = Engine(get_ring(), init_device_mesh(device.type, (1,)), CommFuseConfig())
    steps = step_state(engine)
    cases = [((7,), 5, True, 6), ((12, 6, 6), 10, True, 6), ((1536,), 512, False, 1024), ((384, 128, 128), 384, True, 512)]
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
    worst = {}
    for dtype in (torch.float32, torch.bfloat16):
        for members, fan_in, bias, tokens in cases:
            torch.manual_seed(0)
            refs = [nn.Linear(fan_in, o, bias=bias, dtype=dtype, device=device) for o in members]
            mods = [nn.Linear(fan_in, o, bias=bias, dtype=dtype, device=device) for o in members]
            for m, r in zip(mods, refs):
                m.load_state_dict(r.state_dict())
                convert_linear(m, engine, False)
            attach_group(steps, mods, [f"m{i}" for i in range(len(mods))])
            x = torch.randn(2, tokens // 2, fan_in, device=device, dtype=dtype, requires_grad=True)
            xr = x.detach().clone().requires_grad_(True)
            gs = [torch.randn(2, tokens // 2, o, device=device, dtype=dtype) for o in members]
            sum((m(x) * g).sum() for m, g in zip(mods, gs)).backward()
            outs = [m(x.detach()) for m in mods]
            ys = [r(xr) for r in refs]
            sum((y * g).sum() for y, g in zip(ys, gs)).backward()
            diffs = [_maxdiff(o, y) / (y.abs().max().item() + 1e-12) for o, y in zip(outs, ys)]
            diffs.append(_maxdiff(x.grad, xr.grad) / (xr.grad.abs().max().item() + 1e-12))
            for m, r in zip(mods, refs):
                for name in ("weight", "bias"):
                    p = getattr(m, name)
                    if p is not None:
                        ref = getattr(r, name).grad
                        diffs.append(_maxdiff(p.grad.full_tensor(), ref) / (ref.abs().max().item() + 1e-12))
            key = f"{dtype} {members}x{fan_in} tokens={tokens}"
            worst[key] = max(diffs)
            if max(diffs) > tol[dtype]:
                raise AssertionError(f"fused linear {key}: relative difference {max(diffs):.3g} > {tol[dtype]}")
    return {"cases": len(worst), "worst_relative_diff": worst}


def _sync_site() -> str:
    """Where a host synchronisation came from: the innermost frame outside torch and this script."""
    import traceback

    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and "warnings" not in frame.filename and \
                not frame.filename.endswith("cuda_check.py"):
            return f"{os.path.relpath(frame.filename, os.path.dirname(HERE))}:{frame.lineno} {frame.name}"
    torch_frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" in f.filename]
    return "? " + " < ".join(f"{f.filename.split('/torch/')[-1]}:{f.lineno} {f.name}" for f in reversed(torch_frames[-4:]))


def _train(model, batches, device, autocast: bool, sync_debug: bool):
    """Train; count the host synchronisations inside forward + backward of steps 2.. (where they came from)."""
    # CUDA_CHECK_ADAMW=fused: torch's one-kernel AdamW (the Trainer's default, and docs/usage.md's), else foreach
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01,
                            fused=os.environ.get("CUDA_CHECK_ADAMW") == "fused")
    losses, norms, syncs = [], [], {}

    def seen(message, *args, **kwargs) -> None:
        # the first set_sync_debug_mode of a process warns that the mode "is a prototype feature": not a sync
        if "synchroniz" in str(message) and "prototype feature" not in str(message):
            site = _sync_site()
            if site.startswith("?"):  # no Python frame of ours: the message says more
                site += f" | {str(message)[:200]}"
            syncs[site] = syncs.get(site, 0) + 1

    for step, batch in enumerate(batches):
        batch = {k: v.to(device) for k, v in batch.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = seen
            if sync_debug and device.type == "cuda" and step > 0:
                torch.cuda.set_sync_debug_mode(SYNC_MODE)
            try:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss = model(**batch).loss
                loss.backward()
            except RuntimeError as err:  # SYNC_MODE "error": where the first synchronisation was made
                if "synchroniz" not in str(err):
                    raise
                import traceback

                torch.cuda.set_sync_debug_mode(0)
                syncs["first_sync_raised"] = traceback.format_exc()[-6000:]
                return torch.stack(losses or [torch.zeros(())]), torch.stack(norms or [torch.zeros(())]), syncs
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float())
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return torch.stack(losses), torch.stack(norms), syncs


def _cases(quick: bool):
    kinds = ("llama",) if quick else ("gpt2", "llama", "bert")
    for kind in kinds:
        for schedule in ("fused", "lockstep", "slicing"):
            yield kind, schedule, False
    yield "llama", "fused", True


def part_shard(args) -> dict:
    import commfuse_dp as cf
    import hf_models

    device = device_of(args)
    _init_world(device)
    result = {}
    for kind, schedule, autocast in _cases(args.quick):
        config = (cf.CommFuseConfig(min_fuse_numel=0, lookahead_mb=0) if schedule == "lockstep" else
                  cf.CommFuseConfig(schedule=schedule, min_fuse_numel=0))
        model, ref = hf_models.build(kind).to(device), hf_models.build(kind).to(device)
        cf.shard(model, config)
        batches = [hf_models.batch(0, s) for s in range(5)]
        ours = _train(model, batches, device, autocast, sync_debug=True)
        theirs = _train(ref, batches, device, autocast, sync_debug=True)
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in model.named_parameters()}
        diffs = {"loss": _maxdiff(ours[0], theirs[0]), "grad_norm": _maxdiff(ours[1], theirs[1]),
                 "params": max(_maxdiff(full[n], p) for n, p in ref.named_parameters())}
        stats = cf.step_stats(model)
        label = f"{kind}/{schedule}" + ("/bf16-autocast" if autocast else "")
        result[label] = {"max_abs_diff": diffs, "losses": ours[0].tolist(), "host_syncs_in_steps_2_to_5": ours[2],
                         "adamw": os.environ.get("CUDA_CHECK_ADAMW", "foreach"),
                         "unsharded_host_syncs_in_steps_2_to_5": theirs[2],
                         "stats": {"wall_s": stats.wall_s, "exposed_comm_s": stats.exposed_comm_s,
                                   "hops": stats.hops}}
        tol = 2e-2 if autocast else 1e-5
        bad = {k: v for k, v in diffs.items() if v > tol * max(1.0, theirs[0].abs().max().item() if k == "loss"
                                                                  else 1.0)}
        if bad:
            raise AssertionError(f"shard() {label}: differs from the unsharded model by {bad} (tolerance {tol}); "
                                 f"so far: {json.dumps(result)}")
    return result


def part_fake(args) -> dict:
    """Multi-rank CUDA code on a fake process group: it must run, and not synchronise the host inside a step."""
    import commfuse_dp as cf
    from commfuse_dp.handle import engine_of
    import hf_models

    device = device_of(args)
    world = args.fake_world
    _init_fake_world(device, world)
    if os.environ.get("CUDA_CHECK_HOLD_PARTS"):
        hold_freed_buffers()
    result = {}
    for schedule in ("fused", "lockstep", "slicing", "hsdp-fused"):
        replicate = 2 if schedule.startswith("hsdp") else 1  # HSDP: 2 copies of world/2 ranks
        schedule = schedule.removeprefix("hsdp-")
        # ring_embeddings=False: the ring embedding gathers every rank's token count, which a fake group never sends;
        # nonfinite_grads="off": a fake receive leaves its buffer as it was (uninitialised), so gradients are garbage
        options = dict(min_fuse_numel=0, ring_embeddings=False, nonfinite_grads="off", replicate=replicate)
        config = (cf.CommFuseConfig(lookahead_mb=0, **options) if schedule == "lockstep"
                  else cf.CommFuseConfig(schedule=schedule, **options))
        model = cf.shard(hf_models.build("llama").to(device), config)
        losses, norms, syncs = _train(model, [hf_models.batch(0, s) for s in range(3)], device, False, True)
        stats = cf.step_stats(model)
        label = f"llama/{schedule}" + (f"/replicate={replicate}" if replicate > 1 else "")
        result[label] = {"ran_steps": len(losses), "host_syncs_in_steps_2_to_3": syncs,
                         "hops": stats.hops, "exposed_comm_s": stats.exposed_comm_s}
        replicas = engine_of(model).replicas
        if replicas is not None and device.type == "cuda":
            # fused landings completed and sent across the copies on the replicate ring's stream, not by compute
            result[label]["landings_on_replicate_stream"] = replicas.on_stream
            if replicas.on_stream == 0:
                raise AssertionError(f"{label}: no landing was handed to the replicate ring's stream")
    return result


def part_pieces(args) -> dict:
    """The library's own fused layers on 8 ranks of a fake process group (no bytes move, so a step is compute and
    host work), Llama-3-8B layer shapes (2 layers), bf16, 2 x 4096 tokens: forward + backward time for each
    ``piece_shards`` against the unsharded model's (whole GEMMs)."""
    import commfuse_dp as cf
    from transformers import LlamaConfig, LlamaForCausalLM

    device = device_of(args)
    world = 8
    _init_fake_world(device, world)
    if args.quick:
        cfg = LlamaConfig(**TINY_LLAMA)
        batch, seq, reps = 2, 64, 2
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096)
        batch, seq, reps = 2, 4096, 10
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def timed(model) -> tuple[float, float]:
        """(device seconds per step, host seconds to issue one step): where the host is the slower, the step is
        host-bound and the pieces' GEMM cost cannot show."""
        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        # two untimed steps: the first records the order, the second runs the lookahead
        seconds = seconds_per_call(step, device, reps)
        t0 = time.perf_counter()
        step()
        host = time.perf_counter() - t0
        torch.cuda.synchronize() if device.type == "cuda" else None
        return seconds, host

    torch.manual_seed(0)
    whole, whole_host = timed(LlamaForCausalLM(cfg).to(device, torch.bfloat16))
    result = {"world": world, "tokens": batch * seq, "reps": reps, "unsharded_s": whole,
              "unsharded_host_s": whole_host}
    for shards in (1, 2, 4, 8):
        model = LlamaForCausalLM(cfg).to(device, torch.bfloat16)
        # from_env: COMMFUSE_* variables (COMMFUSE_SCHEDULE, COMMFUSE_FORWARD_BUNDLES, ...) choose what is timed
        config = cf.CommFuseConfig.from_env(min_fuse_numel=0, ring_embeddings=False, nonfinite_grads="off",
                                            piece_shards=shards)
        result.setdefault("config", {"schedule": config.schedule, "forward_bundles": config.forward_bundles})
        cf.shard(model, config)
        seconds, host = timed(model)
        result[f"piece_shards={shards}"] = {"s": seconds, "vs_unsharded": seconds / whole, "host_s": host}
        del model
        torch.cuda.empty_cache()
    return result


def part_host(args) -> dict:
    """Host seconds per training step of ``shard()``'s CUDA path on 8 fake ranks (tiny Llama: the device is idle
    most of the step, so the step time is the host's), fused and slicing, against the unsharded model; then a
    ``cProfile`` of 20 fused steps: calls per step of torch's device lookups and the top functions by own time."""
    import cProfile
    import pstats
    import statistics

    import commfuse_dp as cf
    from transformers import LlamaConfig, LlamaForCausalLM

    device = device_of(args)
    world = 8
    _init_fake_world(device, world)
    cfg = LlamaConfig(**TINY_LLAMA)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(model) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    models = {"unsharded": LlamaForCausalLM(cfg).to(device)}
    for schedule in ("fused", "slicing"):
        models[schedule] = cf.shard(LlamaForCausalLM(cfg).to(device), cf.CommFuseConfig(
            schedule=schedule, min_fuse_numel=0, ring_embeddings=False, nonfinite_grads="off"))
    for model in models.values():
        for _ in range(3):
            step(model)
    sync()
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(30):  # interleaved: drift of the machine reaches every model alike
        for name, model in models.items():
            t0 = time.perf_counter()
            step(model)
            sync()
            times[name].append(time.perf_counter() - t0)
    result = {"world": world, "package": os.path.dirname(cf.__file__),
              "median_step_ms": {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}}
    profile, steps = cProfile.Profile(), 20
    profile.enable()
    for _ in range(steps):
        step(models["fused"])
    sync()
    profile.disable()
    stats = pstats.Stats(profile)
    calls = {f"{os.path.basename(file)}:{name}": count / steps
             for (file, _line, name), (_cc, count, *_rest) in stats.stats.items()
             if name in ("current_stream", "is_available", "current_device", "isend", "irecv", "__enter__")
             and ("cuda" in file or "distributed" in file)}
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]
    result["fused_profile"] = {
        "profiled_ms_per_step": round(stats.total_tt / steps * 1e3, 2),
        "calls_per_step": calls,
        "top_own_ms_per_step": {f"{os.path.basename(f)}:{line}({name})": round(v[2] / steps * 1e3, 3)
                                for (f, line, name), v in top}}
    return result


def _run_part(part: str, args, deadline: float, env: dict | None = None, quick: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", part, "--fake-world", str(args.fake_world),
           "--tokens", str(args.tokens)] + (["--device", args.device] if args.device else []) + (
        ["--quick"] if args.quick or quick else [])
    t0 = time.perf_counter()
    timeout = min(TIMEOUT_S[part], deadline - t0)
    if timeout < 5:
        return {"ok": False, "error": "not run: the --budget-s was spent"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as err:
        return {"ok": False, "error": f"timed out after {err.timeout} s", "tail": str(err.stderr or "")[-3000:]}
    seconds = round(time.perf_counter() - t0, 1)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        text = proc.stdout + proc.stderr
        race = text.find("CSAN detected")  # the sanitizer's report: the two accesses and their stacks
        return {"ok": False, "rc": proc.returncode, "s": seconds, "tail": text[-4000:],
                **({"sanitizer_report": text[race:race + 6000]} if race >= 0 else {})}
    return {"ok": True, "s": seconds, "result": json.loads(lines[-1][7:]), "stderr_tail": proc.stderr[-1500:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--out", default=None, help="folder for cuda_check.json")
    parser.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes, fewer models: a dry run")
    parser.add_argument("--fake-world", type=int, default=4, help="ranks for the fake process group (default 4)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per GEMM (default 8192: 2 x 4096)")
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="stop starting parts after this many seconds (each part also has its own timeout)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        result = globals()[f"part_{args.one}"](args)
        print("RESULT " + json.dumps(result, default=str), flush=True)
        return 0
    report, deadline = {}, time.perf_counter() + args.budget_s
    for part in args.parts.split(","):
        if part == "sanitizer":  # the sanitizer checks every kernel from Python: the shard part on Llama only
            report[part] = {p: _run_part(p, args, deadline, {"TORCH_CUDA_SANITIZER": "1"}, quick=p == "shard")
                            for p in ("linear", "shard", "fake")}
            ok = all(r["ok"] for r in report[part].values())
        else:
            report[part] = _run_part(part, args, deadline)
            ok = report[part]["ok"]
        print(f"== {part}: {'ok' if ok else 'FAILED'}\n{json.dumps(report[part], indent=1, default=str)[:6000]}",
              flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "cuda_check.json"), "w") as f:
                json.dump(report, f, indent=1, default=str)
    return 0 if all(r["ok"] if "ok" in r else all(v["ok"] for v in r.values()) for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
