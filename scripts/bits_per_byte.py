"""Held-out bits per byte of a trained GPT run: a number two runs with different tokenizers (or
the same) compare on, the text's bytes being the unit instead of tokens.

  python scripts/bits_per_byte.py runs/q-llama runs/q-gpt2 [--batch_size=8]

For each run: the run's test documents (data/lm.py's split, as the final evaluation uses) are
packed into the windows the trainer scores, the model's mean next-token cross-entropy over them is
taken in nats, and bits per byte = mean nats per token * (tokens / UTF-8 bytes of the split) / ln 2,
where the ratio counts every token of the split (one EOS per document, one byte for it) against
every byte. Prints one JSON line per run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bits_per_byte(workdir: str, batch_size: int) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from data.lm import pack, split_documents
  from train.rundir import load_run
  from train.losses import lm_loss
  run = load_run(workdir)
  _, _, test_docs = split_documents(run.config.data, run.config.seed)
  windows = pack(test_docs, run.tokenizer, run.config.data.seq_len)
  loss = nnx.jit(lambda model, tokens: lm_loss(model(tokens[:, :-1])[0], tokens[:, 1:],
                                               vocab_size=run.model.config.vocab_size)[0])
  batches = range(0, len(windows) - batch_size + 1, batch_size)  # whole batches: one compiled shape
  nats = float(np.mean([jax.device_get(loss(run.model, jnp.asarray(windows[i:i + batch_size]))) for i in batches]))
  tokens = sum(len(ids) + 1 for ids in run.tokenizer.encode_batch([text for _, text in test_docs]))
  text_bytes = sum(len(text.encode('utf-8')) + 1 for _, text in test_docs)
  return {'workdir': workdir, 'step': run.step, 'test_nats_per_token': round(nats, 4),
          'tokens_per_byte': round(tokens / text_bytes, 4), 'windows_scored': len(batches) * batch_size,
          'bits_per_byte': round(nats * tokens / text_bytes / math.log(2), 4)}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('workdirs', nargs='+')
  parser.add_argument('--batch_size', type=int, default=8)
  args = parser.parse_args()
  for workdir in args.workdirs:
    print(json.dumps(bits_per_byte(workdir, args.batch_size)), flush=True)


if __name__ == '__main__':
  main()
