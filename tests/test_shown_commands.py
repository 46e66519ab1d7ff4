"""Every command the README and the docs show is run by CI or a test, or its page says why it cannot run
here (tests/shown_commands.py says which, command by command)."""
import os
import re
import textwrap

import pytest

import shown_commands
from shown_commands import SHOWN, Ci, Needs, Shown, Synopsis, ByTest

REPO = shown_commands.REPO
CI_STEPS = re.findall(r"^step '([^']+)'", open(os.path.join(REPO, '.ci', 'run')).read(), re.M)
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
  mark = shown_commands.MARKS[SHOWN[text].what]
  unmarked = [f'{s.page}:{s.line}' for s in EVERY if s.text == text and not re.search(mark, s.context)]
  assert not unmarked, f'{text!r} needs {SHOWN[text].what}, but nothing around it on {unmarked} says so'


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

      After the block: needs a GPU.
      '''))
  monkeypatch.setattr(shown_commands, 'REPO', str(tmp_path))
  found = shown_commands.shown_in('page.md')
  assert [(s.line, s.text) for s in found] == [
      (1, 'python launch.py --config=configs/x.py'), (3, "python a.py --flag='# not a comment' --more=1")]
  assert 'the comment, ~3 min' in found[1].context and 'needs a GPU' in found[1].context
  assert isinstance(found[0], Shown) and 'Intro with' in found[0].context
