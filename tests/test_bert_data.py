"""BERT and classification data: sentence pairs, MLM masking statistics, bbc_news, tsv, encoding."""
import hashlib
import os

import numpy as np
import pytest

from configs import bert
from configs.base import base_config
from data import bert_data, classification, sources
from data.sources import DataError
from data import tokenizers as tokenizers_lib
from data.tokenizers import CharTokenizer, train_wordpiece
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
  documents = bert_data.TokenizedDocuments.of(synthetic_documents())
  draws = bert_data.Draws(np.random.default_rng(1), np.random.default_rng(2))
  max_tokens, labels = 40, []
  for index in range(len(documents)):
    pairs = np.asarray(bert_data.document_pairs(documents, index, max_tokens, 0.1, draws), np.int64)
    pairs[:, :4] = bert_data.truncate_pairs(pairs[:, :4], max_tokens, draws)
    for a_start, a_end, b_start, b_end, random_next in pairs.tolist():
      a, b = documents.tokens[a_start:a_end].tolist(), documents.tokens[b_start:b_end].tolist()
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
  examples = bert_data.sentence_pairs(bert_data.TokenizedDocuments.of(documents), tokenizer, 24, np.random.default_rng(0), dupe_factor=3,
                                      short_seq_prob=0.1)
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
    tokens, segments, valid = tokenizers_lib.encode_pair(a, b, 48, tokenizer.bos_id, tokenizer.eos_id,
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
  parts = sources.bbc_news()
  articles = sorted(parts['train'] + parts['valid'] + parts['test'])
  assert len(articles) == 2225
  assert sorted({label for _, _, label in articles}) == ['business', 'entertainment', 'politics', 'sports', 'tech']
  not_utf8 = next(text for key, text, _ in articles if key == 'sports/199.txt')
  assert '£15.8m' in not_utf8
  assert {k: len(v) for k, v in parts.items()} == {'train': 1780, 'valid': 222, 'test': 223}
  # The hash order of the keys, cut at exactly 80% and 90%, each part in that order.
  order = sorted(articles, key=lambda article: hashlib.sha256(f'0:{article[0]}'.encode()).digest())
  assert parts['train'] + parts['valid'] + parts['test'] == order
  root = sources.bbc_news_dir()
  assert {key for key, _, _ in articles} == {f'{label}/{name}' for label in os.listdir(root)
                                             if os.path.isdir(os.path.join(root, label))
                                             for name in os.listdir(os.path.join(root, label))}


def test_tsv_pairs_are_read_and_encoded(tmp_path):
  path = tmp_path / 'pairs.tsv'
  path.write_text('the cat sat\ton a mat\tyes\n\nold towns\tred houses near parks\tno\n')
  config = base_config('test').data
  config.update({'source': f'tsv:{path}', 'eval_source': f'tsv:{path}', 'cache_dir': str(tmp_path / 'cache'),
                 'tokenizer': 'char', 'seq_len': 16, 'max_examples': 0})
  tokenizer, splits, labels, _ = classification.labelled_datasets(config, str(tmp_path / 'run'))
  assert labels == ('no', 'yes') and len(splits['train']) == 2
  first = next(splits['train'][i] for i in range(2) if splits['train'][i]['label'] == 1)
  ids = [tokenizer.encode(text) for text in ('the cat sat', 'on a mat')]
  while len(ids[0]) + len(ids[1]) > 13:  # [CLS] a [SEP] b [SEP] in 16: the longer loses its end first
    longer = 0 if len(ids[0]) >= len(ids[1]) else 1
    ids[longer] = ids[longer][:-1]
  assert first['tokens'].tolist() == [tokenizer.bos_id, *ids[0], tokenizer.eos_id, *ids[1], tokenizer.eos_id]
  assert first['segments'].tolist() == [0] * (len(ids[0]) + 2) + [1] * (len(ids[1]) + 1) and first['valid'].all()
  bad = tmp_path / 'bad.tsv'
  bad.write_text('one\ttwo\tlabel\nonly one field\n')
  config.update({'source': f'tsv:{bad}', 'eval_source': f'tsv:{bad}'})
  with pytest.raises(DataError, match='1 of 2 lines are malformed.*line 2: 1 tab-separated fields, not '
                                     'text_a<TAB>text_b<TAB>label like most lines'):
    classification.labelled_datasets(config, str(tmp_path / 'run'), CharTokenizer.train(['abc']))


def test_encode_pair_truncates_longest_first():
  tokens, segments, valid = tokenizers_lib.encode_pair(list(range(10, 20)), [30, 31], 9, 2, 3, 0)
  assert tokens.tolist() == [2, 10, 11, 12, 13, 3, 30, 31, 3]
  assert segments.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1] and valid.all()


def reference_bert_input(a: list[int], b: list[int] | None, seq_len: int, cls=2, sep=3, pad=0):
  """BERT's fine-tuning truncation as a loop: a token from the end of the longer (a on a tie) until it fits."""
  a, b = list(a), list(b) if b is not None else None
  while len(a) + (len(b) + 1 if b is not None else 0) > seq_len - 2:
    (a if b is None or len(a) >= len(b) else b).pop()
  tokens = [cls] + a + [sep] + (b + [sep] if b is not None else [])
  segments = [0] * (len(a) + 2) + [1] * (len(tokens) - len(a) - 2)
  return tokens + [pad] * (seq_len - len(tokens)), segments + [0] * (seq_len - len(tokens)), len(tokens)


def test_bert_inputs_of_a_batch_equal_the_truncation_loop_row_by_row():
  lengths = [(n_a, n_b) for n_a in range(14) for n_b in [None, *range(14)]]
  ids_a = [list(range(100, 100 + n_a)) for n_a, _ in lengths]
  ids_b = [list(range(200, 200 + n_b)) if n_b is not None else None for _, n_b in lengths]
  for seq_len in range(3, 13):
    tokens, segments, valid, cut = tokenizers_lib.bert_inputs(ids_a, ids_b, seq_len, 2, 3, 0)
    for row, (a, b) in enumerate(zip(ids_a, ids_b)):
      want_tokens, want_segments, length = reference_bert_input(a, b, seq_len)
      assert tokens[row].tolist() == want_tokens and segments[row].tolist() == want_segments, (seq_len, a, b)
      assert valid[row].tolist() == [i < length for i in range(seq_len)]
      assert cut[row] == (len(a) + (len(b) + 1 if b is not None else 0) > seq_len - 2)


def test_truncate_pairs_equal_bert_truncation_loop_with_the_same_coins():
  """Every (len a, len b, budget) up to 9 + 9 tokens, as one batch of pairs, several seeds: the closed
  form keeps the token ranges of BERT's loop (the longer loses a token, b on a tie, from its front
  when its coin, `coins.random() < 0.5` drawn one at a time, says so), the pairs' coins in turn."""
  cases = [(length_a, length_b, max_tokens) for length_a in range(10) for length_b in range(10)
           for max_tokens in range(1, length_a + length_b + 1)]
  for seed in range(4):
    pairs = {max_tokens: [] for max_tokens in range(1, 19)}  # truncate_pairs takes one budget a call
    for length_a, length_b, max_tokens in cases:
      pairs[max_tokens].append((100, 100 + length_a, 200, 200 + length_b))
    coins = np.random.default_rng([seed, 1])
    draws = bert_data.Draws(np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1]))
    for max_tokens, batch in pairs.items():
      got = bert_data.truncate_pairs(np.asarray(batch, np.int64), max_tokens, draws)
      for (a0, a1, b0, b1), (g0, g1, h0, h1) in zip(batch, got.tolist()):
        a, b = list(range(a0, a1)), list(range(b0, b1))
        while len(a) + len(b) > max_tokens:
          longer = a if len(a) > len(b) else b
          longer.pop(0 if coins.random() < 0.5 else -1)
        assert (list(range(g0, g1)), list(range(h0, h1))) == (a, b), (a1 - a0, b1 - b0, max_tokens, seed)
    assert draws.flips(1)[0] == (coins.random() < 0.5)  # the next coin of each: none taken twice or skipped


def test_draws_are_the_generators_numbers_one_at_a_time():
  draws = bert_data.Draws(np.random.default_rng(7), np.random.default_rng(8))
  draws.BLOCK = 5  # blocks much smaller than what is taken
  uniforms, coins = np.random.default_rng(7), np.random.default_rng(8)
  assert [draws.uniform() for _ in range(12)] == [uniforms.random() for _ in range(12)]
  assert draws.below(10) == int(uniforms.random() * 10)
  for count in (3, 0, 11, 1):
    assert draws.flips(count).tolist() == [coins.random() < 0.5 for _ in range(count)]


@pytest.mark.parametrize('kind', ['wordpiece', 'bpe'])
def test_sentences_encoded_per_document_equal_each_sentence_encoded_alone(kind):
  texts = ['The cat sat. On the mat!', 'Dogs ran in the park near 3 old towns.', 'Ünïcode ünd "quotes" (here).']
  trained = (train_wordpiece(texts * 20, vocab_size=150) if kind == 'wordpiece'
             else tokenizers_lib.train_bpe(texts * 20, vocab_size=300))
  documents = [['The cat sat.', 'On the mat!'], ['Dogs ran', '', 'in the park near 3 old towns.'], ['Ünïcode ünd'],
               ['"quotes" (here).', 'The cat.']]
  ids, lengths = trained.encode_sentences(documents)
  alone = [trained.encode(sentence) for document in documents for sentence in document]
  assert lengths.tolist() == [len(x) for x in alone] and lengths[3] == 0  # the empty sentence
  assert [i for x in ids for i in x] == [i for x in alone for i in x]


def test_classification_metrics_by_hand():
  labels = np.array([0, 0, 1, 1, 2, 2])
  predictions = np.array([0, 1, 1, 1, 0, 2])
  metrics = classification.classification_metrics(labels, predictions, 3)
  # F1: class 0 P=1/2 R=1/2 -> 1/2; class 1 P=2/3 R=1 -> 4/5; class 2 P=1 R=1/2 -> 2/3.
  assert_close(metrics['accuracy'], 4 / 6, terms=6)
  assert_close(metrics['macro_f1'], (0.5 + 0.8 + 2 / 3) / 3, terms=3)
  assert metrics['confusion'].tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]


def test_blank_line_documents(tmp_path):
  (tmp_path / 'corpus.txt').write_text('First doc line one.\nLine two.\n\n\nSecond doc.\n')
  config = bert.get_config('tiny').data
  corpus, carve, _, blank_lines = bert_data.plan_source(f'text:{tmp_path}/*.txt', 'train', config, 1 << 20)
  assert blank_lines  # 'auto': one file, documents between blank lines
  records = [record for piece in corpus.shards[0] for record in bert_data.Documents(config, 0, True).records(piece, {})]
  assert [(key, bert_data.split_sentences(text)) for key, text in records] == [
      ('corpus.txt:0', ['First doc line one.', 'Line two.']), ('corpus.txt:32', ['Second doc.'])]


def test_few_documents_are_one_error_line(tmp_path):
  directory = tmp_path / 'corpus'
  directory.mkdir()
  for i in range(3):
    (directory / f'doc{i}.txt').write_text(f'Sentence {i} one. Sentence {i} two.')
  config = bert.get_config('tiny').data
  config.update({'source': f'text:{directory}/*.txt', 'cache_dir': str(tmp_path / 'cache')})
  with pytest.raises(DataError) as error:
    bert_data.pretraining_datasets(config, str(tmp_path / 'run'), 0)
  assert str(error.value) == (f'text:{directory}/*.txt has 3 documents with 1 in the valid split: BERT pretraining '
                              f'needs several (random next sentences come from other documents, and some are held '
                              f'out). Use data.documents=blank_line or more files.')
