"""Drop-in quantized ``nnx.LinearGeneral`` and ``nnx.Einsum``.

Both keep the Params of the layer they replace (same names, shapes, dtypes)
and hand their contraction to the `QuantGemm` at ``quant`` as dimension
numbers (it lowers them to one 2-D quantized GEMM: the contracted axes
flatten into K, the kernel's other axes into N). Layers that are not one
GEMM of the input against the kernel (``LinearGeneral`` with
``batch_axis``, an einsum with batch indices or one-sided sums) are refused
with an explanation.
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp
from flax import nnx

from qlayers import ops
from qlayers.layers.core import QuantGemm, QuantLayer
from qlayers.layers.dense import check_real
from qlayers.recipe import Recipe

__all__ = ["QuantLinearGeneral", "QuantEinsum", "einsum_gemm_plan"]


class QuantLinearGeneral(QuantLayer, nnx.LinearGeneral):
  """``nnx.LinearGeneral`` whose GEMMs (forward and backward) run quantized.

  Same constructor and Params as ``nnx.LinearGeneral``: ``kernel
  (*in_features, *out_features)`` and ``bias (*out_features,)``. The input's
  ``axis`` dims are contracted as one ``K = prod(in_features)`` against
  ``N = prod(out_features)``; the Q/K/V (``axis=-1``, out ``(heads,
  head_dim)``) and output (``axis=(-2, -1)``) projections of
  ``nnx.MultiHeadAttention`` are of this kind. ``batch_axis`` (a batched
  GEMM) is not supported. State and recipes as in `qlayers.QuantDense`.

  Args:
    in_features: int or tuple of input feature sizes.
    out_features: int or tuple of output feature sizes.
    recipe: the quantization recipe (default ``"fp8_delayed"``).
    backend: force a GEMM backend (``"xla"`` or ``"ffi"``).
    **kwargs: everything ``nnx.LinearGeneral`` takes (``axis``,
      ``use_bias``, ``dtype``, ``param_dtype``, ``rngs``, ...).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantLinearGeneral(64, (4, 16), recipe="mxfp8",
    ...                                    rngs=nnx.Rngs(0))
    >>> jax.tree.map(jnp.shape, nnx.state(layer, nnx.Param))
    State({
      'bias': Param(
        value=(4, 16)
      ),
      'kernel': Param(
        value=(64, 4, 16)
      )
    })
    >>> layer(jnp.ones((2, 64))).shape
    (2, 4, 16)
  """

  def __init__(self, in_features, out_features, *,
               recipe: Recipe | str = "fp8_delayed",
               backend: str | None = None, **kwargs):
    super().__init__(in_features, out_features, **kwargs)
    self._refuse_injected_op()
    if self.batch_axis:
      raise ValueError(
          "QuantLinearGeneral does not support batch_axis (a batched GEMM "
          "with one weight per batch entry); keep this layer unquantized.")
    self.quant = QuantGemm(recipe, backend=backend)
    self.quant.seed_from(self.kernel[...])

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    """Contracts ``inputs`` over ``axis``; output ``(*rest, *out_features)``."""
    check_real(type(self).__name__, inputs)
    kernel, as_read = self.gemm_kernel()
    axis = self._contracted_axes(inputs, kernel)
    bias = self.bias[...] if self.bias is not None else None
    # The kernel is quantized from its stored value (see QuantDense).
    inputs, _, bias = self.promote_dtype((inputs, as_read, bias),
                                         dtype=self.dtype)
    dims = ((axis, tuple(range(len(axis)))), ((), ()))
    y = self.quant(inputs, kernel, dims,
                   preferred_element_type=self.preferred_element_type
                   or ops.default_out_dtype(self.recipe, inputs.dtype),
                   rhs_quantized=self.stored_kernel())
    y = lora_term(self, inputs, dims, y)
    if bias is not None:
      y = y + jnp.reshape(bias, (1,) * (y.ndim - bias.ndim) + bias.shape
                          ).astype(y.dtype)
    if out_sharding is not None:
      y = jax.sharding.reshard(y, out_sharding)
    return y

  def _contracted_axes(self, inputs, kernel) -> tuple[int, ...]:
    """The input axes contracted, sorted (as ``nnx.LinearGeneral`` contracts
    them: kernel dims follow the input's axis order, not ``axis``'s), after
    checking their sizes against the local kernel (its shard inside
    ``jax.shard_map``). A rank too small for ``axis`` is the TypeError
    ``lax.dot_general`` gives ``nnx.LinearGeneral``."""
    name, shape = type(self).__name__, jnp.shape(inputs)
    want = tuple(kernel.shape[:len(self.axis)])
    if not all(-len(shape) <= a < len(shape) for a in self.axis):
      raise TypeError(f"{name} contracts axis {self.axis} of sizes {want}, "
                      f"which inputs of shape {shape} do not have.")
    axis = tuple(sorted(a % len(shape) for a in self.axis))
    if tuple(shape[a] for a in axis) != want:
      raise ValueError(f"{name} expects input dims {want} at axis "
                       f"{self.axis}, got shape {shape}.")
    return axis


def lora_term(layer, inputs: jax.Array, dims, y: jax.Array) -> jax.Array:
  """``y`` plus the output of ``layer``'s adapter (`qlayers.add_lora`; none:
  ``y``): ``inputs`` contracted as ``dims`` contracts them with the kernel,
  with ``lora_a (K, r)`` seen as the kernel's leading (contracted) dims,
  then with ``lora_b (r, N)`` as its trailing ones, in the adapter's
  dtype; the same layout as the quantized GEMM's output."""
  lora = getattr(layer, "lora", None)
  if lora is None:
    return y
  shape = tuple(layer.kernel.shape)
  (_, kernel_dims), _ = dims
  n_in = len(kernel_dims)
  if sorted(kernel_dims) != list(range(n_in)):
    raise ValueError(f"{type(layer).__name__}: its adapter needs the "
                     "contracted kernel dims first; this call contracts "
                     f"kernel dims {kernel_dims} of {shape}.")
  dt = lora.dtype
  a = lora.lora_a[...].astype(dt).reshape(*shape[:n_in], -1)
  h = jax.lax.dot_general(inputs.astype(dt), a, dims)
  out = (h @ lora.lora_b[...].astype(dt)).reshape(*h.shape[:-1],
                                                 *shape[n_in:])
  return y + out.astype(y.dtype)


# ----------------------------------------------------------------------------
# Einsum


def _tokens(term: str) -> list[str]:
  """``"...ab"`` -> ``["...", "a", "b"]``."""
  out, i = [], 0
  while i < len(term):
    if term.startswith("...", i):
      out.append("...")
      i += 3
    elif term[i] in string.ascii_letters:
      out.append(term[i])
      i += 1
    else:
      raise ValueError(f"Unexpected character {term[i]!r} in einsum term "
                       f"{term!r}.")
  return out


def einsum_gemm_plan(einsum_str: str) -> tuple[list, list, list, list, list]:
  """Splits an ``Einsum`` equation ``"lhs,rhs->out"`` into one GEMM.

  Returns ``(lhs, rhs, out, contracted, rhs_free)`` as token lists (``...``
  is one token). Raises ValueError when the equation is not a single GEMM
  of the input against the kernel: every output index must come from exactly
  one operand (no batch indices), every other index must appear in both
  operands (no one-sided sums), no operand repeats an index (no diagonals),
  the kernel has no ``...``, and at least one index is contracted.
  """
  eq = einsum_str.replace(" ", "")
  if "->" not in eq or eq.count(",") != 1:
    raise ValueError(f"Einsum {einsum_str!r} must be explicit 'lhs,rhs->out'.")
  ins, out = eq.split("->")
  lhs, rhs = (_tokens(t) for t in ins.split(","))
  out = _tokens(out)
  why = []
  for name, t in (("input", lhs), ("kernel", rhs), ("output", out)):
    if len(set(t)) != len(t):
      why.append(f"the {name} term repeats an index")
  if "..." in rhs:
    why.append("the kernel term has '...'")
  batch = set(lhs) & set(rhs) & set(out)
  if batch:
    why.append(f"indices {sorted(batch)} are batch dims (a batched GEMM)")
  one_sided = (set(lhs) ^ set(rhs)) - set(out)
  if one_sided:
    why.append(f"indices {sorted(one_sided)} are summed over one operand only")
  stray = set(out) - set(lhs) - set(rhs)
  if stray:
    why.append(f"output indices {sorted(stray)} appear in no operand")
  contracted = [c for c in rhs if c in lhs and c not in out]
  if not contracted:
    why.append("no index is contracted")
  if why:
    raise ValueError(f"Einsum {einsum_str!r} is not one GEMM of the input "
                     f"against the kernel: {why[0]}.")
  rhs_free = [c for c in rhs if c in out]
  return lhs, rhs, out, contracted, rhs_free


class QuantEinsum(QuantLayer, nnx.Einsum):
  """``nnx.Einsum`` whose GEMMs (forward and backward) run quantized.

  Same constructor and Params as ``nnx.Einsum``. The equation must be one
  GEMM of the input against the kernel (see `einsum_gemm_plan`), e.g.
  ``"btd,dnh->btnh"`` or ``"...hd,hdo->...o"``: indices shared by input and
  kernel are contracted as one ``K``, the kernel's other indices form ``N``.
  State and recipes as in `qlayers.QuantDense`.

  Args:
    einsum_str: the equation ``"input,kernel->output"``.
    kernel_shape: the kernel's shape.
    bias_shape: the bias's shape (``None``: no bias).
    recipe: the quantization recipe (default ``"fp8_delayed"``).
    backend: force a GEMM backend (``"xla"`` or ``"ffi"``).
    **kwargs: everything ``nnx.Einsum`` takes (``dtype``, ``param_dtype``,
      ``rngs``, ...).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantEinsum("btd,dnh->btnh", (64, 4, 16), (4, 16),
    ...                             recipe="mxfp8", rngs=nnx.Rngs(0))
    >>> layer.kernel.shape, layer.bias.shape, layer.recipe.name
    ((64, 4, 16), (4, 16), 'mxfp8')
    >>> layer(jnp.ones((2, 3, 64))).shape
    (2, 3, 4, 16)
  """

  def __init__(self, einsum_str: str, kernel_shape, bias_shape=None, *,
               recipe: Recipe | str = "fp8_delayed",
               backend: str | None = None, **kwargs):
    super().__init__(einsum_str, kernel_shape, bias_shape, **kwargs)
    self._refuse_injected_op()
    _, rhs, *_ = einsum_gemm_plan(self.einsum_str)
    if len(rhs) != len(self.kernel_shape):
      raise ValueError(f"Einsum {einsum_str!r} names {len(rhs)} kernel dims "
                       f"but kernel_shape is {tuple(kernel_shape)}.")
    self.quant = QuantGemm(recipe, backend=backend)
    self.quant.seed_from(self.kernel[...])

  def __call__(self, inputs: jax.Array, einsum_str: str | None = None,
               out_sharding=None) -> jax.Array:
    """Applies the equation (``einsum_str`` overrides the stored one)."""
    check_real(type(self).__name__, inputs)
    eq = (einsum_str or self.einsum_str).replace(" ", "")
    lhs, rhs, out, contracted, _ = einsum_gemm_plan(eq)
    lhs, out = _expand_ellipsis(eq, lhs, out, inputs.ndim)
    kernel, as_read = self.gemm_kernel()
    bias = self.bias[...] if self.bias is not None else None
    inputs, promoted, bias = self.promote_dtype((inputs, as_read, bias),
                                                dtype=self.dtype)
    if len(lhs) != inputs.ndim or len(rhs) != kernel.ndim:
      raise ValueError(f"{type(self).__name__} {eq!r} does not fit input "
                       f"{inputs.shape} and kernel {kernel.shape}.")
    size = dict(zip(rhs, kernel.shape))
    for c, n in zip(lhs, inputs.shape):
      if size.setdefault(c, n) != n:
        raise ValueError(f"{type(self).__name__} {eq!r}: index {c!r} is {n} "
                         f"in the input but {size[c]} in the kernel.")
    dims = ((tuple(lhs.index(c) for c in contracted),
             tuple(rhs.index(c) for c in contracted)), ((), ()))
    y = self.quant(inputs, kernel, dims,
                   preferred_element_type=self.preferred_element_type
                   or ops.default_out_dtype(self.recipe, inputs.dtype),
                   rhs_quantized=self.stored_kernel())
    y = lora_term(self, inputs, dims, y)
    # dot_general orders the output as the input's free indices, then the
    # kernel's; the equation may want them interleaved.
    have = [c for c in lhs if c in out] + [c for c in rhs if c in out]
    if have != out:
      y = jnp.transpose(y, [have.index(c) for c in out])
    if bias is not None:
      shape = self._infer_broadcasted_bias_shape(eq, inputs, promoted)
      y = y + jnp.reshape(bias, shape).astype(y.dtype)
    if out_sharding is not None:
      y = jax.sharding.reshard(y, out_sharding)
    return y


def _expand_ellipsis(eq, lhs, out, ndim):
  """Replaces ``...`` in the input and output terms by fresh letters."""
  if "..." not in lhs:
    return lhs, out
  n = ndim - (len(lhs) - 1)
  if n < 0:
    raise ValueError(f"Einsum {eq!r}: input of rank {ndim} is too small.")
  fresh = [c for c in string.ascii_letters if c not in eq][:n]
  def sub(t):
    i = t.index("...")
    return t[:i] + fresh + t[i + 1:]
  return sub(lhs), sub(out)

