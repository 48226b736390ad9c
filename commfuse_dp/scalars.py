"""0-d parameters (a learnable scale ``a``, a temperature): replicated on every rank and averaged after backward.

torch's ``fully_shard`` refuses a parameter with no dimension to shard ("doesn't support scalar parameters"), and
DDP takes them, so a model that trains under DDP (accelerate's own ``RegressionModel`` has ``a`` and ``b``) would
crash under ``shard()``. ``shard()`` keeps them out of ``fully_shard`` instead and makes each one a
``Replicate()`` DTensor on the data-parallel mesh, so that optimizers, ``clip_grad_norm_``, state dicts and DCP
see one kind of parameter (DTensors) throughout:

- **values**: rank 0's value on every rank at ``shard()`` (as DDP broadcasts it), gathered on the model's ring;
- **forward**: from the root's forward pre-hook until the end of the step's backward, the owning module's
  attribute (``module.a``) is the plain local tensor (``DTensor.to_local()``, cast to ``param_dtype`` when one is
  set), so the model's own arithmetic mixes no DTensor with plain tensors; its gradient flows into the DTensor.
  Outside a step ``module.a`` is the DTensor parameter again, as a sharded weight is;
- **gradients**: after every backward that synchronises gradients, each rank's gradient of every 0-d parameter is
  gathered on the ring in one message and replaced by the mean over the ranks (a rank whose backward gave a
  parameter no gradient counts zero), as DDP's all-reduce does; under ``no_sync`` they accumulate locally. The
  exchange runs as an autograd final callback, queued from the first hook of the backward that reaches the root's
  outputs or a 0-d parameter, so every rank that runs the same backward runs it at the same point.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from .nonfinite import OncePerBackward, _grad_tensors
from .ring.collectives import ring_all_gather


def scalar_params(model: nn.Module) -> list[nn.Parameter]:
    """The model's 0-d parameters, each once."""
    seen: dict[int, nn.Parameter] = {}
    for p in model.parameters():
        if p.dim() == 0:
            seen.setdefault(id(p), p)
    return list(seen.values())


class ScalarParams:
    """The 0-d parameters of one sharded model (see the module docstring)."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, engine) -> None:
        self.engine = engine
        self.mesh = mesh
        self.owners: list[tuple[nn.Module, str, nn.Parameter]] = []  # (module, name, DTensor parameter)
        self._on_grad = OncePerBackward(self.average)  # from the hooks below: average at this backward's end
        self._shadowed = False
        old = scalar_params(model)
        if not old:
            return
        values = self._agreed_values(old)
        new: dict[int, nn.Parameter] = {}
        for p, value in zip(old, values):
            local = value.to(dtype=p.dtype, device=p.device).reshape(())
            new[id(p)] = nn.Parameter(DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False),
                                      requires_grad=p.requires_grad)
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in new:
                    module._parameters[name] = new[id(p)]
                    self.owners.append((module, name, new[id(p)]))

    @property
    def params(self) -> set[nn.Parameter]:
        return {p for _, _, p in self.owners}

    def _agreed_values(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Rank 0's values of ``params`` (a meta model has none yet: its values come from a checkpoint)."""
        device = params[0].device
        if device.type == "meta":
            return [p.detach() for p in params]
        ring = self.engine.world_ring  # every rank (HSDP: of every copy)
        mine = torch.stack([p.detach().to(torch.float64) for p in params])
        everyone = torch.empty(ring.size * len(params), dtype=torch.float64, device=device)
        ring_all_gather(everyone, mine, ring.group, timeout_s=self.engine.config.timeout_s,
                        label="shard(): the 0-d parameters' values (rank 0's are kept)")
        return list(everyone[:len(params)].unbind())

    # -- during a step ------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """The root's forward begins: each owner's attribute becomes the plain local value, tracked to the DTensor."""
        if not self.owners:
            return  # the usual case: nothing to do on the step's path
        dtype = self.engine.config.param_dtype
        for module, name, p in self.owners:
            local = p.to_local()
            if dtype is not None and local.is_floating_point():
                local = local.to(dtype)
            module.__dict__[name] = local  # found before nn.Module.__getattr__ looks in _parameters
        self._shadowed = True

    def end_forward(self, output) -> None:
        if not self.owners:
            return  # no hooks, no callback per backward
        if not torch.is_grad_enabled():
            self.unshadow()  # no backward follows
            return
        for t in _grad_tensors(output):
            t.register_hook(self._on_grad)
        for _, _, p in self.owners:
            if p.requires_grad and not getattr(p, "_cf_scalar_hooked", False):
                p.register_post_accumulate_grad_hook(self._on_grad)
                p._cf_scalar_hooked = True

    def unshadow(self) -> None:
        if self._shadowed:
            for module, name, _ in self.owners:
                module.__dict__.pop(name, None)
            self._shadowed = False

    def average(self) -> None:
        """Final callback of a backward: the mean of each 0-d gradient over the ranks (synced backward only)."""
        self.unshadow()
        if not self.engine.requires_grad_sync:
            return  # accumulate locally; the synced backward averages the sum
        params = [p for _, _, p in self.owners if p.requires_grad]
        params = list({id(p): p for p in params}.values())
        if not params:
            return
        ring = self.engine.world_ring  # every rank (HSDP: of every copy)
        device = params[0].device
        mine = torch.zeros(2 * len(params), dtype=torch.float64, device=device)
        for i, p in enumerate(params):
            if p.grad is not None:
                mine[i] = p.grad.to_local().to(torch.float64)
                mine[len(params) + i] = 1.0
        everyone = torch.empty(ring.size * mine.numel(), dtype=torch.float64, device=device)
        ring_all_gather(everyone, mine, ring.group, timeout_s=self.engine.config.timeout_s, stats=self.engine.stats,
                        label="the 0-d parameters' gradient mean after the backward")
        rows = everyone.view(ring.size, 2, len(params))
        means = rows[:, 0].sum(0) / ring.size
        present = (rows[:, 1].sum(0) > 0).tolist()  # which got a gradient on some rank (a host read, once)
        for i, p in enumerate(params):
            if not present[i]:
                continue
            if p.grad is None:
                p.grad = DTensor.from_local(torch.zeros((), dtype=p.dtype, device=device), self.mesh,
                                            [Replicate()] * self.mesh.ndim, run_check=False)
            p.grad.to_local().copy_(means[i])

