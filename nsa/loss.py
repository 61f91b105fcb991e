"""Cross-entropy of the output head without materialising the full logits.

    hidden [N, D], head weight [V, D], targets [N] -> mean cross-entropy over non-ignored rows (scalar)

Equal to `F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=...)`, but the rows
go through in chunks of `chunk_rows`: each chunk's logits [chunk, V] exist only while that chunk is
processed. Forward also computes the gradients (softmax - one-hot, over the number of non-ignored
targets), so nothing of the logits is kept for backward, only

    grad_hidden [N, D] (hidden's dtype) and grad_weight [V, D] (fp32 accumulator, weight's dtype at the end);

backward only scales them by the incoming gradient (in place). Memory of one chunk: its fp32 logits
[chunk, V], reused in place for the exponentials and the gradient, plus under autocast the bf16
matmul output and the bf16 gradient: about 6 x chunk x V bytes, where full logits take about
11 x N x V (bf16 logits, fp32 upcast, log-softmax output and its gradient; docs/BENCHMARKS.md).
grad_weight (V x D x 4 bytes) becomes the head's .grad, which the full path allocates too.

Dtypes follow what `nn.Linear` does today: under autocast the matmuls run in the autocast dtype
(bf16 operands, fp32 accumulation inside the GEMM); logits, softmax and the loss are fp32 (fp64 for
fp64 inputs), and grad_weight is accumulated over chunks in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # F.cross_entropy's default; the model's targets use it
WEIGHT_GRAD_SLAB = 16384  # vocabulary rows per low-precision grad_weight update (bounds a temporary)


def linear_cross_entropy(
    hidden: torch.Tensor,  # [N, D]
    weight: torch.Tensor,  # [V, D] output head (possibly the tied token embedding)
    targets: torch.Tensor,  # [N] int64, ignore_index for rows without a target
    chunk_rows: int,  # rows per chunk (model.loss_chunk)
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean cross-entropy of hidden @ weight.T against targets (nan when every row is ignored)."""
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    matmul_dtype = _matmul_dtype(hidden, weight)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_rows, ignore_index, matmul_dtype)
    loss, _, _ = _chunked_loss_and_grads(hidden, weight, targets, chunk_rows, ignore_index, matmul_dtype, False)
    return loss


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and both gradients chunk by chunk; backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows, ignore_index, matmul_dtype):
        loss, grad_hidden, grad_weight = _chunked_loss_and_grads(
            hidden, weight, targets, chunk_rows, ignore_index, matmul_dtype, True)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):  # grad_loss: [] (e.g. 1 / gradient-accumulation steps)
        grad_hidden, grad_weight = ctx.saved_tensors
        # in place: no second [V, D] buffer; a retain_graph second backward fails loudly (version counter)
        grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        grad_weight.mul_(grad_loss.to(grad_weight.dtype))
        return grad_hidden, grad_weight, None, None, None, None


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would multiply in: autocast's when active (fp64 stays fp64), else the inputs'."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and hidden.dtype != torch.float64:
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunked_loss_and_grads(hidden, weight, targets, chunk_rows, ignore_index, matmul_dtype, need_grads):
    """(loss [], grad_hidden [N, D] | None, grad_weight [V, D] | None), one chunk of rows at a time."""
    with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit below
        loss_dtype = torch.promote_types(matmul_dtype, torch.float32)
        w = weight.to(matmul_dtype)  # [V, D]
        valid = targets != ignore_index  # [N] bool
        n_valid = valid.sum()  # [] int64; 0 -> loss 0 / 0 = nan, like F.cross_entropy
        row_scale = valid.to(loss_dtype) / n_valid.clamp(min=1)  # [N]: 1 / n_valid, 0 on ignored rows
        safe_targets = targets.masked_fill(~valid, 0)  # [N] in range for gather / scatter
        loss_sum = torch.zeros((), dtype=loss_dtype, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grads else None  # [N, D]
        grad_weight = torch.zeros(weight.shape, dtype=loss_dtype, device=weight.device) if need_grads else None

        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h = hidden[rows].to(matmul_dtype)  # [C, D]
            t = safe_targets[rows, None]  # [C, 1]
            logits = F.linear(h, w).to(loss_dtype)  # [C, V] (F.linear: a faster CPU kernel than h @ w.T)
            target_logit = logits.gather(1, t).squeeze(1)  # [C]
            exp, sum_exp, lse = _exp_and_logsumexp_(logits)  # exp in logits' buffer
            loss_sum += torch.where(valid[rows], lse - target_logit, 0).sum()
            if need_grads:
                # d loss / d logits = (softmax - one_hot(t)) * row_scale, still in the same buffer
                grad_logits = exp.mul_(row_scale[rows, None] / sum_exp)  # [C, V]
                grad_logits.scatter_add_(1, t, -row_scale[rows, None])
                g = grad_logits.to(matmul_dtype)  # [C, V]
                grad_hidden[rows] = g @ w  # [C, D]
                _add_matmul_(grad_weight, g.T, h)  # [V, D] += [V, C] @ [C, D]
                del grad_logits, g
            del logits, exp  # this chunk's [C, V] buffers go before the next chunk's are allocated

        loss = loss_sum / n_valid
    if need_grads:
        grad_weight = grad_weight.to(weight.dtype)
    return loss, grad_hidden, grad_weight


def _exp_and_logsumexp_(logits: torch.Tensor):
    """In place, logits [C, V] -> exp(logits - row max); returns it, its row sums [C, 1] and logsumexp [C].

    torch.logsumexp would allocate a second [C, V] buffer for the shifted exponentials."""
    row_max = logits.amax(dim=1, keepdim=True)  # [C, 1]
    exp = logits.sub_(row_max).exp_()  # [C, V]
    sum_exp = exp.sum(dim=1, keepdim=True)  # [C, 1]
    return exp, sum_exp, (row_max + sum_exp.log()).squeeze(1)


def _add_matmul_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc [V, D] += a [V, C] @ b [C, D], summed in acc's dtype (fp32).

    A bf16 / fp16 product comes out of the GEMM in that dtype; it is added in slabs of rows so the
    temporary (and the fp32 copy a mixed-dtype add makes on CPU) is WEIGHT_GRAD_SLAB x D, not V x D."""
    if a.dtype == acc.dtype:
        torch.addmm(acc, a, b, out=acc)  # in place; unlike addmm_, seen by torch's FlopCounterMode
        return
    for start in range(0, acc.shape[0], WEIGHT_GRAD_SLAB):
        rows = slice(start, start + WEIGHT_GRAD_SLAB)
        acc[rows] += a[rows] @ b  # [slab, D]
