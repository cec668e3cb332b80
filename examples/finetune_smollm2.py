"""Fine-tune SmolLM2-135M-Instruct on Shakespeare with FP8 GEMMs.

  python examples/finetune_smollm2.py                      # 100 steps, CPU
  python examples/finetune_smollm2.py --steps 1000 --batch-size 16 \\
      --seq-len 512 --recipe mxfp8                         # longer (GPU)

1. Loads the pretrained model (``_common/llama.py``) and checks it works:
   perplexity on held-out plays and a greedy answer to a chat question.
2. Converts its linear layers with one call,
   ``qlayers.quantize(model, recipe)``, and prints the report (the tied
   embedding / output head stays wide); measures the perplexity again.
3. Fine-tunes on the training plays with ``qlayers.value_and_grad`` and
   ``qlayers.Optimizer`` (AdamW, warmup + cosine, clipping) in one
   ``nnx.jit`` step (``_common/lm.py``), measuring validation perplexity as
   it goes.
4. Saves model and optimizer with ``qlayers.checkpoint.save`` (orbax),
   restores them into a freshly initialised and converted model of the same
   shape (random weights, none read from the checkpoint file), and checks
   that both give bit-identical logits.
5. Generates a Shakespeare continuation with the restored model.
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
from _common import cli, llama, lm, shakespeare, training

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on (each field is a command-line flag).

  Attributes:
    recipe: the qlayers recipe for every linear layer.
    steps, batch_size, seq_len: fine-tuning length and batch shape.
    lr, min_lr_ratio, warmup, weight_decay, clip: AdamW with linear warmup
      and cosine decay to ``lr * min_lr_ratio``; global-norm clipping.
    eval_every: validation perplexity every so many steps (and at the end).
    eval_tokens: validation tokens scored (windows of ``seq_len``).
    dtype: computation dtype of the linear layers (parameters stay FP32).
    blocks: keep only the first N transformer blocks (0: all 30); for quick
      tests of the plumbing, not for meaningful numbers.
    question: the chat question asked of the pretrained model.
    prompt, sample_tokens, temperature: Shakespeare continuation at the end.
    seed: data order and sampling.
    out: folder for the checkpoint.
    json: also write all numbers to this file.
    progress: show a progress bar.
  """

  recipe: str = "fp8_delayed"
  steps: int = 100
  batch_size: int = 4
  seq_len: int = 128
  lr: float = 1e-4
  min_lr_ratio: float = 0.1
  warmup: int = 10
  weight_decay: float = 0.01
  clip: float = 1.0
  eval_every: int = 25
  eval_tokens: int = 1024
  dtype: str = "bfloat16"
  blocks: int = 0
  question: str = "What is the capital of France?"
  prompt: str = "ROMEO:\n"
  sample_tokens: int = 64
  temperature: float = 0.8
  seed: int = 0
  out: str = "out/finetune_smollm2"
  json: str | None = None
  progress: bool = True


def parse_args(argv=None) -> Config:
  """Command-line flags -> `Config` (defaults from the dataclass)."""
  return cli.parse(Config, __doc__, argv,
                   at_least={"steps": 1, "batch_size": 1, "seq_len": 1,
                             "warmup": 0, "eval_every": 1, "eval_tokens": 1,
                             "blocks": 0, "sample_tokens": 0},
                   recipe={"help": "available: " + cli.recipes()},
                   dtype={"choices": sorted(DTYPES)})


# --- model and steps ---------------------------------------------------------


def load_model(cfg: Config):
  """SmolLM2 in FP32 parameters (``cfg.blocks`` first blocks if set):
  ``(model, tokenizer, config)``."""
  return llama.load_smollm2(dtype=DTYPES[cfg.dtype], blocks=cfg.blocks)


def make_tx(cfg: Config) -> optax.GradientTransformation:
  return training.adamw_cosine(
      lr=cfg.lr, steps=cfg.steps, warmup=cfg.warmup,
      weight_decay=cfg.weight_decay, min_lr_ratio=cfg.min_lr_ratio,
      clip=cfg.clip)


@functools.partial(jax.jit, static_argnames="graphdef")
def _logits(graphdef, state, tokens):
  return nnx.merge(graphdef, state)(tokens)


def logits(model, tokens) -> np.ndarray:
  """Forward pass in eval mode (the model's state is left as it was)."""
  with lm.eval_mode(model):
    graphdef, state = nnx.split(model)
  return np.asarray(_logits(graphdef, state, jnp.asarray(tokens)))


def chat(model, tokenizer, question: str, max_new_tokens: int = 40) -> str:
  """Greedy answer to one chat turn."""
  ids = tokenizer.encode(llama.chat_prompt(question)).ids
  out = lm.generate(model, ids, max_new_tokens=max_new_tokens, temperature=0,
                    stop_token=tokenizer.token_to_id("<|im_end|>"))
  return tokenizer.decode(out[len(ids):].tolist()).strip()


def continuation(model, tokenizer, cfg: Config) -> str:
  ids = tokenizer.encode(cfg.prompt).ids
  out = lm.generate(model, ids, max_new_tokens=cfg.sample_tokens,
                    key=jax.random.key(cfg.seed), temperature=cfg.temperature)
  return tokenizer.decode(out.tolist())


def short_report(report, rows: int = 6) -> str:
  """``str(report)`` with each section cut to its first ``rows`` rows."""
  out, kept = [], 0
  lines = str(report).split("\n")
  for i, line in enumerate(lines):
    if not line.startswith("  "):
      out.append(line)
      kept = -1  # the next indented line is the section's header row
      continue
    if kept < rows:
      out.append(line)
    elif kept == rows:
      rest = next((j for j in range(i, len(lines))
                   if not lines[j].startswith("  ")), len(lines)) - i
      out.append(f"  ... and {rest} more")
    kept += 1
  return "\n".join(out)


# --- main --------------------------------------------------------------------


def main(argv=None) -> dict[str, Any]:
  """Runs everything; returns the numbers written by ``--json``."""
  cfg = parse_args(argv)
  out = pathlib.Path(cfg.out)
  out.mkdir(parents=True, exist_ok=True)
  results: dict[str, Any] = {"config": dataclasses.asdict(cfg),
                             "backend": jax.default_backend()}
  timings = results.setdefault("seconds", {})
  clock = time.perf_counter()

  def lap(name):
    nonlocal clock
    now = time.perf_counter()
    timings[name] = round(now - clock, 1)
    clock = now

  model, tokenizer, config = load_model(cfg)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  train_ids = np.asarray(
      tokenizer.encode(shakespeare.load_text("train")).ids, np.int32)
  valid_text = shakespeare.load_text("valid")
  valid_ids = np.asarray(  # ~4 characters per token; encode only what is used
      tokenizer.encode(valid_text[:8 * cfg.eval_tokens]).ids, np.int32)
  valid_ids = valid_ids[:cfg.eval_tokens + 1]
  ppl = functools.partial(lm.perplexity, tokens=valid_ids,
                          seq_len=cfg.seq_len, batch_size=cfg.batch_size)
  print(f"SmolLM2: {len(model.blocks)} blocks, {n_params / 1e6:.1f} M params; "
        f"{len(train_ids):,} training tokens, {len(valid_ids) - 1:,} "
        f"validation tokens; on {jax.default_backend()}")
  lap("load")

  # 1. The pretrained model, before anything changes.
  results["ppl_pretrained"] = ppl(model)
  results["chat_before"] = chat(model, tokenizer, cfg.question)
  print(f"pretrained ({cfg.dtype} GEMMs): validation perplexity "
        f"{results['ppl_pretrained']:.2f}")
  print(f"  Q: {cfg.question}\n  A: {results['chat_before']}")
  lap("check_pretrained")

  # 2. One call converts every linear layer.
  report = qlayers.quantize(model, cfg.recipe)
  print(short_report(report))
  results["converted"] = len(report.converted)
  results["ppl_converted"] = ppl(model)
  print(f"after qlayers.quantize(model, {cfg.recipe!r}), before training: "
        f"validation perplexity {results['ppl_converted']:.2f}")
  lap("convert")

  # 3. Fine-tune.
  optimizer = qlayers.Optimizer(model, make_tx(cfg))
  stream = shakespeare.batches(train_ids, batch_size=cfg.batch_size,
                               seq_len=cfg.seq_len, seed=cfg.seed)
  curve = [(0, results["ppl_converted"])]
  losses, step_times = [], []
  bar = training.progress(cfg.steps, f"fine-tune ({cfg.recipe})",
                          enabled=cfg.progress)
  for step in bar:
    inputs, targets = next(stream)
    t0 = time.perf_counter()
    loss = float(lm.train_step(model, optimizer, inputs, targets))
    if step > 1:
      step_times.append(time.perf_counter() - t0)
    if not np.isfinite(loss):
      raise FloatingPointError(f"loss {loss} at step {step}")
    losses.append(loss)
    if step % cfg.eval_every == 0 or step == cfg.steps:
      curve.append((step, ppl(model)))
    bar.set_postfix(loss=f"{loss:.3f}", val_ppl=f"{curve[-1][1]:.2f}",
                    refresh=False)
  bar.close()
  lap("fine_tune")
  results.update(train_loss=losses, val_ppl=curve,
                 step_ms=1e3 * float(np.mean(step_times)) if step_times
                 else None)
  print("step  validation perplexity")
  for step, p in curve:
    print(f"{step:4d}  {p:8.2f}")
  if results["step_ms"]:
    print(f"{results['step_ms']:.0f} ms/step, "
          f"{cfg.batch_size * cfg.seq_len / results['step_ms'] * 1e3:,.0f} "
          "tokens/s")

  # 4. Save, restore into a fresh model, compare logits.
  ckpt = qlayers.checkpoint.save(out / "checkpoint", model,
                                 optimizer=optimizer, overwrite=True)
  fresh = llama.Llama(config, rngs=nnx.Rngs(cfg.seed + 1))
  qlayers.quantize(fresh, cfg.recipe)
  fresh_opt = qlayers.Optimizer(fresh, make_tx(cfg))
  meta = qlayers.checkpoint.restore(ckpt, fresh, optimizer=fresh_opt)
  probe = np.asarray(valid_ids[:cfg.seq_len])[None]
  a, b = logits(model, probe), logits(fresh, probe)
  results["restore"] = {
      "path": str(ckpt), "restored": meta["restored"],
      "identical_logits": bool(np.array_equal(a, b)),
      "max_abs_diff": float(np.max(np.abs(a - b))),
      "optimizer_step": int(fresh_opt.step[...]),
  }
  print(f"saved to {ckpt}; restored ({meta['restored']}) into a freshly "
        f"initialised, converted model: logits identical = "
        f"{results['restore']['identical_logits']} (max |diff| "
        f"{results['restore']['max_abs_diff']:.3g}), optimizer step "
        f"{results['restore']['optimizer_step']}")
  if not results["restore"]["identical_logits"]:
    raise RuntimeError("the restored model's logits differ")
  lap("checkpoint")

  # 5. Generate with the restored model.
  results["sample"] = continuation(fresh, tokenizer, cfg)
  print(f"--- sample (temperature {cfg.temperature}) ---\n{results['sample']}")
  lap("generate")
  print("seconds: " + ", ".join(f"{k} {v}" for k, v in timings.items()))
  cli.write_json(cfg.json, results)
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
