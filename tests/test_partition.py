"""qlayers.partition: the partitioning rule of the quantized 2-D GEMM.

The plan (which mesh axes each operand keeps, which are gathered, summed or
reduce-scattered) is checked on an abstract mesh in this process; the
compiled rule (payloads gathered as bytes, activations never, each device's
local GEMM giving the single-device result) runs on 8 simulated devices in
a subprocess: this file is also the subprocess's script (its cases below).
"""

# pylint: disable=protected-access
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from qlayers import partition, scaling
from qlayers.scaling import QuantSpec

from _support import multidevice

E4M3 = QuantSpec(format="e4m3")
MX = QuantSpec(format="e4m3", granularity="mx")
MESH = AbstractMesh((2, 4), ("fsdp", "model"),
                    axis_types=(AxisType.Auto, AxisType.Auto))


def _q(shape, spec, axis):
  x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
  return scaling.quantize(jnp.asarray(x), spec, axis)


def _struct(q, spec):
  return jax.ShapeDtypeStruct(q.payload.shape, jnp.uint8,
                              sharding=NamedSharding(MESH, spec))


def _partition(a, b, a_spec, b_spec, out_spec=P()):
  """(payload specs of a and b, output spec) the rule asks for."""
  axes = (a.axis, b.axis)
  out = jax.ShapeDtypeStruct(
      (a.shape[1 - a.axis], b.shape[1 - b.axis]), jnp.float32,
      sharding=NamedSharding(MESH, out_spec))
  args = (_struct(a, a_spec), None, _struct(b, b_spec), None)
  _, _, out_sharding, arg_shardings = partition._partition(
      partition._meta(a), partition._meta(b), axes, "float32", "default",
      MESH, args, out)
  return arg_shardings[0].spec, arg_shardings[2].spec, out_sharding.spec


def test_fsdp_weight_is_gathered_activation_keeps_its_rows():
  x, w = _q((32, 64), E4M3, 1), _q((64, 128), E4M3, 0)
  a, b, out = _partition(x, w, P("fsdp", None), P("fsdp", None))
  assert (a, b, out) == (P("fsdp", None), P(None, None), P("fsdp", None))


def test_column_parallel_weight_keeps_its_columns():
  x, w = _q((32, 64), E4M3, 1), _q((64, 128), E4M3, 0)
  a, b, out = _partition(x, w, P("fsdp", None), P("fsdp", "model"))
  assert (a, b, out) == (P("fsdp", None), P(None, "model"),
                         P("fsdp", "model"))


def test_row_parallel_keeps_k_sharded_and_sums():
  x, w = _q((32, 64), E4M3, 1), _q((64, 128), E4M3, 0)
  a, b, out = _partition(x, w, P(None, "model"), P("model", None))
  assert (a, b, out) == (P(None, "model"), P("model", None), P(None, None))


def test_fsdp_weight_gradient_is_reduce_scattered():
  # Wgrad dw = x.T @ g: contracted over the tokens, which fsdp splits; the
  # partitioner wants dw split over fsdp like the weight.
  x, g = _q((32, 64), E4M3, 0), _q((32, 128), E4M3, 0)
  a, b, out = _partition(x, g, P("fsdp", None), P("fsdp", None),
                         out_spec=P("fsdp", None))
  assert (a, b, out) == (P("fsdp", None), P("fsdp", None), P("fsdp", None))
  plan = partition._plan(
      partition._meta(x), partition._meta(g), MESH,
      (_struct(x, P("fsdp", None)), None, _struct(g, P("fsdp", None)), None),
      jax.ShapeDtypeStruct((64, 128), jnp.float32,
                           sharding=NamedSharding(MESH, P("fsdp", None))))
  assert plan.k == ("fsdp",) and plan.scatter == (("fsdp",), ())


def test_k_split_into_partial_mx_blocks_is_gathered():
  # K = 64 over 4 devices leaves 16 per shard: half an MX block of 32.
  x, w = _q((32, 64), MX, 1), _q((64, 128), MX, 0)
  a, b, out = _partition(x, w, P(None, "model"), P("model", None))
  assert (a, b, out) == (P(None, None), P(None, None), P(None, None))
  # Over 2 devices each shard holds one whole block: K stays split.
  a, b, _ = _partition(x, w, P(None, "fsdp"), P("fsdp", None))
  assert (a, b) == (P(None, "fsdp"), P("fsdp", None))


def test_local_gemm_is_traced_without_the_callers_mesh(monkeypatch):
  """XLA calls the rule's lowering while compiling, and jax 0.11 does so
  under the caller's `jax.set_mesh`. The local GEMM works on shards: under
  an explicit-axes mesh its ops would carry sharding annotations that
  nothing partitions after the SPMD pass, and the program would not
  compile."""
  seen = []

  def local(a, b, axes, out_dtype):
    seen.append(jax.sharding.get_abstract_mesh())
    return jnp.zeros((a.shape[1 - a.axis], b.shape[1 - b.axis]), out_dtype)

  monkeypatch.setitem(partition._LOCAL, "probe", local)
  x, w = _q((32, 64), E4M3, 1), _q((64, 128), E4M3, 0)
  out = jax.ShapeDtypeStruct((32, 128), jnp.float32,
                             sharding=NamedSharding(MESH, P("fsdp", None)))
  args = (_struct(x, P("fsdp", None)), None, _struct(w, P("fsdp", None)),
          None)
  _, lower, _, shardings = partition._partition(
      partition._meta(x), partition._meta(w), (1, 0), "float32", "probe",
      MESH, args, out)
  assert shardings[0].spec == P("fsdp", None)  # x's rows stay split
  shards = (jax.ShapeDtypeStruct((16, 64), jnp.uint8),
            jax.ShapeDtypeStruct((), jnp.float32),
            jax.ShapeDtypeStruct((64, 128), jnp.uint8),
            jax.ShapeDtypeStruct((), jnp.float32),
            *partition._levels(x), *partition._levels(w))
  explicit = AbstractMesh((2, 4), ("fsdp", "model"),
                          axis_types=(AxisType.Explicit, AxisType.Explicit))
  with jax.sharding.use_abstract_mesh(explicit):
    jax.make_jaxpr(lower)(*shards)
  assert len(seen) == 1 and seen[0].empty


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn,
                                   ml_dtypes.float8_e5m2])
def test_payloads_travel_as_their_bytes(dtype):
  codes = np.arange(256, dtype=np.uint8)
  payload = jnp.asarray(codes.view(dtype))
  wired = partition._wire(payload)
  assert wired.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(wired), codes)
  back = partition._unwire(wired, jnp.dtype(dtype).name)
  np.testing.assert_array_equal(np.asarray(back).view(np.uint8), codes)


def test_wire_keeps_the_element_type_for_the_local_gemm():
  q = _q((64, 128), E4M3, 0)
  wired = partition.wire(q)
  assert wired.payload.dtype == jnp.uint8
  assert partition._meta(wired) == partition._meta(q)
  np.testing.assert_array_equal(
      np.asarray(wired.payload),
      np.asarray(q.payload).view(np.uint8))


# ----------------------------------------------------------------------------
# On 8 simulated devices


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return multidevice.run_once("test_partition.py", tmp_path_factory)


def test_fsdp_gathers_the_payload_once_as_bytes(results):
  r = multidevice.result(results, "fsdp")
  # The weight's 64 x 128 payload, one byte per element; the activation
  # is not gathered; the two per-tensor amaxes are all-reduced (max).
  assert r["collectives"] == {"all-gather": {"u8": 64 * 128},
                              "all-reduce": {"f32": 2 * 4}}, r
  assert r["same_bits"]  # each device's rows, as on one device


def test_row_parallel_sums_partial_products_in_fp32(results):
  r = multidevice.result(results, "row_parallel")
  # The 32 x 128 FP32 partial products and the two amaxes, nothing gathered.
  assert r["collectives"] == {"all-reduce": {"f32": 32 * 128 * 4 + 2 * 4}}, r
  assert r["max_rel"] < 1e-6  # a sum in another order


def test_a_wired_weight_is_gathered_once_for_two_gemms(results):
  r = multidevice.result(results, "shared_weight")
  assert r["gathers"] == {"per_call": {"u8": 2 * 64 * 128},
                          "wired": {"u8": 64 * 128}}, r
  assert r["same_bits"]


def test_the_cast_kernel_casts_each_shard_without_a_mesh_set(results):
  """`partition.cast`: sharded only through jit's shardings (no mesh set),
  the per-tensor cast kernel (interpreted) casts each device's shard with
  the global scale: the single-device bits, the copy of ``t.T`` sharded as
  ``t`` transposed, nothing gathered but the amax all-reduced, also where
  a shard splits a tile (padded to one)."""
  r = multidevice.result(results, "cast_without_mesh")
  assert r["rows"] == {"same_bits": True, "all-gather": None,
                       "qt_spec": [None, "data"]}, r
  assert r["cols"] == {"same_bits": True, "all-gather": None,
                       "qt_spec": ["data", None]}, r
  for name in ("delayed", "delayed_first"):  # a stored history, the first
    assert r[name]["same_bits"] and r[name]["all-gather"] is None, r
  # 128 rows over 8 devices: 16-row shards of 64-row tiles.
  assert r["split_tiles"] == {"same_bits": True, "all-gather": None,
                              "qt_spec": [None, "data"]}, r


def test_the_mx_kernel_casts_each_shard_of_whole_blocks(results):
  """The MX pair kernel (`cast_transpose.mx_cast_transpose`, interpreted)
  under `partition.cast`: shards of whole 32-blocks cast alone (the
  single-device bits, scales sharded with their payloads, nothing
  gathered); a dim whose shards split blocks is gathered first."""
  r = multidevice.result(results, "mx_without_mesh")
  assert r["rows"] == {"same_bits": True, "all-gather": None}, r
  assert r["cols"] == {"same_bits": True, "all-gather": None}, r
  # 128 rows over 8 devices: 16-row shards of 32-row blocks.
  assert r["split_blocks"]["same_bits"], r
  assert r["split_blocks"]["all-gather"], r


def _sharded_run(f, want, *args):
  """``f`` compiled for ``args`` as they are sharded, run: whether every
  result has the bits of ``want`` (the single-device run), and the
  all-gathers the compiled program holds."""
  import collectives  # pylint: disable=g-import-not-at-top
  compiled = jax.jit(f).lower(*args).compile()
  got = compiled(*args)
  return {"same_bits": all(
      np.array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                     np.asarray(b).reshape(-1).view(np.uint8))
      for a, b in zip(got, want)),
          "all-gather": collectives.summary(compiled.as_text()).get(
              "all-gather")}


def mx_without_mesh():
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  from qlayers import cast_transpose as ct  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()), ("data",))

  def case(shape, spec):
    t = jnp.asarray(np.random.default_rng(4).normal(size=shape)
                    * np.exp(np.random.default_rng(5).normal(size=shape)),
                    jnp.bfloat16)
    f = lambda t: ct.mx_cast_transpose(t, "e4m3", "mx_rceil",  # noqa: E731
                                       interpret=True)
    return _sharded_run(f, jax.jit(f)(t),
                        jax.device_put(t, NamedSharding(mesh, spec)))

  return {"rows": case((1024, 64), P("data")),
          "cols": case((64, 1024), P(None, "data")),
          "split_blocks": case((128, 64), P("data"))}


def test_the_requantize_kernel_requantizes_each_shard(results):
  """A stored MX or NVFP4 copy requantized along its other axis
  (`cast_transpose.mx_requantize`, `nvfp4_requantize`, interpreted) under
  `partition.cast`: shards of whole tiles, rows or columns split, give the
  single-device bits and gather nothing, packed E2M1 codes (whose copy has
  twice their bytes' columns as rows) too; NVFP4's tensor amax is the
  whole tensor's."""
  r = multidevice.result(results, "requantize_without_mesh")
  for name in ("e4m3_rows", "e4m3_cols", "e2m1_rows", "e2m1_cols",
               "nvfp4_rows", "nvfp4_cols"):
    assert r[name] == {"same_bits": True, "all-gather": None}, (name, r)


def requantize_without_mesh():
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  from qlayers import cast_transpose as ct  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()), ("data",))

  def case(fmt, shape, spec):
    w = jnp.asarray(np.random.default_rng(8).normal(size=shape)
                    * np.exp(np.random.default_rng(9).normal(size=shape)),
                    jnp.float32)
    if fmt == "nvfp4":  # its 16 x 16 blocks, under the tensor's amax
      q = scaling.quantize(w, QuantSpec(format="e2m1", granularity="block",
                                        scale_rule="nvfp4"), 1)
      f = lambda p, s: ct.nvfp4_requantize(  # noqa: E731
          p, s, ct.nvfp4_amax(p, s), interpret=True)
    else:
      q = scaling.quantize(w, QuantSpec(format=fmt, granularity="mx"), 1)
      f = lambda p, s: ct.mx_requantize(p, s, fmt, "mx_rceil",  # noqa: E731
                                        interpret=True)
    return _sharded_run(f, jax.jit(f)(q.payload, q.scale),
                        *(jax.device_put(a, NamedSharding(mesh, spec))
                          for a in (q.payload, q.scale)))

  return {f"{fmt}_{name}": case(fmt, shape, spec)
          for fmt in ("e4m3", "e2m1", "nvfp4")
          for name, shape, spec in (("rows", (1024, 64), P("data")),
                                    ("cols", (64, 1024), P(None, "data")))}


def test_a_frozen_kernels_dgrad_copy_is_requantized_under_a_mesh(results):
  """Under an auto mesh of 8 devices, a LoRA step on a frozen MX or NVFP4
  kernel (its codes sharded along K, the input's rows over the mesh)
  planned for B200 makes Dgrad's copy from the codes, one requantize call
  under the cast's partitioning rule, and keeps the single-device input
  gradient on CPU; a kernel whose dims do not split into whole 32 x 32
  tiles on every device (N 128 over 8) keeps XLA's dequantize + quantize."""
  r = multidevice.result(results, "requantize_under_mesh")
  for recipe in ("mxfp8", "mxfp4", "nvfp4"):
    assert r[recipe] == {"requantize_calls": 1, "same_bits": True}, (
        recipe, r)
  assert r["mxfp8_n128"] == {"requantize_calls": 0, "same_bits": True}, r


def test_the_nvfp4_kernels_cast_each_shard_with_its_draws(results):
  """NVFP4's one-pass kernels (interpreted) under `partition.cast`: the
  amaxes of t and of its transform from each shard's partial maxima, and
  both copies cast per shard, with stochastic rounding drawing each
  element's uniform at its place in t (the shard's origin): the
  single-device bits, nothing gathered, rows or columns split; 16 x 16
  weight blocks too; and MXFP4's pair kernel (a transform, both copies
  rounded stochastically), row-wise FP8's two kernels (each row's and
  column's amax over the whole tensor), DeepSeek-V3's 128 x 128 blocks
  and the Hadamard transform kernel the same way."""
  r = multidevice.result(results, "nvfp4_without_mesh")
  for name in ("rows", "rows_two_axes", "cols", "square", "mxfp4_rows",
               "mxfp4_cols",
               "rowwise_rows", "rowwise_cols", "blocks_rows",
               "transform_rows", "transform_cols"):
    assert r[name] == {"same_bits": True, "all-gather": None}, (name, r)


def requantize_under_mesh():
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  from _support import cast_kernels  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  case = lambda r, n: cast_kernels.frozen_lora_dgrad_under(mesh, r, n)  # noqa: E731

  out = {r: case(r, 512) for r in ("mxfp8", "mxfp4", "nvfp4")}
  out["mxfp8_n128"] = case("mxfp8", 128)
  return out


def nvfp4_without_mesh():
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  from qlayers import cast_transpose as ct, formats  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()), ("data",))
  keys = tuple(formats.rounding_key(jnp.uint32(s), jnp.uint32(3))
               for s in (11, 12))

  def case(shape, spec, square=False, fn=None, mesh=mesh):
    t = jnp.asarray(np.random.default_rng(6).normal(size=shape)
                    * np.exp(np.random.default_rng(7).normal(size=shape)),
                    jnp.bfloat16)

    def f(t):
      if fn is not None:
        return fn(t)
      if square:
        return ct.nvfp4_cast_transpose(t, square=True, interpret=True)
      a, at = ct.nvfp4_amaxes(t, interpret=True)
      return (a, at, *ct.nvfp4_cast_transpose(
          t, a, at, hadamard=True, keys=keys, interpret=True))

    return _sharded_run(f, jax.jit(f)(t),
                        jax.device_put(t, NamedSharding(mesh, spec)))

  def mxfp4(t):  # MXFP4's pair: the transform on the t.T copy, both SR
    return ct.fp4_cast_transpose(t, keys=keys, hadamard=(0, 32),
                                 interpret=True)

  def rowwise(t):  # both kernels: the partial maxima, then the copies
    return ct.row_cast_transpose(t, "e4m3", interpret=True)

  def blocks(t):  # DeepSeek-V3's 128 x 128 weight blocks
    return ct.block_cast_transpose(t, "e4m3", interpret=True)

  def transforms(t):  # the Hadamard transform alone, along either axis
    return (ct.transform(t, 16, 0, interpret=True),
            ct.transform(t, 32, 1, interpret=True))

  # Rows over two axes: a shard's origin is their joint index.
  two = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
  return {"rows": case((2048, 256), P("data")),
          "rows_two_axes": case((2048, 256), P(("a", "b")), mesh=two),
          "cols": case((256, 1024), P(None, "data")),
          "square": case((256, 1024), P(None, "data"), square=True),
          "rowwise_rows": case((1024, 128), P("data"), fn=rowwise),
          "rowwise_cols": case((128, 1024), P(None, "data"), fn=rowwise),
          "blocks_rows": case((1024, 128), P("data"), fn=blocks),
          "transform_rows": case((1024, 128), P("data"), fn=transforms),
          "transform_cols": case((128, 1024), P(None, "data"),
                                 fn=transforms),
          "mxfp4_rows": case((1024, 128), P("data"), fn=mxfp4),
          "mxfp4_cols": case((128, 1024), P(None, "data"), fn=mxfp4)}


def cast_without_mesh():
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  import collectives  # pylint: disable=g-import-not-at-top
  from qlayers import cast_transpose as ct  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()), ("data",))
  stored = jnp.zeros(16).at[3].set(5.0)

  def case(shape, spec, history=None):
    t = jnp.asarray(np.random.default_rng(3).normal(size=shape) * 40,
                    jnp.bfloat16)

    def f(t):  # delayed: t's amax found by the kernels, over the devices
      kw = {} if history is None else dict(
          delayed=(history, jnp.float32(1.0)))
      return ct.cast_transpose(t, "e4m3", interpret=True, **kw)

    want = jax.jit(f)(t)
    ts = jax.device_put(t, NamedSharding(mesh, spec))
    compiled = jax.jit(f).lower(ts).compile()  # no jax.set_mesh
    got = compiled(ts)
    qt_spec = got[1].sharding.spec
    return {"same_bits": all(
        np.array_equal(np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1
                       else np.asarray(a), np.asarray(b).view(np.uint8)
                       if b.dtype.itemsize == 1 else np.asarray(b))
        for a, b in zip(got, want)),
            "all-gather": collectives.summary(compiled.as_text()).get(
                "all-gather"),
            "qt_spec": [qt_spec[i] if i < len(qt_spec) else None
                        for i in range(2)]}

  return {"rows": case((1024, 128), P("data")),
          "cols": case((128, 1024), P(None, "data")),
          "delayed": case((1024, 128), P("data"), history=stored),
          "delayed_first": case((1024, 128), P("data"),
                                history=jnp.zeros(16)),
          "split_tiles": case((128, 64), P("data"))}


def _gemm_case(x_spec, w_spec, mesh_shape, names):
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  import collectives  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  x = rng.normal(size=(32, 64)).astype(np.float32)
  w = rng.normal(size=(64, 128)).astype(np.float32)

  def f(x, w):
    qx, qw = scaling.quantize(x, E4M3, 1), scaling.quantize(w, E4M3, 0)
    return partition.gemm(qx, qw, (1, 0), jnp.float32, "default")

  ref = np.asarray(jax.jit(f)(x, w))
  mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), names)
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    ws = jax.device_put(w, NamedSharding(mesh, w_spec))
    compiled = jax.jit(f).lower(xs, ws).compile()
    got = np.asarray(compiled(xs, ws))
  return {"collectives": collectives.summary(compiled.as_text()),
          "same_bits": bool(np.array_equal(got, ref)),
          "max_rel": float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))}


def fsdp():
  return _gemm_case(P("fsdp"), P("fsdp"), (8,), ("fsdp",))


def row_parallel():
  return _gemm_case(P(None, "model"), P("model", None), (4, 2),
                    ("fsdp", "model"))


def shared_weight():
  """Fprop ``x @ w`` and Dgrad ``g @ w.T`` of one per-tensor FP8 weight."""
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  import dataclasses  # pylint: disable=g-import-not-at-top
  import collectives  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(2)
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  arrays = [rng.normal(size=s).astype(np.float32)
            for s in ((32, 64), (32, 128), (64, 128))]

  def f(x, g, w, wired):
    qw = scaling.quantize(w, E4M3, 0)
    qw = partition.wire(qw) if wired else qw
    qx, qg = scaling.quantize(x, E4M3, 1), scaling.quantize(g, E4M3, 1)
    y = partition.gemm(qx, qw, (1, 0), jnp.float32, "default")
    dx = partition.gemm(qg, dataclasses.replace(qw, axis=1), (1, 1),
                        jnp.float32, "default")
    return y, dx

  out, gathers = {}, {}
  with jax.set_mesh(mesh):
    args = [jax.device_put(a, NamedSharding(mesh, P("fsdp")))
            for a in arrays]
    for wired in (False, True):
      compiled = jax.jit(f, static_argnums=3).lower(*args, wired).compile()
      name = "wired" if wired else "per_call"
      gathers[name] = collectives.summary(compiled.as_text())["all-gather"]
      out[name] = [np.asarray(o) for o in compiled(*args)]
  same = all(np.array_equal(a, b) for a, b in zip(out["wired"],
                                                  out["per_call"]))
  return {"gathers": gathers, "same_bits": bool(same)}


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, str(multidevice.ROOT / "benchmarks"))
  case = multidevice.Cases()
  case(fsdp)
  case(row_parallel)
  case(shared_weight)
  case(cast_without_mesh)
  case(mx_without_mesh)
  case(nvfp4_without_mesh)
  case(requantize_without_mesh)
  case(requantize_under_mesh)
  case.main()
