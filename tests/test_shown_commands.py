"""Every command the README and the docs show is run by CI or a test, or its page says why it cannot run
here (tests/shown_commands.py says which, command by command)."""
import ast
import functools
import importlib
import os
import re
import shlex
import textwrap

import pytest

import shown_commands
import support
from shown_commands import SHOWN, UNMEASURED, ByTest, Ci, Needs, SameAs, Shown, Synopsis

REPO = shown_commands.REPO
CI_RUN = open(os.path.join(REPO, '.ci', 'run')).read()
CI_STEPS = re.findall(r"^step '([^']+)'", CI_RUN, re.M)
EVERY = shown_commands.all_shown()
PLACEHOLDER = re.compile(r'<|\[|\.\.\.|/path\b|/data/|\bBUCKET\b|\bNAME\b|\bDIR\b|test_x')


def where(text):
  return ', '.join(f'{s.page}:{s.line}' for s in EVERY if s.text == text)


def test_every_command_shown_says_what_checks_it():
  unlisted = sorted({f'{s.page}:{s.line}: {s.text}' for s in EVERY if s.text not in SHOWN})
  assert not unlisted, ('commands shown but not in tests/shown_commands.py SHOWN (say which test or CI step runs '
                        'each, or mark its page):\n' + '\n'.join(unlisted))
  shown = {s.text for s in EVERY}
  assert not [text for text in SHOWN if text not in shown], 'SHOWN lists commands no page shows'


@pytest.mark.parametrize('text', [t for t, how in SHOWN.items() if isinstance(how, Needs)])
def test_a_command_that_cannot_run_here_says_why_on_its_page(text):
  what = SHOWN[text].what
  unmarked = [f'{s.page}:{s.line}' for s in EVERY
              if s.text == text and (s.page, text) not in UNMEASURED and not shown_commands.marked(s, what)]
  assert not unmarked, (f'{text!r} needs {what}, but nothing around it on {unmarked} says so'
                        + (' (a duration measured on a named machine: "~4 min on 2 cores of an AMD EPYC")'
                           if what == 'minutes' else ''))


@pytest.mark.parametrize('page, text', sorted(UNMEASURED))
def test_a_command_listed_as_unmeasured_still_is(page, text):
  """UNMEASURED only shrinks: an entry goes once its page gives the duration and the machine."""
  shown = [s for s in EVERY if (s.page, s.text) == (page, text)]
  assert shown, f'{page} no longer shows {text!r}: remove it from UNMEASURED'
  assert SHOWN.get(text) == Needs('minutes'), f'{text!r} is not a Needs("minutes") command'
  assert not all(shown_commands.marked(s, 'minutes') for s in shown), \
      f'{page} now marks {text!r} with its duration and machine: remove it from UNMEASURED'


def test_a_minutes_mark_is_a_duration_on_a_named_machine():
  def mark(context, section=''):
    return shown_commands.marked(Shown('page.md', 1, 'python launch.py', context, section), 'minutes')
  assert mark('# ~4 min on 2 cores of an AMD EPYC')
  assert mark('63 min on these 2 cores', section='## Study  2026-11-27, 2 cores of an AMD EPYC, 63 min')
  assert mark('12-18 min on an Intel Xeon') and mark('(29 min on one H200)')
  assert not mark('# MLM + NSP on bbc_news (long on a CPU)')  # no duration
  assert not mark('# train on the stdlib text (minutes)')
  assert not mark('# ~15 min on 2 CPU cores')  # no machine
  assert not mark('~30 min; the machine was not recorded', section='## 2 cores of an AMD EPYC')


@pytest.mark.parametrize('text', [t for t, how in SHOWN.items() if isinstance(how, Ci)])
def test_a_command_run_by_ci_names_a_step_of_ci_run(text):
  assert SHOWN[text].step in CI_STEPS, f'{text!r} ({where(text)}): .ci/run has no step {SHOWN[text].step!r}'
  if SHOWN[text] == shown_commands.RUN:  # run exactly as written: nothing the reader must fill in
    assert not PLACEHOLDER.search(text), f'{text!r} has a placeholder: it cannot run as written'


@pytest.mark.parametrize('text', [t for t, how in SHOWN.items() if isinstance(how, ByTest)])
def test_a_command_checked_by_a_test_names_a_test_that_exists(text):
  path, _, name = SHOWN[text].node.partition('::')
  with open(os.path.join(REPO, path)) as f:
    source = f.read()
  assert not name or re.search(rf'^def {re.escape(name)}\(', source, re.M), f'{SHOWN[text].node} does not exist'
  assert PLACEHOLDER.search(text) or 'runs/' in text or 'export ' in text, \
      f'{text!r} names none of the reader\'s own files: run it as written (shown_commands.RUN) instead'


def family_and_mode(text: str) -> tuple[str | None, str | None]:
  """(the family, the launcher mode) a shown `launch.py` command runs: the family of its --config (the
  launcher's default config without one), else of its workdir's name (`runs/<family>-...`; None when the
  name says no family); (None, None) for a command that is no launch."""
  if 'launch.py' not in text or '--sweep=' in text:
    return None, None
  mode = re.search(r'--mode=(\w+)', text)
  config = re.search(r'--config=configs/(\w+)\.py', text)
  workdir = re.search(r'--workdir=(?:gs://[^/\s]+/)?runs/([\w.-]+)', text)
  if config or not workdir:
    name = config.group(1) if config else 'default'
    if name not in FAMILIES:  # configs/default.py: the family it imports
      name = re.search(r'from configs import (\w+)', open(os.path.join(REPO, 'configs', f'{name}.py')).read()).group(1)
    family = name
  else:
    family = next((f for f in FAMILIES if re.match(rf'{f}(?![a-z_])', workdir.group(1))), None)
  return family, mode.group(1) if mode else 'train'


FAMILIES = support.registered_families()


class ModuleSource:
  """A file of tests/: its source, its functions by name, and the names it imports from other files of
  tests/ (`from test_bert_task import tiny_config as bert_config`: alias -> (file, name))."""

  def __init__(self, path: str):
    with open(os.path.join(REPO, path)) as f:
      self.source = f.read()
    self.lines = self.source.splitlines()
    tree = ast.parse(self.source)
    self.functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    self.imported = {alias.asname or alias.name: (f'tests/{n.module}.py', alias.name)
                     for n in tree.body if isinstance(n, ast.ImportFrom) and n.module
                     and os.path.isfile(os.path.join(REPO, 'tests', f'{n.module}.py')) for alias in n.names}


@functools.cache
def module_source(path: str) -> ModuleSource:
  return ModuleSource(path)


def checked_source(node: str) -> str:
  """The source a test runs: its function's, with the functions and fixtures it reaches, followed by
  name through its module, the tests/ modules it imports from, tests/support.py and tests/conftest.py;
  a whole file when `node` names one."""
  path, _, name = node.partition('::')
  module = module_source
  if not name:
    return module(path).source
  seen, todo, parts = set(), [(path, name)], []
  while todo:
    key, function = todo.pop()
    if (key, function) in seen:
      continue
    seen.add((key, function))
    definition = module(key).functions[function]
    parts.append('\n'.join(module(key).lines[definition.lineno - 1:definition.end_lineno]))
    for sub in ast.walk(definition):
      if isinstance(sub, ast.Name) and sub.id in module(key).functions:
        todo.append((key, sub.id))
      elif isinstance(sub, ast.Name) and sub.id in module(key).imported:
        todo.append(module(key).imported[sub.id])
      elif isinstance(sub, ast.Attribute) and ast.unparse(sub.value) == 'support' and (
          sub.attr in module('tests/support.py').functions):
        todo.append(('tests/support.py', sub.attr))
      elif isinstance(sub, ast.arg):  # a fixture, of the module or of conftest.py
        todo += [(where, sub.arg) for where in (key, 'tests/conftest.py') if sub.arg in module(where).functions][:1]
  return '\n'.join(parts)


# What launch.py's mode runs, called in the test's own process: `--mode=export_hf` is
# `load_run(workdir).export_hf(hf_dir)` (launch.export_hf_mode), `--mode=train` `train_and_evaluate`.
IN_PROCESS = {'train': 'train_and_evaluate(', 'export_hf': '.export_hf('}


def runs_mode(source: str, mode: str) -> bool:
  """Whether `source` launches `--mode=<mode>` (a launch with no --mode trains) or calls what it runs."""
  launches = re.findall(r'launch\(\[(.*?)\]', source, re.S)
  if mode == 'train' and any('--mode=' not in args for args in launches):
    return True
  return f'--mode={mode}' in source or (mode in IN_PROCESS and IN_PROCESS[mode] in source)


def what_a_test_misses(text: str, node: str) -> list[str]:
  """What of `text` the test `node` does not run: its script, launch.py's mode, a config of the command's
  family, stdin when the command pipes its input ([] when it runs them all)."""
  source = checked_source(node)
  family, mode = family_and_mode(text)
  script = re.match(r'python (scripts/\w+\.py)', text)
  missed = []
  if script and script.group(1) not in source:
    missed.append(script.group(1))
  if mode and not runs_mode(source, mode):
    missed.append(f'--mode={mode}')
  if family and not re.search(rf'configs[./]{family}\b|from configs import {family}\b', source):
    missed.append(f'the {family} family (configs/{family}.py)')
  if '--input=-' in text and not ("'--input=-'" in source and 'stdin=' in source):
    missed.append('stdin (--input=-)')
  return missed


@pytest.mark.parametrize('text', [t for t, how in SHOWN.items() if isinstance(how, ByTest)])
def test_a_command_checked_by_a_test_runs_its_family_and_mode(text):
  missed = what_a_test_misses(text, SHOWN[text].node)
  assert not missed, f'{text!r} ({where(text)}): {SHOWN[text].node} does not run {", ".join(missed)}'


def test_a_command_is_given_its_family_and_mode():
  assert family_and_mode('python launch.py') == ('transformer', 'train')
  assert family_and_mode("echo 'x' | python launch.py --mode=predict --workdir=runs/transformer-default-... "
                         '--input=-') == ('transformer', 'predict')
  assert family_and_mode('python launch.py --mode=eval --workdir=gs://BUCKET/runs/gpt2') == ('gpt', 'eval')
  assert family_and_mode('python launch.py --config=configs/rnn_lm.py:random') == ('rnn_lm', 'train')
  assert family_and_mode('python launch.py --mode=export_hf --workdir=runs/smollm --hf_dir=hf/s') == (None, 'export_hf')
  assert family_and_mode('python scripts/make_folds.py --out=/tmp/f') == (None, None)


def test_a_test_of_another_family_or_mode_does_not_check_a_command():
  """The Transformer's stdin predict was once checked by a test that trains a GPT."""
  gpt_predict = 'tests/test_daily_loop.py::test_predict_says_when_an_input_is_cut_to_the_window'
  predict = "echo 'x' | python launch.py --mode=predict --workdir=runs/{}-default-... --input=-"
  assert what_a_test_misses(predict.format('transformer'), gpt_predict) == ['the transformer family '
                                                                            '(configs/transformer.py)']
  assert what_a_test_misses(predict.format('gpt'), gpt_predict) == []
  assert what_a_test_misses(predict.format('gpt').replace('predict', 'eval'), gpt_predict) == ['--mode=eval']
  in_process = 'tests/test_transformer.py::test_train_evaluate_predict_on_a_tsv_corpus'  # load_run(...).predict
  assert what_a_test_misses(predict.format('transformer'), in_process) == ['--mode=predict', 'stdin (--input=-)']


def launch_run(text: str) -> tuple[str, dict, list[str]]:
  """(what a shown launch command pipes into launch.py, the config it trains or reads as a dict ({} for a mode
  that rebuilds the run from its workdir), its other flags) with its --workdir left out."""
  piped, _, command = text.rpartition('|')
  words = shlex.split(command)
  assert words[:2] == ['python', 'launch.py'], text
  flags = [word for word in words[2:] if not word.startswith('--workdir=')]
  spec = next((word.split('=', 1)[1] for word in flags if word.startswith('--config=')), None)
  mode = next((word.split('=', 1)[1] for word in flags if word.startswith('--mode=')), 'train')
  if spec is None and mode == 'train':
    spec = 'configs/default.py'
  config = {}
  if spec is not None:
    path, colon, preset = spec.partition(':')
    module = importlib.import_module(path[:-len('.py')].replace('/', '.'))
    config = (module.get_config(preset) if colon else module.get_config()).to_dict()
  return piped.strip(), config, [word for word in flags if not word.startswith('--config=')]


@pytest.mark.parametrize('text', [t for t, how in SHOWN.items() if isinstance(how, SameAs)])
def test_a_command_like_one_ci_runs_is_that_run_under_another_name(text):
  same = SHOWN[text].command
  assert isinstance(SHOWN.get(same), Ci), f'{text!r} is SameAs {same!r}, which no CI step runs as written'
  assert launch_run(text) == launch_run(same), f'{text!r} is not {same!r} under another --workdir or --config name'


def test_same_as_tells_a_renamed_run_from_another_run():
  assert launch_run('python launch.py --config=configs/transformer.py:default --workdir=runs/a') == launch_run(
      'python launch.py')
  assert launch_run('python launch.py --config=configs/transformer.py:tiny') != launch_run('python launch.py')
  assert launch_run('python launch.py --config.train.steps=5') != launch_run('python launch.py')
  assert launch_run("echo 'x' | python launch.py --mode=predict --workdir=runs/b --input=-") == launch_run(
      "echo 'x' | python launch.py --mode=predict --workdir=runs/a --input=-")
  assert launch_run("echo 'y' | python launch.py --mode=predict --workdir=runs/b --input=-") != launch_run(
      "echo 'x' | python launch.py --mode=predict --workdir=runs/a --input=-")


@pytest.mark.parametrize('text', [t for t, how in SHOWN.items() if isinstance(how, Synopsis)])
def test_a_synopsis_has_placeholders(text):
  assert PLACEHOLDER.search(text), f'{text!r} is called a synopsis but is a command: run it or mark it'


def test_commands_are_read_from_code_blocks_and_inline_spans(tmp_path, monkeypatch):
  page = tmp_path / 'page.md'
  page.write_text(textwrap.dedent('''\
      Intro with `python launch.py --config=configs/x.py` inline and `mkdocs.yml`, not a command.

          python a.py --flag='# not a comment' \\
            --more=1      # the comment, ~3 min
          from train.rundir import load_run

      After the block: needs a GPU. A command wrapped onto the next line (`python launch.py
      --config=configs/y.py --workdir=runs/y`, 63 min on 2 cores of an AMD EPYC) is one command.

      ## Measured

      | command | wall clock |
      | --- | --- |
      | `python launch.py --config=configs/z.py` | 4 min |
      | `python launch.py --config=configs/w.py` | 5 min on an Intel Xeon |
      '''))
  monkeypatch.setattr(shown_commands, 'REPO', str(tmp_path))
  found = shown_commands.shown_in('page.md')
  assert [(s.line, s.text) for s in found] == [
      (1, 'python launch.py --config=configs/x.py'), (3, "python a.py --flag='# not a comment' --more=1"),
      (7, 'python launch.py --config=configs/y.py --workdir=runs/y'), (14, 'python launch.py --config=configs/z.py'),
      (15, 'python launch.py --config=configs/w.py')]
  assert 'the comment, ~3 min' in found[1].context and 'needs a GPU' in found[1].context
  assert isinstance(found[0], Shown) and 'Intro with' in found[0].context
  assert [shown_commands.marked(s, 'minutes') for s in found[2:]] == [True, False, True]  # a row: its own machine


def test_a_wrapped_command_not_in_shown_is_caught(tmp_path, monkeypatch):
  (tmp_path / 'docs').mkdir()
  (tmp_path / 'README.md').write_text('`python launch.py` trains.\n')
  (tmp_path / 'docs' / 'page.md').write_text('Train (`python launch.py\n--config=configs/gpt.py:unlisted`, soon).\n')
  monkeypatch.setattr(shown_commands, 'REPO', str(tmp_path))
  unlisted = [s for s in shown_commands.all_shown() if s.text not in SHOWN]
  assert [(s.page, s.line, s.text) for s in unlisted] == [
      ('docs/page.md', 1, 'python launch.py --config=configs/gpt.py:unlisted')]
