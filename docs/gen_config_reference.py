"""The configuration reference (reference/config.md), generated from configs/base.py at docs build time.

mkdocs-gen-files runs this file (mkdocs.yml); tests/test_docs.py imports `config_keys` to check that
every key has a meaning. The module is parsed, not imported, so a key's meaning can be its comment:
the comment at the end of its line, or else the comment lines directly above it.
"""
import ast
import io
import pathlib
import tokenize

BASE = pathlib.Path(__file__).resolve().parent.parent / 'configs' / 'base.py'
SECTION_FUNCTIONS = {'base_config': ''}  # function -> the config section its assignments fill


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


def config_keys(path: pathlib.Path = BASE) -> list[dict]:
  """Every key configs/base.py sets: [{'key', 'default', 'meaning', 'line'}] in source order."""
  source = path.read_text(encoding='utf-8')
  tree = ast.parse(source)
  lines = source.splitlines()
  comments = comments_by_line(source)
  functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
  sections = dict(SECTION_FUNCTIONS)
  for node in ast.walk(functions['base_config']):  # c.data = data_defaults(): data_defaults fills 'data'
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
      keys.append({'key': key, 'default': ast.get_source_segment(source, node.value), 'meaning': meaning(node.lineno, lines, comments),
                   'line': node.lineno})
  return sorted(keys, key=lambda k: k['line'])


def page(keys: list[dict]) -> str:
  """The reference page: one table per section."""
  out = ['# Configuration reference', '',
         'Every key of the schema all families share, generated from `configs/base.py` when the docs are built '
         '(`docs/gen_config_reference.py`), with its default and the comment that explains it. A family\'s '
         '`get_config(preset)` (`configs/<family>.py`) adds its `model.*` keys and may default shared keys '
         'differently; a run\'s `config.json` holds the config it resolved to. Override any key on the command '
         'line with `--config.<key>=<value>`.', '']
  by_section: dict[str, list[dict]] = {}
  for entry in keys:
    section = entry['key'].split('.')[0] if '.' in entry['key'] else 'top level'
    by_section.setdefault(section, []).append(entry)
  for section, entries in by_section.items():
    out += [f'## {section}', '', '| key | default | meaning |', '| --- | --- | --- |']
    for entry in entries:
      default = entry['default'].replace('|', '\\|')
      text = entry['meaning'].replace('|', '\\|')
      out.append(f"| `{entry['key']}` | `{default}` | {text} |")
    out.append('')
  return '\n'.join(out)


if __name__ == '<run_path>':  # run by mkdocs-gen-files
  import mkdocs_gen_files

  with mkdocs_gen_files.open('reference/config.md', 'w') as f:
    f.write(page(config_keys()))
  mkdocs_gen_files.set_edit_path('reference/config.md', '../configs/base.py')

if __name__ == '__main__':  # the copy kept in the repository: python docs/gen_config_reference.py > docs/reference/config.md
  import sys

  sys.stdout.write(page(config_keys()))
