"""Held-out bits per byte of a trained GPT run: a number two runs with different tokenizers (or
the same) compare on, the text's bytes being the unit instead of tokens.

  python scripts/bits_per_byte.py runs/q-llama runs/q-gpt2 [--batch_size=8]

For each run: the run's test split, read from its token cache (data/lm.py, as the final evaluation
reads it; built when missing, with the run's tokenizer), is cut into the windows the trainer
scores, the model's mean next-token cross-entropy over them is taken in nats, and bits per byte =
mean nats per token * (tokens / UTF-8 bytes of the split) / ln 2, where the ratio counts every
token of the split (one EOS per document, one byte for it) against every byte (the cache's counts:
no text is read again). Prints one JSON line per run.
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

  from data.lm import lm_streams
  from data.token_cache import Windows
  from train.rundir import load_run
  from train.losses import lm_loss
  run = load_run(workdir)
  _, streams, _ = lm_streams(run.config.data, workdir, run.config.seed)
  test = streams['test']
  windows = Windows(test, run.config.data.seq_len + 1, run.config.data.seq_len + 1)
  loss = nnx.jit(lambda model, tokens: lm_loss(model(tokens[:, :-1])[0], tokens[:, 1:],
                                               vocab_size=run.model.config.vocab_size)[0])
  batches = range(0, len(windows) - batch_size + 1, batch_size)  # whole batches: one compiled shape
  nats = float(np.mean([jax.device_get(loss(run.model, jnp.asarray(np.stack([windows[j]['tokens'] for j in
                                                                            range(i, i + batch_size)]))))
                        for i in batches]))
  text_bytes = test.cache.info('bytes', test.split) + test.documents
  return {'workdir': workdir, 'step': run.step, 'test_nats_per_token': round(nats, 4),
          'tokens_per_byte': round(len(test) / text_bytes, 4), 'windows_scored': len(batches) * batch_size,
          'bits_per_byte': round(nats * len(test) / text_bytes / math.log(2), 4)}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('workdirs', nargs='+')
  parser.add_argument('--batch_size', type=int, default=8)
  args = parser.parse_args()
  for workdir in args.workdirs:
    print(json.dumps(bits_per_byte(workdir, args.batch_size)), flush=True)


if __name__ == '__main__':
  main()
