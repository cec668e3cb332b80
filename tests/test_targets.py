"""GPU lowerings from this CPU host, per target, as the table chooses.

One `QuantDense` training step (Fprop, Dgrad, Wgrad) is lowered, not
compiled, for ``cuda`` (sm_90, sm_100) and ``rocm`` (gfx942, gfx950) with
``lowering_platforms``; only the target's branch of each GEMM is kept. The
StableHLO shows each GEMM's operand types: where the table has a native
route (FP8 dot, cuDNN block-scaled dot, ``lax.scaled_dot``), no GEMM reads
a dequantized (FP32/BF16) copy of a quantized operand.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import qlayers
from qlayers import dispatch

# Forms whose GEMM reads the quantized payloads themselves.
NATIVE = {"fp8_folded", "fp8_rowwise", "fp8_fnuz_folded", "fp8_fnuz_rowwise",
          "mx_cudnn", "ue8m0_cudnn", "nvfp4_cudnn", "scaled_dot",
          "ue8m0_scaled_dot"}
TARGETS = (("cuda", "sm_90"), ("cuda", "sm_100"), ("rocm", "gfx942"),
           ("rocm", "gfx950"))


def _lowered(name: str, platform: str, arch: str) -> str:
  layer = qlayers.QuantDense(256, 128, recipe=name, rngs=nnx.Rngs(0))
  x = jnp.ones((64, 256), jnp.float32)

  def step(layer, x):
    loss = lambda l, x: jnp.sum(l(x).astype(jnp.float32) ** 2)  # noqa: E731
    params = nnx.DiffState(0, (nnx.Param, qlayers.QuantGradState))
    return nnx.grad(loss, argnums=(params, 1))(layer, x)
  with dispatch.target_arch(arch):
    return nnx.jit(step).trace(layer, x).lower(
        lowering_platforms=(platform,)).as_text()


def _gemms(text: str) -> list[tuple[str, ...]]:
  """Operand element types of every GEMM outside the decompositions of
  ``xla.scaled_dot`` composites: a dot_general's two, or the kind of a
  block-scaled GEMM (cuDNN custom call, ``xla.scaled_dot`` composite) and
  its operands' (a cuDNN call's four: payloads, then scales).
  Dots with a constant (the Hadamard rotation of a wide operand) are not
  GEMMs of the layer."""
  out = []
  for func in re.split(r"\n  func\.func ", text):
    if func.startswith("private @xla.scaled_dot"):
      continue
    for line in func.splitlines():
      if "stablehlo.dot_general" in line and "%cst" not in line:
        types = re.findall(r"tensor<(?:\d+x)*(\w+)>", line.split(" : ")[-1])
        out.append(tuple(types[:2]))
      elif "__op$block_scaled_dot" in line:
        out.append(("cudnn_block_scaled",) + tuple(re.findall(
            r"tensor<(?:\d+x)*(\w+)>", line.split(" : ")[-1])[:4]))
      elif 'stablehlo.composite "xla.scaled_dot"' in line:
        out.append(("scaled_dot",) + tuple(
            re.findall(r"tensor<(?:\d+x)*(\w+)>", line.split(" : ")[-1])[:2]))
  return out


def _native_recipes(platform: str, arch: str) -> list[str]:
  targets = qlayers.backends()["targets"][f"{platform} {arch}"]
  return sorted(n for n, g in targets.items()
                if {g[k]["form"] for k in ("fprop", "dgrad", "wgrad")} <= NATIVE)


@pytest.mark.parametrize("platform,arch", TARGETS)
def test_native_routes_read_no_dequantized_operand(platform, arch,
                                                   monkeypatch):
  monkeypatch.delenv("QLAYERS_BACKEND", raising=False)
  names = _native_recipes(platform, arch)
  assert "fp8_current" in names
  for name in names:
    gemms = _gemms(_lowered(name, platform, arch))
    assert len(gemms) == 3, (name, gemms)
    for g in gemms:
      assert not {"f32", "bf16", "f16"} & set(g), (name, arch, gemms)


def test_rocm_fp8_types_follow_the_generation(monkeypatch):
  """gfx950 dots take OCP E4M3/E5M2, gfx942 their FNUZ variants (HYBRID:
  Dgrad E5M2 x E4M3, Wgrad E4M3 x E5M2)."""
  monkeypatch.delenv("QLAYERS_BACKEND", raising=False)
  ocp = [("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"),
         ("f8E4M3FN", "f8E5M2")]
  assert _gemms(_lowered("fp8_current", "rocm", "gfx950")) == ocp
  assert _gemms(_lowered("fp8_current", "rocm", "gfx942")) == [
      ("f8E4M3FNUZ", "f8E4M3FNUZ"), ("f8E5M2FNUZ", "f8E4M3FNUZ"),
      ("f8E4M3FNUZ", "f8E5M2FNUZ")]


def test_rocm_mx_gemms_are_scaled_dots_where_the_table_says(monkeypatch):
  monkeypatch.delenv("QLAYERS_BACKEND", raising=False)
  fp8 = ("scaled_dot", "f8E4M3FN", "f8E4M3FN")
  assert _gemms(_lowered("mxfp8", "rocm", "gfx950")) == [fp8] * 3
  assert _gemms(_lowered("deepseek_v3_ue8m0", "rocm", "gfx950")) == [fp8] * 3
  # gfx942 has no MX GEMM: the table dequantizes to BF16, and says why.
  assert _gemms(_lowered("mxfp8", "rocm", "gfx942")) == [("bf16", "bf16")] * 3
  why = qlayers.backends()["targets"]["rocm gfx942"]["mxfp8"]["fprop"]["why"]
  assert "no MX tensor cores" in why


def test_blackwell_block_scaled_routes(monkeypatch):
  monkeypatch.delenv("QLAYERS_BACKEND", raising=False)
  mx = ("cudnn_block_scaled", "f8E4M3FN", "f8E4M3FN", "f8E8M0FNU",
        "f8E8M0FNU")
  for name in ("mxfp8", "mxfp6", "deepseek_v3_ue8m0"):
    assert _gemms(_lowered(name, "cuda", "sm_100")) == [mx] * 3, name
  # E2M1 x E2M1 at the FP4 rate: cuDNN's NVFP4 GEMM, E4M3 scales per 16
  # (MXFP4 through forms.as_nvfp4), and no dequantized operand.
  fp4 = ("cudnn_block_scaled", "f4E2M1FN", "f4E2M1FN", "f8E4M3FN", "f8E4M3FN")
  for name in ("nvfp4", "mxfp4"):
    assert _gemms(_lowered(name, "cuda", "sm_100")) == [fp4] * 3, name
  # FP32 scales that are not powers of two keep the FP32 dequantize.
  assert ("f32", "f32") in _gemms(_lowered("deepseek_v3", "cuda", "sm_100"))
