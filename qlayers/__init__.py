"""qlayers: drop-in quantized Flax NNX layers for FP8 and OCP MX training.

Replace ``nnx.Linear`` with `QuantDense` (or call `qlayers.quantize` on a
model), pick a recipe (``"fp8_delayed"``, ``"mxfp8"``, ...), and train: the
GEMMs run on low-precision operands with FP32 accumulation while master
weights, optimizer moments, norms, softmax and the loss stay wide.
"""

from qlayers import formats
from qlayers import scaling
from qlayers.dispatch import report as backends
from qlayers.ops import dot_general
from qlayers.ops import init_state
from qlayers.ops import quantized_matmul
from qlayers.ops import ScaleState
from qlayers.recipe import available_recipes
from qlayers.recipe import GemmRecipe
from qlayers.recipe import Recipe
from qlayers.recipe import recipe
from qlayers.scaling import QTensor
from qlayers.scaling import QuantSpec

__version__ = "0.1.0"

__all__ = [
    "formats", "scaling", "backends", "dot_general", "init_state",
    "quantized_matmul", "ScaleState", "available_recipes", "GemmRecipe",
    "Recipe", "recipe", "QTensor", "QuantSpec",
]
