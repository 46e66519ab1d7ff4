"""`train.eval_tasks`: lm-eval tasks scored during training on the current weights, in the training
process (the harness's model evals/harness.py `RunLM` over the live model: no checkpoint reloads).

  python launch.py --config=configs/gpt.py:default --config.train.eval_tasks=python_choice,python_perplexity

launch.py builds a `TrainingTasks` before anything is written (a family that is no decoder, an
unknown task, a task whose data cannot be read: one line, exit 1) and hands it to the trainer
(train/downstream.py says when the loop calls it). Each scoring reads `train.eval_tasks_limit`
evenly spaced documents of each task (evals/runner.py `spaced_samples`: the documents a
`--mode=lm_eval --limit` of the same number scores), in batches of the family's eval batch size;
its metrics are logged as tasks/<task>/<metric> (`metric_name`). Every process scores them (the
model is sharded over all of them); only the leader writes them (train/metrics.py MetricWriter).
"""
from __future__ import annotations

from lm_eval import evaluator
from lm_eval.defaults import DEFAULT_OTHER_SEED

from errors import ConfigError
from evals import harness, runner
from train.downstream import PREFIX, every
from train.rundir import Run

KEY = 'config.train.eval_tasks'


def metric_name(task: str, key: str) -> str | None:
  """tasks/<task>/<metric> of the harness's results key '<metric>,<filter>' of `task` (a filter
  other than 'none' follows as /<filter>); None for a standard error and for what is no metric."""
  metric, comma, filter_name = key.partition(',')
  if not comma or metric.endswith('_stderr'):
    return None
  return f'{PREFIX}{task}/{metric}' + ('' if filter_name == 'none' else f'/{filter_name}')


def task_metrics(results: dict) -> dict[str, float]:
  """{tasks/<task>/<metric>: value} of the harness's `results['results']`."""
  return {name: float(value) for task, values in results.items() for key, value in values.items()
          if (name := metric_name(task, key)) is not None and isinstance(value, (int, float))}


def filters_of(task) -> list[str]:
  """The names of a harness task's filters ('none': its responses as they are)."""
  return [f['name'] for f in task.config.filter_list] if task.config.filter_list else ['none']


def logged_names(loaded: dict) -> list[str]:
  """The names `task_metrics` gives for the harness's loaded tasks and groups (TaskManager.load)."""
  names = [metric_name(name, f'{metric},{filter_name}') for name, task in loaded['tasks'].items()
           for metric in task.aggregation() for filter_name in filters_of(task)]
  for name, group in loaded.get('groups', {}).items():
    for aggregate in group.config.aggregate_metric_list or []:
      filters = aggregate.filter_list or sorted({f for task in group.get_all_tasks() for f in filters_of(task)})
      names += [metric_name(name, f'{aggregate.metric},{filter_name}') for filter_name in filters]
  return sorted(names)


class TrainingTasks:
  """train.eval_tasks of `config` for the run in `workdir`, checked and loaded: the scorer the
  trainer calls (train/downstream.py `Downstream`)."""

  def __init__(self, config, workdir: str):
    train = config.train
    if config.family not in harness.DECODER_FAMILIES:
      raise ConfigError(f'{KEY}={train.eval_tasks!r}: lm-eval tasks score decoder language models, the families '
                        f"{harness.DECODER_FAMILIES}, not a {config.family!r} run; set --{KEY}=''.")
    names = [name.strip() for name in train.eval_tasks.split(',') if name.strip()]
    include_path = train.get('eval_tasks_include_path') or None
    runner.check_include_path(include_path, 'config.train.eval_tasks_include_path')
    manager = runner.known_tasks(names, include_path, KEY)
    self.loaded = manager.load(runner.load_tasks(names, manager, KEY))
    self.samples = runner.spaced_samples(self.loaded['tasks'], train.eval_tasks_limit)
    self.metric_names = logged_names(self.loaded)
    self.config, self.workdir, self.names = config, workdir, names

  def describe(self) -> str:
    """One line: what each scoring scores, when, and the command that scores the same documents."""
    train = self.config.train
    counts = ', '.join(f'{name} {len(self.samples[name]) if self.samples else "all"} of {len(task.eval_docs)}'
                       for name, task in self.loaded['tasks'].items())
    limit = f' --limit={train.eval_tasks_limit}' if train.eval_tasks_limit else ''
    return (f'Tasks during training (train.eval_tasks, every {every(train)} steps and at the last evaluation): '
            f'{counts} documents, evenly spaced (train.eval_tasks_limit={train.eval_tasks_limit}; 0 = all); the same '
            f'as python launch.py --mode=lm_eval --workdir={self.workdir} --tasks={",".join(self.names)}{limit}.')

  def __call__(self, model, task, step: int) -> dict[str, float]:
    """{tasks/<task>/<metric>: value} of `model` (the live nnx model of the family Task `task`) at `step`."""
    run = Run(config=self.config, model_config=task.model_config, model=model, tokenizer=task.tokenizer, step=step,
              task=task, workdir=self.workdir)
    for leaf in self.loaded['tasks'].values():  # few-shot examples drawn as lm_eval.simple_evaluate draws them
      leaf.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    # `evaluate`, not `simple_evaluate`: the latter also records the environment (pip, git) at each call.
    results = evaluator.evaluate(lm=harness.RunLM(run=run, batch_size=task.eval_batch_size), task_dict=self.loaded,
                                 samples=self.samples, bootstrap_iters=0, log_samples=False)
    return task_metrics(results['results'])
