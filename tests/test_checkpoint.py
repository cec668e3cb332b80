"""Checkpoints: exact round trips with quantization and optimizer state
and PRNG keys, plain <-> quantized Params, mismatches, damaged checkpoints,
the orbax CheckpointManager behind `checkpoint.Manager`, and format 2."""

import contextlib
import hashlib
import json
import os
import pathlib
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
from qlayers.recipe import from_dict

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


# One transformation for every optimizer here: Nets of one structure then
# share train_step's compilation (a new optax.adam is a new static argument).
ADAM = optax.adam(1e-2)


@nnx.jit
def train_step(model, opt, x, y):
  loss, grads = qlayers.value_and_grad(_loss)(model, x, y)
  opt.update(model, grads)
  return loss


@nnx.jit
def apply(model, x):
  return model(x)


def pure(tree):
  """Variables as a flat {path: numpy array} dict (PRNG keys as key data)."""
  key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  return {"/".join(map(str, p)): np.asarray(
      jax.random.key_data(x) if key(x := v.get_value()) else x)
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
  opt = qlayers.Optimizer(model, ADAM)
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
  fresh_opt = qlayers.Optimizer(fresh, ADAM)
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


def test_the_recorded_version_is_the_package_s():
  """The version a checkpoint records (``qlayers.__version__``) is the one
  pip installs (pyproject.toml's)."""
  import tomllib  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).resolve().parents[1]
  with open(root / "pyproject.toml", "rb") as f:
    assert tomllib.load(f)["project"]["version"] == qlayers.__version__


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
  # Digests cover every file of the directory but their own and the two
  # that orbax's rename step writes (the description has its own digest).
  renaming = {"_CHECKPOINT_METADATA", "commit_success.txt"}
  files = {f.relative_to(path).as_posix(): f for f in path.rglob("*")
           if f.is_file() and f.name != "qlayers.json"}
  assert meta["files"].keys() == files.keys() - renaming
  assert files.keys() >= renaming
  digests = json.loads((path / "qlayers.json").read_text())
  assert digests["format_version"] == 3
  assert digests["description_sha256"] == hashlib.sha256(json.dumps(
      orbax_meta["custom_metadata"], sort_keys=True).encode()).hexdigest()
  assert {k.split("/")[0] for k in files} >= {"model", "quant", "optimizer"}
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
  # A recipe's name and description are not its numerics: a full restore.
  same = qlayers.recipe(RECIPE).replace(name="mine", description="edited")
  assert checkpoint.restore(path, build(recipe=same))["restored"] == "full"
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
                     "qlayers reads versions 2 and 3"):
    checkpoint.restore(copy, target)

  copy = shutil.copytree(path, tmp_path / "copy2")
  shutil.rmtree(copy / "quant")
  with pytest.raises(CheckpointCorruptError, match=r"damaged:\n  quant/.* is "
                     "missing"):
    checkpoint.restore(copy, target)
  checkpoint.restore(copy, Net(), params_only=True)  # quant/ not needed

  copy = shutil.copytree(path, tmp_path / "copy3")
  (copy / "_CHECKPOINT_METADATA").unlink()  # orbax's metadata, with ours
  with pytest.raises(CheckpointCorruptError, match="orbax cannot read its "
                     "_CHECKPOINT_METADATA"):
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


def test_restore_refuses_what_is_not_an_optimizer(tmp_path):
  model = Net()
  checkpoint.save(tmp_path / "c", model)
  with pytest.raises(TypeError, match="optimizer must be an nnx.Optimizer, "
                     "got Net"):
    checkpoint.restore(tmp_path / "c", model, optimizer=model)


# ----------------------------------------------------------------------------
# PRNG keys (issue 24, item 6)


class Dropped(nnx.Module):
  """A block holding its own dropout key stream, as MiniGPT's blocks do
  (only its dropout is applied here)."""

  def __init__(self, seed, spec=None):
    rng = np.random.default_rng(seed)
    init = lambda key, shape, dtype: rng.standard_normal(shape).astype(dtype)
    self.up = nnx.Linear(32, 32, kernel_init=init if spec is None else
                         nnx.with_partitioning(init, spec), rngs=nnx.Rngs(0))
    self.drop = nnx.Dropout(0.1, rngs=nnx.Rngs(dropout=seed))


def test_prng_keys_round_trip_with_and_without_a_mesh(tmp_path):
  """Plain without a mesh, quantized on a 1x1 mesh (both failed before)."""
  mesh = jax.make_mesh((1, 1), ("data", "model"))
  ones = jnp.ones((4, 8))
  for recipe, spec in ((None, None), ("fp8_delayed", (None, "model"))):
    with jax.set_mesh(mesh) if spec else contextlib.nullcontext():
      def make(seed):
        model = Dropped(seed, spec)
        if recipe:
          qlayers.quantize(model, recipe, strict=True)
        return model
      source = make(3)
      source.drop.rngs.count[...] = jnp.uint32(5)  # the stream moved on
      checkpoint.save(tmp_path / str(recipe), source)
      target = make(4)
      checkpoint.restore(tmp_path / str(recipe), target)
      got, want = pure(nnx.state(target)), pure(nnx.state(source))
      assert got.keys() == want.keys()
      for k in got:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
      assert int(target.drop.rngs.count[...]) == 5
      assert jax.random.key_impl(target.drop.rngs.key[...]) == \
          jax.random.key_impl(source.drop.rngs.key[...])
      # The next dropout mask is the one the source draws.
      np.testing.assert_array_equal(np.asarray(target.drop(ones)),
                                    np.asarray(source.drop(ones)))


def test_prng_keys_restore_into_an_abstract_target(tmp_path):
  """An nnx.eval_shape target holds its keys abstract: key_data refused
  them, so no model with a Dropout restored that way."""
  source = Dropped(3)
  source.drop.rngs.count[...] = jnp.uint32(5)
  checkpoint.save(tmp_path / "c", source)
  target = nnx.eval_shape(lambda: Dropped(4))
  checkpoint.restore(tmp_path / "c", target)
  assert_same(nnx.state(source), nnx.state(target))
  ones = jnp.ones((4, 8))
  np.testing.assert_array_equal(np.asarray(target.drop(ones)),
                                np.asarray(source.drop(ones)))


class Count(nnx.Variable):
  pass


class Scalars(nnx.Module):
  """Variables holding Python scalars, as Flax's NNX examples make them."""

  def __init__(self, temperature=1.0, calls=0):
    self.temperature = nnx.Param(temperature)
    self.calls = Count(calls)


def test_a_python_int_jax_cannot_hold_is_named(tmp_path):
  with pytest.raises(ValueError, match="calls holds 2147483648, which does "
                     "not fit JAX's int32"):
    checkpoint.save(tmp_path / "c", Scalars(1.5, 2**31))


def test_python_scalar_variables_round_trip(tmp_path):
  # Orbax saved 1.0 and 0 as float64 and int64, which no model (x64 off)
  # restored: the checkpoint never fit the model that wrote it.
  checkpoint.save(tmp_path / "c", Scalars(1.5, 7))
  target = Scalars()
  checkpoint.restore(tmp_path / "c", target)
  assert target.temperature[...] == 1.5 and target.calls[...] == 7
  assert (np.dtype(target.temperature[...].dtype),
          np.dtype(target.calls[...].dtype)) == (np.float32, np.int32)


# ----------------------------------------------------------------------------
# Digests before the description; no file unlisted (issue 24, item 14)


def test_flipped_bit_in_the_recipe_metadata_is_corruption(trained, tmp_path):
  _, _, path, _ = trained
  for text, flip_at in (('"name": "fp8_delayed"', -2),  # 'd' -> 'e'
                        ('"amax_history_len": 16', -1)):  # 16 -> 17
    copy = shutil.copytree(path, tmp_path / f"c{flip_at}")
    file = copy / "_CHECKPOINT_METADATA"
    raw = bytearray(file.read_bytes())
    config = raw.index(b'"recipe_config"')  # what restore compares
    raw[raw.index(text.encode(), config) + len(text) + flip_at] ^= 1
    file.write_bytes(bytes(raw))
    json.loads(raw)  # still valid JSON: only the digest tells
    with pytest.raises(CheckpointCorruptError, match="description in "
                       "_CHECKPOINT_METADATA changed since it was saved"):
      checkpoint.restore(copy, build(seed=6))
    with pytest.raises(CheckpointCorruptError):
      checkpoint.read_metadata(copy)


def test_an_emptied_or_shortened_digest_list_hides_no_flipped_byte(
    trained, tmp_path):
  _, _, path, _ = trained
  copy = shutil.copytree(path, tmp_path / "c")
  data = _largest_data_file(copy / "model")
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 1
  data.write_bytes(bytes(raw))
  rel = data.relative_to(copy).as_posix()
  digests = json.loads((copy / "qlayers.json").read_text())
  shortened = {k: v for k, v in digests["files"].items() if k != rel}
  for files, unlisted in (({}, "model/_METADATA"), (shortened, rel)):
    (copy / "qlayers.json").write_text(json.dumps({**digests, "files": files}))
    with pytest.raises(CheckpointCorruptError,
                       match=f"{unlisted} is not listed in qlayers.json"):
      checkpoint.restore(copy, build(seed=6))


# ----------------------------------------------------------------------------
# Manager: orbax's CheckpointManager


def test_manager_keeps_the_latest_steps_and_saves_async(tmp_path):
  model = build(seed=0)
  opt = qlayers.Optimizer(model, ADAM)
  snapshots = {}
  with checkpoint.Manager(tmp_path, max_to_keep=2, async_save=True) as m:
    assert m.latest_step() is None
    for step in range(3):
      train_step(model, opt, X, Y)
      assert m.save(step, model, optimizer=opt) == tmp_path / str(step)
      snapshots[step] = pure(nnx.state(model)), pure(nnx.state(opt))
    fresh = build(seed=1)
    fresh_opt = qlayers.Optimizer(fresh, ADAM)
    for step in (None, 1):
      info = m.restore(fresh, step=step, optimizer=fresh_opt)
      want = 2 if step is None else step
      assert (info["step"], info["restored"]) == (want, "full")
      for got, saved in zip((pure(nnx.state(fresh)),
                             pure(nnx.state(fresh_opt))), snapshots[want]):
        for k in saved:
          np.testing.assert_array_equal(got[k], saved[k], err_msg=k)
    assert m.all_steps() == [1, 2]
  assert sorted(os.listdir(tmp_path)) == ["1", "2"]
  with pytest.raises(CheckpointCorruptError, match=r"holds the steps \[1, 2\] "
                     r"of a checkpoint.Manager"):
    checkpoint.restore(tmp_path, fresh)
  with pytest.raises(FileNotFoundError, match="No checkpoint"):
    checkpoint.Manager(tmp_path / "empty").restore(fresh)


def test_manager_removes_what_killed_saves_left(tmp_path):
  """A save killed before orbax's rename leaves ``<step>.orbax-checkpoint-
  tmp[-<timestamp>]`` (names of this and older orbax): the next Manager's
  save of any step removes it. (tests/test_checkpoint_kill.py kills real
  saves.)"""
  model = Net()
  with checkpoint.Manager(tmp_path) as m:
    m.save(1, model)
  for name in ("2.orbax-checkpoint-tmp", "3.orbax-checkpoint-tmp-1764740000"):
    shutil.copytree(tmp_path / "1", tmp_path / name)
    (tmp_path / name / "qlayers.json").unlink()
  with checkpoint.Manager(tmp_path) as m:
    assert m.all_steps() == [1]
    m.save(7, model)
  assert sorted(os.listdir(tmp_path)) == ["1", "7"]
  # A single checkpoint: the next save to the same path removes its leftover.
  shutil.copytree(tmp_path / "1", tmp_path / "c.orbax-checkpoint-tmp")
  checkpoint.save(tmp_path / "c", model)
  assert sorted(os.listdir(tmp_path)) == ["1", "7", "c"]


# ----------------------------------------------------------------------------
# Format 2 (qlayers 0.2)


class Legacy(nnx.Module):
  """The model of tests/data/checkpoint_v2, which qlayers' format-2 code
  wrote (commit 7c40ec7) after setting each array to `_legacy_values`."""

  def __init__(self):
    self.dense = qlayers.QuantDense(
        8, 4, recipe=qlayers.recipe("fp8_delayed", amax_history_len=4),
        rngs=nnx.Rngs(0))
    self.drop = nnx.Dropout(0.1, rngs=nnx.Rngs(dropout=7))


def _legacy_values(model) -> dict:
  """Flat state order i: arange * 0.25 + i + 1 (PRNG keys as built)."""
  return {k: v if k.endswith("rngs/key") else
          (np.arange(v.size) * 0.25 + i + 1).reshape(v.shape).astype(v.dtype)
          for i, (k, v) in enumerate(pure(nnx.state(model)).items())}


def test_format_2_checkpoint_loads(tmp_path):
  path = shutil.copytree(pathlib.Path(__file__).parent / "data" /
                         "checkpoint_v2", tmp_path / "v2")
  target = Legacy()
  want = _legacy_values(target)
  info = checkpoint.restore(path, target)
  assert (info["format_version"], info["restored"]) == (2, "full")
  got = pure(nnx.state(target))
  assert got.keys() == want.keys()
  for k in got:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert int(got["drop/rngs/count"]) == 9
  # Its digests still guard it: a flipped bit in its recipe text is caught.
  file = path / "_CHECKPOINT_METADATA"
  raw = bytearray(file.read_bytes())
  raw[raw.index(b'"recipe": "fp8_delayed"') + 21] ^= 1
  file.write_bytes(bytes(raw))
  with pytest.raises(CheckpointCorruptError, match="_CHECKPOINT_METADATA "
                     "changed since it was saved"):
    checkpoint.restore(path, Legacy())


def test_manager_refuses_steps_out_of_order_until_the_later_are_deleted(
    tmp_path):
  # A save of step 15 after 30 used to go through (orbax forced): keep-2
  # then deleted 20, kept the abandoned 30, and a restarted run resumed it.
  model = build(seed=0)
  with checkpoint.Manager(tmp_path, max_to_keep=2) as m:
    for step in (10, 20, 30):
      m.save(step, model)
    with pytest.raises(ValueError, match="not after the latest saved step 30"):
      m.save(15, model)
    for bad in ("40", 1.5, True):
      with pytest.raises(TypeError, match="step must be an integer"):
        m.save(bad, model)
    with pytest.raises(ValueError, match="step must be >= 0"):
      m.save(-1, model)
    for later in (20, 30):
      m.delete(later)
    m.save(jnp.int32(15), model)  # the rollback, once the later steps are gone
    assert m.all_steps() == [15]  # keep-2 had dropped 10 already
    with pytest.raises(FileNotFoundError, match="No step 99"):
      m.delete(99)
  assert checkpoint.Manager(tmp_path).latest_step() == 15
  for keep in (0, -1, 2.0):
    with pytest.raises((TypeError, ValueError), match="max_to_keep"):
      checkpoint.Manager(tmp_path / "k", max_to_keep=keep)
  checkpoint.Manager(tmp_path / "k", max_to_keep=np.int64(3)).close()


def test_manager_delete_and_restore_take_integer_steps(tmp_path):
  # delete("1") said "No step 1 ...; saved: [1]".
  model = Scalars()
  with checkpoint.Manager(tmp_path) as m:
    for step in (1, 2):
      m.save(step, model)
    for bad in ("1", 1.0):
      with pytest.raises(TypeError, match="step must be an integer"):
        m.delete(bad)
      with pytest.raises(TypeError, match="step must be an integer"):
        m.restore(model, step=bad)
    assert type(m.restore(model, step=np.int64(1))["step"]) is int
    m.delete(jnp.int32(1))
    assert m.all_steps() == [2]


def test_params_only_restarts_the_rounding_counter(tmp_path):
  model = qlayers.QuantDense(32, 32, recipe="nvfp4", rngs=nnx.Rngs(0))
  checkpoint.save(tmp_path / "c", model)
  model.quant.sr_step.set_value(jnp.uint32(3))
  seed = int(model.quant.sr_seed[...])
  assert checkpoint.restore(tmp_path / "c", model,
                            params_only=True)["restored"] == "params_only"
  assert (int(model.quant.sr_step[...]), int(model.quant.sr_seed[...])) == (
      0, seed)


def test_params_only_keeps_the_seeds_of_a_delayed_recipe(tmp_path):
  """Delayed scaling's reset took a fresh QuantGemm's state, seeds (0)
  included: equal-shaped layers then rounded alike."""
  e4m3, e5m2 = {"format": "e4m3"}, {"format": "e5m2",
                                    "rounding": "stochastic"}
  recipe = from_dict({"name": "fp8_delayed_sr", "scaling": "delayed",
                      "amax_history_len": 16, "sr_key": "step",
                      "defaults": {"granularity": "tensor"},
                      "fprop": {"x": e4m3, "w": e4m3},
                      "dgrad": {"g": e5m2, "w": e4m3},
                      "wgrad": {"x": e4m3, "g": e5m2}})
  model = qlayers.QuantDense(16, 16, recipe=recipe, rngs=nnx.Rngs(0))
  checkpoint.save(tmp_path / "c", model)
  s = model.quant
  seed = int(s.sr_seed[...])
  assert seed not in (0, 1)  # seeded from the weights
  s.sr_step.set_value(jnp.uint32(3))
  s.x_amax_history.set_value(jnp.ones_like(s.x_amax_history[...]))
  checkpoint.restore(tmp_path / "c", model, params_only=True)
  assert (int(s.sr_step[...]), int(s.sr_seed[...])) == (0, seed)
  assert not np.any(np.asarray(s.x_amax_history[...]))  # fresh


def test_delayed_settings_do_not_block_a_restore_between_current_recipes(
    tmp_path):
  layer = qlayers.QuantDense(32, 32, recipe="fp8_current", rngs=nnx.Rngs(0))
  checkpoint.save(tmp_path / "c", layer)
  other = qlayers.QuantDense(
      32, 32, recipe=qlayers.recipe("fp8_current").replace(
          amax_history_len=16),  # recipe(..., amax_history_len=) refuses it
      rngs=nnx.Rngs(1))
  assert checkpoint.restore(tmp_path / "c", other)["restored"] == "full"
  delayed = qlayers.QuantDense(
      32, 32, recipe=qlayers.recipe("fp8_delayed", amax_history_len=16),
      rngs=nnx.Rngs(1))
  with pytest.raises(CheckpointMismatchError, match="amax_history_len"):
    checkpoint.restore(tmp_path / "c", delayed, params_only=False)
