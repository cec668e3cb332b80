"""The cast kernels as a GPU target builds them: the GPU-targeted GEMM's values
on CPU, the PTX conversions chosen per target, Threefry's wide rotation
(qlayers/cast_transpose/_base.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qlayers.cast_transpose import _base
from qlayers import ops
from qlayers import table
from qlayers import threefry


@pytest.mark.parametrize("recipe,arch,kernels", [
    ("fp8_current", "sm_90", 3), ("fp8_delayed", "sm_90", 6),
    ("mxfp8", "sm_100", 3), ("mxfp4", "sm_100", 3), ("mxfp6", "sm_100", 3),
    ("mxfp6", "sm_90", 3),
    ("mxfp4_rht", "sm_100", 3),
    ("deepseek_v3_ue8m0", "sm_100", 3), ("deepseek_v3", "sm_90", 3),
    ("fp8_rowwise", "sm_90", 6), ("fp8_rowwise", "sm_100", 6)])
def test_gpu_targeted_gemm_equals_the_cpu_one_on_cpu(recipe, arch, kernels):
  """Traced for a GPU target, a quantized matmul takes the operand pairs;
  run on CPU, its output and all gradients keep their bits."""
  x = jax.random.normal(jax.random.key(1), (2, 64, 128), jnp.float32)
  w = jax.random.normal(jax.random.key(2), (128, 256), jnp.float32) * 0.1
  state = ops.init_state(recipe)

  def loss(x, w, state):
    y, _ = ops.quantized_matmul(x, w, recipe, state)
    return jnp.sum(y * jnp.cos(y))

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
  want = jax.jit(grad)(x, w, state)
  with table.target_arch(arch):
    got = jax.jit(grad)(x, w, state)
    text = jax.jit(grad).trace(x, w, state).lower(
        lowering_platforms=("cuda",)).as_text()
  # x, w, g (MXFP4's g rounding stochastically); row-wise's amaxes and a
  # delayed role's first-step amax each in a kernel before the cast
  assert text.count("__gpu$xla.gpu.triton") == kernels
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("recipe,ptx,converts", [
    ("mxfp4", "e2m1x2", {"sm_100": True, "sm_90": False}),
    ("nvfp4", "e2m1x2", {"sm_100": True, "sm_90": False}),
    ("mxfp6", "e2m3x2", {"sm_100": True, "sm_90": False}),
    ("mxfp8", "e4m3x2", {"sm_100": True}),
    ("deepseek_v3", "e4m3x2", {"sm_90": True})])
def test_kernels_cast_by_ptx_conversions_where_the_target_has_them(
    recipe, ptx, converts):
  """Traced for a GPU the cast kernels round to nearest with its PTX
  conversions (FP4 and FP6: Blackwell's), written as words, and truncate
  the stochastic copies' steps by PTX; without them (Hopper's FP4/FP6, the
  interpreter) with FP32 steps, whose bits the other test_cast_transpose_*
  files check."""
  x, w = jnp.ones((256, 256)), jnp.ones((256, 256))

  def loss(x, w):
    return jnp.sum(ops.quantized_matmul(x, w, recipe)[0])

  for arch, want in converts.items():
    with table.target_arch(arch):
      text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w).lower(
          lowering_platforms=("cuda",)).as_text()
    assert (f"cvt.rn.satfinite.{ptx}.f32" in text) == want, arch
    if recipe in ("mxfp4", "nvfp4"):  # their stochastic gradient copies
      assert ("cvt.rzi.u32.f32" in text) == want, arch
      assert ("mul.wide.u32" in text) == want, arch  # Threefry's rotations


def _run_rotl_ptx(asm: str, x: np.ndarray) -> np.ndarray:
  """`_base.ROTL_WIDE`'s statements run on uint64 ``x`` (32-bit values), the
  three opcodes it uses and no other."""
  regs = {"$1": x}
  for stmt in (t.strip() for t in asm.strip("{} ").split(";")):
    if not stmt or stmt.startswith(".reg") or stmt in ("{", "}"):
      continue
    op, args = stmt.split(None, 1)
    args = [a.strip() for a in args.replace("{", "").replace("}", "").split(
        ",")]
    if op == "mul.wide.u32":
      regs[args[0]] = regs[args[1]] * np.uint64(int(args[2]))
    elif op == "mov.b64":  # {lo, hi} = w
      regs[args[0]] = regs[args[2]] & np.uint64(2**32 - 1)
      regs[args[1]] = regs[args[2]] >> np.uint64(32)
    elif op == "or.b32":
      regs[args[0]] = regs[args[1]] | regs[args[2]]
    else:
      raise AssertionError(f"unexpected PTX statement {stmt!r}")
  return regs["$0"].astype(np.uint32)


def test_the_wide_multiply_rotation_is_threefrys():
  """`_base.ROTL_WIDE` for each of Threefry's rotation distances, its PTX run
  statement by statement: the or of the halves of x * 2**d in 64 bits is
  `qlayers.threefry`'s rotation of x."""
  x = np.random.default_rng(3).integers(0, 2**32, 4096, dtype=np.uint64)
  x[:3] = (0, 2**32 - 1, 2**31)
  for d in {d for group in threefry._ROTATIONS for d in group}:  # noqa: SLF001
    got = _run_rotl_ptx(_base.ROTL_WIDE % (1 << d), x)
    want = threefry._rotl(jnp.asarray(x, jnp.uint32), d)  # noqa: SLF001
    np.testing.assert_array_equal(got, np.asarray(want))
