"""FSDP training and a checkpoint round trip over 8 CPU devices, in one
process or in two processes of 4 devices (``jax.distributed`` on localhost,
gloo CPU collectives). Run by test_sharding_multiprocess.py::

  multiprocess_cases.py OUT CKPT_DIR                      # one process
  multiprocess_cases.py OUT CKPT_DIR PORT PROCESS_ID      # one of two

Process 0 (or the single process) writes ``{"losses", "repeated",
"checkpoint"}`` to OUT: the losses of 3 steps and of the same 8 steps run
twice from one state (written first, on their own), then of 2 more
steps after the model and optimizer were saved with `qlayers.checkpoint` and
restored into fresh ones (or the error that stopped the checkpoint part).
Process 1 writes the same to ``OUT.1``.
"""

import pathlib
import sys
import traceback

import jax

ARGS = sys.argv[1:]
if len(ARGS) == 4:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{ARGS[2]}",
                             num_processes=2, process_id=int(ARGS[3]))

import json  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import qlayers  # noqa: E402

import sharded_training as st  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

REPEAT_STEPS = 8


def _global(mesh, value, spec):
  """A global array from the same host value on every process."""
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                      lambda idx: value[idx])


def _build(mesh, seed):
  model = st.MLP("fp8_delayed", rngs=nnx.Rngs(seed))
  opt = st.optimizer(model)
  state = nnx.state((model, opt))
  # Every process builds the same values; each keeps its shards.
  placed = jax.tree_util.tree_map_with_path(
      lambda p, v: _global(mesh, v, _spec_for(p, v)), state)
  nnx.update((model, opt), placed)
  return model, opt


def _spec_for(path, v):
  name = st._path(path)  # pylint: disable=protected-access
  for layer, spec in st.LAYOUTS["fsdp"][3].items():
    if name.endswith(f"{layer}/kernel") and np.ndim(v) == len(spec):
      return spec
  return P()


def main():
  out_path, ckpt_dir = pathlib.Path(ARGS[0]), pathlib.Path(ARGS[1])
  mesh = st.mesh_for("fsdp")
  result = {"process_count": jax.process_count(),
            "devices": jax.device_count()}
  x, y = st.data()
  with jax.set_mesh(mesh):
    xs, ys = _global(mesh, x, P("fsdp")), _global(mesh, y, P("fsdp"))
    model, opt = _build(mesh, 0)
    compiled, first = st.compile_step(model, opt, xs, ys)
    runs = []
    for _ in range(2):  # the same steps twice: bit for bit the same?
      losses, state = [], first
      for _ in range(REPEAT_STEPS):
        loss, state = compiled(state, xs, ys)
        losses.append(float(loss))
      runs.append(losses)
    state = first
    for _ in range(3):
      _, state = compiled(state, xs, ys)
    nnx.update((model, opt), state)
    result["losses"] = runs[0][:3]
    result["repeated"] = runs
    _write(out_path, result)  # in case the checkpoint part hangs
    try:
      path = ckpt_dir / "ckpt"
      qlayers.checkpoint.save(path, model, optimizer=opt)
      fresh, fresh_opt = _build(mesh, 1)
      qlayers.checkpoint.restore(path, fresh, optimizer=fresh_opt)
      # The step compiled above takes the restored state only if its
      # arrays came back with the shardings they were saved with.
      state = nnx.state((fresh, fresh_opt))
      more = []
      for _ in range(2):
        loss, state = compiled(state, xs, ys)
        more.append(float(loss))
      result["checkpoint"] = {"ok": True, "losses": more}
    except Exception as e:  # pylint: disable=broad-except
      result["checkpoint"] = {"ok": False,
                              "error": f"{type(e).__name__}: {e}"[:2000],
                              "traceback": traceback.format_exc()[-4000:]}
  _write(out_path, result)


def _write(path, result):
  """Process 0 writes OUT, any other OUT.<process index> (its own errors)."""
  if jax.process_index():
    path = path.with_name(f"{path.name}.{jax.process_index()}")
  path.write_text(json.dumps(result))


if __name__ == "__main__":
  main()
