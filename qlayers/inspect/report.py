"""The result of `qlayers.inspect.collect`: one row per (layer, role).

`Report.rows` holds a `Row` per quantized layer and operand role (``x``
input, ``w`` weight, ``g`` output gradient) with the statistics of the
quantized copy that fared worst (lowest SQNR) among the GEMMs consuming it,
and those of every such GEMM in ``Row.gemms``; `Report.outputs` the SQNR of
each GEMM's output. `Report.table` prints them, `Report.to_json` writes
them, `Report.scalars` flattens them for a logger, `Report.plot` draws them
(matplotlib, an optional dependency).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
from typing import Any

__all__ = ["Row", "Output", "Report", "jsonable", "matplotlib_pyplot"]

ROLE_NAMES = {"x": "input", "w": "weight", "g": "output gradient"}
STATS = ("amax", "scale", "saturated", "underflow", "sqnr_db")


@dataclasses.dataclass(frozen=True)
class Row:
  """Statistics of one operand role of one quantized layer.

  Attributes:
    path: the layer's module path (``blocks/0/mlp/up``).
    role: ``x`` (input), ``w`` (weight) or ``g`` (output gradient).
    amax: ``max |t|`` of the operand (as that GEMM consumes it: after a
      Hadamard transform, if the recipe applies one).
    scale: the dequantization factor used (per tensor), or the largest one
      (row/tile/block/MX scales); ``scale_min``: the smallest over blocks
      holding a non-zero.
    saturated: fraction of elements clipped at the format's max.
    underflow: fraction of elements non-zero before and zero after
      quantization; ``zeros``: fraction zero before.
    sqnr_db: SQNR (dB) of the quantized operand against the wide one
      (``inf``: exactly representable).
    gemm: which GEMM the values above are of (the one with the lowest SQNR).
    format, granularity: that GEMM's element format and scaling unit.
    recipe: the layer's recipe.
    use: which call of the layer in ``loss_fn`` (0 unless it runs twice).
    gemms: ``{gemm: {stat: value, "format": ..., "granularity": ...}}`` for
      every GEMM that quantizes this role.
    history: delayed scaling only: ``used`` (the amax the scale came from),
      ``ratio`` (current amax / used: above 1 saturates), ``filled`` (the
      history's entries holding an amax: a step that recorded 0, an idle
      expert's or a non-finite one, is not counted), ``max``, ``recent``
      (its most recent entry).
  """

  path: str
  role: str
  amax: float
  scale: float
  saturated: float
  underflow: float
  sqnr_db: float
  gemm: str
  format: str
  granularity: str
  recipe: str
  use: int = 0
  scale_min: float = math.nan
  zeros: float = 0.0
  gemms: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  history: dict[str, float] | None = None

  @property
  def key(self) -> str:
    """``path`` (with ``#use`` after a first call) and ``role``."""
    return f"{_use_path(self.path, self.use)}/{self.role}"


@dataclasses.dataclass(frozen=True)
class Output:
  """SQNR (dB) of one GEMM's output (``fprop``, ``dgrad``, ``wgrad``) of a
  layer against the FP32 GEMM of its wide operands."""

  path: str
  gemm: str
  sqnr_db: float
  use: int = 0


def _use_path(path: str, use: int) -> str:
  return path if use == 0 else f"{path}#{use}"


@dataclasses.dataclass
class Report:
  """What `qlayers.inspect.collect` measured.

  Attributes:
    rows: one `Row` per (layer path, role, use).
    outputs: one `Output` per (layer path, GEMM, use).
    loss: the value of ``loss_fn``.
    skipped: ``(path, reason)`` of the `QuantGemm` layers with no rows.
  """

  rows: list[Row]
  outputs: list[Output]
  loss: float
  skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)

  # --------------------------------------------------------------------------
  # Access

  @property
  def paths(self) -> list[str]:
    """Layer paths in the order their rows appear."""
    return list(dict.fromkeys(r.path for r in self.rows))

  def row(self, path: str, role: str, use: int = 0) -> Row:
    """The `Row` of ``path`` and ``role``; KeyError naming what exists."""
    for r in self.rows:
      if (r.path, r.role, r.use) == (path, role, use):
        return r
    raise KeyError(f"No row for layer {path!r}, role {role!r}, use {use}; "
                   f"layers: {self.paths}.")

  def output(self, path: str, gemm: str, use: int = 0) -> float:
    """The output SQNR (dB) of ``gemm`` of ``path``."""
    for o in self.outputs:
      if (o.path, o.gemm, o.use) == (path, gemm, use):
        return o.sqnr_db
    raise KeyError(f"No {gemm!r} output for layer {path!r}, use {use}.")

  def select(self, layers: str | None) -> "Report":
    """The rows and outputs of layers whose path matches the regex
    ``layers`` (``re.search``; None: all)."""
    if layers is None:
      return self
    pat = re.compile(layers)
    return Report([r for r in self.rows if pat.search(r.path)],
                  [o for o in self.outputs if pat.search(o.path)],
                  self.loss, self.skipped)

  def scalars(self, layers: str | None = None) -> dict[str, float]:
    """Flat ``{name: float}`` for a logger (TensorBoard, CSV).

    Names are ``{path}/{role}/{stat}`` for the `STATS` of each row (plus
    ``history_used`` and ``history_ratio`` under delayed scaling),
    ``{path}/{gemm}/out_sqnr_db`` for each GEMM output, and ``loss``.
    """
    rep = self.select(layers)
    out = {"loss": float(rep.loss)}
    for r in rep.rows:
      for stat in STATS:
        out[f"{r.key}/{stat}"] = float(getattr(r, stat))
      if r.history:
        out[f"{r.key}/history_used"] = float(r.history["used"])
        out[f"{r.key}/history_ratio"] = float(r.history["ratio"])
    for o in rep.outputs:
      out[f"{_use_path(o.path, o.use)}/{o.gemm}/out_sqnr_db"] = o.sqnr_db
    return out

  # --------------------------------------------------------------------------
  # Output

  def table(self, layers: str | None = None) -> str:
    """A terminal table: one line per row, then the GEMM outputs."""
    rep = self.select(layers)
    head = ["layer", "role", "gemm", "format", "amax", "scale", "sat %",
            "uflow %", "SQNR dB", "hist amax/used"]
    lines = []
    for r in rep.rows:
      h = r.history
      lines.append([
          _use_path(r.path, r.use), r.role, r.gemm,
          f"{r.format}/{r.granularity}", _g(r.amax), _g(r.scale),
          _pct(r.saturated), _pct(r.underflow), _db(r.sqnr_db),
          f"{h['ratio']:.3g} ({int(h['filled'])} amaxes)" if h else "-"])
    out = [f"qlayers.inspect: loss {self.loss:.6g}, "
           f"{len(rep.paths)} layers"]
    out += _grid(head, lines)
    by_layer: dict[str, dict[str, float]] = {}
    for o in rep.outputs:
      by_layer.setdefault(_use_path(o.path, o.use), {})[o.gemm] = o.sqnr_db
    if by_layer:
      out.append("GEMM output SQNR (dB) against the FP32 GEMM of the wide "
                 "operands:")
      out += _grid(["layer", "fprop", "dgrad", "wgrad"],
                   [[p] + [_db(v[g]) if g in v else "-"
                           for g in ("fprop", "dgrad", "wgrad")]
                    for p, v in by_layer.items()])
    for path, why in self.skipped:
      out.append(f"not inspected: {path}: {why}")
    return "\n".join(out)

  def __str__(self) -> str:
    return self.table()

  def to_dict(self) -> dict[str, Any]:
    """Everything, JSON-ready (non-finite numbers as ``"inf"``, ``"nan"``)."""
    return jsonable({"loss": self.loss,
                     "rows": [dataclasses.asdict(r) for r in self.rows],
                     "outputs": [dataclasses.asdict(o) for o in self.outputs],
                     "skipped": [list(s) for s in self.skipped]})

  def to_json(self, path: str | pathlib.Path | None = None) -> str:
    """`to_dict` as JSON text; also written to ``path`` if given."""
    return dump_json(self.to_dict(), path)

  def plot(self, path: str | pathlib.Path, *, layers: str | None = None,
           title: str | None = None) -> pathlib.Path:
    """Draws operand SQNR, GEMM output SQNR, saturation and underflow per
    layer (one marker per role) into ``path`` (needs matplotlib).

    An infinite SQNR (exact) is drawn at the top of its panel as an open
    marker.
    """
    plt = matplotlib_pyplot()
    rep = self.select(layers)
    paths = rep.paths
    if not paths:
      raise ValueError("Nothing to plot: the report has no rows"
                       + (f" matching {layers!r}." if layers else "."))
    pos = {p: i for i, p in enumerate(paths)}
    width = min(40.0, max(6.0, 0.3 * len(paths) + 2))
    fig, axes = plt.subplots(4, 1, figsize=(width, 11), sharex=True)
    markers = {"x": "o", "w": "s", "g": "^", "fprop": "o", "dgrad": "v",
               "wgrad": "D"}
    panels = (("operand SQNR (dB)", "sqnr_db"), (None, None),
              ("saturated (%)", "saturated"), ("underflow (%)", "underflow"))
    for ax, (label, field) in zip(axes, panels):
      if field is None:
        continue
      for role in ("x", "w", "g"):
        rows = [r for r in rep.rows if r.role == role and r.use == 0]
        if not rows:
          continue
        xs = [pos[r.path] for r in rows]
        ys = [getattr(r, field) * (100.0 if field != "sqnr_db" else 1.0)
              for r in rows]
        _scatter(ax, xs, ys, markers[role], f"{role} ({ROLE_NAMES[role]})")
      ax.set_ylabel(label)
    for gemm in ("fprop", "dgrad", "wgrad"):
      outs = [o for o in rep.outputs if o.gemm == gemm and o.use == 0]
      if outs:
        _scatter(axes[1], [pos[o.path] for o in outs],
                 [o.sqnr_db for o in outs], markers[gemm], gemm)
    axes[1].set_ylabel("GEMM output SQNR (dB)")
    for ax in axes:
      ax.grid(alpha=0.3)
      if ax.has_data():
        ax.legend(fontsize=8, loc="best")
    every = -(-len(paths) // 120)  # at most 120 labels
    axes[-1].set_xticks(range(0, len(paths), every))
    axes[-1].set_xticklabels(paths[::every], rotation=90, fontsize=7)
    fig.suptitle(title or f"qlayers.inspect (loss {self.loss:.4g})")
    return save_figure(fig, plt, path)


def _scatter(ax, xs, ys, marker, label):
  """Finite values filled; infinite ones (exact) open, at the top."""
  finite = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
  top = max([y for _, y in finite], default=0.0) + 5.0
  exact = [x for x, y in zip(xs, ys) if math.isinf(y) and y > 0]
  line = ax.plot([x for x, _ in finite], [y for _, y in finite], marker,
                 linestyle="none", label=label)[0]
  if exact:
    ax.plot(exact, [top] * len(exact), marker, linestyle="none",
            markerfacecolor="none", color=line.get_color(),
            label=f"{label}: exact (inf)")


def matplotlib_pyplot():
  """``matplotlib.pyplot`` with a non-interactive backend, or an
  ImportError saying how to install it."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("qlayers.inspect plots need matplotlib: pip install "
                      "matplotlib") from e
  return plt


def save_figure(fig, plt, path: str | pathlib.Path) -> pathlib.Path:
  """Lays out ``fig``, writes it to ``path`` (folders made) and closes it."""
  fig.tight_layout()
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def dump_json(data, path: str | pathlib.Path | None = None) -> str:
  """``data`` (from `jsonable`) as JSON text; also written to ``path``."""
  text = json.dumps(data, indent=1, allow_nan=False)
  if path is not None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
  return text


def jsonable(obj):
  """``obj`` with non-finite floats as strings and tuples as lists."""
  if isinstance(obj, float):
    return obj if math.isfinite(obj) else str(obj)
  if isinstance(obj, dict):
    return {str(k): jsonable(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [jsonable(v) for v in obj]
  return obj


def _g(v: float) -> str:
  return f"{v:.3g}"


def _pct(v: float) -> str:
  return "0" if v == 0 else f"{100 * v:.3g}"


def _db(v: float) -> str:
  return "inf" if math.isinf(v) and v > 0 else f"{v:.1f}"


def _grid(head: list[str], rows: list[list[str]]) -> list[str]:
  table = [head] + rows
  widths = [max(len(r[i]) for r in table) for i in range(len(head))]
  return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
          for r in table]
