"""Prompt continuation for the language-model families (GPT, RNN LM): text in, text out.

The model side is one compiled function per family with the signature of
`models.gpt.generate` (left-padded prompt ids -> new ids and lengths); this module encodes the
prompts, applies the `config.decode` settings, decodes the outputs and writes samples.json.
"""
from __future__ import annotations

import json
import os
from typing import Callable

import jax
import numpy as np

import storage
from models import decoding


def continue_prompts(generate: Callable, model, tokenizer, prompts: list[str], decode_config, *, seed: int,
                     max_len: int | None = None) -> list[str]:
  """Continuations of `prompts` (text after each prompt, without EOS).

  `max_len` (the model's positions, None for recurrent models) bounds prompt + new tokens: the new
  tokens come first and the prompt keeps its last tokens.
  """
  encoded = [tokenizer.encode(p) or [tokenizer.eos_id] for p in prompts]
  max_new = int(decode_config.max_new_tokens)
  prompt_len = max(len(e) for e in encoded)
  if max_len is not None:
    max_new = min(max_new, max_len - 1)
    prompt_len = min(prompt_len, max_len - max_new)
  tokens, valid = decoding.left_pad(encoded, tokenizer.pad_id, prompt_len)
  out, lengths = generate(model, tokens, valid, jax.random.key(seed), max_new_tokens=max_new,
                          temperature=float(decode_config.temperature), top_k=int(decode_config.top_k),
                          top_p=float(decode_config.top_p), eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
  out, lengths = np.asarray(out), np.asarray(lengths)
  return [tokenizer.decode(row[:n][row[:n] != tokenizer.eos_id]) for row, n in zip(out, lengths)]


def max_new_tokens_note(decode_config, max_len: int | None) -> str | None:
  """A note when `decode.max_new_tokens` does not fit the model's window and `continue_prompts` cuts it."""
  asked = int(decode_config.max_new_tokens)
  if max_len is None or asked <= max_len - 1:
    return None
  return (f'decode.max_new_tokens={asked} does not fit the model\'s window: each input gets at most {max_len - 1} '
          f'new tokens (model.max_len={max_len} positions, one of them for the prompt).')


def prompt_truncation_notes(tokenizer, prompts: list[str], decode_config, max_len: int) -> list[str]:
  """Notes for what `continue_prompts` cuts to fit max_len positions: decode.max_new_tokens, and
  the prompts it shortens to make room for the new tokens."""
  room = max_len - min(int(decode_config.max_new_tokens), max_len - 1)
  notes = [note for note in [max_new_tokens_note(decode_config, max_len)] if note]
  for number, prompt in enumerate(prompts, 1):
    length = len(tokenizer.encode(prompt))
    if length > room:
      notes.append(f'input {number} has {length} tokens; the model read only its last {room} (model.max_len='
                   f'{max_len} positions minus decode.max_new_tokens).')
  return notes


def prompt_list(decode_config) -> list[str]:
  """The '|'-separated `decode.prompts` the end of a run continues."""
  return [p for p in decode_config.prompts.split('|') if p]


def sample_prompts(generate: Callable, model, tokenizer, decode_config, workdir: str, *, seed: int,
                   max_len: int | None = None) -> list[str]:
  """Continue the '|'-separated `decode.prompts`, print them and write `workdir/samples.json`."""
  prompts = prompt_list(decode_config)
  if not prompts:
    return []
  note = max_new_tokens_note(decode_config, max_len)
  if note:
    print(f'note: {note}', flush=True)
  samples = continue_prompts(generate, model, tokenizer, prompts, decode_config, seed=seed, max_len=max_len)
  with storage.path(os.path.join(workdir, 'samples.json')).open('w') as f:
    json.dump([{'prompt': p, 'continuation': s} for p, s in zip(prompts, samples)], f, indent=1)
  for prompt, sample in zip(prompts, samples):
    print(f'--- prompt: {prompt!r}\n{prompt}{sample}\n', flush=True)
  return samples
