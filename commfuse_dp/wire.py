"""Narrow formats on the wire: a fused layer's weight shard or gradient contribution encoded once into a flat byte
row, sent as bytes, and decoded where it is used.

[Note: narrow formats]
A row in the ring layout (``runtime/layout.py``: each member's weight rows, then its bias) is cut into segments.
Weight segments (2-D) go in the chosen format; biases (1-D) go as they are, in the row's own dtype. A row's
bytes, segment after segment, each aligned to 16 bytes:
- ``exact``: the values in the row's dtype (nothing narrower);
- ``bf16``: the values rounded to bfloat16;
- ``fp8``: float8 e4m3 values, then one float32 scale per block of ``block`` elements (the block's largest
  magnitude over 448, e4m3's largest finite value);
- ``int8``: symmetric int8 values, then one float32 scale per block (the block's largest magnitude over 127).
Encoding and decoding are torch ops that run on any device. A row's bytes are forwarded unchanged round the ring,
so every rank decodes the same bytes with the same ops: the weight every rank computes with is bitwise the same,
the owner's included (it computes with its own decoded row, not its master). Decoding computes in float32 and
rounds once to the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

GATHER_FORMATS = ("exact", "bf16", "fp8", "int8")
REDUCE_FORMATS = ("exact", "bf16", "int8")
DEFAULT_BLOCK = 2048
MAX_BLOCK = 4096
_ALIGN = 16
_E4M3_MAX = 448.0
_INT8_MAX = 127.0
_TINY = 1e-30  # a block of zeros gets this scale: its values decode to zero


def bytes_per_element(fmt: str, itemsize: int, block: int = DEFAULT_BLOCK) -> float:
    """Bytes an element of ``itemsize`` bytes costs on the wire in ``fmt`` (a scale per block counted in)."""
    if fmt == "exact":
        return float(itemsize)
    if fmt == "bf16":
        return 2.0
    return 1.0 + 4.0 / block


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Segment:
    """One run of a row: ``numel`` elements from ``start``; ``narrow``: in the format (else as they are)."""

    __slots__ = ("start", "numel", "narrow", "offset", "scales", "blocks", "nbytes")

    def __init__(self, start: int, numel: int, narrow: bool) -> None:
        self.start, self.numel, self.narrow = start, numel, narrow
        self.offset = self.scales = self.blocks = self.nbytes = 0


class RowFormat:
    """How one row of ``numel`` elements of ``dtype`` travels: ``segments`` ``(start, numel, narrow)`` in order,
    covering the row. ``nbytes``: the bytes of its wire row. ``encode`` writes a row's bytes, ``decode`` reads
    them back into ``dtype`` (or another float dtype)."""

    def __init__(self, fmt: str, dtype: torch.dtype, numel: int, segments: Sequence[tuple[int, int, bool]],
                 block: int = DEFAULT_BLOCK) -> None:
        if fmt not in GATHER_FORMATS:
            raise ValueError(f"unknown wire format {fmt!r}: allowed {GATHER_FORMATS}")
        self.fmt, self.dtype, self.numel, self.block = fmt, dtype, numel, block
        self.segments: list[Segment] = []
        offset, covered = 0, 0
        self.itemsize = itemsize = dtype.itemsize
        for start, n, narrow in segments:
            if start != covered:
                raise ValueError(f"wire segments must cover the row in order: {start} after {covered}")
            covered += n
            seg = Segment(start, n, narrow and fmt != "exact" and n > 0)
            seg.offset = offset
            if seg.narrow:
                width = 2 if fmt == "bf16" else 1
                seg.blocks = 0 if fmt == "bf16" else math.ceil(n / block)
                seg.scales = offset + _aligned(n * width)
                seg.nbytes = _aligned(n * width) + _aligned(4 * seg.blocks)
            else:
                seg.nbytes = _aligned(n * itemsize)
            offset += seg.nbytes
            self.segments.append(seg)
        if covered != numel:
            raise ValueError(f"wire segments cover {covered} of the row's {numel} elements")
        self.nbytes = max(offset, _ALIGN)

    @property
    def lossy(self) -> bool:
        return any(seg.narrow for seg in self.segments) and not (self.fmt == "bf16" and self.dtype == torch.bfloat16)

    def empty(self, rows: int | None, device: torch.device) -> torch.Tensor:
        shape = (self.nbytes,) if rows is None else (rows, self.nbytes)
        return torch.empty(shape, dtype=torch.uint8, device=device)

    # -- encode ---------------------------------------------------------------------------------------------

    def encode(self, row: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``row`` (``numel`` elements, any float dtype) into ``out`` (``nbytes`` uint8)."""
        for seg in self.segments:
            x = row[seg.start:seg.start + seg.numel]
            if not seg.narrow:
                out[seg.offset:seg.offset + seg.numel * self.itemsize].view(self.dtype).copy_(x)
            elif self.fmt == "bf16":
                out[seg.offset:seg.offset + 2 * seg.numel].view(torch.bfloat16).copy_(x)
            else:
                self._encode_blocks(x, seg, out)

    def _encode_blocks(self, x: torch.Tensor, seg: Segment, out: torch.Tensor) -> None:
        n, block = seg.numel, self.block
        full = n // block * block
        payload = out[seg.offset:seg.offset + n]
        scales = out[seg.scales:seg.scales + 4 * seg.blocks].view(torch.float32)
        if full:
            self._quantize(x[:full].view(-1, block), payload[:full].view(-1, block), scales[:full // block])
        if full < n:
            self._quantize(x[full:].view(1, -1), payload[full:].view(1, -1), scales[full // block:])

    def _quantize(self, x: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor) -> None:
        x = x.float()
        top = _E4M3_MAX if self.fmt == "fp8" else _INT8_MAX
        scale = x.abs().amax(dim=1).div_(top).clamp_min_(_TINY)
        scales.copy_(scale)
        q = x / scale[:, None]
        if self.fmt == "fp8":
            payload.view(torch.float8_e4m3fn).copy_(q.clamp_(-_E4M3_MAX, _E4M3_MAX))
        else:
            payload.view(torch.int8).copy_(q.round_().clamp_(-_INT8_MAX, _INT8_MAX))

    # -- decode ---------------------------------------------------------------------------------------------

    def decode(self, wire: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Read the row in ``wire`` into ``out`` (``numel`` elements of a float dtype); returns ``out``."""
        for seg in self.segments:
            y = out[seg.start:seg.start + seg.numel]
            if not seg.narrow:
                y.copy_(wire[seg.offset:seg.offset + seg.numel * self.itemsize].view(self.dtype))
            elif self.fmt == "bf16":
                y.copy_(wire[seg.offset:seg.offset + 2 * seg.numel].view(torch.bfloat16))
            else:
                self._decode_blocks(wire, seg, y)
        return out

    def encode_fed(self, row: torch.Tensor, out: torch.Tensor, residual: torch.Tensor) -> None:
        """Error feedback: encode ``row`` plus what encoding lost before (``residual``), and keep what it loses now
        in ``residual``. The sum and the loss are computed in float32 whatever the dtypes of ``row`` and
        ``residual`` (``CommFuseConfig.feedback_dtype``: float32 or bfloat16); only the new residual is rounded,
        once, into ``residual``'s dtype."""
        if torch.float32 in (row.dtype, residual.dtype):
            fed = torch.add(row, residual)  # (promoted to float32: the other operand is upcast)
        else:
            fed = row.float().add_(residual)
        self.encode(fed, out)
        residual.copy_(fed.sub_(self.decode(out, torch.empty_like(fed))))

    def add_decoded(self, wire: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out += decode(wire)`` (``out`` float32: a sum of contributions, each rounded once)."""
        tmp = torch.empty_like(out)
        return out.add_(self.decode(wire, tmp))

    def _decode_blocks(self, wire: torch.Tensor, seg: Segment, y: torch.Tensor) -> None:
        n, block = seg.numel, self.block
        full = n // block * block
        payload = wire[seg.offset:seg.offset + n]
        scales = wire[seg.scales:seg.scales + 4 * seg.blocks].view(torch.float32)
        kind = torch.float8_e4m3fn if self.fmt == "fp8" else torch.int8
        if full:
            _scaled(payload[:full].view(kind).view(-1, block), scales[:full // block, None], y[:full].view(-1, block))
        if full < n:
            _scaled(payload[full:].view(kind), scales[full // block], y[full:])


def _scaled(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """``out = values * scales``, computed in float32 (into ``out`` at once where it is float32 and the values are
    int8: one pass)."""
    if out.dtype == torch.float32 and values.dtype == torch.int8:
        torch.mul(values, scales, out=out)
    else:
        out.copy_(values.to(torch.float32).mul_(scales))


def row_bytes(fmt: str, dtype: torch.dtype, segments: Sequence[tuple[int, int, bool]], gather: bool,
              block: int = DEFAULT_BLOCK) -> int:
    """Bytes one row of ``segments`` (``(start, numel, narrow)``) of ``dtype`` puts on the wire in ``fmt``: its
    values as they are where nothing narrows them (the exact format; a bf16 gather of bf16), else ``RowFormat``'s
    (scales and alignment included)."""
    numel = sum(n for _, n, _ in segments)
    if fmt == "exact" or (gather and fmt == "bf16" and dtype == torch.bfloat16):
        return numel * dtype.itemsize
    return RowFormat(fmt, dtype, numel, segments, block).nbytes


def layout_segments(layout, narrow_bias: bool = False) -> list[tuple[int, int, bool]]:
    """The segments of one row of a fused group's ring layout: each member's weight rows narrow, its bias (1-D)
    as it is."""
    segments, at = [], 0
    for m in layout.members:
        if m.offset != at:
            segments.append((at, m.offset - at, False))
            at = m.offset
        segments.append((m.offset, m.weight_numel, True))
        at = m.offset + m.weight_numel
        if m.numel > m.weight_numel:
            segments.append((at, m.numel - m.weight_numel, narrow_bias))
            at = m.offset + m.numel
    if at < layout.numel:
        segments.append((at, layout.numel - at, False))
    return segments


def measure_codec(fmt: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  numel: int = 1 << 20, repeats: int = 5) -> tuple[float, float]:
    """Seconds per element to encode a row into ``fmt`` and to decode it back into ``dtype`` on ``device``: the
    median of ``repeats`` timings of a ``numel``-element row, after one untimed pass (``commfuse-dp plan``)."""
    import statistics
    import time

    if fmt == "exact":
        return 0.0, 0.0
    device = torch.device(device)
    row = RowFormat(fmt, dtype, numel, [(0, numel, True)])
    x = torch.randn(numel, device=device).to(dtype)
    wire, back = row.empty(None, device), torch.empty(numel, dtype=dtype, device=device)

    def timed(run) -> float:
        run()
        seconds = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - began)
        return statistics.median(seconds) / numel

    return timed(lambda: row.encode(x, wire)), timed(lambda: row.decode(wire, back))
