"""``CommFuseConfig``: every knob of commfuse_dp in one validated dataclass (its fields, each with its docstring,
checked in ``__post_init__``), and accelerate's parallelism sizes applied to one (``with_parallelism``)."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..wire import GATHER_FORMATS, MAX_BLOCK, REDUCE_FORMATS
from .values import (_BOOL_FIELDS, _DTYPE_NAMES, ENV_PREFIX, ENV_RESERVED, FSDP2_COLLECTIVES, GRAD_DIVIDES,
                     MIN_FUSE_NUMEL, NONFINITE_MODES, SCHEDULES, _auto_or_count, _dtype, _env_text, _feedback_dtype,
                     _number, _parse_env, _patterns, forward_bundles_auto)


@dataclass(kw_only=True, slots=True)
class CommFuseConfig:
    """Configuration of the sharded model and its ring collectives."""

    schedule: str = "auto"
    """``"auto"`` (default): ``"fused"`` where the planner predicts it faster than the peer (``"fsdp2"``) by 2 %
    for this model, its ranks, the device and the link, else ``"fsdp2"`` (``commfuse_dp/planner/choose.py``;
    ``commfuse_dp.describe(model)`` says what was chosen and why).
    ``"fused"``: CommFuse, each hop (one exchange with the ring's neighbours) runs during a shard-sized piece of
    the layer's own compute.
    ``"slicing"``: data-slicing overlap on the same rings (prefetch the next unit's all-gather, reduce-scatter a
    unit during the next unit's backward); kept so that every benchmark compares the two on one transport.
    ``"fsdp2"``: nothing fused; stock FSDP2 units (each decoder layer and the root) run FSDP2's GPU schedule on the
    rings, on any device: the next unit's all-gather one unit ahead and asynchronous, the reduce-scatters behind the
    backward's compute (``use_ring_collectives(overlap=True)``). What fusing is measured against."""

    bucket_mb: float = 25.0
    """Size of one ring bucket in MiB. Many small tensors are packed into flat buckets of this size; a larger
    tensor is cut into chunks of this size that pipeline through the ring."""

    direct_kb: float = 1024.0
    """A bucketed collective (FSDP2 units, the bucketed rings) whose whole tensor is at most this many KiB, on more
    than 2 ranks, exchanges with every peer in one round instead of going round the ring in N-1 hops: the same
    bytes, one latency instead of N-1 (the root unit's norms, gathered at a step's head and reduced at its tail,
    are such a bucket). Results are the ring's bit for bit. ``0``: always the ring."""

    min_fuse_numel: int = MIN_FUSE_NUMEL
    """A linear whose weight shard has fewer elements than this is not fused (a hop costs a fixed latency
    that a tiny GEMM piece cannot hide); it goes through the bucketed rings instead. Linears that read the same
    input (q/k/v, gate/up) share their hops, so they are judged together, by the sum of their shards: GQA's
    small ``k_proj``/``v_proj`` are fused with ``q_proj``. Under the elastic schedule (``lookahead_mb`` not 0) the
    fused groups of one FSDP2 unit share hops, so a small group is fused where its unit has a large one."""

    param_dtype: torch.dtype | None = None
    """Dtype of the forward/backward compute and of the weight shards sent around the ring (e.g. ``bfloat16``).
    ``None``: the parameters' own dtype. The sharded master parameters keep their own dtype."""

    reduce_dtype: torch.dtype | None = None
    """Dtype in which gradients are reduce-scattered and summed. ``None``: ``param_dtype`` if set, else the
    gradients' own dtype. ``float32`` with a bf16 ``param_dtype`` gives fp32 reduction."""

    gather_format: str = "exact"
    """What the fused layers' weight all-gathers put on the wire (``commfuse_dp/wire.py``): ``"exact"`` (default:
    the compute dtype, nothing lost), ``"bf16"``, ``"fp8"`` (e4m3, a scale per block of ``format_block``
    elements) or ``"int8"`` (symmetric, a scale per block). The owner of a shard encodes it once from its master
    (fp32 masters stay as they are, and so does the optimizer state); the ring forwards the bytes unchanged, and
    every rank decodes them into the compute dtype just before the piece that uses them, so every rank, the owner
    included, computes with bitwise the same weight. Biases and other 1-D parameters travel in their own dtype.
    Lossy formats apply to the ``"fused"`` schedule's linears; with one set, ``schedule="auto"`` runs ``"fused"``."""

    reduce_format: str = "exact"
    """What the fused layers' gradient reduce-scatters put on the wire: ``"exact"`` (default: the ring
    reduce-scatter in ``reduce_dtype``), ``"bf16"`` or ``"int8"`` (a scale per block of ``format_block``). A narrow
    format does not reduce round the ring (re-rounding a partial sum at every hop adds an error that grows with
    the ranks): each rank's contribution to a shard is encoded once and sent straight to the shard's owner in N-1
    pairwise rounds (the ring's bytes, the ring's hops beside the backward's pieces), and the owner sums them in
    float32. Biases travel in their own dtype."""

    error_feedback: bool = False
    """With a lossy ``reduce_format``: keep what encoding lost of each contribution and add it to the next step's
    (error feedback, as in 1-bit Adam and LoCo). Costs one copy of the rank's unsharded fused weight gradients, in
    ``feedback_dtype`` (``describe(model)`` reports its bytes)."""

    feedback_dtype: str = "bfloat16"
    """Dtype in which ``error_feedback`` keeps its residuals: ``"bfloat16"`` (default: half the memory of float32,
    and training follows the exact run as closely: docs/usage.md) or ``"float32"`` (also written
    ``bf16``, ``fp32``). Only the storage narrows: adding the residual to a contribution and computing what
    encoding lost run in float32, and the new residual is rounded once into this dtype. A checkpoint saves the
    residuals in their dtype; a resume with the other one converts them."""

    format_block: int = 2048
    """Elements per scale of the ``fp8`` and ``int8`` formats (1 .. 4096)."""

    grad_divide: str = "post"
    """Where the mean over ranks divides the gradient: ``"post"`` after the sum, ``"pre"`` before it,
    ``"split"`` by sqrt(N) on each side (safest against fp16 overflow/underflow)."""

    prefetch_next: bool = True
    """Start the next layer's first hop during this layer's last compute piece (docs/design.md §7, "Across
    layers"), in forward and backward, using the layer order of the previous step. Off: each layer's ring starts
    with the layer, leaving a small bubble at every layer boundary."""

    prefetch_depth: int = 2
    """With ``prefetch_next``: how many following layers have their first hop in flight at once. Each one
    holds one more packed weight shard of that layer; a deeper queue lets the link run ahead of compute where
    a layer's compute is short, so its bytes land by the time a longer layer needs them."""

    lookahead_mb: float | str = "auto"
    """Memory the fused schedule may spend to run the link ahead of compute (docs/design.md §7, "Elastic
    lookahead"): the all-gather hops of coming layers go as soon as the link is free, into buffers that
    hold those layers' gathered weights, up to this many MiB with the running layer's, and gradient partials
    wait in their own buffers until the link sends them (they land during later compute). ``"auto"`` (default):
    two of the largest unit's (decoder layer's) gathered fused weights, what slicing by FSDP2 unit holds (the
    unit computed and the next one). ``0``: lockstep, each layer's hops
    beside its own compute pieces, with only the first hop of the next ``prefetch_depth`` layers in flight
    (two weight shards per layer live, the least memory). Needs ``prefetch_next``; the slicing schedule ignores
    it."""

    forward_bundles: bool | str = "auto"
    """Whether the elastic schedule's forward sends a decoder layer's weight rings together (hop k of all of them
    as one request: one ring's latency per layer; the backward always does). Together, the layer's first linear
    waits for the bytes of all of them, so compute runs behind the link by the rest of one layer's forward, which
    it makes up only where compute is the slower: one ring's latency per linear against a layer's compute once per
    step. ``"auto"`` (default): together where ``(ranks - 1) x units²`` exceeds 512 (units: decoder layers and the
    root; many hops per step: any model of 32 layers; apart for a few layers on a few ranks, as the bench's);
    ``True``/``False`` force it. ``commfuse-dp plan`` plays both (``plays.fused``)."""

    piece_shards: int | str = "auto"
    """Weight shards per compute piece of a fused layer: its outputs in the forward and its input gradient in the
    backward are computed ``piece_shards`` landed shards at a time, as one wider GEMM (the weight gradient stays one
    piece per shard: it feeds the gradient ring). ``"auto"`` (default): the width with the shortest predicted fused
    step (``choose.py``; 1 on CPU, where pieces cost what whole GEMMs do). ``1``: a piece per hop. On a GPU a GEMM
    cut into N thin pieces loses 7-41 % at 8 ranks on Llama-3-8B shapes, mostly in the input gradient, and about
    2-13 % in pieces of 4 shards (docs/performance.md, "On one GPU"); the forward's first piece then waits for that
    many shards. Takes effect where the gathered weight stays whole (the elastic lookahead, the kept lm_head, the
    slicing schedule, whose runs go in shard order); lockstep (``lookahead_mb=0``) reuses two buffers and computes per
    shard. The sums run in another order than with 1: results agree within rounding, and repeat from run to run."""

    ring_embeddings: bool = True
    """An ``nn.Embedding`` whose table shard has at least ``min_fuse_numel`` elements (and is not tied to another
    module) is sharded by rows and exchanges looked-up rows and their gradients instead of the table where that
    moves fewer bytes, about while a rank's tokens are fewer than the table's rows (``fused/embedding.py``), for
    either schedule. Off: the table goes through FSDP2 and the bucketed rings like the other unfused parameters."""

    replicate: int | str = "auto"
    """HSDP (docs/design.md, "Past one node"): the data-parallel ranks form ``replicate`` groups of equal size, each
    holding one copy of the model sharded over its members (consecutive ranks: a node), and gradient shards are
    averaged across the copies as soon as they land, beside the rest of the backward (accumulation micro-batches
    skip it, as DeepSpeed's MiCS does). Parameters are DTensors ``(Replicate(), Shard(d))`` on a 2-D mesh
    ``("replicate", "shard")``. ``"auto"`` (default): 1 (one group, no HSDP) on one node; on a launch over several
    nodes (the launcher's ``LOCAL_WORLD_SIZE``, ``commfuse_dp/node_layout.py``), a copy per node or one flat ring
    over every rank, whichever the planner predicts faster on the two tiers measured at ``shard()``
    (``commfuse_dp/planner/choose_nodes.py``; HSDP unless the flat ring wins by 2 %). An integer: that many copies. Passing
    ``shard(model, config, mesh=<2-D DeviceMesh>)`` sets the groups instead."""

    hpz_size: int | str = "auto"
    """ZeRO++'s hpZ (DeepSpeed's ``zero_hpz_partition_size``, FSDP2's ``reshard_after_forward=<int>``): with one
    flat shard over every rank, each FSDP2 unit keeps after its forward a second copy of its weights split over
    groups of ``hpz_size`` consecutive ranks (a node), so that the backward gathers inside the node and only the
    forward's gathers and the reduce-scatters cross the nodes. Costs a rank ``unit / hpz_size`` of each unit's
    weights from its forward to its backward (``describe(model)`` gives the bytes). Runs under the ``"fsdp2"``
    schedule (``"auto"`` becomes it) without HSDP (``replicate`` 1) or TP. ``"auto"`` (default): 1 (none) on one
    node; on a multi-node launch where ``replicate`` and ``schedule`` are ``"auto"``, the node's ranks when the
    planner predicts it faster than FSDP2's HSDP by 2 %. 1: none."""

    tp_size: int = 1
    """Tensor parallelism (accelerate's ``ParallelismConfig.tp_size``): groups of ``tp_size`` consecutive ranks
    (inside a node) share each layer, sequence-parallel, their activation rings beside the GEMM's pieces
    (``commfuse_dp.tensor_parallel``, ``docs/tensor_parallel.md``), and ``shard()`` shards each TP rank's part
    over the ranks of the same TP position (the mesh ``("dp_shard", "tp")``; with ``replicate`` R > 1, HSDP beside
    TP: ``("dp_replicate", "dp_shard", "tp")``, and ``"auto"`` is 1). 1 (default): none. The model must be one
    ``tensor_parallel`` supports, with its weights loaded (not on the meta device)."""

    tp_plan: str | dict = "auto"
    """The TP plan in transformers' terms (``DistributedConfig(tp_plan=...)``): ``"auto"`` (default), the model's
    own (its ``_tp_plan``); or a mapping of module names (layer numbers as ``*``) to transformers' style names whose
    rules override the model's. The fused layers split a model one way (``commfuse_dp.tp.plan``): a rule that asks
    another split, or names a module the model lacks, is refused before the model changes. In the environment:
    ``auto`` or the mapping as JSON."""

    fsdp2_collectives: str = "auto"
    """What the ``"fsdp2"`` schedule's units all-gather and reduce-scatter with: ``"rings"`` (this library's, with
    FSDP2's GPU schedule run on any device: ``use_ring_collectives(overlap=True)``) or ``"torch"`` (FSDP2 exactly as
    shipped: NCCL's collectives on CUDA, gloo's on CPU, where FSDP2 waits for each). ``"auto"`` (default): the rings
    on CPU; on CUDA NCCL's own, unless the planner predicts the rings faster there by 2 % (``describe(model)`` says
    which ran and why). The other schedules' FSDP2 units always run on the rings."""

    link_gbps: float | None = None
    """Each rank's link, GB/s (bytes), where known: what ``schedule="auto"`` plans with. ``None``: measured at
    ``shard()`` (hops at two sizes on the shard group, ``commfuse_dp/planner/measure.py``), with the fixed cost of a hop."""

    ring_latency_us: float | None = None
    """The fixed cost of one hop, microseconds, where known: what ``schedule="auto"`` plans with. ``None``:
    measured at ``shard()`` with the link."""

    tflops: float | None = None
    """The device's GEMM rate per rank, TFLOP/s, where known: what ``schedule="auto"`` plans with. ``None``:
    measured at ``shard()`` on the model's own layer shapes in its compute dtype."""

    tokens_per_rank: int | None = None
    """Tokens of one rank's micro-batch (batch x sequence), where known: what ``schedule="auto"`` plans with.
    ``None``: from the first batch where the ``Trainer`` integrations shard the model (``CommFuseTrainer``), else
    8 sequences of the model's context (the Trainer's default per-device batch; ``max_position_embeddings``), at
    most 8192."""

    timeout_s: float = 300.0
    """Seconds one hop may wait for its peers. A peer that died or stopped answering makes the hop raise
    ``RingCommError`` naming that peer and the hop, on every rank, instead of hanging."""

    stats: bool = True
    """Record per-step compute / communication / exposed-communication times (``commfuse_dp.step_stats``)."""

    exclude: tuple[str, ...] = ()
    """``fnmatch`` patterns of module names (``model.named_modules()``) kept out of the fused path, e.g.
    ``("*.experts.*", "lm_head")``: a linear or embedding whose name, or the name of a module that contains it,
    matches one is neither fused nor a ring embedding; FSDP2 shards it with its unit. In YAML a list or a
    comma-separated string; in the environment a comma-separated string (``COMMFUSE_EXCLUDE=*.experts.*,lm_head``)."""

    exclude_data_dependent: bool = True
    """Keep modules that the model calls data-dependently out of the fused path (``commfuse_dp/data_dependence.py``: MoE
    experts, which run only when tokens are routed to them, and LayerDrop layers, skipped at random per rank).
    Every rank must enter the same fused hops in the same order; FSDP2 gathers such a module's whole unit
    on every rank instead. Off: they are fused anyway, and a step in which the ranks diverge fails with an error."""

    shard_frozen: bool = True
    """Shard the models a trainer prepares for evaluation beside the one it trains (``accelerator.prepare_model(m,
    evaluation_mode=True)``: TRL's reference, reward and teacher models) like the trained one: each rank holds 1/N,
    gathered on the rings for each forward, nothing reduced. Every rank must then run their forwards alike. Off:
    such models stay whole on every rank, as accelerate leaves them."""

    nonfinite_grads: str = "auto"
    """What happens when a backward that synchronises gradients leaves a NaN or an infinity in a gradient shard
    (checked after every such backward, once every shard is final; never inside ``no_sync()`` accumulation
    micro-batches, whose non-finite values reach the shards at the synced backward):
    ``"raise"``: every rank raises ``FloatingPointError`` from ``backward()``, naming the step, the ranks whose
    shards are non-finite and their first parameters; the ``.grad`` are left as they are (zero them before the
    next step). ``"skip"``: every rank sets every parameter's ``.grad`` to None, so that the next
    ``optimizer.step()`` changes neither parameters nor optimizer state, logs a warning and counts the step in
    ``step_stats(model).skipped_steps``. ``"off"``: no check. ``"auto"`` (default): ``"raise"``, except in fp16
    (an fp16 ``param_dtype``, fp16 parameters, or a forward under fp16 autocast), where it is ``"off"``: there a
    ``GradScaler`` expects infinities, skips the step itself and lowers its loss scale, which it would not do if
    the gradients had been dropped (``"skip"``) or the backward had raised. Raising by default because a
    non-finite gradient that reaches ``optimizer.step()`` silently turns the weights into NaN for good; the
    check costs one pass over this rank's gradient shards and one all-gather of one byte per rank per synced
    backward (and, on CUDA, the host waits for the backward to finish before ``backward()`` returns)."""

    auto_resume: bool = False
    """Where the training loop is commfuse's (``CommFuseTrainer`` / ``commfuse_trainer(cls)``, the recipes): a run
    that finds a complete checkpoint in its output folder resumes from the newest one (its step, weights,
    optimizer and scheduler state), and starts from step 0 when there is none, so that a job restarted by
    ``torchrun --max-restarts`` or ``commfuse-dp launch --max_restarts`` carries on by itself. A checkpoint whose
    save was interrupted is passed over. The log names the checkpoint and its step. A bare ``CommFuseCallback``
    refuses it (a callback cannot change where ``train()`` starts)."""

    async_save: bool = False
    """Where the checkpoint is commfuse's (``CommFuseTrainer`` checkpoints, ``CommFuseAccelerator.save_state``,
    the recipes): write each checkpoint's sharded state off the training thread
    (``checkpoint.AsyncSaver``): the state is copied to host memory at the save and written while training goes
    on; the next save waits for the one before; a checkpoint counts (is resumed from) once every rank's write
    finished. Such a checkpoint holds the sharded state only, not a consolidated ``from_pretrained`` copy of the
    weights (the model saved at the end of training is consolidated, as always)."""

    def __post_init__(self) -> None:
        # always in this order: of several wrong values, the first one met is named
        self._check_modes()
        self._check_sizes()
        self._check_wire()
        self._check_planner_inputs()
        self._check_run()

    def _check_modes(self) -> None:
        """schedule, grad_divide, nonfinite_grads: one of their names."""
        if self.schedule not in SCHEDULES:
            raise ValueError(f"CommFuseConfig.schedule={self.schedule!r}: allowed values are {SCHEDULES}")
        if self.grad_divide not in GRAD_DIVIDES:
            raise ValueError(f"CommFuseConfig.grad_divide={self.grad_divide!r}: allowed values are {GRAD_DIVIDES}")
        if self.nonfinite_grads is False:  # YAML reads an unquoted ``off`` as false
            self.nonfinite_grads = "off"
        if not isinstance(self.nonfinite_grads, str) or self.nonfinite_grads not in NONFINITE_MODES:
            raise ValueError(f"CommFuseConfig.nonfinite_grads={self.nonfinite_grads!r}: allowed values are "
                             f"{NONFINITE_MODES}")

    def _check_sizes(self) -> None:
        """The rings' and the schedule's sizes: buckets, thresholds, prefetch, lookahead, bundles, pieces."""
        self.bucket_mb = _number("bucket_mb", self.bucket_mb, float)
        if not self.bucket_mb > 0:
            raise ValueError(f"CommFuseConfig.bucket_mb={self.bucket_mb!r}: must be a number of MiB > 0, e.g. 25")
        self.direct_kb = _number("direct_kb", self.direct_kb, float)
        if not self.direct_kb >= 0:
            raise ValueError(f"CommFuseConfig.direct_kb={self.direct_kb!r}: must be a number of KiB >= 0 (0: every "
                             f"bucketed collective goes round the ring)")
        self.min_fuse_numel = _number("min_fuse_numel", self.min_fuse_numel, int)
        if self.min_fuse_numel < 0:
            raise ValueError(f"CommFuseConfig.min_fuse_numel={self.min_fuse_numel!r}: must be an integer >= 0")
        self.prefetch_depth = _number("prefetch_depth", self.prefetch_depth, int)
        if self.prefetch_depth < 1:
            raise ValueError(f"CommFuseConfig.prefetch_depth={self.prefetch_depth!r}: must be an integer >= 1 "
                             f"(turn the prefetch off with prefetch_next=false)")
        if not (isinstance(self.lookahead_mb, str) and self.lookahead_mb.strip().lower() == "auto"):
            self.lookahead_mb = _number("lookahead_mb", self.lookahead_mb, float)
            if not self.lookahead_mb >= 0:
                raise ValueError(f"CommFuseConfig.lookahead_mb={self.lookahead_mb!r}: must be \"auto\" or a number "
                                 f"of MiB >= 0 (0: lockstep)")
        else:
            self.lookahead_mb = "auto"
        if not (isinstance(self.forward_bundles, bool) or self.forward_bundles == "auto"):
            raise ValueError(f"CommFuseConfig.forward_bundles={self.forward_bundles!r}: must be \"auto\", true or "
                             f"false")
        if not (isinstance(self.piece_shards, str) and self.piece_shards.strip().lower() == "auto"):
            self.piece_shards = _number("piece_shards", self.piece_shards, int)
            if self.piece_shards < 1:
                raise ValueError(f"CommFuseConfig.piece_shards={self.piece_shards!r}: must be \"auto\" or an "
                                 f"integer >= 1 (weight shards per compute piece; 1: one per hop)")
        else:
            self.piece_shards = "auto"

    def _check_wire(self) -> None:
        """What travels: the formats on the wire, their block, error feedback, and the fsdp2 schedule's collectives."""
        if self.gather_format not in GATHER_FORMATS:
            raise ValueError(f"CommFuseConfig.gather_format={self.gather_format!r}: allowed values are "
                             f"{GATHER_FORMATS}")
        if self.reduce_format not in REDUCE_FORMATS:
            raise ValueError(f"CommFuseConfig.reduce_format={self.reduce_format!r}: allowed values are "
                             f"{REDUCE_FORMATS} (fp8 gradients lose too much; int8 with error_feedback is the "
                             f"narrowest)")
        self.format_block = _number("format_block", self.format_block, int)
        if not 1 <= self.format_block <= MAX_BLOCK:
            raise ValueError(f"CommFuseConfig.format_block={self.format_block!r}: must be an integer from 1 to "
                             f"{MAX_BLOCK} (elements per scale of fp8 and int8)")
        self.feedback_dtype = _feedback_dtype(self.feedback_dtype)
        if self.error_feedback and self.reduce_format == "exact":
            raise ValueError("CommFuseConfig.error_feedback=True needs a lossy reduce_format (\"bf16\" or "
                             "\"int8\"): an exact reduce-scatter loses nothing to feed back")
        if self.fsdp2_collectives not in FSDP2_COLLECTIVES:
            raise ValueError(f"CommFuseConfig.fsdp2_collectives={self.fsdp2_collectives!r}: allowed values are "
                             f"{FSDP2_COLLECTIVES}")

    def _check_planner_inputs(self) -> None:
        """What ``schedule="auto"`` plans with, where given: link, hop latency, GEMM rate, tokens."""
        for name, unit in (("link_gbps", "GB/s"), ("ring_latency_us", "microseconds"), ("tflops", "TFLOP/s")):
            if getattr(self, name) is not None:
                setattr(self, name, _number(name, getattr(self, name), float))
                if not getattr(self, name) > 0:
                    raise ValueError(f"CommFuseConfig.{name}={getattr(self, name)!r}: must be a number of {unit} "
                                     f"> 0, or None (measured at shard())")
        if self.tokens_per_rank is not None:
            self.tokens_per_rank = _number("tokens_per_rank", self.tokens_per_rank, int)
            if self.tokens_per_rank < 1:
                raise ValueError(f"CommFuseConfig.tokens_per_rank={self.tokens_per_rank!r}: must be an integer "
                                 f">= 1, or None (unknown)")

    def _check_run(self) -> None:
        """The copies (HSDP), the timeout, the switches, the dtypes and the excluded modules."""
        self.replicate = _auto_or_count("replicate", self.replicate, "the number of model copies; 1: no HSDP")
        self.hpz_size = _auto_or_count("hpz_size", self.hpz_size,
                                       "the ranks a second copy of the weights is split over, a node's; 1: none")
        self.tp_size = _number("tp_size", self.tp_size, int)
        if self.tp_size < 1:
            raise ValueError(f"CommFuseConfig.tp_size={self.tp_size!r}: must be an integer >= 1 (1: no tensor "
                             f"parallelism)")
        if self.tp_plan is None:
            self.tp_plan = "auto"
        if isinstance(self.tp_plan, Mapping) and all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in self.tp_plan.items()):
            self.tp_plan = dict(self.tp_plan)
        elif self.tp_plan != "auto":
            raise ValueError(f"CommFuseConfig.tp_plan={self.tp_plan!r}: must be 'auto' (the model's own plan) or a "
                             f"mapping of module names to transformers' style names, e.g. "
                             f"{{'model.layers.*.mlp.down_proj': 'rowwise'}}")
        self.timeout_s = _number("timeout_s", self.timeout_s, float)
        if not self.timeout_s > 0:
            raise ValueError(f"CommFuseConfig.timeout_s={self.timeout_s!r}: must be a number of seconds > 0")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CommFuseConfig.{name}={getattr(self, name)!r}: must be true or false")
        self.param_dtype = _dtype("param_dtype", self.param_dtype)
        self.reduce_dtype = _dtype("reduce_dtype", self.reduce_dtype)
        self.exclude = _patterns("exclude", self.exclude)

    @property
    def ring_kwargs(self) -> dict[str, float]:
        """The keyword arguments of ``ring_all_gather`` / ``ring_reduce_scatter`` this config sets."""
        return {"bucket_mb": self.bucket_mb, "direct_kb": self.direct_kb, "timeout_s": self.timeout_s}

    def bundles_forward(self, world: int, units: int) -> bool:
        """Whether the elastic schedule's forward sends each unit's weight rings together (``forward_bundles``) on
        ``world`` ranks, for a model of ``units`` units with fused groups (decoder layers, the root)."""
        return forward_bundles_auto(world, units) if self.forward_bundles == "auto" else bool(self.forward_bundles)

    def elastic(self, world: int) -> bool:
        """Whether the fused schedule looks ahead elastically (and bundles a unit's hops) on ``world`` ranks."""
        return bool(self.prefetch_next) and world > 1 and self.lookahead_mb != 0

    @property
    def feedback_torch_dtype(self) -> torch.dtype:
        """The torch dtype of ``feedback_dtype``: what error feedback's residuals are kept in."""
        return _DTYPE_NAMES[self.feedback_dtype]

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * (1 << 20)))

    # ---- construction from other sources -------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> CommFuseConfig:
        """Build from a mapping of field names; an unknown key is an error (a typo must not pass silently)."""
        if not isinstance(values, Mapping):
            raise ValueError(f"CommFuseConfig.from_dict expects a mapping of field names, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"CommFuseConfig: unknown field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**dict(values))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> CommFuseConfig:
        """Read a YAML file: either a flat mapping of fields, or any mapping with a ``commfuse:`` block."""
        import yaml

        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: expected a YAML mapping of CommFuseConfig fields, got {type(data).__name__}")
        if "commfuse" in data:
            data = data["commfuse"] or {}
            if not isinstance(data, Mapping):
                raise ValueError(f"{path}: the 'commfuse:' block must be a mapping of CommFuseConfig fields")
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> CommFuseConfig:
        """Read ``COMMFUSE_<FIELD>`` variables (e.g. ``COMMFUSE_BUCKET_MB=50``); keyword overrides win.

        The variables of ``ENV_RESERVED`` (``COMMFUSE_ENABLE``, ``COMMFUSE_CONFIG``) are left for the integrations
        to read. Any other ``COMMFUSE_*`` variable that names no field is an error (``COMMFUSE_SCHEDUL=fused``
        must not silently leave the default schedule in place).
        """
        environ = os.environ if environ is None else environ
        known = {ENV_PREFIX + f.name.upper() for f in fields(cls)}
        unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known and k not in ENV_RESERVED)
        if unknown:
            var = unknown[0]
            close = difflib.get_close_matches(var, sorted(known | set(ENV_RESERVED)), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            others = f" (and {len(unknown) - 1} more: {unknown[1:]})" if len(unknown) > 1 else ""
            raise ValueError(f"{var}{others}: unknown commfuse_dp environment variable; {hint}known variables are "
                             f"{sorted(known)} and, read by the integrations, {list(ENV_RESERVED)}. Unset or "
                             f"rename it")
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse_env(f.name, raw)
        values.update(overrides)
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (dtypes as names), suitable for YAML/JSON and for ``from_dict``."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = (str(v).removeprefix("torch.") if isinstance(v, torch.dtype)
                           else list(v) if isinstance(v, tuple) else v)
        return out

    def to_env(self) -> dict[str, str]:
        """The ``COMMFUSE_*`` variables that ``from_env`` reads back into an equal config."""
        return {ENV_PREFIX + k.upper(): _env_text(v) for k, v in self.to_dict().items()}

    def replace(self, **changes: Any) -> CommFuseConfig:
        return dataclasses.replace(self, **changes)


def with_parallelism(cfg: CommFuseConfig, sizes: Mapping[str, Any], where: str,
                     cfg_name: str = "CommFuseConfig's") -> CommFuseConfig:
    """``cfg`` with accelerate's parallelism sizes (``ParallelismConfig``'s, here ``sizes``): ``dp_replicate_size``
    as ``replicate`` (HSDP), ``tp_size`` as ``tp_size``; ``dp_shard_size`` is then world / (R x TP). Context and
    sequence parallel sizes above 1 are refused, and so is a ``cfg.replicate`` or ``cfg.tp_size`` that says
    otherwise (``where``, ``cfg_name``: named in the error)."""
    other = {k: v for k, v in sizes.items() if k in ("cp_size", "sp_size") and int(v or 1) > 1}
    if other:
        raise ValueError(f"{where} asks for {other}; commfuse shards the data-parallel dimensions and runs tensor "
                         f"parallelism (dp_replicate_size for HSDP, tp_size), no context or sequence parallelism: "
                         f"remove them")
    tp = int(sizes.get("tp_size") or 1)
    if tp > 1:
        if cfg.tp_size not in (1, tp):
            raise ValueError(f"{where}: tp_size={tp} disagrees with {cfg_name} tp_size={cfg.tp_size}: give one "
                             f"of them")
        cfg = dataclasses.replace(cfg, tp_size=tp)
    replicate = int(sizes.get("dp_replicate_size") or 1)
    if replicate <= 1:
        return cfg
    if cfg.replicate not in (1, "auto", replicate):
        raise ValueError(f"{where}: dp_replicate_size={replicate} disagrees with {cfg_name} replicate={cfg.replicate}: "
                         f"give one of them")
    return dataclasses.replace(cfg, replicate=replicate)
