"""qlayers.expert_parallel: dispatch/combine on one device, and on 8
simulated devices (tests/_support/expert_parallel_cases.py) against one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _support import multidevice
from qlayers import expert_parallel as ep


def _routed(n=6, d=4, k=2, g=3):
  x = jnp.arange(n * d, dtype=jnp.float32).reshape(n, d)
  ids = jnp.array([[2, 0], [1, 2], [0, 1], [2, 1], [0, 2], [1, 0]][:n],
                  jnp.int32)
  return x, ids


def test_dispatch_sorts_copies_by_expert_and_combine_restores_tokens():
  x, ids = _routed()
  xs, sizes, route = ep.dispatch(x, ids, n_experts=3)
  assert sizes.tolist() == [4, 4, 4]
  want = np.concatenate([np.asarray(x)[np.nonzero(np.asarray(ids) == e)[0]]
                         for e in range(3)])
  np.testing.assert_array_equal(xs, want)
  # Expert e multiplies by e + 1; gates 0.25/0.75.
  ys = xs * jnp.repeat(jnp.arange(1.0, 4.0), sizes, total_repeat_length=12
                       )[:, None]
  gates = jnp.tile(jnp.array([[0.25, 0.75]]), (6, 1))
  y = ep.combine(ys, route, gates)
  scale = (np.asarray(ids) + 1.0) @ np.array([0.25, 0.75])
  np.testing.assert_array_equal(y, np.asarray(x) * scale[:, None])


def test_transport_spec_by_recipe_and_role():
  assert ep.transport_spec("fp8_current").granularity == "row"
  assert ep.transport_spec("fp8_current", "g").format == "e5m2"
  assert ep.transport_spec("deepseek_v3").granularity == "tile"
  assert ep.transport_spec("mxfp8", "g").block_size == 32
  assert ep.transport_spec("bf16") is None
  with pytest.raises(ValueError, match="role"):
    ep.transport_spec("mxfp8", "w")


def test_errors_name_the_shapes():
  x, ids = _routed()
  with pytest.raises(ValueError, match=r"\(6, 4\) and \(6,\)"):
    ep.dispatch(x, ids[:, 0], n_experts=3)
  _, _, route = ep.dispatch(x, ids, n_experts=3)
  with pytest.raises(ValueError, match="axis_name"):
    ep.combine(x, route, jnp.ones((6, 2)), axis_name="expert")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
  return multidevice.run_once("_support/expert_parallel_cases.py",
                              tmp_path_factory)


def test_eight_devices_match_one(cases):
  r = multidevice.result(cases, "matches_single_device")
  one, eight, explicit = r["loss"]  # explicit axes, unsharded inputs
  assert abs(one - eight) <= 1e-5 * abs(one)
  assert abs(one - explicit) <= 1e-5 * abs(one)
  assert r["dw"] <= 1e-6 and r["dx"] <= 1e-6


def test_explicit_axes_take_prefix_specs_and_mixed_meshes(cases):
  one, prefix, mixed = multidevice.result(
      cases, "explicit_axes_take_prefix_specs_and_mixed_meshes")
  assert abs(prefix - one) <= 1e-5 * abs(one), (one, prefix)
  assert abs(mixed - one) <= 1e-5 * abs(one), (one, mixed)


def test_fsdp_experts_gather_quantized_kernel_shards(cases):
  """Experts over ``expert`` (4 devices), each kernel also over ``fsdp`` (2)
  along K: the step equals one device's, each GEMM gathers its kernel
  shard as 1-byte payloads + scales (never wide) and the weight gradient
  is reduce-scattered back to the shard."""
  r = multidevice.result(cases, "fsdp_gathers_quantized_kernels")
  local = 2 * 128 * 32  # a device's 2 experts' whole kernels [2, 128, 32]
  gathered = {"fp8_current": local,  # one per-tensor copy: Fprop and Dgrad
              "mxfp8": 2 * local + 2 * local // 32}  # along K and along N
  for name, nbytes in gathered.items():
    one, two = r[name]["loss"]
    assert abs(one - two) <= 1e-5 * abs(one), name
    assert r[name]["dw"] <= 1e-6 and r[name]["dx"] <= 1e-6, name
    assert r[name]["dw_shape"] == [8, 128, 32], name
    assert r[name]["all_gather"] == {"u8": nbytes}, name  # BF16: 2 * local
    assert r[name]["reduce_scatter"] == {"f32": 4 * local // 2}, name
  # 128x128 blocks do not fit a 64-row shard: the shard is gathered wide
  # (FP32 here) and quantized whole, as on one device. Its Wgrad tiles
  # along tokens hold one fsdp row's tokens, so only loss and dx match.
  ds = r["deepseek_v3"]
  assert ds["all_gather"] == {"f32": 4 * local}
  assert abs(ds["loss"][0] - ds["loss"][1]) <= 1e-5 * abs(ds["loss"][0])
  assert ds["dx"] <= 1e-6
  assert "splits dim 2 over 'fsdp'" in r["along_n"]
  assert r["quant_experts"] <= 1e-6  # the layer on a kernel shard
  # The same mesh without fsdp= (the experts' group ids are counted, not
  # jnp.searchsorted'ed: that fails beside an automatic mesh axis).
  auto = r["auto_axis"]
  assert abs(auto["loss"][0] - auto["loss"][1]) <= 1e-5 * abs(auto["loss"][0])
  assert auto["dw"] <= 1e-6 and auto["dx"] <= 1e-6


def test_capacity_drops_only_past_the_fullest_pair(cases):
  r = multidevice.result(cases, "capacity_drops_copies")
  no_drop, one_short = r["changed"]
  assert no_drop == 0 and one_short >= 1


def test_ids_out_of_range_are_dropped_on_one_device_and_eight(cases):
  r = multidevice.result(cases, "ids_out_of_range_are_dropped")
  assert r["one"] <= 1e-6 and r["eight"] <= 1e-6


def test_combine_refuses_gates_of_another_k():
  x, ids = _routed()
  xs, _, route = ep.dispatch(x, ids, n_experts=3)
  with pytest.raises(ValueError, match=r"gates \(6, 3\).*12 token copies"):
    ep.combine(xs, route, jnp.ones((6, 3)))


def test_quantized_dispatch_bytes_and_values(cases):
  r = multidevice.result(cases, "quantized_transport")
  bf16 = r["bf16"]
  for name in ("fp8_current", "mxfp8"):
    assert r[name]["finite"]
    # Rows arrive as one device quantizes and dequantizes them.
    assert r[name]["vs_one_device"] <= 1e-5
    # 1-byte payloads + scales: about half the BF16 dispatch.
    assert r[name]["dispatch_bytes"] <= 0.55 * bf16["dispatch_bytes"]
  assert r["mxfp8"]["by_dtype"]["u8"] == 16384 + 512 + 4096 + 128
  assert r["fp8_current"]["step_bytes"] <= 0.77 * bf16["step_bytes"]


def test_local_scales_keep_each_devices_amax(cases):
  r = multidevice.result(cases, "local_scales_keep_amax_per_device")
  assert r["global"] == [7.0] * 8
  assert r["local"] == [float(i) for i in range(8)]


def test_moe_gpt_expert_parallel_step_matches_one_device(cases):
  """The example MoE GPT, one step on 8 devices (experts over ``expert``=4,
  their kernels also over ``fsdp``=2 along K, gathered before the GEMMs)
  against one: loss, every gradient (the per-expert gradient amaxes of
  fp8_delayed included: their backward runs under local_scales too) and
  the amax histories of inputs and weights (the experts' per expert: a
  kernel shard is quantized with its whole kernel's amax)."""
  r = multidevice.result(cases, "moe_gpt_matches_single_device")
  for name in ("bf16", "fp8_delayed"):
    one, eight = r[name]["loss"]
    assert abs(one - eight) <= 1e-5 * abs(one), name
    # BF16 reduction order, which moves with XLA (0.0101 on jax 0.11.2);
    # a gradient summed wrongly across devices is off by O(1).
    assert r[name]["grad_rel"] <= 0.02, name
  # x and w of qkv, out, up, down
  assert r["fp8_delayed"]["histories"] == {"x": 4, "w": 4}
  assert r["fp8_delayed"]["hist_rel"] == {"x": 0.0, "w": 0.0}


def test_dropped_copies_are_zero_rows_and_come_back_as_zero_on_one_device():
  # Rows past the groups held token copies: an expert with a bias gave a
  # -1 copy gate * bias on one device (0 on several).
  x, ids = _routed()
  ids = ids.at[0, 1].set(-1)
  xs, sizes, route = ep.dispatch(x, ids, n_experts=3)
  assert int(sizes.sum()) == 11
  np.testing.assert_array_equal(xs[11:], 0)
  gates = jnp.full((6, 2), 0.5)
  y = ep.combine(xs + 1.0, route, gates)  # an expert adding a bias
  np.testing.assert_array_equal(y[0], 0.5 * (x[0] + 1.0))  # one copy kept


def test_capacity_applies_on_one_device_too():
  # One device sends to itself: capacity was ignored there, so the same
  # code dropped copies on a mesh and none on one device.
  x, ids = _routed()  # experts 0, 1, 2 get 4 copies each
  xs, sizes, route = ep.dispatch(x, ids, n_experts=3, capacity=6)
  assert sizes.tolist() == [4, 2, 0]  # the first six copies, expert order
  np.testing.assert_array_equal(xs[6:], 0)
  y = ep.combine(xs, route, jnp.ones((6, 2)))
  kept = {0: 4, 1: 2}
  want = np.zeros((6, 4), np.float32)
  for token, row in enumerate(np.asarray(ids)):
    for e in row:
      if kept.get(int(e), 0):
        kept[int(e)] -= 1
        want[token] += np.asarray(x[token])
  np.testing.assert_array_equal(y, want)
  with pytest.raises(ValueError, match="capacity must be >= 1"):
    ep.dispatch(x, ids, n_experts=3, capacity=0)
