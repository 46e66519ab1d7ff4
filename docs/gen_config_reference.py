"""The configuration reference (reference/config.md), generated from configs/*.py at docs build time.

mkdocs-gen-files runs this file (mkdocs.yml); tests/test_docs.py checks that every key has a meaning
and that the committed copy is what this file generates. A key's meaning is its comment in the
config file that sets it: the comment at the end of its line, or else the comment lines directly
above it (configs/base.py for the keys every family shares, configs/<family>.py's get_config for a
family's own; a shared key a family sets without a comment keeps the shared meaning). Defaults per
preset come from calling each family's get_config(preset). Allowed values: the key's type, the
choices its meaning lists ('a' | 'b'), the tuple of the code that validates it (ENUMERATIONS), and
the bounds train/validation.py checks (its `positive` and `non_negative` tables).
"""
import ast
import importlib
import io
import pathlib
import re
import sys
import tokenize

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # mkdocs-gen-files runs this file from mkdocs' own directory

from configs.base import base_config, flatten  # noqa: E402  (configs/ imports ml_collections and errors only)

BASE = REPO / 'configs' / 'base.py'
SECTION_FUNCTIONS = {'base_config': ''}  # function -> the config section its assignments fill
# Keys whose values a tuple of the code lists, the one validation checks against: key -> (file, name).
ENUMERATIONS = {
    'train.optimizer': ('train/optim.py', 'OPTIMIZERS'),
    'train.schedule': ('train/optim.py', 'SCHEDULES'),
    'train.decay_shape': ('train/optim.py', 'DECAY_SHAPES'),
    'train.muon_ns_dtype': ('train/optim.py', 'MUON_NS_DTYPES'),
    'model.attention': ('models/attention.py', 'ATTENTION_IMPLEMENTATIONS'),
    'model.dtype': ('train/validation.py', 'MODEL_DTYPES'),
    'task': ('configs/bert.py', 'TASKS'),
}
CHOICES = re.compile(r"'[^'|]*'(?:\s*\([^)]*\))?(?:\s*[a-z ]*)?(?:\s*\|\s*'[^'|]*'(?:\s*\([^)]*\))?(?:\s*[a-z ]*)?)+")


def comments_by_line(source: str) -> dict[int, str]:
  """{line number: the comment text on that line}."""
  tokens = tokenize.generate_tokens(io.StringIO(source).readline)
  return {tok.start[0]: tok.string.lstrip('#').strip() for tok in tokens if tok.type == tokenize.COMMENT}


def meaning(line: int, lines: list[str], comments: dict[int, str]) -> str:
  """The comment ending `line`, else the block of whole-line comments right above it ('' if none)."""
  if line in comments and not lines[line - 1].lstrip().startswith('#'):
    return comments[line]
  above = []
  number = line - 1
  while number >= 1 and lines[number - 1].lstrip().startswith('#'):
    above.insert(0, comments[number])
    number -= 1
  return ' '.join(above)


def is_section(value: ast.expr) -> bool:
  """`x = ml_collections.ConfigDict()` or `x = data_defaults()`: a section, not a key."""
  if not isinstance(value, ast.Call):
    return False
  name = ast.unparse(value.func)
  return name.endswith('ConfigDict') or name.endswith('_defaults')


def config_keys(path: pathlib.Path = BASE, entry: str = 'base_config') -> list[dict]:
  """Every key the function `entry` of the config file `path` sets (configs/base.py's base_config, or a
  family's get_config), with the functions it fills sections with: [{'key', 'default', 'meaning',
  'line'}] in source order, `default` as written."""
  source = path.read_text(encoding='utf-8')
  tree = ast.parse(source)
  lines = source.splitlines()
  comments = comments_by_line(source)
  functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
  sections = {entry: ''}
  for node in ast.walk(functions[entry]):  # c.data = data_defaults(): data_defaults fills 'data'
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.targets[0], ast.Attribute):
      sections.setdefault(ast.unparse(node.value.func), node.targets[0].attr)
  for function, section in list(sections.items()):  # schedule_keys(train) in train_defaults fills 'train' too
    for node in ast.walk(functions[function]) if function in functions and section else ():
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
        sections.setdefault(node.func.id, section)
  keys = []
  for function, section in sections.items():
    if function not in functions:
      continue
    for node in ast.walk(functions[function]):
      if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)) or is_section(node.value):
        continue
      dotted = ast.unparse(node.targets[0]).split('.')[1:]  # drop the local name (c, data, train, ...)
      key = '.'.join([section, *dotted] if section else dotted)
      keys.append({'key': key, 'default': ast.get_source_segment(source, node.value),
                   'meaning': meaning(node.lineno, lines, comments), 'line': node.lineno})
  return sorted(keys, key=lambda k: k['line'])


def families() -> list[str]:
  """The families launch.py runs: a train/tasks/<family>.py beside a configs/<family>.py."""
  tasks = {path.stem for path in (REPO / 'train' / 'tasks').glob('*.py') if not path.stem.startswith('_')}
  return sorted(name for name in tasks if (REPO / 'configs' / f'{name}.py').is_file())


def constant(path: str, name: str) -> tuple:
  """The module-level tuple `name` of the file `path`, read without importing it."""
  for node in ast.parse((REPO / path).read_text(encoding='utf-8')).body:
    if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == name:
      return ast.literal_eval(node.value)
  raise KeyError(f'{path} has no {name}')


def bounds() -> dict[str, str]:
  """{key: '> 0' or '>= 0'}: train/validation.py's `positive` and `non_negative` tables."""
  found = {}
  for node in ast.walk(ast.parse((REPO / 'train' / 'validation.py').read_text(encoding='utf-8'))):
    if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) in ('positive', 'non_negative'):
      bound = '> 0' if ast.unparse(node.targets[0]) == 'positive' else '>= 0'
      found.update({key.value: bound for key in node.value.keys})
  return found


def allowed(key: str, default, text: str, checked: dict[str, str]) -> str:
  """What `key` takes: its validated tuple, the choices its meaning lists, else its type (and bounds)."""
  if key in ENUMERATIONS:
    return ' \\| '.join(f"'{value}'" for value in constant(*ENUMERATIONS[key]))
  choices = CHOICES.search(text)
  if choices:
    return ' \\| '.join(re.findall(r"'[^']*'", choices.group(0)))
  kind = {bool: 'True \\| False', int: 'int', float: 'float', str: 'str'}.get(type(default), type(default).__name__)
  return f'{kind} {checked[key]}' if key in checked else kind


def shown(value) -> str:
  return f'`{value!r}`'.replace('|', '\\|')


def family_rows(family: str, shared: dict[str, str], checked: dict[str, str]) -> list[dict]:
  """The keys `family` sets or its presets change: [{'key', 'meaning', 'default', 'presets', 'allowed'}]."""
  module = importlib.import_module(f'configs.{family}')
  presets = getattr(module, 'PRESETS', {'default': {}})
  default = flatten(module.get_config())
  by_preset = {preset: flatten(module.get_config(preset)) for preset in presets}
  common = flatten(base_config(family))
  own = {entry['key']: entry['meaning'] for entry in config_keys(REPO / 'configs' / f'{family}.py', 'get_config')}
  rows = []
  for key, value in default.items():
    if key not in own and key in common and all(values[key] == common[key] for values in by_preset.values()):
      continue  # the shared default, in every preset: the shared table has it
    text = own.get(key) or shared.get(key, '')
    others: dict[str, list[str]] = {}  # another value: the presets that set it
    for preset, values in by_preset.items():
      if values[key] != value:
        others.setdefault(shown(values[key]), []).append(f'`{preset}`')
    changed = '; '.join(f'{other} in {", ".join(names)}' for other, names in others.items())
    rows.append({'key': key, 'meaning': text, 'default': shown(value), 'presets': changed,
                 'allowed': allowed(key, value, text, checked)})
  return rows


def page() -> str:
  """The reference page: the shared keys, one table per section; then each family's keys."""
  out = ['# Configuration reference', '',
         'Generated from `configs/*.py` when the docs are built (`docs/gen_config_reference.py`; the copy in '
         'the repository is tested equal to it). A key\'s meaning is the comment beside it in the config file '
         'that sets it. Override any key on the command line with `--config.<key>=<value>`; a run\'s '
         '`config.json` holds the config it resolved to.', '',
         'The shared keys come first (`configs/base.py`: every family has them); then each family\'s '
         '`get_config` (`configs/<family>.py`): its own keys and the shared ones it or its presets set '
         'otherwise, with the default of `get_config()` and each preset that changes it.', '']
  shared_keys = config_keys()
  shared = {entry['key']: entry['meaning'] for entry in shared_keys}
  common = flatten(base_config(''))
  checked = bounds()
  by_section: dict[str, list[dict]] = {}
  for entry in shared_keys:
    section = entry['key'].split('.')[0] if '.' in entry['key'] else 'top level'
    by_section.setdefault(section, []).append(entry)
  out += ['## Shared keys', '']
  for section, entries in by_section.items():
    out += [f'### {section}', '', '| key | default | allowed | meaning |', '| --- | --- | --- | --- |']
    for entry in entries:
      default = entry['default'].replace('|', '\\|')
      kind = allowed(entry['key'], common[entry['key']], entry['meaning'], checked)
      out.append(f"| `{entry['key']}` | `{default}` | {kind} | {entry['meaning'].replace('|', chr(92) + '|')} |")
    out.append('')
  for family in families():
    out += [f'## {family}', '', f'`configs/{family}.py`; presets: '
            + ', '.join(f'`{name}`' for name in getattr(importlib.import_module(f'configs.{family}'), 'PRESETS',
                                                          {'default': {}})) + '.', '',
            '| key | default | presets that change it | allowed | meaning |', '| --- | --- | --- | --- | --- |']
    for row in family_rows(family, shared, checked):
      out.append(f"| `{row['key']}` | {row['default']} | {row['presets']} | {row['allowed']} | "
                 f"{row['meaning'].replace('|', chr(92) + '|')} |")
    out.append('')
  return '\n'.join(out)


if __name__ == '<run_path>':  # run by mkdocs-gen-files
  import mkdocs_gen_files

  with mkdocs_gen_files.open('reference/config.md', 'w') as f:
    f.write(page())
  mkdocs_gen_files.set_edit_path('reference/config.md', '../gen_config_reference.py')

if __name__ == '__main__':  # the copy kept in the repository: python docs/gen_config_reference.py > docs/reference/config.md
  sys.stdout.write(page())
