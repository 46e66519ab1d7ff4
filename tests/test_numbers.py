"""One source for every number (issue 61): the measured numbers README.md and the docs show are rows of
measurements/. The tables are generated from those files (docs/gen_measurement_tables.py) and committed
equal to a fresh generation; every other measured number a page shows is held by some row; a row measured
with an earlier recipe of its preset says so. Pure text: no model is built."""
import ast
import csv
import os
import pathlib
import re

import pytest

import support

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEN = support.load_file('docs/gen_measurement_tables.py')
PAGES = [str(path.relative_to(GEN.REPO)) for path in GEN.pages()]
# Files kept as their tools wrote them, without the date, commit, machine and command of each row; what the
# README of measurements/ says of each stands in for them until they are rewritten.
AS_WRITTEN = {
    'classifier_recipe_study.csv': "the sweep's own sweep.csv (measurements/README.md dates it)",
    'transformer_recipe_study.csv': "the sweep's own sweep.csv (measurements/README.md dates it)",
    'gpt_recipe_study.csv': "the sweep's own sweep.csv (measurements/README.md dates it)",
    'gpt_recipe_ablation.csv': 'date and commit per row; the command is the ablation sweep the README names',
    'gpt_learning_curves.csv': "date, commit, machine per row; scripts/time_to_target.py's curves.csv",
    'token_cache_rss.csv': 'date, commit, machine per row; the command is scripts/data_scale.py measure',
    'speed_raw.jsonl': "the raw lines; speed_raw_provenance.csv gives each line's date, commit, machine, command",
    'recipes.jsonl': 'not measurements: the resolved config of each recipe fingerprint',
}


def read(page: str) -> str:
  with open(os.path.join(ROOT, page), encoding='utf-8') as f:
    return f.read()


@pytest.mark.parametrize('page', PAGES)
def test_the_committed_tables_are_generated_from_measurements(page):
  text = read(page)
  assert text == GEN.generate(text), f'{page}: python docs/gen_measurement_tables.py'


def test_the_pages_generate_the_readme_and_docs_tables():
  blocks = {page: len(GEN.BLOCK.findall(read(page))) for page in PAGES}
  assert blocks['README.md'] == 1 and blocks['docs/accelerators.md'] >= 1 and blocks['docs/families/gpt.md'] >= 1


@pytest.mark.parametrize('page', PAGES)
def test_every_measured_number_a_page_shows_is_held_by_a_measurements_row(page):
  unheld = GEN.unheld_numbers(read(page), GEN.held_values())
  assert not unheld, (f'{page} shows measured numbers no file of measurements/ holds (add the row, with its '
                      f'date, commit, machine and command; or a generated table):\n' + '\n'.join(unheld))


def test_a_planted_number_is_caught_and_what_is_not_measured_is_not():
  page = '\n'.join([
      'The recipe reaches it in 0.58x the seconds (526 s against 901.3 s) at 12.345 bits per byte;',
      'Python 3.11, jax 0.11.2, dropout 0.15, within 1e-4, 16 x 1024 tokens, 2,048 steps, seed 0.',
      '',
      '    python launch.py   # 9.876 s in a code block',
      '',
      'Not in `a span: 7.777 s` either; 3.25x faster, 99.6% exact, 1 min 21 s, 7.24 GB, 1,066 tokens/s.'])
  held = GEN.number_forms(526.3) | GEN.number_forms(901.31) | GEN.number_forms(3.2512) | GEN.number_forms(0.996)
  held |= GEN.number_forms(7.24) | GEN.number_forms(1066.0)
  assert [number for number, _ in GEN.measured_numbers(page)] == [
      '0.58', '526', '901.3', '12.345', '3.25', '99.6', '1 min 21 s', '7.24', '1066']
  assert GEN.unheld_numbers(page, held) == [
      'recipe reaches it in 0.58x', 'against 901.3 s) at 12.345 bits per byte', '3.25x faster, 99.6% exact, 1 min 21 s']


def test_the_pages_numbers_would_fail_without_their_rows(tmp_path):
  """Each page's prose measured against an empty measurements/: every measured number it shows is caught."""
  shown = {page: GEN.measured_numbers(read(page)) for page in PAGES}
  assert any(shown.values())
  for page, numbers in shown.items():
    assert GEN.unheld_numbers(read(page), GEN.held_values(tmp_path)) == [context for _, context in numbers], page


def write_csv(path, rows):
  with open(path, 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)


def test_a_row_measured_with_an_earlier_recipe_says_so(tmp_path, monkeypatch):
  monkeypatch.setattr(GEN, 'REPO', tmp_path)
  today = {'train.lr': 4e-3, 'train.optimizer': 'muon', 'model.qk_norm': True, 'model.dtype': 'auto'}
  then = dict(today, **{'train.lr': 2e-3, 'train.optimizer': 'adamw'})
  added_since = {key: value for key, value in today.items() if key != 'model.qk_norm'}  # a key added since
  lr_then = dict(today, **{'train.lr': 2e-3})  # its command sets the lr: the same recipe ran
  float32_then = dict(today, **{'model.dtype': 'float32'})  # 'auto' is float32 on a CPU, bfloat16 on a GPU
  row = {'date': '2026-11-25', 'commit': 'abc1234', 'machine': 'an AMD EPYC', 'command': 'python launch.py',
         'preset': 'configs/gpt.py:default', 'arm': 'x', 'bits': '1.536'}
  write_csv(tmp_path / 'm.csv', [dict(row, recipe=GEN.fingerprint(then), arm='then'),
                                 dict(row, recipe=GEN.fingerprint(today), arm='today'),
                                 dict(row, recipe=GEN.fingerprint(added_since), arm='added'),
                                 dict(row, recipe='unknown', arm='unknown'),
                                 dict(row, recipe=GEN.fingerprint(lr_then), arm='lr set',
                                      command='python launch.py --config.train.lr=0.002'),
                                 dict(row, recipe=GEN.fingerprint(float32_then), arm='f32 cpu'),
                                 dict(row, recipe=GEN.fingerprint(float32_then), arm='f32 gpu', machine='one H100')])
  recipes = {GEN.fingerprint(r): r for r in (then, today, added_since, lr_then, float32_then)}
  body = GEN.table('m.csv headers="arm|bits" cells="{arm}{recipe_note}|{bits}"', lambda preset: today, recipes)
  assert body.splitlines()[2:] == [
      '| then (measured with an earlier recipe of `configs/gpt.py:default`) | 1.536 |',
      '| today | 1.536 |',
      '| added | 1.536 |',
      '| unknown (the recipe of `configs/gpt.py:default` it was measured with is not recorded) | 1.536 |',
      '| lr set | 1.536 |',
      '| f32 cpu | 1.536 |',
      '| f32 gpu (measured with an earlier recipe of `configs/gpt.py:default`) | 1.536 |']
  default_layout = GEN.table('m.csv columns=arm,bits', lambda preset: today, recipes).splitlines()
  assert default_layout[0] == '| arm | bits | recipe |'
  assert default_layout[2] == '| then | 1.536 | measured with an earlier recipe of `configs/gpt.py:default` |'
  with pytest.raises(ValueError, match='recipe_note'):
    GEN.table('m.csv headers="arm" cells="{arm}"', lambda preset: today, recipes)
  write_csv(tmp_path / 'n.csv', [{'value': '1.5', 'date': '2026-11-25'}])
  with pytest.raises(ValueError, match='commit, machine'):
    GEN.table('n.csv')


def test_a_new_file_needs_one_marker(tmp_path, monkeypatch):
  monkeypatch.setattr(GEN, 'REPO', tmp_path)
  write_csv(tmp_path / 'moe.csv', [
      {'date': '2026-11-29', 'commit': 'abc1234', 'machine': 'one H200', 'command': 'python launch.py', 'x': '0.83'},
      {'date': '2026-11-29', 'commit': 'abc1234', 'machine': 'one H200', 'command': 'python x.py', 'x': '1.25'}])
  page = 'Before.\n\n<!-- generated: moe.csv where="command=python x.py" -->\n<!-- end generated -->\n'
  assert GEN.generate(page) == (
      'Before.\n\n<!-- generated: moe.csv where="command=python x.py" -->\n\n'
      '| date | commit | machine | command | x |\n| --- | --- | --- | --- | --- |\n'
      '| 2026-11-29 | abc1234 | one H200 | `python x.py` | 1.25 |\n\n<!-- end generated -->\n')


def test_every_measurements_file_gives_each_row_its_provenance():
  folder = os.path.join(ROOT, 'measurements')
  for name in sorted(os.listdir(folder)):
    if name in AS_WRITTEN or not name.endswith(('.csv', '.jsonl')):
      continue
    with open(os.path.join(folder, name), newline='') as f:
      columns = next(csv.reader(f))
    # recorded_at: the commit column of the files written before issue 61 (scripts/make_figures.py reads it)
    columns = {'commit' if column == 'recorded_at' else column for column in columns}
    assert set(GEN.PROVENANCE) <= columns, f'measurements/{name} lacks {set(GEN.PROVENANCE) - columns}'


def test_every_recorded_recipe_is_the_fingerprint_of_its_config():
  recipes = GEN.recorded_recipes()
  assert recipes and all(GEN.fingerprint(config) == digest for digest, config in recipes.items())
  for name in sorted(os.listdir(os.path.join(ROOT, 'measurements'))):
    if name.endswith('.csv'):
      for row in GEN.read_rows(f'measurements/{name}'):
        if row.get('preset'):
          assert row['recipe'] in recipes or row['recipe'] == GEN.UNKNOWN, (name, row['preset'], row['recipe'])


def test_the_llama_row_against_gpt2_says_gpt2_was_measured_with_an_earlier_recipe():
  """Issue 61: GPT-2's 1.655 bits per byte is its 2019 recipe's; `configs/gpt.py:default` runs another today."""
  section = read('docs/families/gpt.md').split('<!-- generated: measurements/llama_vs_gpt2.csv', 1)[1]
  gpt2 = next(line for line in section.splitlines() if line.startswith('| GPT-2'))
  assert 'measured with an earlier recipe of `configs/gpt.py:default`' in gpt2 and '1.655' in gpt2
  assert "configs/gpt.py:llama" not in read("README.md")  # the headline no longer carries the comparison


# What a config docstring may state that looks measured: settings (a cooldown's share, a fraction of the steps,
# BERT's masking shares, a held-out share, Adam's betas).
DOCSTRING_SETTINGS = r'(the last \d+%|at 0\.\dx|pairs, 15%|chosen: 80%|\[MASK\], 10%|random, 10%|per line; 5%|Adam\(0\.9, 0\.98)$'


def test_config_docstrings_say_what_a_preset_is_never_what_it_measured():
  """Issue 61: results are rows of measurements/ that the docs pages show; a config's docstring points there."""
  stated = {}
  for path in sorted(pathlib.Path(ROOT, 'configs').glob('**/*.py')):
    doc = ast.get_docstring(ast.parse(path.read_text(encoding='utf-8'))) or ''
    measured = [context for _, context in GEN.measured_numbers(doc) if not re.search(DOCSTRING_SETTINGS, context)]
    if measured:
      stated[str(path.relative_to(ROOT))] = measured
  assert not stated, f'config docstrings state measured numbers (move them to measurements/): {stated}'
