"""Atomic Trainer checkpoints: ``checkpoint-N`` counts only once every rank has written all of it (the marker
``commfuse_complete``), resuming takes the last complete one, and rotation counts complete ones only."""

from __future__ import annotations

import logging
import os
import re
import shutil

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

from commfuse_dp import checkpoint as ckpt

logger = logging.getLogger("commfuse_dp")

OPTIMIZER_NAME = "optimizer.pt"  # as the Trainer names it (transformers/trainer.py)

_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")

# ---- atomic checkpoints: checkpoint-N counts only once every rank has written all of it --------------------
#
# Trainer._save_checkpoint (transformers 5.23) writes straight into checkpoint-N (no temporary folder, no rename):
# the weights, checkpoint-N/commfuse, scheduler.pt, one rng_state_<rank>.pth per rank, trainer_state.json last on
# rank 0, and then rank 0 alone deletes older checkpoints (trainer_utils.rotate_checkpoints, save_total_limit),
# without waiting for the other ranks. trainer_utils.get_last_checkpoint (resume_from_checkpoint=True) takes the
# highest checkpoint-N folder whatever it holds. So a rank killed while checkpoint-N is written leaves a folder
# that resume_from_checkpoint=True picks (the Trainer then fails on a missing trainer_state.json, or resumes without
# some rank's RNG state), and the previous checkpoint may already be deleted by then.
#
# CommFuseTrainerMixin overrides two more methods, calling the Trainer's own inside:
# - _save_checkpoint: the marker of checkpoint-N is removed first (re-saving a step overwrites in place), the
#   Trainer saves (its rotation does nothing: the Trainer's copy of the arguments has save_total_limit=None, the
#   mixin keeps the limit), every rank meets at a barrier, and only then does the saving process write
#   checkpoint-N/commfuse_complete and rotate, counting complete checkpoints only and never deleting the one just
#   written or the best one.
# - train: resume_from_checkpoint=True resumes from the last *complete* checkpoint (passing over, with a warning,
#   the ones a killed save left behind); a checkpoint named explicitly must be complete or is refused, as it is
#   in _load_from_checkpoint.

def require_complete(checkpoint: str) -> None:
    if ckpt.is_complete(checkpoint):
        return
    checkpoint = os.fspath(checkpoint)
    if not os.path.isdir(checkpoint):
        raise FileNotFoundError(f"CommFuseTrainer: checkpoint {checkpoint} does not exist")
    parent = os.path.dirname(os.path.abspath(checkpoint))
    last = ckpt.latest_complete(parent, PREFIX_CHECKPOINT_DIR)
    if os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
        why = (f"it holds a single {OPTIMIZER_NAME}: it was written without commfuse (or by an older "
               "version), and its optimizer state cannot be split into this run's shards")
    else:
        why = ("it has no commfuse_complete marker, which CommFuseTrainer writes once every rank has written its "
               "part: its save did not finish (a rank stopped while the Trainer was writing it), or it was "
               "written without commfuse (then start a fresh run from its weights alone: "
               "Trainer(model=AutoModel....from_pretrained(checkpoint), ...))")
    raise ValueError(f"CommFuseTrainer: {checkpoint} is not a complete checkpoint: {why}. Resume from "
                     + (f"the last complete one, {last}" if last else "another checkpoint (there is no complete one "
                        f"in {parent})")
                     + ", or pass resume_from_checkpoint=True, which takes the last complete checkpoint of "
                     "output_dir")


def last_complete_checkpoint(output_dir: str) -> str:
    last = ckpt.latest_complete(output_dir, PREFIX_CHECKPOINT_DIR)
    if last is None:
        raise ValueError(f"No valid checkpoint found in output directory ({output_dir}): CommFuseTrainer "
                         "resumes only from complete checkpoints (with a commfuse_complete marker)")
    newer = [name for name in sorted(os.listdir(output_dir))
             if _CHECKPOINT_RE.match(name) and os.path.isdir(os.path.join(output_dir, name))
             and int(_CHECKPOINT_RE.match(name).group(1)) > int(_CHECKPOINT_RE.match(os.path.basename(last)).group(1))]
    if newer:
        logger.warning("CommFuseTrainer: %s in %s %s incomplete (a save was interrupted); resuming from %s",
                       ", ".join(newer), output_dir, "is" if len(newer) == 1 else "are", last)
    return last


def rotate_complete(run_dir: str, limit: int | None, best: str | None, newest: str) -> None:
    """transformers' rotation (oldest first, by mtime as Trainer._save_checkpoint asks), among complete
    checkpoints only; the one just written and the best one are kept. A checkpoint loses its marker before its
    files go, so a deletion cut short never leaves a folder that looks complete."""
    if limit is None or limit <= 0:
        return
    complete = [c for c in sort_checkpoints(run_dir, PREFIX_CHECKPOINT_DIR, use_mtime=True) if ckpt.is_complete(c)]
    protected = {os.path.abspath(newest)} | ({os.path.abspath(best)} if best else set())
    keep = max(limit, len(protected & {os.path.abspath(c) for c in complete}))
    remaining = len(complete)
    for folder in complete:
        if remaining <= keep:
            break
        if os.path.abspath(folder) not in protected:
            ckpt.unmark_complete(folder)
            shutil.rmtree(folder, ignore_errors=True)
            remaining -= 1
