"""Where a quantized train step gets its size: ``compile.py breakdown``.

Usage (from the repository root)::

  python benchmarks/compile.py breakdown --recipe fp8_current
  python benchmarks/compile.py breakdown --recipe mxfp8 --model d512 \\
      --json breakdown.json
  PYTHONPATH=. JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 .venv-gpu/bin/python \\
      benchmarks/compile.py breakdown --recipe fp8_delayed \\
      --model gpt-d256 --blocks 8 --optimizer examples --target h200

For one recipe on one model (``compile.py``'s models and loop flavours),
for the host CPU or, with ``--target``, for a GPU without one (as
``compile.py measure`` compiles), it compiles, and never runs:

1. the parts on their own: one GEMM's forward+backward (``jax.grad`` over
   kernel and input) as ``nnx.Linear`` and as ``QuantDense`` at the shape of
   the model's MLP up projection; the optimizer update alone
   (``nnx.Optimizer`` vs ``qlayers.Optimizer``, the unquantized model, given
   gradients; for delayed scaling also the quantized model, whose update
   commits the scales); ``value_and_grad`` alone (``nnx`` vs ``qlayers``, on the
   unquantized and the quantized model); ``qlayers.Optimizer.update`` at 1
   and 2 blocks (linear growth doubles, quadratic quadruples); and the whole
   step, ``stock`` vs ``qlayers/RECIPE``. Each with its jaxpr equations
   (nested included), HLO instructions, fusions and compile time;
2. the equations of the GEMM, the optimizer update and the whole step by
   primitive and HLO opcode, against their stock counterparts, and the HLO
   instructions per primitive (``op_name`` metadata) next to the jaxpr's
   equations of that primitive: a ratio far above the stock one is a value
   XLA recomputes in every fusion that reads it;
3. jaxpr equations and HLO instructions by the function that emitted them.
   Attribution is JAX's own: the innermost frame outside JAX of an
   equation's source info (``jax.extend.source_info_util.summarize``) and
   the source location XLA keeps in an instruction's metadata. flax and
   optax are registered as library code
   (``source_info_util.register_exclusion``), so work done inside them is
   charged to the qlayers or model function that called them (optax's Adam
   inside ``qlayers.optim.mixed_precision`` counts there);
4. suspects, counted directly: equations producing zero-size arrays (dtype
   carriers, "no master" markers), ``select_n`` (``jnp.where``),
   ``convert_element_type``, ``is_finite`` and reductions, each by the
   function that emitted them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import time
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.extend import source_info_util

import compile as cb
import mdtable

__all__ = ["Part", "compile_part", "gemm_parts", "optimizer_parts",
           "value_and_grad_parts", "step_parts", "eqn_source",
           "hlo_by_source", "main"]

SUSPECTS = ("zero-size outputs", "select_n", "convert_element_type",
            "is_finite", "reduce_and", "reduce_max")


def _exclude_libraries() -> None:
  """Charges work inside flax and optax to the code that called them."""
  import flax
  for mod in (flax, optax):
    source_info_util.register_exclusion(
        str(pathlib.Path(mod.__file__).resolve().parent))


# ==========================================================================
# Sources


_ROOTS: list[str] = []


def _short(file: str) -> str:
  if not _ROOTS:
    import qlayers
    _ROOTS.append(str(pathlib.Path(qlayers.__file__).resolve().parent.parent)
                  + "/")
    _ROOTS.append(str(cb._HERE.parent) + "/")
  if "site-packages/" in file:
    return file.split("site-packages/", 1)[1]
  for root in _ROOTS:
    if file.startswith(root):
      return file[len(root):]
  return file


_SUMMARY = re.compile(r"^(.*?):(\d+)(?::\d+)? \((.*)\)$")


def eqn_source(eqn) -> tuple[str, int, str]:
  """``(file, line, function)`` of the frame that emitted ``eqn``."""
  s = source_info_util.summarize(eqn.source_info)
  m = _SUMMARY.match(s)
  if not m:
    return s, 0, "?"
  return _short(m.group(1)), int(m.group(2)), m.group(3)


def _is_zero_size(eqn) -> bool:
  avals = [v.aval for v in eqn.outvars]
  return bool(avals) and all(
      hasattr(a, "shape") and int(np.prod(a.shape)) == 0 for a in avals)


def _walk(jaxpr, site=None):
  """``(eqn, source)`` for every equation, nested ones included.

  Equations inside a ``jit`` equation are charged to that equation's call
  site: JAX caches the jaxpr of a jitted function (``jnp.where`` is one), so
  its inner equations keep the source of the first call anywhere.
  """
  if hasattr(jaxpr, "jaxpr"):
    jaxpr = jaxpr.jaxpr
  for eqn in jaxpr.eqns:
    src = site or eqn_source(eqn)
    yield eqn, src
    inner = src if eqn.primitive.name == "jit" else site
    for sub in cb._sub_jaxprs(eqn):
      yield from _walk(sub, inner)


def eqns_by_source(jaxpr) -> dict[str, Counter]:
  """Equation counts by ``file (function)`` and ``file:line``; suspects."""
  by_fn, by_line = Counter(), Counter()
  suspects = {k: Counter() for k in SUSPECTS}
  for eqn, (file, line, fn) in _walk(jaxpr):
    where = f"{file} ({fn})"
    by_fn[where] += 1
    by_line[f"{file}:{line} ({fn})"] += 1
    if _is_zero_size(eqn):
      suspects["zero-size outputs"][where] += 1
    name = eqn.primitive.name
    if name in suspects:
      suspects[name][where] += 1
  return {"function": by_fn, "line": by_line, **suspects}


_FILE_NAME = re.compile(r'^(\d+) "(.*)"$')
_LOCATION = re.compile(r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) "
                       r"line=(\d+)")
_FRAME = re.compile(r"^(\d+) \{file_location_id=(\d+)")
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')


def hlo_by_source(text: str) -> Counter:
  """HLO instructions (fused ones included) by ``file (function)``.

  Reads the source location XLA keeps per instruction: the stack-frame
  tables at the top of ``as_text()`` (``FileNames``, ``FunctionNames``,
  ``FileLocations``, ``StackFrames``), or ``source_file``/``source_line``
  metadata in older formats. Instructions without one (parameters,
  tuples, copies XLA adds) are counted by opcode.
  """
  tables = {"FileNames": (_FILE_NAME, {}), "FunctionNames": (_FILE_NAME, {}),
            "FileLocations": (_LOCATION, {}), "StackFrames": (_FRAME, {})}
  table = None
  out = Counter()
  for line in text.splitlines():
    s = line.strip()
    if s in tables:
      table = tables[s]
      continue
    if table is not None and (m := table[0].match(s)):
      table[1][m.group(1)] = m.groups()[1:]
      continue
    if cb.hlo_opcode(line) is None:
      continue
    table = None
    files, funcs = tables["FileNames"][1], tables["FunctionNames"][1]
    locs, frames = tables["FileLocations"][1], tables["StackFrames"][1]
    if (m := _FRAME_ID.search(line)) and m.group(1) in frames:
      fid, fnid, _ = locs.get(frames[m.group(1)][0], ("?", "?", "?"))
      out[f"{_short(files.get(fid, ('?',))[0])} "
          f"({funcs.get(fnid, ('?',))[0]})"] += 1
    elif m := _SOURCE.search(line):
      out[f"{_short(m.group(1))}:{m.group(2)}"] += 1
    else:
      out[f"(no source: {cb.hlo_opcode(line)})"] += 1
  return out


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def hlo_by_primitive(text: str) -> Counter:
  """HLO instructions by the JAX primitive in their ``op_name`` metadata.

  Set against the jaxpr's equation count of the same primitive, it shows
  where XLA multiplies one equation into many instructions (a value
  recomputed inside every fusion that reads it).
  """
  out = Counter()
  for line in text.splitlines():
    if cb.hlo_opcode(line) is None:
      continue
    m = _OP_NAME.search(line)
    if m is None:
      out["(no op_name)"] += 1
    elif "/" not in m.group(1):
      out["(argument)"] += 1  # parameters carry the argument's path
    else:
      out[m.group(1).rsplit("/", 1)[-1]] += 1
  return out


# ==========================================================================
# Parts


class Part:
  """One compiled program and what it is made of."""

  def __init__(self, group: str, name: str, fn, *args, where: cb.Where):
    self.group, self.name = group, name
    t0 = time.perf_counter()
    with where.arch_context():
      traced = jax.jit(fn).trace(*where.place(args))
      lowered = traced.lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    self.compile_s = time.perf_counter() - t1
    self.lower_s = t1 - t0
    self.jaxpr = traced.jaxpr
    stats = cb.jaxpr_stats(self.jaxpr)
    self.eqns, self.prims = stats["total"], Counter(stats["by_primitive"])
    text = compiled.as_text()
    hs = cb.hlo_stats(text)
    self.hlo, self.fusions = hs["instructions"], hs["fusions"]
    self.opcodes = Counter(hs["by_opcode"])
    self.sources = eqns_by_source(self.jaxpr)
    self.hlo_sources = hlo_by_source(text)
    self.hlo_prims = hlo_by_primitive(text)

  def summary(self) -> dict[str, Any]:
    return {"group": self.group, "name": self.name, "eqns": self.eqns,
            "hlo_instructions": self.hlo, "fusions": self.fusions,
            "compile_s": self.compile_s, "lower_s": self.lower_s,
            "by_primitive": dict(self.prims.most_common()),
            "hlo_by_opcode": dict(self.opcodes.most_common()),
            "hlo_by_primitive": dict(self.hlo_prims.most_common()),
            "eqns_by_function": dict(self.sources["function"].most_common()),
            "hlo_by_function": dict(self.hlo_sources.most_common())}


def compile_part(group: str, name: str, fn, *args, where: cb.Where) -> Part:
  print(f"[breakdown] {group}: {name} ...", flush=True, end=" ")
  p = Part(group, name, fn, *args, where=where)
  print(f"{p.eqns:,} eqns, {p.hlo:,} HLO instr, {p.compile_s:.1f}s",
        flush=True)
  return p


def gemm_parts(model_name: str, recipe: str, where: cb.Where) -> list[Part]:
  """One GEMM fwd+bwd: ``nnx.Linear`` vs ``QuantDense`` (BF16 compute)."""
  import qlayers
  m, k, n = cb.MODELS[model_name].mlp_up
  x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
  ct = jax.random.normal(jax.random.key(1), (m, n), jnp.float32)
  layers = {
      "nnx.Linear": nnx.Linear(k, n, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
      f"QuantDense({recipe})": qlayers.QuantDense(
          k, n, recipe=recipe, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
  }
  out = []
  for name, layer in layers.items():
    gd, params, rest = nnx.split(layer, nnx.Param, ...)
    params, rest = nnx.as_pure(params), nnx.as_pure(rest)

    def loss(p, r, x, ct, gd=gd):
      y = nnx.merge(gd, p, r)(x)
      return jnp.vdot(y.astype(jnp.float32), ct)

    out.append(compile_part(f"one GEMM {m}x{k}x{n} fwd+bwd", name,
                            jax.grad(loss, (0, 2)), params, rest, x, ct,
                            where=where))
  return out


def optimizer_parts(model_name: str, recipe: str, where: cb.Where,
                    **build) -> list[Part]:
  """``opt.update`` alone, given gradients (the Params' own values).

  With a delayed-scaling recipe also on the quantized model, whose update
  commits the scales; otherwise that update is the unquantized one.
  """
  import qlayers
  out = []
  variants = [("stock", "nnx.Optimizer"), ("qlayers-wide", "qlayers.Optimizer")]
  if qlayers.recipe(recipe).delayed:
    variants.append((f"qlayers/{recipe}",
                     f"qlayers.Optimizer, {recipe} model"))
  for variant, label in variants:
    parts = cb.build_parts(model_name, variant, **build)
    grads = nnx.state(parts.model, nnx.Param)

    def update(model, opt, grads):
      opt.update(model, grads)

    f, state = cb.functional(update, parts.model, parts.opt)
    out.append(compile_part("optimizer update alone", label, f, state, grads,
                            where=where))
  return out


def scaling_parts(model_name: str, where: cb.Where, *, rules: str,
                  optimizer: str, **_) -> list[Part]:
  """``qlayers.Optimizer.update`` alone at 1 and 2 blocks (how it grows)."""
  out = []
  for blocks in (1, 2):
    parts = cb.build_parts(model_name, "qlayers-wide", blocks=blocks,
                           rules=rules, optimizer=optimizer)
    grads = nnx.state(parts.model, nnx.Param)
    n = len(jax.tree.leaves(grads))

    def update(model, opt, grads):
      opt.update(model, grads)

    f, state = cb.functional(update, parts.model, parts.opt)
    out.append(compile_part("qlayers.Optimizer.update alone, by size",
                            f"{blocks} block(s), {n} Param leaves", f, state,
                            grads, where=where))
  return out


def value_and_grad_parts(model_name: str, recipe: str, where: cb.Where,
                         **build) -> list[Part]:
  """Loss and gradients alone (no optimizer)."""
  import qlayers
  out = []
  for variant, vg, label in (
      ("stock", nnx.value_and_grad, "nnx.value_and_grad, stock model"),
      ("stock", qlayers.value_and_grad, "qlayers.value_and_grad, stock model"),
      (f"qlayers/{recipe}", nnx.value_and_grad,
       f"nnx.value_and_grad, {recipe} model"),
      (f"qlayers/{recipe}", qlayers.value_and_grad,
       f"qlayers.value_and_grad, {recipe} model")):
    parts = cb.build_parts(model_name, variant, **build)

    def loss_and_grads(model, batch, vg=vg, loss_fn=parts.loss_fn):
      return vg(loss_fn)(model, batch)

    f, state = cb.functional(loss_and_grads, parts.model)
    out.append(compile_part("value_and_grad alone", label, f, state,
                            parts.batch, where=where))
  return out


def step_parts(model_name: str, recipe: str, where: cb.Where,
               **build) -> list[Part]:
  out = []
  for variant in ("stock", f"qlayers/{recipe}"):
    step, state, batch, _ = cb.build_step(model_name, variant, **build)
    out.append(compile_part("whole train step", variant, step, state, batch,
                            where=where))
  return out


# ==========================================================================
# Report


def _components(parts: list[Part]) -> list[str]:
  lines = mdtable.head(["part", "variant", "jaxpr eqns", "HLO instr",
                        "fusions", "compile s", "HLO vs first of part"],
                       "llrrrrr")
  first: dict[str, Part] = {}
  for p in parts:
    base = first.setdefault(p.group, p)
    lines.append(mdtable.row(p.group, p.name, f"{p.eqns:,}", f"{p.hlo:,}",
                             f"{p.fusions:,}", f"{p.compile_s:.2f}",
                             f"{p.hlo / base.hlo:.2f}x"))
  return lines


def _diff_table(title: str, a: Part, b: Part, counts: str, top: int,
                key_name: str) -> list[str]:
  """Rows of ``counts`` (an attribute or sources key) of ``a`` vs ``b``."""
  def get(p):
    if counts == "prims":
      return p.prims
    if counts == "hlo":
      return p.hlo_sources
    if counts == "opcodes":
      return p.opcodes
    return p.sources[counts]
  ca, cb_ = get(a), get(b)
  keys = sorted(set(ca) | set(cb_), key=lambda k: (-(cb_[k] - ca[k]),
                                                   -cb_[k], k))
  lines = [f"{title}:", "", *mdtable.head(
      [key_name, a.name, b.name, "difference"], "lrrr")]
  shown = keys[:top]
  for k in shown:
    lines.append(mdtable.row(k.replace("|", "/"), f"{ca[k]:,}",
                             f"{cb_[k]:,}", f"{cb_[k] - ca[k]:+,}"))
  rest = keys[top:]
  if rest:
    ra, rb = sum(ca[k] for k in rest), sum(cb_[k] for k in rest)
    lines.append(mdtable.row(f"{len(rest)} more", f"{ra:,}", f"{rb:,}",
                             f"{rb - ra:+,}"))
  lines.append(mdtable.row("total", f"{sum(ca.values()):,}",
                           f"{sum(cb_.values()):,}",
                           f"{sum(cb_.values()) - sum(ca.values()):+,}"))
  return lines + [""]


def _per_primitive(title: str, a: Part, b: Part, top: int) -> list[str]:
  """jaxpr equations and HLO instructions per primitive, ``a`` vs ``b``."""
  keys = sorted(set(b.hlo_prims) | set(a.hlo_prims),
                key=lambda k: (-(b.hlo_prims[k] - a.hlo_prims[k]), k))
  lines = [f"{title}:", "", *mdtable.head(
      ["primitive", f"{a.name} eqns", f"{a.name} HLO", f"{b.name} eqns",
       f"{b.name} HLO", f"{b.name} HLO per eqn"], "lrrrrr")]
  for k in keys[:top]:
    e = b.prims.get(k, 0)
    lines.append(mdtable.row(
        k, f"{a.prims.get(k, 0):,}", f"{a.hlo_prims[k]:,}", f"{e:,}",
        f"{b.hlo_prims[k]:,}", f"{b.hlo_prims[k] / e:.1f}" if e else "—"))
  return lines + [""]


def _suspects(parts: list[Part], top: int) -> list[str]:
  lines = ["Suspects, counted in the jaxpr (equations, nested included), by "
           "the function that emitted them:", "", *mdtable.head(
               ["part", "what", "count", "top sources"], "llrl")]
  for p in parts:
    for k in SUSPECTS:
      c = p.sources[k]
      if not c:
        continue
      src = "; ".join(f"{s} {n}" for s, n in c.most_common(min(top, 4)))
      lines.append(mdtable.row(f"{p.group}: {p.name}", k,
                               f"{sum(c.values()):,}", src.replace("|", "/")))
  return lines + [""]


def render(parts: list[Part], header: dict[str, Any], top: int) -> str:
  groups: dict[str, list[Part]] = {}
  for p in parts:
    groups.setdefault(p.group, []).append(p)
  lines = [f"### Compile breakdown: {header['recipe']} on {header['model']} "
           f"({header['blocks']} blocks), for {header['target']}", "",
           f"- date: {header['started']}; qlayers commit {header['commit']}",
           f"- machine: {header['machine']}",
           f"- versions: {header['versions']}",
           f"- command: `{header['command']}`", "",
           "Parts compiled on their own:", "", *_components(parts), ""]
  gemm = groups[next(g for g in groups if g.startswith("one GEMM"))]
  opt = groups["optimizer update alone"]
  vg = groups["value_and_grad alone"]
  step = groups["whole train step"]
  lines += _diff_table("One GEMM, jaxpr equations by primitive", gemm[0],
                       gemm[1], "prims", top, "primitive")
  lines += _diff_table("One GEMM, jaxpr equations by emitting line", gemm[0],
                       gemm[1], "line", top, "source")
  lines += _diff_table("One GEMM, HLO instructions by opcode", gemm[0],
                       gemm[1], "opcodes", top, "opcode")
  lines += _diff_table("Optimizer update alone, jaxpr equations by primitive",
                       opt[0], opt[1], "prims", top, "primitive")
  lines += _diff_table("Optimizer update alone, HLO instructions by function",
                       opt[0], opt[1], "hlo", top, "function")
  lines += _diff_table("Optimizer update alone, HLO instructions by opcode",
                       opt[0], opt[1], "opcodes", top, "opcode")
  lines += _per_primitive("Optimizer update alone, HLO instructions per "
                          "primitive (op_name metadata)", opt[0], opt[1], top)
  lines += _diff_table("Optimizer update alone, jaxpr equations by line",
                       opt[0], opt[1], "line", top, "source")
  lines += _diff_table("value_and_grad alone (stock model), HLO instructions "
                       "by function", vg[0], vg[1], "hlo", top, "function")
  lines += _diff_table("Whole step, jaxpr equations by primitive", step[0],
                       step[1], "prims", top, "primitive")
  lines += _diff_table("Whole step, jaxpr equations by function", step[0],
                       step[1], "function", top, "function")
  lines += _diff_table("Whole step, HLO instructions by function", step[0],
                       step[1], "hlo", top, "function")
  lines += _per_primitive("Whole step, HLO instructions per primitive "
                          "(op_name metadata)", step[0], step[1], top)
  lines += _diff_table("Whole step, HLO instructions by opcode", step[0],
                       step[1], "opcodes", top, "opcode")
  lines += _suspects([gemm[1], opt[1], vg[1], vg[3], step[1]], top)
  return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
  import datetime
  import sys
  _exclude_libraries()
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")
  blocks = args.blocks
  where = cb.Where.of(args.target, args.targets_dir)
  # What each model is built with: build_parts' keywords.
  build = {"blocks": blocks, "rules": args.rules, "optimizer": args.optimizer}
  parts = gemm_parts(args.model, args.recipe, where)
  parts += optimizer_parts(args.model, args.recipe, where, **build)
  parts += scaling_parts(args.model, where, **build)
  parts += value_and_grad_parts(args.model, args.recipe, where, **build)
  parts += step_parts(args.model, args.recipe, where, **build)
  header = {"recipe": args.recipe, "model": args.model,
            "target": args.target, "rules": args.rules,
            "optimizer": args.optimizer,
            "blocks": blocks or cb.MODELS[args.model].blocks,
            "started": started, "commit": cb._commit(),
            "machine": cb._machine(), "versions": cb._versions(),
            "command": "python benchmarks/compile.py " + " ".join(
                sys.argv[1:])}
  print(render(parts, header, args.top))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(
        {"header": header, "parts": [p.summary() for p in parts]},
        indent=2) + "\n")
  return 0
