"""The model library: configs, layers, attention (dense and Native Sparse Attention), models, FLOPs.

Imports torch only; never the trainer (train/).
"""
from nsa.config import ModelConfig, ModelConfigError, NSAConfig

__all__ = ["ModelConfig", "ModelConfigError", "NSAConfig"]
