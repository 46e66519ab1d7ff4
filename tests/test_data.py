"""Data layer: sources, tokenizers saved with a run, packing, TFDS without TensorFlow."""
import os

import ml_collections
import numpy as np
import pytest

import support
from data import lm, sources, token_cache
from data.tokenizers import CharTokenizer, load_tokenizer, train_bpe, train_wordpiece


def test_char_tokenizer_round_trip_and_reload(tmp_path):
  tok = CharTokenizer.train(['hello world'])
  ids = tok.encode('hello there')
  assert ids[:5] == tok.encode('hello') and tok.token_id('t') is None and ids[6] == tok.unk_id
  tok.save(str(tmp_path))
  again = load_tokenizer(str(tmp_path))
  assert again.encode('hello world') == tok.encode('hello world') and tok.decode(tok.encode('hello')) == 'hello'


def test_bpe_is_byte_level_lossless_and_reloads(tmp_path):
  text = 'def main(argv):\n    return sorted(argv)  # ünïcode ✓\n'
  tok = train_bpe([text * 50], vocab_size=300)
  assert tok.vocab_size <= 300 and tok.pad_id == 0 and tok.eos_id == 2
  assert tok.decode(tok.encode(text)) == text
  tok.save(str(tmp_path))
  assert load_tokenizer(str(tmp_path)).encode(text) == tok.encode(text)


def test_wordpiece_has_bert_specials_and_pairs():
  tok = train_wordpiece(['The cat sat on the mat.', 'A dog sat on a log.'] * 20, vocab_size=120)
  assert [tok.token_id(t) for t in ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')] == [0, 1, 2, 3, 4]
  ids, segments = tok.encode_pair('the cat', 'a dog')
  assert ids[0] == 2 and ids.count(3) == 2 and segments == [0] * (ids.index(3) + 1) + [1] * (len(ids) - ids.index(3) - 1)


def test_pystdlib_has_no_test_folders_and_is_large():
  files, identity = token_cache.text_files('pystdlib')
  assert len(files) > 300 and sum(f.end for f in files) > 5_000_000 and identity['kind'] == 'pystdlib'
  assert not any(part in ('test', 'tests') for f in files for part in f.key.split(os.sep)[:-1])
  assert any(f.key == 'os.py' for f in files) and not any(f.strict for f in files)  # undecodable bytes replaced


def test_deterministic_split_is_stable_disjoint_and_order_free():
  keys = [f'file{i}.py' for i in range(1000)]
  train, held = sources.deterministic_split(keys, [0.9, 0.1], seed=3)
  assert sorted(train + held) == list(range(1000)) and 60 < len(held) < 140
  again = sources.deterministic_split(keys[::-1], [0.9, 0.1], seed=3)
  assert sorted(keys[::-1][i] for i in again[1]) == sorted(keys[i] for i in held)


def test_documents_are_joined_with_eos_into_windows(tmp_path):
  tok = CharTokenizer.train(['abc'])
  tok.save(str(tmp_path / 'run'))
  for name, text in (('1.txt', 'abc'), ('2.txt', 'cab')):
    (tmp_path / 'corpus').mkdir(exist_ok=True)
    (tmp_path / 'corpus' / name).write_text(text)
  config = ml_collections.ConfigDict({'source': f'text:{tmp_path}/corpus/*.txt', 'cache_dir': str(tmp_path / 'cache'),
                                      'eval_source': f'text:{tmp_path}/corpus/1.txt', 'seq_len': 3, 'max_examples': 0})
  _, train, _, _, _ = lm.lm_datasets(config, str(tmp_path / 'run'), seed=0)
  a, b, c, eos = tok.encode('a')[0], tok.encode('b')[0], tok.encode('c')[0], tok.eos_id
  np.testing.assert_array_equal([train[i]['tokens'] for i in range(len(train))], [[a, b, c, eos], [c, a, b, eos]])
  config.seq_len = 8
  with pytest.raises(sources.DataError, match='fewer than one sequence'):
    lm.lm_datasets(config, str(tmp_path / 'run'), seed=0)


def build_tiny_tfds(data_dir):
  import tensorflow_datasets as tfds

  class TinyStories(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version('1.0.0')

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({'text': tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(40, 0), "validation": self._generate_examples(8, 1)}

    def _generate_examples(self, n, seed):
      rng = np.random.default_rng(seed)
      for i in range(n):
        yield i, {'text': ' '.join(support.WORDS[j] for j in rng.integers(0, len(support.WORDS), 30))}

  TinyStories(data_dir=data_dir, file_format='array_record').download_and_prepare()


def test_tfds_source_reads_array_record_without_tensorflow(tmp_path, monkeypatch):
  build_tiny_tfds(str(tmp_path / 'tfds'))
  monkeypatch.setenv('TFDS_DATA_DIR', str(tmp_path / 'tfds'))
  config = ml_collections.ConfigDict({'source': 'tfds:tiny_stories', 'eval_source': 'tfds:tiny_stories:validation',
                                      'tokenizer': 'char', 'vocab_size': 0, 'lowercase': True, 'seq_len': 16,
                                      'max_examples': 0, 'cache_dir': str(tmp_path / 'cache')})
  tokenizer, train, evaluation, test, _ = lm.lm_datasets(config, str(tmp_path / 'run'), seed=0)
  assert len(train) > len(evaluation) > 0 and train[0]['tokens'].shape == (17,)
  assert test is evaluation  # data.test_source is empty: the test split is the eval split
  assert os.path.exists(tmp_path / 'run' / 'tokenizer.json')
  assert 'alpha' in tokenizer.decode(np.concatenate([train[i]['tokens'] for i in range(len(train))]))
  import sys
  assert 'tensorflow' not in sys.modules


def test_text_split_keys_do_not_depend_on_where_the_corpus_lives(tmp_path):
  here = support.write_corpus(str(tmp_path / 'a' / 'corpus'), files=30)
  there = support.write_corpus(str(tmp_path / 'b' / 'elsewhere' / 'corpus'), files=30)
  plans = [lm.plan_corpus(source, True, 0, 'train', 1 << 20)[0] for source in (here, there)]
  keys = [[(piece.key, piece.split) for shard in corpus.shards for piece in shard] for corpus in plans]
  assert [key for key, _ in keys[0]] == [f'doc{i}.txt' for i in sorted(range(30), key=str)]
  assert keys[0] == keys[1] and 'valid' in {split for _, split in keys[0]}
