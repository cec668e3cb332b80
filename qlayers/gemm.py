"""The quantized GEMM with its backward rule (Fprop, Dgrad, Wgrad).

`quantized_matmul` computes ``y = x @ w`` for ``x: (..., K)`` and
``w: (K, N)`` under a `Recipe`:

* Fprop ``y = x @ w``: x quantized along K, w along K.
* Dgrad ``dx = g @ w.T``: g along N, w along N.
* Wgrad ``dw = x.T @ g``: x along M (tokens), g along M.

Each operand is quantized from the high-precision tensor along the
contraction dim of the GEMM that consumes it (a per-tensor quantized copy is
shared between GEMMs, since its scale does not depend on the axis). All of
that, and the kernel form of each GEMM, is decided once per call by
`qlayers.dispatch.plan`; the custom_vjp executes the plan. Accumulation is
FP32; Fprop/Dgrad outputs are in the compute dtype, the weight gradient in
the weight's dtype (FP32 masters).

Delayed scaling keeps a `scaling.ScaleState` per operand role ``x``, ``w``,
``g``: the amax history of completed steps and ``amax``, the running max of
the current step. Each use of the op scales every operand of that role from
the history, for the operand's own format (or, while the history is still
empty, from the current amax; see `scaling.delayed_amax`), and
max-accumulates its amax into ``amax``: the forward returns the updated
``x``/``w`` states; the gradient's amax is only known in the backward pass, so
it leaves as the *cotangent of ``state["g"].amax``*, which a training step
writes back exactly (`qlayers.value_and_grad` and `qlayers.Optimizer` do).
The forward passes ``state["g"]`` on unchanged, and each use of a layer
reads the state the previous one returned (`qlayers.QuantGemm.write`): the
backward rule returns the max of this use's amax and the later uses' (the
cotangent of the ``g`` amax passed on), so uses combine by max, not sum, in
plain FP32. Once per step `qlayers.update_scales` writes ``amax`` into the
history and clears it.

Under a mesh every amax is the amax of the whole tensor (see
`qlayers.sharding`): XLA reduces over shards under jit, ``lax.pmax`` does it
inside ``shard_map``; with explicit mesh axes the op runs in an auto-axes
region whose outputs get ``lax.dot_general``'s explicit-mode shardings.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import warnings
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.sharding import PartitionSpec as P

from qlayers import dispatch
from qlayers import partition
from qlayers import scaling
from qlayers import sharding
from qlayers.dispatch import Plan
from qlayers.operands import (delayed_amax, operand, operand_pair, pairable,
                              requantized_operand, stored_operand)
from qlayers.recipe import Recipe, recipe as load_recipe
from qlayers.scaling import ScaleState

__all__ = ["ROLES", "WGRAD_INPUT_NAME", "init_state", "default_out_dtype",
           "quantized_matmul", "intercept", "intercepting"]


ROLES = ("x", "w", "g")

# Name of the saved Wgrad input (see jax.checkpoint_policies).
WGRAD_INPUT_NAME = "qlayers_wgrad_x"


def init_state(recipe: Recipe | str, batch_shape: tuple[int, ...] = ()
               ) -> dict[str, ScaleState] | None:
  """Fresh delayed-scaling state ``{"x", "w", "g"}``, or None if stateless.

  ``batch_shape`` stacks it (one state per layer of an ``nnx.vmap`` stack).
  """
  recipe = load_recipe(recipe)
  if not recipe.delayed:
    return None
  return {role: scaling.init_scale_state(recipe.amax_history_len, batch_shape)
          for role in ROLES}


# ----------------------------------------------------------------------------
# Helpers


def _keys(key):
  """The stochastic-rounding keys of one call's five quantized copies, (x,
  w, x for Wgrad, g, g for Wgrad): one split of its key (so the forward and
  the backward pass derive them alike, and XLA computes the split once)."""
  return (None,) * 5 if key is None else tuple(jax.random.split(key, 5))


def _values(tree):
  """The primal values of a tree of `CustomVJPPrimal` (see `_qmm_fwd`)."""
  return jax.tree.map(lambda p: p.value, tree,
                      is_leaf=lambda p: isinstance(p, CustomVJPPrimal))


def _warn_if_gradient_amax_lost(recipe: Recipe, x, w, state) -> None:
  """Warns when a delayed GEMM is differentiated without its gradient amax
  (so the gradient's delayed scale could never move). Each trace warns;
  Python's warning filters show it once per location unless told
  otherwise (``warnings.simplefilter("always")``)."""
  if (not recipe.delayed or not (x.perturbed or w.perturbed)
      or state["g"].amax.perturbed):
    return
  warnings.warn(
      f"A layer with the delayed-scaling recipe {recipe.name!r} is being "
      "differentiated without its gradient amax (QuantGradState): the "
      "output-gradient scale will never be updated. Use "
      "qlayers.value_and_grad (with qlayers.Optimizer), or "
      "nnx.value_and_grad(..., argnums=nnx.DiffState(0, (nnx.Param, "
      "qlayers.QuantGradState))) and call qlayers.update_scales(model, "
      "grads) after each optimizer update.", stacklevel=2)


# ----------------------------------------------------------------------------
# The custom_vjp core on x (..., K) and w (K, N), executing a Plan
#
# ``dtypes`` (static) is ``(x dtype, w dtype, vma, x shape, gather)``: the
# backward rule returns the input gradients in the primal shapes and dtypes.
# ``vma`` holds the manual mesh axes ``x`` and ``w`` vary over (inside
# shard_map; empty elsewhere), which their cotangents are reduced to;
# ``gather`` those ``w`` is an FSDP shard over (`sharding.weight_shards`).
# Symbolic zeros: the forward rule sees which inputs are differentiated,
# and the backward rule returns None (zero) for every state leaf but the
# gradient role's running amax (also when the output is unused: then it
# passes on the later uses' amax).


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _qmm(plan: Plan, dtypes, x, w, stored, state, key):
  y, new_state, _ = _forward(plan, dtypes[4], x, w, stored, state, key)
  return y, new_state


# A residual that is the input itself: the jitted forward returns this
# (an empty pytree) in its place and `_qmm_fwd` saves the input.
AS_GIVEN = ()


def _as_given(saved) -> bool:
  return isinstance(saved, tuple) and not saved


def _qmm_forward(plan: Plan, gather, x, w, stored, state, key):
  recipe, fprop = plan.recipe, plan.fprop
  kx, kw, kwx, _, _ = _keys(key)
  ax = aw = delayed_x = delayed_w = run_x = run_w = None
  if recipe.delayed:
    ax, run_x = delayed_amax(x, state["x"], recipe)
    aw, run_w = delayed_amax(w, state["w"], recipe)
    # The per-tensor kernel chooses ax, aw itself from these and writes the
    # running amaxes (`operand_pair`).
    delayed_x, delayed_w = ((state[r], recipe.amax_compute_algo, run)
                            for r, run in (("x", run_x), ("w", run_w)))
  # The copies of x and w for two GEMMs each (x: Fprop, then Wgrad's if
  # `Plan.save_x` says; w: Dgrad's, Fprop's), in one pass where
  # `operand_pair` can; elsewhere each made as before (`Plan.dequantized`:
  # the copies made as BF16 values).
  if plan.save_x == "wide":
    qx, x_saved = operand(x, fprop.lhs, amax=ax, key=kx,
                          dtype=recipe.dtype), AS_GIVEN
  else:
    qx, x_saved, *run = operand_pair(
        x, fprop.lhs, plan.wgrad.lhs if plan.save_x == "wgrad" else None,
        amax=ax, delayed=delayed_x, keys=(kx, kwx),
        dtype=recipe.dtype,
        dequantized=plan.dequantized["x"])
    run_x = run[0] if run else run_x
  dgrad_w = None if plan.share_w else plan.dgrad.rhs
  # A stored weight (a frozen kernel's codes) is Fprop's copy as it is, and
  # Dgrad's where one copy serves both; else the backward pass makes
  # Dgrad's from it, so nothing wide is kept for it.
  qw = None if stored is None or gather else stored_operand(
      stored, fprop.rhs, w.shape)
  w_stored = None
  if qw is not None:
    if plan.share_w:
      w_saved = qw
    else:
      w_saved, w_stored = None, stored
  elif not gather and (plan.share_w or pairable(w, dgrad_w, fprop.rhs)):
    w_saved, qw, *run = operand_pair(w, dgrad_w or fprop.rhs,
                                     None if plan.share_w else fprop.rhs,
                                     amax=aw, delayed=delayed_w,
                                     keys=(kw, None), dtype=recipe.dtype,
                                     dequantized=plan.dequantized["w"])
    run_w = run[0] if run else run_w
  else:
    qw = operand(w, fprop.rhs, amax=aw, key=kw, dtype=recipe.dtype,
                 gather=gather)
    w_saved = qw if plan.share_w else AS_GIVEN
  if plan.share_w and fprop.partitioned and plan.dgrad.partitioned:
    # One uint8 value for Fprop and the Dgrad residual: gathered once.
    qw = w_saved = partition.wire(qw)
  y = dispatch.run(fprop, qx, qw)
  y = y.reshape(*x.shape[:-1], y.shape[-1])

  g_state, new_state = None, state
  if recipe.delayed:
    g_state = state["g"]
    new_state = {"x": state["x"]._replace(amax=run_x),
                 "w": state["w"]._replace(amax=run_w), "g": g_state}
  return y, new_state, (x_saved, w_saved, w_stored, ax, aw, g_state, key)


def _qmm_fwd(plan: Plan, dtypes, x, w, stored, state, key):
  if state is not None:
    _warn_if_gradient_amax_lost(plan.recipe, x, w, state)
  x0, w0 = x, w = x.value, w.value
  # An outer derivative reaches the rules through x and w (a wide recipe,
  # bf16 or fp16, keeps its second derivatives: the wide dots'; the
  # backward rule guards its residuals).
  if plan.recipe.quantized:
    x, w = _guarded((x, w))
  y, new_state, (x_saved, w_saved, *res) = _forward(
      plan, dtypes[4], x, w, _values(stored), _values(state), _values(key))
  # An input saved as it is is saved from here, not as an output of the
  # jitted body (which would read as a copy of it). What Wgrad needs of x
  # is named, so a remat policy (save_only_these_names) can keep just this;
  # named here, where jax.ad_checkpoint.print_saved_residuals sees it.
  x_saved = jax.tree.map(lambda t: checkpoint_name(t, WGRAD_INPUT_NAME),
                         x0 if _as_given(x_saved) else x_saved)
  w_saved = w0 if _as_given(w_saved) else w_saved
  return (y, new_state), (x_saved, w_saved, *res)


@jax.custom_jvp
def _first_order_only(leaves):
  """``leaves`` unchanged; differentiating them is an error. The rules of a
  quantized GEMM are not derivatives to differentiate again: their quantize
  casts round tangents to FP8 and give FP4/FP6 codes none at all, so second
  derivatives through them (``jax.hessian``, grad of grad, Hessian-vector
  products) came out silently wrong (zero for MXFP4 and NVFP4). An input of
  the forward or backward rule with a tangent means an outer derivative
  reaches them."""
  return leaves


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
  del primals, tangents
  raise TypeError(
      "A quantized GEMM has no second derivative: its backward pass "
      "quantizes, and differentiating that again (jax.hessian, grad of "
      "grad, Hessian-vector products, gradient penalties) would give wrong "
      "numbers. Take second-order terms of a wide copy of the model "
      "(qlayers.dequantize_model(model, inplace=False)) or under recipe "
      "'bf16'.")


def _guarded(tree):
  """``tree`` with its float leaves through `_first_order_only`."""
  leaves, treedef = jax.tree.flatten(tree)
  at = [i for i, x in enumerate(leaves)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
  for i, x in zip(at, _first_order_only([leaves[i] for i in at])):
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def _qmm_bwd(plan: Plan, dtypes, res, cts):
  g, out_ct = cts
  if plan.recipe.quantized and not isinstance(g, SymbolicZero):
    g, res = _guarded((g, res))
  # The later uses' gradient amax: the cotangent of the g amax passed on.
  later = out_ct["g"].amax if plan.recipe.delayed else None
  later = None if isinstance(later, SymbolicZero) else later
  if isinstance(g, SymbolicZero):  # the output is not used
    return None, None, None, _g_amax_ct(later), None
  dx, dw, run_g = _backward(plan, dtypes, res, g)
  # Only the gradient role's running amax leaves the backward pass (the
  # forward roles left through the output), max-combined with the later
  # uses' (a chain of uses: JAX never adds two of them).
  state_ct = None if run_g is None else _g_amax_ct(
      run_g if later is None else jnp.maximum(later, run_g))
  return dx, dw, None, state_ct, None


def _qmm_backward(plan: Plan, dtypes, res, g):
  """Dgrad and Wgrad of a used output: ``(dx, dw, run_g)``, ``run_g`` this
  use's gradient amax (None for stateless recipes)."""
  x_dtype, w_dtype, (x_vma, w_vma), x_shape, gather = dtypes
  x_saved, w_saved, w_stored, ax, aw, g_state, key = res
  recipe, dgrad, wgrad = plan.recipe, plan.dgrad, plan.wgrad
  _, _, _, kd, kwg = _keys(key)
  ag = run_g = delayed_g = None
  if recipe.delayed:
    ag, run_g = delayed_amax(g, g_state, recipe)
    delayed_g = (g_state, recipe.amax_compute_algo, run_g)
  # Dgrad: dx = g @ w.T, contracted over N (both Hadamard-transformed along
  # N first if the recipe says so: (g Q.T) @ (w Q.T).T = g @ w.T).
  # g's copies for Dgrad and Wgrad (one if shared), in one pass where it can.
  qg, qg_w, *run = operand_pair(g, dgrad.lhs,
                                None if plan.share_g else wgrad.rhs,
                                amax=ag, delayed=delayed_g,
                                keys=(kd, kwg), dtype=recipe.dtype,
                                dequantized=plan.dequantized["g"])
  if recipe.delayed:
    run_g, = run
  qw = w_saved if isinstance(w_saved, scaling.QTensor) else None
  if (qw is None and w_stored is not None
      and dgrad.rhs.spec == plan.fprop.rhs.spec):
    # Stored MX or NVFP4 codes requantized along N, in one pass on GPUs,
    # in the layout the pair kernel below would write (one spec for both).
    qw = requantized_operand(w_stored, dgrad.rhs)
  if qw is None:
    wide = w_saved if w_stored is None else w_stored.dequantize().T
    spec = dgrad.rhs.spec
    if (w_stored is not None and spec is not None
        and spec.granularity != "row"
        and pairable(wide, dgrad.rhs, plan.fprop.rhs)):
      # A stored weight's Dgrad copy by the pair kernel (its Fprop copy
      # unused), as a Param's is made: on GPUs XLA's quantize of the
      # dequantized kernel along N was slower for MX and FP4 (predicted
      # B200 LoRA step of a 4096 x 4096 -> 14336 layer, MXFP8 498 us
      # against 473); row scaling's kernel reads its input twice, and
      # XLA's was faster (430 us against 512).
      qw, _ = operand_pair(wide, dgrad.rhs, plan.fprop.rhs,
                           dtype=recipe.dtype)
    else:
      qw = operand(wide, dgrad.rhs, amax=aw, dtype=recipe.dtype,
                   gather=gather)
  dx = dispatch.run(dgrad, qg, qw).reshape(x_shape)
  # Wgrad: dw = x.T @ g, contracted over M (both Hadamard-transformed along
  # M first if the recipe says so: (Qx).T @ (Qg) = x.T @ g).
  qx = x_saved if plan.save_x != "wide" else operand(
      x_saved, wgrad.lhs, amax=ax, dtype=recipe.dtype)
  dw = dispatch.run(wgrad, qx, qg_w)
  dx = sharding.sum_over_broadcast(dx, x_vma)
  dw = sharding.sum_over_broadcast(sharding.reduce_scatter(dw, gather), w_vma)
  return dx.astype(x_dtype), dw.astype(w_dtype), run_g


_qmm.defvjp(_qmm_fwd, _qmm_bwd, symbolic_zeros=True)

# The forward and backward bodies, jitted with the plan and ``dtypes``
# static as a trace cache: the GEMMs of every layer of one shape and recipe
# are traced, differentiated and lowered once, then called (XLA inlines
# the calls; 8-block GPT step for H200: trace + lower 3.5 -> 2.3 s, its
# compile time and kernels unchanged, benchmarks/RESULTS.md).
# The custom_vjp stays outside, so each trace still sees which inputs are
# differentiated.
_forward = jax.jit(_qmm_forward, static_argnums=(0, 1))
_backward = jax.jit(_qmm_backward, static_argnums=(0, 1))


def _g_amax_ct(amax):
  """The state cotangent carrying gradient amax ``amax`` (None: zero)."""
  return None if amax is None else {"x": None, "w": None,
                                    "g": ScaleState(None, amax)}


# ----------------------------------------------------------------------------
# Public entry points


def default_out_dtype(recipe: Recipe, x_dtype):
  """The recipe's Fprop out_dtype, else ``x``'s dtype unless it is narrower
  than 16 bits (an FP8 input must not make an FP8 output), else the recipe's
  compute dtype."""
  if recipe.fprop.out_dtype:
    return jnp.dtype(recipe.fprop.out_dtype)
  x_dtype = jnp.dtype(x_dtype)
  return x_dtype if x_dtype.itemsize >= 2 else jnp.dtype(recipe.dtype)


def quantized_matmul(x: jax.Array, w: jax.Array, recipe: Recipe | str,
                     state: dict[str, ScaleState] | None = None, *,
                     key: jax.Array | None = None,
                     out_dtype=None, backend: str | None = None, site=None,
                     w_quantized: scaling.QTensor | None = None):
  """``x @ w`` with every GEMM of forward and backward quantized by ``recipe``.

  A recipe that quantizes nothing (``"bf16"``) runs the same three GEMMs on
  operands cast to its compute dtype, with FP32 accumulation (the FP32
  weight gradient included).

  Args:
    x: activations ``(..., K)``.
    w: weight ``(K, N)``.
    recipe: a `Recipe` or a recipe name.
    state: delayed-scaling state from `init_state` (required for delayed
      recipes, ignored otherwise).
    key: PRNG key for stochastic rounding (derived from the data if omitted).
    out_dtype: output dtype (default: the recipe's Fprop out_dtype, else
      ``x.dtype`` when it has 16 bits or more, else the compute dtype).
    backend: force a GEMM backend (``xla`` or ``ffi``): an input of the
      GEMM's plan (`qlayers.dispatch.plan`).
    site: what `intercept` is told the call comes from (a layer's
      `qlayers.QuantGemm`); None: never intercepted.
    w_quantized: ``w``'s codes as stored, quantized by the recipe's Fprop
      weight spec: a `QTensor` of ``w.T`` ``(N, K)`` along axis 1 (a frozen
      kernel's, `qlayers.FrozenKernel.qtensor`; ``w`` is then its
      dequantized values, a constant). Fprop reads it as it is, instead of
      quantizing ``w``, and the backward pass makes Dgrad's copy from it
      where that copy is not Fprop's; where the plan's Fprop weight takes
      another layout (a Hadamard transform, say) ``w`` is quantized as
      usual. Ignored for an FSDP shard and when intercepted.

  Returns:
    ``(y, new_state)``: ``y`` of shape ``(..., N)``; ``new_state`` has the
    forward roles' running amax updated (``None`` for stateless recipes).
    Under differentiation the cotangent of ``state["g"].amax`` is the
    gradient role's running amax, max-combined with the cotangent of
    ``new_state["g"].amax`` (the uses that read ``new_state``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> x, w = jnp.ones((4, 64)), jnp.ones((64, 32))
    >>> y, _ = quantized_matmul(x, w, "mxfp8")
    >>> y.shape
    (4, 32)
  """
  recipe = load_recipe(recipe)
  if x.ndim < 1 or w.ndim != 2:
    raise ValueError(f"quantized_matmul expects x (..., K) and w (K, N); got "
                     f"{x.shape} and {w.shape}.")
  gather, w_shape = sharding.weight_shards(w)
  if x.shape[-1] != w_shape[0]:
    raise ValueError(f"Contraction mismatch: x has K={x.shape[-1]}, w has "
                     f"K={w_shape[0]}.")
  for name, t in (("x", x), ("w", w)):
    if not jnp.issubdtype(t.dtype, jnp.floating):
      raise TypeError(f"{name} must be floating point, got {t.dtype}.")
  if w_quantized is not None and not (
      isinstance(w_quantized, scaling.QTensor)
      and w_quantized.shape == tuple(w_shape[::-1])
      and w_quantized.axis == 1 and not w_quantized.transposed):
    raise ValueError(
        f"w_quantized must be a QTensor of w.T {tuple(w_shape[::-1])} "
        f"quantized along axis 1; got {_described(w_quantized)}.")
  if gather or not recipe.quantized:
    w_quantized = None
  out_dtype = jnp.dtype(out_dtype or default_out_dtype(recipe, x.dtype))
  if recipe.delayed:
    if state is None:
      raise ValueError(f"Recipe {recipe.name!r} uses delayed scaling and "
                       "needs `state` (see init_state).")
    _check_state(state, recipe)
  else:
    state = None
  dispatch.check_backend(backend)  # before the empty-batch shortcut
  lead, n = x.shape[:-1], w.shape[1]
  if math.prod(lead) == 0 or n == 0 or w.shape[0] == 0:
    # Nothing to multiply (an empty batch): no amax to take, state unchanged.
    return jnp.zeros((*lead, n), out_dtype), state
  tap = interceptor(site)
  if tap is not None:
    return tap(site, x, w, recipe, state, key=key, out_dtype=out_dtype,
               backend=backend)
  dtypes = (x.dtype, w.dtype,
            (sharding.varying_axes(x), sharding.varying_axes(w)), x.shape,
            gather)
  plan = dispatch.plan(recipe, x.shape, x.dtype, w_shape, out_dtype,
                       backend=backend)

  if not sharding.explicit_axes():
    return _qmm(plan, dtypes, x, w, w_quantized, state, key)
  y_spec = sharding.dot_spec(sharding.spec_of(x)[:-1], sharding.spec_of(w)[1:])
  run = sharding.auto_region(
      lambda x, w, stored, state, key: _qmm(plan, dtypes, x, w, stored,
                                            state, key),
      (y_spec, replicated_specs(state)))
  return run(x, w, w_quantized, state, key)


# The function `intercept` routes quantized matmuls with a ``site`` to.
_INTERCEPT: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "qlayers_ops_intercept", default=None)


@contextlib.contextmanager
def intercept(fn: Callable) -> Iterator[None]:
  """Inside the block, every `quantized_matmul` called with a ``site`` (the
  `qlayers.QuantGemm` of a layer passes itself) runs
  ``fn(site, x, w, recipe, state, *, key, out_dtype, backend)`` instead; a
  call without ``site`` (as ``fn`` makes to run the GEMM) is not routed.
  An MoE's grouped GEMM (`qlayers.ragged.quantized_ragged_dot` with a
  ``site``, as `QuantRaggedDot` calls it) has ``w [G, K, N]`` and the
  keywords ``group_sizes``, ``capacity``.
  `qlayers.inspect` measures a model's GEMMs this way; outside the block
  nothing changes. Blocks do not nest.

  Example:
    >>> import jax.numpy as jnp, qlayers
    >>> from flax import nnx
    >>> seen = []
    >>> def fn(site, x, w, recipe, state, **kw):
    ...   seen.append(recipe.name)
    ...   return quantized_matmul(x, w, recipe, state, **kw)
    >>> layer = qlayers.QuantDense(64, 8, recipe="mxfp8", rngs=nnx.Rngs(0))
    >>> with intercept(fn):
    ...   _ = layer(jnp.ones((2, 64)))
    >>> seen
    ['mxfp8']
  """
  if _INTERCEPT.get() is not None:
    raise RuntimeError("qlayers.ops.intercept is already active; its blocks "
                       "do not nest.")
  token = _INTERCEPT.set(fn)
  try:
    yield
  finally:
    _INTERCEPT.reset(token)


def intercepting() -> bool:
  """Whether an `intercept` block is active (they do not nest)."""
  return _INTERCEPT.get() is not None


def interceptor(site) -> Callable | None:
  """The function `intercept` routes a call from ``site`` to: None outside
  its block, or for a call without a site."""
  return None if site is None else _INTERCEPT.get()


def _described(q) -> str:
  if not isinstance(q, scaling.QTensor):
    return type(q).__name__
  return (f"a QTensor of shape {q.shape} along axis {q.axis}"
          + (" (transposed)" if q.transposed else ""))


def replicated_specs(state):
  """Explicit specs of new quantization state: replicated."""
  return jax.tree.map(lambda v: P(*(None,) * v.ndim), state)


def _check_state(state, recipe: Recipe):
  if not isinstance(state, dict) or set(state) != set(ROLES):
    raise ValueError("Delayed-scaling state must be a dict with keys "
                     "'x', 'w', 'g' (see init_state).")
  for role, st in state.items():
    hist = st.amax_history
    if hist.shape != (recipe.amax_history_len,):
      raise ValueError(
          f"State {role!r} has an amax history of shape {hist.shape} but "
          f"recipe {recipe.name!r} keeps {recipe.amax_history_len}.")
    if st.amax.shape != ():
      raise ValueError(f"State {role!r} amax must be a scalar, got shape "
                       f"{st.amax.shape}.")
