"""Collective bytes of one sharded train step, per recipe and layout, read
from the compiled HLO, against the unquantized step.

Usage (from the repository root; the script asks for 8 simulated CPU devices
itself unless ``XLA_FLAGS`` already sets a device count)::

  python benchmarks/sharding.py --json out/sharding.json
  python benchmarks/sharding.py --recipes fp8_delayed,mxfp8 --layouts fsdp
  python benchmarks/sharding.py --quick           # one recipe, two layouts
  python benchmarks/sharding.py --model moe --recipes fp8_current,mxfp8
                                                  # MoE GPT, experts over 8
  python benchmarks/sharding.py --model moe --layouts ep+fsdp
                                  # experts over 4, their kernels over 2 (FSDP)

Model: the GPT of ``examples/_common/gpt.py`` (d_model 256, 2 blocks, 4
heads, d_ff 1024, vocab 256, seq 128, batch 16; BF16 GEMMs), its Params cast
to BF16 (``--params f32``: left FP32), trained with
``qlayers.value_and_grad`` and ``qlayers.Optimizer`` (AdamW; FP32 masters
beside BF16 Params). Variants: ``stock`` (the model as built: ``nnx.Linear``
in BF16, the baseline of the ratios: with BF16 Params it gathers BF16
weights, as a BF16 FSDP run does), ``bf16`` (every linear a qlayers layer that
quantizes nothing) and each recipe, converted by ``qlayers.quantize(model,
recipe)`` (the embedding and the output head stay wide; ``--rules all``
converts the head too).

Layouts on 8 devices, placed with ``examples/_common/sharding.py``: ``dp``
(data=8), ``fsdp`` (fsdp=8), ``tp`` (data=2, model=4), ``fsdp_tp`` (fsdp=2,
model=4). Each variant's step is compiled once; its collectives
(``benchmarks/collectives.py``: bytes of each collective's result on one
device, by op and dtype) are tabulated, the all-gathers also with every
wide element counted at 2 bytes (XLA:CPU gathers BF16 Params as F32, a GPU
as BF16) and, so counted, against the stock step's. ``--steps N`` (default 2) runs the compiled step N times and
compares the losses with the same variant on one device (a sharded step
adds and reduces in another order, so expect FP32 rounding, not bits).

``--model moe``: the MoE GPT of ``examples/_common/moe.py`` (the same sizes,
each MLP 8 experts of width 512, top 2) in layout ``ep``: experts sharded
over an ``expert`` axis of 8 devices with the batch, tokens sent to their
experts by ``all_to_all`` (`qlayers.expert_parallel`), as each quantized
variant's payloads (``transport``); the all-to-all bytes are in "other".
Layout ``ep+fsdp`` (fsdp=2, expert=4): experts over ``expert``, each
expert kernel also over ``fsdp`` along K, the batch over both; the
quantized variants' grouped GEMMs gather their kernel shards as payload +
scales (`qlayers.expert_parallel.run` with ``fsdp``), the stock and bf16
ones wide, and reduce-scatter the kernel gradients.
"""

from __future__ import annotations

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS",
                                                                 ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import qlayers  # noqa: E402
from _common import gpt, lm, moe, sharding  # noqa: E402
import collectives  # noqa: E402
import mdtable  # noqa: E402

LAYOUTS = {"dp": "data=8", "fsdp": "fsdp=8", "tp": "data=2,model=4",
           "fsdp_tp": "fsdp=2,model=4", "ep": "expert=8",
           "ep+fsdp": "fsdp=2,expert=4"}
MOE_LAYOUTS = ("ep", "ep+fsdp")
RECIPES = ("fp8_delayed", "fp8_current", "mxfp8", "deepseek_v3", "mxfp4")
CONFIG = gpt.GPTConfig(vocab_size=256, max_len=128, d_model=256, n_layers=2,
                       n_heads=4, d_ff=1024, dtype=jnp.bfloat16)
# --model moe: the same sizes with every MLP an MoE layer (8 experts of width
# 512, top 2); under "ep" the experts are sharded over ``expert`` and each
# quantized variant sends the tokens to them as its payloads
# (`qlayers.expert_parallel`).
MOE_CONFIG = moe.MoEConfig(**{f.name: getattr(CONFIG, f.name)
                              for f in dataclasses.fields(CONFIG)},
                           n_experts=8, top_k=2)
BATCH, SEQ = 16, 128


def build(variant: str, rules: str, params: str = "bf16", model: str = "gpt"):
  """The GPT (or MoE GPT) as ``variant``; ``params="bf16"`` casts its Params
  to BF16 first (``qlayers.Optimizer`` then keeps FP32 masters beside
  them)."""
  if model == "moe":
    quantized = variant != "stock" and qlayers.recipe(variant).quantized
    config = dataclasses.replace(MOE_CONFIG,
                                 transport=variant if quantized else None)
    model = moe.MoEGPT(config, rngs=nnx.Rngs(0))
  else:
    model = gpt.GPT(CONFIG, rngs=nnx.Rngs(0))
  if params == "bf16":
    narrow = jax.tree.map(lambda p: p.astype(jnp.bfloat16),
                          nnx.state(model, nnx.Param))
    nnx.update(model, narrow)
  if variant != "stock":
    qlayers.quantize(model, variant, rules=() if rules == "all" else None)
  return model, qlayers.Optimizer(model, optax.adamw(3e-4,
                                                     weight_decay=0.01))


def batch(seed=0):
  tokens = np.random.default_rng(seed).integers(
      0, CONFIG.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)
  return tokens[:, :-1], tokens[:, 1:]


def place_experts(mesh, model, opt, inputs, targets):
  """Expert parallelism: stacked expert kernels (and their optimizer
  moments) split over ``expert`` by their leading dim (and over ``fsdp``
  along K where the mesh has it), the batch over both, everything else
  replicated."""
  fsdp = ("fsdp",) if "fsdp" in mesh.axis_names else ()
  def put(path, x):
    if not hasattr(x, "ndim"):
      return x
    names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    experts = x.ndim == 3 and any(n in ("up", "down") for n in names)
    spec = P("expert", *fsdp) if experts else P()
    return jax.device_put(x, NamedSharding(mesh, spec))
  for node in (model, opt):
    nnx.update(node, jax.tree_util.tree_map_with_path(put, nnx.state(node)))
  return [jax.device_put(a, NamedSharding(mesh, P((*fsdp, "expert"))))
          for a in (inputs, targets)]


def compile_step(model, opt, inputs, targets):
  graphdef, state = nnx.split((model, opt))

  def step(state, inputs, targets):
    model, opt = nnx.merge(graphdef, state)
    def loss_fn(m):
      if isinstance(m, moe.MoEGPT):  # with its load-balancing loss
        return moe.loss_fn(m, inputs, targets)[0]
      return lm.next_token_loss(m(inputs), targets)
    loss, grads = qlayers.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss, nnx.state((model, opt))

  t0 = time.perf_counter()
  compiled = jax.jit(step).lower(state, inputs, targets).compile()
  return compiled, state, time.perf_counter() - t0


def run(variant, layout, rules, steps, params="bf16", model_name="gpt"):
  """Collectives (and losses) of one variant; ``layout`` None: one device."""
  inputs, targets = batch()
  model, opt = build(variant, rules, params, model_name)
  if layout is None:
    compiled, state, _ = compile_step(model, opt, inputs, targets)
    return {"losses": _losses(compiled, state, inputs, targets, steps)}
  if layout in MOE_LAYOUTS:  # "fsdp=2,expert=4" -> fsdp 2 x expert 4
    sizes = dict(a.split("=") for a in LAYOUTS[layout].split(","))
    mesh = jax.make_mesh(tuple(map(int, sizes.values())), tuple(sizes),
                         axis_types=(AxisType.Auto,) * len(sizes))
  else:
    mesh = sharding.make_mesh(LAYOUTS[layout])
  with jax.set_mesh(mesh):
    if layout in MOE_LAYOUTS:
      inputs, targets = place_experts(mesh, model, opt, inputs, targets)
    else:
      sharding.shard_model(mesh, model, opt)
      inputs, targets = sharding.put_batch(mesh, inputs, targets)
    compiled, state, secs = compile_step(model, opt, inputs, targets)
    hlo = compiled.as_text()
    return {"collectives": collectives.summary(hlo), "compile_s": secs,
            "losses": _losses(compiled, state, inputs, targets, steps)}


def _losses(compiled, state, inputs, targets, steps):
  out = []
  for _ in range(steps):
    loss, state = compiled(state, inputs, targets)
    out.append(float(loss))
  return out


def _mib(n):
  return f"{n / 2**20:.2f}"


def _by_dtype(d: dict) -> str:
  if not d:
    return "—"
  return ", ".join(f"{k} {_mib(v)}" for k, v in sorted(d.items(),
                                                       key=lambda kv: -kv[1]))


# Bytes per element of the wide HLO types a step may gather.
_WIDE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "pred": 1}


def _wide_as_bf16(gathers: dict) -> int:
  """All-gather bytes with every wide element counted at 2 bytes: what the
  step moves where BF16 collectives exist (XLA:CPU gathers BF16 Params as
  F32, so its bytes of a BF16 gather are twice a GPU's); 1-byte payloads
  and scales (``u8``) as they are."""
  return sum(v if k == "u8" else 2 * v // _WIDE_BYTES[k]
             for k, v in gathers.items())


def table(layout: str, rows: dict) -> list[str]:
  base = rows["stock"]["collectives"]
  base_ag = _wide_as_bf16(base.get("all-gather", {}))
  base_all = sum(sum(v.values()) for v in base.values())
  lines = [f"**{layout}** ({LAYOUTS[layout]}), MiB per step per device", ""]
  lines += mdtable.head(["variant", "all-gather", "all-reduce",
                         "reduce-scatter", "other", "AG, wide as BF16",
                         "AG vs BF16 stock", "total vs stock",
                         "max |Δ loss| vs 1 device"], "lllllrrrr")
  for name, r in rows.items():
    c = r["collectives"]
    other = {}
    for op, d in c.items():
      if op not in ("all-gather", "all-reduce", "reduce-scatter"):
        for k, v in d.items():
          other[f"{op} {k}"] = other.get(f"{op} {k}", 0) + v
    ag = _wide_as_bf16(c.get("all-gather", {}))
    total = sum(sum(v.values()) for v in c.values())
    delta = r.get("loss_delta")
    lines.append(mdtable.row(
        name, _by_dtype(c.get("all-gather", {})),
        _by_dtype(c.get("all-reduce", {})),
        _by_dtype(c.get("reduce-scatter", {})), _by_dtype(other),
        _mib(ag) if ag else "—",
        f"{ag / base_ag:.2f}x" if base_ag else "—",
        f"{total / base_all:.2f}x" if base_all else "—",
        "—" if delta is None else f"{delta:.1e}"))
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--recipes", default=",".join(RECIPES))
  p.add_argument("--layouts", default=",".join(
      x for x in LAYOUTS if x not in MOE_LAYOUTS))
  p.add_argument("--rules", choices=("default", "all"), default="default")
  p.add_argument("--steps", type=int, default=2)
  p.add_argument("--params", choices=("bf16", "f32"), default="bf16",
                 help="dtype of every variant's Params (default bf16: the "
                 "stock baseline gathers BF16 weights)")
  p.add_argument("--model", choices=("gpt", "moe"), default="gpt",
                 help="moe: the MoE GPT (examples/_common/moe.py), layout ep "
                 "(experts over 8 devices, all_to_all dispatch)")
  p.add_argument("--quick", action="store_true")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  recipes = [r for r in args.recipes.split(",") if r]
  layouts = [x for x in args.layouts.split(",") if x]
  if args.quick:
    recipes, layouts = ["fp8_delayed"], ["fsdp", "tp"]
  if args.model == "moe" and args.layouts == p.get_default("layouts"):
    layouts = list(MOE_LAYOUTS)
  for x in layouts:
    if x not in LAYOUTS:
      p.error(f"unknown layout {x!r}; choose from {sorted(LAYOUTS)}")
    if (x in MOE_LAYOUTS) != (args.model == "moe"):
      p.error(f"layout {x!r} is for --model "
              f"{'moe' if x in MOE_LAYOUTS else 'gpt'}")
  if jax.device_count() != 8:
    p.error(f"needs 8 devices, JAX sees {jax.device_count()}")
  variants = ["stock", "bf16", *recipes]
  print(f"{args.model.upper()} d_model={CONFIG.d_model} blocks={CONFIG.n_layers} "
        f"d_ff={CONFIG.d_ff}, {args.params} Params, batch {BATCH}x{SEQ}, on "
        f"{jax.device_count()} {jax.default_backend()} devices")
  single = {v: run(v, None, args.rules, args.steps, args.params, args.model)
            for v in variants} if args.steps else {}
  results = {"model": args.model, "layouts": LAYOUTS, "rules": args.rules,
             "steps": args.steps,
             "params": args.params, "jax": jax.__version__, "results": {}}
  out = []
  for layout in layouts:
    rows = {}
    for v in variants:
      r = run(v, layout, args.rules, args.steps, args.params, args.model)
      if args.steps:
        r["single_losses"] = single[v]["losses"]
        r["loss_delta"] = float(np.max(np.abs(np.subtract(
            r["losses"], single[v]["losses"]))))
      rows[v] = r
      print(f"{layout:8s} {v:12s} compiled in {r['compile_s']:.1f} s: "
            f"{_by_dtype(r['collectives'].get('all-gather', {}))} gathered")
    results["results"][layout] = rows
    out += table(layout, rows) + [""]
  print()
  print("\n".join(out))
  if args.json:
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path}")
  return results


if __name__ == "__main__":
  main()
