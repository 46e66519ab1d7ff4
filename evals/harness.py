"""A decoder run as a model of EleutherAI's lm-evaluation-harness (`lm-eval`), registered as
'attention_lineage' (the harness's `register_model`):

  import lm_eval
  from evals import harness   # registers the model name
  lm_eval.simple_evaluate(model='attention_lineage', model_args={'workdir': 'runs/gpt-default-...'},
                          tasks=['python_choice'], task_manager=harness.task_manager())

or `python launch.py --mode=lm_eval --workdir=RUN --tasks=A,B` (evals/runner.py). Any run of the
GPT family (GPT-2 and Llama-style decoders, trained here or imported) is a model; other families
are refused.

The harness's three requests, as its Hugging Face backend (`lm_eval.models.huggingface.HFLM`)
computes them, so that the same weights score the same (tests/test_lm_eval.py):
  loglikelihood          (context, continuation) -> (log p(continuation | context), is it the greedy
                         continuation); context + continuation longer than max_len + 1 tokens keeps
                         its last ones (left truncation).
  loglikelihood_rolling  (text,) -> log p(text) from its first token, in disjoint windows of max_len
                         tokens that each read as much of the text before them as fits (the harness's
                         `get_rolling_token_windows` and `make_disjoint_window`), the first after BOS.
  generate_until         (context, generation kwargs) -> the continuation up to the first stop string
                         (`until`, and EOS), at most `max_gen_toks` tokens, from the last max_len -
                         max_gen_toks tokens of the context; greedy unless the kwargs sample.
Text is read with the tokenizer's own special tokens (`Tokenizer.encode(..., special_tokens=True)`,
as Hugging Face tokenizers do); BOS (else EOS) stands before text scored from its start.

Compiled shapes. Requests are sorted by length and batched `batch_size` at a time; each batch is
padded to a bucket: its length to the next power of two from MIN_BUCKET (at most max_len), its
rows to the next power of two (at most batch_size). So a task compiles a few programs, however
many lengths its requests have. Generation runs `models.gpt.generate` (the KV cache,
`models/decoding.py`): its loop stops when every row has emitted EOS or `max_gen_toks` tokens,
and the stop strings cut the text afterwards (they are strings, which the compiled loop does not see).
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from lm_eval import utils as harness_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.tasks import TaskManager
from tqdm import tqdm

from errors import UserError
from models import decoding
from models import gpt as gpt_model
from models.lm_head import cross_entropy_parts, is_argmax
from train.rundir import Run, load_run, read_config

MODEL_NAME = 'attention_lineage'
TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tasks')  # the repository's task YAMLs
DECODER_FAMILIES = ('gpt',)  # the families whose runs are left-to-right language models
MIN_BUCKET = 16  # the shortest padded length: shorter requests share one program


class HarnessError(UserError):
  """A run or a request the harness model cannot score (another family, a window too small)."""


def check_decoder(family: str, workdir: str) -> None:
  if family not in DECODER_FAMILIES:
    raise HarnessError(f'{workdir} is a {family!r} run; lm-eval scores decoder language models, runs of the '
                       f'families {DECODER_FAMILIES}: pass the --workdir of one of those.')


def task_manager(include_path: str | list[str] | None = None, include_defaults: bool = False) -> TaskManager:
  """The harness's TaskManager over evals/tasks/ and `include_path`, and over the harness's own
  tasks with `include_defaults` (indexing those thousands of YAML files takes seconds)."""
  extra = [include_path] if isinstance(include_path, str) else list(include_path or [])
  return TaskManager(include_path=[TASKS_DIR, *extra], include_defaults=include_defaults)


def bucket(count: int, limit: int, smallest: int = 1) -> int:
  """The padded size of `count` (tokens or rows): the next power of two from `smallest`, at most `limit`."""
  return min(limit, max(smallest, 1 << (count - 1).bit_length()))


@nnx.jit
def token_scores(model: gpt_model.GPT, tokens: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  """tokens [B, L] ids, targets [B, L] the id after each -> ([B, L] float32 log-probability of each
  target, [B, L] bool: the target is the argmax). One row's [L, V'] logits exist at a time."""
  hidden, _ = model(tokens, return_hidden=True)
  head = model.output_embedding().T

  def score_row(row):
    row_hidden, row_targets = row
    logits = model.logits(row_hidden, head)
    _, log_normalizer, target_logit, top = cross_entropy_parts(logits, row_targets, 0.0, None)
    return target_logit - log_normalizer, is_argmax(logits, row_targets, target_logit, top)

  return jax.lax.map(score_row, (hidden, targets))


def requests_per_batch(batch_size: int | str | None) -> int:
  """The harness's `batch_size` (None: 1) as a whole number >= 1; HarnessError for anything else ('auto')."""
  if batch_size is None:
    return 1
  if not str(batch_size).isdigit() or int(batch_size) < 1:
    raise HarnessError(f'batch_size={batch_size!r}: give a whole number of requests per batch, at least 1.')
  return int(batch_size)


def padded_rows(rows: list[list[int]], length: int, count: int, pad_id: int) -> np.ndarray:
  """[count, length] int32: `rows` right-padded with pad_id, then rows of pad_id."""
  out = np.full((count, length), pad_id, np.int32)
  for i, row in enumerate(rows):
    out[i, :len(row)] = row
  return out


@register_model(MODEL_NAME)
class RunLM(TemplateLM):
  """The harness's model of a decoder run: `RunLM(workdir)` (as `model_args={'workdir': ...}`), or
  `RunLM(run=load_run(...))` for a run already loaded. `batch_size`: requests per compiled batch;
  `max_gen_toks`: generation's limit when a task sets none (the harness's default);
  `config_overrides`: `load_run`'s, for a workdir."""

  def __init__(self, workdir: str | None = None, *, run: Run | None = None, batch_size: int | str | None = 1,
               max_gen_toks: int = 256, config_overrides: dict | None = None, max_batch_size: int | None = None,
               device: str | None = None):
    super().__init__()
    del max_batch_size, device  # the harness passes its settings for torch; JAX places arrays itself
    if (workdir is None) == (run is None):
      raise HarnessError('The lm-eval model needs a run: model_args={"workdir": RUN} (or RunLM(run=...)).')
    if workdir is not None:
      check_decoder(read_config(workdir).family, workdir)
      run = load_run(workdir, config_overrides=config_overrides)
    check_decoder(run.config.family, run.workdir)
    self.run, self.batch_size, self._max_gen_toks = run, requests_per_batch(batch_size), int(max_gen_toks)
    tokenizer = run.tokenizer
    if tokenizer.bos_id is None and tokenizer.eos_id is None:
      raise HarnessError(f"{run.workdir}'s tokenizer has neither a BOS nor an EOS token, which the harness puts "
                         f'before text scored from its start.')
    self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else self.prefix_token_id

  # ------------------------------------------------------------------ the tokenizer, as the harness reads it
  @property
  def eot_token_id(self) -> int | None:
    return self.run.tokenizer.eos_id

  @property
  def prefix_token_id(self) -> int:
    """What text scored from its start is conditioned on: BOS, else EOS (as HFLM)."""
    tokenizer = self.run.tokenizer
    return tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id

  @property
  def max_length(self) -> int:
    return self.run.model_config.max_len

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    """The ids of `string` with the tokenizer's special tokens (None: unless it starts with BOS's text)."""
    if add_special_tokens is None:
      bos = self.run.tokenizer.id_to_token(self.prefix_token_id)
      add_special_tokens = not string.startswith(bos)
    return self.run.tokenizer.encode(string, special_tokens=add_special_tokens)

  def tok_decode(self, tokens: list[int]) -> str:
    return self.run.tokenizer.decode(tokens)

  def get_model_info(self) -> dict[str, Any]:
    """What the harness records in its results JSON under 'config'."""
    return {'workdir': self.run.workdir, 'step': self.run.step, 'family': self.run.config.family,
            'max_length': self.max_length}

  # ------------------------------------------------------------------ the three requests
  def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                            disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
    """(log p(continuation | context), greedy) of each (cache key, context ids, continuation ids)."""
    for _, _, continuation in requests:
      if len(continuation) > self.max_length:
        raise HarnessError(f'A continuation of {len(continuation)} tokens does not fit the model\'s window of '
                           f'{self.max_length} (model.max_len).')
    windows = [(context + continuation)[-(self.max_length + 1):] for _, context, continuation in requests]
    order = Collator(list(range(len(requests))), sort_fn=lambda i: (-len(windows[i]), i))
    answers = []
    for batch in tqdm(order.get_batched(n=self.batch_size), disable=disable_tqdm, desc='loglikelihood batches'):
      length = bucket(len(windows[batch[0]]) - 1, self.max_length, MIN_BUCKET)
      count = bucket(len(batch), self.batch_size)
      tokens = padded_rows([windows[i][:-1] for i in batch], length, count, self.pad_id)
      targets = padded_rows([windows[i][1:] for i in batch], length, count, self.pad_id)
      logprobs, greedy = map(np.asarray, token_scores(self.run.model, tokens, targets))
      for row, i in enumerate(batch):
        end, scored = len(windows[i]) - 1, len(requests[i][2])
        answer = (float(np.sum(logprobs[row, end - scored:end], dtype=np.float64)),
                  bool(np.all(greedy[row, end - scored:end])))
        answers.append(answer)
        if requests[i][0] is not None:  # rolling windows are cached per text (loglikelihood_rolling)
          self.cache_hook.add_partial('loglikelihood', requests[i][0], answer)
    return order.get_original(answers)

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """log p(text) of each (text,): the sum over its disjoint windows (module docstring)."""
    windows, owners = [], []
    for index, (text,) in enumerate(request.args for request in requests):
      for context, continuation in map(harness_utils.make_disjoint_window, harness_utils.get_rolling_token_windows(
          token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
          context_len=1)):
        windows.append((None, context, continuation))
        owners.append(index)
    totals = [0.0] * len(requests)
    for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
      totals[owner] += logprob
    for request, total in zip(requests, totals):
      self.cache_hook.add_partial('loglikelihood_rolling', request.args, total)
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """The continuation of each (context, generation kwargs), cut at its stop strings."""
    order = Collator([request.args for request in requests], sort_fn=lambda args: (-len(self.tok_encode(args[0])),
                                                                                   args[0]),
                     group_by='gen_kwargs', group_fn=lambda args: args[1])
    eos = None if self.eot_token_id is None else self.run.tokenizer.id_to_token(self.eot_token_id)
    texts = []
    for batch in tqdm(order.get_batched(n=self.batch_size), disable=disable_tqdm, desc='generate_until batches'):
      contexts, all_kwargs = zip(*batch)
      kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
      until = handle_stop_sequences(kwargs.pop('until', None), eos=eos)
      for context, continuation in zip(contexts, self._generate(list(contexts), kwargs)):
        text = postprocess_generated_text(continuation, until, None)
        texts.append(text)
        self.cache_hook.add_partial('generate_until', (context, all_kwargs[0]), text)
    return order.get_original(texts)

  def _generate(self, contexts: list[str], kwargs: dict) -> list[str]:
    """Decoded continuations of `contexts` (EOS and what follows dropped) under normalized generation kwargs."""
    new_tokens = kwargs['max_gen_toks']
    room = self.max_length - new_tokens  # the context's last tokens that fit beside the new ones
    if room < 1:
      raise HarnessError(f'max_gen_toks={new_tokens} leaves no room for the context in the model\'s window of '
                         f'{self.max_length} tokens (model.max_len); lower max_gen_toks in the task.')
    encoded = [self.tok_encode(context)[-room:] or [self.prefix_token_id] for context in contexts]
    count = bucket(len(encoded), self.batch_size)
    prompts = encoded + [encoded[0]] * (count - len(encoded))  # filler rows, discarded
    tokens, valid = decoding.left_pad(prompts, self.pad_id, bucket(max(map(len, encoded)), room, MIN_BUCKET))
    sampling = bool(kwargs.get('do_sample'))
    out, lengths = gpt_model.generate(
        self.run.model, tokens, valid, jax.random.key(0), max_new_tokens=new_tokens,
        temperature=float(kwargs.get('temperature', 1.0)) if sampling else 0.0,
        top_k=int(kwargs.get('top_k') or 0) if sampling else 0,
        top_p=float(kwargs.get('top_p') or 1.0) if sampling else 1.0, eos_id=self.eot_token_id, pad_id=self.pad_id)
    out, lengths = np.asarray(out), np.asarray(lengths)
    eot = self.eot_token_id
    return [self.tok_decode([t for t in row[:n] if t != eot]) for row, n in zip(out[:len(contexts)], lengths)]
