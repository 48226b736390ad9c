"""The cross-entropy of logits split over the vocabulary (each tensor-parallel rank holds the logits of its rows
of the lm_head), so that no rank holds the full logits: per token, the maximum, the sum of exponentials and the
target's logit are reduced over the group (two all-reduces of one number a token), and the gradient is each
rank's own softmax rows less the target's one-hot.

``causal_lm_loss(tp)`` is the model's ``loss_function`` (transformers' ``ForCausalLMLoss``, shift and
reduction included: a sum over ``num_items_in_batch`` where it is given, else the mean over counted tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class VocabCrossEntropyFn(torch.autograd.Function):
    """``loss = VocabCrossEntropyFn.apply(logits, target, start, group, ignore_index)``: ``logits`` ``(T, V_r)``
    float, this rank's vocabulary rows ``start:start+V_r``; ``target`` ``(T,)``. ``loss`` ``(T,)``: each token's
    cross-entropy, 0 where the target is ``ignore_index``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, start: int, group, ignore_index: int):
        top = logits.max(-1).values
        dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
        exp = (logits - top[:, None]).exp_()
        local, held, counted = _targets(target, start, logits.shape[-1], ignore_index)
        sums = torch.stack([exp.sum(-1), logits.gather(1, local[:, None]).squeeze(1) * held])
        dist.all_reduce(sums, group=group)
        loss = (sums[0].log() + top - sums[1]) * counted
        ctx.start, ctx.ignore_index = start, ignore_index
        # (the rest is found again from the target, kept narrow where the vocabulary allows)
        narrow = target.to(torch.int32) if start + logits.shape[-1] < 2 ** 31 else target
        ctx.save_for_backward(exp.div_(sums[0][:, None]), narrow)
        return loss

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        softmax, target = ctx.saved_tensors
        local, held, counted = _targets(target.long(), ctx.start, softmax.shape[-1], ctx.ignore_index)
        grad = softmax * (dloss * counted)[:, None]  # (not in place: a second backward reads it again)
        rows = (held & counted).nonzero().squeeze(1)
        grad[rows, local[rows]] -= dloss[rows]
        return grad, None, None, None, None


def _targets(target: torch.Tensor, start: int, rows: int, ignore_index: int):
    """Each target's column in this rank's logits (0 where another rank holds it), where this rank holds it, and
    which targets count (not ``ignore_index``)."""
    local = target - start
    held = (local >= 0) & (local < rows)
    return local.masked_fill(~held, 0), held, target != ignore_index


def causal_lm_loss(tp):
    """A ``loss_function`` for a causal LM whose lm_head ``tp`` split over the vocabulary (``TensorParallel``):
    what ``ForCausalLMLoss`` computes from the full logits."""

    def loss_function(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                      shift_labels=None, **kwargs):
        logits = logits.float()
        if shift_labels is None:
            labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        target = shift_labels.reshape(-1).to(logits.device)
        loss = VocabCrossEntropyFn.apply(logits.reshape(-1, logits.shape[-1]), target, tp.vocab_start,
                                         tp.group, ignore_index).sum()
        if num_items_in_batch is None:
            return loss / (target != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch

    return loss_function


class _Summed(torch.autograd.Function):
    """The sum over the group of each rank's part of a total that every rank then uses alike (its loss is the
    same on every rank of the group): all-reduce forward, the gradient passed through as it is."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group) -> torch.Tensor:
        total = part.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def fused_head_outputs(tp, logits: torch.Tensor, labels, shift_labels, num_items_in_batch, output_cls):
    """What TRL's fused LM head returns (``trl.trainer.utils.add_fused_lm_head``, ``model(..., fused_lm_head=True)``:
    ``FusedCausalLMOutput``), from this rank's vocabulary columns of the logits: per next-token label its
    log-probability (with its gradient: ``VocabCrossEntropyFn``), the entropy (with its gradient),
    ``log(sum_v p_v^2)``, the mean logit and whether the label is the first most likely token, each zero where the
    label is -100, and the loss TRL computes from them. At temperature 1, without softcapping or a logit scale
    (``tensor_parallel`` checks the model's config; the trainers let through use TRL's default temperature)."""
    if shift_labels is None:
        target, x = labels[:, 1:], logits[:, :-1]
    else:
        target, x = shift_labels, logits
    mask = target != -100
    shape = mask.shape
    x = x.float().reshape(-1, x.shape[-1])
    t = target.reshape(-1).to(x.device)
    group, start, rows = tp.group, tp.vocab_start, x.shape[-1]
    log_probs = -VocabCrossEntropyFn.apply(x, t, start, group, -100)
    top = x.detach().max(-1).values
    dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
    e = (x - top[:, None]).exp()
    sum_exp = _Summed.apply(e.sum(-1), group)
    log_z = top + sum_exp.log()
    entropy = log_z - _Summed.apply((e / sum_exp[:, None] * x).sum(-1), group)
    with torch.no_grad():
        local, held, _ = _targets(t, start, rows, -100)
        columns = torch.arange(start, start + rows, device=x.device)
        before = x.detach().masked_fill(columns[None, :] >= t[:, None], float("-inf")).max(-1).values
        stats = torch.stack([x.detach().gather(1, local[:, None]).squeeze(1) * held, (e.detach() ** 2).sum(-1),
                             x.detach().sum(-1)])
        dist.all_reduce(stats, group=group)
        dist.all_reduce(before, dist.ReduceOp.MAX, group=group)
        target_logit, sq_sum_exp, logit_sum = stats
        is_top1 = (target_logit >= top) & (target_logit > before)
        log_sum_sq_probs = sq_sum_exp.log() - 2 * sum_exp.detach().log()
        mean_logits = logit_sum / tp.vocab_size
    per_token = [v.view(shape).masked_fill(~mask, 0) for v in (log_probs, entropy, log_sum_sq_probs, mean_logits,
                                                               is_top1)]
    log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = per_token
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return output_cls(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                      log_sum_sq_probs=log_sum_sq_probs, mean_logits=mean_logits, is_top1=is_top1, label_mask=mask,
                      aux_loss=None)
