"""Where a profiled step spends its time: the top operations of a jax.profiler trace, by total duration.

  python launch.py --config=configs/gpt.py:bench --mode=bench --bench_profile=/tmp/prof
  python scripts/profile_summary.py /tmp/prof [--top 30]

Reads the newest *.xplane.pb under the directory (written by `--bench_profile`, 3 train steps) and
sums event durations per name on every plane and line (XLA thunks / fusions on CPU, kernels on
GPU/TPU), dropping the enclosing per-step and per-program events so shares add up to the step.

By source file: with the optimized HLO XLA dumped in the same process,

  XLA_FLAGS='--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text' python launch.py ... --bench_profile=/tmp/prof
  python scripts/profile_summary.py /tmp/prof --hlo=/tmp/hlo

also sums each event under the file of this repository its HLO instruction came from (the innermost
one on the instruction's recorded Python call stack; for a fusion, that of the operation it was built
around), e.g. how much of a step `models/moe.py` takes. Events are matched to instructions by name.
"""
import argparse
import collections
import glob
import os
import re

from jax.profiler import ProfileData

# Events that enclose others (the whole program, Python dispatch, the step, the host waiting for a
# result); not leaves.
ENCLOSING = ('PjitFunction', 'PjRt', 'ExecuteHelper', 'Thunk:#hlo_op=', 'XlaModule', 'TfrtCpuExecutable',
             'TraceMe', '$', 'jit_', 'ThunkExecutor', 'ExecuteThunks', 'np.asarray', 'SlinkyThreadPool::Await')
# An optimized HLO module's instruction `name = ... metadata={... stack_frame_id=N ...}`, and the
# module's tables of its Python call stacks (XLA prints them after the computations).
INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?stack_frame_id=(\d+)', re.MULTILINE)
TABLE_ROW = re.compile(r'^(\d+) (.*)$')


def _tables(text: str) -> dict[str, dict[int, str]]:
  """{'FileNames' | 'FileLocations' | 'StackFrames': {id: the row's text}} of a dumped module."""
  tables, current = {}, None
  for line in text.splitlines():
    if line in ('FileNames', 'FunctionNames', 'FileLocations', 'StackFrames'):
      current = tables.setdefault(line, {})
    elif current is not None and (row := TABLE_ROW.match(line)):
      current[int(row[1])] = row[2]
    elif current is not None and line.strip():
      current = None
  return tables


def source_files(hlo_dir: str) -> dict[str, str]:
  """{instruction name: the innermost file of this repository on its call stack} over the optimized
  modules (*after_optimizations.txt) dumped in `hlo_dir`."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
  sources = {}
  for path in glob.glob(os.path.join(hlo_dir, '*after_optimizations.txt')):
    text = open(path).read()
    tables = _tables(text)
    files = {k: v.strip('"') for k, v in tables.get('FileNames', {}).items()}
    location_file = {k: int(re.search(r'file_name_id=(\d+)', v)[1]) for k, v in tables.get('FileLocations', {}).items()}
    frames = {k: (int(re.search(r'file_location_id=(\d+)', v)[1]), int(re.search(r'parent_frame_id=(\d+)', v)[1]) - 1)
              for k, v in tables.get('StackFrames', {}).items()}

    def innermost(frame: int) -> str | None:
      while frame in frames:  # a frame's parent is printed one above its id; 0: none
        file = files.get(location_file.get(frames[frame][0]), '')
        if file.startswith(repo) and '/.venv/' not in file:
          return file.removeprefix(repo)
        frame = frames[frame][1]
      return None

    for name, frame in INSTRUCTION.findall(text):
      source = innermost(int(frame))
      if source:
        sources.setdefault(name, source)
  return sources


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('directory')
  parser.add_argument('--top', type=int, default=30)
  parser.add_argument('--hlo', default='', help="XLA's --xla_dump_to directory of the profiled process")
  args = parser.parse_args()
  paths = sorted(glob.glob(os.path.join(args.directory, '**', '*.xplane.pb'), recursive=True), key=os.path.getmtime)
  if not paths:
    raise SystemExit(f'No *.xplane.pb under {args.directory}; run --mode=bench --bench_profile={args.directory}.')
  data = ProfileData.from_file(paths[-1])
  totals, counts = collections.Counter(), collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      for event in line.events:
        if not event.name.startswith(ENCLOSING):
          totals[event.name] += event.duration_ns
          counts[event.name] += 1
  total = sum(totals.values())
  print(f'{paths[-1]}: {total / 1e6:.1f} ms in {sum(counts.values())} leaf events')
  for name, ns in totals.most_common(args.top):
    print(f'{100 * ns / total:6.2f}%  {ns / 1e6:9.2f} ms  x{counts[name]:<5d} {name[:110]}')
  if args.hlo:
    sources = source_files(args.hlo)
    if not sources:
      raise SystemExit(f'No optimized HLO with source metadata under {args.hlo}: run with '
                       f"XLA_FLAGS='--xla_dump_to={args.hlo} --xla_dump_hlo_as_text'.")
    by_file = collections.Counter()
    for name, ns in totals.items():
      by_file[sources.get(name, '(no source: runtime, or not in the dumped modules)')] += ns
    print('\nBy source file:')
    for source, ns in by_file.most_common():
      print(f'{100 * ns / total:6.2f}%  {ns / 1e6:9.2f} ms  {source}')


if __name__ == '__main__':
  main()
