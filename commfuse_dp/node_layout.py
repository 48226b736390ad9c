"""Which ranks share a machine: read off the launcher on every rank and checked against each other.

``torchrun`` (and so ``accelerate launch``, ``commfuse-dp launch`` and the ``Trainer`` under them) sets
``LOCAL_WORLD_SIZE`` (a node's ranks) and ``GROUP_RANK`` (the node's index); Slurm's ``srun`` sets
``SLURM_NTASKS_PER_NODE`` and ``SLURM_NODEID``; Open MPI's ``mpirun`` ``OMPI_COMM_WORLD_LOCAL_SIZE``. HSDP's copies
are consecutive ranks (``shard()``'s 2-D mesh ``(replicate, shard)``), so a layout is usable only where every node
holds as many ranks and rank ``r`` lives on node ``r // per_node``. ``read`` gathers what each rank was told and
raises the same ``ValueError`` on every rank where they disagree; where no launcher says anything, all ranks are
taken as one node.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import NamedTuple

import torch.distributed as dist

from .checks import gather_objects

# (variable with a node's ranks, variable with the node's index), in the order they are trusted
LAUNCHER_VARIABLES = (("LOCAL_WORLD_SIZE", "GROUP_RANK"), ("SLURM_NTASKS_PER_NODE", "SLURM_NODEID"),
                      ("OMPI_COMM_WORLD_LOCAL_SIZE", None))


class NodeLayout(NamedTuple):
    """``nodes`` nodes of ``per_node`` consecutive ranks; ``source``: where that was read."""

    nodes: int
    per_node: int
    source: str

    @property
    def multi(self) -> bool:
        return self.nodes > 1


def told(environ: Mapping[str, str] | None = None) -> tuple[int | None, int | None, str]:
    """What the launcher told this rank: (ranks of its node, its node's index, the variable it came from); Nones
    where nothing says."""
    environ = os.environ if environ is None else environ
    for size_var, node_var in LAUNCHER_VARIABLES:
        size = environ.get(size_var)
        if size is None:
            continue
        try:
            per_node = int(size.split("(")[0].split(",")[0])  # (Slurm may write "4(x2)" or "4,4")
            node = int(environ[node_var]) if node_var and node_var in environ else None
        except ValueError:
            raise ValueError(f"{size_var}={size!r}" + (f", {node_var}={environ.get(node_var)!r}" if node_var else "")
                             + ": not a number of ranks and a node index; fix what sets them (the launcher)") from None
        return per_node, node, size_var
    return None, None, "nothing (no launcher variable): all ranks taken as one node"


def read(timeout_s: float, label: str, environ: Mapping[str, str] | None = None) -> NodeLayout:
    """The node layout of the world, the same on every rank, or the same ``ValueError`` on every rank where the
    ranks were told layouts that disagree, nodes of unequal size, or nodes whose ranks are not consecutive.
    Collective over the world, each hop bounded by ``timeout_s``: a rank that does not take part makes the others
    raise ``RingCommError`` naming it, in ``label``."""
    world = dist.get_world_size()
    if dist.get_backend() == "fake":  # (torch's test group, which moves nothing: no layout to agree on)
        return NodeLayout(1, world, "a fake process group: all ranks taken as one node")
    mine = (*told(environ), socket.gethostname())
    everyone = gather_objects(mine, timeout_s, label)
    sizes = {e[0] for e in everyone}
    source = everyone[0][2]
    if sizes == {None}:
        return NodeLayout(1, world, source)
    if None in sizes or len(sizes) > 1:
        said = ", ".join(f"rank {r}: {e[0] if e[0] is not None else 'nothing'} ({e[2].split(' ')[0]}, host {e[3]})"
                         for r, e in enumerate(everyone))
        raise ValueError(f"commfuse_dp: the ranks were told different numbers of ranks per node ({said}); every node "
                         f"must run as many ranks (torchrun --nproc_per_node alike on every node) and the launcher "
                         f"must tell each rank so")
    per_node = sizes.pop()
    if per_node < 1 or world % per_node:
        raise ValueError(f"commfuse_dp: {source}={per_node} ranks per node does not divide the {world} ranks, so the "
                         f"nodes hold unequal numbers of ranks; run as many ranks on every node")
    misplaced = [r for r, e in enumerate(everyone) if e[1] is not None and e[1] != r // per_node]
    if misplaced:
        r = misplaced[0]
        raise ValueError(f"commfuse_dp: rank {r} runs on node {everyone[r][1]} (host {everyone[r][3]}), not node "
                         f"{r // per_node}: a node's ranks must be consecutive ({per_node} a node) for HSDP's copies. "
                         f"Launch with torchrun's node ranks in order, or give CommFuseConfig(replicate=1)")
    return NodeLayout(world // per_node, per_node, source)
