"""Statistics during training: `Monitor`, and amax histories over steps.

`Monitor` runs `collect` every ``every`` steps, outside the training step:
the step itself is never changed or recompiled (it is compiled without any
of this, whether the monitor is on or off); the inspection pass is
compiled at each recorded step (`collect` caches nothing on the loss
function or the model), the statistics programs once per run. Each record
is a plain dict of floats (`Report.scalars`) handed to a callback -- a
TensorBoard writer, a CSV row -- and kept for `Monitor.to_csv` and
`Monitor.plot`.

`plot_amax_history` draws what delayed scaling already stores: each
layer's amax history (one entry per completed step).
"""

from __future__ import annotations

import csv
import math
import pathlib
import re
from typing import Callable

import numpy as np
from flax import nnx

from qlayers.inspect import _tap
from qlayers.inspect.collect import collect
from qlayers.inspect.report import Report, matplotlib_pyplot, save_figure

__all__ = ["Monitor", "plot_amax_history"]


class Monitor:
  """Records `collect` statistics every ``every`` steps.

  Args:
    loss_fn: ``loss_fn(model, *args, **kwargs) -> scalar``.
    every: record at steps ``0, every, 2 * every, ...``.
    callback: called as ``callback(step, scalars)`` with the `Report.scalars`
      of each recorded step.
    layers: regex of the layer paths to keep (None: all).

  Attributes:
    records: ``[{"step": step, **scalars}, ...]``.
    last: the last `Report` (None before the first).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import qlayers
    >>> layer = qlayers.QuantDense(64, 32, recipe="fp8_current",
    ...                            rngs=nnx.Rngs(0))
    >>> mon = qlayers.inspect.Monitor(lambda m, x: jnp.mean(m(x) ** 2),
    ...                               every=2)
    >>> for step in range(3):
    ...   _ = mon(step, layer, jnp.ones((4, 64)))  # (train here)
    >>> [r["step"] for r in mon.records], "(model)/x/sqnr_db" in mon.records[0]
    ([0, 2], True)
  """

  def __init__(self, loss_fn: Callable, *, every: int,
               callback: Callable[[int, dict[str, float]], None] | None = None,
               layers: str | None = None):
    if not isinstance(every, int) or every < 1:
      raise ValueError(f"every must be a positive int, got {every!r}.")
    if layers is not None:
      re.compile(layers)
    self.loss_fn, self.every, self.callback = loss_fn, every, callback
    self.layers = layers
    self.records: list[dict[str, float]] = []
    self.last: Report | None = None

  def due(self, step: int) -> bool:
    """Whether ``step`` is a recorded step."""
    return step % self.every == 0

  def __call__(self, step: int, model: nnx.Module, *args, **kwargs
               ) -> dict[str, float] | None:
    """Records step ``step`` if due (`collect` on ``model`` and the batch
    ``args``); returns its scalars, or None when not due, or when the model
    has no quantized GEMM (a wide baseline run of the same script)."""
    if not self.due(step) or not _tap.gemm_paths(model):
      return None
    return self.add(step, collect(model, self.loss_fn, *args, **kwargs))

  def add(self, step: int, report: Report) -> dict[str, float]:
    """Records ``report`` (from `collect`) as step ``step``, due or not;
    returns its scalars."""
    self.last = report
    scalars = report.scalars(self.layers)
    self.records.append({"step": step, **scalars})
    if self.callback is not None:
      self.callback(step, scalars)
    return scalars

  def to_csv(self, path: str | pathlib.Path) -> pathlib.Path:
    """Writes the records, one row per recorded step."""
    if not self.records:
      raise ValueError("Nothing recorded yet.")
    names = list(dict.fromkeys(k for r in self.records for k in r))
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=names, restval="")
      w.writeheader()
      w.writerows(self.records)
    return path

  def series(self, name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one recorded scalar."""
    pts = [(r["step"], r[name]) for r in self.records if name in r]
    return [s for s, _ in pts], [v for _, v in pts]

  def plot(self, path: str | pathlib.Path, *, layers: str | None = None,
           stat: str = "amax") -> pathlib.Path:
    """Draws ``stat`` (``amax``, ``scale``, ``sqnr_db``, ``saturated``,
    ``underflow``) over the recorded steps, one panel per role, one line per
    layer matching ``layers``. For ``amax`` under delayed scaling the amax
    the scale came from is drawn dashed."""
    if not self.records:
      raise ValueError("Nothing recorded yet.")
    pat = re.compile(layers) if layers else None
    keys = [k for k in dict.fromkeys(k for r in self.records for k in r)
            if k.endswith(f"/{stat}") and k.count("/") >= 2]
    plt = matplotlib_pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, role in zip(axes, ("x", "w", "g")):
      for key in keys:
        layer, r = key[:-len(stat) - 1].rsplit("/", 1)
        if r != role or (pat and not pat.search(layer)):
          continue
        steps, ys = self.series(key)
        line = ax.plot(steps, ys, label=layer)[0]
        used = f"{layer}/{role}/history_used"
        if stat == "amax" and any(used in rec for rec in self.records):
          ax.plot(*self.series(used), "--", color=line.get_color())
      _label(ax, f"{role}: {stat}", "step", log=stat in ("amax", "scale"))
    return save_figure(fig, plt, path)


def _label(ax, title: str, xlabel: str, *, log: bool) -> None:
  """Title, x label, log y axis if ``log``, grid, legend if anything drawn."""
  ax.set_title(title)
  ax.set_xlabel(xlabel)
  if log:
    ax.set_yscale("log")
  ax.grid(alpha=0.3)
  if ax.has_data():
    ax.legend(fontsize=7)


def plot_amax_history(model: nnx.Module, path: str | pathlib.Path, *,
                      layers: str | None = None) -> pathlib.Path:
  """Draws the stored amax history of every delayed-scaling layer matching
  the regex ``layers``, one panel per role, oldest step on the left (the
  history holds the last ``amax_history_len`` completed steps); a stacked
  layer or the experts draw one line per entry, ``path[i]``."""
  pat = re.compile(layers) if layers else None
  found = [(p, g) for p, g in _tap.gemm_paths(model).items()
           if g.delayed and (pat is None or pat.search(p))]
  if not found:
    raise ValueError("No delayed-scaling layer"
                     + (f" matches {layers!r}." if layers else "."))
  plt = matplotlib_pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for ax, role in zip(axes, ("x", "w", "g")):
    for p, g in found:
      hist = np.asarray(getattr(g, f"{role}_amax_history")[...])
      rows = hist.reshape(-1, hist.shape[-1])  # stacked / experts: per entry
      for i, h in enumerate(rows):
        seen = np.nonzero(h)[0]
        if not seen.size:
          continue
        n = int(seen[-1]) + 1  # entries past the oldest step are empty
        ys = h[:n][::-1]  # index 0 is the most recent step
        ax.plot(np.arange(-n + 1, 1), np.where(ys > 0, ys, math.nan),
                label=p if hist.ndim == 1 else f"{p}[{i}]")
    _label(ax, f"{role}: amax history", "step (0: the last completed)",
           log=True)
  return save_figure(fig, plt, path)
