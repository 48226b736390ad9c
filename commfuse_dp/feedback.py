"""Error feedback's residuals of one model, by name, so that a checkpoint carries them.

With ``CommFuseConfig(error_feedback=True)`` every lossy gradient exchange keeps, from one synced backward to the
next, what encoding lost of this rank's contribution, and adds it to the next contribution. That is
training state as much as the optimizer's moments: a run resumed without it takes a different step from the
uninterrupted one. Every place that keeps one (a fused group's reduce-scatter, an FSDP2 unit's ring
reduce-scatter, the exchange across HSDP's copies) asks the model's ``Residuals`` for it under a name that is the
same on every rank and in every run of the same model and config (the order the runtime built its parts in, never
an object's id), so ``checkpoint.save_sharded`` / ``AsyncSaver`` / ``load_sharded`` (and through them
``CommFuseTrainer`` and ``CommFuseAccelerator.save_state``) save and restore each rank's residuals.

A residual is kept in ``CommFuseConfig.feedback_dtype`` (bfloat16 by default, or float32); the arithmetic
on it is float32 either way (``wire.RowFormat.encode_fed``: upcast, add, encode, subtract what was sent, round the
new residual once into its dtype). A checkpoint saves each residual in its dtype; a resume whose
``feedback_dtype`` differs converts it (float32 to bfloat16 rounds it, as every step's new residual is rounded;
bfloat16 to float32 is exact), so switching the dtype is a memory decision, not a reason to lose the residuals.

A residual is this rank's own (what it sent each owner), so it only means something to the same rank of the same
world: a checkpoint resumed at another world size with error feedback on is refused with one line on every rank.
"""

from __future__ import annotations

import threading

import torch

from .handle import handle_of


class Residuals:
    """The residuals of one model's lossy exchanges, by name; restored ones wait here until their exchange first
    asks for them (they are made lazily, at the first synced backward)."""

    def __init__(self, enabled: bool = False, dtype: torch.dtype = torch.float32) -> None:
        # (``shard()`` and ``use_ring_collectives`` pass the config's ``feedback_dtype``; float32 where none is given)
        self.enabled = enabled  # CommFuseConfig.error_feedback: checkpoints save and restore them
        self.dtype = dtype  # CommFuseConfig.feedback_dtype: what the residuals are kept in
        self.tensors: dict[str, torch.Tensor] = {}
        self._restored: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # (the HSDP exchanges ask on the ring's thread, the rest on the compute one)

    def get(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The residual ``name`` of ``shape`` in ``dtype``: the one kept, else the one a checkpoint restored
        (converted to ``dtype`` where it was saved in another), else zeros."""
        shape = tuple(shape)
        with self._lock:
            kept = self.tensors.get(name)
            if kept is not None and tuple(kept.shape) == shape:
                return kept
            made = torch.zeros(shape, dtype=self.dtype, device=device)
            restored = self._restored.pop(name, None)
            if restored is not None:
                if tuple(restored.shape) != shape:
                    raise ValueError(
                        f"commfuse_dp: the checkpoint's error-feedback residual {name!r} has shape "
                        f"{tuple(restored.shape)}, this run's exchange {shape}: the run was saved with another "
                        f"model, CommFuseConfig or world size. Resume with the same ones")
                made.copy_(restored)
            self.tensors[name] = made
            return made

    @property
    def nbytes(self) -> int:
        """Bytes of residuals kept on this rank (``describe``)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's residuals, to save: those kept and those restored but not asked for yet."""
        with self._lock:
            return {**self._restored, **self.tensors}

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back what a checkpoint saved: into the residuals kept now, the rest for when they are asked for;
        every residual not in ``tensors`` starts again from zero. A residual saved in another dtype than
        ``dtype`` is converted (``copy_``: rounded to nearest into bfloat16, exactly into float32)."""
        with self._lock:
            self._restored = {}
            for name, kept in self.tensors.items():
                saved = tensors.get(name)
                if saved is None:
                    kept.zero_()
                elif tuple(saved.shape) != tuple(kept.shape):
                    raise ValueError(
                        f"commfuse_dp: the checkpoint's error-feedback residual {name!r} has shape "
                        f"{tuple(saved.shape)}, this run's {tuple(kept.shape)}: the run was saved with another "
                        f"model, CommFuseConfig or world size. Resume with the same ones")
                else:
                    kept.copy_(saved)
            self._restored = {n: t.to(self.dtype) for n, t in tensors.items() if n not in self.tensors}


def residuals_of(model: torch.nn.Module) -> Residuals | None:
    """The model's residuals (``shard()`` or ``use_ring_collectives`` made them), or None."""
    handle = handle_of(model, through_wrapper=False)
    return handle.residuals if handle is not None else None
