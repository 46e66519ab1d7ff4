"""scripts/make_folds.py: k folds of a classification source, each example in exactly one test fold."""
import collections
import os
import subprocess
import sys

import pytest

import support


def load_script():
  return support.load_file('scripts/make_folds.py')


def read(path):
  with open(path, encoding='utf-8') as f:
    return f.read().splitlines()


def test_folds_partition_the_examples_and_keep_test_out_of_training(tmp_path):
  lines = [f'story {i}  about\u3000topic\t{"ab"[i % 2]}\n' for i in range(23)]  # whitespace runs inside
  (tmp_path / 'all.tsv').write_text(''.join(lines), encoding='utf-8')
  (tmp_path / 'reversed.tsv').write_text(''.join(reversed(lines)), encoding='utf-8')
  make_folds = load_script()
  # The tsv source holds out 10% + 10% by its own rule; the folds pool all three splits again.
  counts = make_folds.write_folds(str(tmp_path / 'folds'), f'tsv:{tmp_path / "all.tsv"}', folds=5)
  tests = []
  for fold, count in enumerate(counts):
    parts = {name: read(tmp_path / 'folds' / str(fold) / f'{name}.tsv') for name in ('train', 'valid', 'test')}
    assert count == {'fold': fold, **{name: len(part) for name, part in parts.items()}}
    assert not set(parts['test']) & (set(parts['train']) | set(parts['valid']))
    assert not set(parts['train']) & set(parts['valid'])
    assert len(parts['train']) + len(parts['valid']) + len(parts['test']) == 23
    assert len(parts['valid']) == -(-(23 - len(parts['test'])) // make_folds.VALID_EVERY)
    tests += parts['test']
  assert sorted(len(read(tmp_path / 'folds' / str(k) / 'test.tsv')) for k in range(5)) == [4, 4, 5, 5, 5]
  expected = [f'story {i} about topic\t{"ab"[i % 2]}' for i in range(23)]  # one space per whitespace run
  assert collections.Counter(tests) == collections.Counter(expected)
  # The same examples in another file order: the same folds.
  make_folds.write_folds(str(tmp_path / 'again'), f'tsv:{tmp_path / "reversed.tsv"}', folds=5)
  for fold in range(5):
    for name in ('train', 'valid', 'test'):
      assert read(tmp_path / 'again' / str(fold) / f'{name}.tsv') == read(tmp_path / 'folds' / str(fold) / f'{name}.tsv')


def test_a_pair_keeps_its_two_texts():
  from data.classification import LabelledText
  pair = LabelledText('key', 'first\n text', 'yes', text_b='second\ttext ')
  assert load_script().tsv_line(pair) == 'first text\tsecond text\tyes\n'


def test_one_fold_is_refused():
  with pytest.raises(SystemExit, match='at least 2 folds'):
    load_script().write_folds('/nonexistent', folds=1)


@pytest.mark.parametrize('script', ['make_folds.py', 'tfidf_baseline.py'])
def test_a_missing_source_is_one_line_and_exit_1(script, tmp_path):
  out, missing = tmp_path / 'folds', tmp_path / 'missing.tsv'
  arguments = {'make_folds.py': [f'--out={out}'], 'tfidf_baseline.py': []}[script] + [f'--source=tsv:{missing}']
  result = subprocess.run([sys.executable, os.path.join(support.REPO, 'scripts', script), *arguments],
                          capture_output=True, text=True, cwd=str(tmp_path))
  assert result.returncode == 1 and 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines() == [f'error: tsv:{missing} does not exist; give the path of a file '
                                                f'of text<TAB>label lines.']
  assert not out.exists()
