"""Language-model data: documents -> tokenizer -> one token stream -> packed fixed-length windows.

Each example is {'tokens': int32 [seq_len + 1]}: inputs are tokens[:-1], targets tokens[1:].
Documents are joined with the tokenizer's EOS id so a window may span a document boundary, as in
GPT-2 training; with data.document_masking the GPT family finds the boundaries at those EOS ids
and keeps attention within each document (models/gpt.py `document_segments`). Sources: pystdlib
and text:<glob> (a file is a document), tfds:<name>[:<split>] (a record's `text` is one).
Validation is held out of data.source by the held-out rule of data/sources.py: files by the hash
of their keys, each whole or, when large, cut at a safe place (data/token_cache.py) into a start
that trains and an end held out (a single file: its last EVAL_FRACTION); TFDS records by the hash
of each record's key.

The stream is an example cache with one 1-D field per split, `tokens`: a shard's documents cut
into ~PIECE_BYTES items at safe places, tokenized BATCH_BYTES at a time by the threaded
`encode_batch`, each document followed by EOS. A run reads windows of it from the shards' files.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from data import sources, token_cache

EVAL_FRACTION = 0.05
FRACTIONS = (('train', 1 - EVAL_FRACTION), ('valid', EVAL_FRACTION))
PIECE_BYTES = 256 << 10  # text per encode_batch item: enough items per batch for every core
BATCH_BYTES = 4 << 20  # text per encode_batch call: HF tokenizers holds ~100 bytes per token until it returns


class Tokens(token_cache.Processor):
  """The processor of language-model caches: a record is an item of a document's text and whether
  the document ends with it; a split's records become its `tokens`."""
  prefix = 'lm'
  # bump with any change to what records or encode write (token_cache.Processor); 2: the held-out rule
  # (data/sources.py) deals files by size, and a TFDS split's records per piece follow a sample
  VERSION = 2

  def __init__(self, tokenizer=None):
    self.tokenizer = tokenizer

  def records(self, piece: token_cache.Range, info: dict):
    if piece.cut == 'records':
      name, split = piece.key.rsplit(':', 1)
      records = sources.tfds_records(name, split)
      for index in range(piece.start, piece.end):
        [text] = sources.tfds_fields(records[index], ['text'], piece.path, 'a language model reads the field text')
        yield f'{piece.key}:{index}', (text, True)
      return
    raw, position = token_cache.range_bytes(piece), 0
    while position < len(raw):
      stop = position + PIECE_BYTES + token_cache.SAFE_CUT_SEARCH
      end = len(raw) if len(raw) - position <= PIECE_BYTES else token_cache.safe_cut_in(
          raw, 'bytes', position + PIECE_BYTES, stop, final=stop >= len(raw))
      yield piece.key, (token_cache.decode(raw[position:end], piece, position), piece.last and end == len(raw))
      position = end

  def encode(self, split: str, records: list, index: int, info: dict) -> dict[str, np.ndarray]:
    tokenizer, dtype = self.tokenizer, token_cache.token_dtype(self.tokenizer.vocab_size)
    tokens, batch, size = [], [], 0
    for number, (text, ends) in enumerate(records):
      batch.append((text, ends))
      size += len(text)
      if size >= BATCH_BYTES or number == len(records) - 1:
        for (_, last), ids in zip(batch, tokenizer.encode_batch([text for text, _ in batch])):
          tokens.append(np.asarray(ids + [tokenizer.eos_id] if last else ids, dtype))
        batch, size = [], 0
    info.setdefault('documents', {})[split] = sum(ends for _, ends in records)
    info.setdefault('bytes', {})[split] = sum(len(text.encode()) for text, _ in records)
    return {'tokens': np.concatenate(tokens) if tokens else np.zeros((0,), dtype)}


def plan_corpus(source: str, carve_valid: bool, seed: int, default_split: str, shard_bytes: int):
  """(token_cache.Corpus, sources.Carve, {split: origin}) of an LM source: with `carve_valid`,
  EVAL_FRACTION of it held out as 'valid' by the held-out rule of data/sources.py (at most
  sources.HELD_OUT_BYTES of text, at least sources.HELD_OUT_DOCUMENTS documents, a large file cut
  to its end) and the rest 'train'; else all of it 'all'."""
  kind, argument = sources.parse_source(source)
  carve, origins = sources.Carve(whole='all'), {'all': f'{source}, whole'}
  if kind == 'tfds':
    whole, identity = token_cache.tfds_range(argument, default_split)
    name, split = whole.key.rsplit(':', 1)
    per_record = sources.bytes_per_record(sources.tfds_records(name, split), ['text'], whole.path,
                                          'a language model reads the field text')
    corpus = token_cache.plan(source, [whole], identity, shard_bytes, max(round(per_record), 256))
    if carve_valid:
      carve = sources.carve_out(FRACTIONS, ('valid',), whole.end * per_record, seed)
      origins = sources.carved_origins(source, carve, 'documents')
    return corpus, carve, origins
  if kind not in ('pystdlib', 'text'):
    raise sources.unknown_source(source, 'LM data', 'pystdlib, text:<glob> or tfds:<name>[:<split>]')
  files, identity = token_cache.text_files(source)
  if not carve_valid:
    return token_cache.plan(source, [dataclasses.replace(f, split='all') for f in files], identity,
                            shard_bytes), carve, origins
  documents = [(f.key, f.end) for f in files]
  dealt = sources.hold_out_documents(documents, FRACTIONS, ('valid',), seed, can_cut=True)
  ranges = []
  for f in files:  # a file held out whole, trained on whole, or its start trained on and its end held out
    split, held = dealt.get(f.key, ('train', 0))
    cut = f.end - held if held in (0, f.end) else token_cache.next_cut(f.path, f.end - held, f.end, 'bytes')
    ranges += [dataclasses.replace(f, end=cut, split='train')] if cut > f.start else []
    ranges += [dataclasses.replace(f, start=cut, split=split)] if cut < f.end else []
    if split != 'train':
      dealt[f.key] = (split, f.end - cut)
  origins = sources.held_out_origins(source, documents, {k: v for k, v in dealt.items() if v[1]}, ('valid',))
  carve = sources.Carve(fractions=FRACTIONS, held_out=('valid',), seed=seed)
  return token_cache.plan(source, ranges, identity, shard_bytes), carve, origins


def lm_streams(data_config, workdir: str, seed: int, process_index: int = 0, process_count: int = 1, tokenizer=None):
  """(tokenizer, {'train', 'valid', 'test'} -> token_cache.Stream, {split: cache name}).

  The split rule of data/sources.py: data.source carved into train and valid unless
  data.eval_source is named; test is the valid stream itself unless data.test_source names one.
  Each source is tokenized once into its cache (data.cache_dir), this process building its share
  of the shards; the tokenizer is `tokenizer` when given (fine-tuning keeps its base run's), else
  token_cache.shared_tokenizer's, trained when new on the first training text. Prints one line per split.
  """
  eval_source, test_source = data_config.get('eval_source', ''), data_config.get('test_source', '')
  size = token_cache.shard_bytes(data_config)
  corpora = {'train': plan_corpus(data_config.source, not eval_source, seed, 'train', size)}
  for role, source in (('valid', eval_source), ('test', test_source)):
    if source:
      corpora[role] = plan_corpus(source, False, seed, sources.TFDS_SPLITS[role], size)
  corpus, carve, _ = corpora['train']
  tokenizer = token_cache.shared_tokenizer(
      data_config, workdir, {'family': 'lm', 'corpus': corpus.identity, 'carve': dataclasses.asdict(carve)},
      lambda: (text for text, _ in token_cache.records(corpus, Tokens(), carve, carve.whole or 'train')), tokenizer)
  streams, origins, caches = {}, {}, {}
  for role, (corpus, carve, described) in corpora.items():
    identity = {'corpus': corpus.identity, 'carve': dataclasses.asdict(carve), 'shard_bytes': size,
                'tokenizer': token_cache.tokenizer_hash(tokenizer)}
    name = token_cache.cache_name(Tokens.prefix, identity)
    directory = token_cache.cache_directory(token_cache.cache_dir(data_config), name)
    cache = token_cache.build(directory, corpus, Tokens(tokenizer), carve, identity, process_index, process_count,
                              workers=token_cache.cache_workers(data_config))
    for split in described:
      target = role if split == 'all' else split
      streams[target], caches[target] = token_cache.Stream(cache, split), name
      origins[target] = f'{described[split]} ({sources.OPTIONS[role]})' if split == 'all' else described[split]
  if 'test' not in streams:
    streams['test'], caches['test'] = streams['valid'], caches['valid']
    origins['test'] = sources.origin(data_config, 'test')
  for role in sources.ROLES:
    sources.report_split(role, streams[role].documents, 'documents', origins[role])
  return tokenizer, streams, caches


def lm_datasets(data_config, workdir: str, seed: int, process_index: int = 0, process_count: int = 1,
                tokenizer=None):
  """(tokenizer, train, valid, test MapDatasets of {'tokens': int32 [seq_len + 1]} disjoint windows, the
  {split: cache name}); test is the valid dataset itself unless data.test_source names other documents.
  `tokenizer`: the one to use (`lm_streams`)."""
  import grain  # here: a process that builds caches only does not load it
  tokenizer, streams, caches = lm_streams(data_config, workdir, seed, process_index, process_count, tokenizer)
  window = data_config.seq_len + 1
  datasets = {}
  for role in sources.ROLES:
    if role == 'test' and streams['test'] is streams['valid']:
      datasets[role] = datasets['valid']
      continue
    windows = token_cache.Windows(streams[role], window, window, data_config.max_examples if role == 'train' else 0)
    report_windows(role, windows, len(streams[role]))
    datasets[role] = grain.MapDataset.source(windows)
  return tokenizer, datasets['train'], datasets['valid'], datasets['test'], caches


def report_windows(split: str, windows: token_cache.Windows, tokens: int) -> None:
  """One line: the split's windows, and the tokens of the ragged tail they leave out (a warning above
  sources.WARN_FRACTION of the split)."""
  whole = (tokens - windows.length) // windows.stride + 1
  dropped = tokens - whole * windows.length
  line = (f'{split} split: {whole} windows of {windows.length} tokens; the last {dropped} of {tokens} tokens are '
          f'dropped (less than a window).')
  print(f'WARNING: {line}' if dropped > sources.WARN_FRACTION * tokens else line, flush=True)
