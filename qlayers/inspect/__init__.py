"""Numerics diagnostics: which layers suffer under FP8/MX, and why.

* `collect` runs one forward and backward pass and measures, per quantized
  layer and operand role (``x`` input, ``w`` weight, ``g`` output gradient)
  and for each GEMM that consumes it, what that GEMM gets: amax, scale,
  saturated and flushed fractions, SQNR, each GEMM's output SQNR, and the
  amax-history statistics of delayed scaling (a `Report`: ``table()``,
  ``to_json()``, ``plot()``). The model's state does not change.
* `sensitivity` quantizes one layer (and one GEMM) at a time, ranks the
  layers by how much the loss rises and proposes `qlayers.Rule` objects that
  keep the worst ones wide (a `Sensitivity`).
* `noise_fallback` (opt-in) keeps wide the layers whose weight-gradient
  quantization noise exceeds a stated fraction of the gradient's norm
  (`collect` measures it); `save_rules` / `load_rules` carry rules from a
  measuring step to a training step.
* `Monitor` records `collect`'s scalars every N training steps into a
  callback, outside the training step; `plot_amax_history` draws the stored
  amax histories of delayed-scaling layers.

The statistics are computed with the library's own quantization functions
on the operand exactly as each GEMM quantizes it (`qlayers.inspect.numerics`),
so they describe what the GEMM consumed.
"""

from qlayers.inspect.collect import collect
from qlayers.inspect.monitor import Monitor, plot_amax_history
from qlayers.inspect.report import Output, Report, Row
from qlayers.inspect.rules import SQRT3_RULE, gradient_noise, load_rules
from qlayers.inspect.rules import noise_fallback, save_rules
from qlayers.inspect.sensitivity import Candidate, Proposal, Sensitivity
from qlayers.inspect.sensitivity import sensitivity

__all__ = ["collect", "Report", "Row", "Output", "sensitivity",
           "Sensitivity", "Candidate", "Proposal", "Monitor",
           "plot_amax_history", "noise_fallback", "gradient_noise",
           "SQRT3_RULE", "save_rules", "load_rules"]
