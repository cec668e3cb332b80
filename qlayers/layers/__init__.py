"""Quantized NNX layers."""

from qlayers.layers.attention import QuantAttentionProj
from qlayers.layers.dense import QuantDense
from qlayers.layers.logits import QuantLogits

__all__ = ["QuantAttentionProj", "QuantDense", "QuantLogits"]
