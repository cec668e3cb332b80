"""Quantized NNX layers, all running their GEMMs through `QuantGemm`."""

from qlayers.layers.attention import QuantAttentionProj
from qlayers.layers.core import QuantGemm
from qlayers.layers.core import QuantLayer
from qlayers.layers.dense import QuantDense
from qlayers.layers.embed import QuantEmbed
from qlayers.layers.experts import QuantExperts
from qlayers.layers.experts import QuantExpertsEinsum
from qlayers.layers.experts import QuantRaggedDot
from qlayers.layers.general import QuantEinsum
from qlayers.layers.general import QuantLinearGeneral
from qlayers.layers.logits import QuantLogits

__all__ = ["QuantAttentionProj", "QuantDense", "QuantEinsum", "QuantEmbed",
           "QuantExperts", "QuantExpertsEinsum", "QuantGemm", "QuantLayer",
           "QuantLinearGeneral", "QuantLogits", "QuantRaggedDot"]
