"""Timing harness for train-step variants.

Every variant is a ``(step, state)`` pair from a factory
``make(cfg, seed=...)`` with ``step(state, batch) -> (state, loss)``. The
harness

1. builds each variant and runs ``check_steps`` steps on the fixed batch
   (the first is the compile; all of them are the warm-up and are not
   timed) and records the loss, which must be finite and within
   ``loss_rtol`` of the baseline's loss after the same number of steps;
2. times ``rounds`` rounds; in each round every variant runs ``steps``
   consecutive steps, blocking on each step's loss, and the order of the
   variants rotates from round to round so that drift in machine load hits
   every variant alike;
3. reports per variant the median step time, its interquartile range and
   minimum, and the ratio to the baseline as the median (and min/max) of
   the per-round ratios of mean step times, taken within the same round.
   Alongside wall time it records the process CPU time of each step (all
   threads): on a shared machine other processes stretch wall time but
   hardly the CPU time a step consumes, so the CPU ratio is the steadier
   estimate there. ``references`` names further variants that every other
   one is also compared with, by the same per-round ratios (a second
   baseline).

``render_markdown`` and ``to_json`` format a ``Report``.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import math
import os
import platform
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import mdtable

__all__ = ["Variant", "VariantResult", "Report", "run", "render_markdown",
           "to_json", "json_safe", "publish", "machine_info"]


@dataclasses.dataclass(frozen=True)
class Variant:
  """One train-step implementation to time.

  Attributes:
    name: short unique label, e.g. ``"qwix-fp8"``.
    library: the library that quantizes (``"none"`` for the baseline).
    recipe: human-readable description of the quantization.
    make: ``make(cfg, seed=...) -> (step, state)``.
  """

  name: str
  library: str
  recipe: str
  make: Callable[..., tuple[Callable[[Any, Any], tuple[Any, Any]], Any]]


@dataclasses.dataclass
class VariantResult:
  """What one variant measured; times in seconds."""

  name: str
  library: str
  recipe: str
  build_s: float = math.nan
  compile_s: float = math.nan
  step_times: list[float] = dataclasses.field(default_factory=list)
  round_means: list[float] = dataclasses.field(default_factory=list)
  cpu_times: list[float] = dataclasses.field(default_factory=list)
  cpu_round_means: list[float] = dataclasses.field(default_factory=list)
  loss_check: float = math.nan
  loss_final: float = math.nan
  error: str | None = None
  # Filled in by ``run`` after all rounds.
  median_s: float = math.nan
  q25_s: float = math.nan
  q75_s: float = math.nan
  min_s: float = math.nan
  ratio: float = math.nan
  ratio_min: float = math.nan
  ratio_max: float = math.nan
  cpu_median_s: float = math.nan
  cpu_ratio: float = math.nan
  cpu_ratio_min: float = math.nan
  cpu_ratio_max: float = math.nan
  loss_ok: bool = False
  # {reference name: {"wall": [median, min, max], "cpu": [median, min, max]}}
  ref_ratios: dict[str, dict[str, list[float]]] = dataclasses.field(
      default_factory=dict)


@dataclasses.dataclass
class Report:
  """A whole benchmark run."""

  title: str
  config: dict[str, Any]
  steps: int
  rounds: int
  check_steps: int
  loss_rtol: float
  seed: int
  machine: dict[str, Any]
  versions: dict[str, str]
  results: list[VariantResult]
  skipped: dict[str, str]
  started: str
  wall_s: float = math.nan
  references: list[str] = dataclasses.field(default_factory=list)
  loadavg_end: list[float] = dataclasses.field(default_factory=list)


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.lower().startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
  """nproc, CPU model, load average, Python, and the JAX devices."""
  try:
    load = os.getloadavg()
  except OSError:
    load = (math.nan,) * 3
  return {
      "nproc": os.cpu_count(),
      "cpu": _cpu_model(),
      "loadavg": [round(x, 2) for x in load],
      "python": platform.python_version(),
      "platform": platform.platform(),
      "jax_backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
  }


def _block(x):
  return jax.block_until_ready(x)


def _finite(x: float) -> bool:
  return isinstance(x, float) and math.isfinite(x)


def run(cfg: Any, variants: Sequence[Variant], batch: Any, *, steps: int,
        rounds: int, check_steps: int, seed: int = 0,
        loss_rtol: float = 0.1, title: str = "",
        versions: dict[str, str] | None = None,
        skipped: dict[str, str] | None = None,
        references: Sequence[str] = (),
        log: Callable[[str], None] = print) -> Report:
  """Builds, checks and times ``variants``; the first one is the baseline.

  A variant that fails to build or step is reported with its error and left
  out of the timing; the baseline must not fail. ``references``: names of
  variants to compare every variant with as well (skipped if they failed).
  """
  if steps < 1 or rounds < 1 or check_steps < 1:
    raise ValueError("steps, rounds and check_steps must all be >= 1")
  t_start = time.perf_counter()
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")
  machine = machine_info()
  results, live = [], []

  for v in variants:
    res = VariantResult(v.name, v.library, v.recipe)
    results.append(res)
    try:
      t0 = time.perf_counter()
      step, state = v.make(cfg, seed=seed)
      res.build_s = time.perf_counter() - t0
      t0 = time.perf_counter()
      state, loss = step(state, batch)
      _block(loss)
      res.compile_s = time.perf_counter() - t0
      for _ in range(check_steps - 1):
        state, loss = step(state, batch)
      res.loss_check = float(_block(loss))
    except Exception as e:  # noqa: BLE001 - reported, other variants go on
      res.error = f"{type(e).__name__}: {e}".strip()
      log(f"[{v.name}] FAILED: {res.error.splitlines()[0]}")
      log(traceback.format_exc(limit=-3))
      if not live:
        raise RuntimeError(f"baseline {v.name} failed") from e
      continue
    log(f"[{v.name}] built {res.build_s:.1f}s, first step (compile) "
        f"{res.compile_s:.1f}s, loss after {check_steps} steps "
        f"{res.loss_check:.4f}")
    live.append([v, res, step, state])

  gc.collect()
  gc_was_enabled = gc.isenabled()
  gc.disable()
  try:
    for r in range(rounds):
      k = r % len(live)
      for entry in live[k:] + live[:k]:
        v, res, step, state = entry
        times, cpu = [], []
        for _ in range(steps):
          c0, t0 = time.process_time(), time.perf_counter()
          state, loss = step(state, batch)
          _block(loss)
          times.append(time.perf_counter() - t0)
          cpu.append(time.process_time() - c0)
        entry[3] = state
        res.step_times.extend(times)
        res.round_means.append(float(np.mean(times)))
        res.cpu_times.extend(cpu)
        res.cpu_round_means.append(float(np.mean(cpu)))
        res.loss_final = float(loss)
      log(f"round {r + 1}/{rounds}: " + ", ".join(
          f"{e[0].name} {e[1].round_means[-1] * 1e3:.1f}ms" for e in live))
  finally:
    if gc_was_enabled:
      gc.enable()

  base = live[0][1]
  for _, res, _, _ in live:
    t = np.asarray(res.step_times)
    res.median_s = float(np.median(t))
    res.q25_s, res.q75_s = (float(q) for q in np.percentile(t, [25, 75]))
    res.min_s = float(t.min())
    ratios = np.asarray(res.round_means) / np.asarray(base.round_means)
    res.ratio = float(np.median(ratios))
    res.ratio_min, res.ratio_max = float(ratios.min()), float(ratios.max())
    res.cpu_median_s = float(np.median(res.cpu_times))
    ratios = (np.asarray(res.cpu_round_means)
              / np.asarray(base.cpu_round_means))
    res.cpu_ratio = float(np.median(ratios))
    res.cpu_ratio_min = float(ratios.min())
    res.cpu_ratio_max = float(ratios.max())
    res.loss_ok = (_finite(res.loss_check) and _finite(res.loss_final)
                   and abs(res.loss_check - base.loss_check)
                   <= loss_rtol * abs(base.loss_check))

  by_name = {e[0].name: e[1] for e in live}
  refs = [n for n in references if n in by_name]
  for _, res, _, _ in live:
    for n in refs:
      ref = by_name[n]
      out = {}
      for kind, mine, theirs in (
          ("wall", res.round_means, ref.round_means),
          ("cpu", res.cpu_round_means, ref.cpu_round_means)):
        rr = np.asarray(mine) / np.asarray(theirs)
        out[kind] = [float(np.median(rr)), float(rr.min()), float(rr.max())]
      res.ref_ratios[n] = out
  try:
    load_end = [round(x, 2) for x in os.getloadavg()]
  except OSError:
    load_end = []

  return Report(
      title=title, config=_config_dict(cfg), steps=steps, rounds=rounds,
      check_steps=check_steps, loss_rtol=loss_rtol, seed=seed,
      machine=machine, versions=dict(versions or {}), results=results,
      skipped=dict(skipped or {}), started=started,
      wall_s=time.perf_counter() - t_start, references=refs,
      loadavg_end=load_end)


def _config_dict(cfg: Any) -> dict[str, Any]:
  if dataclasses.is_dataclass(cfg):
    out = {}
    for f in dataclasses.fields(cfg):
      val = getattr(cfg, f.name)
      out[f.name] = val if isinstance(val, (int, float, str, bool)) else str(
          np.dtype(val)) if _is_dtype(val) else str(val)
    return out
  return {"config": str(cfg)}


def _is_dtype(x: Any) -> bool:
  try:
    np.dtype(x)
  except TypeError:
    return False
  return True


def _ms(x: float) -> str:
  return "—" if not math.isfinite(x) else f"{x * 1e3:.1f}"


def render_markdown(rep: Report) -> str:
  """The report as Markdown: a header of facts, then one table."""
  m, v = rep.machine, rep.versions
  cfg = ", ".join(f"{k}={val}" for k, val in rep.config.items())
  lines = [
      f"### {rep.title}" if rep.title else "### Step-time benchmark",
      "",
      f"- date: {rep.started}; wall {rep.wall_s:.0f} s",
      f"- machine: {m['nproc']} cores, {m['cpu']}, "
      f"{m['jax_backend']} ({', '.join(m['devices'])}); load avg at start "
      f"{m['loadavg']}, at end {rep.loadavg_end}; Python {m['python']}",
      "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
      f"- config: {cfg}",
      f"- timing: {rep.rounds} interleaved rounds x {rep.steps} steps per "
      f"variant after {rep.check_steps} untimed steps (compile + warm-up); "
      "ratio = median over rounds of (variant mean / baseline mean in the "
      "same round) [min–max]; CPU = process CPU time per step, all threads",
      f"- sanity: loss after {rep.check_steps} steps finite and within "
      f"{rep.loss_rtol:.0%} of the baseline's",
      "",
      *mdtable.head(
          ["variant", "library", "recipe", "median ms", "IQR ms", "min ms",
           "vs BF16 [min–max]", "CPU ms", "CPU vs BF16 [min–max]",
           *(col for n in rep.references
             for col in (f"vs {n}", f"CPU vs {n} [min–max]")),
           "loss@check", "loss@end", "sanity"],
          "lll" + "r" * (6 + 2 * len(rep.references)) + "rrl"),
  ]
  # Timings, reference ratios and losses of a row without measurements.
  dashes = ["—"] * (8 + 2 * len(rep.references))
  for r in rep.results:
    if r.error is not None:
      err = r.error.splitlines()[0].replace("|", "\\|")[:160]
      lines.append(mdtable.row(r.name, r.library, r.recipe, *dashes,
                               f"failed: {err}"))
      continue
    refs = []
    for n in rep.references:
      w, c = r.ref_ratios[n]["wall"], r.ref_ratios[n]["cpu"]
      refs += [f"{w[0]:.2f}x", f"{c[0]:.2f}x [{c[1]:.2f}–{c[2]:.2f}]"]
    lines.append(mdtable.row(
        r.name, r.library, r.recipe, _ms(r.median_s),
        f"{_ms(r.q25_s)}–{_ms(r.q75_s)}", _ms(r.min_s),
        f"{r.ratio:.2f}x [{r.ratio_min:.2f}–{r.ratio_max:.2f}]",
        _ms(r.cpu_median_s),
        f"{r.cpu_ratio:.2f}x [{r.cpu_ratio_min:.2f}–{r.cpu_ratio_max:.2f}]",
        *refs, f"{r.loss_check:.4f}", f"{r.loss_final:.4f}",
        "ok" if r.loss_ok else "CHECK"))
  for name, why in rep.skipped.items():
    lines.append(mdtable.row(name, None, None, *dashes,
                             f"skipped: {why.replace('|', '/')[:160]}"))
  return "\n".join(lines) + "\n"


def to_json(rep: Report) -> dict[str, Any]:
  """The report as a JSON-serialisable dict (NaN becomes None)."""
  return json_safe(dataclasses.asdict(rep))


def json_safe(x: Any) -> Any:
  """``x`` with non-finite floats as None and tuples as lists, recursively."""
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: json_safe(val) for k, val in x.items()}
  if isinstance(x, (list, tuple)):
    return [json_safe(val) for val in x]
  return x


def publish(md: str, append_md: str | None = None, *, file: Any = None) -> None:
  """Prints the Markdown report (to ``file``, default stdout) and appends it
  to the file ``append_md``."""
  print(md, file=file)
  if append_md:
    with open(append_md, "a") as f:
      f.write("\n" + md)
