"""Classification token caches (data/classification.py, cached_texts): the cached splits are the
in-memory `load_splits` + `encode_examples` arrays, example order and report lines included, for
tsv files of both layouts cut into several shards and for TFDS sets; a second run reads the caches
without tokenizing or scanning; a damaged shard or an unseen label is one DataError line."""
import os

import numpy as np
import pytest

from configs.base import base_config
from data import classification, sources
from data.sources import DataError
from data.tokenizers import CharTokenizer

LABELS = ('sport', 'tech', 'arts', 'money')
WORDS = 'cat dog sun moon tree river stone'.split()
CHARS = 'abcdefghijklmnopqrstuvwxyz \t'


def data_config(cache_dir, **overrides):
  """configs/base.py's data schema, caching under `cache_dir` in ~1 KB shards (a file is several)."""
  config = base_config('test').data
  config.update({'cache_dir': str(cache_dir), 'cache_shard_mb': 0.001, 'tokenizer': 'char', 'seq_len': 12,
                 'max_examples': 0, 'max_malformed_fraction': 0.05, 'text_field': 'text', 'label_field': 'label',
                 **overrides})
  return config


def labelled_lines(columns: int, count: int, seed: int) -> list[str]:
  """`count` lines of `columns` fields (short texts, so keys repeat and hashes tie), with a blank,
  a malformed line and a line of the other layout among them."""
  rng = np.random.default_rng(seed)
  lines = ['\t'.join([' '.join(rng.choice(WORDS, rng.integers(1, 6))) for _ in range(columns - 1)] +
                     [LABELS[rng.integers(len(LABELS))]]) for _ in range(count)]
  lines[9], lines[13] = '', 'no tab at all'
  lines[17] = 'a\tb\tc' if columns == 2 else 'a\tb'
  return lines


def write(path, lines) -> str:
  path.write_text(''.join(f'{line}\n' for line in lines), encoding='utf-8')
  return str(path)


def fake_tfds(monkeypatch):
  """sources.tfds_records over three small in-memory splits of {'text': bytes, 'label': int}."""
  rng = np.random.default_rng(1)
  splits = {split: [{'text': ' '.join(rng.choice(WORDS, rng.integers(1, 6))).encode(), 'label': int(rng.integers(3))}
                    for _ in range(count)] for split, count in (('train', 200), ('validation', 40), ('test', 30))}
  monkeypatch.setattr(sources, 'tfds_records', lambda name, split: splits[split])


def printed(capsys) -> list[str]:
  """The lines printed since the last call, less the caches' own progress lines."""
  return [line for line in capsys.readouterr().out.splitlines() if not line.startswith(('Reading ', 'Tokeniz'))]


def workdir_with_tokenizer(path) -> str:
  tokenizer = CharTokenizer.train([CHARS])
  tokenizer.save(str(path))
  return str(path)


def assert_same_rows(expected: list[dict], cached) -> None:
  assert len(cached) == len(expected)
  for i, row in enumerate(expected):
    got = cached[i]
    assert sorted(got) == sorted(row)
    for field, value in row.items():
      assert got[field].dtype == value.dtype and got[field].shape == value.shape, (i, field)
      np.testing.assert_array_equal(got[field], value, err_msg=f'example {i}, {field}')


CASES = {  # name -> (data.source, data.eval_source, data.test_source, other settings)
    'carved': ('{all}', '', '', {}),
    'carved, first 40': ('{all}', '', '', {'max_examples': 40}),
    'test named': ('{all}', '', '{other}', {}),
    'eval named': ('{all}', '{other}', '', {}),
}


@pytest.mark.parametrize('kind', ['tsv 2 fields', 'tsv 3 fields', 'tfds'])
@pytest.mark.parametrize('case', list(CASES))
def test_cached_splits_equal_the_in_memory_splits_in_their_order(kind, case, tmp_path, capsys, monkeypatch):
  if kind == 'tfds':
    fake_tfds(monkeypatch)
    monkeypatch.setattr(classification, 'BYTES_PER_RECORD', 64)  # 16 records a shard
    files = {'all': 'tfds:fake', 'other': 'tfds:fake'}
  else:
    columns = int(kind.split()[1])
    files = {'all': f'tsv:{write(tmp_path / "all.tsv", labelled_lines(columns, 300, 0))}',
             'other': f'tsv:{write(tmp_path / "other.tsv", labelled_lines(columns, 60, 1))}'}
  source, eval_source, test_source, settings = CASES[case]
  config = data_config(tmp_path / 'cache', source=source.format(**files), eval_source=eval_source.format(**files),
                       test_source=test_source.format(**files), **settings)
  workdir = workdir_with_tokenizer(tmp_path / 'run')
  tokenizer = CharTokenizer.train([CHARS])
  splits = classification.load_splits(config)
  labels = classification.label_names(splits['train'])
  expected = {split: classification.encode_examples(splits[split], tokenizer, labels, config.seq_len, split=split)
              for split in classification.SPLITS}
  expected_lines = printed(capsys)
  _, cached, cached_labels, caches = classification.cached_texts(config, workdir)
  assert printed(capsys) == expected_lines  # header, malformed lines, split sizes and origins, truncations
  assert list(cached_labels) == labels
  for split in classification.SPLITS:
    assert_same_rows(expected[split], cached[split])
  assert set(caches) == set(classification.SPLITS)
  if kind != 'tfds':
    shards = [name for name in os.listdir(tmp_path / 'cache' / caches['train']) if name.endswith('.json')]
    assert len(shards) > 4  # manifest.json and several shards


def test_a_header_is_skipped_or_warned_about_as_in_memory(tmp_path, capsys):
  path = write(tmp_path / 'all.tsv', ['text\tlabel'] + labelled_lines(2, 200, 2))
  for header in (True, False):
    # Named for validation the file is read whole: its header line (labelled 'label') is an example there too.
    config = data_config(tmp_path / 'cache', source=f'tsv:{path}', eval_source=f'tsv:{path}', tsv_header=header)
    splits = classification.load_splits(config)
    expected_lines = printed(capsys)
    _, cached, labels, _ = classification.cached_texts(config, workdir_with_tokenizer(tmp_path / f'run{header}'))
    assert printed(capsys)[:len(expected_lines)] == expected_lines  # then the truncations, not reported here
    assert len(cached['train']) == len(splits['train']) and ('label' in labels) is not header
  assert expected_lines[0].startswith(f"WARNING: tsv:{path}: the first line ('text\\tlabel') looks like a header")


def test_a_second_run_tokenizes_and_scans_nothing(tmp_path, monkeypatch):
  path = write(tmp_path / 'all.tsv', labelled_lines(3, 300, 3))
  config = data_config(tmp_path / 'cache', source=f'tsv:{path}')
  calls = []
  encode_batch = CharTokenizer.encode_batch
  monkeypatch.setattr(CharTokenizer, 'encode_batch', lambda self, texts: calls.append(len(texts)) or
                      encode_batch(self, texts))
  tokenizer, first, labels, caches = classification.cached_texts(config, str(tmp_path / 'run'))
  assert calls  # built: the training texts were tokenized
  in_memory = classification.load_splits(config)
  texts = [t for e in in_memory['train'] for t in (e.text, e.text_b) if t]
  assert tokenizer.to_json() == CharTokenizer.train(texts).to_json()  # trained on the training texts
  calls.clear()
  monkeypatch.setattr(classification, '_scan_corpus', lambda *args: pytest.fail('scanned again'))
  for workdir in ('run', 'another-run'):  # a restart, and a new run on the same data (the shared tokenizer)
    again, second, _, same_caches = classification.cached_texts(config, str(tmp_path / workdir))
    assert again.to_json() == tokenizer.to_json() and same_caches == caches
    for split in classification.SPLITS:
      assert_same_rows([first[split][i] for i in range(len(first[split]))], second[split])
  assert calls == []


def test_a_damaged_shard_is_one_line_naming_it(tmp_path):
  path = write(tmp_path / 'all.tsv', labelled_lines(2, 300, 4))
  config = data_config(tmp_path / 'cache', source=f'tsv:{path}')
  workdir = workdir_with_tokenizer(tmp_path / 'run')
  caches = classification.cached_texts(config, workdir)[3]
  shard = tmp_path / 'cache' / caches['train'] / '00001.train.tokens.npy'
  shard.write_bytes(shard.read_bytes()[:100])
  with pytest.raises(DataError) as error:
    classification.cached_texts(config, workdir)
  assert '\n' not in str(error.value)
  assert str(error.value).startswith(f'Cache shard {shard} is truncated or corrupt (')
  assert str(error.value).endswith('to rebuild it.')


def test_a_label_unseen_in_training_is_the_in_memory_error(tmp_path):
  train = write(tmp_path / 'train.tsv', labelled_lines(2, 100, 5))
  other = write(tmp_path / 'other.tsv', ['new words\tpoetry', 'cat dog\tsport'])
  config = data_config(tmp_path / 'cache', source=f'tsv:{train}', eval_source=f'tsv:{other}')
  splits = classification.load_splits(config)
  with pytest.raises(DataError) as in_memory:
    classification.encode_examples(splits['valid'], CharTokenizer.train([CHARS]),
                                   classification.label_names(splits['train']), 12)
  with pytest.raises(DataError) as cached:
    classification.cached_texts(config, workdir_with_tokenizer(tmp_path / 'run'))
  assert str(cached.value) == str(in_memory.value)
  assert str(cached.value).startswith("Labels ['poetry'] do not occur in the training data")
