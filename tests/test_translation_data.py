"""Translation data (data/translation.py): numbers_en_fr, tsv:, the joint vocabulary, example arrays."""
import ml_collections
import numpy as np
import pytest
from num2words import num2words

from data import sources, translation

SMALL = (300, 60, 60)


@pytest.fixture(scope='module')
def numbers():
  return translation.numbers_en_fr(0, SMALL)


def data_config(**overrides):
  c = ml_collections.ConfigDict(dict(source='numbers_en_fr', eval_source='', tokenizer='bpe', vocab_size=400,
                                     lowercase=True, max_examples=0, seq_len=24, source_lang='', target_lang=''))
  c.update(overrides)
  return c


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


def test_read_tsv_and_its_errors(tmp_path):
  path = tmp_path / 'pairs.tsv'
  path.write_text('hello\tbonjour\n\n  cat \tchat\n', encoding='utf-8')
  assert translation.read_tsv(str(path)) == [('hello', 'bonjour'), ('cat', 'chat')]
  path.write_text('hello\tbonjour\nno tab here\n', encoding='utf-8')
  with pytest.raises(sources.DataError, match='line 2'):
    translation.read_tsv(str(path))
  with pytest.raises(sources.DataError, match='does not exist'):
    translation.read_tsv(str(tmp_path / 'missing.tsv'))


def test_tsv_source_splits_deterministically(tmp_path):
  path = tmp_path / 'pairs.tsv'
  lines = [f'source {i}\ttarget {i}' for i in range(400)]
  path.write_text('\n'.join(lines), encoding='utf-8')
  config = data_config(source=f'tsv:{path}')
  splits = translation.load_pairs(config, seed=0)
  sizes = [len(splits.train), len(splits.validation), len(splits.test)]
  assert sum(sizes) == 400 and 320 < sizes[0] < 390 and min(sizes[1:]) > 5
  assert translation.load_pairs(config, seed=0).test == splits.test
  assert not {s for s, _ in splits.train} & {s for s, _ in splits.test}
  capped = translation.load_pairs(data_config(source=f'tsv:{path}', max_examples=10), seed=0)
  assert capped.train == splits.train[:10]
  # eval_source replaces the held-out pairs.
  other = tmp_path / 'other.tsv'
  other.write_text('\n'.join(f'a {i}\tb {i}' for i in range(100)), encoding='utf-8')
  with_eval = translation.load_pairs(data_config(source=f'tsv:{path}', eval_source=f'tsv:{other}'), seed=0)
  assert with_eval.validation == with_eval.test and with_eval.test[0][0].startswith('a ')


def test_language_pair_and_unknown_sources():
  assert translation.language_pair('wmt14_translate/de-en', data_config()) == ('de', 'en')
  assert translation.language_pair('wmt14_translate/de-en', data_config(source_lang='en', target_lang='de')) == \
      ('en', 'de')
  with pytest.raises(sources.DataError, match='numbers_en_fr'):
    translation.load_pairs(data_config(source='nonsense'), seed=0)


def test_joint_tokenizer_is_saved_and_reloaded(numbers, tmp_path):
  tokenizer = translation.get_tokenizer(data_config(), str(tmp_path), numbers.train)
  for text in ('cent vingt-trois', 'one hundred and twenty-third', 'quatre-vingt-dix-neuvième'):
    assert tokenizer.decode(tokenizer.encode(text)) == text
  # Frequent words of both languages are single tokens of the one vocabulary.
  assert len(tokenizer.encode(' hundred')) == 1 and len(tokenizer.encode(' cent')) == 1
  reloaded = translation.get_tokenizer(data_config(vocab_size=50), str(tmp_path), [])
  assert reloaded.encode('mille deux cent') == tokenizer.encode('mille deux cent')


def test_encode_pairs_layout_padding_and_length_rules(numbers, tmp_path):
  tokenizer = translation.get_tokenizer(data_config(), str(tmp_path), numbers.train)
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
