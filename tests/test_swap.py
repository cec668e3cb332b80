"""Walking and swapping layers with public Flax functions: every reference
to a layer found, replaced in modules, lists, dicts, nnx.List and nnx.Dict,
the drop-in holding the very same Variables."""

import inspect

from flax import nnx

from qlayers import convert, heads, recipe, swap


def test_sites_find_every_reference_and_replace_swaps_them_all():
  rngs = nnx.Rngs(0)
  lin = nnx.Linear(4, 4, rngs=rngs)

  class Net(nnx.Module):
    def __init__(self):
      self.a = lin
      self.nlist = nnx.List([lin])
      self.ndict = nnx.Dict(b=lin)
      self.plain = nnx.data({"c": [lin]})
      self.tup = nnx.data((nnx.Linear(4, 4, rngs=rngs),))

  net = Net()
  shared, held = swap.sites(net, lambda m: isinstance(m, nnx.Linear))
  assert sorted(p for _, _, p in shared.refs) == [
      "a", "ndict/b", "nlist/0", "plain/c/0"]
  assert swap.immutable_ref(shared) is None
  assert "immutable tuple" in swap.immutable_ref(held)
  new = swap.quantized(lin, recipe("fp8_current"), None)
  swap.replace(shared, new)
  assert net.a is new and net.nlist[0] is new and net.ndict["b"] is new
  assert net.plain["c"][0] is new
  assert new.kernel is lin.kernel and new.bias is lin.bias


def test_adopt_keeps_variables_and_a_missing_bias_stays_data():
  layer = nnx.Linear(4, 8, use_bias=False, rngs=nnx.Rngs(0))
  new = swap.quantized(layer, recipe("fp8_current"), None)
  assert new.kernel is layer.kernel and new.bias is None
  back = swap.stock(new)
  assert type(back) is nnx.Linear and back.kernel is layer.kernel
  assert not hasattr(back, "quant")
  # The same graph structure as the original: state and graphdef agree.
  assert nnx.graphdef(back) == nnx.graphdef(layer)


def test_no_flax_internals():
  for module in (convert, swap, heads):
    source = inspect.getsource(module)
    for name in ("graphlib", "get_node_impl", "set_key", "_pytree__",
                 "node_dict"):
      assert name not in source, (module.__name__, name)
