"""English -> Spanish message pairs from the machine's own gettext catalogs, as train/valid/test TSVs.

  python scripts/make_gettext_corpus.py --out_dir=/tmp/gettext_es
  python launch.py --config=configs/transformer.py --config.data.source=tsv:/tmp/gettext_es/train.tsv \
      --config.data.eval_source=tsv:/tmp/gettext_es/valid.tsv --config.data.test_source=tsv:/tmp/gettext_es/test.tsv

Every catalog matching --catalogs is read with Python's `gettext.GNUTranslations`. Each message
gives one pair (msgid, msgstr): plural messages their singular forms, messages with a context
(msgctxt) the msgid without it; the header (empty msgid) is skipped. Whitespace runs, newlines
included, become one space, so that each pair is one line; pairs with a tab or an empty side are
dropped, and duplicates removed. Messages are shuffled with --seed and written to --out_dir as
train.tsv, valid.tsv and test.tsv (--valid_size and --test_size pairs, the rest train); all
translations of one English message go to the same file, so held-out messages are never trained on.
"""
from __future__ import annotations

import argparse
import collections
import gettext
import glob
import os
import random

Pair = tuple[str, str]


def catalog_pairs(path: str) -> list[Pair]:
  """The raw (English, translation) pairs of one .mo catalog, in catalog order."""
  with open(path, 'rb') as f:
    catalog = gettext.GNUTranslations(f)._catalog
  pairs = []
  for key, translation in catalog.items():
    if isinstance(key, tuple):  # plural message: (msgid, form index); form 0 is the singular
      msgid, form = key
      if form:
        continue
    else:
      msgid = key
    msgid = msgid.rpartition('\x04')[2]  # 'context\x04msgid'
    if msgid:
      pairs.append((msgid, translation))
  return pairs


def clean(pair: Pair) -> Pair | None:
  """The pair on one line (whitespace runs -> one space), or None when a side has a tab or is empty."""
  if '\t' in pair[0] or '\t' in pair[1]:
    return None
  english, translation = (' '.join(text.split()) for text in pair)
  return (english, translation) if english and translation else None


def split_corpus(pairs: set[Pair], valid_size: int, test_size: int, seed: int) -> dict[str, list[Pair]]:
  """{'train', 'valid', 'test'}: English messages (with all their translations) in a seeded random
  order fill test, then valid; a message too large for what is left of them goes to train."""
  groups = collections.defaultdict(list)
  for english, translation in sorted(pairs):
    groups[english].append((english, translation))
  order = sorted(groups)
  random.Random(seed).shuffle(order)
  splits = {'train': [], 'valid': [], 'test': []}
  for english in order:
    group = groups[english]
    if len(splits['test']) + len(group) <= test_size:
      splits['test'].extend(group)
    elif len(splits['valid']) + len(group) <= valid_size:
      splits['valid'].extend(group)
    else:
      splits['train'].extend(group)
  return splits


def main(argv: list[str] | None = None) -> dict[str, int]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--catalogs', default='/usr/share/locale/es/LC_MESSAGES/*.mo', help='glob of .mo files')
  parser.add_argument('--out_dir', required=True)
  parser.add_argument('--valid_size', type=int, default=1000)
  parser.add_argument('--test_size', type=int, default=1000)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args(argv)
  paths = sorted(glob.glob(os.path.expanduser(args.catalogs)))
  if not paths:
    parser.error(f'--catalogs={args.catalogs} matched no files.')
  counts = collections.Counter()
  pairs = set()
  for path in paths:
    try:
      raw = catalog_pairs(path)
    except (OSError, UnicodeDecodeError) as e:  # not a .mo file, or not in its declared charset
      print(f'skipped {path}: {e}')
      counts['unreadable catalogs'] += 1
      continue
    counts['catalogs'] += 1
    counts['messages'] += len(raw)
    for pair in raw:
      cleaned = clean(pair)
      counts['with a tab or an empty side'] += cleaned is None
      if cleaned is not None:
        pairs.add(cleaned)
  if len(pairs) <= args.valid_size + args.test_size:
    parser.error(f'{len(pairs)} pairs, not more than --valid_size + --test_size = '
                 f'{args.valid_size + args.test_size}; lower them.')
  counts['unique pairs'] = len(pairs)
  os.makedirs(args.out_dir, exist_ok=True)
  for name, split in split_corpus(pairs, args.valid_size, args.test_size, args.seed).items():
    with open(os.path.join(args.out_dir, f'{name}.tsv'), 'w', encoding='utf-8', newline='\n') as f:
      f.writelines(f'{english}\t{translation}\n' for english, translation in split)
    counts[name] = len(split)
  for name, count in counts.items():
    print(f'{name}: {count}')
  print(f'written to {args.out_dir}/{{train,valid,test}}.tsv')
  return dict(counts)


if __name__ == '__main__':
  main()
