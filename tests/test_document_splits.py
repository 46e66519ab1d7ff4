"""A document is in one split only, however many cache pieces it is read in (issue 52): BERT
pretraining reads a file in pieces of a quarter shard, and every piece of a document must go where
the document's key goes, for whole files (data.documents=file) and for blocks between blank lines
(a block with no blank line near is cut at a newline). The text of every document is marked with
its own word, so a document on both sides of the split shows as a word on both sides."""
import re

import numpy as np
import pytest

from configs import bert
from data import bert_data, token_cache, tokenizers

WORDS = 'alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi pi rho'.split()
MARK = re.compile(r'qx(\d+)')


def document(number: int, sentences: int, rng) -> str:
  """`sentences` lines, each a sentence holding the document's mark qx<number>."""
  return '\n'.join(f'Qx{number} ' + ' '.join(rng.choice(WORDS, rng.integers(4, 10))) + '.' for _ in range(sentences))


def marks_by_split(monkeypatch, tmp_path, source: str, documents: str) -> dict[str, set[int]]:
  """{split: the marks of the documents the cache build gave that split}, from pretraining_datasets
  itself (in this process: data.cache_workers=1) with ~20 KB shards, so ~5 KB pieces."""
  config = bert.get_config('tiny').data
  config.update({'source': source, 'cache_dir': str(tmp_path / 'cache'), 'max_examples': 0, 'documents': documents,
                 'cache_shard_mb': 0.02, 'cache_workers': 1})
  seen = {}
  encode = bert_data.Documents.encode

  def recording(self, split, texts, index, info):
    seen.setdefault(split, set()).update(int(mark) for text in texts for mark in MARK.findall(text.lower()))
    return encode(self, split, texts, index, info)

  monkeypatch.setattr(bert_data.Documents, 'encode', recording)
  tokenizer = tokenizers.train_wordpiece([' '.join(WORDS) + ' qx0123456789 .'] * 4, vocab_size=200)
  bert_data.pretraining_datasets(config, str(tmp_path / 'run'), 0, tokenizer)
  return seen


def test_every_piece_of_a_large_file_goes_where_the_file_goes(tmp_path, monkeypatch):
  rng = np.random.default_rng(0)
  folder = tmp_path / 'corpus'
  folder.mkdir()
  for number in range(120):  # a large file (~120 pieces) among small ones, one document each
    (folder / f'doc{number:03d}.txt').write_text(document(number, 4000 if number == 7 else 6, rng) + '\n')
  seen = marks_by_split(monkeypatch, tmp_path, f'text:{folder}/*.txt', 'file')
  assert len(seen['valid']) >= 2 and 7 in seen['train'] | seen['valid']
  assert not seen['train'] & seen['valid'], f'documents in both splits: {sorted(seen["train"] & seen["valid"])}'


def test_every_piece_of_a_long_blank_line_document_goes_where_its_start_goes(tmp_path, monkeypatch):
  # Searching only 2 KB for a blank line, the cuts fall at newlines inside the long documents.
  monkeypatch.setattr(token_cache, 'SAFE_CUT_SEARCH', 2048)
  rng = np.random.default_rng(1)
  texts = [document(number, 500 if number % 20 == 5 else 5, rng) for number in range(400)]
  path = tmp_path / 'corpus.txt'
  path.write_text('\n\n'.join(texts) + '\n')
  plan = bert_data.plan_source(f'text:{path}', 'train', bert.get_config('tiny').data, 20971)[0]
  continued = bert_data.continued_documents(plan)
  assert len(continued) >= 60  # the long documents span several pieces each
  seen = marks_by_split(monkeypatch, tmp_path, f'text:{path}', 'auto')  # one file: blank-line documents
  assert len(seen['valid']) >= 2 and {5, 45, 85} <= seen['train'] | seen['valid']
  assert not seen['train'] & seen['valid'], f'documents in both splits: {sorted(seen["train"] & seen["valid"])}'


@pytest.mark.parametrize('ending', ['\n', '\n\n', '\n \r\n'])
def test_a_continued_document_takes_the_key_of_its_start(tmp_path, monkeypatch, ending):
  """The blocks read piece by piece, joined by key, are the whole file's blocks under their keys: a
  block's key is the offset where its document starts in the file, whichever piece holds it."""
  monkeypatch.setattr(token_cache, 'SAFE_CUT_SEARCH', 512)
  rng = np.random.default_rng(2)
  texts = [document(number, 60 if number % 3 == 0 else 2, rng) for number in range(30)]
  raw = ('\n\n'.join(texts) + ending).encode()
  path = tmp_path / 'corpus.txt'
  path.write_bytes(raw)
  config = bert.get_config('tiny').data
  corpus, _, _, blank_lines = bert_data.plan_source(f'text:{path}', 'train', config, 4096)
  assert blank_lines and sum(map(len, corpus.shards)) >= 20
  processor = bert_data.Documents(config, 0, blank_lines, continued=bert_data.continued_documents(corpus))
  read = {}
  for piece in (piece for shard in corpus.shards for piece in shard):
    for key, text in processor.records(piece, {}):
      read[key] = read.get(key, '') + text
  starts = [0] + [m.end() for m in token_cache.BLANK_LINE.finditer(raw)]
  whole = {f'corpus.txt:{start}': raw[start:end].decode() for start, end in zip(starts, [
      m.start() for m in token_cache.BLANK_LINE.finditer(raw)] + [len(raw)]) if raw[start:end].strip()}
  assert read == whole
