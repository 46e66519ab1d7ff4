"""The documentation's generated parts cannot drift: every key of configs/base.py and of each family's
configs/<family>.py has a one-line meaning (its comment, which docs/gen_config_reference.py turns into the
configuration reference), the parser finds every key the configs really set, the allowed values it
gives are the ones validation enforces, and the README's links and commands hold; the numbers the
pages report (speed ratios, studies, the time-to-target table) are those of measurements/, read from
both."""
import importlib
import itertools
import os
import re
import statistics

import pytest

import support
from configs.base import base_config
from errors import ConfigError
from train.validation import flatten, validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference_module():
  return support.load_file('docs/gen_config_reference.py')


def test_every_config_key_has_a_one_line_meaning():
  module = reference_module()
  keys = module.config_keys()
  missing = [f"{entry['key']} (configs/base.py:{entry['line']})" for entry in keys if not entry['meaning']]
  shared = {entry['key']: entry['meaning'] for entry in keys}
  for family in module.families():
    missing += [f"{row['key']} (configs/{family}.py)" for row in module.family_rows(family, shared, module.bounds())
                if not row['meaning']]
  assert not missing, f'Give these keys an inline "# one-line meaning" comment: {", ".join(missing)}'


def test_the_reference_lists_every_key_base_config_sets():
  listed = {entry['key'] for entry in reference_module().config_keys()}
  assert listed == set(flatten(base_config('gpt')))


def test_the_reference_covers_every_family_and_every_key_of_each_preset():
  """A family's row for each key its get_config sets or any preset gives a value other than the shared
  default; every other key of every preset is a shared one at its shared default."""
  module = reference_module()
  assert module.families() == support.registered_families()
  shared = {entry['key']: entry['meaning'] for entry in module.config_keys()}
  for family, preset in support.family_presets():
    rows = {row['key']: row for row in module.family_rows(family, shared, module.bounds())}
    own = {entry['key'] for entry in module.config_keys(module.REPO / 'configs' / f'{family}.py', 'get_config')}
    assert own <= set(rows), family
    common = flatten(base_config(family))
    for key, value in flatten(importlib.import_module(f'configs.{family}').get_config(preset)).items():
      assert key in rows or common.get(key) == value, f'configs/{family}.py:{preset} {key}={value!r} has no row'


def test_a_family_key_without_a_comment_is_found(tmp_path):
  family = tmp_path / 'family.py'
  family.write_text('def get_config(preset=\'default\'):\n'
                    '  c = base_config(\'x\', preset, PRESETS)\n'
                    '  c.model.width = 64  # the residual stream\n'
                    '  c.model.depth = 2\n'
                    '  c.features = ml_collections.ConfigDict()\n'
                    '  c.features.layer = -1  # the hidden state\n'
                    '  return apply_preset(c, PRESETS)\n')
  keys = {entry['key']: entry['meaning'] for entry in reference_module().config_keys(family, 'get_config')}
  assert keys == {'model.width': 'the residual stream', 'model.depth': '', 'features.layer': 'the hidden state'}


def test_the_allowed_values_listed_are_the_ones_validation_enforces():
  """Each bound the reference gives ('> 0', '>= 0') and each enumeration: a value outside it is a
  ConfigError naming the key, and the enumerations are the code's own tuples."""
  module = reference_module()
  for key, bound in module.bounds().items():
    config = support.smallest_config('gpt', {key: 0 if bound == '> 0' else -1})
    with pytest.raises(ConfigError, match=re.escape(f'config.{key}=')):
      validate_config(config, num_devices=1)
  for key, (path, name) in module.ENUMERATIONS.items():
    family = 'bert' if key == 'task' else 'gpt'
    code = importlib.import_module(path[:-len('.py')].replace('/', '.'))
    assert module.constant(path, name) == getattr(code, name)
    config = support.smallest_config(family, {key: 'no-such-value'})
    with pytest.raises(ConfigError, match=re.escape(key)):
      validate_config(config, num_devices=1)


def test_a_key_without_a_comment_is_found(tmp_path):
  base = tmp_path / 'base.py'
  base.write_text('def base_config(family):\n'
                  '  c = ml_collections.ConfigDict()\n'
                  '  c.seed = 0  # initialisation and data order\n'
                  '  c.train = train_defaults()\n'
                  '  return c\n\n\n'
                  'def train_defaults():\n'
                  '  train = ml_collections.ConfigDict()\n'
                  '  # the first line of a meaning written above its key\n'
                  '  # and its second line\n'
                  '  train.lr = 3e-4\n'
                  '  train.steps = 1000\n'
                  '  return train\n')
  keys = {entry['key']: entry for entry in reference_module().config_keys(base)}
  assert {key: entry['meaning'] for key, entry in keys.items()} == {
      'seed': 'initialisation and data order',
      'train.lr': 'the first line of a meaning written above its key and its second line',
      'train.steps': ''}
  assert keys['train.lr']['default'] == '3e-4'


def test_the_reference_page_has_a_row_per_key():
  module = reference_module()
  page = module.page()
  for entry in module.config_keys():
    assert f"| `{entry['key']}` |" in page
  shared = {entry['key']: entry['meaning'] for entry in module.config_keys()}
  for family in module.families():
    section = page.split(f'\n## {family}\n', 1)[1].split('\n## ', 1)[0]
    for row in module.family_rows(family, shared, module.bounds()):
      assert f"| `{row['key']}` | {row['default']} |" in section, (family, row['key'])


def test_the_committed_reference_page_is_the_generated_one():
  # mkdocs builds the page from configs/base.py; the copy in the repository is what GitHub shows.
  with open(os.path.join(ROOT, 'docs', 'reference', 'config.md'), encoding='utf-8') as f:
    committed = f.read()
  assert committed == reference_module().page(), 'python docs/gen_config_reference.py > docs/reference/config.md'


def readme():
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    return f.read()


def test_the_readme_is_short_and_keeps_the_two_commands():
  text = readme()
  assert len(text.splitlines()) <= 200
  assert '    pip install -r requirements.txt && python launch.py\n' in text
  assert '    pip install -r requirements-dev.txt && python -m pytest -q\n' in text


@pytest.mark.parametrize('link', sorted(set(re.findall(r'\]\(([^)#:]+\.md)(?:#[^)]*)?\)', readme()))))
def test_the_readme_links_to_pages_that_exist(link):
  assert os.path.isfile(os.path.join(ROOT, link)), link


def figures_module():
  return support.load_file('scripts/make_figures.py')


def page_text(page: str) -> str:
  """docs/<page> with its lines joined by single spaces (a sentence may wrap anywhere)."""
  with open(os.path.join(ROOT, 'docs', page), encoding='utf-8') as f:
    return ' '.join(f.read().split())


def speed_table(machine: str) -> dict[str, tuple[list[float], float]]:
  """{benchmark, as the measurements name it: (its ratios per round, its target)} of the table headed
  '| benchmark (<machine>) |' in docs/benchmarks.md."""
  with open(os.path.join(ROOT, 'docs', 'benchmarks.md'), encoding='utf-8') as f:
    lines = f.read().split(f'| benchmark ({machine}) |', 1)[1].splitlines()[2:]
  table = {}
  for line in itertools.takewhile(lambda line: line.startswith('|'), lines):
    label, _, _, ratios, target = [cell.strip() for cell in line.strip('|').split('|')]
    label = re.sub(r' \(.*\)$', '', label)  # the model's size
    label = re.sub(r'^GPT cached greedy decoding, batch (\d+), new tokens/s$', r'GPT decode tokens/s batch \1', label)
    table[label] = ([float(ratio) for ratio in ratios.split(', ')], float(target))
  return table


def test_the_speed_tables_report_the_ratios_of_the_committed_measurements():
  """docs/benchmarks.md's tables against measurements/: the AMD EPYC's from its raw lines (as the figure
  computes them), the Intel Xeon's from its CSV; the targets are the figure's."""
  module = figures_module()
  amd, xeon = {}, {}
  for row in module.ratio_rows_from_raw():
    amd.setdefault(row['benchmark'], []).append(round(row['ratio'], 2))
  targets = {}
  for row in module.read_csv('speed_xeon.csv'):
    xeon.setdefault(row['benchmark'], []).append(float(row['ours_over_reference']))
    targets[row['benchmark']] = float(row['target'])
  assert speed_table('AMD EPYC') == {name: (ratios, targets[name]) for name, ratios in amd.items()}
  assert speed_table('Intel Xeon') == {name: (ratios, targets[name]) for name, ratios in xeon.items()}


# What each study's page says of it: its trials, how many finished and were pruned, its best score.
STUDY_REPORTS = {
    'gpt_recipe_study': ('families/gpt.md', r'gpt_recipe\.py .*? (?P<trials>\d+) trials of .*?'
                         r'`measurements/gpt_recipe_study\.csv`: (?P<finished>\d+) finished, (?P<pruned>\d+) '
                         r'pruned\) .*? its best trial \(.*?\) scored (?P<best>\d\.\d+)'),
    'transformer_recipe_study': ('recipes.md', r'transformer_recipe\.py .*? (?P<trials>\d+) trials \((?P<finished>\d+) '
                                 r'finished, (?P<pruned>\d+) pruned\) .*? It scored (?P<best>\d\.\d+) validation'),
    'classifier_recipe_study': ('recipes.md', r'(?P<finished>\d+) of (?P<trials>\d+) trials finished, (?P<pruned>\d+) '
                                r'were pruned, and the best validation accuracy, (?P<best>\d\.\d+)'),
}


@pytest.mark.parametrize('study', sorted(STUDY_REPORTS))
def test_a_rebuilt_study_has_the_trials_and_the_best_score_the_docs_report(study):
  """The Optuna study the figures are drawn from holds the sweep's finished trials and its best score,
  as the study's page reports them, and the CSV the trials the page counts."""
  page, pattern = STUDY_REPORTS[study]
  report = re.search(pattern, page_text(page))
  assert report, f'docs/{page} no longer reports {study} as {pattern!r}'
  module = figures_module()
  rows = module.read_csv(f'{study}.csv')
  assert (len(rows), sum(row['status'] == 'pruned' for row in rows)) == (int(report['trials']), int(report['pruned']))
  rebuilt, _ = module.rebuilt_study(study, module.STUDIES[study])
  assert len(rebuilt.trials) == int(report['finished'])
  decimals = len(report['best'].split('.')[1])
  assert f'{rebuilt.best_value:.{decimals}f}' == report['best']


def test_the_learning_curves_cross_the_target_where_the_time_to_target_table_says():
  """The curves figure and the table come from the same runs: each run's first evaluation at or below the
  target is the table's step count, and the median over rounds of the run's clock then its seconds."""
  module = figures_module()
  curves = module.read_csv('gpt_learning_curves.csv')
  first = curves[0]
  table = {row['arm']: row for row in module.read_csv('gpt_time_to_target.csv')
           if [row[key] for key in ('date', 'recorded_at', 'machine')]
           == [first[key] for key in ('date', 'recorded_at', 'machine')]}
  assert set(table) == {'default recipe', '2019 recipe'}
  for arm, row in table.items():
    crossings = []
    for round_ in sorted({r['round'] for r in curves if r['arm'] == arm}):
      run = [r for r in curves if (r['arm'], r['round']) == (arm, round_)]
      crossings.append(next(r for r in run if float(r['eval_loss']) <= float(r['target'])))
    assert {int(c['step']) for c in crossings} == {int(row['steps'])}, arm
    for field in ('seconds', 'seconds_excluding_compile'):
      median = statistics.median(float(c[field]) for c in crossings)
      assert round(median, 1) == float(row[field]), (arm, field)


def links_module():
  return support.load_file('docs/repository_links.py')


def test_the_site_links_repository_files_issues_and_the_notebook():
  page = '\n'.join([
      '# `measurements/history.md` in a heading stays as it is',
      'See `measurements/history.md`, `measurements/` and issue 33 (and issue #22); not `runs/x`, `docs/index.md`,',
      '`python launch.py`, `no/such/file.py` or the [`measurements/history.md`](elsewhere) link.',
      '',
      '    python scripts/make_figures.py   # `measurements/history.md` in a code block: issue 33',
      '',
      'The notebook: `notebooks/reload_and_inspect.ipynb`.'])
  repo = 'https://github.com/someone/attention-lineage'
  linked = links_module().link_markdown(page, repo, 'main').split('\n')
  assert linked[0] == page.split('\n')[0] and linked[3:6] == page.split('\n')[3:6]
  assert linked[1] == (f'See [`measurements/history.md`]({repo}/blob/main/measurements/history.md), '
                       f'[`measurements/`]({repo}/tree/main/measurements/) and [issue 33]({repo}/issues/33) (and '
                       f'[issue #22]({repo}/issues/22)); not `runs/x`, `docs/index.md`,')
  assert linked[2] == page.split('\n')[2]
  assert linked[6] == (f'The notebook: [`notebooks/reload_and_inspect.ipynb`]({repo}/blob/main/notebooks/'
                       'reload_and_inspect.ipynb) [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]'
                       '(https://colab.research.google.com/github/someone/attention-lineage/blob/main/notebooks/'
                       'reload_and_inspect.ipynb).')
  elsewhere = links_module().link_markdown(page, 'https://gitlab.example/x/y', 'dev').split('\n')[6]
  assert 'colab' not in elsewhere and '(https://gitlab.example/x/y/blob/dev/notebooks/' in elsewhere


def test_every_measurements_file_a_page_names_exists():
  module = links_module()
  pages = [os.path.join(root, name) for root, _, names in os.walk(os.path.join(ROOT, 'docs')) for name in names
           if name.endswith('.md')]
  named = {span for page in pages for span in re.findall(r'`(measurements/[^`\s]*)`', open(page).read())}
  assert named and all(module.repository_path(span) for span in named), sorted(
      span for span in named if not module.repository_path(span))


def test_the_notebook_clones_the_repository_the_site_links_to():
  with open(os.path.join(ROOT, 'mkdocs.yml')) as f:
    repo_url = re.search(r"^repo_url: !ENV \[ATTENTION_LINEAGE_REPO_URL, '([^']+)'\]$", f.read(), re.M).group(1)
  with open(os.path.join(ROOT, 'notebooks', 'reload_and_inspect.ipynb')) as f:
    cloned = re.findall(r"os\.environ\.get\('REPO_URL', '([^']+)'\)", f.read())
  assert cloned == [repo_url], 'the notebook clones another repository than mkdocs.yml\'s repo_url: make them equal'


def test_the_installation_page_gives_each_requirements_file_its_pins():
  """docs/installation.md's table: every requirements file with the number of packages it pins itself."""
  listed = dict(re.findall(r'\| `(requirements[\w-]*\.txt)` \| (\d+)(?: more)? \|', page_text('installation.md')))
  files = sorted(name for name in os.listdir(ROOT) if re.fullmatch(r'requirements[\w-]*\.txt', name))
  assert sorted(listed) == files
  for name in files:
    with open(os.path.join(ROOT, name)) as f:
      pins = [line for line in f if re.match(r'[A-Za-z0-9_.-]+(\[[\w,]+\])?==', line)]
    assert int(listed[name]) == len(pins), f'docs/installation.md gives {name} {listed[name]} pins; it has {len(pins)}'
