"""Sharded training on explicit-axes meshes (the Flax NNX sharding guide's
mode), on 8 simulated CPU devices: one subprocess runs every case of
sharding_explicit_cases.py. Tolerances as in test_sharding_auto.py."""

import numpy as np
import pytest

from _support import multidevice

LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return multidevice.run_once("_support/sharding_explicit_cases.py",
                              tmp_path_factory)


def _close(a, b, rtol=LOSS_RTOL):
  np.testing.assert_allclose(a, b, rtol=rtol)


# No dp: see EXPLICIT_LAYOUTS in sharding_explicit_cases.py.
@pytest.mark.parametrize("layout", ["fsdp", "tp", "fsdp_tp"])
def test_fp8_delayed_trains_like_one_device(results, layout):
  r = multidevice.result(results, "train_fp8_delayed")
  _close(r[layout]["losses"], r["single"]["losses"])
  for path, hist in r["single"]["state"].items():
    np.testing.assert_allclose(r[layout]["state"][path], hist, rtol=1e-5,
                               err_msg=path)


@pytest.mark.parametrize("layout", ["fsdp", "tp", "fsdp_tp"])
def test_qlayers_optimizer_builds_and_steps(results, layout):
  r = multidevice.result(results, "train_fp8_delayed")[layout]
  assert r["optimizer"] == "Optimizer"
  assert r["losses"][-1] < r["losses"][0], r["losses"]


def test_params_keep_their_shardings(results):
  specs = multidevice.result(results, "train_fp8_delayed")["fsdp_tp"]["specs"]
  assert specs["up/kernel"] == "P('fsdp', 'model')"
  assert specs["down/kernel"] == "P('model', 'fsdp')"
  assert specs["up/bias"] == "P('model',)"
  state = {k: v for k, v in specs.items() if "/quant/" in k}
  assert state and set(state.values()) <= {"P()",
                                           "P(None,)"}, state


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_fsdp_gathers_one_byte_payloads(results, layout):
  got = multidevice.result(results, "train_fp8_delayed")[layout]
  gathers = got["collectives"].get("all-gather", {})
  assert gathers.get("u8", 0) > 0, got["collectives"]
  # TP's bias gradient of a bias without a spec may gather a few floats.
  wide = sum(v for k, v in gathers.items() if k != "u8")
  assert wide <= 0.05 * gathers["u8"], got["collectives"]
  bf16 = multidevice.result(results, "train_bf16")
  _close(bf16["fsdp"]["losses"], bf16["single"]["losses"])
  if layout == "fsdp":
    wide = sum(bf16["fsdp"]["collectives"].get("all-gather", {}).values())
    assert gathers["u8"] <= 0.6 * wide


@pytest.mark.parametrize("layout", ["tp", "fsdp"])
def test_mxfp8(results, layout):
  r = multidevice.result(results, "train_mxfp8")
  _close(r[layout]["losses"], r["single"]["losses"])


def test_optimizer_masters_and_moments_follow_params(results):
  r = multidevice.result(results, "optimizer_shardings")
  for path, spec in r["params"].items():
    mirrored = [v for k, v in r["opt_state"].items()
                if k.endswith(path) and ("mu/" in k or "nu/" in k
                                         or "master/" in k)]
    assert mirrored and set(mirrored) == {spec}, (path, mirrored)


def test_quantize_keeps_sharding_metadata(results):
  r = multidevice.result(results, "quantize_stock_model")
  tp, single = r["tp"], r["single"]
  assert tp["converted"] == single["converted"] == 6
  assert tp["metadata"] == {"up/kernel": "(None, 'model')",
                            "attn/query/kernel": "(None, 'model', None)",
                            "down/kernel": "('model', None)"}
  assert tp["specs"]["up/kernel"] == "P(None, 'model')"
  _close(tp["losses"], single["losses"], rtol=1e-4)


def test_every_layer_kind(results):
  r = multidevice.result(results, "layers_explicit")
  _close(r["tp"]["losses"], r["single"]["losses"], rtol=1e-4)


@pytest.mark.parametrize("shape", ["(8, 1)", "(1, 8)"])
def test_mesh_axis_of_size_one_in_a_spec(results, shape):
  r = multidevice.result(results, "size_one_axes")
  _close(r[f"{shape}/stock"], r["None/stock"])
  _close(r[f"{shape}/quantized"], r["None/quantized"])


def test_checkpoint_roundtrip(results):
  r = multidevice.result(results, "checkpoint_roundtrip")
  assert r["same_state"]
  assert r["next_loss"][0] == r["next_loss"][1]
  assert r["specs"]["up/kernel"] == "P('fsdp', 'model')"


def test_stacked_delayed_layers_built_under_a_mesh(results):
  r = multidevice.result(results, "stacked_delayed_built_under_a_mesh")
  _close(r["mesh"]["losses"], r["single"]["losses"])
  np.testing.assert_array_equal(r["mesh"]["x_amax"], r["single"]["x_amax"])
  assert r["mesh"]["spec"] == "P(None, None)"


def test_freeze_names_shards_its_blocks_cannot_take_and_abstract_restores(
    results):
  r = multidevice.result(results, "freeze_and_abstract_restore")
  assert "sharded over explicit mesh axes" in r["freeze"]
  assert r["still_param"]
  assert r["in_place_deepseek_v3"] and r["in_place_nvfp4"], r
  assert r["in_place_fp8_current"], r
  assert r["same_state"]
  assert r["specs"]["up/kernel"] == "P('fsdp', 'model')"


def test_a_lora_step_on_frozen_kernels_sharded_over_explicit_axes(results):
  r = multidevice.result(results, "frozen_lora_on_explicit_shards")
  for recipe in ("mxfp8", "nvfp4"):
    assert r[recipe] == {"same_bits": True, "requantize_calls": 1}, (
        recipe, r)
