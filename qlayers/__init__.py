"""qlayers: drop-in quantized Flax NNX layers for FP8 and OCP MX training.

Replace ``nnx.Linear`` with `QuantDense` (or call `qlayers.quantize` on a
model), pick a recipe (``"fp8_delayed"``, ``"mxfp8"``, ...), and train with
`qlayers.value_and_grad` and `qlayers.Optimizer`: the GEMMs run on
low-precision operands with FP32 accumulation while master weights, optimizer
moments, norms, softmax and the loss stay wide.
"""

from qlayers import checkpoint
from qlayers import formats
from qlayers import hadamard
from qlayers import scaling
from qlayers.checkpoint import CheckpointCorruptError
from qlayers.checkpoint import CheckpointMismatchError
from qlayers.convert import ConversionReport
from qlayers.convert import DEFAULT_KEEP_WIDE
from qlayers.convert import DEFAULT_RULES
from qlayers.convert import dequantize_model
from qlayers.convert import quantize
from qlayers.convert import Rule
from qlayers.dispatch import report as backends
from qlayers.grad import accumulate_grads
from qlayers.grad import grad
from qlayers.grad import value_and_grad
from qlayers.layers import QuantAttentionProj
from qlayers.layers import QuantDense
from qlayers.layers.general import QuantEinsum
from qlayers.layers.general import QuantLinearGeneral
from qlayers.layers import QuantLogits
from qlayers.ops import commit_state
from qlayers.ops import dot_general
from qlayers.ops import init_state
from qlayers.ops import quantized_matmul
from qlayers.ops import ScaleState
from qlayers.optim import mixed_precision
from qlayers.optim import Optimizer
from qlayers.recipe import available_recipes
from qlayers.recipe import GemmRecipe
from qlayers.recipe import Recipe
from qlayers.recipe import recipe
from qlayers.remat import remat_policy
from qlayers.scaling import QTensor
from qlayers.scaling import QuantSpec
from qlayers.state import commit_scales
from qlayers.state import DelayedScaling
from qlayers.state import QuantGradState
from qlayers.state import QuantState
from qlayers.state import QuantVariable

__version__ = "0.1.0"

__all__ = [
    "formats", "hadamard", "scaling", "backends", "accumulate_grads", "grad",
    "value_and_grad", "QuantAttentionProj", "QuantDense", "QuantLogits",
    "commit_state", "dot_general",
    "init_state", "quantized_matmul", "ScaleState", "mixed_precision",
    "Optimizer", "available_recipes", "GemmRecipe", "Recipe", "recipe",
    "QTensor", "QuantSpec", "commit_scales", "DelayedScaling",
    "QuantGradState", "QuantState", "QuantVariable",
    "checkpoint", "CheckpointCorruptError", "CheckpointMismatchError",
    "ConversionReport", "DEFAULT_KEEP_WIDE", "DEFAULT_RULES",
    "dequantize_model", "quantize", "Rule", "QuantEinsum",
    "QuantLinearGeneral", "remat_policy",
]
