"""`python launch.py --mode=lm_eval --workdir=RUN --tasks=A,B [--include_path=DIR] [--limit=N]
[--batch_size=N]`: the run scored on the harness's tasks, the harness's results JSON written to
RUN/lm_eval/results_<time>.json.

Everything a user can get wrong is checked before the checkpoint loads and before anything is
written, each as one line: a run of a family that is not a decoder, a task name the harness does
not know, a task whose data cannot be read, a --include_path that is no directory. The same checks
stand before a training that scores `train.eval_tasks` (evals/during_training.py), naming its keys.

A `--limit` of N documents per task (below 1: that fraction of them, rounded up, as the harness
counts) scores N evenly spaced ones (`spaced_samples`), not the harness's first N: the same every
run, spread over the whole task, as train.eval_tasks_limit and the final evaluation bound theirs.
"""
from __future__ import annotations

import datetime
import json
import os

import lm_eval
from datasets.exceptions import DatasetsError
from lm_eval.api.group import Group
from lm_eval.api.task import Task
from lm_eval.evaluator_utils import get_sample_size
from lm_eval.utils import handle_non_serializable

import storage
from errors import UserError
from evals import harness
from train.evaluation import final_indices
from train.rundir import read_config

RESULTS_DIR = 'lm_eval'  # in the run's workdir


def check_include_path(include_path: str | None, flag: str = '--include_path') -> None:
  if include_path and not os.path.isdir(include_path):
    raise UserError(f'{flag}={include_path} is not a directory; pass a directory of task YAML files.')


def is_known(name: str, manager) -> bool:
  """`name` is a task, group or tag of `manager`'s index, or a task YAML file."""
  return name in manager.all_tasks or (name.endswith('.yaml') and os.path.isfile(name))


def known_tasks(names: list[str], include_path: str | None, flag: str = '--tasks'):
  """The harness's TaskManager that knows every name (the harness's own tasks indexed only when a
  name is not among the local ones); UserError naming the first unknown one. `flag`: what named
  them (--tasks, or config.train.eval_tasks)."""
  local = harness.task_manager(include_path)
  if all(is_known(name, local) for name in names):
    return local
  manager = harness.task_manager(include_path, include_defaults=True)
  for name in names:
    if not is_known(name, manager):
      raise UserError(f"{flag}: unknown task {name!r}: neither one of lm-eval's tasks (`lm_eval ls tasks` lists "
                      f"them) nor one of the local ones ({', '.join(local.all_tasks)}); a directory of task YAMLs "
                      f'({"--include_path=DIR" if flag == "--tasks" else "config.train.eval_tasks_include_path"}) '
                      'adds more.')
  return manager


def load_tasks(names: list[str], manager, flag: str = '--tasks') -> list[Task | Group]:
  """Each named task (or group, or tag's tasks) built with its data; UserError naming the first
  whose data cannot be read."""
  built = []
  for name in names:
    try:
      loaded = manager.load([name])
    except (OSError, DatasetsError) as e:
      reason = ' '.join(str(e).split()) or type(e).__name__
      raise UserError(f'{flag}: the data of task {name!r} cannot be read ({reason}); check the files its YAML '
                      f'names, or the network for a task of the Hugging Face Hub.') from None
    top = loaded['groups'].get(name) or loaded['tasks'].get(name)
    built += [top] if top is not None else list(loaded['tasks'].values())
  return built


def spaced_samples(tasks: dict[str, Task], limit: float | None) -> dict[str, list[int]] | None:
  """The harness's `samples` for `limit` documents of each of `tasks` ({name: task}, the leaf tasks
  the harness's TaskManager.load gives): {name: indices}, `limit` (the harness's count:
  `get_sample_size`) evenly spaced ones (train/evaluation.py `final_indices`); None for no limit."""
  if not limit:
    return None
  return {name: list(final_indices(len(task.eval_docs), get_sample_size(task, limit))) for name, task in tasks.items()}


def evaluate_run(workdir: str, tasks: list[str], *, include_path: str | None = None, limit: float | None = None,
                 batch_size: int = 1, config_overrides: dict | None = None) -> dict:
  """Score the run in `workdir` (`load_run`'s `config_overrides` applied: {'model.attention': 'xla'})
  on `tasks` as the harness's model 'attention_lineage', at most `limit` evenly spaced documents of
  each (module docstring), and write the harness's results JSON into the workdir. Returns {'step',
  'results_file', 'results': {task: {metric: value}}}."""
  harness.check_decoder(read_config(workdir).family, workdir)
  harness.requests_per_batch(batch_size)
  check_include_path(include_path)
  manager = known_tasks(tasks, include_path)
  built = load_tasks(tasks, manager)
  samples = spaced_samples(manager.load(built)['tasks'], limit)
  model_args = {'workdir': workdir, **({'config_overrides': config_overrides} if config_overrides else {})}
  results = lm_eval.simple_evaluate(model=harness.MODEL_NAME, model_args=model_args, tasks=built, task_manager=manager,
                                    samples=samples, batch_size=batch_size, log_samples=False)
  results['config'].update(limit=limit, samples=samples)
  stamp = datetime.datetime.now().isoformat().replace(':', '-')  # the harness's own results_<time>.json
  path = os.path.join(workdir, RESULTS_DIR, f'results_{stamp}.json')
  storage.path(os.path.dirname(path)).mkdir(parents=True, exist_ok=True)
  storage.write_atomically(path, json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
  return {'step': results['config']['step'], 'results_file': path, 'results': results['results']}
