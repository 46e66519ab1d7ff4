"""The split rule of data/sources.py in every family's cache, tsv reading, and what does not fit seq_len."""
import gzip
import hashlib
import os

import ml_collections
import numpy as np
import pytest

import support
from configs.base import base_config
from data import bert_data, classification, lm, sources, translation
from data.tokenizers import CharTokenizer

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,-'\u00e0\u00e2\u00e7\u00e8\u00e9\u00ea\u00ee\u00f4\u00fb\u0301"


def data_config(tmp_path, **overrides) -> ml_collections.ConfigDict:
  """The shared data schema of configs/base.py (plus BERT's `documents`), caching under tmp_path."""
  c = base_config('test').data
  c.documents = 'auto'
  c.update({'cache_dir': str(tmp_path / 'cache'), 'tokenizer': 'char', 'max_examples': 0, **overrides})
  return c


def write(path, lines) -> str:
  path.write_text(''.join(f'{line}\n' for line in lines), encoding='utf-8')
  return str(path)


def report(capsys) -> list[str]:
  """The split report lines printed since the last call."""
  return [line for line in capsys.readouterr().out.splitlines() if ' split: ' in line and 'longer than' not in line]


def workdir(tmp_path, name='run', text=ALPHABET) -> str:
  """A workdir holding a character tokenizer of `text` (decoding gives every test text back), unless
  it holds one already."""
  if not (tmp_path / name / 'tokenizer.json').exists():
    CharTokenizer.train([text + text.upper() + '\t']).save(str(tmp_path / name))
  return str(tmp_path / name)


def pairs(tmp_path, **overrides) -> dict[str, list]:
  """{split: (source, target) texts} of translation's cache, decoded."""
  tokenizer, splits, test_texts, _ = translation.pair_datasets(data_config(tmp_path, **overrides),
                                                               workdir(tmp_path), seed=0)
  decode = lambda rows, field: [tokenizer.decode(rows[i][field].tolist()) for i in range(len(rows))]
  result = {split: list(zip(decode(rows, 'source'), decode(rows, 'target_out'))) for split, rows in splits.items()}
  assert [test_texts[i] for i in range(len(test_texts))] == result['test']
  return result


def examples(tmp_path, **overrides) -> dict[str, list]:
  """{split: (text, label)} of classification's cache, decoded ([CLS] text [SEP])."""
  tokenizer, splits, labels, _ = classification.labelled_datasets(data_config(tmp_path, seq_len=64, **overrides),
                                                                  workdir(tmp_path))
  return {split: [(tokenizer.decode(rows[i]['tokens'].tolist()), labels[int(rows[i]['label'])])
                  for i in range(len(rows))] for split, rows in splits.items()}


def share(key: str, seed: int = 0) -> float:
  return int.from_bytes(hashlib.sha256(f'{seed}:{key}'.encode()).digest()[:8], 'big') / 2**64


# ----------------------------------------------------------------------------- every family, three named files
def test_translation_files_named_for_every_split_are_used_whole(tmp_path, capsys):
  files = {name: write(tmp_path / f'{name}.tsv', [f'{name} {i}\t{name} fr {i}' for i in range(size)])
           for name, size in (('train', 7), ('valid', 3), ('test', 4))}
  splits = pairs(tmp_path, source=f'tsv:{files["train"]}', eval_source=f'tsv:{files["valid"]}',
                 test_source=f'tsv:{files["test"]}')
  assert splits['train'] == [(f'train {i}', f'train fr {i}') for i in range(7)]
  assert splits['valid'] == [(f'valid {i}', f'valid fr {i}') for i in range(3)]
  assert splits['test'] == [(f'test {i}', f'test fr {i}') for i in range(4)]
  assert report(capsys) == [f'train split: 7 pairs from tsv:{files["train"]}, whole (data.source)',
                            f'valid split: 3 pairs from tsv:{files["valid"]}, whole (data.eval_source)',
                            f'test split: 4 pairs from tsv:{files["test"]}, whole (data.test_source)']


def test_classification_files_named_for_every_split_are_used_whole(tmp_path, capsys):
  files = {name: write(tmp_path / f'{name}.tsv', [f'{name} text {i}\t{"ab"[i % 2]}' for i in range(size)])
           for name, size in (('train', 8), ('valid', 3), ('test', 5))}
  splits = examples(tmp_path, source=f'tsv:{files["train"]}', eval_source=f'tsv:{files["valid"]}',
                    test_source=f'tsv:{files["test"]}')
  expected = {name: [(f'{name} text {i}', 'ab'[i % 2]) for i in range(size)]
              for name, size in (('train', 8), ('valid', 3), ('test', 5))}
  assert {name: sorted(part) for name, part in splits.items()} == expected  # each in its hash order
  assert report(capsys) == [f'train split: 8 examples from tsv:{files["train"]}, whole (data.source)',
                            f'valid split: 3 examples from tsv:{files["valid"]}, whole (data.eval_source)',
                            f'test split: 5 examples from tsv:{files["test"]}, whole (data.test_source)']


def corpora(tmp_path, sizes=(('train', 3), ('valid', 2), ('test', 1))) -> dict[str, str]:
  return {name: support.write_corpus(str(tmp_path / name), files=count, lines=20, seed=i)
          for i, (name, count) in enumerate(sizes)}


def test_lm_files_named_for_every_split_are_used_whole(tmp_path, capsys):
  globs = corpora(tmp_path)
  config = data_config(tmp_path, source=globs['train'], eval_source=globs['valid'], test_source=globs['test'],
                       seq_len=16)
  tokenizer, streams, _ = lm.lm_streams(config, workdir(tmp_path, text=' '.join(support.WORDS)), seed=0)
  for name, count in (('train', 3), ('valid', 2), ('test', 1)):
    texts = [open(tmp_path / name / f'doc{i}.txt').read() for i in range(count)]
    expected = [i for text in texts for i in tokenizer.encode(text) + [tokenizer.eos_id]]
    np.testing.assert_array_equal(streams[name].read(0, len(streams[name])), expected)  # each from its own folder
  assert report(capsys) == [f'train split: 3 documents from {globs["train"]}, whole (data.source)',
                            f'valid split: 2 documents from {globs["valid"]}, whole (data.eval_source)',
                            f'test split: 1 document from {globs["test"]}, whole (data.test_source)']
  # Windows: characters + one EOS per document, cut into windows of seq_len + 1; the tail is reported.
  _, _, evaluation, windows, _ = lm.lm_datasets(config, str(tmp_path / 'run'), seed=0)
  tokens = len(streams['test'])
  assert len(windows) == tokens // 17 and windows is not evaluation
  assert capsys.readouterr().out.splitlines()[-1].endswith(
      f'test split: {tokens // 17} windows of 17 tokens; the last {tokens % 17} of {tokens} tokens are dropped '
      f'(less than a window).')


def test_the_windows_report_the_dropped_tail(tmp_path, capsys):
  for split, text in (('source', 'a' * 404), ('eval_source', 'a' * 6)):
    (tmp_path / split).mkdir()
    (tmp_path / split / 'text.txt').write_text(text)
  config = data_config(tmp_path, source=f'text:{tmp_path}/source/*.txt', seq_len=3,
                       eval_source=f'text:{tmp_path}/eval_source/*.txt')
  train = lm.lm_datasets(config, workdir(tmp_path, text='a'), seed=0)[1]
  assert len(train) == 101
  assert capsys.readouterr().out.splitlines()[-2:] == [
      'train split: 101 windows of 4 tokens; the last 1 of 405 tokens are dropped (less than a window).',
      'WARNING: valid split: 1 windows of 4 tokens; the last 3 of 7 tokens are dropped (less than a window).']


def test_bert_pretraining_files_named_for_every_split_are_used_whole(tmp_path, capsys):
  globs = corpora(tmp_path, (('train', 4), ('valid', 2), ('test', 3)))
  config = data_config(tmp_path, source=globs['train'], eval_source=globs['valid'], test_source=globs['test'],
                       tokenizer='wordpiece', vocab_size=200, seq_len=32, dupe_factor=1, short_seq_prob=0.1)
  _, splits, caches = bert_data.pretraining_datasets(config, str(tmp_path / 'run'), 0)
  assert set(splits) == {'train', 'valid'} and caches['train'] != caches['valid']
  assert report(capsys) == [f'train split: 4 documents from {globs["train"]}, whole (data.source)',
                            f'valid split: 2 documents from {globs["valid"]}, whole (data.eval_source)',
                            f'test split: 3 documents from {globs["test"]}, whole (data.test_source)']


# ----------------------------------------------------------------------------- what is not named is carved out
def test_translation_split_rule(tmp_path, capsys):
  lines = [(f'source {i}', f'target {i}') for i in range(400)]
  everything = write(tmp_path / 'all.tsv', [f'{s}\t{t}' for s, t in lines])
  other = write(tmp_path / 'other.tsv', [f'other {i}\tautre {i}' for i in range(30)])
  role = {pair: 'train' if share(f'{pair[0]}\t{pair[1]}') < 0.9 else 'valid' if share(f'{pair[0]}\t{pair[1]}') < 0.95
          else 'test' for pair in lines}
  only = pairs(tmp_path / 'a', source=f'tsv:{everything}')
  assert {split: only[split] for split in ('train', 'valid', 'test')} == {
      split: [p for p in lines if role[p] == split] for split in ('train', 'valid', 'test')}
  assert report(capsys)[1] == f'valid split: {len(only["valid"])} pairs from tsv:{everything}, a 5% hash split'
  # A named test file is used whole; validation is still the same hash split, and the test
  # share of the source goes back to training.
  with_test = pairs(tmp_path / 'b', source=f'tsv:{everything}', test_source=f'tsv:{other}')
  assert with_test['valid'] == only['valid'] and len(with_test['test']) == 30
  assert with_test['train'] == [p for p in lines if role[p] != 'valid']
  # eval_source alone: the source trains whole, the file is validation and test (all 30 pairs).
  with_eval = pairs(tmp_path / 'c', source=f'tsv:{everything}', eval_source=f'tsv:{other}')
  assert with_eval['train'] == lines and len(with_eval['valid']) == 30 and with_eval['test'] == with_eval['valid']
  assert report(capsys)[-3:] == [f'train split: 400 pairs from tsv:{everything}, whole (data.source)',
                                 f'valid split: 30 pairs from tsv:{other}, whole (data.eval_source)',
                                 'test split: 30 pairs from the valid split (data.test_source is empty)']
  capped = pairs(tmp_path / 'd', source=f'tsv:{everything}', eval_source=f'tsv:{other}', max_examples=10)
  assert capped['train'] == lines[:10]
  assert report(capsys)[0] == f'train split: 10 pairs from tsv:{everything}, whole (data.source), first 10 ' \
                              f'(data.max_examples)'


def test_numbers_en_fr_keeps_its_own_splits_and_can_be_named(tmp_path):
  generated = pairs(tmp_path / 'a', source='numbers_en_fr', max_examples=300, seq_len=100)
  assert (len(generated['train']), len(generated['valid']), len(generated['test'])) == (300, 100, 100)
  own = translation.numbers_en_fr(0, (300, 100, 100))
  assert generated['train'] == own.train[:300] and generated['valid'] == own.validation
  path = write(tmp_path / 'pairs.tsv', ['one\tun', 'two\tdeux'])
  named = pairs(tmp_path / 'b', source=f'tsv:{path}', eval_source='numbers_en_fr', test_source='numbers_en_fr',
                max_examples=300, seq_len=100)
  assert named['train'] == [('one', 'un'), ('two', 'deux')]
  assert named['valid'] == generated['valid'] and named['test'] == generated['test']


def test_classification_split_rule(tmp_path):
  lines = [f'text number {i}\t{"abc"[i % 3]}' for i in range(200)]
  everything = write(tmp_path / 'all.tsv', lines)
  other = write(tmp_path / 'other.tsv', lines[:3])
  role = {f'text number {i}': 'train' if share(f'text number {i}') < 0.8 else 'valid'
          if share(f'text number {i}') < 0.9 else 'test' for i in range(200)}
  texts = lambda part: sorted(text for text, _ in part)
  only = examples(tmp_path / 'a', source=f'tsv:{everything}')
  assert {split: texts(part) for split, part in only.items()} == {
      split: sorted(text for text in role if role[text] == split) for split in ('train', 'valid', 'test')}
  with_test = examples(tmp_path / 'b', source=f'tsv:{everything}', test_source=f'tsv:{other}')
  assert texts(with_test['valid']) == texts(only['valid']) and len(with_test['test']) == 3
  assert texts(with_test['train']) == sorted(texts(only['train']) + texts(only['test']))
  with_eval = examples(tmp_path / 'c', source=f'tsv:{everything}', eval_source=f'tsv:{other}')
  assert texts(with_eval['train']) == sorted(line.split('\t')[0] for line in lines)
  assert len(with_eval['valid']) == 3 and with_eval['test'] == with_eval['valid']


def test_lm_and_bert_carve_only_validation(tmp_path, capsys):
  globs = corpora(tmp_path, (('train', 40), ('test', 2)))
  config = data_config(tmp_path, source=globs['train'], seq_len=16)
  _, streams, _ = lm.lm_streams(config, workdir(tmp_path, text=' '.join(support.WORDS)), seed=0)
  assert streams['test'] is streams['valid'] and streams['train'].documents + streams['valid'].documents == 40
  assert report(capsys)[2].endswith(' from the valid split (this family holds out one split)')
  _, named, _ = lm.lm_streams(data_config(tmp_path, source=globs['train'], test_source=globs['test']),
                              str(tmp_path / 'run'), seed=0)
  assert len(named['valid']) == len(streams['valid']) and named['test'].documents == 2
  bert = data_config(tmp_path, source=globs['train'], tokenizer='wordpiece', vocab_size=200, seq_len=32, dupe_factor=1,
                     short_seq_prob=0.1)
  capsys.readouterr()
  # 40 files: 5% is 2 documents, the held-out floor, paired in a shard of their own.
  _, examples, _ = bert_data.pretraining_datasets(bert, str(tmp_path / 'run-bert'), 0)
  lines = report(capsys)
  assert lines[2].endswith(' from the valid split (this family holds out one split)')
  assert (int(lines[0].split()[2]), int(lines[1].split()[2])) == (38, 2) and len(examples['valid']) > 0


# ----------------------------------------------------------------------------- tsv reading
# Characters str.splitlines() breaks at, although they are not newlines in a tsv file.
SEPARATORS = '\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029'


def read(family: str, tmp_path, path: str, **overrides) -> list[tuple]:
  """A tsv file's records, read whole (named for validation too) through the family's cache."""
  source = {'source': f'tsv:{path}', 'eval_source': f'tsv:{path}', **overrides}
  if family == 'translation':
    return pairs(tmp_path, **source)['train']
  return examples(tmp_path, **source)['valid']


@pytest.mark.parametrize('family', ['translation', 'classification'])
def test_tsv_lines_end_at_newlines_only(tmp_path, family):
  lines = [f'a{c}b\tx{c}y' for c in SEPARATORS] + ['windows\tline\r', 'no tab here']
  path = write(tmp_path / 'data.tsv', lines)
  with pytest.raises(sources.DataError, match=r'1 of 10 lines are malformed.*\(line 10: 1 tab-separated fields'):
    read(family, tmp_path / 'a', path)
  text = ALPHABET + ''.join(SEPARATORS) + 'wxyn'
  CharTokenizer.train([text]).save(str(tmp_path / 'b' / 'run'))
  got = read(family, tmp_path / 'b', path, max_malformed_fraction=0.1)
  expected = [(f'a{c}b', f'x{c}y') for c in SEPARATORS] + [('windows', 'line')]
  assert sorted(got) == sorted(expected) if family == 'classification' else got == expected


def test_malformed_lines_are_skipped_with_their_line_numbers(tmp_path, capsys):
  lines = [f'source {i}\ttarget {i}' for i in range(300)]
  lines[9] = 'hello\t '  # a target that is a single space
  lines[99] = 'a\tb\tc'
  lines.insert(50, '')  # blank lines are neither pairs nor malformed
  path = write(tmp_path / 'pairs.tsv', lines)
  assert len(read('translation', tmp_path / 'a', path)) == 298
  assert [line for line in capsys.readouterr().out.splitlines() if line.startswith('tsv:')] == [
      f'tsv:{path}: skipped 2 malformed of 300 lines (line 10: empty target; line 101: 3 tab-separated fields, not '
      f'source<TAB>target).'] * 2  # read as data.source and as data.eval_source
  with pytest.raises(sources.DataError, match='data.max_malformed_fraction=0 '):
    read('translation', tmp_path / 'b', path, max_malformed_fraction=0)
  for index in (150, 200):
    lines[index] = '\tno source'
  path = write(tmp_path / 'pairs.tsv', lines)
  with pytest.raises(sources.DataError) as error:
    read('translation', tmp_path / 'c', path)
  assert str(error.value) == (
      f'tsv:{path}: 4 of 300 lines are malformed, more than data.max_malformed_fraction=0.01 (line 10: empty '
      f'target; line 101: 3 tab-separated fields, not source<TAB>target; line 151: empty source; ... (1 more)). '
      f'Fix those lines, or raise data.max_malformed_fraction to skip them.')
  splits = pairs(tmp_path / 'd', source=f'tsv:{path}', max_malformed_fraction=0.02)
  assert len(splits['train']) + len(splits['valid']) + len(splits['test']) == 296
  with pytest.raises(sources.DataError, match=r'data.max_malformed_fraction=1.5 must be in \[0, 1\]'):
    pairs(tmp_path / 'e', source=f'tsv:{path}', max_malformed_fraction=1.5)


def test_classification_tsv_flags_other_field_counts_and_empty_fields(tmp_path):
  lines = [f'text {i}\tlabel' for i in range(8)] + ['a\tb\tlabel', 'text\t', '\tlabel']
  path = write(tmp_path / 'labelled.tsv', lines)
  with pytest.raises(sources.DataError, match=r'line 9: 3 tab-separated fields, not text<TAB>label like most lines; '
                                              r'line 10: empty label; line 11: empty text\)'):
    read('classification', tmp_path / 'a', path, max_malformed_fraction=0.01)
  labelled = write(tmp_path / 'two-labels.tsv', lines + [f'more {i}\tother' for i in range(8)])
  assert len(read('classification', tmp_path / 'b', labelled, max_malformed_fraction=0.3)) == 16


@pytest.mark.parametrize('family', ['translation', 'classification', 'text'])
def test_non_utf8_bytes_stop_with_the_file_and_line(tmp_path, family):
  path = tmp_path / 'data.tsv'
  path.write_bytes('good\tbien\nmore\tplus\n'.encode() + b'caf\xe9\tcaf\xc3\xa9\n')
  with pytest.raises(sources.DataError) as error:
    if family == 'text':
      lm.lm_streams(data_config(tmp_path, source=f'text:{path}'), workdir(tmp_path), seed=0)
    else:
      read(family, tmp_path, str(path))
  assert str(error.value) == (f'{path}:3: byte 4 of the line (0xe9) is not UTF-8; data files must be UTF-8: convert '
                              f'it (e.g. iconv -f cp1252 -t utf-8) or fix that line.')


def test_a_byte_order_mark_is_not_text(tmp_path):
  path = tmp_path / 'bom.tsv'
  path.write_bytes(b'\xef\xbb\xbfhello\tbonjour\n')
  assert read('translation', tmp_path, str(path)) == [('hello', 'bonjour')]


def test_a_directory_is_named_as_such_not_as_missing(tmp_path):
  with pytest.raises(sources.DataError) as error:
    read('translation', tmp_path, str(tmp_path))
  assert str(error.value) == (f'tsv:{tmp_path} is a directory; tsv: reads one file: name a file of '
                              f'source<TAB>target lines in it.')


def test_gzipped_tsv_files_are_read_whatever_their_name(tmp_path):
  lines = ['hello\tbonjour', 'caf\u00e9\tcaf\u00e9']
  for name in ('pairs.tsv.gz', 'pairs.tsv'):  # known by gzip's magic bytes, not only by the suffix
    (tmp_path / name).write_bytes(gzip.compress(''.join(f'{p}\n' for p in lines).encode()))
    assert read('translation', tmp_path / name.replace('.', '-'), str(tmp_path / name)) == [
        ('hello', 'bonjour'), ('caf\u00e9', 'caf\u00e9')]
  (tmp_path / 'cut.tsv.gz').write_bytes(gzip.compress(b'hello\tbonjour\n' * 100)[:30])
  with pytest.raises(sources.DataError, match='cut.tsv.gz does not decompress'):
    read('translation', tmp_path / 'cut', str(tmp_path / 'cut.tsv.gz'))


def test_empty_fields_at_the_end_of_each_line_are_not_fields(tmp_path):
  path = write(tmp_path / 'pairs.tsv', ['hello\tbonjour\t', 'cat\tchat\t\t', 'empty\t\t'])
  with pytest.raises(sources.DataError, match=r'1 of 3 lines are malformed.*\(line 3: empty target\)'):
    read('translation', tmp_path / 'a', path)
  assert read('translation', tmp_path / 'b', path, max_malformed_fraction=0.5) == [('hello', 'bonjour'),
                                                                                    ('cat', 'chat')]
  labelled = write(tmp_path / 'labelled.tsv', ['a text\tsport\t', 'another\ttech\t', 'a\tb\tpair\t'])
  assert sorted(read('classification', tmp_path / 'c', labelled, max_malformed_fraction=0.5)) == [
      ('a text', 'sport'), ('another', 'tech')]


def test_a_header_line_is_skipped_when_asked_and_warned_about_when_not(tmp_path, capsys):
  path = write(tmp_path / 'pairs.tsv', ['source\ttarget', 'hello\tbonjour', 'cat\tchat'])
  assert read('translation', tmp_path / 'a', path)[0] == ('source', 'target')
  assert capsys.readouterr().out.count(f"WARNING: tsv:{path}: the first line ('source\\ttarget') looks like a header "
                                       f'of column names and is read as data; pass --config.data.tsv_header=True to '
                                       f'skip it.\n') == 2  # read as data.source and as data.eval_source
  assert read('translation', tmp_path / 'b', path, tsv_header=True) == [('hello', 'bonjour'), ('cat', 'chat')]
  assert 'WARNING' not in capsys.readouterr().out
  for first in ('en\tes', 'text\tlabel', 'sentence1\tsentence2\tlabel'):
    assert sources.looks_like_header(first), first
  for first in ('hello\tbonjour', 'the cat\tanimal', 'text\t', 'go\tgo now'):
    assert not sources.looks_like_header(first), first
  labelled = write(tmp_path / 'labelled.tsv', ['text\tlabel', 'a text\tsport', 'more text\tsport', 'else\ttech'])
  assert sorted(label for _, label in read('classification', tmp_path / 'c', labelled, tsv_header=True)) == [
      'sport', 'sport', 'tech']


# ----------------------------------------------------------------------------- examples longer than seq_len
def test_long_pairs_are_counted_dropped_in_training_and_truncated_in_evaluation(tmp_path, capsys):
  short, long = 'abc\tde', ['abcdefghij\tab', 'ab\tabcdefghij']
  train = write(tmp_path / 'train.tsv', [short] * 99 + long[:1])
  valid = write(tmp_path / 'valid.tsv', [short] * 98 + long)
  tokenizer, splits, _, _ = translation.pair_datasets(data_config(tmp_path, source=f'tsv:{train}',
                                                                  eval_source=f'tsv:{valid}', seq_len=6),
                                                      workdir(tmp_path), seed=0)
  assert len(splits['train']) == 99 and len(splits['valid']) == 100
  assert [line for line in capsys.readouterr().out.splitlines() if 'longer than' in line][:2] == [
      'train split: 1 of 100 pairs (1.0%) are longer than 5 source / 5 target tokens (data.seq_len): dropped.',
      'WARNING: valid split: 2 of 100 pairs (2.0%) are longer than 5 source / 5 target tokens (data.seq_len): '
      'truncated. Raise data.seq_len to keep them whole.']
  arrays, kept = translation.encode_pairs(tokenizer, [('abcdefghij', 'ab')], 6, 6, drop_long=False)  # prints nothing
  assert capsys.readouterr().out == '' and kept.tolist() == [0]


def test_long_classification_examples_are_counted_and_kept_truncated(tmp_path, capsys):
  three = write(tmp_path / 'three.tsv', ['abc\tde\tx', 'abc\tdef\tx', 'ab\tc\ty', 'abcd\tefgh\ty'])
  _, splits, _, _ = classification.labelled_datasets(
      data_config(tmp_path, source=f'tsv:{three}', eval_source=f'tsv:{three}', seq_len=8), workdir(tmp_path))
  assert all(splits['valid'][i]['valid'].sum() <= 8 for i in range(4)) and len(splits['valid']) == 4
  assert [line for line in capsys.readouterr().out.splitlines() if 'longer than' in line][1] == (
      'WARNING: valid split: 2 of 4 examples (50.0%) are longer than 8 tokens with [CLS] and [SEP] (data.seq_len): '
      'truncated. Raise data.seq_len to keep them whole.')


# ----------------------------------------------------------------------------- sources a family does not read
@pytest.mark.parametrize('family, source', [('lm', 'bbc_news'), ('translation', 'pystdlib'),
                                            ('classification', 'numbers_en_fr'), ('bert', 'tsv:pairs.tsv')])
def test_a_source_a_family_cannot_read_is_one_line_naming_it(family, source, tmp_path):
  """Every source a family reads is cached; any other is one line before anything is read or built."""
  config = data_config(tmp_path, source=source, seq_len=16, tokenizer='wordpiece', vocab_size=100, dupe_factor=1,
                       short_seq_prob=0.1)
  read = {'lm': lambda: lm.lm_streams(config, str(tmp_path / 'run'), 0),
          'translation': lambda: translation.pair_datasets(config, str(tmp_path / 'run'), 0),
          'classification': lambda: classification.labelled_datasets(config, str(tmp_path / 'run')),
          'bert': lambda: bert_data.pretraining_datasets(config, str(tmp_path / 'run'), 0)}[family]
  with pytest.raises(sources.DataError) as error:
    read()
  message = str(error.value)
  assert '\n' not in message and message.startswith('Unknown ') and repr(source) in message, message
  assert not os.path.exists(tmp_path / 'cache')  # nothing built
