"""The sweep's numbers (issues #28, #34): parallel workers, median pruning, two hosts on one study.

  python scripts/sweep_bench.py [--out=runs/sweep-bench] [--trials=12] [--steps=60] [--compile_cache=fresh|off]
                                [--hosts_storage=postgresql://USER@HOST/DB]

Four sweeps of the same 12-trial random search (seed 0) over the tiny GPT's learning rate (log
scale, 1e-4 to 3e-2) and width (32 or 64), each a `launch.py --sweep` command:
  serial    --sweep_workers=1, no pruning
  parallel  --sweep_workers=2, no pruning: wall time against `serial` (target <= 0.6x); the same
            trials (proposals depend on the seed and each trial's slot only)
  pruned    --sweep_workers=2, median pruner: trials stopped early (target >= 1/3) and whether the
            best trial of `serial` still finished
  hosts     two sweep commands started at once on one study (a journal file, or --hosts_storage),
            one worker each: disjoint trials, every slot run once
Every sweep starts from the same compile-cache state: `fresh` (default) gives each its own empty
JAX compilation cache (<out>/<sweep>/compile_cache; its trials share it, as a sweep's trials do),
`off` runs without one (--config.compile_cache=). The cache hits and programs compiled that the
trials logged are printed for each sweep. Prints a Markdown table with the CPU, the load average
(`uptime`) before each sweep, and writes <out>/bench.json. The machine may be shared: wall times
move with its load.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SWEEP = '''def get_sweep():
  return {{'config': 'configs/gpt.py:tiny',
          'overrides': {{'train.steps': {steps}, 'train.eval_every': {eval_every}, 'train.checkpoint_every': {steps}}},
          'space': {{'train.lr': {{'low': 1e-4, 'high': 3e-2, 'log': True}}, 'model.width': [32, 64]}},
          'sampler': 'random', 'seed': 0, 'n_trials': {trials}, 'pruner': {pruner!r}}}
'''
MEDIAN = {'name': 'median', 'n_startup_trials': 3, 'n_warmup_steps': 10}
CACHE_LINE = re.compile(r'compilation cache .*: (\d+) hits, (\d+) compiled and stored')


def load_average() -> str:
  return open('/proc/loadavg').read().split()[0] if os.path.exists('/proc/loadavg') else '?'


def cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      model = next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
    return f'{os.cpu_count()} x {model}'
  except (OSError, StopIteration):
    return f'{os.cpu_count()} CPUs'


def sweep_command(sweep_file: str, workdir: str, cache: str, *flags: str) -> list[str]:
  """The sweep's command; `cache` is its trials' compile cache ('' = off), an override of every trial."""
  return [sys.executable, os.path.join(REPO, 'launch.py'), f'--sweep={sweep_file}', f'--workdir={workdir}', *flags,
          f'--config.compile_cache={cache}']


def run(commands: list[list[str]], log: str) -> tuple[float, list[str]]:
  """Run the commands at once; (wall seconds, their stdouts). Exits on a failure."""
  started = time.time()
  processes = [subprocess.Popen(c, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for c in commands]
  outputs = [p.communicate() for p in processes]
  seconds = time.time() - started
  with open(log, 'a') as f:
    for command, (out, err) in zip(commands, outputs):
      f.write(f'$ {" ".join(command)}\n{out}\n--- stderr ---\n{err}\n')
  if any(p.returncode for p in processes):
    sys.exit(f'a sweep failed; see {log}')
  return seconds, [out for out, _ in outputs]


def cache_counts(workdir: str) -> dict[str, int]:
  """{'hits', 'compiled'}: the compile-cache lines of the sweep's trial logs, summed over its trials."""
  hits = compiled = 0
  for log in glob.glob(os.path.join(workdir, 'logs', '*.log')):
    for match in CACHE_LINE.finditer(open(log).read()):
      hits, compiled = hits + int(match.group(1)), compiled + int(match.group(2))
  return {'hits': hits, 'compiled': compiled}


def trials_of(workdir: str, location: str) -> list:
  import optuna
  from sweeps import runner, studies
  from sweeps.report import budget_trials
  study = optuna.load_study(study_name=runner.study_name(workdir), storage=studies.open_storage(location))
  return budget_trials(study)


def summary(trials: list) -> dict:
  return {t.user_attrs['name']: {'state': t.state.name, 'eval/loss': t.user_attrs.get('metrics', {}).get('eval/loss'),
                                 'step': t.user_attrs.get('metrics', {}).get('step')} for t in trials}


def write_sweep(out: str, name: str, args, pruner) -> str:
  path = os.path.join(out, f'{name}.py')
  with open(path, 'w') as f:
    f.write(SWEEP.format(steps=args.steps, eval_every=args.steps // 6, trials=args.trials, pruner=pruner))
  return path


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--out', default='runs/sweep-bench')
  parser.add_argument('--trials', type=int, default=12)
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--compile_cache', choices=('fresh', 'off'), default='fresh')
  parser.add_argument('--hosts_storage', default=None, help='the hosts sweep\'s study (default: a journal file)')
  args = parser.parse_args()
  shutil.rmtree(args.out, ignore_errors=True)
  os.makedirs(args.out)
  log = os.path.join(args.out, 'commands.log')
  plain, pruned_file = write_sweep(args.out, 'plain', args, 'none'), write_sweep(args.out, 'pruned', args, MEDIAN)
  cache_of = lambda workdir: os.path.join(workdir, 'compile_cache') if args.compile_cache == 'fresh' else ''
  results = {'cpu': cpu_model(), 'compile_cache': args.compile_cache}
  for name, sweep_file, flags in [('serial', plain, ['--sweep_workers=1']), ('parallel', plain, ['--sweep_workers=2']),
                                  ('pruned', pruned_file, ['--sweep_workers=2'])]:
    workdir, load = os.path.join(args.out, name), load_average()
    seconds, _ = run([sweep_command(sweep_file, workdir, cache_of(workdir), *flags)], log)
    results[name] = {'seconds': seconds, 'load': load, 'cache': cache_counts(workdir),
                     'trials': summary(trials_of(workdir, os.path.join(workdir, 'study.journal')))}
    print(f'{name}: {seconds:.0f} s (load {load}, compile cache {results[name]["cache"]})', flush=True)
  workdir, load = os.path.join(args.out, 'hosts'), load_average()
  location = args.hosts_storage or os.path.join(args.out, 'hosts.journal')
  command = sweep_command(plain, workdir, cache_of(workdir), f'--sweep_storage={location}')
  seconds, outputs = run([command, command], log)
  ran = [re.findall(r'^\[\d+/\d+\] (\S+) \.\.\.$', out, re.MULTILINE) for out in outputs]
  results['hosts'] = {'seconds': seconds, 'load': load, 'ran': ran, 'cache': cache_counts(workdir),
                      'trials': summary(trials_of(workdir, location))}
  report(results, args)


def report(results: dict, args) -> None:
  serial, parallel, pruned, hosts = (results[k] for k in ('serial', 'parallel', 'pruned', 'hosts'))
  best = min((n for n, t in serial['trials'].items() if t['state'] == 'COMPLETE'),
             key=lambda n: serial['trials'][n]['eval/loss'])
  stopped = [n for n, t in pruned['trials'].items() if t['state'] == 'PRUNED']
  ran = hosts['ran']
  checks = {
      'parallel / serial wall time <= 0.6': parallel['seconds'] / serial['seconds'] <= 0.6,
      'parallel ran the same trials as serial': list(parallel['trials']) == list(serial['trials']),
      'median pruner stopped >= 1/3 of the trials': 3 * len(stopped) >= args.trials,
      f'the best trial of serial ({best}) finished in pruned': pruned['trials'][best]['state'] == 'COMPLETE',
      'two hosts: disjoint trials, both took part': all(ran) and not set(ran[0]) & set(ran[1]),
      f'two hosts: {args.trials} trials, each run once': sorted(ran[0] + ran[1]) == sorted(hosts['trials']) and len(
          hosts['trials']) == args.trials and all(t['state'] == 'COMPLETE' for t in hosts['trials'].values()),
  }
  results.update(best_of_serial=best, stopped_early=stopped, checks=checks)
  print(f'\n{results["cpu"]}; each sweep with {"its own empty" if args.compile_cache == "fresh" else "no"} compile '
        f'cache\n\n| sweep | wall time | load average before | compile cache: hits / compiled |\n'
        f'| --- | ---: | ---: | ---: |')
  for name in ('serial', 'parallel', 'pruned', 'hosts'):
    cache = results[name]['cache']
    print(f'| {name} | {results[name]["seconds"]:.0f} s | {results[name]["load"]} | {cache["hits"]} / '
          f'{cache["compiled"]} |')
  print(f'\nparallel / serial: {parallel["seconds"] / serial["seconds"]:.2f}x; pruned: {len(stopped)} of {args.trials} '
        f'({", ".join(stopped)}); best of serial: {best} ({serial["trials"][best]["eval/loss"]:.4f}), in pruned: '
        f'{pruned["trials"][best]["state"]} ({pruned["trials"][best]["eval/loss"]}); hosts ran {len(ran[0])} + '
        f'{len(ran[1])} trials')
  for check, ok in checks.items():
    print(f'{"ok  " if ok else "MISS"} {check}')
  with open(os.path.join(args.out, 'bench.json'), 'w') as f:
    json.dump(results, f, indent=1)


if __name__ == '__main__':
  main()
