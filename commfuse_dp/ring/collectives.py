"""Bucketed ring all-gather and reduce-scatter: their hop loops, whose hops are requested, issued and waited for
in ``ring/issue.py`` ([Note: one place for a hop]).

[Note: the ring collectives]
N ranks, rank r, shard size n. ``next = r+1``, ``prev = r-1`` (mod N).

All-gather into ``out`` (N*n, rank-major): ``out[r]`` holds the own shard; at hop k = 0 .. N-2 rank r sends
shard ``(r - k) mod N`` (the one it holds since hop k-1) to ``next`` and receives shard ``(r - k - 1) mod N``
from ``prev``, straight into its place in ``out``: nothing is staged, bytes are copied, so the result equals
``all_gather_into_tensor`` bit for bit.

Reduce-scatter of ``inp`` (N*n, rank-major) into ``out`` (n): for k = 0 .. N-1 rank r adds its own piece of
shard ``t = (r - k - 1) mod N`` to the partial sum received from ``prev`` in hop k-1 (none at k = 0) and, if
k < N-1, sends that sum on to ``next`` in hop k. At k = N-1, t = r: the sum is complete, written into ``out``,
and nothing is sent after it. The summation order is fixed by the ring, so results repeat bit for bit run to run.

Bucketing: a shard larger than ``bucket_mb`` is cut into chunks that pipeline through the ring as a wavefront:
at hop T, chunk c is at hop T - c of its own ring, so up to N-1 chunks are in flight at once and the
reduce-scatter staging memory is two buckets per chunk in flight, not two shards. Many small tensors are packed into
flat buckets by the ``*_coalesced`` variants.

Small collectives go direct: when the whole tensor (``N*n`` elements) is at most ``direct_kb`` KiB and N > 2, each
rank exchanges with every peer in one round instead of N-1 hops (the same bytes leave each rank; one latency
instead of N-1, which is what a tiny bucket costs: the root unit's norms at a step's head and tail). All-gather:
rank r sends its shard to every peer and receives shard p from rank p. Reduce-scatter: rank r sends its piece of
shard p to rank p and receives every rank's piece of shard r, then sums them in the ring's order (rank r+1's
piece, plus rank r+2's, ..., plus its own last), so the result is the ring's bit for bit. At N = 2 the ring is
one round already.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from ..stats import StatsRecorder
from ..wire import RowFormat
from .issue import Hop, collective, issue
from .topology import Ring, get_ring

DEFAULT_BUCKET_MB = 25.0
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_DIRECT_KB = 1024.0

_SUM_OPS = {"sum": False, "avg": True}


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                    async_op: bool = False, bucket_mb: float = DEFAULT_BUCKET_MB,
                    timeout_s: float = DEFAULT_TIMEOUT_S, tag: int | None = None,
                    label: object = None, direct_kb: float = DEFAULT_DIRECT_KB,
                    stats: StatsRecorder | None = None, wire: RowFormat | None = None) -> dist.Work | None:
    """All-gather ``input`` from every rank of ``group`` into ``output`` (rank-major), through the ring.

    Same contract as ``dist.all_gather_into_tensor``: ``output`` has ``world_size * input.numel()`` elements,
    both contiguous, same dtype and device. ``input`` may be a view of ``output`` at ``rank * input.numel()``
    (FSDP2 passes it so). With ``async_op=True`` a ``Work`` is returned (CPU: the ring runs on the group's ring
    thread); on CUDA the ring runs on the ring's stream and the current stream waits for it. ``tag`` and
    ``label`` are for the fused layers (an identity tag, and what to name in an error); by default the next tag
    of the group's counter. ``direct_kb``: an ``output`` of at most this many KiB is exchanged with every peer in
    one round instead of going round the ring (0: always the ring). ``stats``: the step statistics its wait is
    recorded in (a sharded model's; ``ring/issue.py``). ``wire``: a narrow format of ``input``'s row ([Note:
    narrow formats]): each rank's row is encoded once, gathered as bytes and decoded into ``output``, its own
    row too, so every rank's ``output`` is bitwise the same.
    """
    ring = get_ring(group, caller="ring_all_gather")
    _check_pair("ring_all_gather", output, input, ring.size * input.numel(), ring)
    tag = ring.next_tag() if tag is None else tag  # on the issuing thread: ops pair up in issue order
    if wire is not None and ring.size > 1 and input.numel():
        return _narrow_all_gather(ring, output, input, wire, tag, bucket_mb, timeout_s, label, direct_kb,
                                  async_op, stats)
    chunk = _chunk_numel(bucket_mb, input.element_size(), "ring_all_gather")
    n = input.numel()
    direct = goes_direct(ring, output, direct_kb, chunked=n > chunk)

    def run() -> None:
        _all_gather_flat(ring, output.view(-1), input.view(-1), tag, chunk, timeout_s, label, direct)

    return collective(ring, "all_gather", tag, label, _hop_sizes(ring, n, chunk, direct), run, output.device,
                      async_op, (output, input), stats, input.element_size())


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                        op: dist.ReduceOp | dist.ReduceOp.RedOpType | str = dist.ReduceOp.SUM, *,
                        async_op: bool = False, bucket_mb: float = DEFAULT_BUCKET_MB,
                        timeout_s: float = DEFAULT_TIMEOUT_S, tag: int | None = None,
                        label: object = None, direct_kb: float = DEFAULT_DIRECT_KB,
                        stats: StatsRecorder | None = None, wire: RowFormat | None = None,
                        residual: torch.Tensor | None = None) -> dist.Work | None:
    """Sum (``op=SUM``) or average (``op=AVG``) ``input`` (``world_size`` rank-major shards) over the ranks of
    ``group`` and leave shard ``rank`` in ``output``: the contract of ``dist.reduce_scatter_tensor``. ``tag``,
    ``label``, ``direct_kb`` (of ``input``) and ``stats``: as for ``ring_all_gather``. ``wire``: a narrow format
    of one shard's row: this rank's piece of each other shard is encoded once and sent straight to its owner in
    N-1 pairwise rounds, and the owner sums the pieces in float32 in the ring's order (``_narrow_reduce_scatter``).
    ``residual``: error feedback with ``wire``, ``(world_size, output.numel())`` (float32 or bfloat16, the
    arithmetic float32 either way: ``RowFormat.encode_fed``): what encoding lost of
    each piece, added to the next call's piece before it is encoded, and updated."""
    ring = get_ring(group, caller="ring_reduce_scatter")
    _check_pair("ring_reduce_scatter", output, input, input.numel() // max(ring.size, 1), ring,
                input_numel=ring.size * output.numel())
    average = _average(op, output.dtype, "ring_reduce_scatter")
    tag = ring.next_tag() if tag is None else tag
    if wire is not None and ring.size > 1 and output.numel():
        def narrow() -> None:
            _narrow_reduce_scatter(ring, output.view(-1), input.view(-1), wire, tag, timeout_s, average, label,
                                   residual)

        return collective(ring, "reduce_scatter", tag, label, [wire.nbytes] * (ring.size - 1), narrow,
                          output.device, async_op, (output, input), stats, encoded=True)
    chunk = _chunk_numel(bucket_mb, input.element_size(), "ring_reduce_scatter")
    n = output.numel()
    direct = goes_direct(ring, input, direct_kb, chunked=n > chunk)

    def run() -> None:
        _reduce_scatter_flat(ring, output.view(-1), input.view(-1), tag, chunk, timeout_s, average, label, direct)

    return collective(ring, "reduce_scatter", tag, label, _hop_sizes(ring, n, chunk, direct), run,
                      output.device, async_op, (output, input), stats, input.element_size())


def ring_all_gather_coalesced(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                              group: dist.ProcessGroup | None = None, *, bucket_mb: float = DEFAULT_BUCKET_MB,
                              timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """All-gather many tensors: ``outputs[i]`` gets every rank's ``inputs[i]``, rank-major. Small tensors are
    packed into flat buckets of ``bucket_mb`` so that they share hops."""
    ring = get_ring(group, caller="ring_all_gather_coalesced")
    _check_lists("ring_all_gather_coalesced", outputs, inputs)
    for out, inp in zip(outputs, inputs):
        _check_pair("ring_all_gather_coalesced", out, inp, ring.size * inp.numel(), ring)
    numels = [t.numel() for t in inputs]
    for lo, hi in _pack(numels, inputs[0].element_size() if inputs else 1, bucket_mb):
        if hi - lo == 1:
            ring_all_gather(outputs[lo], inputs[lo], ring.group, bucket_mb=bucket_mb, timeout_s=timeout_s)
            continue
        flat_in = torch.cat([t.reshape(-1) for t in inputs[lo:hi]])
        flat_out = flat_in.new_empty(ring.size * flat_in.numel())
        ring_all_gather(flat_out, flat_in, ring.group, bucket_mb=bucket_mb, timeout_s=timeout_s)
        pieces = flat_out.view(ring.size, -1).split(numels[lo:hi], dim=1)
        for out, piece in zip(outputs[lo:hi], pieces):
            out.view(ring.size, -1).copy_(piece)


def ring_reduce_scatter_coalesced(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                  group: dist.ProcessGroup | None = None,
                                  op: dist.ReduceOp | dist.ReduceOp.RedOpType | str = dist.ReduceOp.SUM, *,
                                  bucket_mb: float = DEFAULT_BUCKET_MB, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Reduce-scatter many tensors: ``inputs[i]`` holds ``world_size`` rank-major shards of ``outputs[i]``'s
    size. Small tensors are packed into flat buckets of ``bucket_mb`` so that they share hops."""
    ring = get_ring(group, caller="ring_reduce_scatter_coalesced")
    _check_lists("ring_reduce_scatter_coalesced", outputs, inputs)
    for out, inp in zip(outputs, inputs):
        _check_pair("ring_reduce_scatter_coalesced", out, inp, out.numel(), ring, input_numel=ring.size * out.numel())
    numels = [t.numel() for t in outputs]
    for lo, hi in _pack(numels, outputs[0].element_size() if outputs else 1, bucket_mb):
        if hi - lo == 1:
            ring_reduce_scatter(outputs[lo], inputs[lo], ring.group, op, bucket_mb=bucket_mb, timeout_s=timeout_s)
            continue
        flat_in = torch.cat([t.view(ring.size, -1) for t in inputs[lo:hi]], dim=1)
        flat_out = flat_in.new_empty(flat_in.shape[1])
        ring_reduce_scatter(flat_out, flat_in, ring.group, op, bucket_mb=bucket_mb, timeout_s=timeout_s)
        for out, piece in zip(outputs[lo:hi], flat_out.split(numels[lo:hi])):
            out.view(-1).copy_(piece)


# ---- the rings --------------------------------------------------------------------------------------------

def _wavefront(chunks: int, world: int) -> Iterator[tuple[int, range]]:
    """The hops of a collective of ``chunks`` buckets: hop ``tick`` carries chunk c at hop ``tick - c`` of its own
    ring, for every chunk in ``range`` (those in flight)."""
    for tick in range(chunks + world - 2):
        yield tick, range(max(0, tick - world + 2), min(chunks, tick + 1))


def _hop_sizes(ring: Ring, n: int, chunk: int, direct: bool) -> list[int]:
    """The elements each hop of a collective with shards of ``n`` elements sends (none: it has no hop)."""
    if ring.size == 1 or n == 0:
        return []
    if direct:
        return [n * (ring.size - 1)]
    bounds = _chunks(n, chunk)
    return [sum(bounds[c][1] - bounds[c][0] for c in flight) for _, flight in _wavefront(len(bounds), ring.size)]


def _all_gather_flat(ring: Ring, out: torch.Tensor, inp: torch.Tensor, tag: int, chunk: int,
                     timeout_s: float, label: object = None, direct: bool = False) -> None:
    n, world, rank = inp.numel(), ring.size, ring.rank
    own = out[rank * n:(rank + 1) * n]
    if own.data_ptr() != inp.data_ptr() and n:
        own.copy_(inp)
    if world == 1 or n == 0:
        return
    if direct:  # one round: the own shard to every peer, shard p from rank p
        peers = ring.peers
        issue(Hop(ring, [own] * len(peers), [out[p * n:(p + 1) * n] for p in peers], tag, "all_gather", 0, 1,
                  timeout_s, label, peers, peers))
        return
    bounds = _chunks(n, chunk)
    ticks = len(bounds) + world - 2
    for tick, flight in _wavefront(len(bounds), world):
        sends, recvs = [], []
        for c in flight:
            k, (lo, hi) = tick - c, bounds[c]
            held, incoming = ring.shard_held(k), ring.shard_held(k + 1)
            sends.append(out[held * n + lo:held * n + hi])
            recvs.append(out[incoming * n + lo:incoming * n + hi])
        issue(Hop(ring, sends, recvs, tag, "all_gather", tick, ticks, timeout_s, label))


def _reduce_scatter_flat(ring: Ring, out: torch.Tensor, inp: torch.Tensor, tag: int, chunk: int,
                         timeout_s: float, average: bool, label: object = None, direct: bool = False) -> None:
    n, world = out.numel(), ring.size
    if world == 1:
        if out.data_ptr() != inp.data_ptr() and n:
            out.copy_(inp)
        return
    if n == 0:
        return
    if direct:
        _reduce_scatter_direct(ring, out, inp, tag, timeout_s, label)
        if average:
            out.div_(world)
        return
    bounds = _chunks(n, chunk)
    width = min(chunk, n)
    slots = min(len(bounds), world)  # chunks in flight at once; chunk c uses slot c % slots
    partial = [inp.new_empty(width) for _ in range(slots)] if world > 2 else []  # sums being sent on
    received = [inp.new_empty(width) for _ in range(slots)]  # sums arriving from prev

    def complete(c: int) -> None:  # chunk c's last sum arrived (k = N-1 on it, after its last hop; t == rank)
        lo, hi = bounds[c]
        t = ring.shard_reduced(world - 1)
        torch.add(inp[t * n + lo:t * n + hi], received[c % slots][:hi - lo], out=out[lo:hi])

    ticks = len(bounds) + world - 2
    for tick, flight in _wavefront(len(bounds), world):
        if tick >= world - 1:
            complete(tick - world + 1)
        sends, recvs = [], []
        for c in flight:
            k, (lo, hi), slot = tick - c, bounds[c], c % slots
            t = ring.shard_reduced(k)
            mine = inp[t * n + lo:t * n + hi]
            incoming = received[slot][:hi - lo]
            if k == 0:
                outgoing = mine  # nothing to add yet: send straight from the input
            else:
                outgoing = torch.add(mine, incoming, out=partial[slot][:hi - lo])
            sends.append(outgoing)
            recvs.append(incoming)
        issue(Hop(ring, sends, recvs, tag, "reduce_scatter", tick, ticks, timeout_s, label))
    complete(len(bounds) - 1)
    if average:
        out.div_(world)


def _narrow_all_gather(ring: Ring, output: torch.Tensor, input: torch.Tensor, wire: RowFormat, tag: int,
                       bucket_mb: float, timeout_s: float, label: object, direct_kb: float, async_op: bool,
                       stats: StatsRecorder | None) -> dist.Work | None:
    """``ring_all_gather`` of rows in a narrow format: encode this rank's row, gather the bytes round the ring,
    decode every row (this rank's too) into ``output``."""
    n, world = input.numel(), ring.size
    rows = wire.empty(world, input.device)
    chunk = _chunk_numel(bucket_mb, 1, "ring_all_gather")
    direct = goes_direct(ring, rows, direct_kb, chunked=wire.nbytes > chunk)

    def run() -> None:
        wire.encode(input.view(-1), rows[ring.rank])
        _all_gather_flat(ring, rows.view(-1), rows[ring.rank], tag, chunk, timeout_s, label, direct)
        out = output.view(-1)
        for j in range(world):
            wire.decode(rows[j], out[j * n:(j + 1) * n])

    return collective(ring, "all_gather", tag, label, _hop_sizes(ring, wire.nbytes, chunk, direct), run,
                      output.device, async_op, (output, input, rows), stats, encoded=True)


def _narrow_reduce_scatter(ring: Ring, out: torch.Tensor, inp: torch.Tensor, wire: RowFormat, tag: int,
                           timeout_s: float, average: bool, label: object,
                           residual: torch.Tensor | None = None) -> None:
    """Round k = 1 .. N-1: this rank's piece of shard ``(r - k) mod N``, encoded, goes to that rank, and rank
    ``(r + k) mod N``'s piece of shard r comes in; each is decoded and added in float32 while the next round
    travels, this rank's own piece last: the ring's order of summands, each rounded once."""
    n, world, rank = out.numel(), ring.size, ring.rank
    sent = wire.empty(None, inp.device)
    received = wire.empty(2, inp.device)
    total = torch.zeros(n, dtype=torch.float32, device=inp.device)
    for k in range(1, world):
        to, source = (rank - k) % world, (rank + k) % world
        piece = inp[to * n:(to + 1) * n]
        if residual is not None:
            wire.encode_fed(piece, sent, residual[to])
        else:
            wire.encode(piece, sent)
        handle = issue(Hop(ring, [sent], [received[k % 2]], tag, "reduce_scatter", k - 1, world - 1, timeout_s,
                           label, [to], [source]), wait=False)
        if k > 1:
            wire.add_decoded(received[(k - 1) % 2], total)
        handle.wait(observed=False)
    wire.add_decoded(received[(world - 1) % 2], total)
    total.add_(inp[rank * n:(rank + 1) * n])
    if average:
        total.div_(world)
    out.copy_(total)


def goes_direct(ring: Ring, whole: torch.Tensor, direct_kb: float, chunked: bool = False) -> bool:
    """Whether a collective of ``whole`` (the gathered output, or the reduce-scatter's input) is one direct exchange
    with every peer: more than 2 ranks, ``whole`` within ``direct_kb`` KiB, and its shard within one bucket
    (``chunked``: it is not; the ring pipelines its buckets)."""
    if not direct_kb >= 0:
        raise ValueError(f"direct_kb={direct_kb!r} must be >= 0 (KiB; 0: always the ring)")
    return ring.size > 2 and not chunked and whole.numel() * whole.element_size() <= direct_kb * 1024


def _reduce_scatter_direct(ring: Ring, out: torch.Tensor, inp: torch.Tensor, tag: int, timeout_s: float,
                           label: object) -> None:
    """One round: this rank's piece of shard p to rank p; every peer's piece of shard r back, summed in the ring's
    order (rank r+1's first, this rank's own last), so the sum is the ring's bit for bit."""
    n, rank = out.numel(), ring.rank
    peers = ring.peers
    received = inp.new_empty(len(peers), n)
    issue(Hop(ring, [inp[p * n:(p + 1) * n] for p in peers], list(received.unbind(0)), tag, "reduce_scatter", 0, 1,
              timeout_s, label, peers, peers))
    total = received[0]
    for piece in received[1:]:
        total.add_(piece)
    torch.add(total, inp[rank * n:(rank + 1) * n], out=out)


# ---- checks and helpers -----------------------------------------------------------------------------------

def _check_pair(op: str, output: torch.Tensor, input: torch.Tensor, output_numel: int, ring: Ring,
                *, input_numel: int | None = None) -> None:
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                             f"pass {name}.contiguous() (the ring sends and receives flat memory)")
    if output.dtype != input.dtype:
        raise ValueError(f"{op}: output dtype {output.dtype} differs from input dtype {input.dtype}; "
                         f"cast one of them so both match")
    if output.device != input.device:
        raise ValueError(f"{op}: output is on {output.device} but input is on {input.device}; "
                         f"put both on the same device")
    if input_numel is not None and input.numel() != input_numel:
        raise ValueError(f"{op}: input has {input.numel()} elements, expected world_size ({ring.size}) x "
                         f"output ({output.numel()}) = {input_numel}")
    if output.numel() != output_numel:
        raise ValueError(f"{op}: output has {output.numel()} elements, expected world_size ({ring.size}) x "
                         f"input ({input.numel()}) = {output_numel}")
    # ("fake": torch's test group that moves nothing, for measuring host overhead without peers)
    if output.device.type == "cpu" and "gloo" not in ring.backend and ring.backend != "fake" and ring.size > 1:
        raise ValueError(f"{op}: CPU tensors need a gloo process group, but the group's backend is "
                         f"{ring.backend!r}; move the tensors to the GPU or use a gloo group")
    if output.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: tensors on {output.device.type!r} are not supported; use cpu (gloo) or cuda (nccl)")


def _check_lists(op: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    if len(outputs) != len(inputs):
        raise ValueError(f"{op}: {len(outputs)} outputs for {len(inputs)} inputs; pass one output per input")
    dtypes = {t.dtype for t in inputs}
    if len(dtypes) > 1:
        raise ValueError(f"{op}: inputs mix dtypes {sorted(map(str, dtypes))}; one call packs one dtype, "
                         f"so group the tensors by dtype")


def _average(op: object, dtype: torch.dtype, name: str) -> bool:
    key = op.lower() if isinstance(op, str) else ("sum" if op == dist.ReduceOp.SUM else
                                                  "avg" if op == dist.ReduceOp.AVG else repr(op))
    if key not in _SUM_OPS:
        raise ValueError(f"{name}: op {op!r} is not supported; use ReduceOp.SUM or ReduceOp.AVG (for a scaled "
                         f"sum, scale the input first, or call FSDPModule.set_force_sum_reduction_for_comms(True))")
    if _SUM_OPS[key] and not dtype.is_floating_point:
        raise ValueError(f"{name}: ReduceOp.AVG needs a floating-point tensor, got {dtype}; use SUM")
    return _SUM_OPS[key]


def _chunk_numel(bucket_mb: float, element_size: int, op: str) -> int:
    if not bucket_mb > 0:
        raise ValueError(f"{op}: bucket_mb={bucket_mb!r} must be > 0")
    return max(1, int(bucket_mb * (1 << 20)) // element_size)


def _chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]


def _pack(numels: Sequence[int], element_size: int, bucket_mb: float) -> list[tuple[int, int]]:
    """Consecutive index ranges whose total size stays within one bucket (a larger tensor stands alone)."""
    limit = max(1, math.floor(bucket_mb * (1 << 20) / element_size))
    ranges, lo, total = [], 0, 0
    for i, numel in enumerate(numels):
        if i > lo and total + numel > limit:
            ranges.append((lo, i))
            lo, total = i, 0
        total += numel
    if lo < len(numels):
        ranges.append((lo, len(numels)))
    return ranges
