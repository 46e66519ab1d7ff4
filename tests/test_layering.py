"""Layers import downward only (README, Architecture): checked on every import statement of the
repo's packages, inside functions too, so that an upward import fails here and not in review."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = {'errors', 'storage'}  # the repo's two leaf modules: every layer may use them
ALLOWED = {  # package -> the repo's top-level modules and packages it may import
    'configs': {'configs'},
    'models': {'models'},
    'data': {'data'},
    'interop': {'interop', 'models', 'data'},
    'train': {'train', 'models', 'data', 'interop', 'configs'},
}


def repo_imports(path: str) -> set[str]:
  """The repo's top-level names that the file at `path` imports."""
  local = {name[:-3] if name.endswith('.py') else name for name in os.listdir(ROOT)}
  names = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      names |= {alias.name.split('.')[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module.split('.')[0])
  return names & local


@pytest.mark.parametrize('package', sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(package):
  upward = {}
  for directory, _, files in os.walk(os.path.join(ROOT, package)):
    for file in (f for f in files if f.endswith('.py')):
      path = os.path.join(directory, file)
      wrong = repo_imports(path) - ALLOWED[package] - SHARED
      if wrong:
        upward[os.path.relpath(path, ROOT)] = sorted(wrong)
  assert not upward, f'{package}/ imports above its layer: {upward}'


def test_the_check_sees_an_upward_import(tmp_path):
  path = tmp_path / 'model.py'
  path.write_text('def f():\n  from train import trainer\n')
  assert repo_imports(str(path)) == {'train'}
