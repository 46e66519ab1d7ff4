"""A bounded final evaluation and a bounded carved split (issue 54).

The final evaluation scores train.final_eval_examples of the validation split (translation decodes
train.final_decode_examples test pairs), evenly spaced through a larger split: checked against the
examples picked here by hand, and --mode=eval gives the result line's digits. A split carved out of
data.source is its family's share but at most sources.HELD_OUT_BYTES of the text, in every family,
while a small source (every built-in one) keeps its share (tests/test_heldout_sizes.py: the floor)."""
import json
import os
import re

import grain
import jax
import numpy as np
import pytest

import support
from configs.base import base_config
from data import batching, bert_data, classification, lm, sources, token_cache, translation
from errors import ConfigError
from train import evaluation, sharding
from train.metrics import reduce_metrics
from train.trainer import evaluate_run, restored_setup, train_and_evaluate
from train.validation import validate_config

WORDS = 'alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho'.split()


def test_a_bound_picks_evenly_spaced_examples_and_all_of_a_split_it_holds():
  assert list(evaluation.final_indices(10, 4)) == [0, 2, 5, 7]  # i * 10 // 4
  assert list(evaluation.final_indices(7, 7)) == list(range(7)) == list(evaluation.final_indices(7, 0))
  picked = list(evaluation.final_indices(186_641, 50_000))
  assert len(set(picked)) == 50_000 and picked == sorted(picked) and picked[-1] >= 186_641 - 4
  examples = grain.MapDataset.source([{'x': np.int32(i)} for i in range(10)])
  assert evaluation.final_subset(examples, 10) is examples and evaluation.final_subset(examples, 0) is examples
  assert [int(e['x']) for e in evaluation.final_subset(examples, 4)] == [0, 2, 5, 7]


def test_a_negative_bound_is_one_config_error():
  config = support.smallest_config('gpt', {'train.final_decode_examples': -1})
  with pytest.raises(ConfigError, match=r'^config.train.final_decode_examples=-1 must be >= 0.$'):
    validate_config(config, num_devices=1)


# ----------------------------------------------------------------------------- carved splits
def sentence(rng) -> str:
  return ' '.join(rng.choice(WORDS, rng.integers(3, 8))).capitalize() + '.'


def data_config(tmp_path, **values):
  config = base_config('test').data
  config.documents = 'auto'
  config.update({'cache_dir': str(tmp_path / 'cache'), **values})
  return config


def planned(family: str, tmp_path):
  """(the Carve, {split: origin}, {split: bytes of text read}, the source's bytes) of 300-500 KB
  of text carved as `family` carves data.source."""
  rng = np.random.default_rng(0)
  size, config = 32 << 20, data_config(tmp_path)
  if family in ('lm: files', 'lm: one file'):
    folder = tmp_path / 'corpus'
    folder.mkdir()
    for number in range(400 if family == 'lm: files' else 1):
      (folder / f'{number:03d}.txt').write_text(
          ''.join(sentence(rng) + '\n' for _ in range(25 if family == 'lm: files' else 10_000)))
    written = list(folder.iterdir())
    corpus, carve, origins = lm.plan_corpus(f'text:{folder}/*.txt', True, 0, 'train', size)
    processor, text = lm.Tokens(), lambda record: record[0]
  elif family == 'bert':
    path = tmp_path / 'corpus.txt'
    path.write_text('\n\n'.join(' '.join(sentence(rng) for _ in range(12)) for _ in range(1000)) + '\n')
    written = [path]
    corpus, carve, origins, blank_lines = bert_data.plan_source(f'text:{path}', 'train', config, size)
    processor, text = bert_data.Documents(config, 0, blank_lines), lambda record: record
  else:
    path = tmp_path / 'corpus.tsv'
    path.write_text(''.join(f'{sentence(rng)}\t{sentence(rng) if family == "translation" else "red"}\n'
                            for _ in range(10_000)))
    written = [path]
    if family == 'translation':
      corpus, carve, origins = translation.plan_source(f'tsv:{path}', 'train', ('valid', 'test'), config, 0, size)
      processor, text = translation.Pairs(config, 0), lambda record: '\t'.join(record)
    else:
      corpus, carve, origins = classification.plan_source(f'tsv:{path}', 'train', ('valid', 'test'), config, size)
      processor, text = classification.Labelled(config), lambda record: record[1].text
  read = {split: sum(len(text(record).encode()) for record in token_cache.records(corpus, processor, carve, split))
          for split in ('train', 'valid', 'test')}
  return carve, origins, read, sum(os.path.getsize(path) for path in written)


@pytest.mark.parametrize('family', ['lm: files', 'lm: one file', 'bert', 'translation', 'classification'])
def test_a_carved_split_holds_at_most_about_held_out_bytes_in_every_family(family, tmp_path, monkeypatch):
  monkeypatch.setattr(sources, "HELD_OUT_BYTES", 4096)  # ~1% of the ~300-500 KB source, where 5-10% is its share
  carve, origins, read, source_bytes = planned(family, tmp_path)
  total = sum(read.values())
  assert 200_000 < total < 600_000
  for role in carve.held_out:
    assert 0.4 * 4096 < read[role] < 2.5 * 4096, (role, read)
    if family.startswith('lm'):  # files listed when planned: held out by size, at most the cap exactly
      held = sources.percent(read[role] / source_bytes)
      assert read[role] <= 4096 and origins[role].endswith(f', {held} of the text')
    else:  # records dealt as read: the share cut to the cap's
      share = dict(carve.fractions)[role]
      assert share == 4096 / source_bytes and origins[role].endswith(f'{sources.percent(share)} hash split')
  assert read['train'] > 0.95 * total


def test_a_source_below_the_cap_keeps_its_carve_and_so_its_cache():
  fractions = (('train', 0.8), ('valid', 0.1), ('test', 0.1))
  assert sources.carve_out(fractions, ('valid', 'test'), 20 << 20) == sources.Carve(fractions=fractions,
                                                                                     held_out=('valid', 'test'))
  assert sources.carve_out(fractions, ('valid',), 20 << 20, 3) == sources.Carve(fractions=fractions, held_out=('valid',),
                                                                                 seed=3)
  _, carve, origins = lm.plan_corpus('pystdlib', True, 0, 'train', 32 << 20)  # the built-in LM corpus
  assert carve == sources.Carve(fractions=(('train', 0.95), ('valid', 0.05)), held_out=('valid',))
  # Its files in hash order until they hold its 5% of the text (well under the cap), none cut.
  assert re.fullmatch(r'pystdlib, \d+ documents by hash, 5\.\d+% of the text', origins['valid']), origins['valid']


# ----------------------------------------------------------------------------- the final evaluation
def scored_by_hand(setup, state, indices) -> dict[str, float]:
  """The eval/... of the validation examples `indices`, batched and scored here."""
  examples = setup.task.prepared.datasets.eval
  picked = grain.MapDataset.source([examples[i] for i in indices])
  total = None
  with sharding.use_mesh(setup.mesh):
    for batch in batching.padded_batches(picked, setup.task.eval_batch_size):
      metrics = jax.device_get(setup.eval_step(state.params, state.frozen, state.extra,
                                               sharding.global_batch(batch, setup.mesh)))
      metrics = {k: (np.float64(s), np.float64(c)) for k, (s, c) in metrics.items()}  # summed in float64
      total = {k: [total[k][0] + s, total[k][1] + c] if total else [s, c] for k, (s, c) in metrics.items()}
  return setup.task.summarize({f'eval/{k}': v for k, v in reduce_metrics(total).items()})


def test_the_final_evaluation_scores_its_bound_and_mode_eval_repeats_the_digits(tmp_path, capsys):
  # One block: the examples scored and their digits do not depend on the depth (tests/test_run_layout.py's
  # restored GPT trains the same programs).
  config = support.smallest_config('gpt', {
      'data.source': support.write_corpus(str(tmp_path / 'corpus'), files=40, lines=200),
      'data.cache_dir': str(tmp_path / 'cache'), 'train.steps': 2, 'train.eval_every': 2, 'model.num_layers': 1,
      'train.checkpoint_every': 2, 'train.eval_steps': 1, 'train.final_eval_examples': 40})
  workdir = str(tmp_path / 'run')
  trained = train_and_evaluate(config, workdir)
  setup, state, _ = restored_setup(workdir)
  total = len(setup.task.prepared.datasets.eval)
  assert total > 100  # a carved split larger than the bound
  picked = [i * total // 40 for i in range(40)]
  expected = scored_by_hand(setup, state, picked)
  assert {k: trained[k] for k in expected} == expected
  whole = scored_by_hand(setup, state, range(total))
  assert whole['eval/loss'] != expected['eval/loss']
  lines = capsys.readouterr().out.splitlines()
  assert f'Each evaluation during training scores 8 of the {total} validation examples (train.eval_steps=1; 0 = all).' \
      in lines
  assert (f'The final evaluation will score 40 of the {total} validation examples (train.final_eval_examples=40; '
          f'0 = all; a larger split evenly spaced), timed at the first evaluation.') in lines
  assert any(line.startswith('The final evaluation should take about ') and ' to score 40 examples at this ' in line
             for line in lines), lines
  assert any(line.startswith(f'Final evaluation, 40 of the {total} validation examples: eval/') for line in lines)
  assert {k: v for k, v in evaluate_run(workdir).items() if k.startswith('eval/')} == expected  # the same digits
  everything = evaluate_run(workdir, {'train.final_eval_examples': 0})  # the whole split on request
  assert {k: v for k, v in everything.items() if k.startswith('eval/')} == whole


def test_translation_decodes_its_bound_of_the_test_split(tmp_path):
  config = support.smallest_config('seq2seq', {
      'data.cache_dir': str(tmp_path / 'cache'), 'train.steps': 2, 'train.eval_every': 2, 'train.checkpoint_every': 2,
      'train.eval_steps': 1, 'train.final_decode_examples': 10, 'train.final_eval_examples': 30})
  workdir = str(tmp_path / 'run')
  trained = train_and_evaluate(config, workdir)
  setup, _, _ = restored_setup(workdir)
  test_pairs = setup.task.prepared.family_data
  total = len(setup.task.prepared.datasets.test)
  assert total == 100
  with open(os.path.join(workdir, 'translations.json')) as f:
    translations = json.load(f)
  assert [t['source'] for t in translations] == [test_pairs[i * total // 10][0] for i in range(10)]
  exact = sum(t['greedy'] == t['reference'] for t in translations)
  assert trained['test/exact_match_greedy'] == exact / 10
  numbers = lambda results: {k: v for k, v in results.items() if isinstance(v, float) and '/' in k}
  assert numbers(evaluate_run(workdir)) == numbers(trained)
