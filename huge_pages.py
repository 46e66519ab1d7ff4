"""Large host allocations on transparent huge pages: launch.py restarts itself once to ask glibc for them.

XLA:CPU allocates a program's temporaries afresh at every execution (`posix_memalign`), and glibc
serves an allocation over 32 MiB (over 64 MiB in a thread's arena, where XLA's executions run) with a
new `mmap`, returned by `munmap` when it is freed. Every train step on the CPU so faults its
temporaries in 4 KiB at a time: the default classifier's step maps 878 MB, 14.3 M page faults in 60
steps and a third of its CPU time in the kernel (AMD EPYC, 2 cores). `glibc.malloc.hugetlb=1`
(glibc >= 2.35) makes malloc `madvise` those mappings for transparent huge pages, one fault per 2 MiB:
0.4 M faults, 1.27x the classifier's tokens/s, the main job 92.6 -> 84.4 s, peak RSS unchanged.
glibc reads its tunables only when a process starts, so the setting takes an exec; a process that
is not restarted (a notebook) gets it from `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` set before it starts.
Keeping the temporaries mapped instead (`glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0`) was
faster still (1.54x) but tripled peak RSS (1.5 -> 4.8 GB): not taken.
"""
import os
import sys

TUNABLE = 'glibc.malloc.hugetlb'
THP_SETTING = '/sys/kernel/mm/transparent_hugepage/enabled'


def environment_with_huge_pages(environ: dict[str, str]) -> dict[str, str] | None:
  """environ with `glibc.malloc.hugetlb=1` added to GLIBC_TUNABLES; None where that cannot help: not
  glibc >= 2.35, the kernel's transparent huge pages off, or GLIBC_TUNABLES already naming the
  tunable (`glibc.malloc.hugetlb=0` opts out)."""
  tunables = environ.get('GLIBC_TUNABLES', '')
  if TUNABLE in tunables or not _glibc_at_least(2, 35) or not _transparent_huge_pages_allowed():
    return None
  return {**environ, 'GLIBC_TUNABLES': ':'.join(filter(None, [tunables, f'{TUNABLE}=1']))}


def restart_with_huge_pages() -> None:
  """Replace this process (same pid, arguments and open files) by one whose malloc uses huge pages,
  unless environment_with_huge_pages says it cannot help. Call it first, before anything runs."""
  environment = environment_with_huge_pages(dict(os.environ))
  if environment is not None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environment)


def _glibc_at_least(major: int, minor: int) -> bool:
  try:
    name, version = (os.confstr('CS_GNU_LIBC_VERSION') or '').split()
    return name == 'glibc' and tuple(map(int, version.split('.')[:2])) >= (major, minor)
  except (ValueError, OSError, AttributeError):  # not glibc, or a system without confstr
    return False


def _transparent_huge_pages_allowed() -> bool:
  """The kernel's setting is `always` or `madvise` (shown in brackets), not `never`."""
  try:
    with open(THP_SETTING) as setting:
      return '[never]' not in setting.read()
  except OSError:
    return False
