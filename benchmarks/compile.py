"""Compile time and optimized-HLO size of one train step, per recipe and loop.

Usage (from the repository root)::

  python benchmarks/compile.py --model gpt-d64 --json gpt.json
  python benchmarks/compile.py --model d512 --recipes fp8_current,mxfp8
  python benchmarks/compile.py --model smollm2 \\
      --variants stock,qlayers/fp8_current
  python benchmarks/compile.py --model smollm2 --blocks 4     # a shorter stack
  python benchmarks/compile.py --model smollm2 --repeat 3     # medians
  python benchmarks/compile.py --quick                        # ~1 min smoke run
  .venv-gpu/bin/python benchmarks/compile.py run --model gpt-d256 \
      --target h200 --variants stock,qlayers/fp8_delayed --repeat 2
  python benchmarks/compile.py breakdown --recipe fp8_current # what adds HLO
  python benchmarks/compile.py report gpt.json                # tables again

Models (``--model``, ``--blocks N`` changes the number of blocks):

* ``gpt-d64``: the transformer of ``benchmarks/models.py`` (stock ``nnx``
  layers: LayerNorm, separate Q/K/V/O with biases, GELU MLP, untied head),
  8 blocks, d_model 64, 4 heads, d_ff 256, seq 128, batch 8, vocab 256, BF16
  GEMMs.
* ``gpt-d256``: the same transformer at d_model 256, 4 heads, d_ff 1024 (8
  blocks, seq 128, batch 8, vocab 256): the model of the GPU-target compile
  times.
* ``gpt-d64-fused``: the GPT of ``examples/_common/gpt.py`` at the same size
  (fused QKV, RMSNorm, no biases: 6 Params per block instead of 16).
* ``d512``: the transformer of ``benchmarks/models.py`` with its default
  config (d_model 512, 4 heads, 2 blocks, d_ff 2048, seq 256, batch 8,
  vocab 256, BF16 GEMMs).
* ``smollm2``: SmolLM2-135M's architecture from ``examples/_common/llama.py``
  (30 blocks, d_model 576, 9 heads, 3 kv heads, d_ff 1536, vocab 49152, tied
  head), randomly initialised (nothing is downloaded), BF16 GEMMs, batch
  4 x 128 tokens and the optimizer of ``examples/finetune_smollm2.py``
  (global-norm clipping + AdamW under warmup/cosine).

gpt-d64, gpt-d256, gpt-d64-fused and d512 use ``optax.adamw(3e-4,
weight_decay=0.01)`` (``models.make_tx``); ``--optimizer examples`` gives
every model ``examples/train_lm.py``'s chain instead (global-norm clip,
AdamW, warmup/cosine), as qlayers' users and the examples train. Loop flavours (``--variants``, comma-separated):

* ``stock``: the unquantized model, ``nnx.Optimizer(model, tx,
  wrt=nnx.Param)`` and ``nnx.value_and_grad``; the baseline of the ratios.
* ``qlayers-wide``: the unquantized model with ``qlayers.Optimizer`` and
  ``qlayers.value_and_grad`` (what the qlayers loop costs by itself).
* ``stock-opt/RECIPE``: the quantized model, ``qlayers.value_and_grad`` and
  ``nnx.Optimizer`` on the Params; for delayed-scaling recipes the step also
  writes the gradient amax back and rolls the histories
  (``qlayers.update_scales``), so it does what ``qlayers.Optimizer`` does
  except the optax wrapper.
* ``qlayers/RECIPE``: the quantized model with ``qlayers.Optimizer`` and
  ``qlayers.value_and_grad`` (the loop of the examples).
* ``qlayers-unchecked/RECIPE``: ``qlayers/RECIPE`` with
  ``qlayers.Optimizer(..., skip_nonfinite=False)``, so the difference is
  what the optimizer's finiteness check costs.

``--recipes`` chooses RECIPE (default fp8_current, fp8_delayed, mxfp8,
deepseek_v3, mxfp4; ``all``: every quantizing recipe). Conversion is
``qlayers.quantize(model, recipe, rules=())`` by default (every
``nnx.Linear``, the output head too, as ``step.py`` does); ``--rules default``
uses qlayers' default rules (embeddings and head kept wide) instead. Layers a
recipe cannot take (K or N below its block size) are skipped by
``quantize``; the table gives the number converted.

Each variant is measured in a fresh subprocess (``--no-isolate`` measures
in-process) so that no trace, lowering or compilation cache is shared. The
step is written functionally (``nnx.split`` once, ``nnx.merge`` inside,
``jax.jit``), which is what ``nnx.jit`` does, so the phases can be timed
apart: trace (``jax.jit(step).trace``), lower (``.lower()``) and compile
(``.compile()``), wall and CPU time (all threads, and child processes
such as XLA:GPU's ptxas). ``--target h200|b200`` compiles the step for that
GPU without one (run with ``.venv-gpu/bin/python``; the device comes from
``gpu_compile.py``'s target configs). On a shared box the CPU time is the
steadier figure: the wall time grows with the load. Sizes: jaxpr
equations (nested ones included), StableHLO lines, and of the optimized HLO
(``compiled.as_text()``): instructions, lines and fusions. Nothing is run.
Compile times on a shared machine drift by tens of percent between runs;
``--repeat N`` runs all variants N times, round after round, and reports
each timing's median and every round's ratio to that round's stock.
``--cpus 1`` runs every isolated variant on that CPU alone (its
affinity). On a shared 2-core box that narrowed the spread: one H200
fp8_delayed compile took 9.9-14.0 s in five unpinned runs within an hour
and 12.5-14.7 s in eight pinned ones (``benchmarks/RESULTS.md``,
"GPU-target compile time on one pinned CPU"). XLA's parallel phases then
run serially, so its ratios read higher than unpinned ones. Ratios are
against ``stock`` of the same run. ``--json PATH`` writes everything; the
Markdown table goes to stdout.

``breakdown`` (see ``compile_breakdown.py``) takes the model apart for one
recipe: one GEMM's forward+backward against ``nnx.Linear``'s, the optimizer
update alone, ``value_and_grad`` alone, and the whole step's jaxpr equations
and HLO instructions by the function that emitted them and by primitive.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
  sys.path.insert(0, str(_HERE))
# An installed qlayers wins; otherwise the source tree next to benchmarks/.
sys.path.append(str(_HERE.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.extend import core as jex_core  # noqa: E402

import mdtable  # noqa: E402
import models  # noqa: E402

__all__ = ["MODELS", "DEFAULT_RECIPES", "Parts", "build_parts",
           "functional", "build_step", "measure", "iter_eqns",
           "jaxpr_stats", "hlo_stats", "variant_names", "main"]

DEFAULT_RECIPES = ("fp8_current", "fp8_delayed", "mxfp8", "deepseek_v3",
                   "mxfp4")
FLAVOURS = ("stock", "qlayers-wide", "stock-opt", "qlayers",
            "qlayers-unchecked")
_RESULT = "COMPILE_RESULT "  # prefix of the child's JSON line on stdout


# ==========================================================================
# Models: build(blocks) -> model, batch() -> batch, loss(model, batch), tx()


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """How to build one benchmark model, its batch, loss and optimizer."""

  name: str
  blocks: int
  describe: str
  build: Callable[[int], nnx.Module]
  batch: Callable[[], Any]
  loss: Callable[[nnx.Module, Any], jax.Array]
  tx: Callable[[], optax.GradientTransformation]
  # (tokens, d_model, d_ff): the MLP up projection's GEMM, which
  # ``compile.py breakdown`` compiles alone.
  mlp_up: tuple[int, int, int]


def _example(name: str):
  """The module ``examples._common.<name>``, imported on demand: each model
  and optimizer needs only its own (``llama`` reads tokenizers, which the
  GPU-compile environment of ``scripts/setup-gpu-compile`` lacks)."""
  return importlib.import_module(f"examples._common.{name}")


def _token_batch(batch: int, seq: int, vocab: int):
  key = jax.random.key(1_000)
  tokens = jax.random.randint(key, (batch, seq + 1), 0, vocab, jnp.int32)
  return tokens[:, :-1], tokens[:, 1:]


def _lm_loss(model, batch):
  inputs, targets = batch
  return _example("lm").next_token_loss(model(inputs), targets)


def _d64_config(blocks: int) -> models.TransformerConfig:
  return models.TransformerConfig(d_model=64, n_heads=4, d_ff=256,
                                  n_layers=blocks, seq_len=128, batch=8,
                                  vocab=256)


def _gpt(blocks: int):
  gpt = _example("gpt")
  cfg = gpt.GPTConfig(vocab_size=256, max_len=128, d_model=64,
                      n_layers=blocks, n_heads=4, d_ff=256,
                      dtype=jnp.bfloat16)
  return gpt.GPT(cfg, rngs=nnx.Rngs(0))


def _d256_config(blocks: int) -> models.TransformerConfig:
  return models.TransformerConfig(d_model=256, n_heads=4, d_ff=1024,
                                  n_layers=blocks, seq_len=128, batch=8,
                                  vocab=256)


def _d512_config(blocks: int) -> models.TransformerConfig:
  return models.TransformerConfig(n_layers=blocks)


def _smollm2(blocks: int):
  llama = _example("llama")
  cfg = llama.LlamaConfig(n_layers=blocks, dtype=jnp.bfloat16)
  return llama.Llama(cfg, rngs=nnx.Rngs(0))


def _examples_tx():
  # examples/train_lm.py's defaults (lr 3e-3, 300 steps, clip 1.0, ...).
  training = _example("training")
  return training.adamw_cosine(lr=3e-3, steps=300, warmup=30,
                               weight_decay=0.1, min_lr_ratio=0.1, clip=1.0,
                               b2=0.95)


def _smollm2_tx():
  # examples/finetune_smollm2.py's defaults (lr 1e-4, warmup 10, ...).
  training = _example("training")
  return training.adamw_cosine(lr=1e-4, steps=100, warmup=10,
                               weight_decay=0.01, min_lr_ratio=0.1, clip=1.0)


MODELS: dict[str, ModelSpec] = {
    "gpt-d64": ModelSpec(
        "gpt-d64", 8, "benchmarks/models.py TransformerLM, d_model 64, 4 "
        "heads, d_ff 256, vocab 256, BF16 GEMMs, batch 8 x 128",
        lambda n: models.build_model(_d64_config(n), seed=0),
        lambda: models.make_batch(_d64_config(8), seed=0), models.loss_fn,
        lambda: models.make_tx(_d64_config(8)), (1024, 64, 256)),
    "gpt-d256": ModelSpec(
        "gpt-d256", 8, "benchmarks/models.py TransformerLM, d_model 256, 4 "
        "heads, d_ff 1024, vocab 256, BF16 GEMMs, batch 8 x 128",
        lambda n: models.build_model(_d256_config(n), seed=0),
        lambda: models.make_batch(_d256_config(8), seed=0), models.loss_fn,
        lambda: models.make_tx(_d256_config(8)), (1024, 256, 1024)),
    "gpt-d64-fused": ModelSpec(
        "gpt-d64-fused", 8, "examples/_common/gpt.py GPT (fused QKV, RMSNorm, "
        "no biases), d_model 64, 4 heads, d_ff 256, vocab 256, BF16 GEMMs, "
        "batch 8 x 128",
        _gpt, lambda: _token_batch(8, 128, 256), _lm_loss,
        lambda: optax.adamw(3e-4, weight_decay=0.01), (1024, 64, 256)),
    "d512": ModelSpec(
        "d512", 2, "benchmarks/models.py TransformerLM, d_model 512, 4 heads,"
        " d_ff 2048, vocab 256, BF16 GEMMs, batch 8 x 256",
        lambda n: models.build_model(_d512_config(n), seed=0),
        lambda: models.make_batch(_d512_config(2), seed=0), models.loss_fn,
        lambda: models.make_tx(_d512_config(2)), (2048, 512, 2048)),
    "smollm2": ModelSpec(
        "smollm2", 30, "SmolLM2-135M architecture (random init), d_model 576,"
        " 9/3 heads, d_ff 1536, vocab 49152, tied head, BF16 GEMMs, batch "
        "4 x 128, finetune_smollm2 optimizer", _smollm2,
        lambda: _token_batch(4, 128, 49152), _lm_loss, _smollm2_tx,
        (512, 576, 1536)),
}


# ==========================================================================
# Variants


def variant_names(recipes) -> list[str]:
  """``stock``, ``qlayers-wide``, then ``stock-opt/R`` and ``qlayers/R``."""
  names = ["stock", "qlayers-wide"]
  for r in recipes:
    names += [f"stock-opt/{r}", f"qlayers/{r}"]
  return names


def _parse_variant(name: str) -> tuple[str, str | None]:
  flavour, _, recipe = name.partition("/")
  if flavour not in FLAVOURS:
    raise ValueError(f"unknown loop flavour {flavour!r} in variant {name!r}; "
                     f"expected one of {FLAVOURS}")
  if (flavour in ("stock-opt", "qlayers", "qlayers-unchecked")
      ) != bool(recipe):
    raise ValueError(f"variant {name!r}: stock-opt, qlayers and "
                     "qlayers-unchecked take a recipe (stock-opt/fp8_current),"
                     " stock and qlayers-wide none")
  return flavour, recipe or None


@dataclasses.dataclass
class Parts:
  """A variant's pieces: model, optimizer, loss, value_and_grad, batch."""

  model: nnx.Module
  opt: nnx.Optimizer
  loss_fn: Callable[[nnx.Module, Any], jax.Array]
  value_and_grad: Callable
  batch: Any
  flavour: str
  recipe: str | None
  info: dict[str, Any]

  def train_step(self, model, opt, batch) -> jax.Array:
    """``value_and_grad`` of the loss, then ``opt.update``; returns the loss."""
    loss, grads = self.value_and_grad(self.loss_fn)(model, batch)
    opt.update(model, grads)
    if self.flavour == "stock-opt" and self.info["delayed"]:
      _end_delayed_step(model, grads)
    return loss


def _end_delayed_step(model, grads) -> None:
  """What ``qlayers.Optimizer.update`` does to delayed-scaling state.

  Writes the gradient amaxes in ``grads`` and rolls the histories, through
  ``qlayers.update_scales``, or at library versions before it (934f975)
  through ``qlayers.state.write_grad_state`` and ``qlayers.commit_scales``.
  """
  import qlayers
  if hasattr(qlayers, "update_scales"):
    qlayers.update_scales(model, grads)
    return
  from qlayers import state as qstate
  qstate.write_grad_state(model, grads)
  qlayers.commit_scales(model)


def build_parts(model_name: str, variant: str, *, blocks: int | None = None,
                rules: str = "all", optimizer: str = "model") -> Parts:
  """The model (converted for quantized variants) and optimizer of a variant."""
  import qlayers
  spec = MODELS[model_name]
  flavour, recipe = _parse_variant(variant)
  n_blocks = spec.blocks if blocks is None else blocks
  model = spec.build(n_blocks)
  info: dict[str, Any] = {"blocks": n_blocks, "converted": 0, "skipped": 0,
                          "kept_wide": 0, "delayed": False}
  if recipe is not None:
    rec = qlayers.recipe(recipe)
    if not rec.quantized:
      raise ValueError(f"recipe {recipe!r} quantizes nothing; use the stock "
                       "or qlayers-wide variant")
    report = (qlayers.quantize(model, recipe, rules=()) if rules == "all"
              else qlayers.quantize(model, recipe))
    info.update(converted=len(report.converted), skipped=len(report.skipped),
                kept_wide=len(report.kept_wide), delayed=rec.delayed)
  tx = spec.tx() if optimizer == "model" else _examples_tx()
  if flavour in ("stock", "stock-opt"):
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  else:
    opt = qlayers.Optimizer(
        model, tx, skip_nonfinite=flavour != "qlayers-unchecked")
  vg = nnx.value_and_grad if flavour == "stock" else qlayers.value_and_grad
  return Parts(model, opt, spec.loss, vg, spec.batch(), flavour, recipe, info)


def functional(fn: Callable, *nodes):
  """``fn(*nodes, *args)`` as a pure ``f(state, *args) -> (state, out)``.

  The graph nodes are split once; ``f`` merges them, calls ``fn`` and
  returns their new state, as ``nnx.jit`` does.
  """
  graphdef, state = nnx.split(nodes)

  def f(state, *args):
    merged = nnx.merge(graphdef, state)
    out = fn(*merged, *args)
    return nnx.state(merged), out

  return f, state


def build_step(model_name: str, variant: str, *, blocks: int | None = None,
               rules: str = "all", optimizer: str = "model"):
  """The functional train step of ``variant`` and its inputs.

  Returns ``(step, state, batch, info)``: ``step(state, batch) -> (state,
  loss)`` is a pure function (``nnx.merge`` inside), ``info`` says what was
  converted.
  """
  parts = build_parts(model_name, variant, blocks=blocks, rules=rules,
                      optimizer=optimizer)
  step, state = functional(parts.train_step, parts.model, parts.opt)
  return step, state, parts.batch, parts.info


# ==========================================================================
# Sizes


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for j in (v if isinstance(v, (list, tuple)) else (v,)):
      if isinstance(j, jex_core.ClosedJaxpr):
        yield j.jaxpr
      elif isinstance(j, jex_core.Jaxpr):
        yield j


def iter_eqns(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs nested in it."""
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in _sub_jaxprs(eqn):
      yield from iter_eqns(sub)


def jaxpr_stats(jaxpr) -> dict[str, Any]:
  """Equation counts: top level, all (nested included), by primitive."""
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  prims = Counter(e.primitive.name for e in iter_eqns(jaxpr))
  return {"top": len(jaxpr.eqns), "total": sum(prims.values()),
          "by_primitive": dict(prims.most_common())}


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s([a-z][\w\-]*)\(")


def hlo_opcode(line: str) -> str | None:
  """The opcode of an HLO instruction line, or None for other lines."""
  m = _INSTR.match(line)
  if not m:
    return None
  op = _OPCODE.search(" " + m.group(1))
  return op.group(1) if op else None


def hlo_stats(text: str) -> dict[str, Any]:
  """Instructions (all computations, fused ones included), lines, fusions."""
  ops = Counter()
  lines = text.splitlines()
  for line in lines:
    op = hlo_opcode(line)
    if op is not None:
      ops[op] += 1
  return {"instructions": sum(ops.values()), "lines": len(lines),
          "fusions": ops.get("fusion", 0),
          "by_opcode": dict(ops.most_common())}


# ==========================================================================
# Measuring one variant


def _cpu_s() -> float:
  """CPU seconds of this process (all threads) and its finished children
  (XLA:GPU runs ptxas as a child process)."""
  import resource
  kids = resource.getrusage(resource.RUSAGE_CHILDREN)
  return time.process_time() + kids.ru_utime + kids.ru_stime


def _timed(fn):
  c0, t0 = _cpu_s(), time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t0, _cpu_s() - c0


def _gpu_target(target: str, targets_dir: str | None):
  """(device, arch) of a deviceless GPU target (``gpu_compile.TARGETS``)."""
  import gpu_compile  # needs jax with its CUDA plugin (.venv-gpu)
  spec = gpu_compile.TARGETS[target]
  folder = pathlib.Path(targets_dir or gpu_compile._targets_dir())  # noqa: SLF001
  return gpu_compile.gpu_device(spec, folder), spec.arch


@dataclasses.dataclass(frozen=True)
class Where:
  """What a program is compiled for: the host CPU (the default), or a GPU
  without one (``device`` of a deviceless topology, qlayers told ``arch``)."""

  device: Any = None
  arch: str | None = None

  @classmethod
  def of(cls, target: str, targets_dir: str | None = None) -> "Where":
    """``--target``'s ``cpu``, ``h200`` or ``b200``."""
    return cls() if target == "cpu" else cls(*_gpu_target(target,
                                                          targets_dir))

  def place(self, args):
    """``args`` as inputs on the target's device (shapes and dtypes only)."""
    if self.device is None:
      return args
    on = jax.sharding.SingleDeviceSharding(self.device)
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), args)

  def arch_context(self):
    """The context to trace in: GEMMs chosen for the target's GPU."""
    if self.arch is None:
      return contextlib.nullcontext()
    from qlayers import dispatch
    return dispatch.target_arch(self.arch)


def measure(model_name: str, variant: str, *, blocks: int | None = None,
            rules: str = "all", target: str = "cpu",
            targets_dir: str | None = None,
            optimizer: str = "model") -> dict[str, Any]:
  """Builds, traces, lowers and compiles one variant; never runs it.

  ``target`` ``h200``/``b200``: compiled for that GPU without one (the
  inputs placed on a device of its deviceless topology, qlayers told the
  architecture with `qlayers.dispatch.target_arch`)."""
  res: dict[str, Any] = {"model": model_name, "variant": variant,
                         "target": target}
  (step, state, batch, info), res["build_s"], _ = _timed(
      lambda: build_step(model_name, variant, blocks=blocks, rules=rules,
                         optimizer=optimizer))
  res.update(info)
  jitted = jax.jit(step)
  where = Where.of(target, targets_dir)
  state, batch = where.place((state, batch))
  with where.arch_context():
    traced, res["trace_s"], res["trace_cpu_s"] = _timed(
        lambda: jitted.trace(state, batch))
    lowered, res["lower_s"], res["lower_cpu_s"] = _timed(traced.lower)
  compiled, res["compile_s"], res["compile_cpu_s"] = _timed(lowered.compile)
  js = jaxpr_stats(traced.jaxpr)
  res.update(jaxpr_top=js["top"], jaxpr_eqns=js["total"],
             jaxpr_by_primitive=js["by_primitive"])
  res["stablehlo_lines"] = len(lowered.as_text().splitlines())
  hs = hlo_stats(compiled.as_text())
  res.update(hlo_instructions=hs["instructions"], hlo_lines=hs["lines"],
             fusions=hs["fusions"], hlo_by_opcode=hs["by_opcode"])
  return res


@contextlib.contextmanager
def _pinned(cpus: frozenset[int] | None):
  """This thread on ``cpus`` alone while it starts a child, which keeps
  that affinity (Linux's is per thread: XLA's threads here are untouched).
  A ``preexec_fn`` would do it in the child, but forking a threaded JAX
  process to run Python there is unsafe."""
  if cpus is None:
    yield
    return
  before = os.sched_getaffinity(0)
  os.sched_setaffinity(0, cpus)
  try:
    yield
  finally:
    os.sched_setaffinity(0, before)


def _measure_isolated(model_name: str, variant: str, *, blocks, rules,
                      timeout: float, target: str = "cpu",
                      targets_dir: str | None = None,
                      optimizer: str = "model",
                      cpus: frozenset[int] | None = None) -> dict[str, Any]:
  """`measure` in a fresh interpreter (no shared caches), on ``cpus``
  only where given (its CPU affinity, inherited by XLA's threads and
  ptxas)."""
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "measure",
         "--model", model_name, "--variant", variant, "--rules", rules,
         "--target", target, "--optimizer", optimizer]
  if targets_dir:
    cmd += ["--targets-dir", targets_dir]
  if blocks is not None:
    cmd += ["--blocks", str(blocks)]
  t0 = time.perf_counter()
  try:
    with _pinned(cpus):
      proc = subprocess.run(cmd, capture_output=True, text=True,
                            timeout=timeout, check=False,
                            env=dict(os.environ,
                                     JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1"))
  except subprocess.TimeoutExpired:
    return {"model": model_name, "variant": variant,
            "error": f"timed out after {timeout:.0f} s"}
  for line in proc.stdout.splitlines():
    if line.startswith(_RESULT):
      out = json.loads(line[len(_RESULT):])
      out["process_s"] = time.perf_counter() - t0
      return out
  tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
  return {"model": model_name, "variant": variant,
          "error": f"exit {proc.returncode}: {tail[0][:300]}"}


# ==========================================================================
# Report


def _ratio(a, b) -> str:
  return "—" if not a or not b else f"{a / b:.2f}x"


def render(results: list[dict[str, Any]], header: dict[str, Any]) -> str:
  """A header of facts and one Markdown table."""
  lines = [
      f"### Train-step compile cost: {header['model']} "
      f"({header['blocks']} blocks)"
      + (f", deviceless {header['target']}"
         if header.get("target", "cpu") != "cpu" else ""), "",
      f"- date: {header['started']}; wall {header['wall_s']:.0f} s; "
      f"qlayers commit {header['commit']}",
      f"- machine: {header['machine']}",
      f"- versions: {header['versions']}",
      f"- model: {header['describe']}",
      f"- optimizer: {header.get('optimizer', 'the model' + chr(39) + 's')}",
      f"- conversion: {header['rules']}; each variant in "
      f"{'a fresh process' if header['isolate'] else 'one shared process'}"
      + (f", pinned to CPU(s) {', '.join(map(str, header['cpus']))}"
         if header.get("cpus") else ""),
      f"- command: `{header['command']}`", "",
      *mdtable.head(
          ["variant", "converted", "trace s", "lower s", "compile s",
           "compile CPU s", "compile vs stock (wall / CPU)",
           "trace + lower + compile s (vs stock)", "jaxpr eqns",
           "StableHLO lines", "HLO instr", "HLO lines", "fusions",
           "HLO instr vs stock"], "l" + "r" * 13),
  ]
  base = next((r for r in results if r["variant"] == "stock"
               and "error" not in r), None)
  for r in results:
    if "error" in r:
      lines.append(mdtable.row(r["variant"], f"failed: "
                               f"{r['error'].replace('|', '/')}",
                               *[None] * 12))
      continue
    conv = "—" if r["variant"] in ("stock", "qlayers-wide") else (
        f"{r['converted']}" + (f" ({r['skipped']} skipped)"
                               if r["skipped"] else ""))
    lines.append(mdtable.row(
        r["variant"], conv, f"{r['trace_s']:.2f}", f"{r['lower_s']:.2f}",
        f"{r['compile_s']:.2f}", f"{r['compile_cpu_s']:.2f}",
        _ratio(r["compile_s"], base and base["compile_s"]) + " / "
        + _ratio(r["compile_cpu_s"], base and base["compile_cpu_s"]),
        f"{_first_step(r):.2f} ("
        + _ratio(_first_step(r), base and _first_step(base)) + ")",
        f"{r['jaxpr_eqns']:,}", f"{r['stablehlo_lines']:,}",
        f"{r['hlo_instructions']:,}", f"{r['hlo_lines']:,}",
        f"{r['fusions']:,}",
        _ratio(r["hlo_instructions"], base and base["hlo_instructions"])))
  if base and base.get("rounds"):
    lines += ["", f"Timings are medians of {len(base['rounds'])} interleaved "
              "rounds; compile wall / CPU vs stock in each round:", ""]
    for r in results:
      if r is base or not r.get("rounds"):
        continue
      each = [_ratio(a.get("compile_s"), b.get("compile_s")) + " / "
              + _ratio(a.get("compile_cpu_s"), b.get("compile_cpu_s"))
              for a, b in zip(r["rounds"], base["rounds"])]
      lines.append(f"- {r['variant']}: " + ", ".join(each))
  return "\n".join(lines) + "\n"


def _first_step(r: dict[str, Any]) -> float:
  """What a first step waits for before it runs: trace, lower, compile."""
  return r["trace_s"] + r["lower_s"] + r["compile_s"]


def _machine() -> str:
  try:
    load = [round(x, 2) for x in os.getloadavg()]
  except OSError:
    load = []
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(l.split(":", 1)[1].strip() for l in f
                 if l.lower().startswith("model name"))
  except (OSError, StopIteration):
    pass
  return (f"{os.cpu_count()} cores, {cpu}, {jax.default_backend()}; load avg "
          f"at start {load}")


def _versions() -> str:
  import flax
  return (f"python {platform.python_version()}, jax {jax.__version__}, "
          f"flax {flax.__version__}, optax {optax.__version__}")


def _commit() -> str:
  """The git commit of the imported qlayers' tree (``+dirty`` if changed)."""
  import qlayers
  root = pathlib.Path(qlayers.__file__).resolve().parent.parent
  try:
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short",
                           "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                            "--", "qlayers"], capture_output=True, text=True,
                           check=True).stdout.strip()
    return head + ("+dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return os.environ.get("QLAYERS_COMMIT", f"unknown ({root})")


# ==========================================================================
# Command line


def _recipes(arg: str) -> list[str]:
  if arg != "all":
    return [r for r in arg.split(",") if r]
  import qlayers
  return [n for n in qlayers.available_recipes()
          if qlayers.recipe(n).quantized]


def _run(args: argparse.Namespace) -> int:
  if args.quick:
    args.model, args.blocks = "gpt-d64", args.blocks or 2
    args.variants = args.variants or ("stock,qlayers-wide,"
                                      "stock-opt/fp8_current,"
                                      "qlayers/fp8_current")
  names = (args.variants.split(",") if args.variants
           else variant_names(_recipes(args.recipes)))
  for n in names:  # every name before anything compiles
    try:
      _, recipe = _parse_variant(n)
      if recipe:
        import qlayers
        qlayers.recipe(recipe)
    except (ValueError, FileNotFoundError) as e:
      raise SystemExit(f"compile.py: {e}") from None
  if "stock" not in names:
    names.insert(0, "stock")
  if args.cpus is not None:
    if not args.isolate:
      raise SystemExit("--cpus pins the isolated variants' processes; it "
                       "needs --isolate.")
    if not args.cpus <= os.sched_getaffinity(0):
      raise SystemExit(f"--cpus {sorted(args.cpus)}: this process may run "
                       f"only on {sorted(os.sched_getaffinity(0))}.")
  spec = MODELS[args.model]
  t_start = time.perf_counter()
  header = {
      "model": args.model, "blocks": args.blocks or spec.blocks,
      "target": args.target,
      "describe": spec.describe, "started": datetime.datetime.now(
          datetime.timezone.utc).isoformat(timespec="seconds"),
      "machine": _machine(), "versions": _versions(), "commit": _commit(),
      "rules": ("qlayers.quantize(model, recipe, rules=()): every nnx.Linear"
                if args.rules == "all" else
                "qlayers.quantize(model, recipe): default rules"),
      "isolate": args.isolate, "optimizer": (
          "the model's" if args.optimizer == "model" else
          "the examples' (global-norm clipping + AdamW, warmup/cosine)"),
      "command": "python benchmarks/compile.py " + " ".join(sys.argv[1:]),
      "cpus": None if args.cpus is None else sorted(args.cpus),
  }
  runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
  for _ in range(args.repeat):
    for name in names:
      runs[name].append(_measure_one(args, name))
  results = [_combine(runs[name]) for name in names]
  header["repeat"] = args.repeat
  header["wall_s"] = time.perf_counter() - t_start
  md = render(results, header)
  print(md)
  if args.append_md:
    with open(args.append_md, "a") as f:
      f.write("\n" + md)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(
        {"header": header, "results": results}, indent=2) + "\n")
  return 1 if any("error" in r for r in results) else 0


# Timings that vary from run to run; a repeated variant reports their median.
_TIMES = ("build_s", "trace_s", "trace_cpu_s", "lower_s", "lower_cpu_s",
          "compile_s", "compile_cpu_s", "process_s")


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
  """One record of a variant's runs: the median of each timing (the sizes
  are the same every run), with every run's timings under ``rounds``."""
  good = [r for r in runs if "error" not in r]
  if len(runs) == 1 or not good:
    return runs[0]
  out = dict(good[0])
  for key in _TIMES:
    if key in out:
      out[key] = statistics.median(r[key] for r in good)
  out["rounds"] = [{k: r.get(k) for k in _TIMES} if "error" not in r
                   else {"error": r["error"]} for r in runs]
  return out


def _measure_one(args: argparse.Namespace, name: str) -> dict[str, Any]:
  """One variant measured once (isolated unless ``--no-isolate``)."""
  if args.isolate:
    r = _measure_isolated(args.model, name, blocks=args.blocks,
                          rules=args.rules, timeout=args.timeout,
                          target=args.target, targets_dir=args.targets_dir,
                          optimizer=args.optimizer, cpus=args.cpus)
  else:
    try:
      r = measure(args.model, name, blocks=args.blocks, rules=args.rules,
                  target=args.target, targets_dir=args.targets_dir,
                  optimizer=args.optimizer)
    except Exception as e:  # noqa: BLE001 - reported, others go on
      r = {"model": args.model, "variant": name,
           "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
  msg = r.get("error") or (
      f"trace {r['trace_s']:.1f}s lower {r['lower_s']:.1f}s compile "
      f"{r['compile_s']:.1f}s, {r['hlo_instructions']:,} HLO instr")
  print(f"[{args.model}] {name}: {msg}", file=sys.stderr, flush=True)
  return r


def _report_cmd(args: argparse.Namespace) -> int:
  """Prints the tables of earlier ``--json`` files again."""
  for path in args.paths:
    data = json.loads(pathlib.Path(path).read_text())
    print(render(data["results"], data["header"]))
  return 0


def _measure_cmd(args: argparse.Namespace) -> int:
  res = measure(args.model, args.variant, blocks=args.blocks,
                rules=args.rules, target=args.target,
                targets_dir=args.targets_dir, optimizer=args.optimizer)
  print(_RESULT + json.dumps(res), flush=True)
  return 0


def _add_common(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", choices=sorted(MODELS), default="gpt-d64")
  p.add_argument("--blocks", type=int, default=None,
                 help="number of blocks (default: the model's own)")
  p.add_argument("--rules", choices=("all", "default"), default="all",
                 help="all: quantize(model, r, rules=()) (every linear); "
                 "default: qlayers' default rules (head kept wide)")
  p.add_argument("--target", choices=("cpu", "h200", "b200"), default="cpu",
                 help="compile for this device: the host CPU, or an NVIDIA "
                 "GPU without one (deviceless; run with .venv-gpu's python)")
  p.add_argument("--targets-dir", default=None,
                 help="folder with the GPU target configs (default: "
                 "gpu_compile.py's shared gpu-targets)")


def _add_optimizer(p: argparse.ArgumentParser) -> None:
  p.add_argument("--optimizer", choices=("model", "examples"),
                 default="model",
                 help="model: the model's own optax transformation (see "
                 "the models); examples: examples/train_lm.py's (global-norm "
                 "clipping + AdamW under warmup/cosine)")


def _at_least_one(text: str) -> int:
  """``--repeat``'s value: a whole number, at least 1."""
  try:
    n = int(text)
  except ValueError:
    n = 0
  if n < 1:
    raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}")
  return n


def _cpu_set(text: str) -> frozenset[int]:
  """``--cpus``' value: comma-separated CPU numbers, none negative."""
  try:
    cpus = frozenset(int(c) for c in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"expected comma-separated CPU numbers, got {text!r}") from None
  if not cpus or min(cpus) < 0:
    raise argparse.ArgumentTypeError(
        f"expected CPU numbers >= 0, got {text!r}")
  return cpus


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("run", help="compile cost of every variant (default)")
  _add_common(r)
  _add_optimizer(r)
  r.add_argument("--recipes", default=",".join(DEFAULT_RECIPES),
                 help="comma-separated recipe names, or 'all'")
  r.add_argument("--variants", default=None,
                 help="comma-separated variants (stock, qlayers-wide, "
                 "stock-opt/R, qlayers/R); default: all for --recipes")
  r.add_argument("--quick", action="store_true",
                 help="gpt-d64 with 2 blocks, fp8_current only")
  r.add_argument("--isolate", action=argparse.BooleanOptionalAction,
                 default=True, help="each variant in a fresh process")
  r.add_argument("--repeat", type=_at_least_one, default=1, metavar="N",
                 help="measure every variant N times, interleaved, and "
                 "report each timing's median (default 1)")
  r.add_argument("--cpus", type=_cpu_set, default=None, metavar="LIST",
                 help="comma-separated CPU numbers each isolated variant "
                 "runs on (its affinity), e.g. 1: steadier timings on a "
                 "shared box, XLA's parallel phases run serially")
  r.add_argument("--timeout", type=float, default=1800.0,
                 help="seconds per isolated variant")
  r.add_argument("--json", default=None, metavar="PATH")
  r.add_argument("--append-md", default=None, metavar="PATH")
  m = sub.add_parser("measure", help="one variant, JSON on stdout (internal)")
  _add_common(m)
  _add_optimizer(m)
  m.add_argument("--variant", required=True)
  rep = sub.add_parser("report", help="the tables of earlier --json files")
  rep.add_argument("paths", nargs="+", metavar="JSON")
  b = sub.add_parser("breakdown", help="where one recipe's step gets its "
                     "size (see compile_breakdown.py)")
  _add_common(b)
  _add_optimizer(b)
  b.add_argument("--recipe", default="fp8_current")
  b.add_argument("--top", type=int, default=25,
                 help="rows of each by-source / by-primitive table")
  b.add_argument("--json", default=None, metavar="PATH")
  return p


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] not in ("run", "measure", "report", "breakdown",
                                 "-h", "--help"):
    argv.insert(0, "run")
  args = _parser().parse_args(argv)
  if args.cmd == "measure":
    return _measure_cmd(args)
  if args.cmd == "report":
    return _report_cmd(args)
  if args.cmd == "breakdown":
    import compile_breakdown
    return compile_breakdown.main(args)
  return _run(args)


if __name__ == "__main__":
  sys.exit(main())
