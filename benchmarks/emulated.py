"""The emulated accelerator (``commfuse-dp bench --compute emulated --tflops X``): compute that costs time, not CPU.

A GPU computes without the host's CPU, so on a real cluster a rank's communication never competes with its compute
for a core. Here 4 or 8 ranks share 2 cores. To time the schedules of such a cluster faithfully, each compute
piece -- every GEMM (``mm``, ``addmm``, ``bmm``, ``baddbmm``: the fused linears' pieces, the FSDP2 units' layers,
the lm_head and so the loss) and every attention kernel, forward and backward -- is replaced, while the
accelerator is active, by a Python kernel registered over torch's own CPU kernel of that op (``torch.library``; no
other op passes through Python, so the host's cost of everything else is what it is without the accelerator): a
wait of ``FLOPs / (X TFLOP/s)`` on this rank's own clock (the host sleeps: the GIL and
the cores are free for the communication threads), and its output is a zero tensor of the right shape, dtype and
strides. FLOPs are counted as ``torch.utils.flop_counter`` counts them (attention: the full ``L x S`` score
matrix, causal or not).

What is not emulated: everything else runs for real on the CPU (norms, activations, softmax, the optimizer,
copies; small next to the GEMMs at the bench's shapes, and the same for every schedule), and every byte of
communication moves over the emulated links. The numbers a model computes in this mode are zeros, not its
results: the mode times schedules, it does not train (records say ``"compute": "emulated"``).

Waits are kept on a running clock: a piece due before the previous one ended starts when that one ends, and the
host sleeps only once the clock is ahead of it by more than ``MIN_SLEEP_S``, so thousands of small pieces still
cost their sum and not the sleeps' granularity.

``host_ahead=True`` (the bench's default, ``--emulated-host ahead``): the host does not sleep after each piece but
goes on, as it does beside a GPU, whose kernels queue while the host issues the next ones; the emulated device
works its queue on the clock. Ring work requested by this thread does not start before the clock's time at its
request (``commfuse_dp.ring.topology.set_device_clock``: a CUDA communication stream waits for the compute
stream's event so), the host blocks where it waits for a hop as before, and ``synchronize()`` sleeps until
the queue is done (the worker calls it after the backward and at the step's end). So host work of the schedule
(Python, packing, the ring thread's issuing) overlaps the emulated compute, as on a GPU, instead of adding to it.
``host_ahead=False`` (``--emulated-host sync``): the host sleeps until each piece is done. Either way, work that is
not emulated (norms, softmax, the optimizer) runs on the host's CPU.
"""

from __future__ import annotations

import threading
import time

import torch
from torch.utils import flop_counter
from torch.utils._pytree import tree_map

MIN_SLEEP_S = 2e-4

aten = torch.ops.aten
_FLOPS = dict(flop_counter.flop_registry)
# CPU attention kernels (not in the registry): same arguments, in order, as the CUDA flash kernels'.
_FLOPS[aten._scaled_dot_product_flash_attention_for_cpu] = \
    flop_counter.flop_registry[aten._scaled_dot_product_flash_attention]
_FLOPS[aten._scaled_dot_product_flash_attention_for_cpu_backward] = \
    flop_counter.flop_registry[aten._scaled_dot_product_flash_attention_backward]
# In-place GEMMs (the fused backward's ``dx.addmm_(dy, w)``): as their out-of-place forms.
_FLOPS[aten.addmm_] = flop_counter.flop_registry[aten.addmm]
_FLOPS[aten.baddbmm_] = flop_counter.flop_registry[aten.baddbmm]


class EmulatedAccelerator:
    """Under ``with EmulatedAccelerator(tflops):``, GEMMs and attention cost time at ``tflops`` and return zeros."""

    def __init__(self, tflops: float, host_ahead: bool = False) -> None:
        self.host_ahead = host_ahead
        self._thread: int | None = None  # the thread whose compute is emulated (set on entering)
        self._library: torch.library.Library | None = None
        if not tflops > 0:
            raise ValueError(f"EmulatedAccelerator: tflops must be > 0, got {tflops!r}")
        self.flops_per_s = tflops * 1e12
        self.flops = 0  # FLOPs emulated so far
        self.pieces = 0
        self._due = 0.0  # perf_counter() time at which the emulated work issued so far ends
        # FLOPs and output shapes by the call's signature (op, shapes, strides, dtypes, other arguments): the meta
        # computation that finds them costs the host about as much as a small real kernel, once per piece otherwise.
        self._known: dict = {}
        self.spans: list[tuple[float, float]] | None = None  # a list: record (start, end) of each piece (timelines)

    def _emulate(self, func, args, kwargs, writes):
        """One GEMM or attention kernel: its FLOPs on the clock, zeros out. ``writes``: the positions of the
        arguments it writes into (``_writes``)."""
        if threading.get_ident() != self._thread:
            raise RuntimeError(f"EmulatedAccelerator: {func} ran on another thread than the one whose compute is "
                               "emulated; while it is active, this process's CPU GEMMs are emulated on that thread "
                               "only (the bench's compute thread)")
        key = _signature(func, args, kwargs)
        known = self._known.get(key) if key is not None else None
        if known is None:
            shapes = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))  # output shapes, no compute
            known = (int(_FLOPS[func.overloadpacket](*args, **kwargs, out_val=shapes)), shapes)
            if key is not None:
                self._known[key] = known
        flops, shapes = known
        self.flops += flops
        self.pieces += 1
        self._wait(flops / self.flops_per_s)
        if writes:
            # ``out=`` (the fused linear's ``torch.mm(x, w.t(), out=y[:, lo:hi])``): the result is zeros, written
            # where asked. In place (``dx.addmm_(dy, w)``): ``self`` plus a zero product is ``self``, left as is.
            tensors = []
            for i, name in writes:
                tensor = args[i] if i is not None and i < len(args) else kwargs.get(name)
                if isinstance(tensor, torch.Tensor):
                    if name != "self":
                        tensor.zero_()
                    tensors.append(tensor)
            return tensors[0] if len(tensors) == 1 else tuple(tensors)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        return tree_map(lambda m: _zeros_like_meta(m, device), shapes)

    def __enter__(self):
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("EmulatedAccelerator: one is active already in this process (they do not nest)")
        self._thread = threading.get_ident()
        self._library = _override_kernels(self)
        _ACTIVE = self
        if self.host_ahead:
            from commfuse_dp.ring.topology import set_device_clock

            set_device_clock(self.device_clock)
        return self

    def __exit__(self, *exc):
        global _ACTIVE
        if self.host_ahead:
            from commfuse_dp.ring.topology import set_device_clock

            self.synchronize()
            set_device_clock(None)
        self._library._destroy()  # the CPU kernels are torch's own again
        self._library = None
        _ACTIVE = None
        return False

    def device_clock(self) -> float | None:
        """When the compute issued so far ends (None on another thread: its ring work waits for nothing)."""
        return self._due if threading.get_ident() == self._thread else None

    def synchronize(self) -> None:
        """Sleep until the emulated compute issued so far is done (host ahead; else it is done already)."""
        ahead = self._due - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)

    def _wait(self, seconds: float) -> None:
        now = time.perf_counter()
        start = max(self._due, now)
        self._due = start + seconds
        if self.spans is not None:
            self.spans.append((start, self._due))
        ahead = self._due - now
        if not self.host_ahead and ahead > MIN_SLEEP_S:
            time.sleep(ahead)


_ACTIVE: EmulatedAccelerator | None = None
# The CPU kernels an accelerator replaces while it is active (every overload of these with a CPU kernel).
_EMULATED = (aten.mm, aten.addmm, aten.addmm_, aten.bmm, aten.baddbmm, aten.baddbmm_,
             aten._scaled_dot_product_flash_attention_for_cpu,
             aten._scaled_dot_product_flash_attention_for_cpu_backward)


def _override_kernels(accelerator: EmulatedAccelerator) -> torch.library.Library:
    """Register ``accelerator._emulate`` as the CPU kernel of the GEMM and attention ops (torch's own come back when
    the returned library is destroyed). Only these ops pay for a Python call; every other op runs as it would
    without the accelerator (a ``TorchDispatchMode`` put a Python call of ~28 us in front of every op, views
    included, which inflated the host time of schedules with many small ops)."""
    import warnings

    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid")
        for packet in _EMULATED:
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"):
                    library.impl(op.name().split("::")[1], _kernel(accelerator, op), "CPU")
    return library


def _kernel(accelerator: EmulatedAccelerator, op):
    writes = _writes(op)

    def emulated(*args, **kwargs):
        return accelerator._emulate(op, args, kwargs, writes)
    return emulated


def _signature(func, args, kwargs):
    """What a call's FLOPs and output shapes depend on (op, shapes, strides, dtypes, other arguments), hashable;
    None when an argument is neither a tensor nor hashable (then nothing is cached). Flat: it runs per piece."""
    key = [func, *map(_described, args)]
    for name in sorted(kwargs):
        key += (name, _described(kwargs[name]))
    key = tuple(key)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _described(value):
    if isinstance(value, torch.Tensor):
        return value.shape, value.stride(), value.dtype
    if isinstance(value, (list, tuple)):
        return tuple(map(_described, value))
    return value


def _writes(func) -> tuple[tuple[int | None, str], ...]:
    """Where ``func``'s written arguments are (its ``out=`` ones, or ``self`` of an in-place op), by schema:
    ``(position or None if keyword-only, name)``."""
    return tuple((None if arg.kwarg_only else i, arg.name) for i, arg in enumerate(func._schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write)


def _meta(value):
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _zeros_like_meta(value, device: torch.device):
    if not isinstance(value, torch.Tensor):
        return value
    return torch.zeros_like(torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device))
