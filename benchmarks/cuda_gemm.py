"""The device helpers of ``cuda_check.py`` (``device_of``, ``seconds_per_call``, ``hold_freed_buffers``) and its
``gemm`` part: one GEMM whole against N pieces as the fused linear computes it, forward and backward."""

from __future__ import annotations

import time

import torch


def device_of(args) -> torch.device:
    if args.device:
        device = torch.device(args.device)
        return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def seconds_per_call(fn, device: torch.device, reps: int) -> float:
    """Seconds per call of ``fn`` after two untimed calls (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def hold_freed_buffers() -> None:
    """Keep each reduce-scatter's input (slicing's partials) and each gradient ring handed to the replicate ring's stream
    (HSDP fused) alive until the end of the backward instead of freeing it at once under ``record_stream``. The
    CUDA sanitizer keys accesses by data pointer and forgets only a freed block's base pointer, not the views at
    offsets inside it, so a block reused after ``record_stream`` allowed it reads as a race (its report says "Trace
    for tensor allocation not found"). If the sanitizer is clean with this, what it reported without it was that
    reuse."""
    from commfuse_dp.runtime.slicing import SlicingCall, SlicingScheduler

    held: list = []
    scatter, end = SlicingCall.finish, SlicingScheduler.end_backward

    def finish(self):
        held.append(self.grads.parts)
        return scatter(self)

    def end_backward(self):
        end(self)
        held.clear()

    SlicingCall.finish, SlicingScheduler.end_backward = finish, end_backward

    from commfuse_dp.runtime.replicas import Replicas

    after_event, exchange = Replicas.after_event, Replicas.exchange

    def held_after_event(self, finish, event, buffers):
        held.append(buffers)
        return after_event(self, finish, event, buffers)

    def held_exchange(self, accumulate):
        exchange(self, accumulate)
        held.clear()

    Replicas.after_event, Replicas.exchange = held_after_event, held_exchange


def part_gemm(args) -> dict:
    """Whole GEMM against N pieces, as the fused linear computes it, forward and backward."""
    device = device_of(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = 256 if args.quick else args.tokens
    scale = 16 if args.quick else 1
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    pieces = (1, 2, 4) if args.quick else (1, 2, 4, 8, 16)
    reps = 2 if args.quick else 10

    def timed(fn) -> float:
        return seconds_per_call(fn, device, reps)

    out = {"tokens": tokens, "dtype": str(dtype), "pieces": {}}
    for name, (fan_out, fan_in) in shapes.items():
        fan_out, fan_in = fan_out // scale, fan_in // scale
        x = torch.randn(tokens, fan_in, device=device, dtype=dtype)
        w = torch.randn(fan_out, fan_in, device=device, dtype=dtype)
        dy = torch.randn(tokens, fan_out, device=device, dtype=dtype)
        y, dx, dw = torch.empty_like(dy), torch.empty_like(x), torch.empty_like(w)
        row = {}
        for n in pieces:
            rows = fan_out // n
            cuts = [(k * rows, (k + 1) * rows) for k in range(n)]

            def forward():
                for lo, hi in cuts:
                    torch.mm(x, w[lo:hi].t(), out=y[:, lo:hi])

            def backward():
                dx.zero_()
                for lo, hi in cuts:
                    dx.addmm_(dy[:, lo:hi], w[lo:hi])
                    torch.mm(dy[:, lo:hi].t(), x, out=dw[lo:hi])

            def backward_dx():
                dx.zero_()
                for lo, hi in cuts:
                    dx.addmm_(dy[:, lo:hi], w[lo:hi])

            def backward_dw():
                for lo, hi in cuts:
                    torch.mm(dy[:, lo:hi].t(), x, out=dw[lo:hi])

            f, b = timed(forward), timed(backward)
            flops = 2 * tokens * fan_in * fan_out
            # the backward's two halves on their own: dx summed over n products of K = out/n (the thin ones), dW
            # shard by shard (K = tokens)
            row[n] = {"forward_s": f, "backward_s": b, "forward_tflops": flops / f / 1e12,
                      "backward_tflops": 2 * flops / b / 1e12, "backward_dx_s": timed(backward_dx),
                      "backward_dw_s": timed(backward_dw)}
        wc = torch.empty_like(w)
        row["weight_copy_s"] = timed(lambda: wc.copy_(w))  # gathering a group's rows into one block
        for n in pieces:
            row[n]["slowdown_vs_whole"] = (row[n]["forward_s"] + row[n]["backward_s"]) / (
                row[1]["forward_s"] + row[1]["backward_s"])
        out["pieces"][f"{name} {fan_out}x{fan_in}"] = row
    return out
