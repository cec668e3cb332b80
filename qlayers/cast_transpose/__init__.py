"""One pass per operand on NVIDIA GPUs: casts that write an operand's two
quantized copies at once (Transformer Engine's cast-transpose).

A wide tensor ``t (R, C)`` feeds two GEMMs that contract different axes: x
is contracted over K in Fprop and over M in Wgrad, w over K and N, g over N
and M. Each copy is otherwise a pass of its own over ``t`` (or, for a
per-tensor FP8 copy, a transpose of the one payload, since cuBLASLt's FP8
GEMM takes only contraction-minor operands), and XLA does not fuse those
passes (``benchmarks/RESULTS.md``, "One pass per operand"). The Pallas
(Triton) kernels here read each tile of ``t`` once and write both copies,
with the values of `qlayers.scaling.quantize` (the CPU tests run them in
Pallas' interpreter and compare bits). One module per kind of copy:

- `qlayers.cast_transpose.fp8`: per-tensor FP8 (`cast_transpose`, the scale
  and a delayed role's amax in the kernel) and row-wise FP8
  (`row_cast_transpose`).
- `qlayers.cast_transpose.blockwise`: MXFP8/MXFP6 and DeepSeek-V3's tiles
  (`mx_cast_transpose`), DeepSeek-V3's 128 x 128 weight blocks
  (`block_cast_transpose`).
- `qlayers.cast_transpose.fp4`: MXFP4 (`fp4_cast_transpose`), rounded to
  nearest or stochastically, with Hadamard transforms if asked.
- `qlayers.cast_transpose.nvfp4`: NVFP4's two copies (`nvfp4_cast_transpose`)
  and the tensor amaxes they need first (`nvfp4_amaxes`).
- `qlayers.cast_transpose.hadamard`: the Hadamard transform alone in one
  pass (`transform`).
- `qlayers.cast_transpose.requantize`: a stored MX or NVFP4 copy's values
  quantized along the other axis from its codes (`mx_requantize`,
  `nvfp4_requantize`: a frozen kernel's Dgrad copy).

Each entry point is jitted with its settings static: a train step calls it
once per operand of every layer, and jit traces and lowers one kernel per
shape instead of one per call. The kernels run under a partitioning rule
(`qlayers.partition.cast`): in a sharded program each device casts its
shard, the 4-bit ones drawing each element's stochastic-rounding bits at
its place in the whole tensor.
"""

from qlayers.cast_transpose.blockwise import MX_BLOCK
from qlayers.cast_transpose.blockwise import TILE_BLOCK
from qlayers.cast_transpose.blockwise import block_cast_transpose
from qlayers.cast_transpose.blockwise import mx_cast_transpose
from qlayers.cast_transpose.blockwise import mx_supported
from qlayers.cast_transpose.fp4 import fp4_cast_transpose
from qlayers.cast_transpose.fp4 import fp4_supported
from qlayers.cast_transpose.fp4 import fp4_transforms
from qlayers.cast_transpose.fp8 import TILE
from qlayers.cast_transpose.fp8 import cast_transpose
from qlayers.cast_transpose.fp8 import row_cast_transpose
from qlayers.cast_transpose.fp8 import supported
from qlayers.cast_transpose.hadamard import transform
from qlayers.cast_transpose.hadamard import transform_supported
from qlayers.cast_transpose.nvfp4 import NV_BLOCK
from qlayers.cast_transpose.nvfp4 import nvfp4_amaxes
from qlayers.cast_transpose.nvfp4 import nvfp4_cast_transpose
from qlayers.cast_transpose.nvfp4 import nvfp4_supported
from qlayers.cast_transpose.nvfp4 import nvfp4_tile_rows
from qlayers.cast_transpose.requantize import mx_requantize
from qlayers.cast_transpose.requantize import nvfp4_amax
from qlayers.cast_transpose.requantize import nvfp4_requantize
from qlayers.cast_transpose.requantize import requantize_supported

__all__ = ["TILE", "MX_BLOCK", "TILE_BLOCK", "NV_BLOCK", "supported",
           "cast_transpose", "row_cast_transpose", "mx_supported",
           "mx_cast_transpose", "block_cast_transpose", "fp4_supported",
           "fp4_transforms", "fp4_cast_transpose", "nvfp4_supported",
           "nvfp4_cast_transpose", "nvfp4_amaxes", "nvfp4_tile_rows",
           "transform_supported", "transform", "requantize_supported",
           "mx_requantize", "nvfp4_amax", "nvfp4_requantize"]
