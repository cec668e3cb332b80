"""Quantized NNX layers."""

from qlayers.layers.dense import QuantDense

__all__ = ["QuantDense"]
