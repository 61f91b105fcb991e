"""NSA's gated combination of the three branch outputs (paper Eq. 5), in torch ops: the torch path of the custom op
nsa::gated_combine (nsa/attention/ops.py) and the oracle of its Triton kernels (kernels/gated_combine.py)."""
from __future__ import annotations

import torch


def gated_sum(g: torch.Tensor, o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor) -> torch.Tensor:
    """g [B, T, H, 3] (cmp, sel, win) and the branch outputs [B, H, T, hd] -> their gated sum [B, H, T, hd]."""
    gt = g.transpose(1, 2).unsqueeze(-1).to(o_cmp.dtype)  # [B, H, T, 3, 1]
    return gt[..., 0, :] * o_cmp + gt[..., 1, :] * o_sel + gt[..., 2, :] * o_win


def gated_combine_fwd(g: torch.Tensor, o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor) -> torch.Tensor:
    """-> the gated sum in the output projection's layout, y [B, T, H, hd] contiguous."""
    return gated_sum(g, o_cmp, o_sel, o_win).transpose(1, 2).contiguous()


def gated_combine_bwd(d_y: torch.Tensor, g: torch.Tensor, o_cmp: torch.Tensor, o_sel: torch.Tensor,
                      o_win: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """d_y [B, T, H, hd] -> d_g [B, T, H, 3] (g's dtype), d_o_cmp, d_o_sel, d_o_win [B, H, T, hd] (contiguous): the
    products and sums autograd forms through gated_sum, in the same dtypes."""
    dy = d_y.transpose(1, 2)  # [B, H, T, hd]
    gt = g.transpose(1, 2).unsqueeze(-1).to(o_cmp.dtype)  # [B, H, T, 3, 1]
    d_o = [(gt[..., i, :] * dy).contiguous() for i in range(3)]
    d_g = torch.stack([(dy * o).sum(-1) for o in (o_cmp, o_sel, o_win)], -1)  # [B, H, T, 3]
    return (d_g.transpose(1, 2).to(g.dtype).contiguous(), *d_o)
