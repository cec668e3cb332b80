"""Backend selection and the xla forms.

The dispatch table is checked per target platform without a GPU or the CUDA
plugin: choices through `qlayers.backends()`, code through lowering for
``cuda`` from this CPU host (``lowering_platforms``), where only the cuda
branch of each GEMM is kept.
"""

import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qlayers
from qlayers import _native
from qlayers import dispatch
from qlayers import ops
from qlayers import scaling as S
from qlayers import table
from _support.numerics import sqnr_db

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_GPU_TARGETS = ("qlayers_gemm_fp8_tensor", "qlayers_gemm_mx",
                "qlayers_gemm_fp8_rowwise", "qlayers_gemm_blockwise")


@pytest.fixture
def fake_cuda_library(monkeypatch):
  """As if libqlayers_cuda.so (built against cuBLAS >= 12.9) were loaded."""
  real = _native.loaded
  monkeypatch.setattr(_native, "loaded", lambda platform: (
      _GPU_TARGETS if platform == "cuda" else real(platform)))


def _forms(target: str) -> dict[str, tuple[str, str, str]]:
  """recipe -> (Fprop, Dgrad, Wgrad) forms in `qlayers.backends()`."""
  out = {}
  for name, gemms in qlayers.backends()["targets"][target].items():
    assert all(g["why"] for g in gemms.values()), (target, name)
    out[name] = tuple(gemms[k]["form"] for k in ("fprop", "dgrad", "wgrad"))
  return out


def _same(form):
  return (form,) * 3


# Without a native GPU library: what XLA can do on each target.
EXPECTED = {
    "cpu": {"bf16": _same("cpu_wide"), "fp8_current": _same("cpu_fp8"),
            "fp8_delayed": _same("cpu_fp8"), "fp8_rowwise": _same("cpu_fp8"),
            "deepseek_v3": _same("f32_emulation"),
            "deepseek_v3_ue8m0": _same("f32_emulation"), "mxfp8": _same("cpu_mx"),
            "mxfp6": _same("cpu_mx"), "mxfp4": _same("cpu_mx")},
    "cuda sm_90": {"bf16": _same("wide"), "fp8_current": _same("fp8_folded"),
                   "fp8_delayed": _same("fp8_folded"),
                   "fp8_rowwise": _same("fp8_rowwise"),
                   "deepseek_v3": _same("f32_dequant"),
                   "deepseek_v3_ue8m0": _same("f32_dequant"),
                   "mxfp8": _same("bf16_dequant"),
                   "mxfp6": _same("bf16_dequant"),
                   "mxfp4": _same("bf16_dequant")},
    "cuda sm_100": {"fp8_current": _same("fp8_folded"),
                    "fp8_rowwise": _same("fp8_rowwise"),
                    "deepseek_v3": _same("f32_dequant"),
                    "deepseek_v3_ue8m0": _same("ue8m0_cudnn"),
                    "nvfp4": _same("nvfp4_cudnn"),
                    "mxfp8": _same("mx_cudnn"), "mxfp6": _same("mx_cudnn"),
                    "mxfp4": _same("nvfp4_cudnn")},
    "rocm gfx942": {"fp8_current": _same("fp8_fnuz_folded"),
                    "fp8_rowwise": _same("fp8_fnuz_rowwise"),
                    "deepseek_v3_ue8m0": _same("f32_dequant"),
                    "mxfp8": _same("bf16_dequant")},
    "rocm gfx950": {"fp8_current": _same("fp8_folded"),
                    "fp8_rowwise": _same("fp8_rowwise"),
                    "mxfp8": _same("scaled_dot"),
                    "deepseek_v3_ue8m0": _same("ue8m0_scaled_dot"),
                    "mxfp4": _same("bf16_dequant")},
}


@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_table_per_target_without_gpu_libraries(target, monkeypatch):
  monkeypatch.delenv("QLAYERS_BACKEND", raising=False)
  forms = _forms(target)
  for name, want in EXPECTED[target].items():
    assert forms[name] == want, (target, name)
  # No GPU target ever falls back to the CPU's FP32 HIGHEST emulation.
  if target != "cpu":
    assert not {f for fs in forms.values() for f in fs} & {
        "cpu_fp8", "cpu_mx", "f32_emulation"}


def test_table_picks_the_native_kernel_where_it_is_the_only_route(
    fake_cuda_library, monkeypatch):
  monkeypatch.delenv("QLAYERS_BACKEND", raising=False)
  hopper, blackwell = _forms("cuda sm_90"), _forms("cuda sm_100")
  assert hopper["deepseek_v3"] == _same("ffi")
  # UE8M0 scales: cuBLASLt blockwise on sm_90, cuDNN MXFP8 on sm_100.
  assert hopper["deepseek_v3_ue8m0"] == _same("ffi")
  assert blackwell["deepseek_v3_ue8m0"] == _same("ue8m0_cudnn")
  why = qlayers.backends()["targets"]["cuda sm_100"]["nvfp4"]["fprop"]["why"]
  assert "NVFP4 GEMM" in why
  assert hopper["fp8_rowwise"] == _same("ffi")
  # Where XLA has a native route it keeps it; the sm_90 modes are sm_90 only.
  assert hopper["fp8_current"] == _same("fp8_folded")
  assert blackwell["mxfp8"] == _same("mx_cudnn")
  assert blackwell["deepseek_v3"] == _same("f32_dequant")
  assert blackwell["fp8_rowwise"] == _same("fp8_rowwise")
  why = qlayers.backends()["targets"]["cuda sm_90"]["deepseek_v3"]["fprop"]
  assert why["backend"] == "ffi" and "BLK128x128" in why["why"]


def _blockwise(m, k, n):
  tile = S.QuantSpec(format="e4m3", granularity="tile")
  block = S.QuantSpec(format="e4m3", granularity="block")
  x = jax.random.normal(jax.random.key(0), (m, k))
  w = jax.random.normal(jax.random.key(1), (k, n))
  return S.quantize(x, tile, 1), S.quantize(w, block, 0)


def test_native_kernel_needs_its_shapes_and_architecture(fake_cuda_library):
  a, b = _blockwise(256, 256, 128)
  assert dispatch.choose(a, b, "cuda", "sm_90").backend == "ffi"
  assert dispatch.choose(a, b, "cuda", "sm_100").form == "f32_dequant"
  assert dispatch.choose(a, b, "cuda", None).form == "f32_dequant"
  odd_a, odd_b = _blockwise(100, 256, 128)
  assert dispatch.choose(odd_a, odd_b, "cuda", "sm_90").form == "f32_dequant"
  ok, why = table.ffi_supports(odd_a, odd_b, "cuda", "sm_90")
  assert not ok and "multiples of 16" in why and "M=100" in why
  ok, why = table.ffi_supports(b, b, "cuda", "sm_90")
  assert not ok and "(128, 128) x (128, 128)" in why
  row = S.QuantSpec(format="e4m3", granularity="row")
  ra = S.quantize(jnp.ones((64, 64)), row, 1)
  ok, why = table.ffi_supports(ra, ra, "cuda", "sm_100")
  assert not ok and "sm_90 only" in why
  ok, why = table.ffi_supports(ra, ra, "rocm", "gfx950")
  assert not ok and "not loaded" in why


def test_forced_backend(monkeypatch):
  spec = S.QuantSpec(format="e4m3")
  a = S.quantize(jnp.ones((4, 32)), spec, 1)
  b = S.quantize(jnp.ones((32, 8)), spec, 0)
  with pytest.raises(ValueError, match="Unknown backend 'tpu'"):
    dispatch.select(a, b, "tpu")
  monkeypatch.setenv("QLAYERS_BACKEND", "nope")
  with pytest.raises(ValueError, match="QLAYERS_BACKEND"):
    dispatch.select(a, b)
  monkeypatch.setenv("QLAYERS_BACKEND", "xla")
  backend, why = dispatch.select(a, b)
  assert backend == "xla" and why.startswith("forced")
  # A forced ffi that no GPU library can run: a clear error where this
  # process may lower for that GPU, the table where it cannot.
  monkeypatch.setenv("QLAYERS_BACKEND", "ffi")
  monkeypatch.delenv("QLAYERS_GPU_ARCH", raising=False)
  c = dispatch.choose(a, b, "cuda", None)
  assert c.backend == "xla" and "ffi forced but unavailable" in c.why
  with dispatch.target_arch("sm_90"):
    with pytest.raises(ValueError, match="cannot run this GEMM on cuda sm_90"):
      dispatch.choose(a, b, "cuda", dispatch.gpu_arch("cuda"))


def test_gpu_arch_follows_the_target_then_the_environment(monkeypatch):
  monkeypatch.delenv("QLAYERS_GPU_ARCH", raising=False)
  assert dispatch.gpu_arch("cpu") is None
  monkeypatch.setenv("QLAYERS_GPU_ARCH", "gfx950")
  assert dispatch.gpu_arch("rocm") == "gfx950"
  assert dispatch.gpu_arch("cuda") is None  # no CUDA device here
  device = lambda: jax.sharding.get_abstract_mesh().abstract_device  # noqa: E731
  with dispatch.target_arch("sm_100"):
    assert dispatch.gpu_arch("cuda") == "sm_100"
    assert device().device_kind == "NVIDIA B200"  # for Pallas' lowering
    with dispatch.target_arch("sm_90"):
      assert dispatch.gpu_arch("cuda") == "sm_90"
      assert device().device_kind == "NVIDIA H100"
    assert dispatch.gpu_arch("cuda") == "sm_100"
    assert device().device_kind == "NVIDIA B200"
  assert device() is None
  with jax.set_mesh(jax.make_mesh((1,), ("data",))):  # a mesh stays as set
    mesh = jax.sharding.get_abstract_mesh()
    with dispatch.target_arch("gfx950"):
      assert jax.sharding.get_abstract_mesh() == mesh
  with pytest.raises(ValueError, match="Unknown GPU architecture"):
    with dispatch.target_arch("hopper"):
      pass
  monkeypatch.setenv("QLAYERS_GPU_ARCH", "volta")
  with pytest.raises(ValueError, match="QLAYERS_GPU_ARCH"):
    dispatch.gpu_arch("cuda")
  with pytest.raises(ValueError, match="QLAYERS_GPU_ARCH"):
    qlayers.backends()  # it reported while every GEMM raised


def test_backend_names_are_checked_where_given():
  # "FFI" built a layer that failed only at its first non-empty call, and an
  # empty batch returned zeros whatever the name.
  with pytest.raises(ValueError, match="Unknown backend 'FFI'"):
    qlayers.QuantGemm("mxfp8", backend="FFI")
  with pytest.raises(ValueError, match="Unknown backend 'bogus'"):
    qlayers.ops.quantized_matmul(jnp.ones((0, 32)), jnp.ones((32, 8)),
                                 "mxfp8", backend="bogus")


def test_select_takes_power_of_two_scales_as_the_plan_does():
  a = S.quantize(jnp.ones((4, 128)), S.QuantSpec(
      format="e4m3", granularity="tile", pow2=True), 1)
  b = S.quantize(jnp.ones((128, 128)), S.QuantSpec(
      format="e4m3", granularity="block", pow2=True), 0)
  with dispatch.target_arch("sm_100"):
    assert "cuDNN" in dispatch.select(a, b, platform="cuda", pow2=True)[1]
    assert "FP32 dequantize" in dispatch.select(a, b, platform="cuda")[1]


RECIPE_OPERANDS = {
    "fp8_current": (S.QuantSpec(format="e4m3"), S.QuantSpec(format="e4m3")),
    "fp8_rowwise": (S.QuantSpec(format="e4m3", granularity="row", pow2=True),
                    S.QuantSpec(format="e4m3", granularity="row", pow2=True)),
    "deepseek_v3": (S.QuantSpec(format="e4m3", granularity="tile"),
                    S.QuantSpec(format="e4m3", granularity="block")),
    "mxfp8": (S.QuantSpec(format="e4m3", granularity="mx"),
              S.QuantSpec(format="e4m3", granularity="mx")),
    "mxfp4": (S.QuantSpec(format="e2m1", granularity="mx"),
              S.QuantSpec(format="e2m1", granularity="mx")),
}
CPU_FORM = {"fp8_current": "cpu_fp8", "fp8_rowwise": "cpu_fp8",
            "deepseek_v3": "f32_emulation", "mxfp8": "cpu_mx",
            "mxfp4": "cpu_mx"}


def _fprop(name, m=128, k=256, n=64):
  sx, sw = RECIPE_OPERANDS[name]
  w_axis = 1 if sw.fmt.packed else 0
  x = jax.random.normal(jax.random.key(2), (m, k))
  w = jax.random.normal(jax.random.key(3), (k, n))
  w = w.T if w_axis == 1 else w

  def f(x, w):
    return dispatch.gemm(S.quantize(x, sx, 1), S.quantize(w, sw, w_axis),
                         axes=(1, w_axis), out_dtype=jnp.bfloat16)
  return f, (x, w), (sx, sw, w_axis)


@pytest.mark.parametrize("name", sorted(RECIPE_OPERANDS))
def test_cpu_branch_is_bitwise_the_cpu_form(name, monkeypatch):
  monkeypatch.delenv("QLAYERS_BACKEND", raising=False)
  f, (x, w), (sx, sw, w_axis) = _fprop(name)
  with dispatch.target_arch("sm_100"):  # GPU branches differ from the CPU's
    got = jax.jit(f)(x, w)
  ref = jax.jit(lambda x, w: dispatch.FORMS[CPU_FORM[name]](
      S.quantize(x, sx, 1), S.quantize(w, sw, w_axis), jnp.bfloat16,
      (1, w_axis)))(x, w)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(ref, np.float32))


def _lowered(f, args, platform, arch=None):
  with dispatch.target_arch(arch) if arch else contextlib.nullcontext():
    return jax.jit(f).trace(*args).lower(
        lowering_platforms=(platform,)).as_text()


def _fp8_dots(text):
  """Result types of the dot_generals that read fp8 operands directly."""
  return re.findall(r"stablehlo\.dot_general %\S+, %\S+.*?: \(tensor<[^>]*xf8E"
                    r"[^>]*>, tensor<[^>]*xf8E[^>]*>\) -> tensor<[^>]*x(\w+)>",
                    text)


def test_lowering_for_cuda_takes_the_gpu_forms(fake_cuda_library,
                                               monkeypatch):
  monkeypatch.delenv("QLAYERS_BACKEND", raising=False)
  f, args, _ = _fprop("fp8_current")
  # Per-tensor FP8: the dot reads the FP8 payloads and writes BF16 itself
  # (the form XLA folds into cuBLASLt); on CPU it reads BF16 copies.
  cuda = _lowered(f, args, "cuda", "sm_90")
  assert _fp8_dots(cuda) == ["bf16"]
  # Behind a barrier, so XLA cannot merge it with a GEMM sharing an operand.
  assert "stablehlo.optimization_barrier" in cuda
  cpu = _lowered(f, args, "cpu")  # BF16 copies (behind their own barrier)
  assert _fp8_dots(cpu) == []
  assert not re.search(r"optimization_barrier[^\n]*xf8E", cpu)
  f, args, _ = _fprop("mxfp8")
  assert "__op$block_scaled_dot" in _lowered(f, args, "cuda", "sm_100")
  sm90 = _lowered(f, args, "cuda", "sm_90")
  assert "custom_call" not in sm90 and "HIGHEST" not in sm90
  f, args, _ = _fprop("deepseek_v3")
  assert "custom_call @qlayers_gemm_blockwise" in _lowered(f, args, "cuda",
                                                           "sm_90")
  assert "custom_call @qlayers_gemm" not in _lowered(f, args, "cpu")
  f, args, _ = _fprop("fp8_rowwise")
  assert "custom_call @qlayers_gemm_fp8_rowwise" in _lowered(f, args, "cuda",
                                                             "sm_90")



@pytest.mark.parametrize("name", ["fp8_current", "fp8_rowwise"])
def test_one_device_lowering_is_the_same_under_a_mesh(
    name, fake_cuda_library, monkeypatch):
  """A mesh of one device leaves the GPU lowering exactly as without a mesh:
  `qlayers.partition` (which a GEMM goes through under a mesh of several
  devices, always where the table picks the native kernel, as for row-wise
  FP8 on sm_90) is not in the program."""
  monkeypatch.delenv("QLAYERS_BACKEND", raising=False)
  f, args, _ = _fprop(name)
  plain = _lowered(f, args, "cuda", "sm_90")
  mesh = jax.make_mesh((1,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh):
    meshed = _lowered(f, args, "cuda", "sm_90")
  assert meshed == plain
  if name == "fp8_rowwise":
    assert "custom_call @qlayers_gemm_fp8_rowwise" in plain
  else:
    assert _fp8_dots(plain) == ["bf16"]

def test_export_for_cpu_and_cuda_keeps_both_and_runs_the_cpu_one(monkeypatch):
  monkeypatch.delenv("QLAYERS_BACKEND", raising=False)
  f, args, _ = _fprop("mxfp4")
  exported = jax.export.export(jax.jit(f), platforms=("cpu", "cuda"))(*args)
  assert "stablehlo.case" in exported.mlir_module()
  np.testing.assert_array_equal(np.asarray(exported.call(*args), np.float32),
                                np.asarray(jax.jit(f)(*args), np.float32))


def test_gpu_forms_agree_with_the_cpu_reference():
  """The GPU forms compute the same product (run here on CPU)."""
  for name, form in (("fp8_current", "fp8_folded"),
                     ("fp8_rowwise", "fp8_rowwise"),
                     ("deepseek_v3", "f32_dequant"),
                     ("mxfp8", "bf16_dequant"), ("mxfp4", "bf16_dequant")):
    f, (x, w), (sx, sw, w_axis) = _fprop(name)
    qa, qb = S.quantize(x, sx, 1), S.quantize(w, sw, w_axis)
    ref = dispatch.FORMS[CPU_FORM[name]](qa, qb, jnp.float32, (1, w_axis))
    for out in (jnp.float32, jnp.bfloat16):
      got = dispatch.FORMS[form](qa, qb, out, (1, w_axis))
      assert got.dtype == out
      # BF16 outputs: one rounding of the result (about 2**-9 relative).
      floor = 120 if out == jnp.float32 else 45
      assert sqnr_db(ref, got.astype(jnp.float32)) > floor, (name, form, out)


def test_gemm_checks_operands():
  spec = S.QuantSpec(format="e4m3")
  a = S.quantize(jnp.ones((4, 32)), spec, 1)
  with pytest.raises(TypeError, match="both be QTensor"):
    dispatch.gemm(a, jnp.ones((32, 8)), axes=(1, 0), out_dtype=jnp.float32)
  b = S.quantize(jnp.ones((32, 8)), spec, 0)
  with pytest.raises(ValueError, match="quantized along axes"):
    dispatch.gemm(a, b, axes=(1, 1), out_dtype=jnp.float32)


@pytest.mark.parametrize("name,big", [("fp8_current", 1e34),
                                       ("fp8_rowwise", 1e35)])
def test_cpu_fp8_applies_the_scale_product_once(name, big):
  """Near the FP32 range the output is finite: one multiply by the product
  of the two scales (as the GPU form), not one scale after the other."""
  from flax import nnx
  layer = qlayers.QuantDense(128, 8, recipe=name, rngs=nnx.Rngs(0))
  layer.kernel[...] = jnp.full((128, 8), 1e-3)
  y = layer(jnp.full((2, 128), big))
  assert bool(jnp.isfinite(y).all()), y
  np.testing.assert_allclose(np.asarray(y, np.float64), 128 * 1e-3 * big,
                             rtol=0.1)


def test_scaled_dot_matches_emulation():
  spec = S.QuantSpec(format="e4m3", granularity="mx")
  x = jax.random.normal(jax.random.key(0), (64, 96))
  w = jax.random.normal(jax.random.key(1), (96, 40))
  a, b = S.quantize(x, spec, 1), S.quantize(w, spec, 0)
  emulated = dispatch.gemm(a, b, axes=(1, 0), out_dtype=jnp.float32,
                           backend="xla")  # the CPU's form
  native = jax.jit(lambda a, b: dispatch.scaled_dot_mx(a, b, jnp.float32))(
      a, b)
  assert sqnr_db(emulated, native) > 120


def test_report_names_platform_and_backends():
  info = qlayers.backends()
  assert info["platform"] == jax.default_backend()
  assert info["available"]["xla"] is True
  assert set(info["targets"]) == {
      "cpu", "cuda sm_90", "cuda sm_100", "rocm gfx942", "rocm gfx950"}


def test_report_says_what_each_recipe_uses():
  chosen = qlayers.backends()["chosen"]
  assert set(qlayers.available_recipes()) == set(chosen)
  assert chosen["bf16"]["backend"] == "xla"
  for name, c in chosen.items():
    assert c["backend"] in ("xla", "ffi") and c["why"], name


def _built_cuda_library():
  for d in (_ROOT / "build" / "cuda" / "ffi",):
    if d and (pathlib.Path(d) / "libqlayers_cuda.so").is_file():
      return pathlib.Path(d)
  return None


@pytest.mark.skipif(_built_cuda_library() is None,
                    reason="libqlayers_cuda.so not built (ffi/build_cuda.sh)")
def test_cuda_library_registers_its_handlers_without_a_device():
  """Loading needs cuBLASLt, not a GPU; running the kernels needs one."""
  code = ("from qlayers import _native; import json; "
          f"_native.load({str(_built_cuda_library())!r}, "
          "gpu_without_device=True); "
          "print(json.dumps([_native.loaded('cuda'), "
          "_native.build_info()['details']['cuda']]))")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, text=True,
                       capture_output=True, timeout=300, check=True)
  targets, details = json.loads(out.stdout.strip().splitlines()[-1])
  if not targets and "OSError" in details.get("reason", ""):
    pytest.skip(f"cuBLASLt not loadable here: {details['reason']}")
  assert set(targets) >= {"qlayers_gemm_fp8_tensor", "qlayers_gemm_mx"}
  if "block_scaling=1" in details.get("info", ""):
    assert {"qlayers_gemm_fp8_rowwise", "qlayers_gemm_blockwise"} <= set(
        targets)


@pytest.mark.skipif(not _native.available(),
                    reason="native library not built")
@pytest.mark.parametrize("name", ["fp8_current", "fp8_delayed", "deepseek_v3",
                                  "mxfp8", "mxfp6", "mxfp4"])
def test_layers_agree_across_backends(name):
  """Forward and both gradients of a QuantDense on xla vs ffi (awkward dims)."""
  from flax import nnx
  x = jax.random.normal(jax.random.key(0), (3, 37, 200))
  results = {}
  for backend in ("xla", "ffi"):
    layer = qlayers.QuantDense(200, 72, recipe=name, backend=backend,
                               rngs=nnx.Rngs(0))
    def loss(m, x):
      y = m(x)
      return jnp.sum(y * jnp.cos(y)), y
    (_, y), grads = jax.jit(jax.value_and_grad(
        lambda m, x: loss(nnx.merge(*m), x), argnums=(0, 1), has_aux=True))(
            nnx.split(layer), x)
    results[backend] = (y, grads[1], grads[0][1]["kernel"][...])
  for a, b in zip(results["xla"], results["ffi"]):
    assert sqnr_db(a, b) > 100  # same quantized operands, FP32 accumulation


@pytest.mark.parametrize("recipe,arch", [
    ("fp8_current", "sm_90"), ("fp8_rowwise", "sm_90"),
    ("deepseek_v3", "sm_90"), ("mxfp8", "sm_100"), ("nvfp4", "sm_100")])
def test_vmapped_gemms_lower_for_cuda(recipe, arch, fake_cuda_library,
                                      monkeypatch):
  """The experts' GEMMs and batched dot_generals are traced under jax.vmap:
  the cast kernels' partitioning rule and cuDNN's block-scaled GEMM had no
  batching rule, so none of them lowered for a GPU; nor did the backward
  rules, which JAX traces after the vmap's block."""
  monkeypatch.delenv("QLAYERS_BACKEND", raising=False)
  x, w = (jnp.ones(s, jnp.bfloat16) for s in ((64, 128), (2, 128, 64)))
  sizes = jnp.array([32, 32], jnp.int32)

  def loss(x, w, s):
    y = ops.quantized_ragged_dot(x, w, s, recipe, out_dtype=jnp.bfloat16)[0]
    return jnp.sum(y.astype(jnp.float32))

  text = _lowered(jax.grad(loss, argnums=(0, 1)), (x, w, sizes), "cuda",
                  arch)
  if arch == "sm_100":
    assert "__op$block_scaled_dot" in text
  a, b = (jnp.ones(s, jnp.bfloat16) for s in ((2, 64, 128), (2, 128, 64)))
  _lowered(lambda a, b: ops.quantized_dot_general(
      a, b, (((2,), (1,)), ((0,), (0,))), recipe)[0], (a, b), "cuda", arch)


@pytest.mark.parametrize("recipe,arch", [("fp8_current", "sm_90"),
                                         ("mxfp8", "sm_100")])
def test_a_vmap_of_gemms_traced_unbatched_first_lowers_for_cuda(
    recipe, arch, monkeypatch):
  """A user's jax.vmap over a quantized GEMM, after the same GEMM was
  traced unbatched (its cast kernels cached by jax.jit with their
  partitioning rule): the cast's own vmap rule maps the kernel as it is, so
  the order does not matter, and the unbatched GEMM keeps its rule."""
  monkeypatch.delenv("QLAYERS_BACKEND", raising=False)

  def grads(x, w):
    def loss(x, w):
      y = ops.quantized_matmul(x, w, recipe, out_dtype=jnp.bfloat16)[0]
      return jnp.sum(y.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1))(x, w)

  x, w = jnp.ones((32, 128), jnp.bfloat16), jnp.ones((128, 64), jnp.bfloat16)
  _lowered(grads, (x, w), "cuda", arch)
  _lowered(jax.vmap(grads), (x[None].repeat(2, 0), w[None].repeat(2, 0)),
           "cuda", arch)
  with dispatch.target_arch(arch):
    assert "custom_partitioning" in str(jax.make_jaxpr(grads)(x, w))
