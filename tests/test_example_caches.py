"""Two real processes build one example cache of each family (translation pairs, labelled texts,
BERT sentence pairs), each its share of the shards (the first in two build workers of its own), both
reading every row: what each reads equals what one process builds and reads alone."""
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap

import ml_collections
import numpy as np
import pytest

import support
from data import bert_data, classification, translation
from data.sources import DataError
from data.tokenizers import train_wordpiece

BUILD_AND_READ = textwrap.dedent('''
    import json, sys
    import ml_collections
    import numpy as np
    from data import bert_data, classification, translation
    index, count, families = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    for family, (config, workdir, out) in families.items():
      config = ml_collections.ConfigDict(config)
      if family == 'translation':
        splits = translation.pair_datasets(config, workdir, 0, index, count)[1]
      elif family == 'classification':
        splits = classification.labelled_datasets(config, workdir, None, index, count)[1]
      else:
        splits = bert_data.pretraining_datasets(config, workdir, 0, None, index, count)[1]
      np.savez(out, **{f'{split}.{field}': np.stack([rows[i][field] for i in range(len(rows))])
                       for split, rows in splits.items() for field in rows[0]})
''')
FAMILIES = ('translation', 'classification', 'bert')


def family_config(family: str, tmp_path) -> dict:
  """A small source of `family`, cut into several shards."""
  rng = np.random.default_rng(0)
  words = 'one two three four five six seven eight nine ten'.split()
  phrase = lambda: ' '.join(rng.choice(words, rng.integers(2, 7)))
  base = {'cache_dir': str(tmp_path / 'cache'), 'cache_shard_mb': 0.004, 'max_examples': 0, 'tokenizer': 'bpe',
          'vocab_size': 200, 'seq_len': 32, 'lowercase': True, 'eval_source': '', 'test_source': '',
          'max_malformed_fraction': 0.01, 'tsv_header': False}
  if family == 'translation':
    (tmp_path / 'pairs.tsv').write_text(''.join(f'{phrase()}\t{phrase()}\n' for _ in range(600)))
    return {**base, 'source': f'tsv:{tmp_path}/pairs.tsv', 'source_lang': '', 'target_lang': '', 'min_number': 0}
  if family == 'classification':
    (tmp_path / 'texts.tsv').write_text(''.join(f'{phrase()}\t{rng.choice(words)}\n' for _ in range(600)))
    return {**base, 'source': f'tsv:{tmp_path}/texts.tsv', 'tokenizer': 'wordpiece', 'text_field': 'text',
            'label_field': 'label'}
  text = '\n\n'.join('\n'.join(phrase().capitalize() + '.' for _ in range(rng.integers(2, 8))) for _ in range(400))
  (tmp_path / 'documents.txt').write_text(text)
  return {**base, 'source': f'text:{tmp_path}/documents.txt', 'tokenizer': 'wordpiece', 'seq_len': 32,
          'documents': 'auto', 'dupe_factor': 2, 'short_seq_prob': 0.1, 'text_field': 'text'}


@pytest.fixture(scope='module')
def two_processes(tmp_path_factory):
  """Each family's cache built by two processes at once (each builds its shards of the three caches
  in turn; process 0 with data.cache_workers=2, process 1 in itself): {family: (its config, the rows
  each process read)}."""
  root = tmp_path_factory.mktemp('two-processes')
  for family in FAMILIES:
    (root / family).mkdir()
  families = {family: family_config(family, root / family) for family in FAMILIES}
  processes = [subprocess.Popen([sys.executable, '-c', BUILD_AND_READ, str(i), '2', json.dumps(
      {family: ({**config, 'cache_workers': 2 - i}, str(root / family / f'run{i}'), str(root / family / f'rows{i}.npz'))
       for family, config in families.items()})], cwd=support.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for i in range(2)]
  outputs = [process.communicate(timeout=300) for process in processes]
  for process, (stdout, stderr) in zip(processes, outputs):
    assert process.returncode == 0, stderr[-3000:]
  assert outputs[0][0].count('in 2 processes') == 2 * len(FAMILIES), outputs[0][0]  # 'Tokenizing', 'Tokenized'
  assert 'in 2 processes' not in outputs[1][0]
  return {family: (config, [dict(np.load(root / family / f'rows{i}.npz')) for i in range(2)])
          for family, config in families.items()}


@pytest.mark.parametrize('family', FAMILIES)
def test_two_processes_build_and_read_one_cache(family, two_processes, tmp_path):
  config, two = two_processes[family]
  root = os.path.dirname(config['cache_dir'])
  shards = [json.load(open(path)) for path in glob.glob(os.path.join(config['cache_dir'], '*-v*', '[0-9]*[0-9].json'))]
  assert len(shards) >= 4 and {shard['built_by_process'] for shard in shards} == {0, 1}
  # One process alone (this one), with the same tokenizer, in a cache of its own.
  shutil.copytree(os.path.join(root, 'run0'), tmp_path / 'alone')
  alone = ml_collections.ConfigDict({**config, 'cache_dir': str(tmp_path / 'cache-alone')})
  workdir = str(tmp_path / 'alone')
  splits = (translation.pair_datasets(alone, workdir, 0)[1] if family == 'translation' else
            classification.labelled_datasets(alone, workdir)[1] if family == 'classification' else
            bert_data.pretraining_datasets(alone, workdir, 0)[1])
  one = {f'{split}.{field}': np.stack([rows[i][field] for i in range(len(rows))])
         for split, rows in splits.items() for field in rows[0]}
  assert os.listdir(tmp_path / 'cache-alone')
  for rows in two:
    assert sorted(rows) == sorted(one) and len(next(v for k, v in one.items() if k.startswith('train.'))) > 100
    for name, value in one.items():
      np.testing.assert_array_equal(rows[name], value, err_msg=name)


def test_an_error_in_a_build_worker_is_the_builds_one_line_error(tmp_path, capsys):
  """A line that is not UTF-8 in a shard that a spawned worker builds: the same DataError, naming the
  line, as when one process builds it; the shards finished before are kept."""
  config = family_config('classification', tmp_path)
  path = tmp_path / 'texts.tsv'
  lines = path.read_bytes().splitlines(keepends=True)
  lines[500] = b'caf\xe9\tone\n'  # cp1252, in one of the last shards
  path.write_bytes(b''.join(lines))
  config = ml_collections.ConfigDict({**config, 'cache_workers': 2})
  tokenizer = train_wordpiece([line.decode() for line in lines[:400]], vocab_size=200)  # not from the corpus: no
  with pytest.raises(DataError, match=r'texts.tsv:501: byte 4 of the line \(0xe9\) is not UTF-8'):  # read here
    classification.labelled_datasets(config, str(tmp_path / 'run'), tokenizer)
  assert 'in 2 processes' in capsys.readouterr().out
  assert glob.glob(os.path.join(config.cache_dir, '*-v*', '00000.json'))  # built before the error: kept
