"""LoRA on frozen FP8 base weights of SmolLM2-135M, from an FP8 checkpoint.

  python examples/finetune_smollm2_lora.py           # CPU: slow, see RESULTS
  python examples/finetune_smollm2_lora.py --steps 300 --recipe deepseek_v3

1. Loads SmolLM2-135M-Instruct (``_common/llama.py``; the GGUF dequantized
   to FP32) and writes it as a Hugging Face FP8 checkpoint
   (``qlayers.checkpoint.write_safetensors``: every linear weight E4M3 with
   a ``weight_scale_inv`` per 128x128 block, ``quantization_config`` in
   ``config.json``; embedding and norms as they are).
2. FP8 model: converts the linear layers (``qlayers.quantize``) and loads
   the checkpoint into it with ``qlayers.hf.load_tensors``: each kernel
   becomes a ``qlayers.FrozenKernel`` holding the file's payload and scales
   (no FP32 master, no gradient, no optimizer state).
   BF16 baseline: the same model with BF16 kernels (``bf16`` recipe, kernels
   cast to BF16), also frozen by training only the adapters.
3. Both get the same LoRA adapters (``qlayers.add_lora``, BF16, on every
   linear layer) and are fine-tuned on the Shakespeare training plays with
   ``qlayers.value_and_grad`` / ``qlayers.Optimizer`` (``wrt=nnx.LoRAParam``),
   same data, same steps.
4. Reports validation perplexity before and after for both (the FP8 run
   against the BF16 run), the bytes of the base weights (FP8 payload +
   scales against BF16) and of everything held for training (parameters +
   optimizer state), and exports the FP8 run's adapters
   (``qlayers.checkpoint.save_adapters``).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import qlayers
from qlayers import checkpoint, hf
from qlayers.layers.frozen import FrozenKernel

from _common import cli, llama, lm, shakespeare

HF_LINEAR = {"attn": "self_attn", "mlp": "mlp"}


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on (each field is a command-line flag).

  Attributes:
    recipe: the qlayers recipe of the FP8 run's GEMMs (the base weights
      are FP8 128x128 blocks whatever it is).
    steps, batch_size, seq_len, lr: the LoRA fine-tune (Adam, constant lr).
    rank: LoRA rank (BF16 adapters on every linear layer).
    eval_tokens: validation tokens scored (windows of ``seq_len``).
    blocks: keep only the first N transformer blocks (0: all 30); for quick
      tests of the plumbing, not for meaningful numbers.
    seed: data order and adapter initialisation.
    out: folder for the FP8 checkpoint and the adapters.
    json: also write all numbers to this file.
  """

  recipe: str = "fp8_current"
  steps: int = 30
  batch_size: int = 4
  seq_len: int = 128
  lr: float = 1e-3
  rank: int = 8
  eval_tokens: int = 1024
  blocks: int = 0
  seed: int = 0
  out: str = "out/finetune_smollm2_lora"
  json: str | None = None


def load(cfg: Config):
  """SmolLM2 (FP32 parameters, BF16 GEMMs), first ``cfg.blocks`` blocks."""
  model, tokenizer, _ = llama.load_smollm2(dtype=jnp.bfloat16,
                                           blocks=cfg.blocks)
  return model, tokenizer


def hf_names(model) -> dict[str, str]:
  """Model Variable path -> Hugging Face Llama tensor name."""
  names = {"embed.embedding": "model.embed_tokens.weight",
           "final_norm.scale": "model.norm.weight"}
  for i, block in enumerate(model.blocks):
    pre = f"model.layers.{i}"
    names[f"blocks.{i}.attn_norm.scale"] = f"{pre}.input_layernorm.weight"
    names[f"blocks.{i}.mlp_norm.scale"] = (
        f"{pre}.post_attention_layernorm.weight")
    for part, hf_part in HF_LINEAR.items():
      for name, _ in nnx.iter_children(getattr(block, part)):
        if name.endswith("_proj"):
          names[f"blocks.{i}.{part}.{name}.kernel"] = (
              f"{pre}.{hf_part}.{name}.weight")
  return names


def hf_tensors(model, names: dict[str, str]) -> dict[str, np.ndarray]:
  """The model's weights under their Hugging Face names, ``(out, in)``."""
  state = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(
      nnx.state(model, nnx.Param))}
  return {hf_name: np.asarray(state[path][...]).T if path.endswith(".kernel")
          else np.asarray(state[path][...])
          for path, hf_name in names.items()}


def kernels(model):
  """``(path, kernel)`` of every linear layer (Param or FrozenKernel)."""
  return [(p, m.kernel) for p, m in nnx.iter_graph(model)
          if isinstance(m, qlayers.QuantDense)]


def nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def memory(model, optimizer) -> dict[str, int]:
  """Bytes held for training: base weights, the rest of the model's state,
  adapters, optimizer state (masters and moments)."""
  base = sum(k.nbytes if isinstance(k, FrozenKernel) else k[...].nbytes
             for _, k in kernels(model))
  everything = nbytes(nnx.state(model))
  adapters = nbytes(nnx.state(model, nnx.LoRAParam))
  opt = nbytes(nnx.state(optimizer.opt_state))
  return {"base_weights": base, "adapters": adapters,
          "other": everything - base - adapters, "optimizer": opt,
          "total": everything + opt}


@nnx.jit
def train_step(model, optimizer, inputs, targets):
  """One adapter-only step; returns the batch loss."""
  def loss_fn(model):
    return lm.next_token_loss(model(inputs), targets)
  loss, grads = qlayers.value_and_grad(loss_fn, wrt=nnx.LoRAParam)(model)
  optimizer.update(model, grads)
  return loss


def finetune(name, model, cfg: Config, train_ids, ppl) -> dict[str, Any]:
  """Adds adapters, trains them; perplexity before and after."""
  qlayers.add_lora(model, cfg.rank, rngs=nnx.Rngs(cfg.seed))
  optimizer = qlayers.Optimizer(model, optax.adam(cfg.lr),
                                wrt=nnx.LoRAParam)
  out = {"ppl_before": ppl(model), "memory": memory(model, optimizer)}
  stream = shakespeare.batches(train_ids, batch_size=cfg.batch_size,
                               seq_len=cfg.seq_len, seed=cfg.seed)
  losses, times = [], []
  for step in range(1, cfg.steps + 1):
    inputs, targets = next(stream)
    t0 = time.perf_counter()
    loss = float(train_step(model, optimizer, inputs, targets))
    times.append(time.perf_counter() - t0)
    if not np.isfinite(loss):
      raise FloatingPointError(f"{name}: loss {loss} at step {step}")
    losses.append(loss)
    if step == 1 or step % 10 == 0 or step == cfg.steps:
      print(f"  {name} step {step}: loss {loss:.3f} ({times[-1]:.1f} s)")
  out.update(ppl_after=ppl(model), train_loss=losses,
             first_step_s=times[0],
             step_s=float(np.mean(times[1:])) if len(times) > 1 else None)
  return out


def main(argv=None) -> dict[str, Any]:
  """Runs everything; returns the numbers written by ``--json``."""
  cfg = cli.parse(Config, __doc__, argv, at_least={
      "steps": 1, "batch_size": 1, "seq_len": 1, "rank": 1,
      "eval_tokens": 1, "blocks": 0},
      recipe={"help": "available: " + cli.recipes()})
  out = pathlib.Path(cfg.out)
  results: dict[str, Any] = {"config": dataclasses.asdict(cfg),
                             "backend": jax.default_backend()}
  model, tokenizer = load(cfg)
  train_ids = np.asarray(
      tokenizer.encode(shakespeare.load_text("train")).ids, np.int32)
  valid_text = shakespeare.load_text("valid")[:8 * cfg.eval_tokens]
  valid_ids = np.asarray(tokenizer.encode(valid_text).ids,
                         np.int32)[:cfg.eval_tokens + 1]
  ppl = functools.partial(lm.perplexity, tokens=valid_ids,
                          seq_len=min(cfg.seq_len, cfg.eval_tokens),
                          batch_size=cfg.batch_size)

  # 1. The FP8 checkpoint, written from the model.
  names = hf_names(model)
  ckpt = checkpoint.write_safetensors(out / "fp8", hf_tensors(model, names),
                                      fp8_block=(128, 128))
  files = sorted(ckpt.glob("*.safetensors"))
  results["checkpoint"] = {"path": str(ckpt), "bytes": sum(
      f.stat().st_size for f in files)}
  print(f"wrote {ckpt} ({results['checkpoint']['bytes'] / 2**20:.1f} MiB)")

  # 2. BF16 baseline: BF16 kernels (from the same FP32 weights).
  qlayers.quantize(model, "bf16")
  for _, k in kernels(model):
    k.set_value(k[...].astype(jnp.bfloat16))
  results["bf16"] = finetune("bf16", model, cfg, train_ids, ppl)
  del model

  # 3. FP8: frozen kernels straight from the checkpoint.
  fp8, _ = load(cfg)
  qlayers.quantize(fp8, cfg.recipe)
  loaded = hf.load_tensors(fp8, checkpoint.read_safetensors(
      ckpt, quantized=True), names, frozen=True)
  frozen = sum(isinstance(k, FrozenKernel) for _, k in kernels(fp8))
  print(f"FP8 model: {loaded} tensors loaded, {frozen} frozen FP8 kernels")
  results["fp8"] = finetune("fp8", fp8, cfg, train_ids, ppl)
  results["fp8"]["frozen_kernels"] = frozen
  adapters = checkpoint.save_adapters(out / "adapters.safetensors", fp8)
  results["adapters"] = {"path": str(adapters),
                         "bytes": adapters.stat().st_size}

  b, f = results["bf16"], results["fp8"]
  results["ppl_ratio_after"] = f["ppl_after"] / b["ppl_after"]
  results["base_bytes_ratio"] = (f["memory"]["base_weights"]
                                 / b["memory"]["base_weights"])
  print("             perplexity before -> after   base weights   "
        "params+optimizer")
  for name, r in (("bf16 base", b), ("fp8 base", f)):
    m = r["memory"]
    print(f"  {name:10} {r['ppl_before']:8.2f} -> {r['ppl_after']:7.2f}"
          f"   {m['base_weights'] / 2**20:8.1f} MiB   "
          f"{m['total'] / 2**20:8.1f} MiB")
  print(f"FP8/BF16: perplexity after {results['ppl_ratio_after']:.4f}x, "
        f"base-weight bytes {results['base_bytes_ratio']:.3f}x; adapters "
        f"{adapters} ({results['adapters']['bytes'] / 2**20:.2f} MiB)")
  cli.write_json(cfg.json, results)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
