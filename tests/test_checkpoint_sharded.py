"""Checkpoints of arrays sharded over a mesh: one process with 8 CPU
devices, and 2 processes x 4 CPU devices under ``jax.distributed``; single
checkpoints (`checkpoint.save`) and numbered steps (`checkpoint.Manager`).

Each case runs this file as a script in fresh processes (the device count is
fixed when JAX starts). The model: ``nnx.Linear`` layers with
``nnx.with_partitioning`` kernels, two of them converted to `QuantDense`
(``fp8_current``: no state; ``fp8_delayed``: replicated state).
"""

import os
import socket
import subprocess
import sys

import numpy as np

from _support import multidevice

MESH = (2, 4)  # ("data", "model")


def _run(args, nproc: int, devices: int, timeout: float = 300):
  env = dict(multidevice.env(devices), OPENBLAS_NUM_THREADS="1")
  procs = [subprocess.Popen([sys.executable, __file__, str(i), str(nproc),
                             *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=os.path.dirname(__file__))
           for i in range(nproc)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i} failed:\n{out[-6000:]}"
    assert out.rstrip().endswith("checks passed"), out[-3000:]
  return outs


def test_one_process_eight_devices(tmp_path):
  out, = _run([tmp_path, 0], nproc=1, devices=8)
  print(out[-2000:])


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_four_devices_each(tmp_path):
  outs = _run([tmp_path, _free_port()], nproc=2, devices=4)
  print(outs[0][-2000:])


# ----------------------------------------------------------------------------
# The worker


def _worker(process_id: int, nproc: int, directory: str, port: int):
  import pathlib
  import shutil

  import jax
  if nproc > 1:
    # CPU collectives (used by process_allgather below) are gloo by default
    # in this JAX; said here so that a change of default shows.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                               num_processes=nproc, process_id=process_id)
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  from flax import nnx
  import optax
  import orbax.checkpoint as ocp
  import qlayers
  from qlayers import checkpoint
  from qlayers import _checkpoint_checks as ckpt_checks
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec as P

  assert jax.process_count() == nproc and jax.device_count() == 8
  mesh = jax.make_mesh(MESH, ("data", "model"))
  directory = pathlib.Path(directory)
  primary = jax.process_index() == 0
  checks = []

  def sync(name):
    ocp.multihost.sync_global_processes(f"test_{name}")

  class Model(nnx.Module):

    def __init__(self, seed, specs):
      rng = np.random.default_rng(seed)
      init = lambda key, shape, dtype: rng.standard_normal(shape).astype(
          dtype)
      dims = (16, 32, 64, 32, 8)
      for name, spec, (a, b) in zip(("embed", "cur", "dly", "out"), specs,
                                    zip(dims, dims[1:])):
        setattr(self, name, nnx.Linear(
            a, b, kernel_init=nnx.with_partitioning(init, spec),
            bias_init=nnx.with_partitioning(init, spec[1:]),
            rngs=nnx.Rngs(0)))

  specs_a = ((None, "model"), ("data", "model"), ("model", "data"),
             ("model", None))
  specs_b = (("model", None), (None, "data"), ("data", None), (None, None))
  rules = [qlayers.Rule(pattern="^cur$", recipe="fp8_current"),
           qlayers.Rule(pattern="^dly$", recipe="fp8_delayed")]

  def build(seed, specs=specs_a, rules=rules):
    with jax.set_mesh(mesh):
      model = Model(seed, specs)
      if rules:
        qlayers.quantize(model, None, rules, strict=True)
      quant = model.dly.quant if rules else None
    if quant is not None:
      # Recognisable replicated quantization state.
      for i, name in enumerate(("x_amax_history", "w_amax_history",
                                "g_amax_history", "x_amax")):
        var = getattr(quant, name)
        value = np.full(var.shape, seed + i / 8, np.float32)
        var[...] = jax.device_put(value, NamedSharding(mesh, P()))
    return model

  def arrays(tree):
    return {"/".join(map(str, p)): v.get_value()
            for p, v in nnx.to_flat_state(nnx.state(tree))}

  def local(x) -> dict:
    """{shard index: value} of this process's shards."""
    return {str(s.index): np.asarray(s.data) for s in x.addressable_shards}

  def gather(x):
    """The global value of ``x`` on every process."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  def optimizer(model):
    with jax.set_mesh(mesh):
      return nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

  source = build(0)
  opt = optimizer(source)
  src = arrays(source)
  kernel = src["cur/kernel"]
  assert kernel.sharding.spec == P("data", "model"), kernel.sharding
  assert not kernel.is_fully_addressable or nproc == 1
  hist = src["dly/quant/x_amax_history"]
  assert hist.sharding.is_fully_replicated and len(hist.sharding.device_set) \
      == 8, hist.sharding
  src_global = {k: gather(v) for k, v in src.items()}

  # Only process 0 writes the digests (in orbax's finalize step).
  written = []
  write = ckpt_checks._write  # pylint: disable=protected-access
  ckpt_checks._write = lambda p: (written.append(p), write(p))
  path = checkpoint.save(directory / "ckpt", source, optimizer=opt)
  ckpt_checks._write = write
  assert len(written) == (1 if primary else 0), written
  sync("saved")
  files = checkpoint.read_metadata(path)["files"]
  writers = {rel.split("/")[1] for rel in files
             if rel.startswith("model/ocdbt.process_")}
  assert writers == {f"ocdbt.process_{i}" for i in range(nproc)}, writers
  checks.append(f"saved by {sorted(writers)}")

  # Full restore: every value back, each array with the target's sharding.
  for specs, what in ((specs_a, "same"), (specs_b, "other")):
    target = build(1, specs)
    target_opt = optimizer(target)
    want_shardings = {k: v.sharding for k, v in arrays(target).items()}
    info = checkpoint.restore(path, target, optimizer=target_opt)
    assert info["restored"] == "full"
    got = arrays(target)
    assert got.keys() == src.keys()
    for k, v in got.items():
      assert v.sharding == want_shardings[k], (k, v.sharding)
      full = {str(s.index): s.index for s in v.addressable_shards}
      for key, idx in full.items():
        np.testing.assert_array_equal(local(v)[key], src_global[k][idx],
                                      err_msg=k)
    for k, v in arrays(target_opt).items():
      if np.size(v):
        np.testing.assert_array_equal(gather(v), gather(arrays(opt)[k]),
                                      err_msg=k)
    checks.append(f"restored into {what} shardings")

  # Params only (into a model without quantized layers and back).
  plain = build(2, rules=[])
  checkpoint.restore(path, plain)
  for k, v in arrays(plain).items():
    np.testing.assert_array_equal(gather(v), src_global[k], err_msg=k)
  target = build(3)
  checkpoint.restore(path, target, params_only=True)
  h = target.dly.quant.x_amax_history[...]
  assert h.sharding.is_fully_replicated and len(h.sharding.device_set) == 8
  assert not np.any(gather(h))
  np.testing.assert_array_equal(gather(target.cur.kernel[...]),
                                src_global["cur/kernel"])
  checks.append("params-only, fresh state replicated")

  # A damaged file is detected by every process, the target untouched.
  damaged = directory / "damaged"
  if primary:
    shutil.copytree(path, damaged)
    data = max((f for f in (damaged / "model").rglob("*")
                if f.is_file() and "/d/" in f.as_posix()),
               key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
  sync("damaged")
  target = build(4)
  before = {k: gather(v) for k, v in arrays(target).items()}
  try:
    checkpoint.restore(damaged, target)
  except checkpoint.CheckpointCorruptError as e:
    assert "SHA-256 differs" in str(e), e
  else:
    raise AssertionError("damage not detected")
  for k, v in arrays(target).items():
    np.testing.assert_array_equal(gather(v), before[k], err_msg=k)
  checks.append("damage detected")

  # Replacing works across processes too.
  checkpoint.save(path, build(5), overwrite=True)
  target = build(6)
  checkpoint.restore(path, target)
  np.testing.assert_array_equal(gather(target.dly.quant.x_amax[...]),
                                np.full((), 5 + 3 / 8, np.float32))

  # Numbered steps with orbax's CheckpointManager: the latest one kept.
  with checkpoint.Manager(directory / "steps", max_to_keep=1) as steps:
    steps.save(1, build(7))
    steps.save(2, build(8), optimizer=optimizer(build(8)))
    target = build(9)
    info = steps.restore(target)
    assert steps.all_steps() == [2] and info["step"] == 2
  np.testing.assert_array_equal(gather(target.dly.quant.x_amax[...]),
                                np.full((), 8 + 3 / 8, np.float32))
  checks.append("Manager: latest step kept and restored")
  sync("done")
  print(f"process {jax.process_index()}:", "; ".join(checks))
  print("checks passed")


if __name__ == "__main__":
  _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
