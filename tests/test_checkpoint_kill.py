"""`checkpoint.Manager.save` killed with SIGKILL: every step the next Manager
lists is complete and restores exactly (all digests checked), the killed
step is either complete or absent, and what a killed save left is removed
by the next save that finishes (of any step).

Kills land at random times during a save and, since the end of a save
takes milliseconds, also exactly in orbax's finalize step: as qlayers'
digests are about to be written, and after they are written but before
orbax's rename (the saving process kills itself there).

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
from qlayers import _checkpoint_checks as checks
from qlayers import checkpoint

RANDOM_KILLS = 4
POINTS = ("before_digests", "before_rename")  # in orbax's finalize step
TMP = ".orbax-checkpoint-tmp"  # orbax's name for an unfinished step


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


def _kill_at(point: str) -> None:
  write = checks._write  # pylint: disable=protected-access
  if point == "before_digests":
    checks._write = _die
  elif point == "before_rename":
    checks._write = lambda path: (write(path), _die())


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


def _child(directory, step, point, ready) -> None:
  model = build(step)
  _kill_at(point)
  with checkpoint.Manager(directory) as manager:
    os.write(ready, b"r")
    manager.save(step, model)
  os._exit(0)


def _scout(scratch, out) -> None:
  """Saves and restores once; reports the modules that imported."""
  before = set(sys.modules)
  with checkpoint.Manager(scratch) as manager:
    manager.save(0, build(0))
    manager.restore(build(1))
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
  """Per line ``directory step point delay`` on stdin: forks a process that
  saves, SIGKILLs it ``delay`` s after it starts saving, answers
  ``killed|done|failed seconds``."""
  _warm_up(scratch)
  print(f"threads {len(os.listdir('/proc/self/task'))}", flush=True)
  for line in sys.stdin:
    directory, step, point, delay = line.split()
    pid, r = _fork(_child, directory, int(step), point)
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

  def save(self, directory, step, point="-", delay=600.0):
    self.proc.stdin.write(f"{directory} {step} {point} {delay}\n")
    self.proc.stdin.flush()
    how, seconds = self.proc.stdout.readline().split()
    return how, float(seconds)

  def close(self):
    self.proc.stdin.close()
    self.proc.wait(timeout=60)
    self.proc.stdout.close()


# ----------------------------------------------------------------------------


def test_killed_saves_leave_complete_steps_and_no_leftovers(tmp_path):
  rng = random.Random(0)
  directory = tmp_path / "steps"
  helper = _Helper(tmp_path)
  target = build(0)
  try:
    how, seconds = helper.save(directory, 1)  # unkilled
    assert how == "done"
    durations, outcomes, leftovers, complete = [seconds], [], set(), {1}
    trials = [(p, 600.0) for p in POINTS] + [("-", None)] * RANDOM_KILLS
    for step, (point, delay) in enumerate(trials, start=2):
      if delay is None:
        delay = rng.uniform(0, 1.5 * float(np.median(durations)))
      how, seconds = helper.save(directory, step, point, delay)
      assert how in ("killed", "done"), how
      if how == "done":
        durations.append(seconds)
      # Read without a Manager (a new Manager would clean up itself).
      names = {p.name for p in directory.iterdir()}
      leftovers = {n for n in names if TMP in n}
      steps = {int(n) for n in names if n.isdigit()}
      # A save that finished left nothing unfinished, its own or an earlier
      # save's. (A killed one may die before orbax's cleanup, which runs in
      # a thread of the new Manager, has removed an earlier leftover.)
      assert how == "killed" or (step in steps and not leftovers), names
      assert steps - {step} == complete, names
      complete = steps
      for s in steps:  # complete, all digests checked, exact
        checkpoint.restore(directory / str(s), target)
        want = _values(build(s))
        assert all(np.array_equal(v, want[k])
                   for k, v in _values(target).items()), s
      outcomes.append((point if point != "-" else round(delay, 3), how,
                       step in steps, sorted(leftovers)))
    print(np.round(durations, 3), *outcomes, sep="\n")
    # The kills in the finalize step left orbax's unfinished directory.
    assert [o[1:3] for o in outcomes[:len(POINTS)]] == [("killed", False)] * 2
    assert all(o[3] for o in outcomes[:len(POINTS)])
    # The next save (of any step) leaves nothing unfinished behind.
    how, _ = helper.save(directory, 99)
    assert how == "done"
    assert not [p.name for p in directory.iterdir() if TMP in p.name]
  finally:
    helper.close()


if __name__ == "__main__":
  _serve(sys.argv[1])
