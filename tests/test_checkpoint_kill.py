"""`checkpoint.save(..., overwrite=True)` killed with SIGKILL: the directory
always holds the old or the new complete checkpoint, it restores, and the
save can be run again.

Kills land at random times during the save and, since the swap itself takes
microseconds, also exactly around it (the saving process kills itself on
entering a step). Both ways of replacing are run: the atomic exchange and the
two renames used where the file system has no exchange.

The saving processes are forked from one helper process (this file run as a
script) that has imported everything a save needs but started no JAX backend
and no thread, so a trial costs a fork, not an interpreter start.
"""

import importlib
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
from flax import nnx

import qlayers
from qlayers import checkpoint

RANDOM_KILLS = 6  # per way of replacing
# Steps of a save the process kills itself on entering: writing the digests,
# swapping, syncing the directory after the swap; with two renames also the
# second rename.
POINTS = {False: ("_write_json", "_swap_in", "_fsync_dir"),
          True: ("_write_json", "_swap_in", "rename", "_fsync_dir")}


def build(gen: int) -> nnx.Module:
  """A quantized model whose every value (Params and quantization state)
  tells which ``gen`` it is; made without compiling anything."""
  model = nnx.eval_shape(lambda: nnx.Sequential(
      qlayers.QuantDense(32, 64, recipe="fp8_delayed", rngs=nnx.Rngs(0)),
      nnx.Linear(64, 8, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(gen)
  nnx.update(model, nnx.from_flat_state([
      (path, var.replace(jax.device_put(
          rng.standard_normal(var.shape).astype(var.dtype))))
      for path, var in nnx.to_flat_state(nnx.state(model))]))
  return model


def _values(model) -> dict:
  return {"/".join(map(str, p)): np.asarray(v.get_value())
          for p, v in nnx.to_flat_state(nnx.state(model))}


# ----------------------------------------------------------------------------
# The helper process


def _die(*_, **__):
  os.kill(os.getpid(), signal.SIGKILL)


def _kill_at(point: str, path: str) -> None:
  if point == "rename":
    rename = os.rename

    def second_rename(src, dst):
      if os.fspath(dst) == path:  # the old one is already moved aside
        _die()
      rename(src, dst)
    os.rename = second_rename
  elif point != "-":
    setattr(checkpoint, point, _die)


def _fork(fn, *args) -> tuple[int, int]:
  """Runs ``fn(*args, write_fd)`` in a child; returns its pid and the read
  end of the pipe."""
  r, w = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(r)
    try:
      fn(*args, w)
    finally:
      os._exit(1)
  os.close(w)
  return pid, r


def _child(path, gen, fallback, point, ready) -> None:
  if fallback:  # as on a file system without an atomic exchange
    checkpoint._exchange = lambda a, b: False  # pylint: disable=protected-access
  model = build(gen)
  _kill_at(point, path)
  os.write(ready, b"r")
  checkpoint.save(path, model, overwrite=True)
  os._exit(0)


def _scout(scratch, out) -> None:
  """Builds, saves and restores once; reports the modules that imported."""
  before = set(sys.modules)
  checkpoint.save(scratch, build(0))
  checkpoint.restore(scratch, build(1))
  os.write(out, "\n".join(sorted(set(sys.modules) - before)).encode())
  os._exit(0)


def _warm_up(scratch: str) -> None:
  """Imports here what a save imports lazily (learnt from a forked scout)."""
  pid, r = _fork(_scout, scratch)
  with os.fdopen(r, "rb") as f:
    names = f.read().decode().split()
  _, status = os.waitpid(pid, 0)
  assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
  for name in names:
    try:
      importlib.import_module(name)
    except ImportError:  # only importable once a backend runs
      pass


def _serve(scratch: str) -> None:
  """Per line ``path gen fallback point delay`` on stdin: forks a process
  that saves, SIGKILLs it ``delay`` s after it starts saving, answers
  ``killed|done|failed seconds``."""
  _warm_up(scratch)
  print(f"threads {len(os.listdir('/proc/self/task'))}", flush=True)
  for line in sys.stdin:
    path, gen, fallback, point, delay = line.split()
    pid, r = _fork(_child, path, int(gen), fallback == "1", point)
    os.read(r, 1)
    os.close(r)
    start = time.monotonic()
    while time.monotonic() < start + float(delay):
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        break
      time.sleep(0.002)
    else:
      os.kill(pid, signal.SIGKILL)
      _, status = os.waitpid(pid, 0)
    how = ("killed" if os.WIFSIGNALED(status) else
           "done" if os.WEXITSTATUS(status) == 0 else "failed")
    print(how, f"{time.monotonic() - start:.3f}", flush=True)


class _Helper:

  def __init__(self, scratch):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    self.proc = subprocess.Popen(
        [sys.executable, __file__, str(scratch / "scout")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        cwd=os.path.dirname(__file__))
    first = self.proc.stdout.readline()
    assert first == "threads 1\n", f"helper not fork-safe: {first!r}"

  def save(self, path, gen, fallback, point="-", delay=600.0):
    self.proc.stdin.write(f"{path} {gen} {int(fallback)} {point} {delay}\n")
    self.proc.stdin.flush()
    how, seconds = self.proc.stdout.readline().split()
    return how, float(seconds)

  def close(self):
    self.proc.stdin.close()
    self.proc.wait(timeout=60)
    self.proc.stdout.close()


# ----------------------------------------------------------------------------


def test_killed_overwrite_keeps_a_complete_checkpoint(tmp_path):
  rng = random.Random(0)
  cache = {}
  want = lambda gen: cache.setdefault(gen, _values(build(gen)))
  target = build(0)
  helper = _Helper(tmp_path)
  try:
    for fallback in (False, True):
      path = tmp_path / ("two_renames" if fallback else "exchange") / "ckpt"
      path.parent.mkdir()
      how, seconds = helper.save(path, 1, fallback)  # unkilled
      assert how == "done"
      durations, current, outcomes = [seconds], 1, []
      trials = [(p, 600.0) for p in POINTS[fallback]] + [
          ("-", None)] * RANDOM_KILLS
      for point, delay in trials:
        new = current + 1
        if delay is None:
          delay = rng.uniform(0, 1.1 * float(np.median(durations)))
        how, seconds = helper.save(path, new, fallback, point, delay)
        assert how in ("killed", "done"), how
        if how == "done":
          durations.append(seconds)
        at_path = path.is_dir()
        left = sorted(p.name for p in path.parent.iterdir() if p != path)
        assert at_path or fallback, f"nothing at {path} after a kill"
        checkpoint.restore(path, target)  # complete: all digests checked
        got = _values(target)
        same = [g for g in (current, new)
                if all(np.array_equal(got[k], want(g)[k]) for k in got)]
        assert same, f"{point} {delay}: neither the old nor the new values"
        assert how == "killed" or same == [new]
        outcomes.append((point if point != "-" else round(delay, 3), how,
                         "new" if same == [new] else "old", at_path, left))
        current = same[0]
      # The killed saves left no trap: a save from here works and cleans up.
      checkpoint.save(path, build(99), overwrite=True)
      checkpoint.restore(path, target)
      assert all(np.array_equal(v, want(99)[k])
                 for k, v in _values(target).items())
      assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt"]
      print("two renames" if fallback else "exchange",
            np.round(durations, 3), *outcomes, sep="\n")
      point_outcomes = outcomes[:len(POINTS[fallback])]
      assert all(o[1] == "killed" for o in point_outcomes)
      assert [o[2] for o in point_outcomes] == (
          ["old", "old", "new", "new"] if fallback else ["old", "old", "new"])
      if fallback:  # killed between the renames: found beside the path
        assert not point_outcomes[2][3]
  finally:
    helper.close()


if __name__ == "__main__":
  _serve(sys.argv[1])
