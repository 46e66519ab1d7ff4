"""K-fold cross-validation splits of a classification source, written as tsv files.

One fixed test split of a few hundred examples cannot tell two good classifiers apart: on
bbc_news' 223 test articles one article is 0.45 points, and the standard error of an accuracy of
0.98 is ~0.9 points. Folds score every example once. Each fold's directory holds train.tsv,
valid.tsv (a ninth of the other folds: what picks the best checkpoint and TF-IDF's C) and test.tsv
(the fold), text<TAB>label per line (text_a<TAB>text_b<TAB>label for pairs), whitespace runs
written as one space (neither WordPiece nor TF-IDF tells them apart).

  python scripts/make_folds.py --out=/tmp/bbc_folds                  # bbc_news, 5 folds
  for k in 0 1 2 3 4; do
    d=/tmp/bbc_folds/$k
    python scripts/tfidf_baseline.py --source=tsv:$d/train.tsv --eval_source=tsv:$d/valid.tsv --test_source=tsv:$d/test.tsv
    python launch.py --config=configs/classifier.py:default --workdir=runs/fold$k --config.data.source=tsv:$d/train.tsv \
      --config.data.eval_source=tsv:$d/valid.tsv --config.data.test_source=tsv:$d/test.tsv
  done

Examples are pooled from every split the source's rule gives (data/classification.py's
`load_splits`) and dealt to folds in the order of a hash of their keys, so fold sizes differ by
at most one and the folds do not depend on the order of the files. Small sources only: it holds
every example in memory, as `load_splits` does.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_collections  # noqa: E402

from data.classification import key_digest, load_splits  # noqa: E402
from errors import UserError  # noqa: E402

VALID_EVERY = 9  # of the other folds' examples (in hash order), every 9th is validation


def tsv_line(example) -> str:
  texts = [example.text] if example.text_b is None else [example.text, example.text_b]
  return '\t'.join(' '.join(text.split()) for text in texts) + f'\t{example.label}\n'


def write_folds(out: str, source: str = 'bbc_news', folds: int = 5) -> list[dict]:
  """Write out/<k>/{train,valid,test}.tsv for k < folds; returns each fold's example counts."""
  if folds < 2:
    raise SystemExit(f'--folds={folds}: cross-validation needs at least 2 folds.')
  data_config = ml_collections.ConfigDict(dict(source=source, eval_source='', test_source='', max_examples=0,
                                               text_field='text', label_field='label'))
  pooled = sorted((e for split in load_splits(data_config).values() for e in split), key=lambda e: key_digest(e.key))
  counts = []
  for fold in range(folds):
    rest = [e for rank, e in enumerate(pooled) if rank % folds != fold]
    parts = {'test': pooled[fold::folds], 'valid': rest[::VALID_EVERY],
             'train': [e for i, e in enumerate(rest) if i % VALID_EVERY]}
    directory = os.path.join(out, str(fold))
    os.makedirs(directory, exist_ok=True)
    for name, examples in parts.items():
      with open(os.path.join(directory, f'{name}.tsv'), 'w', encoding='utf-8') as f:
        f.writelines(tsv_line(e) for e in examples)
    counts.append({'fold': fold, **{name: len(examples) for name, examples in parts.items()}})
  return counts


if __name__ == '__main__':
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', required=True, help='directory for <fold>/{train,valid,test}.tsv')
  parser.add_argument('--source', default='bbc_news', help='a classification source (bbc_news, tsv:, tfds:)')
  parser.add_argument('--folds', type=int, default=5)
  args = parser.parse_args()
  try:
    counts = write_folds(args.out, args.source, args.folds)
  except UserError as error:  # a missing file, an unknown source: one line, exit 1 (nothing written yet)
    sys.exit(f'error: {error}')
  for line in counts:
    print(json.dumps(line))
