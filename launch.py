"""The one launcher: train, evaluate, predict with, import or export any model family.

  python launch.py                                            # the default main job (configs/default.py)
  python launch.py --config=configs/gpt.py:tiny --config.train.steps=50 --workdir=runs/try
  python launch.py --mode=eval --workdir=runs/try             # metrics of the latest checkpoint
  echo 'def main():' | python launch.py --mode=predict --workdir=runs/try --input=-
  python launch.py --mode=import_hf --hf_dir=/path/gpt2 --workdir=runs/gpt2   # family from its config.json
  python launch.py --mode=export_hf --workdir=runs/try --hf_dir=hf/try   # GPT/BERT run -> transformers directory
  python launch.py --config=configs/gpt.py:bench --mode=bench             # speed: tokens/s, MFU, decoding
  python launch.py --config=configs/gpt.py:gpt2 --mode=compile --compile_target=h100  # compile only: kernels, memory
  python launch.py --sweep=configs/sweeps/gpt_tiny_lr.py --workdir=runs/sweep  # trials one after another

`train` resumes when `--workdir` holds a checkpoint. `eval` and `predict` rebuild the run from
its own config.json and model.json, with the `--config.*` overrides given applied on top
(checked against that file: configs/run.py). Each mode but `train` ends with one JSON line on
stdout. A user mistake (`errors.UserError`) ends with one line on stderr and exit status 1.

  printf 'a text\n' | python launch.py --mode=predict --workdir=runs/bert-bbc --config.task=features --input=-
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

from absl import app, flags
from ml_collections import config_flags

import storage
from errors import UserError


def _flag_value(argv, name: str) -> str | None:
  """The last value of `--name=VALUE` or `--name VALUE` in argv (before parsing), else None."""
  value = None
  for i, arg in enumerate(argv):
    if arg.startswith(f'--{name}='):
      value = arg.split('=', 1)[1]
    elif arg == f'--{name}' and i + 1 < len(argv):
      value = argv[i + 1]
  return value


# --mode=import_hf without --config: the config of the HF directory's config.json `model_type`.
HF_IMPORT_CONFIGS = {'gpt2': 'configs/gpt.py:gpt2', 'llama': 'configs/gpt.py:llama', 'bert': 'configs/bert.py:base'}


def hf_model_type(hf_dir: str | None) -> str | None:
  """The `model_type` of hf_dir/config.json; None when there is no readable one."""
  try:
    with open(os.path.join(hf_dir or '', 'config.json')) as f:
      return json.load(f).get('model_type')
  except (OSError, ValueError, AttributeError):
    return None


def _with_config_file(argv: list[str]) -> list[str]:
  """argv with an explicit `--config=` when none is given but one follows from the others.

  import_hf: the family (and its full-size preset) of the HF directory's model_type
  (HF_IMPORT_CONFIGS). eval/predict with `--config.*` overrides: `configs/run.py:<workdir>`, so that
  the overrides are checked against (and applied to) the run's own config.json instead of
  configs/default.py. Other modes with overrides: the default file, named, so that the overrides
  are parsed (and their mistakes reported) by `parse_flags`.
  """
  if _flag_value(argv, 'config') is not None:
    return list(argv)
  import_config = HF_IMPORT_CONFIGS.get(hf_model_type(_flag_value(argv, 'hf_dir')))
  if _flag_value(argv, 'mode') == 'import_hf' and import_config:
    return [argv[0], f'--config={import_config}', *argv[1:]]
  if not any(re.match(r'--(no)?config\.', a) for a in argv):
    return list(argv)
  if _flag_value(argv, 'mode') in ('eval', 'predict') and _flag_value(argv, 'workdir'):
    return [argv[0], f'--config=configs/run.py:{_flag_value(argv, "workdir")}', *argv[1:]]
  return [argv[0], '--config=configs/default.py', *argv[1:]]


def _compile_mode_environment(argv: list[str]) -> None:
  """--mode=compile runs nothing, so JAX needs no backend but the CPU (an installed CUDA plugin fails
  to start without a GPU), and --compile_target=cpu-N needs N host devices. These must be set before
  JAX is imported; every import of JAX in this file comes after this."""
  if _flag_value(argv, 'mode') != 'compile':
    return
  os.environ['JAX_PLATFORMS'] = 'cpu'
  # libtpu locks /tmp/libtpu_lockfile for the TPU it drives; compiling drives none, so let two compiles share it.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  cpu_devices = re.fullmatch(r'cpu-(\d+)', _flag_value(argv, 'compile_target') or '')
  if cpu_devices:  # XLA reads its flags left to right: the last count wins
    count_flag = f'--xla_force_host_platform_device_count={cpu_devices.group(1)}'
    os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {count_flag}'.strip()


_compile_mode_environment(sys.argv)
ARGV = _with_config_file(sys.argv)
config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config file[:preset].', lock_config=True,
                                sys_argv=ARGV)
flags.DEFINE_string('workdir', None, 'Run directory (default: runs/<config>-<preset>-<timestamp>).')
flags.DEFINE_enum('mode', 'train', ['train', 'eval', 'predict', 'import_hf', 'export_hf', 'bench', 'compile'],
                  'What to do.')
flags.DEFINE_string('input', '-', 'predict: file with one input per line, or - for stdin.')
flags.DEFINE_string('output', None, 'predict: also write the outputs here, one JSON value per line.')
flags.DEFINE_string('hf_dir', None, 'import_hf: a Hugging Face model directory; export_hf: the new directory to '
                    'write (config.json, model.safetensors, tokenizer files).')
flags.DEFINE_integer('bench_steps', 10, 'bench: timed train steps (after 2 warm-up steps).')
flags.DEFINE_bool('bench_decode', True, 'bench: also time cached decoding (generative families).')
flags.DEFINE_string('bench_profile', None, 'bench: write a jax.profiler trace of 3 more steps to this directory.')
flags.DEFINE_string('compile_target', None, 'compile: the devices to compile for (cpu, cpu-8, h100, h100x8, h200, '
                    'v5e-8, v5p-16, v4-32, ...; train/targets.py). GPU and TPU targets need requirements-aot.txt.')
flags.DEFINE_string('sweep', None, 'A sweep file (configs/sweeps/*.py): run its trials in <workdir>/<trial>/.')
flags.DEFINE_bool('sweep_dry_run', False, 'With --sweep: print one launch command per trial and stop.')
flags.DEFINE_bool('distributed', None, 'Call jax.distributed.initialize() (default: auto-detect a '
                  'multi-process launch on TPU pods, SLURM, or when --coordinator_address is set).')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0, for manual multi-process launches.')
flags.DEFINE_integer('num_processes', None, 'Number of processes, for manual multi-process launches.')
flags.DEFINE_integer('process_id', None, 'This process index, for manual multi-process launches.')
FLAGS = flags.FLAGS


def default_workdir(config_arg: str, prefix: str = '') -> str:
  path, _, preset = config_arg.partition(':')
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


def predict(workdir: str) -> None:
  """--mode=predict: each --input line and its output, the outputs also in --output, one JSON line."""
  from train.rundir import load_run
  lines = read_lines(FLAGS.input)
  if not lines:
    raise UserError('--mode=predict got no input lines; pass --input=FILE or pipe lines into stdin.')
  if FLAGS.output:
    prepare_output(FLAGS.output)
  run = load_run(workdir, config_overrides=explicit_overrides())
  outputs = _jsonable(run.predict(lines))
  if FLAGS.output:
    storage.path(FLAGS.output).write_text(''.join(json.dumps(o) + '\n' for o in outputs))
  for line, output in zip(lines, outputs):
    print(f'>>> {line}\n{output}', flush=True)
  print(json.dumps({'mode': 'predict', 'workdir': workdir, 'step': run.step, 'outputs': outputs}), flush=True)


def explicit_overrides() -> dict:
  """{'task': 'features', ...}: the `--config.<key>=<value>` overrides given on the command line."""
  if not FLAGS['config'].present:
    return {}
  return dict(config_flags.get_override_values(FLAGS['config']))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  from absl import logging
  logging.set_verbosity(logging.WARNING)  # Orbax and JAX log every save at INFO
  if FLAGS.sweep:
    from train import sweep
    sweep.run_sweep_from_flags(FLAGS, sys.argv)
    return
  maybe_initialize_distributed()
  import jax
  from train import trainer
  from train.rundir import load_run
  config_arg = FLAGS['config'].config_filename if hasattr(FLAGS['config'], 'config_filename') else 'default'
  mode = FLAGS.mode
  workdir = FLAGS.workdir or (default_workdir(config_arg, prefix=f'compile-{FLAGS.compile_target}-')
                              if mode == 'compile' else default_workdir(config_arg))
  if mode not in ('train', 'bench', 'compile') and not FLAGS.workdir:
    raise app.UsageError(f'--mode={mode} needs --workdir.')
  if mode == 'train':
    if jax.process_index() == 0:
      print(f'workdir: {workdir}', flush=True)
    results = trainer.train_and_evaluate(FLAGS.config, workdir)
    if jax.process_index() == 0:
      if not results.get('preempted'):
        print('\nReload this run (Python or Colab):\n'
              '  from train.rundir import load_run\n'
              f'  run = load_run({workdir!r})\n'
              "  run.predict(['...'])   # or call run.model(...) directly\n", flush=True)
      print(json.dumps({'mode': 'train', 'workdir': workdir, **_jsonable(results)}), flush=True)
  elif mode == 'eval':
    results = trainer.evaluate_run(workdir, explicit_overrides())
    print(json.dumps({'mode': 'eval', 'workdir': workdir, **_jsonable(results)}), flush=True)
  elif mode == 'predict':
    predict(workdir)
  elif mode == 'import_hf':
    if not FLAGS.hf_dir:
      raise app.UsageError('--mode=import_hf needs --hf_dir=DIR (config.json + weights).')
    check_import_family(FLAGS.hf_dir, FLAGS.config.family)
    results = trainer.import_hf_run(FLAGS.config, FLAGS.hf_dir, workdir)
    print(json.dumps({'mode': 'import_hf', 'workdir': workdir, **_jsonable(results)}), flush=True)
  elif mode == 'export_hf':
    if not FLAGS.hf_dir:
      raise app.UsageError('--mode=export_hf needs --hf_dir=DIR (a new directory to write).')
    from interop import check_export, export_run
    from train.rundir import read_config
    check_export(read_config(workdir).family, FLAGS.hf_dir)  # before the checkpoint loads
    results = export_run(load_run(workdir), FLAGS.hf_dir)
    print(json.dumps({'mode': 'export_hf', 'workdir': workdir, 'hf_dir': FLAGS.hf_dir, **results}), flush=True)
  elif mode == 'bench':
    if FLAGS.bench_steps < 1:
      raise app.UsageError(f'--bench_steps={FLAGS.bench_steps}: time at least 1 step.')
    from train.bench import run_benchmark
    results = run_benchmark(FLAGS.config, steps=FLAGS.bench_steps, profile_dir=FLAGS.bench_profile,
                            decode=FLAGS.bench_decode)
    print(json.dumps(_jsonable(results)), flush=True)
  elif mode == 'compile':
    run_compile_mode(workdir)


def run_compile_mode(workdir: str) -> None:
  """--mode=compile: the config's steps compiled for --compile_target, described in one JSON line."""
  if not FLAGS.compile_target:
    raise app.UsageError('--mode=compile needs --compile_target (cpu, cpu-8, h100, h100x8, h200, v5e-8, ...).')
  from train import aot
  results = aot.compile_for_target(FLAGS.config, FLAGS.compile_target, workdir)
  print(json.dumps({'mode': 'compile', **_jsonable(results)}), flush=True)


def check_import_family(hf_dir: str, family: str) -> None:
  """UserError unless hf_dir's model_type is one `family` imports (when config.json says)."""
  model_type = hf_model_type(hf_dir)
  if model_type is None:
    return  # no readable config.json: the importer reports what is missing
  if model_type not in HF_IMPORT_CONFIGS:
    raise UserError(f'{hf_dir}/config.json has model_type={model_type!r}; import_hf reads '
                    f'{sorted(HF_IMPORT_CONFIGS)} directories.')
  expected = HF_IMPORT_CONFIGS[model_type].split(':')[0]
  if expected != f'configs/{family}.py':
    raise UserError(f'{hf_dir} holds a {model_type!r} model, which {expected} imports, not the {family!r} '
                    f'config given; drop --config (it follows from config.json) or pass --config={expected}.')


def _jsonable(value):
  import numpy as np
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, (np.floating, np.integer)):
    return value.item()
  return value


def _unknown_override(argv) -> str | None:
  """The message for the first `--config.<key>=` override whose key the config file lacks."""
  import importlib.util
  spec_arg = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), 'configs/default.py')
  path, _, preset = spec_arg.partition(':')
  spec = importlib.util.spec_from_file_location('_launch_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(preset) if preset else module.get_config()
  from train.validation import flatten, unknown_key_message
  known = flatten(config)
  for arg in argv:
    if arg.startswith('--config.'):
      key = arg[len('--config.'):].split('=', 1)[0]
      if key not in known and not any(k.startswith(key + '.') for k in known):
        where = (f'{os.path.join(preset, "config.json")} (the run being reloaded)' if path == 'configs/run.py'
                 else f'{path} and configs/base.py')
        return unknown_key_message(key, known, where)
  return None


def _missing_config_file(config_arg: str | None) -> str | None:
  """The message for a `--config=FILE[:preset]` whose file is not there (config_flags reports it
  only when the config is first used, as two chained tracebacks)."""
  path = (config_arg or '').partition(':')[0]
  if not path or os.path.isfile(path):
    return None
  configs = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs')
  names = sorted(n for n in os.listdir(configs) if n.endswith('.py') and n not in ('__init__.py', 'base.py', 'run.py'))
  problem = 'is a directory' if os.path.isdir(path) else 'does not exist'
  return (f'--config={config_arg}: {path} {problem}. Name a config file, one of configs/{{{",".join(names)}}} '
          f'with an optional :preset, e.g. --config=configs/gpt.py:tiny.')


def parse_flags(argv):
  """absl flag parsing, with config override mistakes (unknown key, bad value) as one clear line."""
  argv = _with_config_file(argv)
  run_file = _flag_value(argv, 'config')
  missing = _missing_config_file(run_file)
  if missing:
    print(f'error: {missing}', file=sys.stderr)
    sys.exit(1)
  if run_file and run_file.startswith('configs/run.py:'):
    path = os.path.join(run_file.split(':', 1)[1], 'config.json')
    try:
      found = storage.path(path).exists()
    except UserError as e:  # a gs:// workdir without gcsfs or credentials
      print(f'error: {e}', file=sys.stderr)
      sys.exit(1)
    if not found:
      print(f'error: --config.* overrides with --mode={_flag_value(argv, "mode")} apply to the run\'s own '
            f'config.json, and {path} was not found; pass the --workdir of a trained run.', file=sys.stderr)
      sys.exit(1)
  try:
    return FLAGS(argv)
  except Exception as e:  # noqa: BLE001 - config_flags raises AttributeError/KeyError/ValueError
    try:
      message = _unknown_override(argv)
    except Exception:  # noqa: BLE001 - the config file itself is broken: show the original error
      message = None
    if message is None:
      message = 'bad flag or config override: ' + str(e).strip().replace('\\n', ' ').replace("\\'", "'")
    print(f'error: {message}', file=sys.stderr)
    sys.exit(1)


def run_main(argv):
  """User mistakes (errors.UserError) end with one message and exit status 1, not a traceback."""
  try:
    main(argv)
  except UserError as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(1)
  except KeyboardInterrupt:  # Ctrl-C (or SIGTERM during setup): the trainer kept what was complete
    print('Interrupted.', file=sys.stderr, flush=True)
    sys.exit(130)


if __name__ == '__main__':
  app.run(run_main, flags_parser=parse_flags)
