"""What the quantized GEMMs compile to on H200 (sm_90) and B200 (sm_100).

Compiles qlayers programs for NVIDIA GPUs on a machine without one (the
target configs and recipe are in the shared ``gpu-targets`` folder) and reads
the optimized HLO: for every GEMM, the kernel XLA emits, its operand and
output dtypes, whether the scales are real operands of the GEMM (folded) or
applied by other kernels, and the extra passes between the quantize kernel
and the GEMM and between the GEMM and its consumer; then XLA's cost analysis
and a roofline model of the step time against the BF16 step.

Setup and use (from the repository root)::

  bash scripts/setup-gpu-compile                       # makes .venv-gpu/
  .venv-gpu/bin/python benchmarks/gpu_compile.py       # every target/recipe
  .venv-gpu/bin/python benchmarks/gpu_compile.py --targets b200 \\
      --recipes bf16,mxfp8 --programs layer --tokens 1024 --json out.json
  .venv-gpu/bin/python benchmarks/gpu_compile.py --triton off --ffi-dir '' \\
      --programs llama3-8b,llama2-70b --recipes bf16,fp8_current,mxfp8

Programs: ``layer`` is one `qlayers.QuantDense` (``--in-features`` x
``--out-features``, ``--tokens`` rows, BF16 compute) forward and backward,
``value_and_grad`` of ``sum(y * ct)`` for a cotangent input ``ct`` (a real
tensor, so XLA cannot fold the backward GEMMs away) with respect to the
kernel and the input, so Fprop, Dgrad and Wgrad are all live. ``block`` is a
Llama-style block (RMSNorm, q/k/v/o, causal attention, SwiGLU MLP) of stock
NNX layers converted with ``qlayers.quantize(model, recipe, rules=())`` and
one training step with `qlayers.value_and_grad` and `qlayers.Optimizer`,
at the ``--block-*`` shapes; ``d2048``, ``llama3-8b`` and ``llama2-70b`` are
that block at fixed shapes (`BLOCK_PRESETS`: the old d 2048 block; Llama-3-8B
d 4096, 32/8 heads, SwiGLU 14336; Llama-2-70B d 8192, 64/8, 28672; seq 4096,
batch 1, cuDNN fused attention). Each run also reports the *ideal* of every
recipe: the BF16 program of the same run with each layer GEMM at the peak
of the recipe's formats and no extra pass, and the fraction of it reached.

Each target is compiled with XLA's Triton GEMMs on (its default: without a
device there is no autotuning, every dot becomes a Triton fusion) and off
(``xla_gpu_enable_triton_gemm=false``: the cuBLAS/cuDNN path that the
autotuner weighs against Triton on a real GPU). Each target and flag runs in
its own worker process; a recipe that fails to compile, or crashes the
compiler, is reported with its error line.

qlayers chooses each GEMM's code for the platform being lowered for
(``lax.platform_dependent``); the GPU generation comes from
``qlayers.dispatch.target_arch``, which each worker sets to its target's
architecture (``--host-arch`` leaves it unset: the choice a process makes
when it cannot tell which GPU it compiles for). The native cuBLASLt library
(``ffi/build_cuda.sh``) is registered without a device when it is found
(``--ffi-dir``, default ``build/cuda/ffi``), so GEMMs the dispatch table
sends to ``ffi`` show up as their FFI custom calls.

The roofline numbers are a model prediction, not a measurement: each kernel
takes ``max(flops / peak, bytes / bandwidth)`` at the target's published
dense peak for the GEMM's operand type, kernels run back to back. A kernel
that is neither a GEMM nor attention also takes at least the time its
threads need to issue their instructions (the issue roof: each kernel's
machine code and launch grid, read from the compile's XLA dump;
`kernel_code`), so a cast kernel heavy in arithmetic is not charged its
bytes alone. The machine code is the SASS that ptxas makes of the dumped
PTX (``nvdisasm`` counts it per pipeline: `sass_counts`), or the PTX itself
where those tools are missing. The
"+launches" columns add `LAUNCH_US` per kernel, XLA:GPU's own launch
estimate, which the roofline alone leaves out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Iterable

_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parent
if str(_HERE) not in sys.path:
  sys.path.insert(0, str(_HERE))

import mdtable  # noqa: E402

RECIPES = ("bf16", "fp8_current", "fp8_delayed", "fp8_rowwise",
           "deepseek_v3", "deepseek_v3_ue8m0", "mxfp8", "mxfp6", "mxfp4",
           "nvfp4")
# "block": the --block-* flags; the others: BLOCK_PRESETS.
PROGRAMS = ("layer", "block", "d2048", "llama3-8b", "llama2-70b", "moe")


@dataclasses.dataclass(frozen=True)
class Target:
  """A GPU to compile for and its published dense peaks (TFLOP/s, TB/s)."""

  name: str
  config: str  # GpuTargetConfigProto text file in the gpu-targets folder
  arch: str
  bf16: float
  fp8: float
  fp4: float | None  # None: no native FP4/FP6 tensor cores
  tf32: float
  fp32: float
  tbps: float
  source: str
  link_gbps: float | None = None  # NVLink, GB/s each way per GPU
  sms: int = 0  # streaming multiprocessors and their clock, as the target
  ghz: float = 0.0  # file says (core_count, clock_rate_ghz)


# H200 SXM: the H100 SXM5 tensor-core rates (same GH100 silicon) with the
# H200's 4.8 TB/s HBM3e; dense, no sparsity (NVIDIA H100/H200 datasheets as
# tabulated on glennklockwood.com/garden/processors/h100). B200: NVIDIA's HGX
# B200 per-GPU figures (FP8/FP6 9 PF, FP4 18 PF, BF16 4.5 PF, TF32 2.2 PF, all
# with sparsity, so halved here; FP32 75 TF; 7.7 TB/s), also
# glennklockwood.com/garden/processors/B200 (HGX, 1000 W). NVLink: 900 GB/s
# per H200 (NVLink 4) and 1,800 GB/s per B200 (NVLink 5, "2x 900 GB/s" on
# the same page), both directions together, so half each way.
TARGETS = {
    "h200": Target("h200", "h200.txtpb", "sm_90", bf16=989.0, fp8=1979.0,
                   fp4=None, tf32=494.7, fp32=66.9, tbps=4.8,
                   source="NVIDIA H100/H200 SXM datasheets (dense)",
                   link_gbps=450.0, sms=132, ghz=1.98),
    "b200": Target("b200", "b200_approx.txtpb", "sm_100", bf16=2250.0,
                   fp8=4500.0, fp4=9000.0, tf32=1100.0, fp32=75.0, tbps=7.7,
                   source="NVIDIA HGX B200 per-GPU specs (dense)",
                   link_gbps=900.0, sms=148, ghz=1.98),
}

# ==========================================================================
# HLO text parsing (pure functions on the optimized HLO of `as_text()`)

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "s16": 2, "u16": 2,
    "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4,
    "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3": 1, "f8e3m4": 1,
    "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "f6e2m3fn": 0.75,
    "f6e3m2fn": 0.75, "token": 0,
}
NARROW = {d for d, b in DTYPE_BYTES.items()
          if b <= 1 and d not in ("pred", "s8", "token")}
WIDE_FLOAT = ("bf16", "f16", "f32", "f64")

GEMM_CALLS = {
    "__cublas$lt$matmul$f8": "cuBLASLt FP8",
    "__cublas$lt$matmul": "cuBLASLt",
    "__cublas$gemm": "cuBLAS",
    "__cudnn$blockScaledDot": "cuDNN block-scaled",
    # qlayers' own FFI kernels (ffi/gpu/blaslt_gemm.cu): a, a scales, b,
    # b scales; both operands (rows, K).
    "qlayers_gemm_fp8_tensor": "qlayers FFI FP8",
    "qlayers_gemm_fp8_rowwise": "qlayers FFI FP8 row-wise",
    "qlayers_gemm_blockwise": "qlayers FFI FP8 blockwise",
    "qlayers_gemm_mx": "qlayers FFI MX",
}
FFI_GEMMS = {k for k in GEMM_CALLS if k.startswith("qlayers_")}
# Top-level instructions that move no data (views, plumbing).
FREE_OPS = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple",
            "opt-barrier", "after-all", "partition-id", "replica-id",
            "iota"}

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Array:
  dtype: str
  dims: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.dims)

  @property
  def nbytes(self) -> float:
    return self.size * DTYPE_BYTES.get(self.dtype, 4)


def parse_shape(text: str) -> tuple[Array, ...]:
  """Every array in an HLO shape (``f32[2,3]{1,0}`` or a tuple of them)."""
  out = []
  for dtype, dims in _ARRAY.findall(text):
    if dtype not in DTYPE_BYTES:
      continue
    out.append(Array(dtype, tuple(int(d) for d in dims.split(",") if d)))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Inst:
  """One HLO instruction: ``%name = shape opcode(operands), attrs``."""

  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attrs: str
  root: bool = False
  literal: str = ""

  @property
  def arrays(self) -> tuple[Array, ...]:
    return parse_shape(self.shape)

  def attr(self, key: str) -> str | None:
    """The value of ``key=`` (a ``{...}`` or ``"..."`` group, or a token)."""
    m = re.search(r"(?:^|[\s,])" + re.escape(key) + r"=", self.attrs)
    if not m:
      return None
    return _group(self.attrs, m.end())

  @property
  def op_name(self) -> str:
    m = re.search(r'op_name="([^"]*)"', self.attrs)
    return m.group(1) if m else ""


def _group(text: str, i: int) -> str:
  """The balanced ``{...}``/``(...)``/``"..."`` group or token at ``i``."""
  if i >= len(text):
    return ""
  if text[i] == '"':
    j = text.index('"', i + 1)
    return text[i + 1:j]
  pairs = {"{": "}", "(": ")", "[": "]"}
  if text[i] in pairs:
    depth, j, quoted = 0, i, False
    while j < len(text):
      c = text[j]
      if c == '"':
        quoted = not quoted
      elif not quoted and c in pairs:
        depth += 1
      elif not quoted and c in pairs.values():
        depth -= 1
        if depth == 0:
          return text[i + 1:j]
      j += 1
    return text[i + 1:]
  m = re.match(r"[^,\s]*", text[i:])
  return m.group(0) if m else ""


def _split_top(text: str) -> list[str]:
  """Splits on commas outside brackets and quotes."""
  parts, depth, cur, quoted = [], 0, [], False
  for c in text:
    if c == '"':
      quoted = not quoted
    if not quoted and c in "{([":
      depth += 1
    elif not quoted and c in "})]":
      depth -= 1
    if c == "," and depth == 0 and not quoted:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(c)
  if cur:
    parts.append("".join(cur))
  return [p.strip() for p in parts if p.strip()]


_INST = re.compile(r"^\s*(ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")


def parse_instruction(line: str) -> Inst | None:
  """Parses one instruction line; ``None`` for anything else."""
  m = _INST.match(line)
  if not m:
    return None
  root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
  if rest.startswith("("):
    shape = "(" + _group(rest, 0) + ")"
    rest = rest[len(shape):].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  m2 = re.match(r"([a-z][\w\-\.\$]*)\(", rest)
  if not m2:
    return None
  opcode = m2.group(1)
  inner = _group(rest, m2.end() - 1)
  attrs = rest[m2.end() + len(inner) + 1:].lstrip(", ")
  inner = re.sub(r"/\*.*?\*/", "", inner)
  operands, literal = [], ""
  if opcode in ("constant", "parameter"):
    literal = inner.strip()
  else:
    for part in _split_top(inner):
      ref = re.search(r"%([^\s,\)]+)\s*$", part)
      if ref:
        operands.append(ref.group(1))
  return Inst(name, shape, opcode, tuple(operands), attrs, root, literal)


@dataclasses.dataclass
class Computation:
  name: str
  entry: bool
  insts: dict[str, Inst]
  params: list[str]  # parameter instruction names by parameter number

  @property
  def root(self) -> Inst:
    for inst in self.insts.values():
      if inst.root:
        return inst
    return list(self.insts.values())[-1]

  def users(self) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {n: [] for n in self.insts}
    for inst in self.insts.values():
      for op in inst.operands:
        if op in out:
          out[op].append(inst.name)
    return out


_COMP = re.compile(r"^(ENTRY\s+)?%([^\s(]+)\s*\(.*\)\s*->.*\{\s*$")


def parse_module(text: str) -> dict[str, Computation]:
  """The computations of an HLO module text, by name."""
  comps: dict[str, Computation] = {}
  cur = None
  for line in text.splitlines():
    m = _COMP.match(line)
    if m:
      cur = Computation(m.group(2), bool(m.group(1)), {}, [])
      comps[cur.name] = cur
      continue
    if cur is None:
      continue
    if line.startswith("}"):
      cur = None
      continue
    inst = parse_instruction(line)
    if inst is None:
      continue
    cur.insts[inst.name] = inst
    if inst.opcode == "parameter":
      num = int(inst.literal)
      while len(cur.params) <= num:
        cur.params.append("")
      cur.params[num] = inst.name
  return comps


def entry(comps: dict[str, Computation]) -> Computation:
  for c in comps.values():
    if c.entry:
      return c
  raise ValueError("HLO module has no ENTRY computation")


def called(inst: Inst) -> list[str]:
  """Names of the computations an instruction calls."""
  names = []
  for key in ("calls", "body", "condition", "to_apply",
              "branch_computations"):
    v = inst.attr(key)
    if v:
      names += [p.strip().lstrip("%") for p in v.split(",") if p.strip()]
  return names


def fusion_kind(inst: Inst) -> str:
  """``kLoop``/``kInput``/``kCustom``, plus the backend kind if any."""
  kind = inst.attr("kind") or ""
  m = re.search(r'"kind":"([^"]+)"', inst.attrs)
  return f"{kind}:{m.group(1)}" if m else kind


def _dims_attr(inst: Inst, key: str) -> tuple[int, ...]:
  v = inst.attr(key)
  return tuple(int(x) for x in v.split(",") if x.strip()) if v else ()


def _json_dims(inst: Inst, key: str) -> tuple[int, ...]:
  m = re.search(r'"' + key + r'":\[([^\]]*)\]', inst.attrs)
  if not m:
    return ()
  return tuple(int(x.strip().strip('"')) for x in m.group(1).split(",")
               if x.strip())


def dot_dims(lhs: Array, rhs: Array, lc, rc, lb, rb) -> dict:
  """``batch, m, n, k`` of a dot_general from operand shapes and dims."""
  del rc
  batch = math.prod(lhs.dims[d] for d in lb)
  k = math.prod(lhs.dims[d] for d in lc)
  m = math.prod(s for d, s in enumerate(lhs.dims) if d not in (*lc, *lb))
  n = rhs.size // max(batch * k, 1)
  return {"batch": batch, "m": m, "n": n, "k": k}


# --------------------------------------------------------------------------
# GEMM discovery and classification


@dataclasses.dataclass
class Gemm:
  """One GEMM kernel of the optimized module and what feeds it."""

  name: str  # top-level instruction
  kernel: str  # e.g. "cuBLASLt FP8", "Triton", "cuDNN block-scaled"
  op: str  # dot / scaled-dot / custom-call target
  a: str  # operand dtypes as the GEMM reads them ("f8e4m3fn", "u8->bf16")
  b: str
  out: str
  dims: dict
  scales: str  # how the scales reach the GEMM
  folded: bool | None  # scales applied inside the GEMM kernel
  epilogue: tuple[str, ...]  # in-kernel ops after the product (Triton)
  operands: tuple[str, ...]  # top-level operand names (data operands)
  precision: str = ""
  op_name: str = ""

  @property
  def flops(self) -> float:
    d = self.dims
    return 2.0 * d["batch"] * d["m"] * d["n"] * d["k"]


def _const_value(comp: Computation, name: str) -> str | None:
  """The literal of a (possibly broadcast/bitcast) constant, else None."""
  inst = comp.insts.get(name)
  while inst is not None and inst.opcode in ("broadcast", "bitcast",
                                             "reshape", "copy", "convert"):
    inst = comp.insts.get(inst.operands[0]) if inst.operands else None
  if inst is not None and inst.opcode == "constant":
    return inst.literal
  return None


def _cone_params(comps, comp: Computation, name: str,
                 seen=None) -> set[int]:
  """Parameter numbers of ``comp`` in the backward cone of ``name``,
  following nested fusions."""
  seen = set() if seen is None else seen
  if name in seen:
    return set()
  seen.add(name)
  inst = comp.insts[name]
  if inst.opcode == "parameter":
    return {comp.params.index(name)}
  out: set[int] = set()
  if inst.opcode == "fusion":
    inner = comps.get(called(inst)[0]) if called(inst) else None
    if inner is not None:
      idx = _cone_params(comps, inner, inner.root.name)
      for i in idx:
        if i < len(inst.operands):
          out |= _cone_params(comps, comp, inst.operands[i], seen)
      return out
  for op in inst.operands:
    out |= _cone_params(comps, comp, op, seen)
  return out


def _find(comps, comp: Computation, opcodes: tuple[str, ...]):
  """(computation, instruction) of the first op in ``opcodes`` inside
  ``comp`` or the fusions it calls."""
  for inst in comp.insts.values():
    if inst.opcode in opcodes:
      return comp, inst
  for inst in comp.insts.values():
    if inst.opcode == "fusion":
      for c in called(inst):
        if c in comps:
          hit = _find(comps, comps[c], opcodes)
          if hit:
            return hit
  return None


def _operand_view(comps, comp, name, outer_params) -> str:
  """Dtype a dot operand is read as: ``"f8e4m3fn"`` when the dot consumes
  the loaded type, ``"f8e4m3fn->bf16"`` when it is converted in the kernel
  first (``outer_params``: dtypes of the fusion's parameters)."""
  inst = comp.insts[name]
  mma = inst.arrays[0].dtype if inst.arrays else "?"
  idx = _cone_params(comps, comp, name)
  # Large parameters only: scalars (scales, flags) are not the operand.
  loads = sorted({outer_params[i].dtype for i in idx if i < len(outer_params)
                  and outer_params[i].size > 1})
  if not loads or loads == [mma]:
    return mma
  return "+".join(loads) + "->" + mma


def _forward_ops(comp: Computation, start: str) -> tuple[str, ...]:
  """Opcodes on the path from ``start`` to the root (the epilogue)."""
  users = comp.users()
  ops, cur = [], start
  while users.get(cur):
    cur = users[cur][0]
    op = comp.insts[cur].opcode
    if op not in ("bitcast", "reshape", "broadcast"):
      ops.append(op)
  return tuple(ops)


def _precision(inst: Inst) -> str:
  m = re.search(r"operand_precision=\{([^}]*)\}", inst.attrs)
  if m:
    return m.group(1)
  m = re.search(r'"operand_precision":\[([^\]]*)\]', inst.attrs)
  alg = re.search(r'"algorithm":"([^"]+)"', inst.attrs)
  out = m.group(1).replace('"', "") if m else ""
  if alg and alg.group(1) != "ALG_UNSET":
    out += f" {alg.group(1)}"
  return out.strip()


def classify_fusion_gemm(comps, top: Computation, inst: Inst) -> Gemm | None:
  """A fusion holding a dot or scaled-dot (Triton, cuDNN fusion)."""
  names = called(inst)
  if not names or names[0] not in comps:
    return None
  body = comps[names[0]]
  hit = _find(comps, body, ("dot", "scaled-dot"))
  if hit is None:
    return None
  where, dot = hit
  params = [top.insts[o].arrays[0] if top.insts[o].arrays else Array("?", ())
            for o in inst.operands]
  kind = fusion_kind(inst)
  kernel = "Triton" if "triton" in kind else f"fusion {kind}"
  if "cudnn" in kind:
    kernel = "cuDNN fusion"
  lhs, rhs = (where.insts[o].arrays[0] for o in dot.operands[:2])
  dims = dot_dims(lhs, rhs, _dims_attr(dot, "lhs_contracting_dims"),
                  _dims_attr(dot, "rhs_contracting_dims"),
                  _dims_attr(dot, "lhs_batch_dims"),
                  _dims_attr(dot, "rhs_batch_dims"))
  if where is body:
    a = _operand_view(comps, body, dot.operands[0], params)
    b = _operand_view(comps, body, dot.operands[1], params)
    epi = _forward_ops(body, dot.name)
  else:
    a, b = lhs.dtype, rhs.dtype
    epi = ()
  epi_mul = [n for n in _epilogue_names(body, dot.name) if
             body.insts[n].opcode in ("multiply", "divide")] \
      if where is body else []
  pro_mul = _prologue_multiplies(comps, body, dot) if where is body else False
  if dot.opcode == "scaled-dot":
    scales = "block scales (operands of scaled-dot)"
    folded = True
  elif epi_mul or pro_mul:
    scales = ("multiply in the kernel epilogue" if epi_mul else
              "multiply on an operand in the kernel")
    folded = True
  else:
    scales = "none in kernel"
    folded = None
  data = tuple(o for o, p in zip(inst.operands, params) if p.size > 1)
  return Gemm(inst.name, kernel, dot.opcode, a, b, inst.arrays[0].dtype, dims,
              scales, folded, epi, data, _precision(dot),
              inst.op_name or dot.op_name)


def _epilogue_names(comp: Computation, start: str) -> list[str]:
  users = comp.users()
  out, cur = [], start
  while users.get(cur):
    cur = users[cur][0]
    out.append(cur)
  return out


def _prologue_multiplies(comps, comp: Computation, dot: Inst) -> bool:
  """True when a dot operand is multiplied by something before the dot."""
  def walk(c, name, depth=0):
    if depth > 12:
      return False
    inst = c.insts[name]
    if inst.opcode in ("multiply", "divide"):
      return True
    if inst.opcode == "fusion":
      for n in called(inst):
        if n in comps and walk(comps[n], comps[n].root.name, depth + 1):
          return True
      return False
    return any(walk(c, o, depth + 1) for o in inst.operands)
  return any(walk(comp, o) for o in dot.operands[:2])


def classify_custom_call(top: Computation, inst: Inst) -> Gemm | None:
  """A vendor GEMM custom call (cuBLAS, cuBLASLt, cuDNN)."""
  target = inst.attr("custom_call_target") or ""
  if target not in GEMM_CALLS:
    return None
  ops = [top.insts[o] for o in inst.operands]
  arrs = [o.arrays[0] if o.arrays else Array("?", ()) for o in ops]
  out = inst.arrays[0]
  lc = _json_dims(inst, "lhs_contracting_dimensions")
  rc = _json_dims(inst, "rhs_contracting_dimensions")
  lb = _json_dims(inst, "lhs_batch_dimensions")
  rb = _json_dims(inst, "rhs_batch_dimensions")
  if target in FFI_GEMMS:
    # OUT (M, N) = A (M, K) @ B (N, K)^T; packed MX payloads are narrower
    # than K, so K comes from the output and A's size only for fp8.
    dims = {"batch": 1, "m": out.dims[0], "n": out.dims[1],
            "k": arrs[0].dims[-1] if arrs[0].dims else 0}
    return Gemm(inst.name, GEMM_CALLS[target], target, arrs[0].dtype,
                arrs[2].dtype if len(arrs) > 2 else "?", out.dtype, dims,
                "scale operands of the kernel", True, (),
                (inst.operands[0], inst.operands[2]) if len(inst.operands) > 2
                else tuple(inst.operands), "", inst.op_name)
  if target == "__cudnn$blockScaledDot" or not lc:
    # (batch,) m, k x (batch,) n, k: contraction last on both.
    dims = {"batch": math.prod(out.dims[:-2]), "m": out.dims[-2],
            "n": out.dims[-1],
            "k": arrs[0].size // max(math.prod(out.dims[:-1]), 1)}
  else:
    dims = dot_dims(arrs[0], arrs[1], lc, rc, lb, rb)
  if target == "__cublas$lt$matmul$f8":
    beta = re.search(r'"beta":([0-9.eE+-]+)', inst.attrs)
    first_scale = 3 if beta and float(beta.group(1)) != 0 else 2
    descr, real = [], []
    for role, i in (("a", first_scale), ("b", first_scale + 1)):
      if i >= len(inst.operands):
        continue
      c = _const_value(top, inst.operands[i])
      src = top.insts[inst.operands[i]].shape.split("{")[0]
      descr.append(f"{role}:{'const ' + c if c is not None else src}")
      real.append(c is None)
    scales = " ".join(descr)
    folded = all(real) if real else False
  elif target == "__cudnn$blockScaledDot":
    scales = "block scales (operands)"
    folded = True
  else:
    scales = "none (wide GEMM)"
    folded = None
  return Gemm(inst.name, GEMM_CALLS[target], target, arrs[0].dtype,
              arrs[1].dtype, out.dtype, dims, scales, folded, (),
              tuple(inst.operands[:2]), _precision(inst), inst.op_name)


def kernel_computations(comps) -> list[Computation]:
  """The entry and the computations it runs as control flow (not fusion
  bodies): where kernels are launched from."""
  out, todo, seen = [], [entry(comps)], set()
  while todo:
    c = todo.pop()
    if c.name in seen:
      continue
    seen.add(c.name)
    out.append(c)
    for inst in c.insts.values():
      if inst.opcode in ("while", "conditional", "call"):
        todo += [comps[n] for n in called(inst) if n in comps]
  return out


def find_gemms(comps) -> list[tuple[Computation, Gemm]]:
  """Every GEMM kernel of the module, with the computation it runs in."""
  out = []
  for comp in kernel_computations(comps):
    for inst in comp.insts.values():
      g = None
      if inst.opcode == "custom-call":
        g = classify_custom_call(comp, inst)
      elif inst.opcode == "fusion":
        g = classify_fusion_gemm(comps, comp, inst)
      elif inst.opcode in ("dot", "scaled-dot"):
        lhs, rhs = (comp.insts[o].arrays[0] for o in inst.operands[:2])
        dims = dot_dims(lhs, rhs, _dims_attr(inst, "lhs_contracting_dims"),
                        _dims_attr(inst, "rhs_contracting_dims"),
                        _dims_attr(inst, "lhs_batch_dims"),
                        _dims_attr(inst, "rhs_batch_dims"))
        g = Gemm(inst.name, "unfused dot", inst.opcode, lhs.dtype, rhs.dtype,
                 inst.arrays[0].dtype, dims, "none", None, (),
                 tuple(inst.operands[:2]), _precision(inst), inst.op_name)
      if g is not None:
        out.append((comp, g))
  return out


# --------------------------------------------------------------------------
# Passes around a GEMM and the per-kernel cost


def is_kernel(inst: Inst) -> bool:
  """Whether a top-level instruction launches work that touches memory."""
  if inst.opcode in FREE_OPS:
    return False
  if inst.opcode == "reshape":
    return False  # top-level reshapes of the optimized module are views
  return True


# qlayers' kernels that read their tensor only on a run's first step (a
# delayed role's amax while its history is empty: `qlayers.cast_transpose`'s
# `_first_amax_kernel`): on every later step they read the history alone.
FIRST_STEP_ONLY = ("qlayers_first_amax",)


def first_step_only(inst: Inst) -> bool:
  """Whether ``inst`` is a `FIRST_STEP_ONLY` kernel: priced as a later
  step runs it (its largest operand unread, no issue roof)."""
  return inst.opcode == "custom-call" and any(
      f"/{name}/" in inst.op_name for name in FIRST_STEP_ONLY)


def kernel_bytes(comp: Computation, inst: Inst) -> float:
  """Bytes a kernel reads and writes (its operands and outputs; cuBLAS
  workspace outputs excluded; a `first_step_only` kernel's largest operand
  left out)."""
  outs = inst.arrays
  if inst.opcode == "custom-call" and len(outs) > 1 and outs[-1].dtype == "s8":
    outs = outs[:-1]
  total = sum(a.nbytes for a in outs)
  reads = []
  for op in dict.fromkeys(inst.operands):
    src = comp.insts.get(op)
    if src is not None and src.arrays:
      reads.append(sum(a.nbytes for a in src.arrays) if src.opcode != "tuple"
                   else 0)
  if first_step_only(inst) and reads:
    reads.remove(max(reads))
  return total + sum(reads)


def _through_views(comp: Computation, name: str) -> Inst:
  inst = comp.insts[name]
  while inst.opcode in ("bitcast", "get-tuple-element", "reshape") and \
      inst.operands:
    inst = comp.insts[inst.operands[0]]
  return inst


def _big_inputs(comp: Computation, inst: Inst, floor: int) -> list[Inst]:
  out = []
  for op in inst.operands:
    src = comp.insts.get(op)
    if src is not None and src.arrays and max(a.size for a in src.arrays) \
        >= floor:
      out.append(src)
  return out


def _narrow(inst: Inst) -> bool:
  return any(a.dtype in NARROW for a in inst.arrays if a.size > 1)


@dataclasses.dataclass(frozen=True)
class Pass:
  name: str
  what: str  # transpose/copy/convert/..., from the fusion name or opcode
  nbytes: float


def _what(inst: Inst) -> str:
  if inst.opcode == "fusion":
    m = re.match(r"(?:loop|input)_(\w+?)_fusion", inst.name)
    return (m.group(1) if m else inst.name.split(".")[0]) + " fusion"
  return inst.opcode


def pre_passes(comp: Computation, gemm: Gemm) -> list[Pass]:
  """Kernels between the quantize kernel and the GEMM: kernels on an
  operand's path that read a quantized (narrow) tensor, such as a transpose
  or copy of a payload, or a dequantize of it to a wide type."""
  out, seen = [], set()
  for op in gemm.operands:
    cur = _through_views(comp, op)
    floor = max(cur.arrays[0].size // 4, 2) if cur.arrays else 2
    while is_kernel(cur) and cur.name not in seen:
      big = _big_inputs(comp, cur, floor)
      narrow_in = [b for b in big if _narrow(b)]
      if not narrow_in:
        break  # cur quantizes (or computes) from wide data: not extra
      seen.add(cur.name)
      out.append(Pass(cur.name, _what(cur), kernel_bytes(comp, cur)))
      cur = _through_views(comp, narrow_in[0].name)
  return out


def post_passes(comp: Computation, gemm: Gemm) -> list[Pass]:
  """Kernels that only finish the GEMM's output: every large input they
  read is this GEMM's output (scale multiply, convert, split-K reduction,
  transpose), before the real consumer."""
  users = comp.users()
  out_size = comp.insts[gemm.name].arrays[0].size
  # A split-K partial product is reduced to 1/batch of its size.
  floor = max(out_size // max(8, 2 * gemm.dims["batch"]), 2)
  found, frontier, seen = [], [gemm.name], {gemm.name}
  while frontier:
    cur = frontier.pop()
    for u in users.get(cur, []):
      if u in seen:
        continue
      seen.add(u)
      inst = comp.insts[u]
      if inst.opcode in ("bitcast", "get-tuple-element", "reshape"):
        frontier.append(u)
        continue
      if not is_kernel(inst) or inst.opcode in ("custom-call",) and \
          inst.attr("custom_call_target") in GEMM_CALLS:
        continue
      if inst.opcode == "fusion" and "gemm" in fusion_kind(inst):
        continue
      big = [b for b in _big_inputs(comp, inst, floor)
             if _through_views(comp, b.name).name not in seen
             and b.name not in seen]
      full = max((a.size for a in inst.arrays), default=0) >= floor
      if not big and full:
        found.append(Pass(inst.name, _what(inst), kernel_bytes(comp, inst)))
        frontier.append(u)
  return found


def scaled_outside(comps, comp: Computation, gemm: Gemm) -> bool:
  """True when a kernel after the GEMM multiplies its output by a
  broadcast (a scale left out of the GEMM, scalar or per row/column)."""
  users = comp.users()
  frontier, seen = [gemm.name], set()
  while frontier:
    cur = frontier.pop()
    for u in users.get(cur, []):
      if u in seen:
        continue
      seen.add(u)
      inst = comp.insts[u]
      if inst.opcode in ("bitcast", "get-tuple-element", "reshape"):
        frontier.append(u)
      elif inst.opcode == "fusion" and called(inst) and \
          called(inst)[0] in comps and "gemm" not in fusion_kind(inst):
        body = comps[called(inst)[0]]
        for i, op in enumerate(inst.operands):
          if op == cur and i < len(body.params) and \
              _multiplied(body, body.params[i]):
            return True
  return False


def _multiplied(body: Computation, start: str) -> bool:
  """Whether ``start`` reaches a multiply/divide by a broadcast value
  through layout and type changes only. A broadcast constant is not a scale
  (scales come from amaxes at run time): it is the consumer's, such as the
  attention's 1/sqrt(d) or an optimizer's moment decay."""
  users = body.users()
  todo, seen = [start], set()
  while todo:
    cur = todo.pop()
    for u in users.get(cur, []):
      if u in seen:
        continue
      seen.add(u)
      inst = body.insts[u]
      if inst.opcode in ("multiply", "divide"):
        others = [body.insts[o] for o in inst.operands if o != cur]
        if any(_expanded_scale(body, o) for o in others):
          return True
      elif inst.opcode in ("bitcast", "reshape", "transpose", "copy",
                           "convert", "reduce", "slice"):
        todo.append(u)
  return False


def _constant(body: Computation, inst: Inst) -> bool:
  """Whether a broadcast's operand is a constant."""
  src = body.insts.get(inst.operands[0]) if inst.operands else None
  return src is not None and src.opcode == "constant"


def _expanded_scale(body: Computation, inst: Inst, depth: int = 0) -> bool:
  """Whether ``inst`` is a run-time value broadcast over the GEMM's output:
  a broadcast of a non-constant, or a convert / product of broadcasts with
  at least one such (row-wise scales: ``bf16(sa[:, None] * sb[None, :])``)."""
  if depth > 4:
    return False
  if inst.opcode == "broadcast":
    return not _constant(body, inst)
  if inst.opcode in ("convert", "bitcast", "reshape", "multiply"):
    ops = [body.insts[o] for o in inst.operands if o in body.insts]
    scales = [_expanded_scale(body, o, depth + 1) for o in ops]
    return bool(ops) and any(scales) and all(
        s or o.opcode == "broadcast" for s, o in zip(scales, ops))
  return False


def gemm_peak(g: Gemm, target: Target) -> tuple[float, str]:
  """TFLOP/s the model assumes for a GEMM: by the type the MMA consumes (the
  FP4 peak only when both operands are E2M1: E2M1 beside FP6/FP8 runs at
  the FP8 rate)."""
  mma = {g.a.split("->")[-1], g.b.split("->")[-1]}
  if g.op == "scaled-dot" and target.fp4 is None:
    return target.bf16, "bf16 (block-scaled dot emulated on this arch)"
  if mma == {"f4e2m1fn"} and target.fp4:
    return target.fp4, "fp4"
  if mma & {"f8e4m3fn", "f8e5m2", "f6e2m3fn", "f6e3m2fn", "f4e2m1fn"} and \
      not mma & {"bf16", "f16", "f32"}:
    return target.fp8, "fp8"
  if "f32" in mma:
    if "highest" in g.precision.lower() or "F32_F32_F32" in g.precision:
      return target.fp32, "fp32"
    return target.tf32, "tf32"
  return target.bf16, "bf16"


def attention_flops(comp: Computation, inst: Inst) -> float:
  """FLOPs of a cuDNN fused attention call (``__cudnn$fmha*``), else 0.

  From its score shape ``(b, h, s_q, s_kv)`` (``intermediate_tensor_shape``)
  and head size (the query's last dim): forward two GEMMs (``4 b h s_q s_kv
  d``), backward five (``10 ...``: the scores recomputed, dV, dP, dQ, dK);
  a causal mask halves them (the kernel skips masked tiles).
  """
  target = inst.attr("custom_call_target") or ""
  if inst.opcode != "custom-call" or not target.startswith("__cudnn$fmha"):
    return 0.0
  m = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*'
                r'\[([^\]]*)\]', inst.attrs)
  q = comp.insts.get(inst.operands[0]) if inst.operands else None
  if not m or q is None or not q.arrays:
    return 0.0
  scores = math.prod(int(x.strip().strip('"')) for x in m.group(1).split(",")
                     if x.strip())
  gemms = 10 if "Backward" in target else 4
  causal = 0.5 if re.search(r'"mask_type":\s*"CAUSAL', inst.attrs) else 1.0
  return gemms * scores * q.arrays[0].dims[-1] * causal


def kernel_group(inst: Inst, gemm: bool, attention: bool) -> str:
  """What a kernel is, for a step's breakdown (`roofline`'s ``groups``):
  "GEMM", "attention", the qlayers kernel or primitive whose scope its
  op_name names (``qlayers_cast_transpose``, ...), else its XLA kind: the
  instruction's name without its number (``input_reduce_fusion``)."""
  if gemm:
    return "GEMM"
  if attention:
    return "attention"
  m = re.search(r"\bqlayers_\w+", inst.op_name)
  return m.group(0) if m else re.sub(r"[._]\d+$", "", inst.name)


def roofline(comps, target: Target,
             code: dict[str, KernelCode] | None = None) -> dict:
  """Model step time: every kernel at max(flops/peak, bytes/bandwidth);
  cuDNN fused attention at the BF16 peak (`attention_flops`). With the
  kernels' ``code`` (`kernel_code`), a kernel that is neither a GEMM nor
  attention also takes at least the time to issue its instructions
  (`issue_s`, from its SASS where counted): the issue roof. ``ptx`` then
  holds the step time and issue time the PTX counts alone would give.
  ``groups``: the step by `kernel_group`, ``{group: [kernels, model us,
  bytes, issue us]}``, slowest first."""
  gemms = {g.name: g for _, g in find_gemms(comps)}
  total_s, gemm_s, flops, nbytes, kernels = 0.0, 0.0, 0.0, 0.0, 0
  att_s = att_flops = 0.0
  issue_extra_s, issue_bound = 0.0, []
  ptx_extra_s, sass_kernels, coded = 0.0, 0, 0
  groups: dict[str, list[float]] = {}
  for comp in kernel_computations(comps):
    for inst in comp.insts.values():
      if not is_kernel(inst) or inst.opcode in ("while", "conditional",
                                                "call"):
        continue
      kernels += 1
      b = kernel_bytes(comp, inst)
      t = b / (target.tbps * 1e12)
      g = gemms.get(inst.name)
      af = 0.0 if g is not None else attention_flops(comp, inst)
      extra = 0.0
      if g is not None:
        peak, _ = gemm_peak(g, target)
        t = max(t, g.flops / (peak * 1e12))
        flops += g.flops
        gemm_s += t
      elif af:
        t = max(t, af / (target.bf16 * 1e12))
        att_flops += af
        att_s += t
      elif code is not None and inst.name in code and not first_step_only(
          inst):
        coded += 1
        sass_kernels += code[inst.name].sass is not None
        ptx_extra_s += max(0.0, issue_s(code[inst.name], target, "ptx") - t)
        ti = issue_s(code[inst.name], target)
        if ti > t:
          extra = ti - t
          issue_extra_s += extra
          issue_bound.append((inst.name, code[inst.name].kernel,
                              extra * 1e6))
          t = ti
      nbytes += b
      total_s += t
      row = groups.setdefault(kernel_group(inst, g is not None, bool(af)),
                              [0, 0.0, 0.0, 0.0])
      row[0] += 1
      row[1] += t * 1e6
      row[2] += b
      row[3] += extra * 1e6
  out = {"kernels": kernels, "gemm_flops": flops, "bytes": nbytes,
         "time_us": total_s * 1e6, "gemm_time_us": gemm_s * 1e6,
         "attention_flops": att_flops, "attention_time_us": att_s * 1e6,
         "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1][1]))}
  if code is not None:
    issue_bound.sort(key=lambda x: -x[2])
    out.update(issue=True, issue_extra_us=issue_extra_s * 1e6,
               issue_bound=[{"hlo": h, "kernel": k, "extra_us": round(e, 2)}
                            for h, k, e in issue_bound],
               issue_counted={"kernels": coded, "sass": sass_kernels},
               ptx={"time_us": (total_s - issue_extra_s + ptx_extra_s) * 1e6,
                    "issue_extra_us": ptx_extra_s * 1e6})
  return out


# --------------------------------------------------------------------------
# The issue roof: a kernel's own instructions, from its PTX and launch grid

# Thread instructions a streaming multiprocessor issues per clock: four
# schedulers, one warp instruction (32 threads) each. 32-bit integer
# arithmetic runs at half that, 64 per clock (the CUDA C++ Programming
# Guide's throughput table for compute capability 9.0; taken for sm_100
# too). Counted in PTX, before ptxas merges (three-input adds and logic),
# so an estimate of the SASS.
ISSUE_PER_CLOCK = 128
INTEGER_PER_CLOCK = 64
_INTEGER_OPS = {"add", "sub", "mul", "mad", "shl", "shr", "shf", "and", "or",
                "xor", "not", "lop3", "prmt", "bfe", "bfi", "min", "max",
                "neg", "abs", "popc", "clz", "brev", "bfind", "mul24",
                "mad24", "sad"}
_INTEGER_TYPES = {"u16", "s16", "b16", "u32", "s32", "b32", "u64", "s64",
                  "b64"}


@dataclasses.dataclass(frozen=True)
class KernelCode:
  """One launch of a compiled kernel: its name (the PTX entry), threads in
  all, and PTX instructions per thread (each written once: a loop counts
  its body once, a branch both ways); ``sass``: its SASS instructions per
  thread by pipeline (`SassCounts` as a tuple), None where not counted."""

  kernel: str
  threads: int
  instructions: int
  integer: int
  loops: bool
  sass: tuple[int, ...] | None = None


def parse_ptx(text: str) -> dict[str, tuple[int, int, bool]]:
  """``{entry: (instructions, integer instructions, has a loop)}`` of a PTX
  module."""
  out = {}
  for m in re.finditer(r"\.entry\s+(\w+)\s*\(", text):
    start = text.index("{", m.end())
    depth, i = 0, start
    while True:  # the entry's body: to its matching brace
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      if depth == 0:
        break
      i += 1
    total = integer = 0
    labels, loops = set(), False
    for line in text[start + 1:i].splitlines():
      # One statement per ';': Triton's inline assembly puts several on a
      # line, inside braces that scope its registers.
      for stmt in line.split("//", 1)[0].split(";"):
        stmt = stmt.strip().strip("{}").strip()
        if not stmt or stmt.startswith("."):
          continue
        if stmt.endswith(":"):
          labels.add(stmt[:-1])
          continue
        if stmt.startswith("@"):
          stmt = stmt.split(None, 1)[1]
        op, *parts = stmt.split(None, 1)[0].split(".")
        if op == "bra":
          loops |= stmt.split()[-1] in labels  # a branch back
        total += 1
        integer += op in _INTEGER_OPS and bool(_INTEGER_TYPES & set(parts))
    out[m.group(1)] = (total, integer, loops)
  return out


_THUNK = re.compile(r"^(\d+):\s+\S+.*\]\s+(\S+)\s+grid:\s+\[([\d, ]+)\]"
                    r"\s+threads:\s+\[([\d, ]+)\]")


def kernel_code(dump: str | os.PathLike, count_sass: bool = True
                ) -> dict[str, KernelCode]:
  """``{HLO instruction: KernelCode}`` of the kernels an XLA:GPU dump
  (``xla_dump_to``) launches: the thunk sequence names each launch's
  kernel and grid, the thunk metadata its HLO instruction, the PTX its
  code (and, with ``count_sass``, `sass_counts` its SASS)."""
  dump = pathlib.Path(dump)
  ptx = {}
  for f in sorted(dump.glob("*.ptx")):
    ptx.update(parse_ptx(f.read_text()))
  sass = sass_counts(dump.glob("*.ptx")) if count_sass else {}
  out = {}
  for seq in sorted(dump.glob("*.thunk_sequence.txt")):
    meta = seq.with_name(seq.name.replace("thunk_sequence", "thunk_metadata"))
    if not meta.is_file():
      continue
    names = dict(
        (int(i), n) for n, i in re.findall(
            r'profile_annotation:\s+"([^"]+)"\s+thunk_id:\s+(\d+)',
            meta.read_text()))
    for line in seq.read_text().splitlines():
      m = _THUNK.match(line.strip())
      if not m or int(m.group(1)) not in names or m.group(2) not in ptx:
        continue
      grid, block = (math.prod(int(v) for v in g.split(","))
                     for g in m.group(3, 4))
      total, integer, loops = ptx[m.group(2)]
      counted = sass.get(m.group(2))
      out[names[int(m.group(1))]] = KernelCode(
          m.group(2), grid * block, total, integer, loops,
          counted and dataclasses.astuple(counted))
  return out


def issue_s(code: KernelCode, target: Target, counts: str = "sass") -> float:
  """Seconds to issue a kernel's instructions on all of ``target``'s SMs.
  From its SASS (``counts="sass"``, where counted): the busiest of the
  issue slots and the pipelines (`SassCounts.clocks`). From its PTX
  (``"ptx"``, or no SASS): every instruction at `ISSUE_PER_CLOCK`, its
  integer ones at `INTEGER_PER_CLOCK`, whichever takes longer."""
  if counts == "sass" and code.sass is not None:
    clocks = SassCounts(*code.sass).clocks()
  else:
    clocks = max(code.instructions / ISSUE_PER_CLOCK,
                 code.integer / INTEGER_PER_CLOCK)
  return code.threads * clocks / (target.sms * target.ghz * 1e9)


# --------------------------------------------------------------------------
# The issue roof in SASS: what ptxas makes of each kernel, by pipeline

# Each SM's pipelines, instructions (threads) per clock: the CUDA C++
# Programming Guide's arithmetic throughput table for compute capability
# 9.0 (taken for sm_100 too): FP32 add/multiply/FMA 128; 32-bit integer
# add, logic, shift, compare, min/max and multiply-add 64; conversions 16.
# Nsight Compute's Kernel Profiling Guide ("Pipelines") says which pipeline
# runs what: fma the FP32 arithmetic and, in its heavy half alone, the
# integer multiply-adds (IMAD, which ptxas also uses for adds and moves);
# xu the conversions between integers and floats and the transcendentals;
# alu the other integer, logic, comparison, min/max and data-movement
# instructions. An opcode none of these sets names, and that is no memory,
# control or uniform-datapath instruction, is charged to alu, the pipeline
# the cast kernels load most: an unknown opcode is not taken as free.
ALU_PER_CLOCK = 64
FMA_PER_CLOCK = 128
FMA_HEAVY_PER_CLOCK = 64
XU_PER_CLOCK = 16
_SASS_FMA = {"FFMA", "FADD", "FMUL", "FFMA2", "FADD2", "FMUL2", "FSWZADD",
             "HFMA2", "HADD2", "HMUL2"}
_SASS_FMA_HEAVY = {"IMAD", "IMUL", "IDP", "IMADSP"}
_SASS_XU = {"MUFU", "F2I", "I2F", "F2F", "FRND", "I2FP", "F2IP"}
# Issued, but on none of the pipelines above: memory, synchronization,
# control flow, special registers, tensor cores; uniform-datapath opcodes
# (U...) besides.
_SASS_ELSEWHERE = {
    "LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LDC", "LDCU", "LDL", "STL",
    "LD", "ST", "ATOM", "ATOMG", "ATOMS", "RED", "REDG", "REDUX", "LDGSTS",
    "LDGDEPBAR", "DEPBAR", "BAR", "BRA", "BRX", "JMP", "BSSY", "BSYNC",
    "BREAK", "BMOV", "EXIT", "RET", "CALL", "WARPSYNC", "YIELD", "KILL",
    "NANOSLEEP", "S2R", "CS2R", "S2UR", "R2UR", "ACQBULK", "SYNCS", "MEMBAR",
    "FENCE", "ERRBAR", "CCTL", "CCTLL", "VOTE", "SHFL", "MATCH", "ELECT",
    "PREEXIT", "ENDCOLLECTIVE", "HMMA", "IMMA", "QMMA", "OMMA", "HGMMA",
    "QGMMA", "IGMMA", "UTCHMMA", "UTCQMMA", "UTCOMMA", "UTCBAR", "TMA",
    "UBLKCP", "UTMALDG", "UTMASTG", "UTMACMDFLUSH", "UTMACCTL", "UTMAPF",
    "LDTM", "STTM", "TEX", "TLD", "SUST", "SULD", "ACQSHMINIT", "FENCE"}


@dataclasses.dataclass(frozen=True)
class SassCounts:
  """A kernel's SASS instructions per thread (each written once, as
  `parse_ptx` counts PTX; NOPs left out): in all, and those of the alu,
  fma (its heavy half among them) and xu pipelines (`ALU_PER_CLOCK`...)."""

  total: int
  alu: int
  fma: int
  fma_heavy: int
  xu: int

  def clocks(self) -> float:
    """SM clocks per thread: the busiest of the issue slots
    (`ISSUE_PER_CLOCK`) and the pipelines."""
    return max(self.total / ISSUE_PER_CLOCK, self.alu / ALU_PER_CLOCK,
               self.fma / FMA_PER_CLOCK,
               self.fma_heavy / FMA_HEAVY_PER_CLOCK, self.xu / XU_PER_CLOCK)


def sass_pipe(opcode: str) -> str | None:
  """The pipeline (``alu``, ``fma``, ``fma_heavy``, ``xu``) that runs a
  SASS ``opcode`` (its name before the first dot), None for one issued to
  none of them (module comment above)."""
  if opcode in _SASS_FMA_HEAVY:
    return "fma_heavy"
  if opcode in _SASS_FMA:
    return "fma"
  if opcode in _SASS_XU:
    return "xu"
  if opcode in _SASS_ELSEWHERE or opcode.startswith("U"):
    return None
  return "alu"


_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?"
                        r"([A-Z][A-Z0-9_]*)")
_SASS_FUNCTION = re.compile(r"^\.text\.(\S+):\s*$")


def parse_sass(text: str) -> dict[str, SassCounts]:
  """``{function: SassCounts}`` of ``nvdisasm -c`` output."""
  out, name, counts = {}, None, Counter()

  def close():
    if name is not None:
      out[name] = SassCounts(
          counts["total"], counts["alu"], counts["fma"] + counts["fma_heavy"],
          counts["fma_heavy"], counts["xu"])

  for line in text.splitlines():
    m = _SASS_FUNCTION.match(line.strip())
    if m:
      close()
      name, counts = m.group(1), Counter()
      continue
    m = _SASS_LINE.match(line)
    if m is None or name is None or m.group(1) == "NOP":
      continue
    counts["total"] += 1
    pipe = sass_pipe(m.group(1))
    if pipe:
      counts[pipe] += 1
  close()
  return out


def cuda_tool(name: str) -> str | None:
  """The CUDA tool ``name`` (``ptxas``, ``nvdisasm``) of the NVIDIA wheels
  in this Python's environment (jax[cuda13]'s ptxas, the one XLA compiles
  with; `scripts/setup-gpu-compile` installs nvdisasm beside it), else the
  one on PATH; None if neither."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.find_spec("nvidia")
  for root in (spec.submodule_search_locations or []) if spec else []:
    for tool in sorted(pathlib.Path(root).glob(f"*/bin/{name}")):
      if os.access(tool, os.X_OK):
        return str(tool)
  return shutil.which(name)


def sass_counts(ptx_files: Iterable[pathlib.Path]) -> dict[str, SassCounts]:
  """``{kernel: SassCounts}`` of PTX modules, each compiled by ptxas for
  the target its ``.target`` line names (at ptxas' default -O3, as XLA
  compiles them) and disassembled by nvdisasm; empty without those tools.
  A module ptxas rejects is left out (its kernels keep their PTX
  counts)."""
  ptxas, nvdisasm = cuda_tool("ptxas"), cuda_tool("nvdisasm")
  if not ptxas or not nvdisasm:
    return {}
  from concurrent.futures import ThreadPoolExecutor  # pylint: disable=g-import-not-at-top

  def one(path: pathlib.Path) -> dict[str, SassCounts]:
    m = re.search(r"^\s*\.target\s+(sm_\w+)", path.read_text(), re.M)
    if m is None:
      return {}
    with tempfile.TemporaryDirectory(prefix="sass_") as d:
      cubin = os.path.join(d, "k.cubin")
      try:
        subprocess.run([ptxas, f"-arch={m.group(1)}", str(path), "-o", cubin],
                       check=True, capture_output=True, timeout=600)
        text = subprocess.run([nvdisasm, "-c", cubin], check=True,
                              capture_output=True, text=True,
                              timeout=600).stdout
      except (subprocess.SubprocessError, OSError):
        return {}
    return parse_sass(text)

  out = {}
  with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
    for counts in pool.map(one, sorted(ptx_files)):
      out.update(counts)
  return out


# What XLA:GPU's own cost model charges each kernel for its launch, whatever
# it does (kKernelLaunchOverhead, 1 us, in
# xla/service/gpu/model/gpu_performance_model_base.h; NCCL kernels 5 us).
# The roofline above charges none, so a program of many small kernels looks
# as fast as one without them; the launch-charged figures add this per
# kernel.
LAUNCH_US = 1.0


def launched_us(time_us: float, kernels: int) -> float:
  """A model time with `LAUNCH_US` charged for each of ``kernels``."""
  return time_us + kernels * LAUNCH_US


# --------------------------------------------------------------------------
# The ideal: the BF16 program with each quantized GEMM at its format's peak

FORMAT_BITS = {"e4m3": 8, "e5m2": 8, "e3m2": 6, "e2m3": 6, "e2m1": 4}


def format_peak(fmts, target: Target) -> tuple[float, str]:
  """TFLOP/s of the MMA that reads operands of element formats ``fmts``
  (a GEMM's two formats; None: wide). FP6/FP4 run on FP8 tensor cores
  where the target has no FP4 ones (every E3M2/E2M3/E2M1 value is an E4M3
  value)."""
  if not fmts or any(f not in FORMAT_BITS for f in fmts):
    return target.bf16, "bf16"
  bits = max(FORMAT_BITS[f] for f in fmts)
  if bits <= 4 and target.fp4:
    return target.fp4, "fp4"
  return target.fp8, "fp8"


def gemm_kind(role: str) -> str | None:
  """``Fprop``/``Dgrad``/``Wgrad`` of an attributed role (the first of
  ambiguous candidates); None for ``other``/``attention``."""
  kinds = [r.rsplit(" ", 1)[-1] for r in role.split(" | ")]
  return kinds[0] if kinds[0] in _ROLE_ORDER else None


def ideal_time_us(base: dict, formats: dict, target: Target) -> float | None:
  """Model time of the ideal program of a recipe: the BF16 record ``base``
  with each layer GEMM (Fprop/Dgrad/Wgrad) at the peak of the recipe's
  formats for that GEMM (``formats``: kind -> [lhs, rhs] format names) and
  its operands read at their width; nothing else changes (no quantize,
  transpose or scale pass). None when ``base`` lacks per-GEMM times."""
  gemms = base.get("gemms") or []
  if base.get("status") != "ok" or any("time_us" not in g for g in gemms):
    return None
  t = base["roofline"]["time_us"]
  for g in gemms:
    kind = gemm_kind(g["role"])
    fmts = formats.get(kind) if kind else None
    if not fmts or any(f not in FORMAT_BITS for f in fmts):
      continue  # not quantized: as in the BF16 program
    peak, _ = format_peak(fmts, target)
    d = g["dims"]
    operands = d["batch"] * d["k"] * (d["m"] + d["n"])
    bits = max(FORMAT_BITS[f] for f in fmts)
    nbytes = operands * bits / 8 + d["batch"] * d["m"] * d["n"] * \
        DTYPE_BYTES.get(g["out"], 4)
    flops = 2.0 * d["batch"] * d["m"] * d["n"] * d["k"]
    new = max(flops / (peak * 1e12), nbytes / (target.tbps * 1e12)) * 1e6
    t += new - g["time_us"]
  return t


def against_ideal(rec: dict, base: dict | None) -> dict | None:
  """``{"speedup", "ideal_speedup", "of_ideal"}`` of a record against its
  BF16 ``base`` (same target, flag and program); None if unknown. With
  both kernel counts, also ``"launched"``: the same three with `LAUNCH_US`
  charged per kernel (the ideal program launches BF16's kernels)."""
  if base is None or rec.get("status") != "ok" or \
      base.get("status") != "ok" or "formats" not in rec:
    return None
  ideal = ideal_time_us(base, rec.get("formats") or {},
                        TARGETS[rec["target"]])
  if ideal is None:
    return None
  t, b = rec["roofline"]["time_us"], base["roofline"]["time_us"]
  out = {"speedup": b / t, "ideal_speedup": b / ideal, "of_ideal": ideal / t}
  if "kernels" in rec["roofline"] and "kernels" in base["roofline"]:
    tl = launched_us(t, rec["roofline"]["kernels"])
    bl = launched_us(b, base["roofline"]["kernels"])
    il = launched_us(ideal, base["roofline"]["kernels"])
    out["launched"] = {"speedup": bl / tl, "ideal_speedup": bl / il,
                       "of_ideal": il / tl}
  return out


# --------------------------------------------------------------------------
# Attribution of GEMMs to layers and roles


@dataclasses.dataclass(frozen=True)
class LayerDims:
  name: str
  tokens: int
  k: int  # in features
  n: int  # out features
  weight_param: str = ""  # entry parameter holding the kernel (layer bench)
  shares_input: str = ""  # layers with the same tag read the same input


def attribute(g: Gemm, layers: list[LayerDims], *, backward: bool | None,
              uses_weight: set[str] | None = None) -> str:
  """``"<layer> <Fprop|Dgrad|Wgrad>"`` candidates for a GEMM, by shapes.

  ``backward``: the GEMM depends on the loss cotangent (None: unknown).
  ``uses_weight``: the entry parameters in its operands' cone, which tells
  Dgrad (reads the weight) from Wgrad when shapes tie. A GEMM whose N is
  the sum of the N of several layers with one input (XLA merges dots that
  share an operand: q/k/v, gate/up) is named ``"q+k+v Fprop"``. A batched
  GEMM is taken for a split-K Wgrad only when it is a Triton fusion.
  """
  if "attention" in g.op_name:
    return "attention"
  d = g.dims
  free = sorted((d["m"], d["n"]))
  split_k = d["batch"] > 1 and g.kernel == "Triton"
  if d["batch"] > 1 and not split_k:
    return "other"
  k = d["k"] * d["batch"]  # split-K: the batch splits the contraction
  hits = []
  for group in _layer_groups(layers):
    ly = group[0]
    n = sum(x.n for x in group)
    names = "+".join(x.name for x in group)
    cands = []
    if free == sorted((ly.tokens, n)) and k == ly.k:
      cands.append("Fprop")
    if len(group) == 1 and free == sorted((ly.tokens, ly.k)) and k == ly.n:
      cands.append("Dgrad")
    if free == sorted((ly.k, n)) and ly.tokens == k:
      cands.append("Wgrad")
    if backward is True:
      cands = [c for c in cands if c != "Fprop"] or cands
    elif backward is False:
      cands = [c for c in cands if c == "Fprop"] or cands
    if len(cands) > 1 and uses_weight is not None and ly.weight_param:
      reads_w = any(ly.weight_param in p for p in uses_weight)
      cands = [c for c in cands if (c == "Dgrad") == reads_w] or cands
    hits += [f"{names} {c}" for c in cands]
  if not hits:
    return "other"
  return " | ".join(_merge_names(hits))


def _layer_groups(layers: list[LayerDims]) -> list[list[LayerDims]]:
  """Each layer alone, then every run of 2+ consecutive layers that read
  the same input (the candidates for a merged GEMM)."""
  out = [[ly] for ly in layers]
  for i in range(len(layers)):
    for j in range(i + 2, len(layers) + 1):
      run = layers[i:j]
      tags = {x.shares_input for x in run}
      if len(tags) == 1 and "" not in tags:
        out.append(run)
  return out


def _merge_names(hits: list[str]) -> list[str]:
  """``["q Fprop", "k Fprop"]`` -> ``["q/k Fprop"]``."""
  by_role: dict[str, list[str]] = {}
  for h in hits:
    name, role = h.rsplit(" ", 1)
    by_role.setdefault(role, []).append(name)
  return [f"{'/'.join(names)} {role}" for role, names in by_role.items()]


def entry_param_cone(comps, comp: Computation, name: str) -> set[str]:
  """Entry parameter instruction names in the cone of ``name``.

  Through a fusion, only the fusion operands its result depends on count;
  through a ``get-tuple-element`` of a multi-output fusion, only those of
  that output (XLA fuses unrelated work into one kernel, such as a loss
  reduction with a gradient's quantize).
  """
  out: set[str] = set()
  stack, seen = [(name, None)], set()
  while stack:
    n, index = stack.pop()
    if (n, index) in seen or n not in comp.insts:
      continue
    seen.add((n, index))
    inst = comp.insts[n]
    if inst.opcode == "parameter":
      out.add(n)
      continue
    if inst.opcode == "get-tuple-element" and inst.operands:
      stack.append((inst.operands[0], int(inst.attr("index") or 0)))
      continue
    body = comps.get(called(inst)[0]) if inst.opcode == "fusion" and \
        called(inst) else None
    if body is not None:
      root = body.root
      start = root.name
      if index is not None and root.opcode == "tuple" and \
          index < len(root.operands):
        start = root.operands[index]
      used = _cone_params(comps, body, start)
      stack += [(inst.operands[i], None) for i in sorted(used)
                if i < len(inst.operands)]
      continue
    stack += [(op, None) for op in inst.operands]
  return out


def _entry_cone(comps, top: Computation, comp: Computation,
                operands) -> set[str] | None:
  """Entry parameters in the cone of ``operands`` of an instruction in
  ``comp``: the entry itself, or a computation the entry calls (``call``:
  jax keeps ``jax.nn.scaled_matmul`` as one); None when neither."""
  if comp is top:
    return set().union(*(entry_param_cone(comps, top, op) for op in operands))
  site = next((i for i in top.insts.values()
               if i.opcode == "call" and called(i) == [comp.name]), None)
  if site is None:
    return None
  inner = set().union(*(entry_param_cone(comps, comp, op) for op in operands))
  outer = [site.operands[i] for i, name in enumerate(comp.params)
           if name in inner and i < len(site.operands)]
  return set().union(*(entry_param_cone(comps, top, op) for op in outer))


def param_by_op_name(comp: Computation, needle: str) -> str:
  """The entry parameter whose op_name (pytree path) contains ``needle``."""
  for inst in comp.insts.values():
    if inst.opcode == "parameter" and needle in inst.op_name:
      return inst.name
  return ""


def describe(comps, layers: list[LayerDims], quantized: bool,
             cotangent_params: tuple[str, ...] = (),
             target: Target | None = None) -> list[dict]:
  """One record per GEMM: attribution, kernel, dtypes, scales, passes, its
  bytes and (with ``target``) its model time."""
  top = entry(comps)
  ct = [param_by_op_name(top, c) for c in cotangent_params]
  ct = [c for c in ct if c]
  out = []
  for comp, g in find_gemms(comps):
    cone = _entry_cone(comps, top, comp, comp.insts[g.name].operands)
    known = cone is not None
    backward = bool(cone & set(ct)) if ct and known else None
    role = attribute(g, layers, backward=backward,
                     uses_weight=cone if known else None)
    wide_mma = not ({g.a.split("->")[-1], g.b.split("->")[-1]} -
                    set(WIDE_FLOAT))
    kernel = g.kernel
    if quantized and wide_mma and role not in ("other", "attention"):
      kernel += " (emulated: wide operands)"
    pre, post = pre_passes(comp, g), post_passes(comp, g)
    folded = g.folded
    if quantized and role not in ("other", "attention") and folded is not True:
      # Folded: no kernel after the GEMM applies a scale to its output. A
      # kernel that applies its scales itself (a Triton epilogue, scale
      # operands of cuDNN or of our FFI kernels) is taken at its word: a
      # later multiply by a broadcast there is the consumer's (the
      # attention's 1/sqrt(d), the optimizer's moments).
      folded = not scaled_outside(comps, comp, g)
    out.append({
        "gemm": g.name, "role": role, "kernel": kernel, "op": g.op,
        "a": g.a, "b": g.b, "out": g.out, "dims": g.dims,
        "precision": g.precision, "scales": g.scales, "folded": folded,
        "epilogue": list(g.epilogue),
        "pre": [dataclasses.asdict(p) for p in pre],
        "post": [dataclasses.asdict(p) for p in post],
        "op_name": g.op_name,
        "bytes": kernel_bytes(comp, comp.insts[g.name]),
    })
    if target is not None:
      peak, _ = gemm_peak(g, target)
      out[-1]["time_us"] = 1e6 * max(out[-1]["bytes"] / (target.tbps * 1e12),
                                     g.flops / (peak * 1e12))
    out[-1]["issues"] = issues(out[-1]) if quantized else []
  return out


def issues(rec: dict, compute_dtype: str = "bf16") -> list[str]:
  """What keeps one quantized GEMM record from the ideal: a native
  low-precision kernel with both scales inside it, writing the layer's
  dtype (Fprop/Dgrad: ``compute_dtype``, Wgrad: FP32), and no extra pass."""
  role = rec["role"]
  if role in ("other", "attention"):
    return []
  out = []
  if "emulated" in rec["kernel"]:
    out.append("emulated")
  if rec["folded"] is False:
    out.append("scale after GEMM")
  roles = {r.rsplit(" ", 1)[-1] for r in role.split(" | ")}
  if roles <= {"Fprop", "Dgrad"} and rec["out"] != compute_dtype:
    out.append(f"writes {rec['out']}")
  for key, where in (("pre", "in"), ("post", "out")):
    if rec[key]:
      mib = sum(p["nbytes"] for p in rec[key]) / 2**20
      out.append(f"{len(rec[key])} pass{'es' if len(rec[key]) > 1 else ''}"
                 f" {where} ({mib:.0f} MiB)")
  return out


def summarize_kernels(records: list[dict]) -> str:
  """``"3 cuBLASLt FP8"``-style count of the GEMM kernels."""
  c = Counter(r["kernel"] for r in records)
  return ", ".join(f"{n} {k}" for k, n in sorted(c.items()))


# ==========================================================================
# Programs (need jax, flax, qlayers; imported lazily so the parsing above
# stays importable without them)


def _jax():
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  import jax  # pylint: disable=g-import-not-at-top
  return jax


@contextlib.contextmanager
def target_dispatch(arch: str | None):
  """qlayers chooses GEMMs for GPU ``arch`` inside (None: unchanged)."""
  if arch is None:
    yield
    return
  from qlayers import dispatch  # pylint: disable=g-import-not-at-top
  with dispatch.target_arch(arch):
    yield


def ffi_targets() -> dict:
  """FFI targets qlayers registered per platform in this process."""
  try:
    from qlayers import _native  # pylint: disable=g-import-not-at-top
  except ImportError:
    return {}
  return {p: list(_native.loaded(p)) for p in ("cpu", "cuda")}


def installed_cudnn() -> tuple[int, int, int] | None:
  """The version of the cuDNN wheel jax's CUDA plugin installed here (what a
  GPU running this environment would load), or None without one."""
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  for wheel in ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
    try:
      parts = metadata.version(wheel).split(".")
    except metadata.PackageNotFoundError:
      continue
    return tuple(int(p) for p in (parts + ["0", "0"])[:3])
  return None


def target_config(target: Target, targets_dir: pathlib.Path) -> str:
  """The target file's text with both of its cuDNN versions set to
  `installed_cudnn` (unchanged without one).

  The files carry two: ``gpu_device_info.dnn_version`` ("9.10.0") and
  ``dnn_version_info`` (10.10.0). XLA gates cuDNN features on them, e.g.
  passing a block-scaled dot's global scale into the cuDNN graph (cuDNN >=
  9.13); jaxlib 0.10.2 reads the second, jaxlib 0.12 the first. A real GPU
  reports the cuDNN it loads, so the program compiled here is the one that
  environment would run, whichever jaxlib reads which field."""
  text = (targets_dir / target.config).read_text()
  version = installed_cudnn()
  if version is None:
    return text
  major, minor, patch = version
  text, n = re.subn(r'dnn_version: "[0-9.]+"',
                    f'dnn_version: "{major}.{minor}.{patch}"', text)
  text, m = re.subn(r"dnn_version_info \{[^}]*\}",
                    f"dnn_version_info {{\n  major: {major}\n  minor: "
                    f"{minor}\n  patch: {patch}\n}}", text)
  if (n, m) != (1, 1):
    raise ValueError(f"{target.config}: expected one dnn_version and one "
                     f"dnn_version_info, found {n} and {m}")
  return text


def gpu_device(target: Target, targets_dir: pathlib.Path):
  jax = _jax()
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  topo = topologies.get_topology_desc(
      platform="cuda", topology_name="",
      target_config=target_config(target, targets_dir), topology="1x1x1")
  return topo.devices[0]


def layer_program(recipe: str, tokens: int, k: int, n: int):
  """(step, args, layers, cotangent param paths) for one QuantDense."""
  jax = _jax()
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import qlayers  # pylint: disable=g-import-not-at-top

  class Probe(nnx.Module):
    """The layer and its input as a Param, so Dgrad is part of the grads."""

    def __init__(self):
      self.x = nnx.Param(jnp.zeros((tokens, k), jnp.bfloat16))
      self.layer = qlayers.QuantDense(k, n, recipe=recipe,
                                      dtype=jnp.bfloat16,
                                      rngs=nnx.Rngs(0))

  graphdef, state = nnx.split(nnx.eval_shape(Probe))

  def step(state, ct):
    model = nnx.merge(graphdef, state)

    def loss(m):
      y = m.layer(m.x[...])
      return jnp.sum(y.astype(jnp.float32) * ct)

    value, grads = qlayers.value_and_grad(loss)(model)
    return value, grads

  args = (state, jax.ShapeDtypeStruct((tokens, n), jnp.float32))
  layers = [LayerDims("dense", tokens, k, n, weight_param="kernel")]
  return step, args, layers, ("ct",)


# Llama-style blocks at published model shapes (``--block-preset``): d,
# heads, KV heads (GQA), SwiGLU width, and the attention real models run.
BLOCK_PRESETS = {
    "d2048": {"batch": 4, "seq": 1024, "d": 2048, "heads": 16,
              "kv_heads": 16, "ff": 5632, "attention": "materialized"},
    "llama3-8b": {"batch": 1, "seq": 4096, "d": 4096, "heads": 32,
                  "kv_heads": 8, "ff": 14336, "attention": "cudnn"},
    "llama2-70b": {"batch": 1, "seq": 4096, "d": 8192, "heads": 64,
                   "kv_heads": 8, "ff": 28672, "attention": "cudnn"},
}


def block_program(recipe: str, batch: int, seq: int, d: int, heads: int,
                  ff: int, kv_heads: int | None = None,
                  attention: str = "materialized", abstract: bool = True):
  """(step, args, layers, cotangent param paths) for one train step of a
  Llama-style block.

  ``kv_heads``: grouped-query attention (k/v project to ``kv_heads`` heads;
  default ``heads``). ``attention``: ``materialized`` (einsum, softmax over
  the full score matrix) or ``cudnn`` (`jax.nn.dot_product_attention` with
  ``implementation="cudnn"``: cuDNN's fused flash attention on GPU).
  ``abstract=False``: the state is a real initialized model and optimizer
  (to run the step; the inputs stay shapes)."""
  jax = _jax()
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import qlayers  # pylint: disable=g-import-not-at-top
  bf16 = jnp.bfloat16
  kv_heads = kv_heads or heads
  if heads % kv_heads or attention not in ("materialized", "cudnn"):
    raise ValueError(f"block: heads {heads} must be a multiple of kv_heads "
                     f"{kv_heads}; attention {attention!r} is materialized "
                     "or cudnn")
  kv_d = d // heads * kv_heads

  class Block(nnx.Module):
    """Pre-norm attention + SwiGLU MLP, residuals, BF16 compute."""

    def __init__(self, rngs):
      lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=bf16,
                                    rngs=rngs)
      self.attn_norm = nnx.RMSNorm(d, dtype=bf16, rngs=rngs)
      self.q, self.o = lin(d, d), lin(d, d)
      self.k, self.v = lin(d, kv_d), lin(d, kv_d)
      self.mlp_norm = nnx.RMSNorm(d, dtype=bf16, rngs=rngs)
      self.gate, self.up = lin(d, ff), lin(d, ff)
      self.down = lin(ff, d)

    def __call__(self, x):
      b, s, _ = x.shape
      h = self.attn_norm(x)
      split = lambda t, n: t.reshape(b, s, n, d // heads)
      q = split(self.q(h), heads)
      k, v = split(self.k(h), kv_heads), split(self.v(h), kv_heads)
      with jax.named_scope("attention"):  # its GEMMs are not quantized
        if attention == "cudnn":
          att = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                             implementation="cudnn")
        else:
          k, v = (jnp.repeat(t, heads // kv_heads, axis=2) for t in (k, v))
          logits = jnp.einsum("bqhd,bkhd->bhqk", q, k,
                              preferred_element_type=jnp.float32)
          logits = logits / math.sqrt(d // heads)
          mask = jnp.tril(jnp.ones((s, s), bool))
          p = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
          att = jnp.einsum("bhqk,bkhd->bqhd", p.astype(bf16), v)
      x = x + self.o(att.reshape(b, s, d))
      h = self.mlp_norm(x)
      return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))

  def build():
    model = Block(nnx.Rngs(0))
    qlayers.quantize(model, None if recipe == "bf16" else recipe, rules=())
    opt = qlayers.Optimizer(model, optax.adamw(1e-4))
    return model, opt

  graphdef, state = nnx.split(nnx.eval_shape(build) if abstract else build())

  def step(state, x, target):
    model, opt = nnx.merge(graphdef, state)

    def loss(m):
      y = m(x).astype(jnp.float32)
      return jnp.mean(jnp.square(y - target))

    value, grads = qlayers.value_and_grad(loss)(model)
    opt.update(model, grads)
    return value, nnx.state((model, opt))

  args = (state, jax.ShapeDtypeStruct((batch, seq, d), bf16),
          jax.ShapeDtypeStruct((batch, seq, d), jnp.float32))
  t = batch * seq
  layers = [LayerDims(n, t, d, o, shares_input="attn_norm")
            for n, o in (("q", d), ("k", kv_d), ("v", kv_d))]
  layers += [LayerDims("o", t, d, d)]
  layers += [LayerDims(n, t, d, ff, shares_input="mlp_norm")
             for n in ("gate", "up")]
  layers += [LayerDims("down", t, ff, d)]
  return step, args, layers, ("target",)


def _on_device(args, device):
  jax = _jax()
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
      args)


def xla_cost(compiled) -> dict:
  """XLA's own cost analysis of the compiled module (flops, bytes).

  The deviceless GPU executable does not implement it; then XLA's generic
  HloCostAnalysis runs on the optimized GPU module through the host client.
  It counts fusions but not custom calls (cuBLAS/cuDNN: reported as -1).
  """
  jax = _jax()
  try:
    ca = compiled.cost_analysis()
    if ca:
      ca = ca[0] if isinstance(ca, (list, tuple)) else ca
      return {"flops": ca.get("flops"), "bytes": ca.get("bytes accessed"),
              "source": "compiled.cost_analysis()"}
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    from jax._src.lib import xla_client  # pylint: disable=g-import-not-at-top
    module = compiled.runtime_executable().hlo_modules()[0]
    host = jax.devices("cpu")[0].client
    analyse = xla_client._xla.hlo_module_cost_analysis  # pylint: disable=protected-access
    ca = analyse(host, module)
    return {"flops": ca.get("flops"), "bytes": ca.get("bytes accessed"),
            "source": "HloCostAnalysis on the optimized module"}
  except Exception as e:  # pylint: disable=broad-except
    return {"flops": None, "bytes": None, "source": f"unavailable: {e}"}


def first_line(err: BaseException | str) -> str:
  """The line of a compiler error that names the problem."""
  text = str(err)
  lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
  for pattern in (r"\b(INTERNAL|UNIMPLEMENTED|INVALID_ARGUMENT|"
                  r"FAILED_PRECONDITION|RESOURCE_EXHAUSTED|UNKNOWN): ",
                  r"(Unsupported|error:|Error)"):
    for ln in lines:
      if re.search(pattern, ln):
        return ln[:300]
  return (lines[0] if lines else type(err).__name__)[:300]


def compile_with_code(lowered, options: dict, dump_dir=None,
                      count_sass: bool = True):
  """``(executable, kernel codes, compile seconds)`` of ``lowered`` compiled
  with XLA ``options``: the compile dumps into a temporary folder (or into
  ``dump_dir``, emptied first, to keep it), whose `kernel_code` (SASS
  counted with ``count_sass``) the issue roof charges."""
  if dump_dir:
    shutil.rmtree(dump_dir, ignore_errors=True)  # no other compile's kernels
    pathlib.Path(dump_dir).mkdir(parents=True)
    folder = contextlib.nullcontext(str(dump_dir))
  else:
    folder = tempfile.TemporaryDirectory(prefix="gpu_compile_")
  with folder as name:
    t0 = time.perf_counter()
    compiled = lowered.compile(compiler_options=dict(options,
                                                     xla_dump_to=name))
    seconds = time.perf_counter() - t0
    return compiled, kernel_code(name, count_sass), seconds


def compile_one(item: dict, device, targets_dir) -> dict:
  """Compiles one (target, triton, program, recipe) and describes it."""
  jax = _jax()
  target = TARGETS[item["target"]]
  opts = {} if item["triton"] else {"xla_gpu_enable_triton_gemm": False}
  dump_dir = item.get("dump_dir") and pathlib.Path(item["dump_dir"]) / (
      hlo_path(dict(item, hlo_dir=".")).stem)
  t0 = time.perf_counter()
  rec = dict(item)
  try:
    with target_dispatch(None if item.get("host_arch") else target.arch):
      if item["program"] == "layer":
        step, args, layers, cts = layer_program(item["recipe"],
                                                **item["layer"])
      elif item["program"] == "moe":  # grouped GEMMs: moe_programs.py
        import moe_programs  # pylint: disable=g-import-not-at-top
        step, args, layers, cts = moe_programs.moe_program(item["recipe"])
      else:
        step, args, layers, cts = block_program(item["recipe"],
                                                **item["block"])  # presets too
      lowered = jax.jit(step).lower(*_on_device(args, device))
    t1 = time.perf_counter()
    compiled, code, compile_s = compile_with_code(
        lowered, opts, dump_dir, item.get("sass", True))
  except Exception as e:  # pylint: disable=broad-except
    rec.update(status="failed", error=first_line(e),
               compile_s=time.perf_counter() - t0)
    return rec
  text = compiled.as_text()
  if item.get("hlo_dir"):
    hlo_path(item).write_text(text)
  rec.update(status="ok", trace_s=t1 - t0, compile_s=compile_s,
             xla_cost=xla_cost(compiled), ffi_targets=ffi_targets(),
             formats=recipe_formats(item["recipe"]),
             kernel_code={k: dataclasses.astuple(v) for k, v in code.items()})
  rec.update(analyse(text, item, layers, cts, code))
  return rec


def recipe_formats(name: str) -> dict:
  """``{"Fprop": [lhs, rhs], ...}``: each GEMM's operand element formats
  under recipe ``name`` (None: kept wide), for the ideal column."""
  import qlayers  # pylint: disable=g-import-not-at-top
  r = qlayers.recipe(name)
  return {kind: [None if spec is None else spec.format
                 for spec in (g.lhs, g.rhs)]
          for kind, g in (("Fprop", r.fprop), ("Dgrad", r.dgrad),
                          ("Wgrad", r.wgrad))}


def hlo_path(item: dict) -> pathlib.Path:
  return pathlib.Path(item["hlo_dir"]) / (
      f"{item['target']}_{'triton' if item['triton'] else 'notriton'}_"
      f"{item['program']}_{pathlib.Path(item['recipe']).stem}.hlo")


def analyse(text: str, item: dict, layers, cts,
            code: dict[str, KernelCode] | None = None) -> dict:
  """GEMM records, kernel summary and roofline of one optimized module (with
  the kernels' ``code``, the issue roof too)."""
  comps = parse_module(text)
  quantized = item["recipe"] not in ("bf16", "fp16")
  gemms = describe(comps, layers, quantized, cts, TARGETS[item["target"]])
  return {"gemms": gemms, "kernels": summarize_kernels(
              [g for g in gemms if g["role"] not in ("other", "attention")]),
          "roofline": roofline(comps, TARGETS[item["target"]], code)}


def reparse(records: list[dict], hlo_dir: str) -> list[dict]:
  """Re-analyses the kept HLO of earlier records with this parser (nothing
  is compiled; the programs are only rebuilt for their layer shapes)."""
  out = []
  for rec in records:
    rec = dict(rec)
    if rec.get("status") == "ok":
      item = dict(rec, hlo_dir=hlo_dir)
      path = hlo_path(item)
      if path.is_file():
        if rec["program"] == "layer":
          _, _, layers, cts = layer_program(rec["recipe"], **rec["layer"])
        else:
          _, _, layers, cts = block_program(rec["recipe"], **rec["block"])
        code = rec.get("kernel_code")
        rec.update(analyse(path.read_text(), item, layers, cts, code and {
            k: KernelCode(*v) for k, v in code.items()}))
        rec.setdefault("formats", recipe_formats(rec["recipe"]))
    out.append(rec)
  return out


# ==========================================================================
# Reports


def _mb(nbytes: float) -> str:
  return f"{nbytes / 2**20:.1f}"


def _passes(ps: list[dict]) -> str:
  if not ps:
    return "-"
  return "; ".join(f"{p['what']} {_mb(p['nbytes'])} MiB" for p in ps)


def gemm_rows(rec: dict) -> list[tuple]:
  """Table rows for a record's GEMMs; identical rows merged with a count."""
  rows = Counter()
  for g in rec.get("gemms", []):
    d = g["dims"]
    shape = (f"{d['batch']}x" if d["batch"] > 1 else "") + \
        f"{d['m']}x{d['n']}x{d['k']}"
    folded = {True: "yes", False: "no", None: "-"}[g["folded"]]
    rows[(g["role"], shape, g["kernel"], f"{g['a']} x {g['b']} -> "
          f"{g['out']}", f"{folded} ({g['scales']})", _passes(g["pre"]),
          _passes(g["post"]), ", ".join(g.get("issues", [])) or "-")] += 1
  return [(*k, n) for k, n in sorted(rows.items())]


def dispatch_label(rec: dict) -> str:
  """How a record's GEMMs were chosen (older records: the stopgap flag)."""
  if "assume_gpu_dispatch" in rec:
    return ("assumed GPU dispatch" if rec["assume_gpu_dispatch"]
            else "dispatch as traced on the host")
  if rec.get("host_arch"):
    return "dispatch for the lowering platform, GPU generation unknown"
  ffi = rec.get("ffi_targets", {}).get("cuda")
  return (f"dispatch for {TARGETS[rec['target']].arch}"
          + (f", FFI: {', '.join(ffi)}" if ffi else ", no FFI library"))


def group_rows(recs: list[dict], top: int = 16) -> list[list[str]]:
  """Rows of where each recipe's step goes (`roofline`'s ``groups``): the
  ``top`` groups by their largest model time over ``recs``, a cell per
  recipe "model us (kernels)", and the rest in one row."""
  recs = [r for r in recs if r["status"] == "ok" and "groups" in
          r["roofline"]]
  names = sorted({g for r in recs for g in r["roofline"]["groups"]},
                 key=lambda g: -max(r["roofline"]["groups"].get(
                     g, [0, 0.0])[1] for r in recs))
  def cell(rows):
    n, us = sum(x[0] for x in rows), sum(x[1] for x in rows)
    return f"{us:.0f} ({n})" if n else "-"
  out = [[g] + [cell([r["roofline"]["groups"].get(g, [0, 0.0])])
                for r in recs] for g in names[:top]]
  if names[top:]:
    out.append(["the rest"] + [cell([r["roofline"]["groups"][g]
                                     for g in names[top:]
                                     if g in r["roofline"]["groups"]])
                               for r in recs])
  return out


def markdown(records: list[dict], by_group: bool = False) -> str:
  """One GEMM table and one cost table per (target, Triton flag, program);
  with ``by_group``, also where each recipe's step goes (`group_rows`)."""
  out = []
  groups: dict[tuple, list[dict]] = {}
  for r in records:
    groups.setdefault((r["target"], r["triton"], r["program"]), []).append(r)
  for (tname, triton, program), recs in groups.items():
    target = TARGETS[tname]
    flag = "Triton GEMMs on" if triton else "Triton GEMMs off"
    dispatch = dispatch_label(recs[0])
    out += [f"### {tname} ({target.arch}), {flag}, {program}, {dispatch}",
            ""]
    out += mdtable.head(["recipe", "GEMM", "b x m x n x k", "kernel",
                         "a x b -> out", "scales folded", "extra passes in",
                         "extra passes out", "issues", "count"],
                        "llrllllllr")
    for r in recs:
      if r["status"] != "ok":
        out.append(mdtable.row(r["recipe"], "failed", None, None,
                               r["error"].replace("|", "/"), None, None,
                               None, None, None))
        continue
      for row in gemm_rows(r):
        out.append(mdtable.row(r["recipe"], *row))
    out += ["", f"Model prediction (roofline at {target.source}: BF16 "
            f"{target.bf16:g}, FP8 {target.fp8:g} TFLOP/s, {target.tbps:g} "
            "TB/s; cuDNN fused attention at the BF16 peak); XLA cost from "
            "its HloCostAnalysis (-1: custom calls it cannot cost). Ideal: "
            "the BF16 program with each layer GEMM at the peak of the "
            "recipe's formats and no extra pass; of ideal = ideal time / "
            f"model time. +launches: {LAUNCH_US:g} us charged per kernel "
            "(XLA:GPU's kKernelLaunchOverhead), the ideal with BF16's "
            "kernels. issue us: what the issue roof (each kernel's SASS "
            "instructions by pipeline, or its PTX where not counted, over "
            "its threads) adds to the bytes of the kernels it binds; "
            "included in model us; (PTX: ...) where the PTX counts alone "
            "give another figure. A step after the first: a delayed role's "
            "first-step amax kernel reads its history only.", ""]
    out += mdtable.head(["recipe", "GEMM kernels", "kernels", "GEMM GFLOP",
                         "bytes MiB", "XLA GFLOP", "XLA MiB",
                         "model us", "issue us", "model GEMM us", "vs bf16",
                         "ideal vs bf16", "of ideal", "+launches vs bf16",
                         "+launches of ideal", "compile s"],
                        "llrrrrrrrrrrrrrr")
    base = next((r for r in recs if r["recipe"] == "bf16" and
                 r["status"] == "ok"), None)
    for r in recs:
      if r["status"] != "ok":
        out.append(mdtable.row(r["recipe"], "failed", *([None] * 13),
                               f"{r['compile_s']:.1f}"))
        continue
      rf, xc = r["roofline"], r["xla_cost"]
      ratio = (f"{base['roofline']['time_us'] / rf['time_us']:.2f}x"
               if base else "")
      ideal = against_ideal(r, base)
      ideal_cells = ([f"{ideal['ideal_speedup']:.2f}x",
                      f"{ideal['of_ideal']:.2f}"] if ideal else ["", ""])
      launched = (ideal or {}).get("launched")
      ideal_cells += ([f"{launched['speedup']:.2f}x",
                       f"{launched['of_ideal']:.2f}"] if launched
                      else ["", ""])
      fmt = lambda v, s: "n/a" if v is None else (
          "-1" if v < 0 else f"{v / s:.1f}")
      out.append(mdtable.row(
          r["recipe"], r["kernels"] or "-", rf["kernels"],
          f"{rf['gemm_flops'] / 1e9:.1f}", _mb(rf["bytes"]),
          fmt(xc["flops"], 1e9), fmt(xc["bytes"], 2**20),
          f"{rf['time_us']:.0f}",
          _issue_cell(rf),
          f"{rf['gemm_time_us']:.0f}", ratio,
          *ideal_cells, f"{r['compile_s']:.1f}"))
    out.append("")
    rows = group_rows(recs) if by_group else []
    if rows:
      ok = [r["recipe"] for r in recs if r["status"] == "ok"]
      out += ["Where the step goes: model us (kernels) by kernel group: a "
              "GEMM, attention, the qlayers kernel or primitive that "
              "launched it, else XLA's kind of kernel.", ""]
      out += mdtable.head(["group", *ok], "l" + "r" * len(ok))
      out += [mdtable.row(*row) for row in rows] + [""]
  return "\n".join(out)


def _issue_cell(rf: dict) -> str:
  """A roofline's issue us, with the PTX counts' figure where it
  differs."""
  if not rf.get("issue"):
    return "n/a"
  cell = f"{rf['issue_extra_us']:.0f}"
  ptx = rf.get("ptx", {}).get("issue_extra_us")
  if ptx is not None and round(ptx) != round(rf["issue_extra_us"]):
    cell += f" (PTX: {ptx:.0f})"
  return cell


def _issue_summary(rec: dict) -> str:
  """Distinct issues of a record's layer GEMMs with counts ("-": none)."""
  c = Counter()
  for g in rec.get("gemms") or []:
    for issue in g.get("issues", []):
      c[issue] += 1
  return "; ".join(f"{i}" + (f" x{n}" if n > 1 else "")
                   for i, n in sorted(c.items())) or "-"


def compare_markdown(runs: list[tuple[str, list[dict]]]) -> str:
  """Condensed side-by-side tables of several runs (e.g. before/after):
  per (target, Triton flag, program) and recipe, each run's GEMM kernels,
  their issues and the model step time against that run's BF16."""
  keys: dict[tuple, None] = {}
  index: dict[tuple, dict] = {}
  for label, recs in runs:
    for r in recs:
      key = (r["target"], r["triton"], r["program"])
      keys.setdefault(key, None)
      index[(label, *key, r["recipe"])] = r
  out = []
  labels = [label for label, _ in runs]
  for key in keys:
    tname, triton, program = key
    out += [f"#### {tname} ({TARGETS[tname].arch}), Triton GEMMs "
            f"{'on' if triton else 'off'}, {program}", ""]
    cols = ["recipe"]
    for label in labels:
      cols += [f"{label}: GEMM kernels", f"{label}: issues",
               f"{label}: vs bf16"]
    out += mdtable.head(cols, "l" + "llr" * len(labels))
    recipes = dict.fromkeys(rec for (lab, *k, rec) in index
                            if tuple(k) == key)
    for recipe in recipes:
      cells = [recipe]
      for label in labels:
        r = index.get((label, *key, recipe))
        base = index.get((label, *key, "bf16"))
        if r is None:
          cells += [None, None, None]
        elif r["status"] != "ok":
          cells += ["failed", r.get("error", "").replace("|", "/")[:120],
                    None]
        else:
          ratio = ""
          if base and base["status"] == "ok":
            speedup = base["roofline"]["time_us"] / r["roofline"]["time_us"]
            ratio = f"{speedup:.2f}x"
            ideal = against_ideal(r, base)
            if ideal and r["recipe"] != "bf16":
              ratio += (f" ({ideal['of_ideal']:.2f} of "
                        f"{ideal['ideal_speedup']:.2f}x)")
              if "launched" in ideal:
                ratio += (f"; +launches {ideal['launched']['speedup']:.2f}x"
                          f" ({ideal['launched']['of_ideal']:.2f})")
          cells += [r["kernels"] or "-", _issue_summary(r), ratio]
      out.append(mdtable.row(*cells))
    out.append("")
  return "\n".join(out)


_ROLE_ORDER = {"Fprop": 0, "Dgrad": 1, "Wgrad": 2}


def _role_key(role: str) -> tuple:
  return (_ROLE_ORDER.get(role.rsplit(" ", 1)[-1], 3), role)


def _gemm_cells(gemms: list[dict]) -> list[str]:
  """Kernel, dtypes, folded and passes of the GEMMs that share one role
  (usually one; several are joined with " / ")."""
  def passes(g):
    parts = [f"{where} {_passes(g[key])}" for key, where in
             (("pre", "in:"), ("post", "out:")) if g[key]]
    return "; ".join(parts) or "-"
  folded = {True: "yes", False: "no", None: "-"}
  cols = (lambda g: g["kernel"], lambda g: f"{g['a']} x {g['b']} -> {g['out']}",
          lambda g: f"{folded[g['folded']]} ({g['scales']})", passes)
  return [" / ".join(dict.fromkeys(col(g) for g in gemms)) for col in cols]


def compare_gemms_markdown(runs: list[tuple[str, list[dict]]],
                           program: str = "layer") -> str:
  """Per GEMM (Fprop/Dgrad/Wgrad) side by side for one program: each run's
  kernel, operand and output dtypes, whether the scales are folded, and the
  extra passes with their bytes."""
  keys: dict[tuple, None] = {}
  index: dict[tuple, dict] = {}
  for label, recs in runs:
    for r in recs:
      if r["program"] != program:
        continue
      keys.setdefault((r["target"], r["triton"]), None)
      index[(label, r["target"], r["triton"], r["recipe"])] = r
  labels = [label for label, _ in runs]
  out = []
  for tname, triton in keys:
    out += [f"#### {tname} ({TARGETS[tname].arch}), Triton GEMMs "
            f"{'on' if triton else 'off'}, {program}: per GEMM", ""]
    cols = ["recipe", "GEMM"]
    for label in labels:
      cols += [f"{label}: kernel", f"{label}: a x b -> out",
               f"{label}: scales folded", f"{label}: extra passes"]
    out += mdtable.head(cols, "ll" + "llll" * len(labels))
    recipes = dict.fromkeys(rec for (lab, t, tr, rec) in index
                            if (t, tr) == (tname, triton))
    for recipe in recipes:
      per_run = {}
      roles: dict[str, None] = {}
      for label in labels:
        r = index.get((label, tname, triton, recipe))
        by_role: dict[str, list[dict]] = {}
        for g in (r or {}).get("gemms") or []:
          by_role.setdefault(g["role"], []).append(g)
          roles.setdefault(g["role"], None)
        per_run[label] = (r, by_role)
      for role in sorted(roles, key=_role_key) or ["-"]:
        cells = [recipe, role]
        for label in labels:
          r, by_role = per_run[label]
          if r is None:
            cells += [None] * 4
          elif r["status"] != "ok":
            cells += ["failed", r.get("error", "").replace("|", "/")[:120],
                      None, None]
          elif role not in by_role:
            cells += ["-"] * 4
          else:
            cells += _gemm_cells(by_role[role])
        out.append(mdtable.row(*cells))
    out.append("")
  return "\n".join(out)


# ==========================================================================
# Driver: one worker process per (target, Triton flag)


def worker(items_path: str, ffi_dir: str = "") -> None:
  """Compiles the items of a JSON file, one JSON line per finished item;
  with ``ffi_dir``, the cuBLASLt kernels there are registered although no
  GPU is attached."""
  if ffi_dir:
    from qlayers import _native  # pylint: disable=g-import-not-at-top
    _native.load(ffi_dir, gpu_without_device=True)
  items = json.loads(pathlib.Path(items_path).read_text())
  devices = {}
  for item in items:
    targets_dir = pathlib.Path(item["targets_dir"])
    if item["target"] not in devices:
      devices[item["target"]] = gpu_device(TARGETS[item["target"]],
                                           targets_dir)
    print("START " + json.dumps([item["program"], item["recipe"]]),
          flush=True)
    rec = compile_one(item, devices[item["target"]], targets_dir)
    print("RESULT " + json.dumps(rec), flush=True)


def run_items(items: list[dict], python: str, timeout: float,
              log=print, ffi_dir: str = "") -> list[dict]:
  """Runs items in worker processes; a crash fails only the item it hit."""
  done: list[dict] = []
  todo = list(items)
  tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
  while todo:
    path = tmp / f"qlayers_gpu_compile_{os.getpid()}.json"
    path.write_text(json.dumps(todo))
    env = dict(os.environ, JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    proc = subprocess.Popen([python, __file__, "--worker", str(path),
                             "--ffi-dir", ffi_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=_ROOT)
    try:
      stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      stdout, stderr = proc.communicate()
      stderr += f"\nworker timed out after {timeout:.0f} s"
    finally:
      # Stopped early (Ctrl-C, or SIGTERM, which the script makes an
      # exit): the worker goes too, instead of compiling on to its timeout.
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
        path.unlink(missing_ok=True)
    finished = 0
    for line in stdout.splitlines():
      if line.startswith("RESULT "):
        rec = json.loads(line[7:])
        done.append(rec)
        finished += 1
        log(f"  {rec['target']} triton={rec['triton']} {rec['program']} "
            f"{rec['recipe']}: {rec['status']} "
            f"({rec.get('compile_s', 0):.1f} s) {rec.get('kernels') or ''}"
            f"{rec.get('error', '')}")
    todo = todo[finished:]
    if todo and proc.returncode != 0:
      bad = dict(todo.pop(0))
      lines = [ln for ln in stderr.splitlines() if ln.strip()]
      crash = next((ln for ln in reversed(lines) if re.search(
          r"(Check failed|F0|Fatal|Error|error|timed out)", ln)),
                   lines[-1] if lines else f"exit {proc.returncode}")
      bad.update(status="failed", error=f"compiler crashed: {crash.strip()}"
                 [:300], compile_s=0.0)
      done.append(bad)
      log(f"  {bad['program']} {bad['recipe']}: crashed: {bad['error']}")
    elif todo:
      raise RuntimeError("worker stopped early without an error: "
                         + stderr[-500:])
    path.unlink(missing_ok=True)
  return done


def _csv(text: str, allowed: Iterable[str], what: str) -> list[str]:
  vals = [v.strip() for v in text.split(",") if v.strip()]
  bad = [v for v in vals if v not in allowed]
  if bad:
    raise SystemExit(f"unknown {what}: {', '.join(bad)} (choose from "
                     f"{', '.join(allowed)})")
  return vals


def _targets_dir() -> str:
  if os.environ.get("QLAYERS_GPU_TARGETS"):
    return os.environ["QLAYERS_GPU_TARGETS"]
  for base in (_ROOT, *list(_ROOT.parents)[:2]):
    if (base / "shared" / "gpu-targets").is_dir():
      return str(base / "shared" / "gpu-targets")
  return str(_ROOT / "shared" / "gpu-targets")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--targets", default="h200,b200")
  p.add_argument("--triton", default="on,off",
                 help="Triton GEMMs: on, off or on,off")
  p.add_argument("--recipes", default=",".join(RECIPES),
                 help="recipe names or recipe .toml files, comma-separated")
  p.add_argument("--programs", default=",".join(PROGRAMS))
  p.add_argument("--tokens", type=int, default=4096)
  p.add_argument("--in-features", type=int, default=4096)
  p.add_argument("--out-features", type=int, default=4096)
  p.add_argument("--block-batch", type=int, default=4)
  p.add_argument("--block-seq", type=int, default=1024)
  p.add_argument("--block-d", type=int, default=2048)
  p.add_argument("--block-heads", type=int, default=16)
  p.add_argument("--block-ff", type=int, default=5632)
  p.add_argument("--block-kv-heads", type=int, default=0,
                 help="grouped-query attention (default: --block-heads)")
  p.add_argument("--block-attention", default="materialized",
                 choices=("materialized", "cudnn"),
                 help="program block's attention: einsum + softmax, or "
                 "jax.nn.dot_product_attention(implementation='cudnn')")
  p.add_argument("--groups", action="store_true",
                 help="also print where each recipe's step goes, by kernel "
                 "group (the records hold it either way)")
  p.add_argument("--host-arch", action="store_true",
                 help="do not tell qlayers which GPU it compiles for (the "
                 "choice when the generation is unknown)")
  p.add_argument("--ffi-dir", default=str(_ROOT / "build" / "cuda" / "ffi"),
                 help="folder with libqlayers_cuda.so (and libqlayers_cpu.so)"
                 ", registered without a device; '' for none (default: "
                 "build/cuda/ffi from ffi/build_cuda.sh)")
  p.add_argument("--targets-dir", default=_targets_dir(),
                 help="folder with h200.txtpb, b200_approx.txtpb "
                 "($QLAYERS_GPU_TARGETS; default: shared/gpu-targets in the "
                 "checkout or up to two folders above it)")
  p.add_argument("--json", help="write every record to this file")
  p.add_argument("--markdown", help="write the tables to this file")
  p.add_argument("--hlo-dir", help="keep each optimized HLO here")
  p.add_argument("--dump-dir", help="keep each compile's XLA dump (PTX, "
                 "thunk sequence) in a folder of its own here (emptied "
                 "first)")
  p.add_argument("--issue-counts", choices=("sass", "ptx"), default="sass",
                 help="what the issue roof counts: each kernel's SASS by "
                 "pipeline (ptxas and nvdisasm from the NVIDIA wheels or "
                 "PATH; its PTX where they are missing) or its PTX alone "
                 "(faster: no ptxas run per module)")
  p.add_argument("--timeout", type=float, default=3600,
                 help="seconds per worker process")
  p.add_argument("--reparse", nargs=2, metavar=("JSON", "HLO_DIR"),
                 help="re-analyse an earlier run's kept HLO with this parser "
                 "and rewrite its tables (--json/--markdown; nothing is "
                 "compiled)")
  p.add_argument("--compare", nargs="+", metavar="LABEL=JSON",
                 help="print side-by-side tables of earlier runs' --json "
                 "files: per recipe, then per layer GEMM (nothing is "
                 "compiled)")
  p.add_argument("--worker", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    worker(args.worker, args.ffi_dir)
    return 0
  if args.reparse:
    data = json.loads(pathlib.Path(args.reparse[0]).read_text())
    data["records"] = reparse(data["records"], args.reparse[1])
    text = markdown(data["records"], by_group=args.groups)
    print(text)
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps(data, indent=1))
    if args.markdown:
      pathlib.Path(args.markdown).write_text(text)
    return 0
  if args.compare:
    runs = []
    for item in args.compare:
      label, sep, path = item.partition("=")
      if not sep:
        raise SystemExit(f"--compare takes LABEL=JSON, got {item!r}")
      runs.append((label, json.loads(pathlib.Path(path).read_text())
                   ["records"]))
    text = compare_markdown(runs)
    if any(r["program"] == "layer" for _, recs in runs for r in recs):
      text += "\n" + compare_gemms_markdown(runs, "layer")
    print(text)
    if args.markdown:
      pathlib.Path(args.markdown).write_text(text)
    return 0
  targets = _csv(args.targets, TARGETS, "target")
  tritons = _csv(args.triton, ("on", "off"), "--triton value")
  from qlayers.recipe import available_recipes  # pylint: disable=g-import-not-at-top
  known = tuple(dict.fromkeys(RECIPES + tuple(available_recipes())))
  recipes = _csv(args.recipes, known + tuple(
      r for r in args.recipes.split(",") if r.strip().endswith(".toml")
      and pathlib.Path(r.strip()).is_file()), "recipe (or .toml file)")
  programs = _csv(args.programs, PROGRAMS, "program")
  targets_dir = pathlib.Path(args.targets_dir)
  for t in targets:
    if not (targets_dir / TARGETS[t].config).is_file():
      raise SystemExit(f"{targets_dir / TARGETS[t].config} not found; "
                       "pass --targets-dir")
  if args.hlo_dir:
    pathlib.Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
  if args.block_d % args.block_heads:
    raise SystemExit("--block-d must be a multiple of --block-heads")
  layer = {"tokens": args.tokens, "k": args.in_features,
           "n": args.out_features}
  block = {"batch": args.block_batch, "seq": args.block_seq,
           "d": args.block_d, "heads": args.block_heads, "ff": args.block_ff,
           "kv_heads": args.block_kv_heads or args.block_heads,
           "attention": args.block_attention}
  ffi_dir = args.ffi_dir
  if ffi_dir and not (pathlib.Path(ffi_dir) / "libqlayers_cuda.so").is_file():
    print(f"no libqlayers_cuda.so in {ffi_dir}: FFI GEMMs are not available "
          "(build them with `bash ffi/build_cuda.sh`)", flush=True)
    ffi_dir = ""
  records = []
  t0 = time.perf_counter()
  for t in targets:
    for tr in tritons:
      items = [{"target": t, "triton": tr == "on", "program": prog,
                "recipe": r, "layer": layer,
                "block": BLOCK_PRESETS.get(prog, block),
                "host_arch": args.host_arch,
                "targets_dir": str(targets_dir), "hlo_dir": args.hlo_dir,
                "dump_dir": args.dump_dir,
                "sass": args.issue_counts == "sass"}
               for prog in programs for r in recipes]
      print(f"{t} Triton {tr}: {len(items)} compiles", flush=True)
      records += run_items(items, sys.executable, args.timeout,
                           ffi_dir=ffi_dir)
  text = markdown(records, by_group=args.groups)
  print()
  print(text)
  print(f"total {time.perf_counter() - t0:.0f} s")
  if args.markdown:
    pathlib.Path(args.markdown).write_text(text)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(
        {"settings": {"layer": layer, "block": block,
                      "host_arch": args.host_arch, "ffi_dir": ffi_dir,
                      "issue_counts": args.issue_counts, "sass_tools": {
                          t: cuda_tool(t) for t in ("ptxas", "nvdisasm")},
                      "cudnn": installed_cudnn(),
                      "targets": {t: dataclasses.asdict(TARGETS[t])
                                  for t in targets}},
         "records": records}, indent=1))
  return 0


if __name__ == "__main__":
  # SIGTERM as an exit, so that `run_items` stops its worker on the way out.
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
  sys.exit(main())
