"""Reading a GGUF file: metadata, FP32 tensors, and its byte-level BPE tokenizer.

GGUF (llama.cpp's format) keeps hyperparameters and the tokenizer as
key/value metadata and the weights as (often block-quantized) tensors. The
``gguf`` package parses the file; ``gguf.quants.dequantize`` turns Q4_1,
Q8_0, ... blocks back into float32. Dequantized matrices come out in
PyTorch's ``[out_features, in_features]`` order.
"""

import pathlib

import gguf
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

# llama.cpp token types: 1 normal, 3 control (special), 4 user-defined.
_SPECIAL_TOKEN_TYPES = (3, 4)


class GGUFFile:
  """A GGUF file's metadata and tensors.

  Args:
    path: the ``.gguf`` file. Opening maps it into memory; tensors are
      dequantized only when asked for.
  """

  def __init__(self, path: str | pathlib.Path):
    self.path = pathlib.Path(path)
    self._reader = gguf.GGUFReader(self.path)
    self._tensors = {t.name: t for t in self._reader.tensors}

  def metadata(self, key: str):
    """The value stored under ``key`` (str, number, bool or list)."""
    field = self._reader.fields.get(key)
    if field is None:
      raise KeyError(f"{self.path.name} has no metadata key {key!r}")
    return field.contents()

  def tensor_names(self) -> list[str]:
    return list(self._tensors)

  def tensor(self, name: str) -> np.ndarray:
    """Tensor ``name`` dequantized to float32, in ``[out, in]`` order."""
    t = self._tensors.get(name)
    if t is None:
      raise KeyError(f"{self.path.name} has no tensor {name!r}")
    array = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.ascontiguousarray(array, dtype=np.float32)

  def tokenizer(self) -> Tokenizer:
    """The file's GPT-2 style byte-level BPE as a ``tokenizers.Tokenizer``.

    Supports ``tokenizer.ggml.model == "gpt2"`` with the ``smollm`` (also
    ``gpt2``) pre-tokenizer: digits split one by one, then the GPT-2 regex.
    Control tokens (``<|im_start|>`` ...) are special: matched whole in the
    input and skipped by ``decode`` unless ``skip_special_tokens=False``. No
    BOS is added (``tokenizer.ggml.add_bos_token`` is false for SmolLM2).
    """
    kind, pre = self.metadata("tokenizer.ggml.model"), self.metadata(
        "tokenizer.ggml.pre"
    )
    if kind != "gpt2" or pre not in ("smollm", "gpt2"):
      raise NotImplementedError(
          f"tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported;"
          " only gpt2-style BPE with the 'smollm' or 'gpt2' pre-tokenizer"
      )
    tokens = self.metadata("tokenizer.ggml.tokens")
    types = self.metadata("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ")) for m in self.metadata("tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    splits = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre == "smollm":
      splits.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [t for t, ty in zip(tokens, types) if ty in _SPECIAL_TOKEN_TYPES]
    )
    return tok
