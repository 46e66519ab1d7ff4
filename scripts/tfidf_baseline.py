"""TF-IDF + logistic regression on a classification source, scored on the split the models use.

  python scripts/tfidf_baseline.py                      # bbc_news
  python scripts/tfidf_baseline.py --source=tsv:data.tsv
  python scripts/tfidf_baseline.py --source=tsv:train.tsv --eval_source=tsv:valid.tsv --test_source=tsv:test.tsv

Fits on the train split (C chosen on the valid split) and prints one JSON line with test
accuracy and macro-F1, the reference the Transformer classifier and BERT are compared with.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

from data.classification import classification_metrics, label_names, load_splits  # noqa: E402
from errors import UserError  # noqa: E402


def run(source: str = 'bbc_news', eval_source: str = '', test_source: str = '') -> dict:
  from sklearn.feature_extraction.text import TfidfVectorizer
  from sklearn.linear_model import LogisticRegression
  data_config = ml_collections.ConfigDict(dict(source=source, eval_source=eval_source, test_source=test_source,
                                               max_examples=0, text_field='text', label_field='label'))
  splits = load_splits(data_config)
  labels = label_names(splits['train'])
  texts = {name: [e.text if e.text_b is None else f'{e.text} {e.text_b}' for e in part]
           for name, part in splits.items()}
  targets = {name: np.asarray([labels.index(e.label) for e in part]) for name, part in splits.items()}
  vectorizer = TfidfVectorizer(sublinear_tf=True, min_df=2, ngram_range=(1, 2))
  features = {'train': vectorizer.fit_transform(texts['train'])}
  features.update({name: vectorizer.transform(texts[name]) for name in ('valid', 'test')})
  best = None
  for c in (1.0, 10.0, 100.0):
    model = LogisticRegression(C=c, max_iter=2000).fit(features['train'], targets['train'])
    valid = classification_metrics(targets['valid'], model.predict(features['valid']), len(labels))['accuracy']
    if best is None or valid > best[0]:
      best = (valid, c, model)
  valid_accuracy, c, model = best
  test = classification_metrics(targets['test'], model.predict(features['test']), len(labels))
  return {'source': source, 'C': c, 'valid_accuracy': valid_accuracy, 'test_accuracy': test['accuracy'],
          'test_macro_f1': test['macro_f1'], 'train': len(texts['train']), 'valid': len(texts['valid']),
          'test': len(texts['test'])}


if __name__ == '__main__':
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--source', default='bbc_news')
  parser.add_argument('--eval_source', default='')
  parser.add_argument('--test_source', default='')
  args = parser.parse_args()
  try:
    result = run(args.source, args.eval_source, args.test_source)
  except UserError as error:  # a missing file, an unknown source: one line, exit 1
    sys.exit(f'error: {error}')
  print(json.dumps(result))
