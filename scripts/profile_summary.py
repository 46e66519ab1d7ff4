"""Where a profiled step spends its time: the top operations of a jax.profiler trace, by total duration.

  python launch.py --config=configs/gpt.py:bench --mode=bench --bench_profile=/tmp/prof
  python scripts/profile_summary.py /tmp/prof [--top 30]

Reads the newest *.xplane.pb under the directory (written by `--bench_profile`, 3 train steps) and
sums event durations per name on every plane and line (XLA thunks / fusions on CPU, kernels on
GPU/TPU), dropping the enclosing per-step and per-program events so shares add up to the step.
"""
import argparse
import collections
import glob
import os

from jax.profiler import ProfileData

# Events that enclose others (the whole program, Python dispatch, the step); not leaves.
ENCLOSING = ('PjitFunction', 'PjRt', 'ExecuteHelper', 'Thunk:#hlo_op=', 'XlaModule', 'TfrtCpuExecutable',
             'TraceMe', '$', 'jit_', 'ThunkExecutor', 'ExecuteThunks')


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('directory')
  parser.add_argument('--top', type=int, default=30)
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


if __name__ == '__main__':
  main()
