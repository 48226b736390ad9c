"""``tensor_parallel(model, group)``: a Hugging Face decoder made sequence-parallel tensor-parallel over
``group``, its activation rings beside the GEMM pieces ([Note: TPSP on rings] in ``rings.py``).

What changes in the model: every decoder layer's ``self_attn`` and ``mlp`` become ``TPAttention`` / ``TPMLP``
holding this rank's heads (q, k, v rows and o columns) and this rank's part of the MLP's inner size; the
token embedding and the lm_head hold this rank's rows of the vocabulary (one table where they are tied); the
norms stay whole (``TPNorm``: the original's forward on this rank's rows of the sequence), and their weights'
gradients are summed over the group as each backward produces them. The model's ``loss_function`` becomes the
vocabulary-parallel cross-entropy (``loss.py``), so ``model(input_ids, labels=labels).loss`` is one process's loss on every rank, while its
``logits`` are this rank's vocabulary rows of them and its last hidden states this rank's rows of the sequence.

Families: those whose attention and MLP this module reproduces exactly (``FAMILIES``); any other is refused.
Heads must divide over the group (also the key/value heads: they are not replicated); the sequence and the
vocabulary need not.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from ..handle import handle_of
from .loss import causal_lm_loss, fused_head_outputs
from .modules import TPAttention, TPEmbedding, TPLMHead, TPMLP, TPNorm
from .plan import NORMS, check_plan
from .rings import seq_split

# model_type -> the keywords its attention passes to the attention function beyond Llama's
FAMILIES = {
    "llama": lambda attn: {},
    "gemma": lambda attn: {},
    "mistral": lambda attn: {"sliding_window": getattr(attn.config, "sliding_window", None)},
    "qwen2": lambda attn: {"sliding_window": attn.sliding_window},
}
SAME_BATCH_CHECKS = 3  # the first forwards check that every TP rank got the same batch


class TensorParallel:
    """A model's tensor-parallel group: its ring engine and step state, the rows of the vocabulary this rank
    holds, the sequence's length in the step that runs, and which parameters are split (``sharded``: name ->
    (dim, start, count) of the whole) or whole (``replicated``)."""

    def __init__(self, group, vocab_size: int, config=None, fused: bool = True) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        from ..config import CommFuseConfig
        from ..ring import get_ring
        from ..runtime.engine import Engine
        from ..runtime.schedule import FusedSchedule
        from ..runtime.step import StepState

        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        mesh = DeviceMesh.from_group(group, device_type=device)
        self.engine = Engine(get_ring(group, caller="tensor_parallel"), mesh, config or CommFuseConfig())
        self.steps = StepState(self.engine, FusedSchedule)
        self.vocab_size = vocab_size
        self.fused = fused
        self.hidden, self.item = 0, 4  # the rows the rings carry: width and bytes an element (tensor_parallel)
        counts, offsets = seq_split(vocab_size, self.size)
        self.vocab_start, self.vocab_rows = offsets[self.rank], counts[self.rank]
        self.seq: int | None = None
        self.mesh = None  # shard()'s whole mesh, with tp_size (data_parallel_mesh)
        self.data_parallel = None  # and the group of every data-parallel rank at this rank's TP position
        self.embedded = False  # the embedding ran in this forward (and checked its token ids)
        self.first_layer_next = False  # the root's forward began and the first decoder layer has not run yet
        self.head: str | None = None  # the lm_head's name, where the model has one
        self.head_ran = False  # the lm_head ran in this forward of the root
        self.keep = 0  # the forward's logits_to_keep: >0, the whole vocabulary's logits of the last positions
        self.trl_fused_head = False  # TRL's fused_lm_head=True is answered (CommFuseTrainer of SFT or DPO)
        self.fused_request = None  # in a forward that answers it: (labels, shift_labels, num_items_in_batch)
        self.checked = 0  # forwards whose batch was checked the same on every rank (check_same_batch)
        self.layers: list[tuple[str, str, str, str]] = []  # (module, what is split, forward rings, backward rings)
        self.ring_ops = 0  # ring operations a forward and backward (``add_layer``)
        self.sharded: dict[str, tuple[int, int, int, int]] = {}
        self.replicated: list[str] = []

    def report(self) -> dict:
        """What ``describe()`` shows of the tensor parallelism."""
        mesh = self.mesh
        return {"size": self.size, "group": dist.get_process_group_ranks(self.group),
                "mesh": dict(zip(mesh.mesh_dim_names, mesh.mesh.shape)) if mesh is not None else {"tp": self.size},
                "fused": self.fused, "layers": [list(row) for row in self.layers],
                "ring_ops": self.ring_ops, "bytes_per_token": self.bytes_per_token}

    def add_layer(self, row: tuple[str, str, str, str], ring_ops: int) -> None:
        """A TP layer (module, what this rank holds, forward rings, backward rings) with its ring operations a
        forward and backward."""
        self.layers.append(row)
        self.ring_ops += ring_ops

    @property
    def bytes_per_token(self) -> float:
        """What a rank sends a step for each token of the sequence: each ring operation (N-1)/N of a row of the
        hidden size in the activations' dtype (rounded up by the sequence's split)."""
        return self.ring_ops * (self.size - 1) / self.size * self.hidden * self.item

    def check_same_batch(self, batch: torch.Tensor, what: str) -> None:
        """Raise on every rank of the group unless every rank's ``batch`` has the same shape and checksum (the
        first ``SAME_BATCH_CHECKS`` forwards): a TP group computes one batch, and ranks given different ones
        (a sampler over every rank instead of the data-parallel ones) would compute wrong numbers without a word,
        or enter hops of different sizes."""
        if self.checked >= SAME_BATCH_CHECKS:
            return
        self.checked += 1
        flat = batch.detach().reshape(-1).double()
        mine = torch.zeros(8, dtype=torch.float64, device=batch.device)
        mine[:batch.dim() + 1] = torch.tensor([batch.dim(), *batch.shape], dtype=torch.float64)
        mine[6] = flat.sum()
        mine[7] = (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)).sum()
        both = torch.cat([mine, -mine])
        dist.all_reduce(both, dist.ReduceOp.MAX, group=self.group)
        if not torch.equal(both[:8], -both[8:]):
            raise ValueError(f"tensor_parallel: the ranks of a TP group got different {what} (shape or values); "
                             f"every rank of a TP group must get the same batch: shard the data over the "
                             f"data-parallel ranks (rank // tp_size), not over every rank")

    def exclusions(self) -> dict[str, str]:
        """What ``shard()`` keeps off its fused path, and why: the TP layers, whose rings read their weights (in
        the data-parallel dimension their weights go through FSDP2 units)."""
        return {name: "tensor-parallel: its TP rings read its weights (sharded over data parallel in FSDP2 units)"
                for name, *_ in self.layers}

    def rows_of(self, seq: int) -> tuple[int, int]:
        """(offset, count) of this rank's rows of a sequence of ``seq`` tokens."""
        counts, offsets = seq_split(seq, self.size)
        return offsets[self.rank], counts[self.rank]

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` (the 2-norm) of the whole model's gradients: the split parameters'
        squares summed over the group, the whole ones counted once; gradients that are data-parallel shards
        (DTensors, after ``shard()``) summed over their data-parallel mesh first. Returns the total norm."""
        from torch.distributed.tensor import DTensor, Shard

        named = dict(model.named_parameters())
        # [split, whole] squares: of plain tensors (complete here), and of data-parallel shards (partial)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        complete = torch.zeros(2, dtype=torch.float64, device=device)
        partial = torch.zeros(2, dtype=torch.float64, device=device)
        dp_group = None
        grads = []
        for i, names in enumerate((self.sharded, self.replicated)):
            for name in names:
                g = named[name].grad
                if g is None:
                    continue
                grads.append(g)
                if isinstance(g, DTensor):
                    local = g.to_local()
                    dims = tuple(d for d, p in enumerate(g.placements) if isinstance(p, Shard))
                    if dims:
                        if len(dims) > 1:
                            raise NotImplementedError("clip_grad_norm_: a gradient sharded over more than one mesh "
                                                      "dimension")
                        dp_group = g.device_mesh.get_group(dims[0])
                        partial[i] += local.detach().double().pow(2).sum()
                        continue
                    g = local
                complete[i] += g.detach().double().pow(2).sum()
        if dp_group is not None:
            dist.all_reduce(partial, group=dp_group)
        squares = complete + partial
        split = squares[0:1].clone()
        dist.all_reduce(split, group=self.group)
        total = (split[0] + squares[1]).sqrt().float()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total


def tensor_parallel(model: nn.Module, group=None, config=None, *, fused: bool = True) -> nn.Module:
    """Make ``model`` (a Hugging Face causal LM of ``FAMILIES``) sequence-parallel tensor-parallel over ``group``
    (default: every rank) in place, and return it. Every rank must give the same model (same weights), and then
    every rank's forward the same batch: each keeps its part. ``fused=False``: the reference schedule, each
    gather waited for before its GEMM and each reduce-scatter started after it (DTensor's schedule on the same
    rings). ``config.tp_plan`` (transformers' plan terms, ``commfuse_dp.tp.plan``) is checked against what these
    layers split before the model changes."""
    group = group if group is not None else dist.group.WORLD
    cfg = model.config
    if cfg.model_type not in FAMILIES:
        raise ValueError(f"tensor_parallel: model type {cfg.model_type!r} is not supported; supported: "
                         f"{', '.join(sorted(FAMILIES))} (their attention and MLP are reproduced exactly)")
    size = dist.get_world_size(group)
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if heads % size or kv % size:
        raise ValueError(f"tensor_parallel: {heads} attention heads and {kv} key/value heads do not both divide over "
                         f"{size} tensor-parallel ranks; key/value heads are not replicated: choose a "
                         f"tensor-parallel size that divides {math.gcd(heads, kv)}")
    check_plan(model, getattr(config, "tp_plan", "auto"))
    tp = TensorParallel(group, cfg.vocab_size, config, fused)
    tp.hidden, tp.item = cfg.hidden_size, model.get_input_embeddings().weight.element_size()
    names = {id(m): n for n, m in model.named_modules()}
    base = model.get_decoder()
    embed, head = base.embed_tokens, getattr(model, "lm_head", None)
    tied = head is not None and head.weight is embed.weight
    for layer in base.layers:
        _split_attention(tp, layer, names, FAMILIES[cfg.model_type])
        _split_mlp(tp, layer, names)
    _keep(tp, embed, names[id(embed)], 0, tp.vocab_start, tp.vocab_rows)
    base.embed_tokens = TPEmbedding(embed, tp, names[id(embed)])
    tp.add_layer((names[id(embed)], f"{tp.vocab_rows} of {tp.vocab_size} vocabulary rows",
                  "reduce-scatter to sequence rows", "gather"), 2)
    if head is not None:
        if tied:
            head.weight = embed.weight
        else:
            _keep(tp, head, names[id(head)], 0, tp.vocab_start, tp.vocab_rows)
        model.lm_head = TPLMHead(head, tp, names[id(head)])
        tp.head = names[id(head)]
        tp.add_layer((names[id(head)], f"{tp.vocab_rows} of {tp.vocab_size} vocabulary rows"
                      + (" (tied)" if tied else ""), "gather", "reduce-scatter"), 2)
        model.loss_function = causal_lm_loss(tp)
    _sum_whole_gradients(tp, model)
    base.layers[0].register_forward_pre_hook(_first_layer_rows(tp), with_kwargs=True)
    model.register_forward_pre_hook(_begin_step(tp), with_kwargs=True)
    model.register_forward_hook(_end_forward(tp))
    handle_of(model, create=True).tp = tp
    return model


def data_parallel_mesh(model: nn.Module, config, mesh, device_type: str):
    """``shard()`` with ``CommFuseConfig.tp_size`` > 1: the mesh ``("dp_shard", "tp")`` over the world (with
    ``replicate`` R > 1, ``("dp_replicate", "dp_shard", "tp")``), consecutive ranks in a TP group; ``model`` made
    tensor-parallel over its TP group (after every rank's model was checked the same); returns the data-parallel
    mesh that ``shard()`` shards this rank's part over."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..checks import check_ranks_agree

    size, world = config.tp_size, dist.get_world_size()
    if mesh is not None:
        raise ValueError(f"shard: CommFuseConfig.tp_size={size} builds the mesh itself; pass no mesh=, or leave "
                         f"tp_size at 1 and call commfuse_dp.tensor_parallel(model, tp_group) before shard(model, "
                         f"mesh=<the data-parallel mesh>)")
    if world % size:
        raise ValueError(f"shard: CommFuseConfig.tp_size={size} does not divide the {world} ranks")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local % size:
        raise ValueError(f"shard: CommFuseConfig.tp_size={size} does not divide the {local} ranks of a node "
                         f"(LOCAL_WORLD_SIZE); a TP group must stay inside one node")
    handle = handle_of(model)
    if handle is not None and handle.tp is not None:
        raise ValueError("shard: this model is tensor-parallel already (commfuse_dp.tensor_parallel); leave "
                         "CommFuseConfig.tp_size at 1 and pass the data-parallel mesh")
    check_ranks_agree(list(range(world)), config, model)  # the same whole model everywhere, before it is split
    replicate, shards = (1 if config.replicate == "auto" else config.replicate), world // size
    if shards % replicate:
        raise ValueError(f"shard: CommFuseConfig.replicate={replicate} does not divide the {shards} data-parallel "
                         f"ranks of each TP position (world {world} / tp_size {size})")
    if replicate > 1:  # HSDP beside TP: the copies and the shards of each TP position
        full = init_device_mesh(device_type, (replicate, shards // replicate, size),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        dp = full["dp_replicate", "dp_shard"]
    else:
        full = init_device_mesh(device_type, (shards, size), mesh_dim_names=("dp_shard", "tp"))
        dp = full["dp_shard"]
    # every data-parallel rank of this TP position, for the checks all of them must agree on (the HSDP engine's)
    flat, _ = dist.new_subgroups_by_enumeration([list(range(p, world, size)) for p in range(size)])
    tensor_parallel(model, full["tp"].get_group(), config)
    handle_of(model).tp.mesh, handle_of(model).tp.data_parallel = full, flat
    return dp


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients of a model made tensor-parallel by ``tensor_parallel`` to a total 2-norm of
    ``max_norm``, the norm taken over the whole model (every rank's parts); returns the norm before clipping."""
    handle = handle_of(model)
    if handle is None or handle.tp is None:
        raise ValueError("clip_grad_norm_: this model was not made tensor-parallel by commfuse_dp.tensor_parallel(); "
                         "use torch.nn.utils.clip_grad_norm_")
    return handle.tp.clip_grad_norm_(model, max_norm)


def _split_attention(tp: TensorParallel, layer: nn.Module, names: dict, family) -> None:
    attn = layer.self_attn
    name = names[id(attn)]
    head_dim = attn.head_dim
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        rows = proj.weight.shape[0] // tp.size
        _keep(tp, proj, names[id(proj)], 0, tp.rank * rows, rows)
    cols = attn.o_proj.weight.shape[1] // tp.size
    assert cols % head_dim == 0
    _keep(tp, attn.o_proj, names[id(attn.o_proj)], 1, tp.rank * cols, cols)
    layer.self_attn = TPAttention(attn, tp, name, family(attn))
    tp.add_layer((name, f"{attn.q_proj.weight.shape[0] // head_dim} of the heads", "gather (q, k, v); "
                  "reduce-scatter (o)", "reduce-scatter; gather"), 4)


def _split_mlp(tp: TensorParallel, layer: nn.Module, names: dict) -> None:
    mlp = layer.mlp
    missing = [p for p in ("gate_proj", "up_proj", "down_proj", "act_fn") if not hasattr(mlp, p)]
    if missing:
        raise ValueError(f"tensor_parallel: {names[id(mlp)]} ({type(mlp).__name__}) has no {missing}: only gated "
                         f"MLPs (down(act(gate(x)) * up(x))) are supported")
    counts, offsets = seq_split(mlp.gate_proj.weight.shape[0], tp.size)
    start, rows = offsets[tp.rank], counts[tp.rank]
    for proj in (mlp.gate_proj, mlp.up_proj):
        _keep(tp, proj, names[id(proj)], 0, start, rows)
    _keep(tp, mlp.down_proj, names[id(mlp.down_proj)], 1, start, rows)
    layer.mlp = TPMLP(mlp, tp, names[id(mlp)])
    tp.add_layer((names[id(mlp)], f"{rows} of {sum(counts)} inner", "gather (gate, up); reduce-scatter (down)",
                  "reduce-scatter; gather"), 4)


def _keep(tp: TensorParallel, module: nn.Module, name: str, dim: int, start: int, count: int) -> None:
    """Keep ``start:start+count`` of ``module``'s weight along ``dim`` (and of its bias where it is split with
    it: ``dim`` 0), recorded in ``tp.sharded`` as ``(dim, start, count, whole size along dim)``."""
    weight = module.weight
    module.weight = nn.Parameter(weight.detach().narrow(dim, start, count).clone(), requires_grad=weight.requires_grad)
    tp.sharded[f"{name}.weight"] = (dim, start, count, weight.shape[dim])
    bias = getattr(module, "bias", None)
    if bias is not None and dim == 0:
        module.bias = nn.Parameter(bias.detach().narrow(0, start, count).clone(), requires_grad=bias.requires_grad)
        tp.sharded[f"{name}.bias"] = (0, start, count, bias.shape[0])
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = module.weight.shape
    elif isinstance(module, nn.Embedding):
        module.num_embeddings = count


def _sum_whole_gradients(tp: TensorParallel, model: nn.Module) -> None:
    """The parameters left whole: each rank's gradient covers its rows of the sequence only, so each norm becomes
    a ``TPNorm`` that sums its weight's gradient over the group. Only norms and row-parallel biases (whose
    gradients the gathered rows make whole) may be left."""
    norms = [(prefix, m) for prefix, m in model.named_modules()
             if type(m).__name__.endswith(NORMS) and isinstance(getattr(m, "weight", None), nn.Parameter)]
    owned = {f"{prefix}.weight" for prefix, _ in norms}
    for name, _ in model.named_parameters():
        if name in tp.sharded:
            continue
        if name not in owned and not _row_bias(name):
            raise ValueError(f"tensor_parallel: {name} would stay whole, and only norms' weights and the biases of "
                             f"row-parallel linears may; this model is not supported")
        tp.replicated.append(name)
    for prefix, norm in norms:
        if list(norm.named_parameters(recurse=False)) != [("weight", norm.weight)]:
            raise ValueError(f"tensor_parallel: {prefix} ({type(norm).__name__}) has parameters beside its weight; "
                             f"only such norms are supported")
        parent, _, attr = prefix.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, TPNorm(norm, tp))


def _row_bias(name: str) -> bool:
    """A row-parallel linear's bias: whole, its gradient complete on every rank (from the gathered rows)."""
    return name.endswith(("o_proj.bias", "down_proj.bias"))


def _begin_step(tp: TensorParallel):
    def hook(module, args, kwargs):
        tp.fused_request = None
        if kwargs.get("fused_lm_head"):
            if not tp.trl_fused_head:
                raise ValueError(_OWN_HEAD.format(head=tp.head, size=tp.size))
            # TRL's fused LM head (SFTTrainer): its forward runs the model's own, and the end hook returns what
            # the fused head would have, computed over the vocabulary's parts (loss.fused_head_outputs)
            tp.fused_request = (kwargs.get("labels"), kwargs.get("shift_labels"), kwargs.get("num_items_in_batch"))
            kwargs = {**kwargs, "fused_lm_head": False, "labels": None, "shift_labels": None,
                      "num_items_in_batch": None}
        keep = kwargs.get("logits_to_keep", 0)
        if not isinstance(keep, int):
            raise ValueError("tensor parallelism: logits_to_keep as indices is not supported; give a number of "
                             "last positions (generate() does)")
        tp.keep = keep
        tp.steps.begin_step()
        tp.first_layer_next, tp.embedded, tp.head_ran = True, False, False
        return args, kwargs
    return hook


def _end_forward(tp: TensorParallel):
    def hook(module, args, out) -> None:
        tp.steps.end_forward()
        if tp.head is not None and not tp.head_ran:
            raise ValueError(_OWN_HEAD.format(head=tp.head, size=tp.size))
        if tp.fused_request is not None:
            from trl.trainer.utils import FusedCausalLMOutput

            request, tp.fused_request = tp.fused_request, None
            return fused_head_outputs(tp, out.logits, *request, FusedCausalLMOutput)
        return None
    return hook


_OWN_HEAD = ("tensor parallelism: the model's forward was replaced by one that projects the last hidden states through "
             "{head}.weight itself instead of calling {head} (TRL's fused LM head, fused_lm_head=True, in its KTO, "
             "GRPO and RLOO trainers; SFTTrainer's and DPOTrainer's are answered under commfuse_trainer(...)). Under "
             "tp_size={size} those are this rank's rows of the sequence and of the vocabulary, so it would compute "
             "on parts. Train with tp_size=1 (data parallelism) in that trainer")


def _first_layer_rows(tp: TensorParallel):
    """The first decoder layer's pre-hook: the sequence's length for this step, and this rank's rows of the
    whole-sequence hidden states (the embedding's frame, or ``inputs_embeds`` given whole)."""
    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if tp.first_layer_next and not tp.embedded:  # (inputs_embeds given: the embedding did not check them)
            tp.check_same_batch(hidden, "inputs_embeds")
        tp.first_layer_next = tp.embedded = False  # (a recomputation in the backward checks nothing)
        tp.seq = hidden.shape[1]
        start, rows = tp.rows_of(tp.seq)
        mine = hidden[:, start:start + rows].clone()  # (its own storage: the frame is not kept for the backward)
        if args:
            return (mine, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": mine}
    return hook
