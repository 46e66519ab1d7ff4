"""BERT pretraining caches (data/bert_data.py, cached_pretraining_examples): a corpus that fits one
shard gives exactly the in-memory examples (split lines and tokenizer sample included) for text
files of both document layouts and for TFDS; several shards build alone, random next sentences
never leave their shard and NSP stays 50/50; a second run tokenizes and scans nothing; a damaged
shard is one DataError line."""
import os

import numpy as np
import pytest

from configs import bert
from data import bert_data, lm, sources, tokenizers
from data.sources import DataError

SEED = 3


def data_config(source, cache_dir, **overrides):
  """The tiny preset's data on `source`, cached under `cache_dir`, every pair kept."""
  config = bert.get_config('tiny').data
  config.update({'source': source, 'cache_dir': str(cache_dir), 'max_examples': 0, 'dupe_factor': 2, **overrides})
  return config


def documents(count, seed=0, words=None):
  """`count` documents of 2-8 capitalised sentences over `words`, each split over two lines."""
  rng = np.random.default_rng(seed)
  words = words or 'alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho'.split()
  texts = []
  for _ in range(count):
    sentences = [' '.join(rng.choice(words, rng.integers(3, 12))).capitalize() + '.' for _ in range(rng.integers(2, 9))]
    half = len(sentences) // 2
    texts.append(' '.join(sentences[:half]) + '\n' + ' '.join(sentences[half:]))
  return texts


def write_files(directory, texts) -> str:
  os.makedirs(directory, exist_ok=True)
  for i, text in enumerate(texts):
    with open(os.path.join(directory, f'doc{i:03d}.txt'), 'w') as f:
      f.write(text)
  return f'text:{directory}/*.txt'


def rows(examples) -> dict[str, np.ndarray]:
  """A CachedExamples split stacked: {field: [N, ...]}."""
  items = [examples[i] for i in range(len(examples))]
  return {field: np.stack([item[field] for item in items]) for field in bert_data.FIELDS}


def split_lines(capsys) -> list[str]:
  return [line for line in capsys.readouterr().out.splitlines() if ' split: ' in line]


@pytest.mark.parametrize('layout', ['blank_line', 'file', 'tfds'])
def test_one_shard_is_the_in_memory_path(tmp_path, monkeypatch, capsys, layout):
  texts = documents(120)
  if layout == 'blank_line':  # one file: documents between blank lines (a CRLF one and a BOM too)
    path = tmp_path / 'corpus.txt'
    path.write_bytes(('\ufeff' + '\n\n'.join(texts[:60]) + '\r\n \r\n' + '\n\n\n'.join(texts[60:])).encode())
    source = f'text:{path}'
  elif layout == 'file':
    source = write_files(tmp_path / 'corpus', texts)
  else:
    records = [{'text': text.encode()} for text in texts]
    monkeypatch.setattr(sources, 'tfds_records', lambda name, split: records)
    source = 'tfds:fake'
  samples = []
  train_tokenizer = lm.train_tokenizer
  monkeypatch.setattr(lm, 'train_tokenizer', lambda kind, sample, *args: (
      samples.append(list(sample)), train_tokenizer(kind, samples[-1], *args))[1])
  config = data_config(source, tmp_path / 'cache', max_examples=300)
  tokenizer, examples, caches = bert_data.cached_pretraining_examples(config, str(tmp_path / 'run'), SEED)
  cached_lines = split_lines(capsys)

  train, valid, _ = bert_data.pretraining_documents(config)
  assert split_lines(capsys) == cached_lines and len(cached_lines) == 3
  assert samples == [train]  # the tokenizer was trained on the in-memory path's sample
  assert caches['train'] == caches['valid'] and caches['train'].startswith('bert-')  # one cache, both splits
  for split, texts_, dupe, seed in (('train', train, 2, SEED), ('valid', valid, 1, SEED + 1)):
    expected = bert_data.pretraining_examples(bert_data.tokenize_documents(texts_, tokenizer), tokenizer,
                                              config.seq_len, dupe_factor=dupe, short_seq_prob=config.short_seq_prob,
                                              seed=seed, max_examples=300)
    got = rows(examples[split])
    for field in bert_data.FIELDS:
      assert got[field].dtype == expected[field].dtype
      np.testing.assert_array_equal(got[field], expected[field], err_msg=f'{split} {field}')


def unique_words(count, rng) -> list[str]:
  words = set()
  while len(words) < count:
    words.add(''.join(rng.choice(list('bcdfghjklmnpqrstvwxz'), 6)))
  return sorted(words)


def test_shards_pair_their_own_documents(tmp_path):
  """~2 KB shards of 60 one-file documents, each with words of its own: every pair's A is one
  document, B the next sentences of it or (random) another document of the same shard."""
  rng = np.random.default_rng(0)
  vocabulary = unique_words(60 * 5, rng)
  texts = [documents(1, seed=d, words=vocabulary[5 * d:5 * d + 5])[0] for d in range(60)]
  source = write_files(tmp_path / 'corpus', texts)
  tokenizer = tokenizers.train_wordpiece(vocabulary * 2 + ['.'] * 2, vocab_size=3000)  # every word one id
  assert all(len(tokenizer.encode(word)) == 1 for word in vocabulary)
  config = data_config(source, tmp_path / 'cache', cache_shard_mb=0.002, dupe_factor=3)
  _, examples, caches = bert_data.cached_pretraining_examples(config, str(tmp_path / 'run'), SEED, tokenizer)
  plan = bert_data.plan_documents(source, 'train', ('valid', 'test'), config)
  shard_of = {os.path.basename(piece.where): (split, index) for split, shards in plan.shards.items()
              for index, shard in enumerate(shards) for piece in shard}
  assert len(plan.shards['train']) >= 4 and len(plan.shards['valid']) == 1
  document_of = {tokenizer.token_id(word): f'doc{i // 5:03d}.txt' for i, word in enumerate(vocabulary)}
  for split in ('train', 'valid'):
    got = rows(examples[split])
    labels = got['next_sentence']
    assert len(labels) > 50 or split == 'valid'
    for tokens, segments, valid, random_next in zip(got['tokens'], got['segments'], got['valid'], labels):
      side = lambda segment: {document_of[t] for t in tokens[valid & (segments == segment)] if t in document_of}
      (a,), b = side(0), side(1)
      if not b:  # B cut down to its full stop
        continue
      assert len(b) == 1 and shard_of[next(iter(b))] == shard_of[a], (a, b)  # never another shard's
      assert (a in b) != bool(random_next)
    if split == 'train':
      assert abs(labels.mean() - 0.5) < 0.08, labels.mean()
  cache = os.path.join(config.cache_dir, caches['train'])
  assert sorted(name for name in os.listdir(cache) if name.endswith('.train.tokens.npy')) == [
      f'{i:05d}.train.tokens.npy' for i in range(len(plan.shards['train']))]


def test_a_second_run_tokenizes_and_scans_nothing(tmp_path, monkeypatch):
  path = tmp_path / 'corpus.txt'
  path.write_text('\n\n'.join(documents(80)))
  config = data_config(f'text:{path}', tmp_path / 'cache', cache_shard_mb=0.005)
  calls = []
  encode_batch = tokenizers.HFTokenizer.encode_batch
  monkeypatch.setattr(tokenizers.HFTokenizer, 'encode_batch',
                      lambda self, texts: (calls.append(len(texts)), encode_batch(self, texts))[1])
  first = bert_data.cached_pretraining_examples(config, str(tmp_path / 'run1'), SEED)
  assert calls
  calls.clear()
  monkeypatch.setattr(bert_data, '_block_stretches', lambda *args: pytest.fail('the corpus was scanned again'))
  # Another workdir: the tokenizer comes from the cache directory, the plan and the pairs too.
  second = bert_data.cached_pretraining_examples(config, str(tmp_path / 'run2'), SEED)
  assert calls == [] and second[2] == first[2]
  for split in ('train', 'valid'):
    np.testing.assert_array_equal(rows(second[1][split])['tokens'], rows(first[1][split])['tokens'])


def test_a_damaged_shard_is_one_line(tmp_path):
  source = write_files(tmp_path / 'corpus', documents(60))
  config = data_config(source, tmp_path / 'cache', cache_shard_mb=0.005)
  _, _, caches = bert_data.cached_pretraining_examples(config, str(tmp_path / 'run'), SEED)
  shard = os.path.join(config.cache_dir, caches['train'], '00001.train.tokens.npy')
  with open(shard, 'r+b') as f:
    f.truncate(100)
  with pytest.raises(DataError) as error:
    bert_data.cached_pretraining_examples(config, str(tmp_path / 'run'), SEED)
  message = str(error.value)
  assert '\n' not in message and shard in message and 'rebuild' in message, message
