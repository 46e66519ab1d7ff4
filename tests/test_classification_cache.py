"""Classification caches (data/classification.py, labelled_datasets): the cached splits equal an
independent reference (the file's layout, the 80/10/10 hash split, each shard's examples in hash
order, the shards taken in turn, [CLS] a [SEP] (b [SEP]) rows, labels as indices into the
training split's sorted labels) for tsv files of both layouts cut into several shards and for TFDS
sets; a second run reads the caches without tokenizing; a damaged shard or an unseen label is one
DataError line."""
import hashlib
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
SHARD_BYTES = 1048  # data.cache_shard_mb=0.001


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


TFDS_SPLITS = {split: [{'text': ' '.join(np.random.default_rng(i).choice(WORDS, 1 + i % 5)).encode(), 'label': i % 3}
                       for i in range(start, start + count)]
               for split, start, count in (('train', 0, 200), ('validation', 1000, 40), ('test', 2000, 30))}


def printed(capsys) -> list[str]:
  """The lines printed since the last call, less the caches' own progress lines."""
  return [line for line in capsys.readouterr().out.splitlines() if not line.startswith(('Reading ', 'Tokeniz'))]


def workdir_with_tokenizer(path) -> str:
  tokenizer = CharTokenizer.train([CHARS])
  tokenizer.save(str(path))
  return str(path)


# ----------------------------------------------------------------------------- an independent reference
def line_shards(path: str) -> list[list[str]]:
  """The file's lines in shards as the plan cuts a tsv file: after the first line end at or past
  every SHARD_BYTES from the last cut."""
  raw = open(path, 'rb').read()
  cuts = [0]
  while len(raw) - cuts[-1] > SHARD_BYTES:
    cuts.append(raw.index(b'\n', cuts[-1] + SHARD_BYTES) + 1)
  cuts.append(len(raw))
  return [raw[a:b].decode().split('\n') for a, b in zip(cuts, cuts[1:]) if b > a]


def examples_of(shards: list[list], tsv: bool) -> tuple[list[list[tuple]], int]:
  """(per shard: (key, texts, label) of its examples, the layout): a tsv line's stripped fields (empty
  ones at the end beyond two dropped), the most common count of 2 or 3 (ties: 2), all non-empty."""
  fields = [[[f.strip() for f in line.split('\t')] for line in shard if line.strip()] if tsv else shard
            for shard in shards]
  for shard in fields:
    for row in shard:
      while len(row) > 2 and not row[-1]:
        row.pop()
  counts = [sum(len(row) == n for shard in fields for row in shard) for n in (2, 3)]
  layout = 2 if counts[0] >= counts[1] else 3
  return [[('\t'.join(row[:-1]), row[:-1], row[-1]) for row in shard if len(row) == layout and all(row)]
          for shard in fields], layout


def share(key: str) -> float:
  return int.from_bytes(hashlib.sha256(f'0:{key}'.encode()).digest()[:8], 'big') / 2**64


def split_of(key: str, held_out) -> str:
  u = share(key)
  role = 'train' if u < 0.8 else 'valid' if u < 0.9 else 'test'
  return role if role in held_out else 'train'


def in_turn(shards: list[list], limit: int = 0) -> list:
  """Each shard's items in the order of SHA-256 of (0, key) (file order among equal keys), row 0 of
  every shard, then row 1, ...; the first `limit` (0: all)."""
  ordered = [sorted(shard, key=lambda example: hashlib.sha256(f'0:{example[0]}'.encode()).digest()) for shard in shards]
  items = [shard[row] for row in range(max(map(len, ordered), default=0)) for shard in ordered if row < len(shard)]
  return items[:limit or None]


def bert_input(tokenizer, texts, seq_len) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """[CLS] a [SEP] (b [SEP]) padded, the longer text losing tokens from its end first."""
  ids = [tokenizer.encode(text) for text in texts]
  while sum(map(len, ids)) > seq_len - 1 - len(ids):
    longest = max(range(len(ids)), key=lambda i: (len(ids[i]), -i))
    ids[longest] = ids[longest][:-1]
  tokens = [tokenizer.bos_id] + ids[0] + [tokenizer.eos_id] + (ids[1] + [tokenizer.eos_id] if len(ids) == 2 else [])
  segments = [0] * (len(ids[0]) + 2) + [1] * (len(tokens) - len(ids[0]) - 2)
  pad = seq_len - len(tokens)
  return (np.asarray(tokens + [tokenizer.pad_id] * pad), np.asarray(segments + [0] * pad),
          np.arange(seq_len) < len(tokens))


CASES = {  # name -> (data.source, data.eval_source, data.test_source, other settings)
    'carved': ('{all}', '', '', {}),
    'carved, first 40': ('{all}', '', '', {'max_examples': 40}),
    'test named': ('{all}', '', '{other}', {}),
    'eval named': ('{all}', '{other}', '', {}),
}


@pytest.mark.parametrize('kind', ['tsv 2 fields', 'tsv 3 fields', 'tfds'])
@pytest.mark.parametrize('case', list(CASES))
def test_the_classification_cache_equals_an_independent_reference(kind, case, tmp_path, monkeypatch):
  if kind == 'tfds':
    monkeypatch.setattr(sources, 'tfds_records', lambda name, split: TFDS_SPLITS[split])
    monkeypatch.setattr(classification, 'BYTES_PER_RECORD', 64)  # 16 records a shard
    files = {'all': 'tfds:fake', 'other': 'tfds:fake'}
    step = SHARD_BYTES // 64
    as_rows = lambda records: [[r['text'].decode(), str(r['label'])] for r in records]
    shards = {'all': [as_rows(TFDS_SPLITS['train'][a:a + step]) for a in range(0, 200, step)],
              'valid': [as_rows(TFDS_SPLITS['validation'][a:a + step]) for a in range(0, 40, step)],
              'test': [as_rows(TFDS_SPLITS['test'][a:a + step]) for a in range(0, 30, step)]}
  else:
    columns = int(kind.split()[1])
    files = {'all': f'tsv:{write(tmp_path / "all.tsv", labelled_lines(columns, 300, 0))}',
             'other': f'tsv:{write(tmp_path / "other.tsv", labelled_lines(columns, 60, 1))}'}
    shards = {'all': line_shards(str(tmp_path / 'all.tsv'))}
    shards['valid'] = shards['test'] = line_shards(str(tmp_path / 'other.tsv'))
  source, eval_source, test_source, settings = CASES[case]
  config = data_config(tmp_path / 'cache', source=source.format(**files), eval_source=eval_source.format(**files),
                       test_source=test_source.format(**files), **settings)
  tokenizer, cached, labels, caches = classification.labelled_datasets(config, workdir_with_tokenizer(tmp_path / 'run'))

  held_out = ('valid', 'test') if case.startswith('carved') else ('valid',) if case == 'test named' else ()
  examples, layout = examples_of(shards['all'], kind != 'tfds')
  expected = {role: in_turn([[e for e in shard if split_of(e[0], held_out) == role] for shard in examples],
                            settings.get('max_examples', 0) if role == 'train' else 0)
              for role in ('train', 'valid', 'test')}
  for role, named in (('valid', eval_source), ('test', test_source)):
    if named:
      expected[role] = in_turn(examples_of(shards[role], kind != 'tfds')[0])
  if eval_source:
    expected['test'] = expected['valid']
  assert list(labels) == sorted({label for _, _, label in expected['train']})
  for role in ('train', 'valid', 'test'):
    assert len(cached[role]) == len(expected[role]) > 0, role
    for i, (_, texts, label) in enumerate(expected[role]):
      got = cached[role][i]
      tokens, segments, valid = bert_input(tokenizer, texts, config.seq_len)
      for field, value in (('tokens', tokens), ('segments', segments), ('valid', valid),
                           ('label', labels.index(label))):
        assert got[field].dtype == (bool if field == 'valid' else np.int32), field
        np.testing.assert_array_equal(got[field], value, err_msg=f'{role} {i} {field}')
  assert layout == (2 if kind != 'tsv 3 fields' else 3) and set(caches) == {'train', 'valid', 'test'}
  assert len(os.listdir(tmp_path / 'cache' / caches['train'])) > 8  # several shards


def test_a_header_is_skipped_or_warned_about(tmp_path, capsys):
  path = write(tmp_path / 'all.tsv', ['text\tlabel'] + labelled_lines(2, 200, 2))
  for header in (True, False):
    # Named for validation the file is read whole: its header line (labelled 'label') is an example there too.
    config = data_config(tmp_path / 'cache', source=f'tsv:{path}', eval_source=f'tsv:{path}', tsv_header=header)
    _, cached, labels, _ = classification.labelled_datasets(config, workdir_with_tokenizer(tmp_path / f'run{header}'))
    lines = printed(capsys)
    warning = f"WARNING: tsv:{path}: the first line ('text\\tlabel') looks like a header"
    assert any(line.startswith(warning) for line in lines) is not header
    assert len(cached['train']) == 197 + (not header) and ('label' in labels) is not header


def test_a_second_run_tokenizes_and_reads_nothing(tmp_path, monkeypatch):
  path = write(tmp_path / 'all.tsv', labelled_lines(3, 300, 3))
  config = data_config(tmp_path / 'cache', source=f'tsv:{path}')
  calls = []
  encode_batch = CharTokenizer.encode_batch
  monkeypatch.setattr(CharTokenizer, 'encode_batch', lambda self, texts: calls.append(len(texts)) or
                      encode_batch(self, texts))
  tokenizer, first, labels, caches = classification.labelled_datasets(config, str(tmp_path / 'run'))
  assert calls  # built: the training texts were tokenized
  examples, _ = examples_of(line_shards(path), True)
  texts = [t for shard in examples for key, texts, _ in shard if split_of(key, ('valid', 'test')) == 'train'
           for t in texts]
  assert tokenizer.to_json() == CharTokenizer.train(texts).to_json()  # trained on the training texts
  calls.clear()
  monkeypatch.setattr(classification.Labelled, 'records', lambda *args: pytest.fail('read again'))
  for workdir in ('run', 'another-run'):  # a restart, and a new run on the same data (the shared tokenizer)
    again, second, _, same_caches = classification.labelled_datasets(config, str(tmp_path / workdir))
    assert again.to_json() == tokenizer.to_json() and same_caches == caches
    for split in classification.SPLITS:
      assert len(second[split]) == len(first[split])
      for i in range(len(first[split])):
        for field, value in first[split][i].items():
          np.testing.assert_array_equal(second[split][i][field], value)
  assert calls == []


def test_a_damaged_shard_is_one_line_naming_it(tmp_path):
  path = write(tmp_path / 'all.tsv', labelled_lines(2, 300, 4))
  config = data_config(tmp_path / 'cache', source=f'tsv:{path}')
  workdir = workdir_with_tokenizer(tmp_path / 'run')
  caches = classification.labelled_datasets(config, workdir)[3]
  shard = tmp_path / 'cache' / caches['train'] / '00001.train.tokens@2.npy'
  shard.write_bytes(shard.read_bytes()[:100])
  with pytest.raises(DataError) as error:
    classification.labelled_datasets(config, workdir)
  assert '\n' not in str(error.value)
  assert str(error.value).startswith(f'Token-cache shard {shard} is truncated or corrupt (')
  assert str(error.value).endswith('to rebuild it.')


def test_a_label_unseen_in_training_is_one_error(tmp_path):
  train = write(tmp_path / 'train.tsv', labelled_lines(2, 100, 5))
  other = write(tmp_path / 'other.tsv', ['new words\tpoetry', 'cat dog\tsport'])
  config = data_config(tmp_path / 'cache', source=f'tsv:{train}', eval_source=f'tsv:{other}')
  with pytest.raises(DataError) as error:
    classification.labelled_datasets(config, workdir_with_tokenizer(tmp_path / 'run'))
  assert str(error.value) == "Labels ['poetry'] do not occur in the training data (labels: ['arts', 'money', " \
                             "'sport', 'tech'])."
