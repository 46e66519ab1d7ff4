"""tests/postgres_server.py finds a PostgreSQL server as Debian installs it or on PATH (Fedora,
Homebrew), and without one skips the tests that need it with one line naming what to install."""
import os

import pytest

import postgres_server


def executables(folder, names=('initdb', 'postgres')) -> str:
  os.makedirs(folder, exist_ok=True)
  for name in names:
    path = os.path.join(folder, name)
    with open(path, 'w') as f:
      f.write('#!/bin/sh\n')
    os.chmod(path, 0o755)
  return str(folder)


def test_the_newest_debian_server_comes_first_then_the_programs_on_path(tmp_path, monkeypatch):
  on_path = executables(tmp_path / 'bin')
  monkeypatch.setenv('PATH', on_path)
  monkeypatch.setattr(postgres_server, 'DEBIAN_SERVERS', str(tmp_path / 'lib' / '*' / 'bin'))
  assert postgres_server.programs() == {name: os.path.join(on_path, name) for name in ('initdb', 'postgres')}
  for version in ('9', '15', '16'):  # 16 lacks initdb: not a whole server
    executables(tmp_path / 'lib' / version / 'bin', ('initdb', 'postgres') if version != '16' else ('postgres',))
  newest = str(tmp_path / 'lib' / '15' / 'bin')
  assert postgres_server.programs() == {name: os.path.join(newest, name) for name in ('initdb', 'postgres')}


def test_without_a_server_the_tests_that_need_one_skip_with_what_to_install(tmp_path, monkeypatch):
  monkeypatch.setenv('PATH', executables(tmp_path / 'bin', ('postgres',)))  # initdb missing: no server
  monkeypatch.setattr(postgres_server, 'DEBIAN_SERVERS', str(tmp_path / 'nothing' / '*' / 'bin'))
  assert postgres_server.programs() is None
  with pytest.raises(pytest.skip.Exception) as skipped:
    with postgres_server.PostgresServer():
      pass
  assert str(skipped.value) == ('PostgreSQL server not found (initdb and postgres): apt-get install postgresql '
                                '(Debian) / dnf install postgresql-server (Fedora) / brew install postgresql (macOS)')
