"""Sharded training on auto-axes meshes, inside shard_map, and with the ffi
backend, on 8 simulated CPU devices (one subprocess runs every case of
sharding_auto_cases.py; the assertions are here).

Tolerances: a sharded step sums the same products in a different order
(all-reduces of partial sums, blocked dots of other sizes), so losses agree
to FP32 rounding (rtol 1e-5 over three steps), while amaxes (a max is exact)
and quantized bits agree exactly.
"""

import numpy as np
import pytest

from qlayers import sharding

from _support import multidevice
from _support import sharded_training as st

LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return multidevice.run_once("_support/sharding_auto_cases.py",
                              tmp_path_factory)


def _gathers(run) -> dict:
  return run["collectives"].get("all-gather", {})


def _close(a, b, rtol=LOSS_RTOL):
  np.testing.assert_allclose(a, b, rtol=rtol)


@pytest.mark.parametrize("layout", ["dp", "fsdp", "tp", "fsdp_tp"])
def test_fp8_delayed_trains_like_one_device(results, layout):
  r = multidevice.result(results, "train_fp8_delayed")
  single, got = r["single"], r[layout]
  _close(got["losses"], single["losses"])
  assert got["losses"][0] == pytest.approx(single["losses"][0], rel=1e-6)
  # The state records global amaxes: the first step's entries are the amaxes
  # of the same tensors, exactly; later ones follow weights that moved by
  # differently rounded updates.
  for path, hist in single["state"].items():
    if path.endswith("_history"):
      first = max(i for i, a in enumerate(hist) if a)  # the first step's
      assert got["state"][path][first] == hist[first], path
      np.testing.assert_allclose(got["state"][path], hist, rtol=1e-5,
                                 err_msg=path)


def test_state_is_replicated(results):
  r = multidevice.result(results, "train_fp8_delayed")
  specs = r["fsdp_tp"]["specs"]
  assert specs["up/kernel"] == "P('fsdp', 'model')"
  state = {k: v for k, v in specs.items() if "/quant/" in k}
  assert state and set(state.values()) <= {"P()",
                                           "P(None,)"}, state


@pytest.mark.parametrize("layout", ["dp", "tp"])
def test_no_gathers_without_fsdp(results, layout):
  r = multidevice.result(results, "train_fp8_delayed")
  assert not _gathers(r[layout]), r[layout]["collectives"]


@pytest.mark.parametrize("recipe", ["fp8_delayed", "mxfp8"])
@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_fsdp_gathers_one_byte_payloads(results, recipe, layout):
  got = multidevice.result(results, f"train_{recipe}")[layout]
  _close(got["losses"],
         multidevice.result(results, f"train_{recipe}")["single"]["losses"])
  gathers = _gathers(got)
  assert set(gathers) == {"u8"}, got["collectives"]


def test_mxfp4_fsdp_gathers_packed_payloads(results):
  got = multidevice.result(results, "train_mxfp4")
  # Stochastic rounding of the gradients draws from a key derived from the
  # gradient's sum, whose FP32 rounding depends on the reduction order: the
  # sharded run draws other (equally distributed) bits.
  _close(got["fsdp"]["losses"], got["single"]["losses"], rtol=1e-2)
  assert set(_gathers(got["fsdp"])) == {"u8"}, got["fsdp"]["collectives"]


@pytest.mark.parametrize("recipe", ["fp8_delayed", "mxfp8"])
def test_fsdp_gathers_at_most_0_6_of_bf16(results, recipe):
  bf16 = multidevice.result(results, "train_bf16")
  _close(bf16["fsdp"]["losses"], bf16["single"]["losses"])
  wide = sum(_gathers(bf16["fsdp"]).values())
  fp8 = sum(_gathers(multidevice.result(results, f"train_{recipe}")["fsdp"])
            .values())
  assert wide > 0 and fp8 <= 0.6 * wide, (fp8, wide)


def test_gather_switch_restores_wide_gathers(results):
  off = multidevice.result(results, "gather_switch_off")["fsdp"]
  on = multidevice.result(results, "train_fp8_delayed")
  _close(off["losses"], on["single"]["losses"])
  assert set(_gathers(off)) - {"u8"}, off["collectives"]


def test_gather_switch_is_a_context_manager(monkeypatch):
  monkeypatch.setenv("QLAYERS_QUANTIZED_GATHER", "0")  # no longer read
  assert sharding.quantized_gather()
  with sharding.gather_payloads(False):
    assert not sharding.quantized_gather()
    with sharding.gather_payloads(True):
      assert sharding.quantized_gather()
    assert not sharding.quantized_gather()
  assert sharding.quantized_gather()
  with pytest.raises(TypeError, match="takes a bool, got '0'"):
    with sharding.gather_payloads("0"):
      pass


# Bytes of each MLP kernel's FSDP-gathered block per device, at one byte per
# element: the whole (D, H) kernel over fsdp=8; a (D, H/4) block over
# fsdp=2 x model=4.
KERNEL_GATHER = {"fsdp": st.D * st.H, "fsdp_tp": st.D * st.H // 4}


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_fsdp_gathers_a_shared_fp8_weight_once(results, layout):
  """Per-tensor FP8: Fprop and Dgrad read one copy of the weight, wired
  once (`partition.wire`), so each kernel's payload is gathered once, not
  once per GEMM."""
  got = multidevice.result(results, "train_fp8_delayed")[layout]
  assert _gathers(got) == {"u8": 2 * KERNEL_GATHER[layout]}, got


def test_ffi_has_the_xla_collectives(results):
  r = multidevice.result(results, "ffi")
  xla = multidevice.result(results, "train_fp8_delayed")
  for layout in ("tp", "fsdp_tp"):
    got = r["fp8_delayed"][layout]
    _close(got["losses"], xla["single"]["losses"])
    if layout == "tp":
      assert _gathers(got) == _gathers(xla[layout]) == {}
    else:
      # The native kernel takes per-tensor operands contraction-last, so
      # Dgrad quantizes its own copy of each weight instead of sharing
      # Fprop's (plan.share_w is False): one of the two kernels is gathered
      # a second time, 1.5x what xla gathers.
      assert _gathers(got) == {"u8": 3 * KERNEL_GATHER[layout]}, got
    a = sum(got["collectives"].get("all-reduce", {}).values())
    b = sum(xla[layout]["collectives"].get("all-reduce", {}).values())
    assert a == pytest.approx(b, rel=0.01), layout
  # Data parallel: each device multiplies its own rows; nothing is gathered
  # (an unpartitioned native GEMM would gather the activations).
  dp = r["mxfp8"]["dp"]
  _close(dp["losses"],
         multidevice.result(results, "train_mxfp8")["single"]["losses"])
  assert not _gathers(dp), dp["collectives"]
  assert dp["collectives"] == r["mxfp8_xla_dp"]["collectives"]


@pytest.mark.parametrize("key", [
    f"{g}/axis{a}" for g in ("tensor", "row", "tile", "block", "mx")
    for a in (0, 1)] + ["mxfp4/axis1"])
def test_scales_are_global_bit_for_bit(results, key):
  r = multidevice.result(results, "scales_global")
  assert r[key] == {"fsdp": True, "model": True, "both": True}


def test_uneven_shards_are_gathered(results):
  """The outputs bit for bit, the gradients up to summation order."""
  for recipe, r in multidevice.result(results, "uneven_shards").items():
    assert r["y"] and r["grads"] < 1e-6, (recipe, r)


def test_delayed_amax_is_global(results):
  r = multidevice.result(results, "scales_global")["delayed_amax"]
  assert r["sharded"] == r["single"] == r["true"]


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_current", "mxfp8",
                                    "bf16"])
def test_shard_map(results, recipe):
  r = multidevice.result(results, "shard_map_ops")[recipe]
  assert r["loss"][1] == pytest.approx(r["loss"][0], rel=1e-6)
  assert r["dx"] < 1e-5 and r["dw"] < 1e-5
  if "amax" in r:
    for single, sharded in r["amax"]:
      assert sharded == single
    assert r["g_amax"][1] == pytest.approx(r["g_amax"][0], rel=1e-6)


def test_fsdp_kernel_shard_in_a_quantdense(results):
  r = multidevice.result(results, "fsdp_layer_in_shard_map")
  assert r["loss"][1] == pytest.approx(r["loss"][0], rel=1e-6)
  assert r["dkernel"] < 1e-5


def test_layer_inside_shard_map(results):
  r = multidevice.result(results, "shard_map_layer")
  assert r["loss"][1] == pytest.approx(r["loss"][0], rel=1e-6)
  assert r["dkernel"] < 1e-5
  # Each device saw 1/8 of the batch; the amaxes are the whole batch's.
  assert r["x_amax"][1] == r["x_amax"][0]
  assert r["w_amax"][1] == r["w_amax"][0]
  assert r["g_amax"][1] == pytest.approx(r["g_amax"][0], rel=1e-6)


def test_every_layer_under_tensor_parallelism(results):
  r = multidevice.result(results, "layers_tp")["mxfp8"]
  _close(r["tp"], r["single"], rtol=1e-4)


def test_the_cast_kernel_trains_under_a_mesh_as_xla_does(results):
  """Under `jax.set_mesh` the per-tensor pairs for Hopper (one copy for
  Blackwell), the row-wise ones and DeepSeek-V3's tiles and blocks, and
  the MX, MXFP4 and NVFP4 pairs for Blackwell are the one-pass kernels'
  (`qlayers.partition.cast`;
  interpreted here): each device casts its shard (32-row shards padded to a
  64-row tile, or whole blocks; the 4-bit stochastic rounding drawn at each
  element's place in the whole tensor), with the collectives of XLA's pairs
  and their training (delayed scaling's histories rolled by its kernel:
  `qlayers.history_roll`): nvfp4, mxfp4_rht, fp8_rowwise and deepseek_v3
  matmuls' gradients are the same bits; the MLP's first step's
  loss and amaxes too, later steps may differ by a rounding where a GEMM's
  partial sums meet in another order. Blackwell's per-tensor kernel (one
  layout) runs too; Hopper's MX pairs (BF16 values) stay XLA's."""
  r = multidevice.result(results, "cast_kernel_under_mesh")
  assert r["without"] == {"mxfp8/sm_90": 0}, r
  # Delayed scaling's end of step is the roll kernel under the mesh too
  # (each GEMM's histories replicated), with the same state below.
  for name in ("fp8_delayed/fsdp_tp/sm_90", "fp8_delayed/dp/sm_100"):
    runs = r["runs"][name]
    assert runs["kernel"]["rolls"] > 0 and runs["xla"]["rolls"] == 0, name
  for name, runs in r["runs"].items():
    kernel, xla = runs["kernel"], runs["xla"]
    assert kernel["kernels"] > 0 and xla["kernels"] == 0, name
    assert _gathers(kernel) == _gathers(xla), name
    # The amaxes are all-reduced as their magnitude bits (u32) by the
    # kernel's pair, as FP32 by XLA's: the same bytes.
    assert (sum(kernel["collectives"]["all-reduce"].values())
            == sum(xla["collectives"]["all-reduce"].values())), name
    assert kernel["losses"][0] == xla["losses"][0], name
    _close(kernel["losses"], xla["losses"])
    for a, b in zip(kernel.get("grads", ()), xla.get("grads", ())):
      assert a == b, name  # one step: the same bits
    for path, hist in xla["state"].items():
      if path.endswith("_history"):
        first = max(i for i, a in enumerate(hist) if a)
        assert kernel["state"][path][first] == hist[first], (name, path)
        np.testing.assert_allclose(kernel["state"][path], hist, rtol=1e-5,
                                   err_msg=f"{name} {path}")


def test_a_vmap_under_a_mesh_is_its_items(results):
  """A jax.vmap of a quantized GEMM under a mesh failed: the GEMM's
  partitioning rule has no batching rule (its own vmap rule now maps the
  local GEMM)."""
  assert multidevice.result(results, "vmap_under_mesh") == {
      "fp8_current": True, "mxfp8": True}


def test_a_frozen_kernel_is_read_as_stored_under_a_mesh(results):
  """The GEMM reads a frozen kernel's stored codes, sharded along N, under
  an automatic mesh: the step is one device's."""
  for recipe, r in multidevice.result(results, "frozen_under_mesh").items():
    _close(*r["loss"])
    assert r["grad_rel"] < 1e-5, recipe
