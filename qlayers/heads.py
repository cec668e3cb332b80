"""Output heads: the layers whose GEMM produces the model's output.

`qlayers.quantize` keeps the output head wide by default. Two rules find it;
the conversion report says which one decided (``report.head``):

* **By tracing** (when ``quantize`` is given ``example_input``): the model is
  traced once on the example (``jax.make_jaxpr`` over ``nnx.split`` /
  ``nnx.merge``: shapes only, nothing is computed) and the data flow of the
  jaxpr is followed. A head is a linear layer (or an ``nnx.Embed`` whose
  table is the weight of a GEMM: a tied ``attend`` head) whose output
  reaches an output of the model through no other linear layer, where no
  such layer of that output feeds any linear layer (its own stacked copies
  included). A classifier applied last is the head wherever it is defined;
  two heads are both found; the last projection of a residual encoder, whose
  output also travels the residual stream into the next blocks, is not.
* **By shape** (no ``example_input``): the one linear layer whose N is the
  vocabulary of an ``nnx.Embed`` of the model. When several layers have that
  N, or it is also some layer's K (a feed-forward or fused QKV as wide as the
  vocabulary, a model as wide as its vocabulary), shapes cannot tell the
  head: none is chosen by shape, and the report says so and asks for
  ``example_input``. Without an example other heads (a classifier) are found
  by name only (`qlayers.convert.DEFAULT_KEEP_WIDE`).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from flax import nnx

from qlayers import ops
from qlayers.swap import dims, path_str, weight

# Primitives that pass a weight on unchanged as far as "is this the layer's
# weight" goes (casts, layout, sharding); anything else makes a new value.
_SAME = frozenset({
    "convert_element_type", "reshape", "transpose", "broadcast_in_dim",
    "squeeze", "expand_dims", "copy", "copy_p", "reduce_precision",
    "sharding_constraint", "mesh_cast", "reshard", "device_put", "slice",
    "dynamic_slice"})
_GEMMS = frozenset({"dot_general", "ragged_dot", "ragged_dot_general"})
# Statistics (an amax for a scale, a max for a stable softmax) are not the
# signal: a quantized GEMM's output scaled by its input's amax stays its own.
_STATS = frozenset({"reduce_max", "reduce_min", "argmax", "argmin"})
_NONE = (None, frozenset())


def _join(a, b):
  return (a[0] if a[0] == b[0] else None, a[1] | b[1])


class _Flow:
  """Forward data flow over a jaxpr. Each value carries ``(w, src)``: ``w``
  the layer whose weight it is (or None), ``src`` the layers whose GEMM
  output reaches it through no other layer's GEMM. ``fed`` collects the
  layers whose output reaches some layer's GEMM."""

  def __init__(self):
    self.fed: set[int] = set()

  def run(self, jaxpr, ins):
    env = dict(zip(jaxpr.invars, ins))
    read = lambda v: _NONE if isinstance(v, jcore.Literal) else env.get(
        v, _NONE)
    for eqn in jaxpr.eqns:
      outs = self._eqn(eqn, [read(v) for v in eqn.invars])
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]

  def _loop(self, jaxpr, ins, first, n):
    """Runs a loop body to a fixed point: outputs ``[:n]`` flow back into
    inputs ``[first:first + n]`` (the carry)."""
    for _ in range(8):
      outs = self.run(jaxpr, ins)
      new = list(ins)
      new[first:first + n] = [_join(a, b) for a, b in
                              zip(ins[first:first + n], outs[:n])]
      if new == ins:
        break
      ins = new
    return outs

  def _eqn(self, eqn, vals):
    name, p, n = eqn.primitive.name, eqn.params, len(eqn.outvars)
    if name in _STATS:
      return [_NONE] * n
    src = frozenset().union(*(s for _, s in vals))
    if name in _GEMMS:
      layer = next((w for w, _ in vals[:2] if w is not None), None)
      if layer is None:
        return [(None, src)] * n
      self.fed.update(src)
      return [(None, frozenset({layer}))] * n
    if name == "scan":
      body = getattr(p["jaxpr"], "jaxpr", p["jaxpr"])
      if "num_consts" in p:
        first, n_carry = p["num_consts"], p["num_carry"]
      else:  # jax >= 0.11: the flat inputs as groups (consts, carry, xs)
        consts, carry, _ = p["ft_in"].unpack()
        first, n_carry = len(consts), len(carry)
      return self._loop(body, vals, first, n_carry)
    if name == "while":
      body = vals[p["cond_nconsts"]:]
      return self._loop(p["body_jaxpr"].jaxpr, body, p["body_nconsts"], n)
    if name == "cond":
      outs = [self.run(b.jaxpr, vals[1:]) for b in p["branches"]]
      return [_join_all(o) for o in zip(*outs)]
    for sub in p.values():
      sub = getattr(sub, "jaxpr", sub)
      if (isinstance(sub, jcore.Jaxpr) and len(sub.invars) == len(vals)
          and len(sub.outvars) == n):
        return self.run(sub, vals)  # jit, custom_vjp/jvp, remat, shard_map
    return [(self._weight(eqn, name, vals), src)] * n

  @staticmethod
  def _weight(eqn, name, vals):
    """The layer whose weight ``eqn``'s output still is: through a cast or a
    layout change, or an elementwise op on one weight (scaling, rounding and
    clipping it: how a quantized layer's kernel reaches its GEMM)."""
    if name in _SAME:
      return vals[0][0] if vals else None
    ws = {w for w, _ in vals if w is not None}
    if len(ws) != 1 or len(eqn.outvars) != 1:
      return None
    shape = getattr(eqn.outvars[0].aval, "shape", None)
    for v, (w, _) in zip(eqn.invars, vals):
      if w is not None and getattr(v.aval, "shape", ()) == shape:
        return w
    return None


def _join_all(vals):
  out = vals[0]
  for v in vals[1:]:
    out = _join(out, v)
  return out


def _trace(model, example_input, layers):
  """Per output leaf of ``model(*example)``, the layers feeding it directly,
  and the layers that feed any layer."""
  graphdef, state = nnx.split(model)
  args = example_input if isinstance(example_input, tuple) else (
      example_input,)

  def call(state, args):
    out = nnx.merge(graphdef, state)(*args)
    return [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]

  try:
    # The GEMMs of layers quantized already, as the plain GEMMs they stand
    # for: packing, native kernels and stochastic rounding would hide
    # their weights from the flow (inside another intercept, as they are).
    with (contextlib.nullcontext() if ops.intercepting()
          else ops.intercept(_plain_gemm)):
      closed = jax.make_jaxpr(call)(state, args)
  except Exception as e:  # the user's model: any error, said with context
    shapes = jax.tree.map(lambda x: getattr(x, "shape", x), args)
    raise ValueError(
        f"qlayers.quantize: tracing the model on example_input (shapes "
        f"{shapes}) to find its output head failed: {type(e).__name__}: "
        f"{e}") from e
  owner = {id(leaf): i for i, l in enumerate(layers)
           if (leaf := _weight_leaf(l)) is not None}
  ins = [(owner.get(id(leaf)), frozenset()) for leaf in jax.tree.leaves(state)]
  ins += [_NONE] * (len(closed.jaxpr.invars) - len(ins))
  flow = _Flow()
  outs = flow.run(closed.jaxpr, ins)
  return [src for _, src in outs], flow.fed


def _weight_leaf(layer):
  """The array of ``layer``'s weight the traced model reads (a frozen
  kernel's payload), or None."""
  w = weight(layer)
  if w is None:
    return None
  return (w if isinstance(w, nnx.Variable) else w.payload).get_value()


def _plain_gemm(gemm, x, w, recipe, state, *, out_dtype=None,
                group_sizes=None, **_):
  """A quantized GEMM's plain form (shapes and data flow only)."""
  del gemm, recipe
  y = (jnp.matmul(x, w) if group_sizes is None
       else jax.lax.ragged_dot(x, w, group_sizes))
  return y.astype(out_dtype or y.dtype), state


def _found(rule: str, heads: dict, paths: dict[int, str], hint="") -> str:
  """How the report names the rule and what it found."""
  names = sorted(paths.get(i, "(model)") for i in heads)
  return f"{rule}: " + (", ".join(names) if names else "none found" + hint)


def by_tracing(model, layers: list, paths: dict[int, str],
               example_input) -> tuple[dict, str]:
  """``({id(layer): why}, summary)``: the heads found by tracing."""
  outs, fed = _trace(model, example_input, layers)
  found: set[int] = set()
  for src in outs:
    if src and not src & fed:
      found |= src
  heads = {}
  for i in sorted(found):
    layer = layers[i]
    if isinstance(layer, nnx.Embed):
      heads[id(layer)] = (
          f"tied: the model's output is a projection onto this "
          f"embedding table ({layer.num_embeddings} x {layer.features}), "
          "found by tracing example_input")
    else:
      heads[id(layer)] = ("its output is the model's output "
                          "through no other linear layer, found by tracing "
                          "example_input")
  return heads, _found("by tracing example_input", heads, paths,
                       " (no linear layer's output is the model's output)")


def by_shape(model, layers: list, paths: dict[int, str]) -> tuple[dict, str]:
  """``({id(layer): why}, summary)``: the one linear layer whose N is the
  vocabulary of an ``nnx.Embed`` of ``model``, when shapes single it out."""
  vocab = {}
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Embed):
      vocab.setdefault(node.num_embeddings, node)
  linears = [l for l in layers if not isinstance(l, nnx.Embed)]
  ks = {dims(l)[0] for l in linears}
  rule = "by shape (N is an embedding's vocabulary)"
  hint = "; pass example_input= to decide by tracing"
  heads, undecided = {}, []
  for v, embed in vocab.items():
    found = sorted(paths.get(id(l), "?") for l in linears if dims(l)[1] == v)
    if len(found) > 1 or (found and v in ks):
      also = f" and the K of another" if v in ks else ""
      names = ", ".join(found[:3]) + (f" and {len(found) - 3} more"
                                      if len(found) > 3 else "")
      undecided.append(f"N={v} is the N of {names}{also}")
      continue
    for l in linears:
      if dims(l)[1] == v:
        heads[id(l)] = (f"N={v} is the vocabulary of the embedding ({v} x "
                        f"{embed.features}), found by shape")
  if undecided:
    return heads, (f"{rule}: undecided ({'; '.join(undecided)}: shapes "
                   f"cannot tell which is the head, none is kept wide by "
                   f"shape{hint})")
  return heads, _found(rule, heads, paths, hint)


def output_heads(model, layers: list, paths: dict[int, str],
                 example_input=None) -> tuple[dict, str]:
  """``({id(layer): why}, rule)``: the output heads among ``layers`` of
  ``model`` and which rule found them (see the module docstring).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from qlayers import heads
    >>> class Net(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.score = nnx.Linear(32, 10, rngs=rngs)  # defined first
    ...     self.body = nnx.Linear(16, 32, rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.score(nnx.relu(self.body(x)))
    >>> net = Net(nnx.Rngs(0))
    >>> paths = {id(net.score): "score", id(net.body): "body"}
    >>> found, rule = heads.output_heads(
    ...     net, [net.score, net.body], paths, jnp.ones((2, 16)))
    >>> [id(net.score)] == list(found), rule
    (True, 'by tracing example_input: score')
  """
  if example_input is not None:
    return by_tracing(model, layers, paths, example_input)
  return by_shape(model, layers, paths)
