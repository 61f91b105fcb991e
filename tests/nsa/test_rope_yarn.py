"""RoPE scaling by YaRN (nsa/layers.py RotaryEmbedding, model.rope_scaling: yarn) against the paper's formulas written
out per dimension here (Peng et al. 2023: NTK-by-parts with a ramp in rotations per trained context, and the
0.1 ln(s) + 1 temperature on cos / sin), plus what it must keep: the fast dimensions as trained, the slow ones
interpolated like linear scaling, nothing changed at scale 1, and a model built with it runs and is refused where
its meaning would be ambiguous (stages, an export to transformers)."""
from __future__ import annotations

import math

import pytest
import torch

from nsa.config import ModelConfig
from nsa.layers import RotaryEmbedding
from nsa.model import Transformer


def paper_yarn_angles(hd: int, theta: float, scale: float, context: int, positions: list[int]) -> torch.Tensor:
    """[T, hd/2] angles by the YaRN paper's h(theta_d) = (1 - g(r)) theta_d / s + g(r) theta_d, r = L / lambda_d,
    L = context / scale, g(r) = 0 below 1 rotation, 1 above 32, linear between."""
    rows = []
    for p in positions:
        row = []
        for i in range(hd // 2):
            theta_d = theta ** (-2 * i / hd)
            r = (context / scale) / (2 * math.pi / theta_d)
            g = 0.0 if r < 1 else 1.0 if r > 32 else (r - 1) / 31
            row.append(p * ((1 - g) * theta_d / scale + g * theta_d))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("hd, theta, scale, context", [(32, 10000.0, 4.0, 256), (64, 500000.0, 8.0, 65536),
                                                       (128, 1e6, 2.5, 20000)])
def test_yarn_equals_the_papers_formula_per_dimension(hd, theta, scale, context):
    positions = [0, 1, 7, 100, context - 1, 3 * context]
    cos, sin = RotaryEmbedding(hd, theta, scale, "yarn", context)(torch.tensor(positions))
    angles = paper_yarn_angles(hd, theta, scale, context, positions)
    magnitude = 0.1 * math.log(scale) + 1
    torch.testing.assert_close(cos.double(), angles.cos() * magnitude, rtol=0, atol=2e-6)
    torch.testing.assert_close(sin.double(), angles.sin() * magnitude, rtol=0, atol=2e-6)


def test_fast_dimensions_keep_their_angles_and_slow_ones_match_linear_interpolation():
    hd, theta, scale, context = 64, 10000.0, 4.0, 4096
    positions = torch.arange(0, 3 * context, 97)
    m = 0.1 * math.log(scale) + 1
    yarn_cos, yarn_sin = RotaryEmbedding(hd, theta, scale, "yarn", context)(positions)
    plain_cos, plain_sin = RotaryEmbedding(hd, theta)(positions)
    linear_cos, linear_sin = RotaryEmbedding(hd, theta, scale, "linear")(positions)
    turns = (context / scale) * RotaryEmbedding(hd, theta).inv_freq / (2 * math.pi)
    fast, slow = turns > 32, turns < 1
    assert fast.any() and slow.any() and not (fast & slow).any()
    torch.testing.assert_close(yarn_cos[:, fast] / m, plain_cos[:, fast], rtol=0, atol=1e-6)
    torch.testing.assert_close(yarn_sin[:, slow] / m, linear_sin[:, slow], rtol=0, atol=1e-6)
    torch.testing.assert_close(yarn_cos ** 2 + yarn_sin ** 2, torch.full_like(yarn_cos, m * m), rtol=0, atol=1e-5)


def test_scale_one_is_plain_rope_and_unknown_scalings_are_refused():
    positions = torch.arange(50)
    for a, b in zip(RotaryEmbedding(32, 1e4, 1.0, "yarn", 64)(positions), RotaryEmbedding(32, 1e4)(positions)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="model.rope_scaling='ntk'"):
        ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=64, rope_scaling="ntk")


def test_a_yarn_model_runs_and_differs_from_linear_only_in_its_positions():
    base = dict(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=64, max_seq_len=128, rope_scale=4.0)
    torch.manual_seed(0)
    linear = Transformer(ModelConfig(**base)).eval()
    yarn = Transformer(ModelConfig(**base, rope_scaling="yarn")).eval()
    yarn.load_state_dict(linear.state_dict())  # no parameter of its own
    tokens = torch.randint(0, 64, (1, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = linear(tokens), yarn(tokens)
    assert torch.isfinite(b).all() and not torch.allclose(a, b)
