"""Which optimizer and which parameter group each parameter gets, decided by its name: the one place for the rule.

AdamW's grouping (`adamw_groups`): matrices (embeddings, linear weights, phi's [l, hd] encodings) decay; vectors
(biases, norm gains) do not, nor do the matrices a module names in its `no_weight_decay()` (NSA with
nsa.aux_decay=false). Parameters a module names in its `lr_scales()` (NSA with nsa.aux_lr_scale) get their own
groups; `set_lr` (train/trainer/optim.py) scales their lr.

Muon's share (`muon_names`, train.optimizer=muon): the hidden weight matrices, i.e. the `weight` of every
`nn.Linear` inside a transformer block (`blocks.<i>.`): attention's q / k / v / o projections (dense `attn.qkv`,
`attn.proj`; NSA `attn.q_proj`, `attn.kv_proj`, `attn.proj`) and the MLP's `mlp.w_in`, `mlp.w_out`, except what a
module names as its own: `aux_parameter_names()` (NSA's gate MLP and phi, whatever nsa.aux_decay / aux_lr_scale
say), `no_weight_decay()` or `lr_scales()`. Everything else stays on AdamW: the token (and learned position)
embeddings, the output head (tied or not: it is no block's), norms, biases, NSA's gate MLP and phi (`compress_k/v`:
fc_in, fc_out, pos_enc). tests/train/test_muon.py lists the split of a dense and an NSA model.

Fused matrices (`muon_row_splits`): a module that stacks several projections in one weight (dense attention's
qkv, NSA's kv_proj) names their rows in `muon_row_splits()`; Muon orthogonalises each projection apart.
"""
from __future__ import annotations

import torch.nn as nn

BLOCKS = "blocks."  # the transformer blocks' prefix (nsa/model.py: Transformer.blocks)
ADAMW, MUON = "adamw", "muon"  # the optimizer a group is stepped by (its "optimizer" key, train/trainer/muon.py)
# the attribute a fused matrix carries (set by train/trainer/optim.py from the modules' `muon_row_splits()`): the row
# counts of the matrices it stacks, e.g. dense attention's qkv (q, k, v); Muon orthogonalises each one apart
ROW_SPLITS = "muon_row_splits"


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _named_by_modules(model: nn.Module, method: str) -> dict[str, object]:
    """{qualified name: value} over every module that has `method`; a set / list it returns maps each name to True."""
    found: dict[str, object] = {}
    for prefix, module in model.named_modules():
        if hasattr(module, method):
            listed = getattr(module, method)()
            items = listed.items() if isinstance(listed, dict) else ((name, True) for name in listed)
            found.update({_qualified(prefix, name): value for name, value in items})
    return found


def muon_names(model: nn.Module) -> list[str]:
    """Names of the parameters Muon trains under train.optimizer=muon (module docstring), in model order."""
    own = {**_named_by_modules(model, "aux_parameter_names"), **_named_by_modules(model, "no_weight_decay"),
           **_named_by_modules(model, "lr_scales")}
    hidden = {_qualified(prefix, "weight") for prefix, module in model.named_modules()
              if isinstance(module, nn.Linear) and prefix.startswith(BLOCKS)}
    return [name for name, p in model.named_parameters()
            if p.requires_grad and p.dim() == 2 and name in hidden and name not in own]


def adamw_groups(model: nn.Module, weight_decay: float, exclude: frozenset[str] = frozenset()) -> list[dict]:
    """AdamW's groups (module docstring) over the trainable parameters not in `exclude` (Muon's). Without lr scales:
    two groups, decay then no decay."""
    exempt = _named_by_modules(model, "no_weight_decay")
    scales = _named_by_modules(model, "lr_scales")
    groups: dict[tuple[bool, float], list[nn.Parameter]] = {(True, 1.0): [], (False, 1.0): []}
    for name, p in model.named_parameters():
        if p.requires_grad and name not in exclude:
            decays = p.dim() >= 2 and name not in exempt
            groups.setdefault((decays, scales.get(name, 1.0)), []).append(p)
    return [{"params": params, "weight_decay": weight_decay if decays else 0.0, "lr_scale": scale}
            for (decays, scale), params in groups.items() if params or scale == 1.0]


def split_summary(model: nn.Module, muon: list[str]) -> str:
    """One line for the console: how many tensors and parameters each optimizer trains."""
    chosen = set(muon)
    counts = {"muon": [0, 0], "adamw": [0, 0]}
    for name, p in model.named_parameters():
        if p.requires_grad:
            entry = counts["muon" if name in chosen else "adamw"]
            entry[0] += 1
            entry[1] += p.numel()
    return (f"optimizer: muon for {counts['muon'][0]} matrices ({counts['muon'][1]:,} params), adamw for "
            f"{counts['adamw'][0]} tensors ({counts['adamw'][1]:,} params)")


def muon_row_splits(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{qualified name: rows of each stacked projection} over every module that declares `muon_row_splits()`."""
    return _named_by_modules(model, "muon_row_splits")
