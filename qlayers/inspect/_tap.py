"""Routing a model's GEMMs through an inspection function while it traces.

`QuantGemm` runs its GEMM through `ops.quantized_matmul` with itself as the
``site``; `tapping` is the public hook `ops.intercept`, which routes those
calls to an inspection function for the duration of a trace only, so
nothing changes for a model that is not being inspected. `label` names every `QuantGemm` of a
model (built inside that trace) by its layer's path, as a static attribute:
NNX carries it through its own transforms (``nnx.remat``, ``nnx.scan``), so
the tap knows which layer it runs for.
"""

from __future__ import annotations

import collections
import re

from flax import nnx

from qlayers import ops
from qlayers.layers import core
from qlayers.layers.experts import ExpertSite

_ATTR = "_inspect_path"
_CALL = "_inspect_call"  # a token per inspection: see `label`


def layer_path(path: tuple) -> str:
  """The module path of the layer owning a `QuantGemm` at ``path`` (its
  attribute, ``quant`` or ``dot_general``, dropped), joined by ``/``."""
  parts = [str(p) for p in path[:-1]] if path else []
  return "/".join(parts) or "(model)"


def gemm_paths(model: nnx.Module) -> dict[str, core.QuantGemm]:
  """``{layer path: QuantGemm}`` of ``model`` (each shared one once); a
  layer of several GEMMs (``QuantTunixMoE``: ``gate_quant``, ``up_quant``,
  ``down_quant``) names each by its attribute too, after a colon
  (``layers/0/mlp:gate_quant``): rules match the layer (`rule_path`)."""
  found = list(core.gemms(model))
  owners = collections.Counter(layer_path(p) for p, _ in found)
  return {layer_path(p) if owners[layer_path(p)] == 1
          else f"{layer_path(p)}:{p[-1]}": g for p, g in found}


def rule_path(name: str) -> str:
  """The module path a `qlayers.Rule` matches for a row of the reports: an
  iteration's or expert's row (``blocks/mlp[2][3]``) and a GEMM of a layer
  of several (``layers/0/mlp:gate_quant``) are their layer's.

  Example:
    >>> rule_path("layers/0/mlp:down_quant[1]"), rule_path("blocks/up[2]")
    ('layers/0/mlp', 'blocks/up')
  """
  return re.sub(r"(\[\d+\])+$", "", name).split(":", 1)[0]


def label(model: nnx.Module) -> list[str]:
  """Names each `QuantGemm` of ``model`` by its layer path; returns them.

  Only for a model merged inside the trace being inspected: the label is a
  static attribute, so on the caller's model it would change its graph.
  Each call's labels carry a token of their own, so that an ``nnx.jit``
  the loss function calls traces anew for each inspection rather than
  replaying an earlier one's trace (its taps, its masks).
  """
  paths = gemm_paths(model)
  token = object()
  for path, gemm in paths.items():
    setattr(gemm, _ATTR, path)
    setattr(gemm, _CALL, token)
  return list(paths)


def path_of(site) -> str | None:
  """The label `label` gave the GEMM of ``site`` (a `QuantGemm`, or an
  expert's `ExpertSite`; None: not labelled)."""
  return getattr(split(site)[0], _ATTR, None)


def split(site) -> tuple:
  """``(gemm, expert or None)`` of a site `ops.intercept` hands a tap."""
  if isinstance(site, ExpertSite):
    return site.gemm, site.expert
  return site, None


def tapping(fn):
  """Runs every `QuantGemm` GEMM through ``fn`` (signature of
  `ops.quantized_matmul`, plus the `QuantGemm` first) inside the block:
  `ops.intercept`, whose blocks do not nest."""
  return ops.intercept(fn)
