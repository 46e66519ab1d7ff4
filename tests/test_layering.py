"""Layers import downward only (README, Architecture): checked on every import statement of the
repo's packages, inside functions too, so that an upward import fails here and not in review; no
two modules of the repo import each other, directly or around a longer circle; no module uses
another module's private names; and training knows nothing of sweeps (sweeps/ stands above train/:
nothing but launch.py, scripts/ and tests/ imports it, and no layer below it uses Optuna)."""
import ast
import functools
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = {'errors', 'storage'}  # the repo's two leaf modules: every layer may use them
ALLOWED = {  # package -> the repo's top-level modules and packages it may import
    'configs': {'configs'},
    'models': {'models'},
    'data': {'data'},
    'interop': {'interop', 'models', 'data'},
    'train': {'train', 'models', 'data', 'interop', 'configs'},
    'sweeps': {'sweeps', 'train', 'models', 'data', 'interop', 'configs'},
    'evals': {'evals', 'train', 'models', 'data'},
}


def parsed(path: str) -> tuple[ast.AST, list[str]]:
  """A file's syntax tree and lines, read once for every check (again when the file changes)."""
  status = os.stat(path)
  return _parsed(path, status.st_mtime_ns, status.st_size)


@functools.cache
def _parsed(path: str, mtime: int, size: int) -> tuple[ast.AST, list[str]]:
  source = open(path).read()
  return ast.parse(source), source.splitlines()


def imported_names(path: str) -> set[str]:
  """The top-level names (the repo's and libraries') that the file at `path` imports absolutely."""
  names = set()
  for node in ast.walk(parsed(path)[0]):
    if isinstance(node, ast.Import):
      names |= {alias.name.split('.')[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module.split('.')[0])
  return names


def repo_imports(path: str) -> set[str]:
  """The repo's top-level names that the file at `path` imports."""
  local = {name[:-3] if name.endswith('.py') else name for name in os.listdir(ROOT)}
  return imported_names(path) & local


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


@functools.cache  # walked once per root: the private-name check asks for every file it reads
def module_files(root: str) -> dict[str, str]:
  """{dotted module name: path} of every .py file under `root` (hidden folders aside); a package
  is named by its __init__.py. Read only: the dict is shared by its callers."""
  modules = {}
  for directory, folders, files in os.walk(root):
    folders[:] = [f for f in folders if not f.startswith('.') and f != '__pycache__']
    for file in (f for f in files if f.endswith('.py')):
      path = os.path.join(directory, file)
      name = os.path.relpath(path, root)[:-len('.py')].replace(os.sep, '.')
      modules[name.removesuffix('.__init__')] = path
  return modules


def imported_modules(name: str, path: str, modules: dict[str, str]) -> set[str]:
  """The modules among `modules` that module `name` (the file at `path`) imports anywhere in it.
  `from a.b import c` names a.b.c when that is a module, else a.b; the packages above a module
  (whose __init__ Python runs first) are no edges, or every package re-exporting its parts would
  be a circle."""
  package = name if path.endswith('__init__.py') else name.rpartition('.')[0]
  found = set()
  for node in ast.walk(parsed(path)[0]):
    if isinstance(node, ast.Import):
      candidates = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:  # relative: `from . import x` in package p names p.x
        parent = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(parent + ([base] if base else []))
      candidates = [f'{base}.{alias.name}' if f'{base}.{alias.name}' in modules else base for alias in node.names]
    else:
      continue
    for candidate in candidates:
      while candidate and candidate not in modules:
        candidate = candidate.rpartition('.')[0]
      if candidate and candidate != name:
        found.add(candidate)
  return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One circle [a, b, ..., a] of `graph` (module -> the modules it imports), or None."""
  done, path = set(), []

  def visit(module):
    if module in path:
      return path[path.index(module):] + [module]
    if module in done:
      return None
    path.append(module)
    for imported in sorted(graph.get(module, ())):
      cycle = visit(imported)
      if cycle:
        return cycle
    path.pop()
    done.add(module)
    return None

  return next((cycle for cycle in map(visit, sorted(graph)) if cycle), None)


def import_graph(root: str) -> dict[str, set[str]]:
  modules = module_files(root)
  return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def test_no_modules_import_each_other():
  cycle = find_cycle(import_graph(ROOT))
  assert cycle is None, f'modules import each other: {" -> ".join(cycle)}; move what both need into one of them.'


DATA_FAMILIES = {'data.lm', 'data.translation', 'data.classification', 'data.bert_data'}


def test_data_families_plug_into_the_cache_and_know_no_other_family():
  """The cache (data/token_cache.py) and what every family shares import no family; a family imports
  no other family (what two need is in sources, tokenizers or the cache)."""
  graph = import_graph(ROOT)
  for module in DATA_FAMILIES | {'data.token_cache', 'data.sources', 'data.tokenizers', 'data.batching'}:
    assert not graph[module] & (DATA_FAMILIES - {module}), f'{module} imports {graph[module] & DATA_FAMILIES}'


def test_the_check_sees_a_circle_of_imports(tmp_path):
  package = tmp_path / 'pkg'
  package.mkdir()
  (package / '__init__.py').write_text('from pkg import a\n')  # a package re-exporting its part: no circle
  (package / 'a.py').write_text('from pkg.b import f\n')
  (package / 'b.py').write_text('def f():\n  from . import c\n')  # inside a function, relative: still an edge
  (package / 'c.py').write_text('import pkg.a\n')
  assert find_cycle(import_graph(str(tmp_path))) == ['pkg.a', 'pkg.b', 'pkg.c', 'pkg.a']
  (package / 'c.py').write_text('import json\n')
  assert find_cycle(import_graph(str(tmp_path))) is None


# ----------------------------------------------------------------------------- private names
# A private name used from outside its module may change or vanish without notice. Where a library
# has no public equivalent, the import's line says so with the version it was checked on
# ('# no public alias in Orbax 0.12'), and is allowed.
CHECKED_PRIVATE = re.compile(r'#.*\bpublic\b.*\d+\.\d+')


def private(name: str) -> bool:
  return name.startswith('_') and not (name.startswith('__') and name.endswith('__'))


def private_uses(path: str, root: str = ROOT) -> list[str]:
  """'<line>: <what>' for each private name the file at `path` takes from another module: `from m
  import _x`, a private module (`import a._b`, `from a._b import x`), or `m._x` where `m` is a module
  the file imported (a repo module imported by `from pkg import m`, or any `import m`)."""
  tree, lines = parsed(path)
  modules = module_files(root)
  imported, found = set(), []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
      imported |= {alias.asname or alias.name.split('.')[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + [f'{node.module}.{alias.name}' for alias in node.names]
      imported |= {alias.asname or alias.name for alias in node.names if f'{node.module}.{alias.name}' in modules}
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and private(node.attr):
      names = [f'{node.value.id}.{node.attr}'] if node.value.id in imported else []
    else:
      continue
    for name in names:
      if any(private(part) for part in name.split('.')) and not CHECKED_PRIVATE.search(lines[node.lineno - 1]):
        found.append(f'{node.lineno}: {name}')
  return found


def test_no_module_uses_another_modules_private_names():
  used = {}
  for name, path in module_files(ROOT).items():
    relative = os.path.relpath(path, ROOT)
    found = private_uses(path)
    if found:
      used[relative] = found
  assert not used, f'private names used from outside their module: {used}; use a public name, or make it public.'


def test_the_check_sees_private_names_taken_from_other_modules(tmp_path):
  package = tmp_path / 'pkg'
  package.mkdir()
  (package / '__init__.py').write_text('')
  (package / 'a.py').write_text('def _helper():\n  pass\n')
  (package / 'b.py').write_text('from pkg import a\nfrom pkg.a import _helper\nimport json._private\n'
                                'from jax._src import dispatch\nfrom __future__ import annotations\n'
                                'from orbax._src import x  # no public alias in Orbax 0.12\n'
                                'def f(self):\n  a._helper()\n  self._own()\n  a.__name__\n')
  assert private_uses(str(package / 'b.py'), str(tmp_path)) == [
      '2: pkg.a._helper', '3: json._private', '4: jax._src', '4: jax._src.dispatch', '8: a._helper']


SWEEP_USERS = {'sweeps', 'launch', 'scripts', 'tests'}  # the top-level names that may import sweeps/


def sweep_importers(root: str) -> dict[str, list[str]]:
  """{module of `root` outside sweeps/, launch.py, scripts/ and tests/: the sweeps modules it imports}."""
  modules = module_files(root)
  sweep = {name for name in modules if name.split('.')[0] == 'sweeps'}
  found = {}
  for name, path in modules.items():
    if name.split('.')[0] not in SWEEP_USERS:
      imported = imported_modules(name, path, modules) & sweep
      if imported:
        found[name] = sorted(imported)
  return found


def test_training_imports_nothing_of_sweeps():
  """A sweep runs trainings as processes and reads what they log; the trainer, its loop and its
  steps never report to a sweep (launch.py, above train/, starts one)."""
  importers = sweep_importers(ROOT)
  assert not importers, f'modules below sweeps/ import it: {importers}; a sweep reads what its trials log.'


def test_the_check_sees_training_import_a_sweep_module(tmp_path):
  for folder in ('sweeps', 'train/tasks', 'scripts', 'tests'):
    (tmp_path / folder).mkdir(parents=True)
  (tmp_path / 'sweeps' / '__init__.py').write_text('')
  (tmp_path / 'sweeps' / 'runner.py').write_text('from sweeps import evaluations\n')  # within sweeps/: fine
  (tmp_path / 'sweeps' / 'evaluations.py').write_text('import json\n')
  (tmp_path / 'launch.py').write_text('def main():\n  from sweeps import runner\n')  # above it: fine
  (tmp_path / 'scripts' / 'bench.py').write_text('import sweeps.runner\n')
  (tmp_path / 'tests' / 'test_x.py').write_text('from sweeps.runner import parse\n')
  (tmp_path / 'train' / 'loop.py').write_text('def report():\n  from sweeps.evaluations import Reporter\n')
  (tmp_path / 'train' / 'tasks' / 'lm.py').write_text('import sweeps\n')
  (tmp_path / 'storage.py').write_text('from sweeps import runner\n')
  assert sweep_importers(str(tmp_path)) == {
      'train.loop': ['sweeps.evaluations'], 'train.tasks.lm': ['sweeps'], 'storage': ['sweeps.runner']}


def test_no_layer_below_sweeps_uses_optuna():
  """Optuna is the sweep layer's library: a module below sweeps/ that imports it is sweep code in
  the wrong folder (train/ holds training only)."""
  users = [os.path.relpath(path, ROOT) for name, path in module_files(ROOT).items()
           if name.split('.')[0] not in SWEEP_USERS and 'optuna' in imported_names(path)]
  assert not users, f'{users} import Optuna; sweep code lives in sweeps/.'

