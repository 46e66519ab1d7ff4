"""Translation data (data/translation.py): numbers_en_fr, tsv: and TFDS pairs through the example
cache, which equals an independent reference over several shards (the split, the rows, the test
text kept for BLEU), the joint vocabulary, example arrays."""
import hashlib

import numpy as np
import pytest
from num2words import num2words

from configs.base import base_config
from data import sources, token_cache, translation
from data.tokenizers import train_tokenizer

SMALL = (300, 60, 60)


@pytest.fixture(scope='module')
def numbers():
  return translation.numbers_en_fr(0, SMALL)


def data_config(tmp_path, **overrides):
  """configs/base.py's data schema, caching under tmp_path in ~1 KB shards of pairs."""
  c = base_config('test').data
  c.update({'source': 'numbers_en_fr', 'cache_dir': str(tmp_path / 'cache'), 'cache_shard_mb': 0.004,
            'tokenizer': 'char', 'vocab_size': 400, 'seq_len': 24, 'max_examples': 0, **overrides})
  return c


def texts(rows, tokenizer, field='source') -> list[str]:
  """A split's `field` decoded (a char tokenizer gives the text back)."""
  return [tokenizer.decode(rows[i][field].tolist()) for i in range(len(rows))]


def pairs_of(tmp_path, lines, whole=False, **overrides):
  """(tokenizer, {split: (source, target) texts}) of a tsv file of `lines`, read through the cache
  (`whole`: named for validation too, so that it trains whole)."""
  path = tmp_path / 'pairs.tsv'
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(''.join(f'{line}\n' for line in lines), encoding='utf-8')
  config = data_config(tmp_path, source=f'tsv:{path}', **{'eval_source': f'tsv:{path}' if whole else '', **overrides})
  tokenizer, splits, _, _ = translation.pair_datasets(config, str(tmp_path / 'run'), seed=0)
  return tokenizer, {split: list(zip(texts(rows, tokenizer), texts(rows, tokenizer, 'target_out')))
                     for split, rows in splits.items()}


def test_numbers_are_num2words_translations_with_held_out_numbers(numbers):
  lexicon = 2 * (translation.NUMBERS_LEXICON + 1)
  assert len(numbers.train) == lexicon + SMALL[0]
  assert (len(numbers.validation), len(numbers.test)) == SMALL[1:]
  train_sources = {s for s, _ in numbers.train}
  for pairs in (numbers.validation, numbers.test):
    assert not train_sources & {s for s, _ in pairs}
  assert not {s for s, _ in numbers.validation} & {s for s, _ in numbers.test}
  # The lexicon is in training; every pair is num2words' English and French for one number.
  assert ('seventy-one', 'soixante et onze') in numbers.train
  assert ('twenty-first', 'vingt et unième') in numbers.train
  assert ('nineteen eighty-four', num2words(1984, to='year', lang='fr')) == translation.number_pair('year', 1984)
  # All three kinds are drawn: ordinals, years read as pairs ('twelve ninety-three'), cardinals.
  year_heads = {'eleven', 'twelve', 'thirteen', 'fourteen', 'fifteen', 'sixteen', 'seventeen', 'eighteen',
                'nineteen', 'twenty'}
  held_out = numbers.validation + numbers.test
  ordinals = [t for s, t in held_out if s.endswith(('th', 'st', 'nd', 'rd'))]
  years = [s for s, _ in held_out if s.split()[0] in year_heads and len(s.split()) > 1 and 'thousand' not in s]
  assert ordinals and all(t.endswith('ième') for t in ordinals)
  assert years and len(ordinals) + len(years) < len(held_out)


def test_numbers_are_deterministic_in_the_seed(numbers):
  again = translation.numbers_en_fr(0, SMALL)
  assert again.test == numbers.test and again.train == numbers.train
  other = translation.numbers_en_fr(1, SMALL)
  assert other.test != numbers.test


def test_number_pair_is_num2words():
  assert translation.number_pair('cardinal', 123) == ('one hundred and twenty-three', 'cent vingt-trois')
  assert translation.number_pair('ordinal', 80) == (num2words(80, to='ordinal'), num2words(80, to='ordinal', lang='fr'))


def test_a_tsv_file_is_read_and_its_errors_are_one_line(tmp_path):
  _, splits = pairs_of(tmp_path / 'a', ['hello\tbonjour', '', '  cat \tchat'], whole=True)
  assert splits['train'] == [('hello', 'bonjour'), ('cat', 'chat')]
  with pytest.raises(sources.DataError, match='line 2'):
    pairs_of(tmp_path / 'b', ['hello\tbonjour', 'no tab here'], whole=True)
  with pytest.raises(sources.DataError, match='does not exist'):
    translation.pair_datasets(data_config(tmp_path, source=f'tsv:{tmp_path}/missing.tsv'), str(tmp_path / 'run'), 0)


def test_tsv_source_splits_deterministically(tmp_path):
  lines = [f'source {i}\ttarget {i}' for i in range(400)]
  _, splits = pairs_of(tmp_path / 'a', lines)
  sizes = [len(splits[split]) for split in ('train', 'valid', 'test')]
  assert sum(sizes) == 400 and 320 < sizes[0] < 390 and min(sizes[1:]) > 5
  assert pairs_of(tmp_path / 'b', lines)[1]['test'] == splits['test']
  assert not {s for s, _ in splits['train']} & {s for s, _ in splits['test']}
  capped = pairs_of(tmp_path / 'c', lines, max_examples=10)[1]
  assert capped['train'] == splits['train'][:10]
  # eval_source replaces the held-out pairs.
  other = tmp_path / 'other.tsv'
  other.write_text('\n'.join(f'a {i}\tb {i}' for i in range(100)), encoding='utf-8')
  with_eval = pairs_of(tmp_path / 'd', lines, eval_source=f'tsv:{other}')[1]
  assert with_eval['valid'] == with_eval['test'] and with_eval['test'][0][0].startswith('a ')


def test_language_pair_and_unknown_sources(tmp_path):
  assert translation.language_pair('wmt14_translate/de-en', data_config(tmp_path)) == ('de', 'en')
  assert translation.language_pair('wmt14_translate/de-en', data_config(tmp_path, source_lang='en',
                                                                         target_lang='de')) == ('en', 'de')
  with pytest.raises(sources.DataError, match='numbers_en_fr'):
    translation.pair_datasets(data_config(tmp_path, source='nonsense'), str(tmp_path / 'run'), seed=0)


def test_the_joint_tokenizer_is_trained_on_both_sides_saved_and_reloaded(tmp_path):
  config = data_config(tmp_path, tokenizer='bpe', max_examples=300)
  tokenizer = translation.pair_datasets(config, str(tmp_path / 'run'), seed=0)[0]
  for text in ('cent vingt-trois', 'one hundred and twenty-third', 'quatre-vingt-dix-neuvième'):
    assert tokenizer.decode(tokenizer.encode(text)) == text
  # Frequent words of both languages are single tokens of the one vocabulary.
  assert len(tokenizer.encode(' hundred')) == 1 and len(tokenizer.encode(' cent')) == 1
  reloaded = translation.pair_datasets(data_config(tmp_path, tokenizer='bpe', max_examples=300, vocab_size=50),
                                       str(tmp_path / 'run'), seed=0)[0]  # the workdir's, whatever the settings
  assert reloaded.to_json() == tokenizer.to_json()


def test_encode_pairs_layout_padding_and_length_rules(numbers):
  tokenizer = train_tokenizer('bpe', [text for pair in numbers.train for text in pair], 400)
  pad, bos, eos = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
  source_ids = tokenizer.encode('seven hundred')
  target_ids = tokenizer.encode('sept cents')
  long = ' '.join(['seven hundred'] * 10)
  pairs = [('seven hundred', 'sept cents'), (long, 'sept cents')]
  arrays, kept = translation.encode_pairs(tokenizer, pairs, 8, 6, drop_long=True)
  np.testing.assert_array_equal(kept, [0])
  s, t = len(source_ids), len(target_ids)
  np.testing.assert_array_equal(arrays['source'][0], source_ids + [eos] + [pad] * (8 - s - 1))
  np.testing.assert_array_equal(arrays['target_in'][0], [bos] + target_ids + [pad] * (6 - t - 1))
  np.testing.assert_array_equal(arrays['target_out'][0], target_ids + [eos] + [pad] * (6 - t - 1))
  assert all(a.dtype == np.int32 for a in arrays.values())
  # Evaluation keeps every row: the long source is cut, still ending with EOS.
  arrays, kept = translation.encode_pairs(tokenizer, pairs, 8, 6, drop_long=False)
  np.testing.assert_array_equal(kept, [0, 1])
  assert arrays['source'][1, -1] == eos and pad not in arrays['source'][1]
  dataset = translation.as_dataset(arrays)
  assert len(dataset) == 2 and set(dataset[1]) == {'source', 'target_in', 'target_out'}
  np.testing.assert_array_equal(dataset[1]['source'], arrays['source'][1])


# ----------------------------------------------------------------------------- the cache against a reference
def reference_rows(pairs, tokenizer, length, drop_long) -> dict[str, np.ndarray]:
  """Rows of (source, target) pairs written out here: source ids + EOS, BOS + target ids, target ids +
  EOS, padded to `length`; a pair longer than that dropped (training) or cut (held out)."""
  rows = {field: [] for field in translation.FIELDS}
  for source, target in pairs:
    a, b = tokenizer.encode(source), tokenizer.encode(target)
    if drop_long and (len(a) >= length or len(b) >= length):
      continue
    a, b = a[:length - 1], b[:length - 1]
    pad = lambda ids: ids + [tokenizer.pad_id] * (length - len(ids))
    for field, ids in zip(translation.FIELDS, (a + [tokenizer.eos_id], [tokenizer.bos_id] + b, b + [tokenizer.eos_id])):
      rows[field].append(pad(ids))
  return {field: np.asarray(value, np.int32).reshape(-1, length) for field, value in rows.items()}


def reference_splits(lines, held_out, seed=0) -> dict[str, list]:
  """A tsv file's pairs by split: SHA-256 of (seed, line) into 90/5/5, a role not held out giving its
  share to train; malformed and blank lines left out."""
  splits = {'train': [], 'valid': [], 'test': []}
  for line in lines:
    fields = [field.strip() for field in line.split('\t')]
    if len(fields) != 2 or not all(fields):
      continue
    u = int.from_bytes(hashlib.sha256(f'{seed}:{fields[0]}\t{fields[1]}'.encode()).digest()[:8], 'big') / 2**64
    role = 'train' if u < 0.9 else 'valid' if u < 0.95 else 'test'
    splits[role if role in held_out else 'train'].append(tuple(fields))
  return splits


def file_order(rows) -> dict[str, np.ndarray]:
  """A cached split's rows shard after shard, each in its stored order (the file's)."""
  shards = range(len(rows.cache.shards))
  return {field: np.concatenate([rows.cache.array(s, f'{rows.split}.{field}') for s in shards if rows.counts[s]])
          for field in rows.fields}


def pair_lines(count, seed) -> list[str]:
  rng = np.random.default_rng(seed)
  words = 'one two three four five six seven eight nine ten eleven twelve'.split()
  lines = [f'{" ".join(rng.choice(words, rng.integers(1, 8)))}\t{" ".join(rng.choice(words, rng.integers(1, 8)))} x'
           for _ in range(count)]
  lines[7], lines[30] = 'not a pair', ''
  return lines


@pytest.mark.parametrize('case', ['carved', 'test named', 'eval named', 'tfds', 'numbers_en_fr'])
def test_the_translation_cache_equals_an_independent_reference(case, tmp_path, monkeypatch):
  lines = pair_lines(600, 0)
  path = tmp_path / 'pairs.tsv'
  path.write_text('\n'.join(lines), encoding='utf-8')
  other = pair_lines(80, 1)[8:]
  (tmp_path / 'other.tsv').write_text('\n'.join(other), encoding='utf-8')
  overrides = {'source': f'tsv:{path}', 'max_malformed_fraction': 0.05}
  if case == 'test named':
    overrides['test_source'] = f'tsv:{tmp_path}/other.tsv'
  elif case == 'eval named':
    overrides['eval_source'] = f'tsv:{tmp_path}/other.tsv'
  elif case == 'tfds':
    splits = {split: [{'en': s.encode(), 'fr': t.encode()} for s, t in pairs]
              for split, pairs in (('train', reference_splits(lines, ())['train']),
                                   ('validation', reference_splits(other, ())['train'][:30]),
                                   ('test', reference_splits(other, ())['train'][30:]))}
    monkeypatch.setattr(sources, 'tfds_records', lambda name, split: splits[split])
    monkeypatch.setattr(translation, 'BYTES_PER_RECORD', 64)
    overrides['source'] = 'tfds:fake/en-fr'
  elif case == 'numbers_en_fr':
    overrides.update(source='numbers_en_fr', max_examples=300)
  config = data_config(tmp_path, **overrides)
  tokenizer, cached, test_texts, caches = translation.pair_datasets(config, str(tmp_path / 'run'), seed=0)
  if case == 'numbers_en_fr':  # its own split, generated
    generated = translation.numbers_en_fr(0, (300, 100, 100))
    expected = {'train': generated.train, 'valid': generated.validation, 'test': generated.test}
  elif case == 'tfds':
    expected = {'train': [(r['en'].decode(), r['fr'].decode()) for r in splits['train']],
                'valid': [(r['en'].decode(), r['fr'].decode()) for r in splits['validation']],
                'test': [(r['en'].decode(), r['fr'].decode()) for r in splits['test']]}
  else:
    held_out = {'carved': ('valid', 'test'), 'test named': ('valid',), 'eval named': ()}[case]
    expected = reference_splits(lines, held_out)
    if case != 'carved':
      expected[{'test named': 'test', 'eval named': 'valid'}[case]] = reference_splits(other, ())['train']
    if case == 'eval named':
      expected['test'] = expected['valid']
  for split in ('train', 'valid', 'test'):
    rows = reference_rows(expected[split], tokenizer, config.seq_len, drop_long=split == 'train')
    got = file_order(cached[split])
    for field in translation.FIELDS:
      np.testing.assert_array_equal(got[field], rows[field], err_msg=f'{split} {field}')
  kept = len(reference_rows(expected['train'], tokenizer, config.seq_len, True)['source'])
  assert len(cached['train']) == min(kept, config.max_examples or kept)
  if case not in ('numbers_en_fr', 'tfds'):
    assert len(token_cache.Cache(str(tmp_path / 'cache' / caches['train'])).shards) >= 4  # several shards
  # The test split's text, kept for BLEU, read in the rows' order.
  order = [cached['test'].locate(i) for i in range(len(cached['test']))]
  starts = np.cumsum([0] + cached['test'].counts.tolist())
  assert [test_texts[i] for i in range(len(test_texts))] == [expected['test'][starts[s] + r] for s, r in order]
