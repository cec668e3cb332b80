"""Checks the pretrained example models and prints what they score.

  python examples/check_pretrained.py [--tokens 4096]

SmolLM2-135M-Instruct: load time, perplexity on validation Shakespeare, and a
greedy answer to a chat question. all-MiniLM-L6-v2: load time and cosine
similarities of a few sentence pairs. Runs on CPU in about a minute.
"""

import argparse
import time

import numpy as np

from _common import bert, llama, shakespeare


def check_smollm2(n_tokens: int, seq_len: int):
  start = time.perf_counter()
  model, tokenizer, config = llama.load_smollm2()
  print(f"SmolLM2 loaded in {time.perf_counter() - start:.1f} s: {config}")
  ids = tokenizer.encode(shakespeare.load_text("valid")).ids[:n_tokens + 1]
  start = time.perf_counter()
  ppl = llama.perplexity(model, ids, seq_len=seq_len)
  print(f"perplexity on {len(ids) - 1} validation tokens (windows of"
        f" {seq_len}): {ppl:.2f} ({time.perf_counter() - start:.1f} s)")
  for question in ("What is the capital of France?",
                   "Name three colours of the rainbow."):
    prompt = tokenizer.encode(llama.chat_prompt(question)).ids
    start = time.perf_counter()
    out = llama.generate(model, prompt, max_new_tokens=48, temperature=0,
                         stop_token=tokenizer.token_to_id("<|im_end|>"))
    answer = tokenizer.decode(out[len(prompt):].tolist())
    print(f"Q: {question}\nA: {answer!r} ({time.perf_counter() - start:.1f} s)")


PAIRS = (
    ("A man is eating food.", "A man is eating a piece of bread."),
    ("A man is eating food.", "The girl is carrying a baby."),
    ("A man is riding a horse.",
     "A man is riding a white horse on an enclosed ground."),
    ("A man is riding a horse.", "A monkey is playing drums."),
)


def check_minilm():
  start = time.perf_counter()
  model, tokenizer, _ = bert.load_minilm()
  print(f"MiniLM loaded in {time.perf_counter() - start:.1f} s")
  for a, b in PAIRS:
    e = bert.sentence_embeddings(model, tokenizer, [a, b])
    print(f"cos = {float(np.dot(e[0], e[1])):+.4f}  {a!r} vs {b!r}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--seq-len", type=int, default=512)
  args = parser.parse_args()
  check_minilm()
  check_smollm2(args.tokens, args.seq_len)


if __name__ == "__main__":
  main()
