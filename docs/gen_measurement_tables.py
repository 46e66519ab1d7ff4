"""Tables of measured numbers, generated from the files of measurements/ into README.md and the docs.

A page asks for a table with one marker line; this script writes the table below it, up to the end
marker, and the result is committed (GitHub readers see it; tests/test_numbers.py checks that each
block equals a fresh generation):

    <!-- generated: measurements/moe.csv -->
    <!-- end generated -->

Options, shell-quoted words after the file name:

    columns="a,b,c"    the columns shown, in this order (default: every column but `recipe`)
    where="col=value"  only the rows whose column has that value (several: all must hold)
    headers="A|B|C"    the header cells (default: the column names)
    cells="{a}|**{b}** ({date}, `{commit}`, {machine})"   a row's cells, a str.format template over its columns

Every row of a measurements file has date, commit, machine and command (measurements/README.md). A
file with `preset` and `recipe` columns says which preset the command ran (configs/gpt.py:default)
and the fingerprint of that preset's resolved config when the row was measured (recipes.jsonl keeps
each fingerprint's config). Where today's preset resolves to another recipe, the row says "measured
with an earlier recipe of <preset>": the `{recipe_note}` field of a template (a template must use
it), a column of the default layout.

    python docs/gen_measurement_tables.py              rewrite every block in README.md and docs/
    python docs/gen_measurement_tables.py --check      exit 1 naming each block that differs
    python docs/gen_measurement_tables.py --fingerprint configs/gpt.py:default [--at COMMIT]
        the preset's fingerprint today (or at COMMIT), recorded in recipes.jsonl, for a new row
"""
import argparse
import csv
import hashlib
import importlib
import json
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
MEASUREMENTS = REPO / 'measurements'
RECIPES = MEASUREMENTS / 'recipes.jsonl'
PAGES = ('README.md', 'docs/**/*.md')
BLOCK = re.compile(r'^<!-- generated: (?P<spec>.+?) -->\n(?P<body>.*?)^<!-- end generated -->$', re.M | re.S)
PROVENANCE = ('date', 'commit', 'machine', 'command')
# Keys that change where a run writes and what it logs, never what it computes.
NOT_RECIPE = ('compile_cache', 'logging.', 'data.cache_dir', 'data.cache_shard_mb', 'data.cache_workers',
              'train.checkpoint_every', 'train.keep_checkpoints', 'train.log_every', 'train.async_checkpoints')
UNKNOWN = 'unknown'


def flat(config, prefix: str = '') -> dict:
  """{dotted key: value} of a ConfigDict's to_dict() (no repository code: old commits' configs too)."""
  out = {}
  for key, value in config.items():
    if isinstance(value, dict):
      out.update(flat(value, f'{prefix}{key}.'))
    else:
      out[f'{prefix}{key}'] = value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)
  return out


def resolve(preset: str, root: pathlib.Path = REPO) -> dict:
  """The recipe of 'configs/<family>.py:<name>': its resolved config minus the NOT_RECIPE keys."""
  path, _, name = preset.partition(':')
  sys.path.insert(0, str(root))
  module = importlib.import_module(path[:-len('.py')].replace('/', '.'))
  config = module.get_config(name) if name else module.get_config()
  return {key: value for key, value in flat(config.to_dict()).items() if not key.startswith(NOT_RECIPE)}


def fingerprint(recipe: dict) -> str:
  return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def resolve_at(preset: str, commit: str) -> dict:
  """The preset resolved from the configs/ of an earlier commit, in a process of its own."""
  with tempfile.TemporaryDirectory() as tmp:
    archive = subprocess.run(['git', 'archive', commit, 'configs', 'errors.py'], cwd=REPO, capture_output=True)
    if archive.returncode:  # errors.py is younger than configs/
      archive = subprocess.run(['git', 'archive', commit, 'configs'], cwd=REPO, capture_output=True, check=True)
    subprocess.run(['tar', '-x', '-C', tmp], input=archive.stdout, check=True)
    script = str(pathlib.Path(__file__).resolve())
    out = subprocess.run([sys.executable, script, '--resolve', preset, '--root', tmp], cwd=tmp, capture_output=True,
                         text=True, check=True)
  return json.loads(out.stdout)


def recorded_recipes() -> dict[str, dict]:
  if not RECIPES.exists():
    return {}
  return {entry['fingerprint']: entry['config'] for entry in map(json.loads, RECIPES.read_text().splitlines())}


# What an 'auto' setting resolves to on a CPU (models/attention.py's resolve_compute_dtype): a CPU row measured
# before the key defaulted to 'auto' ran the same computation.
AUTO_ON_CPU = {'model.dtype': 'float32'}
ACCELERATOR = re.compile(r'--compile_target|\b(?:[HAB]\d00|TPU|v\d[ep]?-\d+)\b')


def command_keys(command: str) -> set[str]:
  """The config keys a row's command sets itself (--config.train.lr=...): the preset's value of those is not
  what ran, then or today."""
  return {word.split('=', 1)[0][len('--config.'):] for word in shlex.split(command) if word.startswith('--config.')}


def earlier_recipe(row: dict, today: dict, recipes: dict[str, dict]) -> bool:
  """Whether the row's recipe differs from today's: its fingerprint differs and a key both configs have
  has another value (a key added or renamed since is not a change of recipe by itself), leaving out the keys
  its command sets and, on a CPU, a setting that became the 'auto' that resolves to its old value there."""
  if row['recipe'] == fingerprint(today):
    return False
  then = recipes.get(row['recipe'])
  if then is None:
    return True
  on_cpu = not ACCELERATOR.search(row['command'] + ' ' + row['machine'])
  same = command_keys(row['command'])
  same |= {key for key, value in AUTO_ON_CPU.items() if on_cpu and today.get(key) == 'auto' and then.get(key) == value}
  return any(then[key] != today[key] for key in (then.keys() & today.keys()) - same)


def recipe_note(row: dict, today_of, recipes: dict[str, dict]) -> str:
  preset = row.get('preset', '')
  if not preset:
    return ''
  if row.get('recipe', UNKNOWN) == UNKNOWN:
    return f' (the recipe of `{preset}` it was measured with is not recorded)'
  if earlier_recipe(row, today_of(preset), recipes):
    return f' (measured with an earlier recipe of `{preset}`)'
  return ''


def read_rows(name: str) -> list[dict]:
  path = REPO / name
  if path.suffix == '.jsonl':
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  with open(path, newline='', encoding='utf-8') as f:
    return list(csv.DictReader(f))


def parse_spec(spec: str) -> tuple[str, dict]:
  words = shlex.split(spec)
  options = {'where': []}
  for word in words[1:]:
    key, _, value = word.partition('=')
    if key not in ('columns', 'where', 'headers', 'cells'):
      raise ValueError(f'generated block "{spec}": unknown option {key!r} (columns, where, headers, cells)')
    if key == 'where':
      options['where'].append(value.split('=', 1))
    else:
      options[key] = value
  return words[0], options


def table(spec: str, today_of=None, recipes: dict | None = None) -> str:
  """The Markdown table a marker's spec asks for."""
  today_of = today_of or resolve_cached
  recipes = recipes if recipes is not None else recorded_recipes()
  name, options = parse_spec(spec)
  rows = read_rows(name)
  if rows and not set(PROVENANCE) <= rows[0].keys():
    raise ValueError(f'{name} lacks {", ".join(sorted(set(PROVENANCE) - rows[0].keys()))}: every row says its '
                     'date, commit, machine and command (measurements/README.md)')
  rows = [row for row in rows if all(str(row.get(key)) == value for key, value in options['where'])]
  columns = options['columns'].split(',') if 'columns' in options else [key for key in rows[0] if key != 'recipe']
  has_presets = bool(rows) and 'preset' in rows[0]
  if 'cells' in options:
    if has_presets and '{recipe_note}' not in options['cells']:
      raise ValueError(f'generated block "{spec}": its rows have presets, so cells must place {{recipe_note}}')
    template = options['cells']
    headers = options['headers'].split('|')
  else:
    template = '|'.join(f'`{{{c}}}`' if c == 'command' else f'{{{c}}}' for c in columns)
    template += '|{recipe_note}' if has_presets else ''
    headers = options['headers'].split('|') if 'headers' in options else columns + ['recipe'] * has_presets
  lines = ['| ' + ' | '.join(headers) + ' |', '| ' + ' | '.join('---' for _ in headers) + ' |']
  for row in rows:
    note = recipe_note(row, today_of, recipes)
    if 'cells' not in options:
      note = note.strip(' ()') or "today's"
    lines.append('| ' + ' | '.join(cell.strip() for cell in template.format(**row, recipe_note=note).split('|')) + ' |')
  return '\n'.join(lines) + '\n'


_resolved = {}


def resolve_cached(preset: str) -> dict:
  if preset not in _resolved:
    _resolved[preset] = resolve(preset)
  return _resolved[preset]


def generate(text: str, **kwargs) -> str:
  """text with every generated block's body rewritten."""
  return BLOCK.sub(lambda m: f"<!-- generated: {m['spec']} -->\n\n{table(m['spec'], **kwargs)}\n<!-- end generated -->",
                   text)


# A measured number, as a page shows one in its prose and hand-written tables: a ratio with decimals (0.60x),
# a percentage (99.6%, +16%), a duration (1 min 21 s, 526 s, 5.9 min, 10.4 ms), a size or a rate (7.24 GB,
# 2.00 MB/s, 1,066 tokens/s, 266 GFLOP/s), bits per byte, or a bare number with two or more decimals
# (0.951, 99.82, 3.730). Integers without a unit (steps, counts, parameters, seeds) are not: they are
# settings or computed, not measured; nor are dotted versions (0.12.8).
NUMBER = re.compile(r'(?<![\w.^/=])(?<!e-)[+-]?(?P<number>\d(?:,?\d)*(?:\.\d+)*)')
UNIT = re.compile(r'''
    x(?!\w)                                                                  # a ratio
  | \s?%                                                                     # a percentage
  | \ min\ \d+\ s(?!\w) | \ ?(?:ms|s|min|minutes|h|hours)(?![\w/])          # a duration
  | \ ?(?:[KMGT]i?B(?:/s)?|GFLOP/s|(?:new\ |target\ )?tokens/s)(?!\w)       # a size or a rate
  | \ (?:held-out\ )?bits\ per\ byte''', re.X)
# Numbers that look measured but are not, each with its reason: a regex on the words before the number and
# the number with its unit.
NOT_MEASURED = (
    (r'(Python|glibc >=|glibc older than|Llama|jax|flax|version) \d+\.\d+$', 'a software or model version'),
    (r'of a mean is \d[\d.]*$', 'a computation (1 / sqrt(50,000)), not a measurement'),
    (r'(lr|b1|b2|dropout|smoothing|init_std|cap|decay|fraction|coefficient|rate|=) ~?\d[\d.e-]*$', 'a setting'),
    (r'(within|tolerance|atol|rtol) \d[\d.e-]*$', "a test's tolerance"),
    (r'(>=|<=|target|targets?:?|asks) \S*\d[\d.]*x?$', 'a target, not a result'),
    (r'\d+(\.\d)? ?GiB$', "a device's memory (its datasheet), or a threshold"),
)


def page_prose(text: str) -> str:
  """text without what a page shows but does not state: generated blocks (tested against their files), code
  blocks and spans, HTML comments, link targets."""
  text = BLOCK.sub('', text)
  text = re.sub(r'<!--.*?-->', '', text, flags=re.S)
  text = re.sub(r'^```.*?^```', '', text, flags=re.S | re.M)
  text = re.sub(r'(?:^|\n\n)(?:(?: {4}|\t).*\n?)+', '\n\n', text)  # indented code blocks
  text = re.sub(r'`[^`]*`', '``', text)
  return re.sub(r'\]\([^)]*\)', ']', text)


def measured_numbers(text: str) -> list[tuple[str, str]]:
  """[(the number as held: '0.60', '1066', or '1 min 21 s' whole; the words before it and the number with
  its unit)] of every measured number in a page's prose."""
  prose = page_prose(text)
  found, consumed = [], 0
  for match in NUMBER.finditer(prose):
    number = match['number']
    if match.start() < consumed or number.count('.') > 1:
      continue
    decimals = len(number.partition('.')[2])
    unit = UNIT.match(prose, match.end())
    if unit is None and (decimals < 2 or re.match(r'[\w%]', prose[match.end():match.end() + 1])):
      continue
    if unit is not None and unit.group(0) == 'x' and not decimals:
      continue
    consumed = unit.end() if unit else match.end()
    shown = prose[match.start():consumed]
    before = ' '.join(prose[max(0, match.start() - 40):match.start()].split()[-4:])
    context = ' '.join(f'{before} {shown}'.split())
    if not any(re.search(pattern, context) for pattern, _ in NOT_MEASURED):
      minutes = re.fullmatch(r'(\d+) min (\d+) s', ' '.join(shown.split()))
      found.append((' '.join(minutes.group(0).split()) if minutes else number.replace(',', ''), context))
  return found


def number_forms(value: float) -> set[str]:
  """How a measured value may be shown: rounded to 0-5 decimals, and as a percentage of a fraction."""
  forms = {f'{value:.{d}f}' for d in range(6)}
  return forms | {f'{value * 100:.{d}f}' for d in range(3)} if abs(value) <= 1 else forms


def held_values(folder: pathlib.Path = MEASUREMENTS) -> set[str]:
  """Every number of every CSV and JSONL file in `folder` (cells' text included) in number_forms, and each
  'N min M s' duration whole."""
  cells = []
  for path in sorted(folder.glob('*.csv')):
    with open(path, newline='', encoding='utf-8') as f:
      cells += [cell for row in csv.reader(f) for cell in row]
  for path in sorted(folder.glob('*.jsonl')):
    cells += [cell for line in path.read_text(encoding='utf-8').splitlines() for cell in re.split(r'[,:\[\]{}]', line)]
  held = set()
  for cell in cells:
    held |= set(re.findall(r'\d+ min \d+ s', cell))
    for number in re.findall(r'-?\d(?:,?\d)*(?:\.\d+)?(?:e-?\d+)?', cell):
      held |= number_forms(float(number.replace(',', '')))
  return held


def unheld_numbers(text: str, held: set[str]) -> list[str]:
  """The measured numbers of a page that no measurements file holds, each with the words before it."""
  return [context for number, context in measured_numbers(text) if number not in held]


def pages() -> list[pathlib.Path]:
  return sorted(path for pattern in PAGES for path in REPO.glob(pattern))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--check', action='store_true', help='exit 1 if a committed block differs from its generation')
  parser.add_argument('--fingerprint', metavar='PRESET', help='print a preset\'s fingerprint, recording its config')
  parser.add_argument('--at', metavar='COMMIT', help='with --fingerprint: the preset as COMMIT resolved it')
  parser.add_argument('--resolve', metavar='PRESET', help=argparse.SUPPRESS)
  parser.add_argument('--root', default=str(REPO), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.resolve:
    print(json.dumps(resolve(args.resolve, pathlib.Path(args.root))))
    return
  if args.fingerprint:
    recipe = resolve_at(args.fingerprint, args.at) if args.at else resolve(args.fingerprint)
    digest = fingerprint(recipe)
    if digest not in recorded_recipes():
      with open(RECIPES, 'a', encoding='utf-8') as f:
        f.write(json.dumps({'fingerprint': digest, 'preset': args.fingerprint, 'commit': args.at or 'HEAD',
                            'config': recipe}, sort_keys=True) + '\n')
    print(digest)
    return
  stale = []
  for path in pages():
    text = path.read_text(encoding='utf-8')
    fresh = generate(text)
    if fresh != text:
      stale.append(str(path.relative_to(REPO)))
      if not args.check:
        path.write_text(fresh, encoding='utf-8')
  if args.check and stale:
    sys.exit(f'generated tables differ from measurements/ in {", ".join(stale)}: python docs/gen_measurement_tables.py')


if __name__ == '__main__':
  main()
