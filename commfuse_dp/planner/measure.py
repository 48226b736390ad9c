"""What ``CommFuseConfig()``'s ``"auto"`` settings measure where nothing told them (``choose.py``): the rings'
bandwidth and fixed cost per hop on the shard group, and the device's GEMM rate on the model's own layer
shapes.

``measure_machine`` runs inside ``shard()`` on every rank of the world (it runs hops on the shard group and
agrees the figures over the world, so every rank calls it at the same point). Each figure is the median rank's over
the world (a gather of the times), so that every rank plans with the same numbers and makes the same choice. Results
are cached per process group and device (the link) and per device, dtype and shapes (the GEMMs); a second
``shard()`` on the same group measures nothing new.

- The link: ring all-gathers (``ring_all_gather``, N-1 hops each) of 4 KiB a hop, then of 4 times more
  until a hop takes at least 4 times the small one's (its bytes outweigh its fixed cost) and more than a host's
  timing noise (5 ms on a CPU), or 50 ms; the line ``seconds per hop = latency + bytes / bandwidth`` through the
  smallest and the last. Each size is timed as a few ring all-gathers back to back (5 of the small, 3 of the
  others), twice, started together on every rank, the faster run kept. About 0.1-0.5 s on this project's 2-core
  machines, more on a slow link with many ranks.
- The GEMMs: per linear of a decoder layer (q/k/v, o, gate/up, down), its forward product and the backward's two
  (input and weight gradients) on the compute dtype, with a rank's tokens as rows (fewer on a CPU, so that the
  three stay about 1 GFLOP), after one untimed round.
  The device's work is waited for (``torch.cuda.synchronize``; an emulated accelerator's clock,
  ``ring.topology.device_ready``). About 0.05 s on a CPU core.
- Across nodes (``measure_tiers``, a multi-node launch under ``replicate="auto"``): the link the same way on each
  node's group, every node at once; on each replicate group (one local rank across the nodes), every group at once
  and timed until the last is done, which is what a rank gets of its node's NICs while HSDP's exchange runs; and on
  the first local rank's replicate group alone, one flow across, a flat ring's hop between nodes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ring.collectives import ring_all_gather
from ..ring.topology import device_ready, get_ring, wait_until

SMALL_HOP_BYTES = 4 << 10
GROWTH = 4
BANDWIDTH_BOUND = 4.0  # a hop this many times the small one's is mostly bytes
HOP_CAP_S = 0.05
NOISE_S = {"cpu": 5e-3, "cuda": 2e-4}  # a hop shorter than this is within a host's timing noise: grow it
MAX_HOP_BYTES = {"cpu": 16 << 20, "cuda": 64 << 20}
CPU_GEMM_FLOPS = 1e9  # rows are cut so that one linear's three products stay near this on a CPU
GPU_MAX_ROWS = 8192


@dataclass(frozen=True)
class LinkFit:
    bytes_per_s: float
    latency_s: float  # fixed cost of one hop
    hop_bytes: tuple[int, int]  # the two sizes the line goes through

    @property
    def sizes(self) -> str:
        return f"{_size(self.hop_bytes[0])} and {_size(self.hop_bytes[1])}"


@dataclass(frozen=True)
class Gemm:
    flops_per_s: float
    rows: int  # rows of each product timed


@dataclass(frozen=True)
class Measured:
    """What ``measure_machine`` found; ``None`` where it was not asked to measure (a given hint)."""

    link: LinkFit | None = None
    gemm: Gemm | None = None
    # seconds per element and pass of each narrow format asked for (the mean of encoding and decoding,
    # ``wire.measure_codec``); None where none was asked for
    codec: dict[str, float] | None = None


_LINKS: dict[tuple, LinkFit | None] = {}
_GEMMS: dict[tuple, Gemm] = {}
_CODECS: dict[tuple, dict[str, float]] = {}


def measure_machine(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                    shapes: list[tuple[int, int]] | None, tokens: int, link: bool, gemm: bool,
                    formats: tuple[str, ...] = ()) -> Measured:
    """The link (``link``), the GEMM rate on ``shapes`` ((in, out) of a layer's linears, ``gemm``) and the codec of
    each narrow format in ``formats``, measured on ``group`` and ``device`` or taken from the cache. Collective over
    the world: every rank calls it alike."""
    ring = get_ring(group, caller="shard")
    device = torch.device(device)
    key = (tuple(dist.get_process_group_ranks(group)), ring.backend, str(device))
    gemm_key = (str(device), dtype, tuple(shapes or ()), tokens)
    formats = tuple(sorted({f for f in formats if f != "exact"}))
    codec_key = (str(device), dtype, formats)
    wanted = [link and key not in _LINKS, gemm and shapes is not None and gemm_key not in _GEMMS,
              bool(formats) and codec_key not in _CODECS]
    wanted = [bool(w) for w in _any(device, [float(w) for w in wanted])]  # measure where any rank must
    if wanted[0]:
        _LINKS[key] = _measure_link(group, device, ring.size)
    if wanted[1]:
        _GEMMS[gemm_key] = _measure_gemm(device, dtype, shapes, tokens)
    if wanted[2]:
        _CODECS[codec_key] = _measure_codec(device, dtype, formats)
    return Measured(_LINKS.get(key) if link else None, _GEMMS.get(gemm_key) if gemm and shapes else None,
                    _CODECS.get(codec_key) if formats else None)


@dataclass(frozen=True)
class Tiers:
    """The two tiers of a multi-node launch (``measure_tiers``): the ring inside a node, a rank's link to other
    nodes while every rank of its node crosses at once (HSDP's exchange), and one flow alone across (a flat ring's
    hop between nodes). None where a tier's larger hops took no longer than its small ones (no line to fit)."""

    intra: LinkFit | None
    share: LinkFit | None
    flow: LinkFit | None


_TIERS: dict[tuple, Tiers] = {}


def measure_tiers(node_group: dist.ProcessGroup, replicate_group: dist.ProcessGroup, device: torch.device
                  ) -> Tiers:
    """Both tiers, measured as ``measure_machine`` measures a link (module docstring): ring all-gathers on each
    node's group, every node at once; on each replicate group (the ranks of one local rank across the nodes),
    every group at once, so that the ranks of a node share its NICs as HSDP's exchange does; and on the first
    local rank's replicate group alone. The median rank's figures (of the ranks that ran each). Collective over the
    world; cached per groups and device. The shared tier is timed until the last group is done (``together``)."""
    device = torch.device(device)
    key = (tuple(dist.get_process_group_ranks(node_group)), tuple(dist.get_process_group_ranks(replicate_group)),
           str(device))
    if key not in _TIERS:
        per_node, nodes = dist.get_world_size(node_group), dist.get_world_size(replicate_group)
        first = dist.get_rank(node_group) == 0
        _TIERS[key] = Tiers(_measure_link(node_group, device, per_node) if per_node > 1 else None,
                            _measure_link(replicate_group, device, nodes, together=True),
                            _measure_link(replicate_group, device, nodes, active=first))
    return _TIERS[key]


def layer_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """(in, out) of a decoder layer's linears as the planner groups them: q/k/v, o, gate/up, down."""
    kv = hidden * kv_heads // heads
    return [(hidden, hidden + 2 * kv), (hidden, hidden), (hidden, 2 * intermediate), (intermediate, hidden)]


def _measure_link(group: dist.ProcessGroup, device: torch.device, world: int, active: bool = True,
                  together: bool = False) -> LinkFit | None:
    """``group``'s line of seconds per hop against bytes (module docstring); ``active``: whether this rank's group
    runs (the others take part only in agreeing on the figures, the median of the ranks that ran); ``together``:
    every group's hops are timed until the last group's end (a barrier of the world), so that groups that share
    a link (a node's NICs) are measured at the rate they get while all of them send, not while some are done."""
    def hop_seconds(nbytes: int, calls: int) -> float:
        """Seconds per hop: the faster of two runs of ``calls`` ring all-gathers back to back, each run
        started together on every rank (a barrier), so that neither a late neighbour nor a link's burst credit
        after an idle spell (``tc tbf``) weighs much in it; the median rank's."""
        numel = max(nbytes // 4, 1)
        shard = torch.zeros(numel, dtype=torch.float32, device=device)
        whole = torch.empty(world * numel, dtype=torch.float32, device=device)
        bucket_mb = 2 * nbytes / 2**20 + 1  # one bucket: the hops are not cut into chunks

        def run() -> float:
            _sync(device)
            dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)  # every group at once
            if not active:
                if together:
                    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
                return math.nan
            began = time.perf_counter()
            for _ in range(calls):
                ring_all_gather(whole, shard, group, direct_kb=0, bucket_mb=bucket_mb)
            _sync(device)
            if together:
                dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
            return (time.perf_counter() - began) / (calls * (world - 1))

        if active:
            ring_all_gather(whole, shard, group, direct_kb=0, bucket_mb=bucket_mb)  # untimed: buffers, connections
        return _agreed(device, [min(run(), run())])[0]

    kind = device.type if device.type in MAX_HOP_BYTES else "cpu"
    small = hop_seconds(SMALL_HOP_BYTES, 5)
    nbytes, seconds = SMALL_HOP_BYTES, small
    while ((seconds < BANDWIDTH_BOUND * small or seconds < NOISE_S[kind]) and seconds < HOP_CAP_S
           and nbytes * GROWTH <= MAX_HOP_BYTES[kind]):
        nbytes *= GROWTH
        seconds = hop_seconds(nbytes, 3)
    per_byte = (seconds - small) / (nbytes - SMALL_HOP_BYTES) if nbytes > SMALL_HOP_BYTES else 0.0
    if per_byte <= 0:  # the larger hops took no longer: no line to fit (the plan falls back to its assumptions)
        return None
    return LinkFit(1.0 / per_byte, max(small - SMALL_HOP_BYTES * per_byte, 0.0), (SMALL_HOP_BYTES, nbytes))


def _measure_gemm(device: torch.device, dtype: torch.dtype,
                  shapes: list[tuple[int, int]], tokens: int) -> Gemm:
    if device.type == "cuda":
        rows = min(tokens, GPU_MAX_ROWS)
    else:
        rows = max(64, min(tokens, int(CPU_GEMM_FLOPS / (6 * max(i * o for i, o in shapes)))))
    weights = [torch.randn(o, i, device=device, dtype=dtype) for i, o in shapes]
    x = {n: torch.randn(rows, n, device=device, dtype=dtype) for n in {n for shape in shapes for n in shape}}

    def run() -> float:
        _sync(device)
        began = time.perf_counter()
        for w in weights:
            out, inp = w.shape
            torch.mm(x[inp], w.t())  # y = x W^T
            torch.mm(x[out], w)  # dx = dy W
            torch.mm(x[out].t(), x[inp])  # dW = dy^T x
        _sync(device)
        return time.perf_counter() - began

    with torch.no_grad():
        run()  # untimed: thread pools, kernels chosen, pages touched
        seconds = min(run(), run())
    flops = sum(6.0 * rows * i * o for i, o in shapes)
    return Gemm(flops / _agreed(device, [seconds])[0], rows)


def _measure_codec(device: torch.device, dtype: torch.dtype, formats: tuple[str, ...]) -> dict[str, float]:
    """Seconds per element and pass of each format (the mean of encoding and decoding a 256 Ki-element row), the
    median rank's."""
    from ..wire import measure_codec

    mine = [sum(measure_codec(f, device, dtype, numel=1 << 18)) / 2 for f in formats]
    return dict(zip(formats, _agreed(device, mine)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wait_until(device_ready())  # an emulated accelerator's work issued so far (ring/topology.py)


def _any(device: torch.device, values: list[float]) -> list[float]:
    """The largest of each value over the ranks of the world (the same list on every rank)."""
    t = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _agreed(device: torch.device, values: list[float]) -> list[float]:
    """The median over the ranks of the world of each value (the same list on every rank, also where the world
    holds several shard groups, HSDP's copies): one rank that a shared core held up does not set the figure."""
    t = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    # (the lower middle of an even count; NaN: a rank that did not measure, left out)
    return torch.stack(everyone).nanmedian(dim=0).values.tolist()


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
