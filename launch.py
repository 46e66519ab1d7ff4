"""The one launcher: train, evaluate, predict with, import or export any model family.

  python launch.py                                            # the default main job (configs/default.py)
  python launch.py --config=configs/gpt.py:tiny --config.train.steps=50 --workdir=runs/try
  python launch.py --config=configs/gpt.py --mode=prepare    # tokenize the data into its cache, no training
  python launch.py --mode=eval --workdir=runs/try             # metrics of the latest checkpoint
  echo 'def main():' | python launch.py --mode=predict --workdir=runs/try --input=-
  python launch.py --mode=import_hf --hf_dir=/path/gpt2 --workdir=runs/gpt2   # family from its config.json
  python launch.py --mode=export_hf --workdir=runs/try --hf_dir=hf/try   # GPT/BERT run -> transformers directory
  python launch.py --mode=lm_eval --workdir=runs/try --tasks=python_choice   # lm-eval tasks (evals/)
  python launch.py --config=configs/gpt.py:bench --mode=bench             # speed: tokens/s, MFU, decoding
  python launch.py --config=configs/gpt.py:gpt2 --mode=compile --compile_target=h100  # compile only: kernels, memory
  python launch.py --sweep=configs/sweeps/gpt_tiny_random.py --workdir=runs/rs --sweep_workers=2  # an Optuna study

`--config=FILE[:preset]` names the config: by default configs/default.py, for `import_hf` the
family of the HF directory's config.json. `train` resumes when `--workdir` holds a checkpoint.
`eval`, `predict` and `lm_eval` rebuild the run from its own config.json and model.json, with the
`--config.*` overrides given applied on top (checked against that file: configs/run.py). Each
mode but `train` ends with one JSON line on stdout. A user mistake (`errors.UserError`, a bad flag
or override) ends with one line on stderr and exit status 1.

  printf 'a text\n' | python launch.py --mode=predict --workdir=runs/bert-bbc --config.task=features --input=-
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import sys
import time
from typing import NoReturn

import ml_collections
from absl import app, flags
from ml_collections import config_flags

import huge_pages
import storage
from errors import UserError

# `--config=FILE[:preset]` and its `--config.<key>=<value>` overrides are defined by parse_flags: the
# override flags follow from the config, which is loaded only once the other flags say which one.
flags.DEFINE_string('workdir', None, 'Run directory (default: runs/<config>-<preset>-<timestamp>).')
flags.DEFINE_enum('mode', 'train', ['train', 'prepare', 'eval', 'predict', 'import_hf', 'export_hf', 'lm_eval', 'bench',
                                    'compile'], 'What to do.')
flags.DEFINE_string('input', '-', 'predict: file with one input per line, or - for stdin.')
flags.DEFINE_string('output', None, 'predict: also write the outputs here, one JSON value per line.')
flags.DEFINE_string('hf_dir', None, 'import_hf: a Hugging Face model directory; export_hf: the new directory to '
                    'write (config.json, model.safetensors, tokenizer files).')
# lm_eval's flags are the harness's own (its `lm_eval` command's).
flags.DEFINE_list('tasks', None, 'lm_eval: the harness tasks to score, comma-separated: names (evals/tasks/, '
                  '--include_path, lm-eval\'s own) or task YAML files.')
flags.DEFINE_string('include_path', None, 'lm_eval: a directory of task YAML files, beside evals/tasks/.')
flags.DEFINE_float('limit', None, 'lm_eval: at most this many examples of each task (below 1: this fraction).')
flags.DEFINE_integer('batch_size', 1, 'lm_eval: requests per compiled batch.')
flags.DEFINE_bool('hf_adapter', False, 'export_hf of a LoRA run: write its adapters as a PEFT adapter directory '
                  '(adapter_config.json, adapter_model.safetensors) for its base run\'s export, instead of the '
                  'model with the adapters merged.')
flags.DEFINE_integer('bench_steps', 10, 'bench: timed train steps (after 2 warm-up steps).')
flags.DEFINE_bool('bench_decode', True, 'bench: also time cached decoding (generative families).')
flags.DEFINE_string('bench_profile', None, 'bench: write a jax.profiler trace of 3 more steps to this directory.')
flags.DEFINE_string('compile_target', None, 'compile: the devices to compile for (cpu, cpu-8, h100, h100x8, h200, '
                    'v5e-8, v5p-16, v4-32, ...; train/targets.py). GPU and TPU targets need requirements-aot.txt.')
flags.DEFINE_string('sweep', None, 'A sweep file (configs/sweeps/*.py): an Optuna study whose trials run in '
                    '<workdir>/<trial>/ (sweeps/runner.py).')
flags.DEFINE_bool('sweep_dry_run', False, 'With --sweep: print one launch command per trial and stop.')
flags.DEFINE_string('sweep_storage', None, 'With --sweep: the study\'s storage, a journal file (also on a disk several '
                    'hosts share) or a database URL (sqlite:///FILE, postgresql://...); default <workdir>/study.journal.')
flags.DEFINE_integer('sweep_workers', 1, 'With --sweep: trials run at once on this host.')
flags.DEFINE_string('sweep_devices', None, 'With --sweep: accelerator ids (e.g. 0,1,2,3) split evenly among '
                    '--sweep_workers; each trial sees its share (CUDA_VISIBLE_DEVICES).')
flags.DEFINE_integer('sweep_heartbeat', 30, 'With --sweep: seconds between a running trial\'s heartbeats; a trial '
                     'silent for twice as long (its host died) is failed and run again.')
flags.DEFINE_bool('distributed', None, 'Call jax.distributed.initialize() (default: auto-detect a '
                  'multi-process launch on TPU pods, SLURM, or when --coordinator_address is set).')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0, for manual multi-process launches.')
flags.DEFINE_integer('num_processes', None, 'Number of processes, for manual multi-process launches.')
flags.DEFINE_integer('process_id', None, 'This process index, for manual multi-process launches.')
FLAGS = flags.FLAGS

CONFIG_HELP = 'Config file[:preset] (default: configs/default.py, or the one --mode implies).'
OVERRIDE = re.compile(r'-{1,2}(?:no)?config\.([^=]+)')  # the key of a --config.<key>=<value> argument


@dataclasses.dataclass(frozen=True)
class Invocation:
  """What parse_flags hands to main besides FLAGS."""
  config_spec: str | None  # the FILE[:preset] that FLAGS.config was loaded from; None: an empty config
  argv: list[str]  # the command line as given: a sweep passes its --config flags on to every trial
  positional: list[str]  # arguments that are not flags (none is accepted)


# The modes. Each takes the run directory (--workdir, or a new one for train, bench and compile),
# reads its other flags from FLAGS and prints its one JSON line.

def train_mode(workdir: str) -> None:
  import jax
  from train import trainer
  leader = jax.process_index() == 0
  task_scorer = None
  if FLAGS.config.train.get('eval_tasks'):  # checked before anything is written (evals/during_training.py)
    from evals.during_training import TrainingTasks
    task_scorer = TrainingTasks(FLAGS.config, workdir)
  if leader:
    print(f'workdir: {workdir}', flush=True)
  results = trainer.train_and_evaluate(FLAGS.config, workdir, task_scorer)
  if not leader:
    return
  if not results.get('preempted'):
    print('\nReload this run (Python or Colab):\n'
          '  from train.rundir import load_run\n'
          f'  run = load_run({workdir!r})\n'
          "  run.predict(['...'])   # or call run.model(...) directly\n", flush=True)
  print_line({'mode': 'train', 'workdir': workdir, **results})


def prepare_mode(workdir: str) -> None:
  del workdir  # the caches live under data.cache_dir, shared by every run on the same data
  from train import trainer
  print_line({'mode': 'prepare', **trainer.prepare_data(FLAGS.config)})


def eval_mode(workdir: str) -> None:
  from train import trainer
  print_line({'mode': 'eval', 'workdir': workdir, **trainer.evaluate_run(workdir, explicit_overrides())})


def predict_mode(workdir: str) -> None:
  """Each --input line and its output, the outputs also in --output."""
  from train.rundir import load_run
  lines = read_lines(FLAGS.input)
  if not lines:
    raise UserError('--mode=predict got no input lines; pass --input=FILE or pipe lines into stdin.')
  if FLAGS.output:
    prepare_output(FLAGS.output)
  run = load_run(workdir, config_overrides=explicit_overrides())
  outputs = jsonable(run.predict(lines))
  if FLAGS.output:
    storage.path(FLAGS.output).write_text(''.join(json.dumps(o) + '\n' for o in outputs))
  for line, output in zip(lines, outputs):
    print(f'>>> {line}\n{output}', flush=True)
  print_line({'mode': 'predict', 'workdir': workdir, 'step': run.step, 'outputs': outputs})


def import_hf_mode(workdir: str) -> None:
  from train import trainer
  if not FLAGS.hf_dir:
    raise app.UsageError('--mode=import_hf needs --hf_dir=DIR (config.json + weights).')
  check_import_family(FLAGS.hf_dir, FLAGS.config.family)
  print_line({'mode': 'import_hf', 'workdir': workdir,
              **trainer.import_hf_run(FLAGS.config, FLAGS.hf_dir, workdir)})


def export_hf_mode(workdir: str) -> None:
  if not FLAGS.hf_dir:
    raise app.UsageError('--mode=export_hf needs --hf_dir=DIR (a new directory to write).')
  from train import lora
  from train.rundir import check_hf_export, load_run, read_config
  saved = read_config(workdir)
  # Before the checkpoint loads:
  check_hf_export(saved.family, FLAGS.hf_dir, FLAGS.hf_adapter, lora.enabled(saved.train))
  print_line({'mode': 'export_hf', 'workdir': workdir, 'hf_dir': FLAGS.hf_dir,
              **load_run(workdir).export_hf(FLAGS.hf_dir, FLAGS.hf_adapter)})


def lm_eval_mode(workdir: str) -> None:
  """The harness's results JSON in <workdir>/lm_eval/ (evals/runner.py)."""
  if not FLAGS.tasks:
    raise UserError('--mode=lm_eval needs --tasks=A,B: task names (evals/tasks/, --include_path, lm-eval\'s own) '
                    'or task YAML files.')
  from evals import runner
  print_line({'mode': 'lm_eval', 'workdir': workdir,
              **runner.evaluate_run(workdir, FLAGS.tasks, include_path=FLAGS.include_path, limit=FLAGS.limit,
                                    batch_size=FLAGS.batch_size, config_overrides=explicit_overrides())})


def bench_mode(workdir: str) -> None:
  """Writes nothing: the workdir is unused."""
  del workdir
  if FLAGS.bench_steps < 1:
    raise app.UsageError(f'--bench_steps={FLAGS.bench_steps}: time at least 1 step.')
  from train.bench import run_benchmark
  print_line(run_benchmark(FLAGS.config, steps=FLAGS.bench_steps, profile_dir=FLAGS.bench_profile,
                           decode=FLAGS.bench_decode))


def compile_mode(workdir: str) -> None:
  """The config's steps compiled for --compile_target (with JAX on the CPU: set_compile_environment)."""
  if not FLAGS.compile_target:
    raise app.UsageError('--mode=compile needs --compile_target (cpu, cpu-8, h100, h100x8, h200, v5e-8, ...).')
  from train import aot
  print_line({'mode': 'compile', **aot.compile_for_target(FLAGS.config, FLAGS.compile_target, workdir)})


MODES = {'train': train_mode, 'prepare': prepare_mode, 'eval': eval_mode, 'predict': predict_mode,
         'import_hf': import_hf_mode, 'export_hf': export_hf_mode, 'lm_eval': lm_eval_mode, 'bench': bench_mode,
         'compile': compile_mode}
NEW_WORKDIR_MODES = ('train', 'prepare', 'bench', 'compile')  # the others read a run, so --workdir must name one


def main(invocation: Invocation) -> None:
  """Runs the sweep of --sweep, or else the --mode."""
  if invocation.positional:
    raise app.UsageError(f'Unexpected arguments: {invocation.positional}')
  from absl import logging
  logging.set_verbosity(logging.WARNING)  # Orbax and JAX log every save at INFO
  if FLAGS.sweep:
    from sweeps import runner
    runner.run_sweep_from_flags(FLAGS, invocation.argv, check_overrides=check_sweep_overrides)
    return
  if not FLAGS.workdir and FLAGS.mode not in NEW_WORKDIR_MODES:
    raise app.UsageError(f'--mode={FLAGS.mode} needs --workdir.')
  prefix = f'compile-{FLAGS.compile_target}-' if FLAGS.mode == 'compile' else ''
  maybe_initialize_distributed()
  MODES[FLAGS.mode](FLAGS.workdir or default_workdir(invocation.config_spec, prefix))


def run_main(invocation: Invocation) -> None:
  """User mistakes (errors.UserError) end with one message and exit status 1, not a traceback."""
  try:
    main(invocation)
  except UserError as e:
    exit_with_error(str(e))
  except KeyboardInterrupt:  # Ctrl-C (or SIGTERM during setup): the trainer kept what was complete
    print('Interrupted.', file=sys.stderr, flush=True)
    sys.exit(130)


# What the modes share.

def default_workdir(config_spec: str, prefix: str = '') -> str:
  path, _, preset = config_spec.partition(':')
  name = os.path.splitext(os.path.basename(path))[0]
  return os.path.join('runs', f'{prefix}{name}-{preset or "default"}-{time.strftime("%Y%m%d-%H%M%S")}')


def maybe_initialize_distributed() -> None:
  import jax
  auto = any(os.environ.get(v) for v in ('TPU_WORKER_HOSTNAMES', 'MEGASCALE_COORDINATOR_ADDRESS')) or \
      int(os.environ.get('SLURM_NTASKS', '1')) > 1 or FLAGS.coordinator_address is not None
  if FLAGS.distributed or (FLAGS.distributed is None and auto):
    # Collectives between CPU devices of different processes (over TCP); TPU/GPU collectives are unaffected.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(coordinator_address=FLAGS.coordinator_address, num_processes=FLAGS.num_processes,
                               process_id=FLAGS.process_id)


def explicit_overrides() -> dict:
  """{'task': 'features', ...}: the `--config.<key>=<value>` overrides given on the command line."""
  return dict(config_flags.get_override_values(FLAGS['config']))


def read_lines(path: str) -> list[str]:
  """The lines of --input (a file, or - for stdin), which must be UTF-8 either way."""
  from data.sources import decode_utf8  # one rule for every text the project reads
  if path == '-':
    raw, name = sys.stdin.buffer.read(), '<stdin>'
  elif not storage.path(path).exists():
    raise UserError(f'--input={path} does not exist; pass a file with one input per line, or - for stdin.')
  else:
    raw, name = storage.path(path).read_bytes(), path
  text = decode_utf8(raw, name).replace('\r\n', '\n')
  return text.removesuffix('\n').split('\n') if text else []  # not splitlines(): it also cuts at \f, U+2028, ...


def prepare_output(location: str) -> None:
  """Create --output's directory now, so that a place that cannot take the file fails before the
  decoding, not after it."""
  output = storage.path(location)
  if output.is_dir():
    raise UserError(f'--output={location} is a directory; name a file in it, e.g. '
                    f'--output={os.path.join(location, "predictions.jsonl")}.')
  try:
    output.parent.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    reason = 'a file of that name exists' if isinstance(e, FileExistsError) else e.strerror or str(e)
    raise UserError(f'--output={location}: its directory {output.parent} cannot be created ({reason}); '
                    f'name a file in a directory you can write.') from None


def hf_model_type(hf_dir: str | None) -> str | None:
  """The `model_type` of hf_dir/config.json; None when there is no readable one."""
  try:
    with open(os.path.join(hf_dir or '', 'config.json')) as f:
      return json.load(f).get('model_type')
  except (OSError, ValueError, AttributeError):
    return None


def hf_import_configs() -> dict[str, str]:
  """{Hugging Face model_type: 'configs/<family>.py:<preset>'}, from each config file's HF_MODEL_TYPES."""
  directory = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs')
  configs = {}
  for name in sorted(file[:-3] for file in os.listdir(directory) if file.endswith('.py') and not file.startswith('_')):
    for model_type, preset in getattr(importlib.import_module(f'configs.{name}'), 'HF_MODEL_TYPES', {}).items():
      configs[model_type] = f'configs/{name}.py:{preset}'
  return configs


def check_import_family(hf_dir: str, family: str) -> None:
  """UserError unless hf_dir's config.json reads and its model_type is one `family` imports (any
  importing family when config.json names none)."""
  from interop.common import read_hf_config
  model_type = read_hf_config(hf_dir).get('model_type')  # HFImportError: config.json missing or not JSON
  configs = hf_import_configs()
  if model_type is None:
    importing = sorted({spec.split(':')[0] for spec in configs.values()})
    if f'configs/{family}.py' not in importing:
      raise UserError(f'{hf_dir}/config.json names no model_type; pass the config of its family, one of '
                      f'{importing}.')
    return
  if model_type not in configs:
    raise UserError(f'{hf_dir}/config.json has model_type={model_type!r}; import_hf reads '
                    f'{sorted(configs)} directories.')
  expected = configs[model_type].split(':')[0]
  if expected != f'configs/{family}.py':
    raise UserError(f'{hf_dir} holds a {model_type!r} model, which {expected} imports, not the {family!r} '
                    f'config given; drop --config (it follows from config.json) or pass --config={expected}.')


def jsonable(value):
  import numpy as np
  if isinstance(value, dict):
    return {str(k): jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, (np.floating, np.integer)):
    return value.item()
  return value


def print_line(result: dict) -> None:
  print(json.dumps(jsonable(result)), flush=True)


def exit_with_error(message: str) -> NoReturn:
  print(f'error: {message}', file=sys.stderr, flush=True)
  sys.exit(1)


# Flag parsing.

def parse_flags(argv: list[str]) -> Invocation:
  """absl's parsing of argv, with the config file executed exactly once; app.run hands the result to main.

  First the flags defined above, leaving `--config=...` and the `--config.*` overrides; these say
  which config file to load (config_spec). Its config then defines the override flags, and the
  rest is parsed. A mistake in any flag, the config file or an override ends with one line on
  stderr and exit status 1, before anything runs.
  """
  try:
    rest = FLAGS(argv, known_only=True)
    set_compile_environment()
    given, rest = split_config_flag(rest)
    spec = config_spec(given, has_overrides=any(OVERRIDE.match(a) for a in rest))
    config = load_config(spec)
    check_override_keys(config, spec, rest)
    config_flags.DEFINE_config_dict('config', config, CONFIG_HELP, lock_config=True, sys_argv=rest)
    FLAGS['config'].default_as_str = None  # --help: CONFIG_HELP names the default, not the whole config
    return Invocation(config_spec=spec, argv=list(argv), positional=FLAGS(rest)[1:])
  except UserError as e:
    exit_with_error(str(e))
  except Exception as e:  # noqa: BLE001 - absl and config_flags raise many kinds for a bad value
    exit_with_error('bad flag or config override: ' + one_line(e))


def set_compile_environment() -> None:
  """--mode=compile runs nothing, so JAX needs no backend but the CPU (an installed CUDA plugin fails
  to start without a GPU), and --compile_target=cpu-N needs N host devices. JAX reads these when it
  is imported, so they are set here, before anything imports it (launch.py's own imports do not)."""
  if FLAGS.mode != 'compile':
    return
  os.environ['JAX_PLATFORMS'] = 'cpu'
  # libtpu locks /tmp/libtpu_lockfile for the TPU it drives; compiling drives none, so let two compiles share it.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  cpu_devices = re.fullmatch(r'cpu-(\d+)', FLAGS.compile_target or '')
  if cpu_devices:  # XLA reads its flags left to right: the last count wins
    count_flag = f'--xla_force_host_platform_device_count={cpu_devices.group(1)}'
    os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {count_flag}'.strip()


def split_config_flag(args: list[str]) -> tuple[str | None, list[str]]:
  """(the value of the last `--config=FILE[:preset]` or `--config FILE[:preset]` in args, or None;
  args without it)."""
  given, rest = None, []
  args = iter(args)
  for arg in args:
    match = re.fullmatch(r'--?config(=(.*))?', arg, re.DOTALL)
    if match is None:
      rest.append(arg)
    else:
      given = match.group(2) if match.group(1) else next(args, '')
  return given, rest


def config_spec(given: str | None, has_overrides: bool) -> str | None:
  """The FILE[:preset] to load: --config when given, else the one the other flags imply.

  import_hf: the family (and full-size preset) of --hf_dir's config.json model_type
  (`hf_import_configs`). eval/predict/lm_eval with `--config.*` overrides: configs/run.py:<workdir>,
  so that the overrides are checked against (and applied to) the run's own config.json instead of
  configs/default.py. None when nothing asks for a config and nothing uses one: eval, predict,
  lm_eval and export_hf rebuild the run from its own files, a sweep gives each trial its own. Otherwise
  configs/default.py.
  """
  if given is not None:
    return given
  if FLAGS.mode == 'import_hf':
    imported = hf_import_configs().get(hf_model_type(FLAGS.hf_dir))
    if imported:
      return imported
  if not has_overrides and (FLAGS.sweep or FLAGS.mode in ('eval', 'predict', 'export_hf', 'lm_eval')):
    return None
  if FLAGS.mode in ('eval', 'predict', 'lm_eval') and FLAGS.workdir:
    return f'configs/run.py:{FLAGS.workdir}'
  return 'configs/default.py'


def load_config(spec: str | None) -> ml_collections.ConfigDict:
  """The config of `FILE[:preset]`: FILE's get_config(preset), or get_config() without a preset;
  an empty config for None.

  This is the one execution of FILE. UserError when FILE is missing, when a configs/run.py
  workdir has no config.json, or when FILE raises (its message, e.g. an unknown preset).
  """
  if spec is None:
    return ml_collections.ConfigDict()
  path, colon, preset = spec.partition(':')
  check_config_file(spec)
  module_spec = importlib.util.spec_from_file_location('launch_config', path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
    return module.get_config(preset) if colon else module.get_config()
  except Exception as e:  # noqa: BLE001 - whatever the config file raises, as one line
    raise UserError('bad flag or config override: ' + one_line(e)) from None


def check_config_file(spec: str) -> None:
  """UserError when spec's file is not there, or names a run (configs/run.py:<workdir>) without config.json."""
  path, colon, workdir = spec.partition(':')
  if not os.path.isfile(path):
    configs = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs')
    names = sorted(n for n in os.listdir(configs) if n.endswith('.py') and n not in ('__init__.py', 'base.py', 'run.py'))
    problem = 'is a directory' if os.path.isdir(path) else 'does not exist'
    raise UserError(f'--config={spec}: {path or "(no file)"} {problem}. Name a config file, one of '
                    f'configs/{{{",".join(names)}}} with an optional :preset, e.g. --config=configs/gpt.py:tiny.')
  if path == 'configs/run.py' and colon and not storage.path(os.path.join(workdir, 'config.json')).exists():
    raise UserError(f'--config.* overrides with --mode={FLAGS.mode} apply to the run\'s own config.json, and '
                    f'{os.path.join(workdir, "config.json")} was not found; pass the --workdir of a trained run.')


def check_sweep_overrides(spec: str, args: list[str]) -> None:
  """UserError for the first `--config.<key>=<value>` a sweep gives its trials (its overrides, grid,
  trials, space) whose key the trials' config lacks or whose value it cannot take, parsed as each
  trial's own command line will be, before any trial starts."""
  config = load_config(spec)
  check_override_keys(config, spec, args)
  for arg in args:
    parsed = flags.FlagValues()
    config_flags.DEFINE_config_dict('config', copy.deepcopy(config), flag_values=parsed, sys_argv=['launch.py', arg])
    try:
      parsed(['launch.py', arg])
    except flags.Error as e:
      from train.validation import flatten
      key = OVERRIDE.match(arg).group(1)
      default = flatten(config).get(key)
      raise UserError(f'The sweep gives its trials {arg}, which {spec} cannot take ({one_line(e)}); give {key} '
                      f'a value of type {type(default).__name__}, like its default {default!r}.') from None


def check_override_keys(config, spec: str | None, args: list[str]) -> None:
  """UserError for the first `--config.<key>=` override in args whose key the config lacks, naming
  the closest key."""
  keys = [match.group(1) for match in map(OVERRIDE.match, args) if match]
  if not keys:
    return
  from train.validation import flatten, unknown_key_message
  known = flatten(config)
  for key in keys:
    if key not in known and not any(k.startswith(key + '.') for k in known):
      path, _, preset = spec.partition(':')
      where = (f'{os.path.join(preset, "config.json")} (the run being reloaded)' if path == 'configs/run.py'
               else f'{path} and configs/base.py')
      raise UserError(unknown_key_message(key, known, where))


def one_line(error: Exception) -> str:
  """error's message on one line (absl quotes the values it rejects, escaping their newlines)."""
  return ' '.join(str(error).strip().replace('\\n', ' ').replace("\\'", "'").split('\n'))


if __name__ == '__main__':
  huge_pages.restart_with_huge_pages()  # XLA:CPU's per-step temporaries on 2 MiB pages (huge_pages.py)
  app.run(run_main, flags_parser=parse_flags)
