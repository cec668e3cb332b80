"""NVFP4's step-keyed stochastic rounding does not depend on the layout: the
quantized Wgrad gradient operand has the same bits on one device and sharded
over 8 (tests/_support/nvfp4_cases.py)."""

import pytest

from _support import multidevice


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return multidevice.run_once("_support/nvfp4_cases.py", tmp_path_factory)


def test_sr_operand_is_the_same_bits_in_every_layout(results):
  r = multidevice.result(results, "sr_operand_layouts")
  for layout in ("rows", "both"):
    assert r[layout]["scale"] == r["single"]["scale"], layout
    assert r[layout]["payload"] == r["single"]["payload"], layout


def test_the_data_derived_key_is_not_layout_independent(results):
  # Why nvfp4 keys by the step: the older key, from the FP32 sum of the
  # operand, sums in another order when sharded and draws other bits.
  r = multidevice.result(results, "sr_operand_layouts")
  assert r["rows_data"]["payload"] != r["single_data"]["payload"]


def test_shard_map_scales_under_the_whole_tensors_amax(results):
  r = multidevice.result(results, "shard_map_operand")
  assert r["shard_map"] == r["single"]


def test_shard_map_devices_draw_their_own_bits(results):
  r = multidevice.result(results, "shard_map_step_keys")
  assert not any(r["split_alike"]), r  # each device its own bits
  assert all(r["replicated_alike"]), r  # one replicated tensor, one rounding
