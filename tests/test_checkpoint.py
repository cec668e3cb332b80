"""Checkpoints: exact round trips with quantization and optimizer state,
plain <-> quantized Params, mismatches and damaged checkpoints."""

import hashlib
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import qlayers
from qlayers import checkpoint
from qlayers.checkpoint import CheckpointCorruptError, CheckpointMismatchError

RECIPE = qlayers.recipe("fp8_delayed", amax_history_len=16)
X = jax.random.normal(jax.random.key(0), (16, 32))
Y = jax.random.normal(jax.random.key(1), (16, 8))


class Net(nnx.Module):

  def __init__(self, seed=0, d=32):
    # NumPy-drawn kernels: random init in JAX compiles a program per shape.
    rng = np.random.default_rng(seed)
    init = lambda key, shape, dtype: (
        rng.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype)
    kw = dict(kernel_init=init, rngs=nnx.Rngs(seed))
    self.up = nnx.Linear(d, 2 * d, **kw)
    self.down = nnx.Linear(2 * d, d, **kw)
    self.norm = nnx.LayerNorm(d, rngs=nnx.Rngs(seed))
    self.head = nnx.Linear(d, 8, **kw)

  def __call__(self, x):
    return self.head(self.norm(x + self.down(jax.nn.gelu(self.up(x)))))


def build(seed=0, recipe=RECIPE, rules=None, d=32):
  """A Net; quantized (head kept wide by default) unless recipe is None."""
  model = Net(seed, d)
  if recipe is not None or rules is not None:
    qlayers.quantize(model, recipe, rules, strict=True)
  return model


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def train_step(model, opt, x, y):
  loss, grads = qlayers.value_and_grad(_loss)(model, x, y)
  opt.update(model, grads)
  return loss


@nnx.jit
def apply(model, x):
  return model(x)


def pure(tree):
  """Variables as a flat {path: numpy array} dict."""
  return {"/".join(map(str, p)): np.asarray(v.get_value())
          for p, v in nnx.to_flat_state(tree)}


def assert_same(a, b):
  a, b = pure(a), pure(b)
  assert a.keys() == b.keys()
  for k in a:
    assert a[k].dtype == b[k].dtype, k
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A quantized model and optimizer after 3 steps, and their checkpoint."""
  model = build(seed=0)
  opt = qlayers.Optimizer(model, optax.adam(1e-2))
  for _ in range(3):
    train_step(model, opt, X, Y)
  path = tmp_path_factory.mktemp("ckpt") / "step3"
  saved = checkpoint.save(path, model, optimizer=opt)
  assert saved == path
  snapshot = pure(nnx.state(model))
  return model, opt, path, snapshot


def test_round_trip_is_bit_exact_and_training_continues(trained):
  model, opt, path, _ = trained
  fresh = build(seed=1)
  fresh_opt = qlayers.Optimizer(fresh, optax.adam(1e-2))
  info = checkpoint.restore(path, fresh, optimizer=fresh_opt)
  assert info["restored"] == "full"

  assert_same(nnx.state(model), nnx.state(fresh))  # Params and quant state
  assert_same(nnx.state(opt), nnx.state(fresh_opt))
  quant = pure(nnx.state(fresh, qlayers.QuantVariable))
  assert {v.dtype for v in quant.values()} == {np.dtype(np.float32)}
  assert quant["up/quant/x_amax_history"].shape == (16,)
  assert np.all(quant["up/quant/x_amax_history"][:3] > 0)

  np.testing.assert_array_equal(np.asarray(apply(model, X)),
                                np.asarray(apply(fresh, X)))
  x2, y2 = X * 2, Y[::-1]
  l1 = train_step(model, opt, x2, y2)
  l2 = train_step(fresh, fresh_opt, x2, y2)
  assert float(l1) == float(l2)
  assert_same(nnx.state(model), nnx.state(fresh))
  assert_same(nnx.state(opt), nnx.state(fresh_opt))


def test_metadata_records_recipes_and_file_digests(trained):
  _, _, path, _ = trained
  meta = checkpoint.read_metadata(path)
  assert meta["qlayers_version"] == qlayers.__version__
  assert meta["items"] == ["model", "quant", "optimizer"]
  assert meta["has_optimizer"] is True
  assert sorted(meta["layers"]) == ["down", "up"]
  up = meta["layers"]["up"]
  assert (up["type"], up["recipe"], up["scaling"], up["amax_history_len"]) \
      == ("QuantDense", "fp8_delayed", "delayed", 16)
  assert up["recipe_config"]["amax_history_len"] == 16
  # The description is orbax's custom step metadata, written by orbax.
  orbax_meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
  assert orbax_meta["custom_metadata"]["layers"] == meta["layers"]
  # Digests cover every file of the directory but their own.
  files = {f.relative_to(path).as_posix(): f for f in path.rglob("*")
           if f.is_file() and f.name != "qlayers.json"}
  assert meta["files"].keys() == files.keys()
  assert {k.split("/")[0] for k in files} >= {"model", "quant", "optimizer",
                                              "_CHECKPOINT_METADATA"}
  for rel, rec in meta["files"].items():
    assert rec["size"] == files[rel].stat().st_size
    assert rec["sha256"] == hashlib.sha256(files[rel].read_bytes()).hexdigest()
  # Orbax records the tree, shapes and dtypes: nothing of that is repeated.
  assert "variables" not in meta
  assert not list(path.parent.glob(".step3*"))  # no staging left behind


def test_plain_checkpoint_into_quantized_model(tmp_path):
  plain = Net(seed=2)
  checkpoint.save(tmp_path / "plain", plain)
  target = build(seed=3)
  apply(target, X)
  qlayers.update_scales(target)  # quantization state no longer fresh
  info = checkpoint.restore(tmp_path / "plain", target)
  assert info["restored"] == "params_only"
  assert_same(nnx.state(plain, nnx.Param), nnx.state(target, nnx.Param))
  for layer in (target.up, target.down):
    assert_same(nnx.state(qlayers.QuantGemm(RECIPE)),
                nnx.state(layer.quant))


def test_quantized_checkpoint_params_into_plain_model(trained):
  _, _, path, snapshot = trained
  plain = Net(seed=4)
  info = checkpoint.restore(path, plain)
  assert info["restored"] == "params_only"
  got = pure(nnx.state(plain))
  assert got.keys() == {k for k in snapshot if "/quant/" not in k}
  for k, v in got.items():
    np.testing.assert_array_equal(v, snapshot[k], err_msg=k)


def test_mismatches_raise_and_leave_the_target_untouched(trained, tmp_path):
  _, _, path, snapshot = trained

  def fails(target, match, **kw):
    before = pure(nnx.state(target))
    with pytest.raises(CheckpointMismatchError, match=match):
      checkpoint.restore(path, target, **kw)
    after = pure(nnx.state(target))
    assert all(np.array_equal(before[k], after[k]) for k in before)

  fails(build(recipe="fp8_delayed"), r"amax_history_len: 16 vs 1024")
  fails(build(recipe="fp8_current"), r"scaling: 'delayed' vs 'current'")
  only_up = [qlayers.Rule(pattern="^up$", recipe=RECIPE)]
  fails(build(recipe=None, rules=only_up),
        r"(?s)quantized in the checkpoint but not in the model:\n  down: "
        r"QuantDense recipe 'fp8_delayed' \(delayed scaling, "
        r"amax_history_len=16\)")
  fails(build(recipe=None, rules=[qlayers.Rule(pattern=".", recipe=RECIPE)]),
        r"(?s)quantized in the model but not in the checkpoint:\n  head")
  fails(build(d=48), r"(?s)model Variables that differ:\n  down/bias: "
        r"checkpoint \(32,\) float32, model \(48,\) float32")
  fails(build(), r"(?s)checkpoint Variables the optimizer does not have:\n"
        r"  opt_state/inner_state/0/count",
        optimizer=qlayers.Optimizer(build(), optax.sgd(0.1)))
  # Asked explicitly, a recipe change loads the Params only.
  target = build(recipe="fp8_current")
  info = checkpoint.restore(path, target, params_only=True)
  assert info["restored"] == "params_only"
  np.testing.assert_array_equal(np.asarray(target.up.kernel[...]),
                                snapshot["up/kernel"])

  checkpoint.save(tmp_path / "plain", Net(seed=5))
  with pytest.raises(CheckpointMismatchError, match="up: QuantDense"):
    checkpoint.restore(tmp_path / "plain", build(), params_only=False)
  with pytest.raises(CheckpointMismatchError, match="no optimizer state"):
    checkpoint.restore(tmp_path / "plain", Net(),
                       optimizer=qlayers.Optimizer(Net(), optax.sgd(0.1)))


def test_missing_and_damaged_checkpoints(trained, tmp_path):
  _, _, path, _ = trained
  target = build(seed=6)
  before = pure(nnx.state(target))
  with pytest.raises(FileNotFoundError, match="No checkpoint"):
    checkpoint.restore(tmp_path / "nothing", target)
  (tmp_path / "file").write_text("x")
  with pytest.raises(CheckpointCorruptError, match="not a checkpoint dir"):
    checkpoint.restore(tmp_path / "file", target)

  copy = shutil.copytree(path, tmp_path / "copy")
  (copy / "qlayers.json").unlink()
  with pytest.raises(CheckpointCorruptError, match="did not finish"):
    checkpoint.restore(copy, target)
  (copy / "qlayers.json").write_text("{not json")
  with pytest.raises(CheckpointCorruptError, match="not readable JSON"):
    checkpoint.restore(copy, target)
  (copy / "qlayers.json").write_text(json.dumps(
      {"format": "qlayers-checkpoint", "format_version": 1, "files": {}}))
  with pytest.raises(CheckpointCorruptError, match="format version 1; this "
                     "qlayers reads version 2"):
    checkpoint.restore(copy, target)

  copy = shutil.copytree(path, tmp_path / "copy2")
  shutil.rmtree(copy / "quant")
  with pytest.raises(CheckpointCorruptError, match=r"damaged:\n  quant/.* is "
                     "missing"):
    checkpoint.restore(copy, target)
  checkpoint.restore(copy, Net(), params_only=True)  # quant/ not needed

  copy = shutil.copytree(path, tmp_path / "copy3")
  (copy / "_CHECKPOINT_METADATA").unlink()  # orbax's metadata, with ours
  with pytest.raises(CheckpointCorruptError, match="lacks the qlayers "
                     "description"):
    checkpoint.restore(copy, target)

  copy = shutil.copytree(path, tmp_path / "copy4")
  data = _largest_data_file(copy / "model")
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 1  # one flipped bit, same size
  data.write_bytes(bytes(raw))
  with pytest.raises(CheckpointCorruptError, match="SHA-256 differs"):
    checkpoint.restore(copy, target)
  data.write_bytes(bytes(raw[:-7]))
  with pytest.raises(CheckpointCorruptError,
                     match=rf"{len(raw) - 7} bytes, {len(raw)} when saved"):
    checkpoint.restore(copy, target, verify=False)
  after = pure(nnx.state(target))
  assert all(np.array_equal(before[k], after[k]) for k in before)


def _largest_data_file(item):
  return max((f for f in item.rglob("*") if f.is_file()
              and "/d/" in f.as_posix()), key=lambda f: f.stat().st_size)


def test_orbax_alone_misses_a_flipped_bit_that_digests_catch(tmp_path):
  """Why the digests are kept: orbax restores a flipped bit in an array's
  data file as a wrong value, without an error."""
  import orbax.checkpoint as ocp

  model = Net(seed=7, d=64)
  path = checkpoint.save(tmp_path / "c", model)
  saved = nnx.to_pure_dict(nnx.state(model))
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        saved)
  data = _largest_data_file(path / "model")
  raw = data.read_bytes()
  silent = 0
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    for pos in range(len(raw) // 4, len(raw), len(raw) // 4):
      flipped = bytearray(raw)
      flipped[pos] ^= 1
      data.write_bytes(bytes(flipped))
      with pytest.raises(CheckpointCorruptError, match="SHA-256 differs"):
        checkpoint.restore(path, Net(seed=8, d=64))
      try:
        got = ckptr.restore(path, ocp.args.Composite(
            model=ocp.args.StandardRestore(target)))["model"]
      except Exception:  # orbax noticed this one
        continue
      silent += not all(jax.tree.leaves(jax.tree.map(
          lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), got,
          saved)))
  assert silent >= 1
  data.write_bytes(raw)
  fresh = Net(seed=8, d=64)
  checkpoint.restore(path, fresh)
  assert_same(nnx.state(model), nnx.state(fresh))


def test_params_only_restore_keeps_stacked_state_shapes(tmp_path):
  """A stack made with nnx.vmap (applied with nnx.scan) and converted keeps
  its (3, history) state through a params-only restore."""

  class Stacked(nnx.Module):

    def __init__(self, seed):
      @nnx.split_rngs(splits=3)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return nnx.Linear(16, 16, rngs=rngs)
      self.layers = make(nnx.Rngs(seed))

    def __call__(self, x):
      @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
      def body(layer, x):
        return jax.nn.tanh(layer(x))
      return body(self.layers, x)

  def stack(seed, recipe):
    model = Stacked(seed)
    if recipe is not None:
      qlayers.quantize(model, recipe, strict=True)
    return model

  source = stack(0, "fp8_delayed")
  apply(source, X[:, :16])
  qlayers.update_scales(source)
  checkpoint.save(tmp_path / "q", source)
  checkpoint.save(tmp_path / "plain", stack(1, None))
  for ckpt in ("q", "plain"):
    target = stack(2, "fp8_delayed")
    info = checkpoint.restore(tmp_path / ckpt, target, params_only=True)
    assert info["restored"] == "params_only"
    s = target.layers.quant
    assert s.x_amax_history.shape == (3, 1024) and s.x_amax.shape == (3,)
    assert s.g_amax.shape == (3,)
    assert not np.any(np.asarray(s.x_amax_history[...]))  # fresh
  # A full restore brings the stacked state back as it was.
  target = stack(2, "fp8_delayed")
  checkpoint.restore(tmp_path / "q", target)
  assert_same(nnx.state(source), nnx.state(target))
  hist = np.asarray(target.layers.quant.x_amax_history[...])
  assert hist.shape == (3, 1024) and np.all(hist[:, 0] > 0)


def test_save_refuses_to_overwrite(tmp_path):
  model = Net()
  checkpoint.save(tmp_path / "c", model)
  with pytest.raises(FileExistsError, match="overwrite=True"):
    checkpoint.save(tmp_path / "c", model)
  checkpoint.save(tmp_path / "c", model, overwrite=True)
  assert checkpoint.read_metadata(tmp_path / "c")["items"] == ["model"]
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "keep.txt").write_text("mine")
  with pytest.raises(FileExistsError, match="not a qlayers checkpoint"):
    checkpoint.save(tmp_path / "other", model, overwrite=True)
  assert (tmp_path / "other" / "keep.txt").read_text() == "mine"
  with pytest.raises(TypeError, match="nnx.Module"):
    checkpoint.save(tmp_path / "d", {"w": jnp.ones(2)})
