"""The split rule of data/sources.py in every family's loader, tsv reading, and what does not fit seq_len."""
import ml_collections
import pytest

import support
from configs.base import base_config
from data import bert_data, classification, lm, sources, translation
from data.tokenizers import CharTokenizer


def data_config(**overrides) -> ml_collections.ConfigDict:
  """The shared data schema of configs/base.py (plus BERT's `documents`), with overrides."""
  c = base_config('test').data
  c.documents = 'auto'
  c.update(overrides)
  return c


def write(path, lines) -> str:
  path.write_text(''.join(f'{line}\n' for line in lines), encoding='utf-8')
  return str(path)


def report(capsys) -> list[str]:
  """The split report lines printed since the last call."""
  return [line for line in capsys.readouterr().out.splitlines() if ' split: ' in line]


# ----------------------------------------------------------------------------- every family, three named files
def test_translation_files_named_for_every_split_are_used_whole(tmp_path, capsys):
  files = {name: write(tmp_path / f'{name}.tsv', [f'{name} {i}\t{name} fr {i}' for i in range(size)])
           for name, size in (('train', 7), ('valid', 3), ('test', 4))}
  config = data_config(source=f'tsv:{files["train"]}', eval_source=f'tsv:{files["valid"]}',
                       test_source=f'tsv:{files["test"]}')
  splits = translation.load_pairs(config, seed=0)
  assert splits.train == [(f'train {i}', f'train fr {i}') for i in range(7)]
  assert splits.validation == [(f'valid {i}', f'valid fr {i}') for i in range(3)]
  assert splits.test == [(f'test {i}', f'test fr {i}') for i in range(4)]
  assert report(capsys) == [f'train split: 7 pairs from tsv:{files["train"]}, whole (data.source)',
                            f'valid split: 3 pairs from tsv:{files["valid"]}, whole (data.eval_source)',
                            f'test split: 4 pairs from tsv:{files["test"]}, whole (data.test_source)']


def test_classification_files_named_for_every_split_are_used_whole(tmp_path, capsys):
  files = {name: write(tmp_path / f'{name}.tsv', [f'{name} text {i}\t{"ab"[i % 2]}' for i in range(size)])
           for name, size in (('train', 8), ('valid', 3), ('test', 5))}
  config = data_config(source=f'tsv:{files["train"]}', eval_source=f'tsv:{files["valid"]}',
                       test_source=f'tsv:{files["test"]}')
  splits = classification.load_splits(config)
  assert {name: [(e.text, e.label) for e in part] for name, part in splits.items()} == {
      name: [(f'{name} text {i}', 'ab'[i % 2]) for i in range(size)]
      for name, size in (('train', 8), ('valid', 3), ('test', 5))}
  assert report(capsys) == [f'train split: 8 examples from tsv:{files["train"]}, whole (data.source)',
                            f'valid split: 3 examples from tsv:{files["valid"]}, whole (data.eval_source)',
                            f'test split: 5 examples from tsv:{files["test"]}, whole (data.test_source)']


def corpora(tmp_path, sizes=(('train', 3), ('valid', 2), ('test', 1))) -> dict[str, str]:
  return {name: support.write_corpus(str(tmp_path / name), files=count, lines=20, seed=i)
          for i, (name, count) in enumerate(sizes)}


def test_lm_files_named_for_every_split_are_used_whole(tmp_path, capsys):
  globs = corpora(tmp_path)
  config = data_config(source=globs['train'], eval_source=globs['valid'], test_source=globs['test'],
                       tokenizer='char', seq_len=16)
  train, valid, test = lm.split_documents(config, seed=0)
  assert [[key for key, _ in docs] for docs in (train, valid, test)] == [
      ['doc0.txt', 'doc1.txt', 'doc2.txt'], ['doc0.txt', 'doc1.txt'], ['doc0.txt']]
  assert valid[0][1] != train[0][1] and test[0][1] != valid[0][1]  # each from its own folder
  assert report(capsys) == [f'train split: 3 documents from {globs["train"]}, whole (data.source)',
                            f'valid split: 2 documents from {globs["valid"]}, whole (data.eval_source)',
                            f'test split: 1 document from {globs["test"]}, whole (data.test_source)']
  # Packed: characters + one EOS per document, cut into windows of seq_len + 1; the tail is reported.
  _, _, evaluation, packed_test, _ = lm.lm_datasets(config, str(tmp_path / 'run'), seed=0)
  tokens = len(test[0][1]) + 1
  assert len(packed_test) == tokens // 17 and packed_test is not evaluation
  assert capsys.readouterr().out.splitlines()[-1].endswith(
      f'test split: {tokens // 17} windows of 17 tokens; the last {tokens % 17} of {tokens} tokens are dropped '
      f'(less than a window).')


def test_pack_reports_the_dropped_tail(capsys):
  tokenizer = CharTokenizer.train(['a'])
  assert lm.pack([('k', 'a' * 404)], tokenizer, seq_len=3, split='train').shape == (101, 4)
  assert lm.pack([('k', 'a' * 6)], tokenizer, seq_len=3, split='valid').shape == (1, 4)
  assert capsys.readouterr().out.splitlines() == [
      'train split: 101 windows of 4 tokens; the last 1 of 405 tokens are dropped (less than a window).',
      'WARNING: valid split: 1 windows of 4 tokens; the last 3 of 7 tokens are dropped (less than a window).']


def test_bert_pretraining_files_named_for_every_split_are_used_whole(tmp_path, capsys):
  globs = corpora(tmp_path, (('train', 4), ('valid', 2), ('test', 3)))
  config = data_config(source=globs['train'], eval_source=globs['valid'], test_source=globs['test'])
  train, valid, test = bert_data.pretraining_documents(config)
  assert (len(train), len(valid), len(test)) == (4, 2, 3)
  assert valid == [text for _, text in sources.read_text_files(globs['valid'].removeprefix('text:'))]
  assert report(capsys) == [f'train split: 4 documents from {globs["train"]}, whole (data.source)',
                            f'valid split: 2 documents from {globs["valid"]}, whole (data.eval_source)',
                            f'test split: 3 documents from {globs["test"]}, whole (data.test_source)']


# ----------------------------------------------------------------------------- what is not named is carved out
def test_translation_split_rule(tmp_path, capsys):
  pairs = [(f'source {i}', f'target {i}') for i in range(400)]
  everything = write(tmp_path / 'all.tsv', [f'{s}\t{t}' for s, t in pairs])
  other = write(tmp_path / 'other.tsv', [f'other {i}\tautre {i}' for i in range(30)])
  only = translation.load_pairs(data_config(source=f'tsv:{everything}'), seed=0)
  assert sorted(only.train + only.validation + only.test) == sorted(pairs)
  assert min(len(only.validation), len(only.test)) > 5 and not set(only.validation) & set(only.test)
  lines = report(capsys)
  assert lines[1] == f'valid split: {len(only.validation)} pairs from tsv:{everything}, a 5% hash split'
  # A named test file is used whole; validation is still the same hash split, and the test
  # share of the source goes back to training.
  with_test = translation.load_pairs(data_config(source=f'tsv:{everything}', test_source=f'tsv:{other}'), seed=0)
  assert with_test.validation == only.validation
  assert with_test.train == [p for p in pairs if p not in set(only.validation)]
  assert len(with_test.test) == 30
  # eval_source alone: the source trains whole, the file is validation and test (all 30 pairs).
  with_eval = translation.load_pairs(data_config(source=f'tsv:{everything}', eval_source=f'tsv:{other}'), seed=0)
  assert with_eval.train == pairs and len(with_eval.validation) == 30 and with_eval.test is with_eval.validation
  assert report(capsys)[-3:] == [f'train split: 400 pairs from tsv:{everything}, whole (data.source)',
                                 f'valid split: 30 pairs from tsv:{other}, whole (data.eval_source)',
                                 'test split: 30 pairs from the valid split (data.test_source is empty)']
  capped = translation.load_pairs(data_config(source=f'tsv:{everything}', eval_source=f'tsv:{other}',
                                              max_examples=10), seed=0)
  assert capped.train == pairs[:10]
  assert report(capsys)[0] == f'train split: 10 pairs from tsv:{everything}, whole (data.source), first 10 ' \
                              f'(data.max_examples)'


def test_numbers_en_fr_keeps_its_own_splits_and_can_be_named(tmp_path):
  generated = translation.load_pairs(data_config(source='numbers_en_fr', max_examples=300), seed=0)
  assert (len(generated.train), len(generated.validation), len(generated.test)) == (300, 100, 100)
  pairs = write(tmp_path / 'pairs.tsv', ['one\tun', 'two\tdeux'])
  named = translation.load_pairs(data_config(source=f'tsv:{pairs}', eval_source='numbers_en_fr',
                                             test_source='numbers_en_fr', max_examples=300), seed=0)
  assert named.train == [('one', 'un'), ('two', 'deux')]
  assert named.validation == generated.validation and named.test == generated.test


def test_classification_split_rule(tmp_path):
  lines = [f'text number {i}\t{"abc"[i % 3]}' for i in range(200)]
  everything = write(tmp_path / 'all.tsv', lines)
  other = write(tmp_path / 'other.tsv', lines[:3])
  key = lambda part: [e.text for e in part]
  only = classification.load_splits(data_config(source=f'tsv:{everything}'))
  assert {name: len(part) for name, part in only.items()} == {'train': 160, 'valid': 20, 'test': 20}
  with_test = classification.load_splits(data_config(source=f'tsv:{everything}', test_source=f'tsv:{other}'))
  assert key(with_test['valid']) == key(only['valid'])
  assert key(with_test['train']) == key(only['train']) + key(only['test']) and len(with_test['test']) == 3
  with_eval = classification.load_splits(data_config(source=f'tsv:{everything}', eval_source=f'tsv:{other}'))
  assert key(with_eval['train']) == [line.split('\t')[0] for line in lines]
  assert len(with_eval['valid']) == 3 and with_eval['test'] is with_eval['valid']


def test_lm_and_bert_carve_only_validation(tmp_path, capsys):
  globs = corpora(tmp_path, (('train', 40), ('test', 2)))
  train, valid, test = lm.split_documents(data_config(source=globs['train']), seed=0)
  assert test is valid and len(train) + len(valid) == 40 and valid
  assert report(capsys)[2].endswith(' from the valid split (this family holds out one split)')
  named = lm.split_documents(data_config(source=globs['train'], test_source=globs['test']), seed=0)
  assert named[:2] == (train, valid) and len(named[2]) == 2
  bert_train, bert_valid, bert_test = bert_data.pretraining_documents(data_config(source=globs['train']))
  assert bert_test is bert_valid and len(bert_train) + len(bert_valid) == 40


# ----------------------------------------------------------------------------- tsv reading
# Characters str.splitlines() breaks at, although they are not newlines in a tsv file.
SEPARATORS = '\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029'


@pytest.mark.parametrize('family', ['translation', 'classification'])
def test_tsv_lines_end_at_newlines_only(tmp_path, family):
  read = {'translation': translation.read_tsv, 'classification': classification.read_tsv}[family]
  lines = [f'a{c}b\tx{c}y' for c in SEPARATORS] + ['windows\tline\r', 'no tab here']
  path = write(tmp_path / 'data.tsv', lines)
  with pytest.raises(sources.DataError, match=r'1 of 10 lines are malformed.*\(line 10: 1 tab-separated fields'):
    read(path)
  rows = read(path, max_malformed_fraction=0.1)
  got = [(r.text, r.label) for r in rows] if family == 'classification' else rows
  assert got == [(f'a{c}b', f'x{c}y') for c in SEPARATORS] + [('windows', 'line')]


def test_malformed_lines_are_skipped_with_their_line_numbers(tmp_path, capsys):
  lines = [f'source {i}\ttarget {i}' for i in range(300)]
  lines[9] = 'hello\t '  # a target that is a single space
  lines[99] = 'a\tb\tc'
  lines.insert(50, '')  # blank lines are neither pairs nor malformed
  path = write(tmp_path / 'pairs.tsv', lines)
  assert len(translation.read_tsv(path)) == 298
  assert capsys.readouterr().out == (f'tsv:{path}: skipped 2 malformed of 300 lines (line 10: empty target; line '
                                     f'101: 3 tab-separated fields, not source<TAB>target).\n')
  with pytest.raises(sources.DataError, match='data.max_malformed_fraction=0 '):
    translation.read_tsv(path, max_malformed_fraction=0)
  for index in (150, 200):
    lines[index] = '\tno source'
  path = write(tmp_path / 'pairs.tsv', lines)
  with pytest.raises(sources.DataError) as error:
    translation.read_tsv(path)
  assert str(error.value) == (
      f'tsv:{path}: 4 of 300 lines are malformed, more than data.max_malformed_fraction=0.01 (line 10: empty '
      f'target; line 101: 3 tab-separated fields, not source<TAB>target; line 151: empty source; ... (1 more)). '
      f'Fix those lines, or raise data.max_malformed_fraction to skip them.')
  config = data_config(source=f'tsv:{path}', max_malformed_fraction=0.02)
  splits = translation.load_pairs(config, seed=0)
  assert len(splits.train) + len(splits.validation) + len(splits.test) == 296
  with pytest.raises(sources.DataError, match=r'data.max_malformed_fraction=1.5 must be in \[0, 1\]'):
    translation.load_pairs(data_config(source=f'tsv:{path}', max_malformed_fraction=1.5), seed=0)


def test_classification_tsv_flags_other_field_counts_and_empty_fields(tmp_path):
  lines = [f'text {i}\tlabel' for i in range(8)] + ['a\tb\tlabel', 'text\t', '\tlabel']
  path = write(tmp_path / 'labelled.tsv', lines)
  with pytest.raises(sources.DataError, match=r'line 9: 3 tab-separated fields, not text<TAB>label like most lines; '
                                              r'line 10: empty label; line 11: empty text\)'):
    classification.read_tsv(path)
  assert len(classification.read_tsv(path, max_malformed_fraction=0.3)) == 8


@pytest.mark.parametrize('read', [translation.read_tsv, classification.read_tsv,
                                  lambda path: sources.read_text_files(path)])
def test_non_utf8_bytes_stop_with_the_file_and_line(tmp_path, read):
  path = tmp_path / 'data.tsv'
  path.write_bytes('good\tbien\nmore\tplus\n'.encode() + b'caf\xe9\tcaf\xc3\xa9\n')
  with pytest.raises(sources.DataError) as error:
    read(str(path))
  assert str(error.value) == (f'{path}:3: byte 4 of the line (0xe9) is not UTF-8; data files must be UTF-8: convert '
                              f'it (e.g. iconv -f cp1252 -t utf-8) or fix that line.')


def test_a_byte_order_mark_is_not_text(tmp_path):
  path = tmp_path / 'bom.tsv'
  path.write_bytes(b'\xef\xbb\xbfhello\tbonjour\n')
  assert translation.read_tsv(str(path)) == [('hello', 'bonjour')]


def test_a_directory_is_named_as_such_not_as_missing(tmp_path):
  with pytest.raises(sources.DataError) as error:
    translation.read_tsv(str(tmp_path))
  assert str(error.value) == (f'tsv:{tmp_path} is a directory; tsv: reads one file: name a file of '
                              f'source<TAB>target lines in it.')


def test_gzipped_tsv_files_are_read_whatever_their_name(tmp_path):
  import gzip
  pairs = ['hello\tbonjour', 'caf\u00e9\tcaf\u00e9']
  for name in ('pairs.tsv.gz', 'pairs.tsv'):  # known by gzip's magic bytes, not only by the suffix
    (tmp_path / name).write_bytes(gzip.compress(''.join(f'{p}\n' for p in pairs).encode()))
    assert translation.read_tsv(str(tmp_path / name)) == [('hello', 'bonjour'), ('caf\u00e9', 'caf\u00e9')]
  (tmp_path / 'cut.tsv.gz').write_bytes(gzip.compress(b'hello\tbonjour\n' * 100)[:30])
  with pytest.raises(sources.DataError, match='cut.tsv.gz is gzip-compressed but does not decompress'):
    translation.read_tsv(str(tmp_path / 'cut.tsv.gz'))


def test_empty_fields_at_the_end_of_each_line_are_not_fields(tmp_path):
  pairs = write(tmp_path / 'pairs.tsv', ['hello\tbonjour\t', 'cat\tchat\t\t', 'empty\t\t'])
  with pytest.raises(sources.DataError, match=r'1 of 3 lines are malformed.*\(line 3: empty target\)'):
    translation.read_tsv(pairs)
  assert translation.read_tsv(pairs, max_malformed_fraction=0.5) == [('hello', 'bonjour'), ('cat', 'chat')]
  labelled = write(tmp_path / 'labelled.tsv', ['a text\tsport\t', 'another\ttech\t', 'a\tb\tpair\t'])
  examples = classification.read_tsv(labelled, max_malformed_fraction=0.5)
  assert [(e.text, e.label) for e in examples] == [('a text', 'sport'), ('another', 'tech')]


def test_a_header_line_is_skipped_when_asked_and_warned_about_when_not(tmp_path, capsys):
  path = write(tmp_path / 'pairs.tsv', ['source\ttarget', 'hello\tbonjour', 'cat\tchat'])
  assert translation.read_tsv(path)[0] == ('source', 'target')
  assert capsys.readouterr().out == (f"WARNING: tsv:{path}: the first line ('source\\ttarget') looks like a header "
                                     f'of column names and is read as data; pass --config.data.tsv_header=True to '
                                     f'skip it.\n')
  splits = translation.load_pairs(data_config(source=f'tsv:{path}', eval_source=f'tsv:{path}', tsv_header=True), 0)
  assert splits.train == splits.validation == [('hello', 'bonjour'), ('cat', 'chat')]
  assert 'WARNING' not in capsys.readouterr().out
  for first in ('en\tes', 'text\tlabel', 'sentence1\tsentence2\tlabel'):
    assert sources.looks_like_header(first), first
  for first in ('hello\tbonjour', 'the cat\tanimal', 'text\t', 'go\tgo now'):
    assert not sources.looks_like_header(first), first
  labelled = write(tmp_path / 'labelled.tsv', ['text\tlabel', 'a text\tsport'])
  assert [e.label for e in classification.read_source(f'tsv:{labelled}', data_config(tsv_header=True))] == ['sport']


# ----------------------------------------------------------------------------- examples longer than seq_len
def test_long_pairs_are_counted_dropped_in_training_and_truncated_in_evaluation(capsys):
  tokenizer = CharTokenizer.train(['abcdefghij'])
  short, long = ('abc', 'de'), [('abcdefghij', 'ab'), ('ab', 'abcdefghij')]
  arrays, kept = translation.encode_pairs(tokenizer, [short] * 99 + long[:1], 6, 6, drop_long=True, split='train')
  assert len(kept) == 99 and len(arrays['source']) == 99
  arrays, kept = translation.encode_pairs(tokenizer, [short] * 98 + long, 6, 6, drop_long=False, split='valid')
  assert len(kept) == 100 and len(arrays['source']) == 100
  translation.encode_pairs(tokenizer, long, 6, 6, drop_long=False)  # no split name: nothing printed
  assert capsys.readouterr().out.splitlines() == [
      'train split: 1 of 100 pairs (1.0%) are longer than 5 source / 5 target tokens (data.seq_len): dropped.',
      'WARNING: valid split: 2 of 100 pairs (2.0%) are longer than 5 source / 5 target tokens (data.seq_len): '
      'truncated. Raise data.seq_len to keep them whole.']


def test_long_classification_examples_are_counted_and_kept_truncated(capsys):
  tokenizer = CharTokenizer.train(['abcdefgh'])
  examples = [classification.LabelledText('', text, 'x', text_b) for text, text_b in
              [('abcdef', None), ('abcdefg', None), ('abc', 'de'), ('abc', 'def')]]
  encoded = classification.encode_examples(examples, tokenizer, ['x'], seq_len=8, split='test')
  assert len(encoded) == 4 and all(e['valid'].sum() == 8 for e in encoded[1::2])
  assert capsys.readouterr().out == ('WARNING: test split: 2 of 4 examples (50.0%) are longer than 8 tokens with '
                                     '[CLS] and [SEP] (data.seq_len): truncated. Raise data.seq_len to keep them '
                                     'whole.\n')
