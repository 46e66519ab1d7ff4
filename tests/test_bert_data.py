"""BERT and classification data: sentence pairs, MLM masking statistics, bbc_news, tsv, encoding."""
import ml_collections
import numpy as np
import pytest

from data import bert_data, classification
from data.sources import DataError
from data.tokenizers import train_wordpiece
from numerics import assert_close


@pytest.fixture(scope='module')
def tokenizer():
  words = 'the cat sat on a mat while dogs ran in parks near old towns with many red and blue houses'.split()
  rng = np.random.default_rng(0)
  texts = [' '.join(rng.choice(words, 12)) + '.' for _ in range(200)]
  return train_wordpiece(texts, vocab_size=120)


def test_split_sentences_keeps_titles_initials_and_quotes():
  text = ('Mr. Smith went to Washington. He said "Yes." Then J. R. Tolkien arrived! Was it 3.5 p.m. or 4?\n\n'
          '(It was late.) The end')
  assert bert_data.split_sentences(text) == [
      'Mr. Smith went to Washington.', 'He said "Yes."', 'Then J. R. Tolkien arrived!', 'Was it 3.5 p.m. or 4?',
      '(It was late.)', 'The end']


def synthetic_documents(count=60, seed=0):
  """Document d's tokens are 1000 d + a running counter: the source of every token is recoverable."""
  rng = np.random.default_rng(seed)
  documents = []
  for d in range(count):
    counter, sentences = 0, []
    for _ in range(rng.integers(3, 15)):
      length = int(rng.integers(1, 30))
      sentences.append(list(range(1000 * d + counter, 1000 * d + counter + length)))
      counter += length
    documents.append(sentences)
  return documents


def test_sentence_pairs_next_and_random():
  documents = synthetic_documents()
  rng = np.random.default_rng(1)
  max_tokens, labels = 40, []
  for index in range(len(documents)):
    for a, b, random_next in bert_data.document_pairs(documents, index, max_tokens, 0.1, rng):
      labels.append(random_next)
      assert a and b and len(a) + len(b) <= max_tokens
      assert {t // 1000 for t in a} == {index}
      # Truncation removes tokens only at the ends, so each side stays a contiguous run.
      assert a == list(range(a[0], a[0] + len(a))) and b == list(range(b[0], b[0] + len(b)))
      if random_next:
        assert {t // 1000 for t in b} != {index}
      else:
        assert {t // 1000 for t in b} == {index} and b[0] > a[-1]
  assert len(labels) > 200
  assert abs(np.mean(labels) - 0.5) < 0.07


def test_pretraining_examples_layout(tokenizer):
  documents = [[tokenizer.encode(f'the cat sat on a mat number {i}.'), tokenizer.encode('dogs ran in parks.'),
                tokenizer.encode('old towns with red houses.')] for i in range(10)]
  examples = bert_data.pretraining_examples(documents, tokenizer, 24, dupe_factor=3, seed=0)
  cls, sep, pad = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
  assert examples['tokens'].shape[1] == 24
  for tokens, segments, valid in zip(examples['tokens'], examples['segments'], examples['valid']):
    length = valid.sum()
    assert valid[:length].all() and not valid[length:].any()
    real = tokens[:length]
    assert real[0] == cls and real[-1] == sep and (real == sep).sum() == 2 and (tokens[length:] == pad).all()
    first_sep = int(np.flatnonzero(real == sep)[0])
    assert (segments[:first_sep + 1] == 0).all() and (segments[first_sep + 1:length] == 1).all()
    assert (segments[length:] == 0).all()


def test_masking_statistics(tokenizer):
  """~15% of eligible tokens chosen, 80/10/10 among them; [CLS], [SEP] and padding never chosen."""
  masker = bert_data.Masker(tokenizer, mask_prob=0.15, max_predictions=12)
  rng = np.random.default_rng(0)
  mask_id = tokenizer.token_id('[MASK]')
  chosen = eligible = masked = randomised = kept = 0
  for draw in range(3000):
    a = list(rng.integers(5, tokenizer.vocab_size, rng.integers(5, 20)))
    b = list(rng.integers(5, tokenizer.vocab_size, rng.integers(5, 20)))
    tokens, segments, valid = classification.encode_pair(a, b, 48, tokenizer.bos_id, tokenizer.eos_id,
                                                         tokenizer.pad_id)
    example = {'tokens': tokens, 'segments': segments, 'valid': valid, 'next_sentence': np.int32(0)}
    out = masker(example, np.random.default_rng(draw))
    weights = out['masked_weights'].astype(bool)
    positions = out['masked_positions'][weights]
    assert len(np.unique(positions)) == len(positions)
    special = ~valid | np.isin(tokens, [tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id])
    assert not special[positions].any()
    np.testing.assert_array_equal(out['masked_labels'][weights], tokens[positions])
    untouched = np.ones(len(tokens), bool)
    untouched[positions] = False
    np.testing.assert_array_equal(out['tokens'][untouched], tokens[untouched])
    new = out['tokens'][positions]
    chosen += len(positions)
    eligible += (~special).sum()
    masked += (new == mask_id).sum()
    kept += (new == tokens[positions]).sum()
    randomised += ((new != mask_id) & (new != tokens[positions])).sum()
    assert not np.isin(new[new != mask_id], [tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id]).any()
  assert abs(chosen / eligible - 0.15) < 0.005
  assert abs(masked / chosen - 0.8) < 0.015
  # A random replacement equals the original with probability ~1/vocab: counted as kept.
  assert abs(randomised / chosen - 0.1) < 0.012
  assert abs(kept / chosen - 0.1) < 0.012


def test_bbc_news_split_is_fixed_and_disjoint():
  articles = classification.read_bbc_news()
  assert len(articles) == 2225
  assert classification.label_names(articles) == ['business', 'entertainment', 'politics', 'sports', 'tech']
  not_utf8 = next(a for a in articles if a.key == 'sports/199.txt')
  assert '£15.8m' in not_utf8.text
  splits = classification.split_examples(articles)
  assert {k: len(v) for k, v in splits.items()} == {'train': 1780, 'valid': 222, 'test': 223}
  keys = {name: {a.key for a in part} for name, part in splits.items()}
  assert not keys['train'] & keys['valid'] and not keys['train'] & keys['test'] and not keys['valid'] & keys['test']
  shuffled = classification.split_examples(articles[::-1])
  assert all({a.key for a in shuffled[name]} == keys[name] for name in keys)


def test_tsv_reader_and_pair_encoding(tmp_path, tokenizer):
  path = tmp_path / 'pairs.tsv'
  path.write_text('the cat sat\ton a mat\tyes\n\nold towns\tred houses near parks\tno\n')
  examples = classification.read_tsv(str(path))
  assert [(e.text, e.text_b, e.label) for e in examples] == [('the cat sat', 'on a mat', 'yes'),
                                                              ('old towns', 'red houses near parks', 'no')]
  encoded = classification.encode_examples(examples, tokenizer, ['no', 'yes'], seq_len=8)
  first = encoded[0]
  assert first['label'] == 1 and first['valid'].sum() <= 8
  assert first['tokens'][0] == tokenizer.bos_id and (first['tokens'] == tokenizer.eos_id).sum() == 2
  bad = tmp_path / 'bad.tsv'
  bad.write_text('one\ttwo\tlabel\nonly one field\n')
  with pytest.raises(DataError, match='1 of 2 lines are malformed.*line 2: 1 tab-separated fields, not '
                                     'text_a<TAB>text_b<TAB>label like most lines'):
    classification.read_tsv(str(bad))


def test_encode_pair_truncates_longest_first():
  tokens, segments, valid = classification.encode_pair(list(range(10, 20)), [30, 31], 9, 2, 3, 0)
  assert tokens.tolist() == [2, 10, 11, 12, 13, 3, 30, 31, 3]
  assert segments.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1] and valid.all()


def test_classification_metrics_by_hand():
  labels = np.array([0, 0, 1, 1, 2, 2])
  predictions = np.array([0, 1, 1, 1, 0, 2])
  metrics = classification.classification_metrics(labels, predictions, 3)
  # F1: class 0 P=1/2 R=1/2 -> 1/2; class 1 P=2/3 R=1 -> 4/5; class 2 P=1 R=1/2 -> 2/3.
  assert_close(metrics['accuracy'], 4 / 6, terms=6)
  assert_close(metrics['macro_f1'], (0.5 + 0.8 + 2 / 3) / 3, terms=3)
  assert metrics['confusion'].tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]


def test_text_documents_blank_line_mode(tmp_path):
  (tmp_path / 'corpus.txt').write_text('First doc line one.\nLine two.\n\n\nSecond doc.\n')
  documents = bert_data.text_documents(str(tmp_path / '*.txt'), 'auto')
  assert [bert_data.split_sentences(d) for _, d in documents] == [['First doc line one.', 'Line two.'], ['Second doc.']]


def test_few_documents_still_hold_one_out_for_eval(tmp_path, monkeypatch):
  documents = [(f'doc{i}', f'Sentence {i} one. Sentence {i} two.') for i in range(3)]
  monkeypatch.setattr(bert_data, 'read_documents', lambda source, config, default_split='train': documents)
  # Every key hashed to train: the last document is held out instead of failing.
  monkeypatch.setattr(bert_data.sources, 'deterministic_split', lambda keys, fractions, seed=0: [[0, 1, 2], []])
  config = ml_collections.ConfigDict({'source': 'text:x', 'eval_source': ''})
  train, held, test = bert_data.pretraining_documents(config)
  assert train == [documents[0][1], documents[1][1]] and held == [documents[2][1]] and test is held
  documents[:] = documents[:2]
  monkeypatch.setattr(bert_data.sources, 'deterministic_split', lambda keys, fractions, seed=0: [[0, 1], []])
  with pytest.raises(DataError, match='needs several'):
    bert_data.pretraining_documents(config)
