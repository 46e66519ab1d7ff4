"""MkDocs hook (mkdocs.yml `hooks:`): the pages' mentions of the repository, linked on the site.

The pages are Markdown that reads well on GitHub too, so they name repository files as code spans
(`measurements/history.md`, `scripts/make_figures.py`) and the project's issues as "issue 33". On the
site these become links into the repository at `repo_url` (mkdocs.yml: the ATTENTION_LINEAGE_REPO_URL
environment variable, else a placeholder), on the branch `extra.repo_branch`:

  `measurements/history.md`             -> [`measurements/history.md`](<repo_url>/blob/<branch>/measurements/history.md)
  `measurements/`                       -> .../tree/<branch>/measurements/
  issue 33, issue #22                   -> [issue 33](<repo_url>/issues/33)
  `notebooks/reload_and_inspect.ipynb`  -> the file's link and an "Open in Colab" badge for it

A code span is linked when it names a file or folder the repository tracks (git ls-files; what exists,
outside a git checkout), outside docs/ (pages link to each other themselves); headings, indented code
blocks and spans already inside a link are left as they are.
"""
import functools
import pathlib
import re
import subprocess

REPO = pathlib.Path(__file__).resolve().parent.parent
CODE_SPAN = re.compile(r'(?<![\[`])`([^`\n]+)`(?![\]`])')
ISSUE = re.compile(r'\bissue #?(\d+)\b')
PATH = re.compile(r'[\w.-]+(?:/[\w.-]+)*/?')
COLAB_BADGE = 'https://colab.research.google.com/assets/colab-badge.svg'


@functools.cache
def tracked() -> frozenset[str] | None:
  """The files git tracks in the repository and their folders (as 'a/b/'); None outside a git checkout."""
  try:
    files = subprocess.run(['git', 'ls-files'], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
  except (OSError, subprocess.CalledProcessError):
    return None
  folders = {'/'.join(path.split('/')[:i]) + '/' for path in files for i in range(1, path.count('/') + 1)}
  return frozenset(files) | frozenset(folders)


def repository_path(text: str) -> str | None:
  """`text` when it names a file or folder of the repository outside docs/, else None."""
  if not PATH.fullmatch(text) or '..' in text or text.split('/')[0] == 'docs':
    return None
  if '/' not in text and not (REPO / text).is_file():  # a lone word: a top-level file (a folder ends in /)
    return None
  known = tracked()
  found = (text if text.endswith('/') or (REPO / text).is_file() else text + '/') in known if known else (
      REPO / text).exists()
  return text if found else None


def colab_url(repo_url: str, branch: str, path: str) -> str | None:
  """Colab's address of a notebook on GitHub, None for a repository elsewhere."""
  match = re.fullmatch(r'https://github\.com/([^/]+/[^/]+?)(?:\.git)?/?', repo_url)
  return f'https://colab.research.google.com/github/{match.group(1)}/blob/{branch}/{path}' if match else None


def link_line(line: str, repo_url: str, branch: str) -> str:
  """`line` with its repository paths and issue numbers linked (its code spans' text kept verbatim)."""
  out, last = [], 0
  for span in CODE_SPAN.finditer(line):
    out.append(ISSUE.sub(lambda m: f'[{m.group(0)}]({repo_url}/issues/{m.group(1)})', line[last:span.start()]))
    path = repository_path(span.group(1))
    if path is None:
      out.append(span.group(0))
    else:
      kind = 'tree' if (REPO / path).is_dir() else 'blob'
      out.append(f'[{span.group(0)}]({repo_url}/{kind}/{branch}/{path})')
      colab = colab_url(repo_url, branch, path) if path.endswith('.ipynb') else None
      if colab:
        out.append(f' [![Open in Colab]({COLAB_BADGE})]({colab})')
    last = span.end()
  out.append(ISSUE.sub(lambda m: f'[{m.group(0)}]({repo_url}/issues/{m.group(1)})', line[last:]))
  return ''.join(out)


def link_markdown(markdown: str, repo_url: str, branch: str) -> str:
  """Every prose line of a page linked (link_line); headings and indented code blocks unchanged."""
  lines = markdown.split('\n')
  in_code = False
  for i, line in enumerate(lines):
    in_code = line.startswith('    ') and (in_code or i == 0 or not lines[i - 1].strip())
    if not in_code and not line.startswith('#'):
      lines[i] = link_line(line, repo_url.rstrip('/'), branch)
  return '\n'.join(lines)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001  (MkDocs' hook signature)
  return link_markdown(markdown, config['repo_url'], config['extra']['repo_branch'])


def on_config(config):
  config['edit_uri'] = f"edit/{config['extra']['repo_branch']}/docs/"
  return config
