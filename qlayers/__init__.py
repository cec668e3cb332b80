"""qlayers: drop-in quantized Flax NNX layers for FP8 and OCP MX training.

Replace ``nnx.Linear`` with `QuantDense` (or call `qlayers.quantize` on a
model), pick a recipe (``"fp8_delayed"``, ``"mxfp8"``, ...), and train with
`qlayers.value_and_grad` and `qlayers.Optimizer`: the GEMMs run on
low-precision operands with FP32 accumulation while master weights, optimizer
moments, norms, softmax and the loss stay wide.

The numerics are reachable as `qlayers.formats` (element formats),
`qlayers.scaling` (scale rules, `QTensor`) and `qlayers.ops` (the quantized
GEMM and its ``dot_general`` form); the optimizer pieces as `qlayers.optim`;
checkpoints as `qlayers.checkpoint`; numerics diagnostics per layer (which
layers suffer under a recipe, and why) as `qlayers.inspect`.
"""

from qlayers import checkpoint
from qlayers import formats
from qlayers import hf
from qlayers import ops
from qlayers import optim
from qlayers import scaling
from qlayers.convert import dequantize_model
from qlayers.convert import quantize
from qlayers.convert import Rule
from qlayers.dispatch import report as backends
from qlayers.grad import accumulate_grads, average_grads
from qlayers.grad import value_and_grad
from qlayers.layers import QuantAttentionProj
from qlayers.layers import QuantDense
from qlayers.layers import QuantEinsum
from qlayers.layers import QuantExperts
from qlayers.layers import QuantExpertsEinsum
from qlayers.layers import QuantGemm
from qlayers.layers import QuantLinearGeneral
from qlayers.layers import QuantLogits
from qlayers.layers.core import update_scales
from qlayers.layers.frozen import freeze
from qlayers.layers.frozen import FrozenKernel
from qlayers.layers.frozen import FrozenWeight
from qlayers.lora import add_lora
from qlayers.lora import merge_lora
from qlayers.optim import Optimizer
from qlayers.recipe import available_recipes
from qlayers.recipe import Recipe
from qlayers.recipe import recipe
from qlayers.remat import remat_policy
from qlayers.state import QuantGradState
from qlayers.state import QuantVariable
# Last: it builds on the layers, conversion and ops above.
from qlayers import inspect  # pylint: disable=g-bad-import-order
from qlayers import recipe_rules  # pylint: disable=g-bad-import-order

from qlayers._version import __version__  # pylint: disable=g-bad-import-order

__all__ = [
    # Layers, and the quantized GEMM they all run.
    "QuantDense", "QuantLinearGeneral", "QuantEinsum", "QuantAttentionProj",
    "QuantLogits", "QuantGemm",
    # Mixture of experts: stacked expert kernels (grouped GEMM, ragged_dot;
    # or one GEMM per expert of an einsum over capacity buffers).
    "QuantExperts", "QuantExpertsEinsum",
    # Converting an existing model.
    "quantize", "dequantize_model", "Rule",
    # Recipes.
    "recipe", "Recipe", "available_recipes",
    # Training.
    "value_and_grad", "accumulate_grads", "average_grads", "Optimizer",
    "update_scales", "remat_policy",
    # Quantization state (never nnx.Param): all of it, and the gradient part.
    "QuantVariable", "QuantGradState",
    # Fine-tuning: frozen quantized base weights and LoRA adapters beside them.
    "freeze", "FrozenKernel", "FrozenWeight", "add_lora", "merge_lora",
    # Where the GEMMs run.
    "backends",
    # Submodules.
    "checkpoint", "formats", "hf", "scaling", "ops", "inspect", "recipe_rules",
]
