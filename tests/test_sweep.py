"""Sweeps as Optuna studies (sweeps/runner.py): a grid gives today's trials and table, two hosts share
one study (a journal file, and a real PostgreSQL server) without running a trial twice, a study
killed midway resumes without repeating finished trials (the interrupted one from its
checkpoint), a trial pruned by its worker stops early with a checkpoint that reloads, per-slot
seeds, one line for each bad input, and exit status 1 when no trial finished ok.

The trials of this module are tiny GPTs of a few shapes: they share one persistent compilation cache
(JAX's, as every run has; here a fresh directory, caching programs of any compile time), so that a
program compiled by one trial loads in the next instead of compiling again."""
import csv
import json
import os
import re
import signal
import threading
import time
import types

import matplotlib.image
import optuna
import pytest
from optuna.storages import RetryHeartbeatStaleTrialCallback

import support
from numerics import assert_close
from postgres_server import PostgresServer
from sweeps import runner, studies

pytestmark = pytest.mark.filterwarnings('ignore::optuna.exceptions.ExperimentalWarning')  # as run_sweep does
SWEEP_FILE = '''
def get_sweep():
  return {{
      'config': 'configs/gpt.py:tiny',
      'overrides': {{'data.source': {source!r}, 'compile_cache': {cache!r}, 'model.num_layers': 1, 'train.steps': 4,
                    'train.eval_every': 2, 'train.checkpoint_every': 4, 'train.eval_steps': 0, 'train.log_every': 2}},
      'grid': {{'train.lr': [0.001, 0.003], 'train.warmup_steps': [1]}},
      # A trial of keys of its own (the table's last columns), which fails: 3 heads do not divide a width of 16.
      'trials': [{{'model.width': 16, 'model.num_heads': 3}}],
  }}
'''
GRID_TRIALS = ['00-lr=0.001-warmup_steps=1', '01-lr=0.003-warmup_steps=1', '02-width=16-num_heads=3']
# Trial 1 (LONG) is long enough to be killed midway (40 steps after its first checkpoint), and is never
# compared with trial 0 (its evaluations come at other steps); trial 2 (a learning rate that learns
# nothing) is pruned at its first evaluation by its worker, against trial 0's one evaluation
# (n_startup_trials=1), long before its last step (the steps after it are never run).
LONG = {'train.lr': 0.01, 'train.steps': 50, 'train.eval_every': 25}
KILL_FILE = '''
def get_sweep():
  return {{
      'config': 'configs/gpt.py:tiny',
      'overrides': {{'data.source': {source!r}, 'compile_cache': {cache!r}, 'model.num_layers': 1, 'train.steps': 10,
                    'train.eval_every': 10, 'train.checkpoint_every': 10, 'train.eval_steps': 1,
                    'train.log_every': 10}},
      'trials': {trials!r},
      'pruner': {{'name': 'median', 'n_startup_trials': 1}},
  }}
'''
KILL_TRIALS = [{'train.lr': 0.01}, LONG, {'train.lr': 1e-7, 'train.steps': 200}]
KILLED, PRUNED = '01-lr=0.01-steps=50-eval_every=25', '02-lr=1e-07-steps=200'


def sweep_process(sweep_file: str, workdir: str, *args: str, start_new_session: bool = False):
  """The sweep command, started (a `subprocess.Popen` alike: support.launch)."""
  return support.launch([f'--sweep={sweep_file}', f'--workdir={workdir}', *args], background=True,
                        start_new_session=start_new_session)


def load_study(workdir: str, location: str | None = None) -> optuna.Study:
  return optuna.load_study(study_name=runner.study_name(workdir),
                           storage=studies.open_storage(location or os.path.join(workdir, 'study.journal')))


def started(stdout: str) -> list[str]:
  return re.findall(r'^\[\d+/\d+\] (\S+) \.\.\.$', stdout, re.MULTILINE)


def read_rows(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, 'sweep.csv')) as f:
    return list(csv.DictReader(f))


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return support.write_corpus(str(tmp_path_factory.mktemp('corpus')), files=3, lines=30)


@pytest.fixture(scope='module')
def cache(tmp_path_factory):
  """The trials' compilation cache."""
  return str(tmp_path_factory.mktemp('compile_cache'))


@pytest.fixture(scope='module')
def sweep_file(corpus, cache, tmp_path_factory):
  path = tmp_path_factory.mktemp('sweep') / 'tiny.py'
  path.write_text(SWEEP_FILE.format(source=corpus, cache=cache))
  return str(path)


@pytest.fixture(scope='module')
def two_hosts(sweep_file, tmp_path_factory):
  """Today's grid sweep, run by two sweep commands started at once on one study in the default
  journal file (one of them with two workers): (workdir, [(returncode, stdout, stderr)] per host)."""
  workdir = str(tmp_path_factory.mktemp('hosts') / 'sweep')
  hosts = [sweep_process(sweep_file, workdir, '--sweep_workers=2'), sweep_process(sweep_file, workdir)]
  outputs = [h.communicate(timeout=600) for h in hosts]
  return workdir, [(h.returncode, *output) for h, output in zip(hosts, outputs)]


@pytest.fixture(scope='module')
def postgres():
  with PostgresServer() as server:
    yield server


@pytest.fixture(scope='module')
def killed_and_rerun(corpus, cache, postgres, tmp_path_factory):
  """A sweep on a study in PostgreSQL, killed (with its trial, as when a host dies) while trial 1
  trains, then rerun by two hosts at once: one takes trial 2, the other (once trial 1's heartbeat
  is stale) its retry."""
  root = tmp_path_factory.mktemp('killed')
  (root / 'kill.py').write_text(KILL_FILE.format(source=corpus, cache=cache, trials=KILL_TRIALS))
  workdir, storage = str(root / 'sweep'), f'--sweep_storage={postgres.url}'
  first = sweep_process(str(root / 'kill.py'), workdir, storage, '--sweep_heartbeat=1', start_new_session=True)
  checkpoints = os.path.join(workdir, KILLED, 'checkpoints')
  deadline = time.time() + 300
  while not (os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints))):
    assert first.poll() is None and time.time() < deadline, first.communicate()
    time.sleep(0.05)
  os.killpg(first.pid, signal.SIGKILL)
  first_out = first.communicate()[0]
  before = {name: open(os.path.join(workdir, name, 'metrics.jsonl')).read() for name in ['00-lr=0.01']}
  states = [t.state for t in load_study(workdir, postgres.url).get_trials()]
  # Stale after 2 heartbeats of 2 s: the hosts wait for that, and never take each other's live trial as stale.
  hosts = [sweep_process(str(root / 'kill.py'), workdir, storage, '--sweep_heartbeat=2') for _ in range(2)]
  outputs = [h.communicate(timeout=600) for h in hosts]
  return workdir, first_out, states, before, [(h.returncode, *output) for h, output in zip(hosts, outputs)]


def test_a_grid_gives_the_trials_and_table_of_before(two_hosts):
  workdir, hosts = two_hosts
  assert [h[0] for h in hosts] == [0, 0], [h[2][-2000:] for h in hosts]
  rows = read_rows(workdir)
  assert [r['trial'] for r in rows] == GRID_TRIALS
  assert [r['status'] for r in rows] == ['ok', 'ok', 'failed'] and rows[0]['train.lr'] == '0.001'
  assert list(rows[0])[:6] == ['trial', 'status', 'train.lr', 'train.warmup_steps', 'model.width', 'model.num_heads']
  assert (rows[0]['model.width'], rows[2]['model.width'], rows[2]['model.num_heads']) == ('', '16', '3')
  for row in rows[:2]:
    with open(os.path.join(workdir, row['trial'], 'metrics.jsonl')) as f:
      best_eval = min(m['eval/loss'] for m in map(json.loads, f) if 'eval/loss' in m)
    # The trial's final line: the best checkpoint's loss over the whole validation split (eval_steps=0).
    # The same evaluation program on the same batches (train and final evaluation), as sweep.csv prints it.
    assert_close(float(row['eval/loss']), best_eval, terms=1)
    assert row['step'] == '4', row
  assert rows[2]['eval/loss'] == '' and 'num_heads=3 does not divide' in rows[2]['error']
  table = open(os.path.join(workdir, 'sweep.md')).read()
  assert '2 of 3 trials ok' in table and table.count('\n| 0') == 3
  best = min(rows[:2], key=lambda r: float(r['eval/loss']))['trial']
  assert f'`{best}`' in table and f'--workdir={workdir}/{best}' in table  # the best trial's command line
  for plot in ('eval_loss.png', 'history.png', 'importance.png'):
    image = matplotlib.image.imread(os.path.join(workdir, plot))
    assert image.ndim == 3 and image.shape[1] > 300
  assert 'does not divide' in open(os.path.join(workdir, 'logs', '02-width=16-num_heads=3.log')).read()


def test_two_hosts_on_one_study_run_disjoint_trials_and_the_budget_once(two_hosts):
  workdir, hosts = two_hosts
  assert [h[0] for h in hosts] == [0, 0], [h[2][-2000:] for h in hosts]
  ran = [started(stdout) for _, stdout, _ in hosts]
  assert all(ran) and not set(ran[0]) & set(ran[1]), ran  # both took part, never the same trial
  assert sorted(ran[0] + ran[1]) == GRID_TRIALS
  trials = load_study(workdir).get_trials()
  named = [t for t in trials if 'name' in t.user_attrs]
  assert sorted(t.user_attrs['slot'] for t in named) == [0, 1, 2]  # each slot once, none retried
  assert [t.user_attrs['name'] for t in sorted(named, key=lambda t: t.number)] == GRID_TRIALS  # the file's order
  # A trial opened past the budget when both hosts asked for the last slot at once never ran.
  assert all(t.user_attrs.get('over_budget') for t in trials if t not in named)
  for name in ran[0] + ran[1]:
    assert '--- the next attempt' not in open(os.path.join(workdir, 'logs', f'{name}.log')).read()


def test_two_hosts_on_one_postgresql_study_run_disjoint_trials_none_twice(killed_and_rerun, postgres):
  workdir, _, _, _, hosts = killed_and_rerun
  assert [h[0] for h in hosts] == [0, 0], [h[2][-2000:] for h in hosts]
  assert not os.path.exists(os.path.join(workdir, 'study.journal'))  # the study is in the database
  ran = [started(stdout) for _, stdout, _ in hosts]
  assert sorted(ran) == [[KILLED], [PRUNED]], ran  # one trial each: the dead host's (retried once) and the next
  trials = load_study(workdir, postgres.url).get_trials()
  named = [t for t in trials if 'name' in t.user_attrs]
  TrialState = optuna.trial.TrialState
  assert [(t.user_attrs['slot'], t.state) for t in named] == [  # the dead host's trial failed once, retried once
      (0, TrialState.COMPLETE), (1, TrialState.FAIL), (2, TrialState.PRUNED), (1, TrialState.COMPLETE)]
  assert not named[1].user_attrs.get('interrupted')  # failed as stale, not stopped by a signal
  assert all(t.user_attrs.get('over_budget') for t in trials if t not in named)
  for name in (PRUNED, KILLED):  # the killed worker wrote no log: each trial ran once on the rerun
    assert '--- the next attempt' not in open(os.path.join(workdir, 'logs', f'{name}.log')).read()


def test_hosts_opening_a_new_postgresql_database_at_once_all_open_it(postgres):
  """The first hosts on a new database create Optuna's tables at once; each must open it all the same."""
  import psycopg
  for round_ in range(3):
    with psycopg.connect(postgres.url, autocommit=True) as connection:
      connection.execute(f'CREATE DATABASE race{round_}')
    url, errors = f'{postgres.url.rsplit("/", 1)[0]}/race{round_}', []

    def open_it():
      try:
        studies.open_storage(url)
      except studies.SweepError as e:
        errors.append(str(e))

    hosts = [threading.Thread(target=open_it) for _ in range(4)]
    for host in hosts:
      host.start()
    for host in hosts:
      host.join()
    assert not errors, errors


def test_a_killed_study_resumes_without_repeating_finished_trials(killed_and_rerun, postgres):
  workdir, first_out, states, before, hosts = killed_and_rerun
  assert started(first_out) == ['00-lr=0.01', KILLED]
  TrialState = optuna.trial.TrialState
  assert states == [TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING]  # trial 2: queued, not started
  assert [h[0] for h in hosts] == [0, 0], [h[2][-2000:] for h in hosts]
  assert '00-lr=0.01' not in hosts[0][1] + hosts[1][1]  # trial 0 is not run again
  assert open(os.path.join(workdir, '00-lr=0.01', 'metrics.jsonl')).read() == before['00-lr=0.01']
  log = open(os.path.join(workdir, 'logs', f'{KILLED}.log')).read()
  resumed = int(re.search(r'Resumed from the checkpoint at step (\d+)', log).group(1))
  assert 10 <= resumed < 50  # the interrupted trial went on from its checkpoint
  assert [(r['status'], r['step']) for r in read_rows(workdir)] == [('ok', '10'), ('ok', '50'), ('pruned', '10')]
  retry = [t for t in load_study(workdir, postgres.url).get_trials() if t.user_attrs.get('slot') == 1][-1]
  assert RetryHeartbeatStaleTrialCallback.retried_trial_number(retry) == 1
  assert retry.state == TrialState.COMPLETE


def test_a_trial_pruned_by_its_worker_stops_early_and_its_checkpoint_reloads(killed_and_rerun, postgres):
  from train.rundir import load_run
  workdir = killed_and_rerun[0]
  pruned = [t for t in load_study(workdir, postgres.url).get_trials() if t.user_attrs.get('slot') == 2][-1]
  assert pruned.state == optuna.trial.TrialState.PRUNED and pruned.user_attrs['pruned_at'] == 10
  assert pruned.intermediate_values.keys() == {10}  # reported by its worker, which stopped there
  run_dir = os.path.join(workdir, PRUNED)
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    logged = [m for m in map(json.loads, f)]
  # The number the trial logged, as its worker read it: exactly.
  assert pruned.intermediate_values[10] == next(m['eval/loss'] for m in logged if m['step'] == 10 and 'eval/loss' in m)
  # Its worker's SIGTERM made training save a checkpoint at a step boundary and stop, long before step 200.
  stopped = pruned.user_attrs['stopped_at']
  log = open(os.path.join(workdir, 'logs', f'{PRUNED}.log')).read()
  assert f'SIGTERM: saved step {stopped} ' in log and 10 <= stopped < 200
  assert max(m['step'] for m in logged) <= stopped
  # It reloads as the study scored it (its best evaluated checkpoint), and its SIGTERM save by step.
  best = min((m['eval/loss'], m['step']) for m in logged if 'eval/loss' in m)[1]
  assert load_run(run_dir).step == best
  assert load_run(run_dir, stopped).step == stopped
  assert '1 pruned' in open(os.path.join(workdir, 'sweep.md')).read()


def test_sigterm_stops_the_sweep_with_its_trial_saved_and_queued_again(corpus, cache, tmp_path):
  # The killed study's long trial (its programs in the cache already), stopped after its first checkpoint.
  (tmp_path / 'one.py').write_text(KILL_FILE.format(source=corpus, cache=cache, trials=[LONG]))
  workdir, name = str(tmp_path / 'sweep'), '00-lr=0.01-steps=50-eval_every=25'
  sweep = sweep_process(str(tmp_path / 'one.py'), workdir)
  checkpoints = os.path.join(workdir, name, 'checkpoints')
  while not (os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints))):
    assert sweep.poll() is None, sweep.communicate()
    time.sleep(0.05)
  sweep.send_signal(signal.SIGTERM)  # to the sweep alone: it passes the signal on to its trial
  stdout, stderr = sweep.communicate(timeout=120)
  assert sweep.returncode == 130 and stderr.strip().endswith('Interrupted.'), stderr[-2000:]
  assert 'interrupted' in stdout
  saved = int(re.search(r'SIGTERM: saved step (\d+)', open(os.path.join(workdir, 'logs', f'{name}.log')).read()).group(1))
  assert 10 <= saved < 50 and str(saved) in os.listdir(checkpoints)
  first, retry = load_study(workdir).get_trials()
  assert first.state == optuna.trial.TrialState.FAIL and first.user_attrs['interrupted']
  assert retry.state == optuna.trial.TrialState.WAITING
  assert RetryHeartbeatStaleTrialCallback.retried_trial_number(retry) == 0
  assert retry.params == first.params and '1 waiting' in open(os.path.join(workdir, 'sweep.md')).read()


def test_dry_run_prints_one_launch_command_per_trial(sweep_file, tmp_path):
  result = support.launch([f'--sweep={sweep_file}', '--sweep_dry_run', f'--workdir={tmp_path}/dry',
                           '--config.train.steps=3'], timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  commands = result.stdout.strip().splitlines()
  assert len(commands) == 3 and not os.path.exists(tmp_path / 'dry')
  assert all('launch.py --config=configs/gpt.py:tiny' in c for c in commands)
  # The command-line override comes after the sweep's own and before the trial's values.
  assert commands[0].index('--config.train.steps=4') < commands[0].index('--config.train.steps=3') < \
      commands[0].index('--config.train.lr=0.001')
  assert f'--workdir={tmp_path}/dry/02-width=16-num_heads=3' in commands[2]


SPACE = {'train.lr': {'low': 1e-4, 'high': 3e-2, 'log': True}, 'model.num_layers': {'low': 1, 'high': 3},
         'model.width': [32, 64]}


def proposals(sweep, study: optuna.Study, n: int) -> list[dict]:
  return [runner.propose(sweep, t, studies.take_slot(study, t, sweep.n_trials))
          for t in (study.ask() for _ in range(n))]


@pytest.mark.parametrize('sampler', ['random', 'qmc', 'tpe'])
def test_hosts_with_one_seed_propose_different_trials_each_slot_its_own(sampler, tmp_path):
  sweep = runner.parse({'space': SPACE, 'sampler': sampler, 'n_trials': 6}, 'configs/gpt.py:tiny')
  make = lambda storage: optuna.create_study(
      storage=storage, study_name='s', load_if_exists=True,
      sampler=studies.make_sampler(*sweep.sampler, sweep.seed, sweep.points, sweep.space))
  alone = proposals(sweep, make(None), 6)
  storage = studies.open_storage(str(tmp_path / 'study.journal'))
  host_a, host_b = make(storage), make(storage)
  shared = [p for _ in range(3) for p in proposals(sweep, host_a, 1) + proposals(sweep, host_b, 1)]
  assert shared == alone  # slot k's proposal, whichever host asks
  assert len({json.dumps(p, sort_keys=True) for p in alone}) == 6
  for p in alone:
    assert 1e-4 <= p['train.lr'] <= 3e-2 and p['model.num_layers'] in (1, 2, 3) and p['model.width'] in (32, 64)


@pytest.mark.parametrize('sampler', ['random', 'qmc', 'tpe'])
def test_a_samplers_seed_option_is_the_sweeps_seed(sampler):
  sweeps = [runner.parse({'space': SPACE, 'n_trials': 4, **spec}, 'configs/gpt.py:tiny') for spec in
            ({'sampler': {'name': sampler, 'seed': 7}}, {'sampler': sampler, 'seed': 7}, {'sampler': sampler})]
  runs = [proposals(sweep, runner.open_study(sweep, 'w', None), 4) for sweep in sweeps]
  assert sweeps[0].seed == 7 and runs[0] == runs[1] != runs[2]
  with pytest.raises(runner.SweepError, match="give the seed once"):
    runner.parse({'space': SPACE, 'n_trials': 4, 'seed': 1, 'sampler': {'name': sampler, 'seed': 2}}, 'c')


def test_a_grid_is_enqueued_in_the_files_order_and_its_budget_taken_once():
  sweep = runner.parse({'grid': {'train.lr': [0.1, 0.2], 'model.width': [16, 32]},
                           'trials': [{'model.num_heads': 1}]}, 'configs/gpt.py:tiny')
  study = runner.open_study(sweep, 'w', None)
  assert [t.state for t in study.get_trials()] == [optuna.trial.TrialState.WAITING] * 5
  assert proposals(sweep, study, 5) == [{'train.lr': 0.1, 'model.width': 16}, {'train.lr': 0.1, 'model.width': 32},
                                        {'train.lr': 0.2, 'model.width': 16}, {'train.lr': 0.2, 'model.width': 32},
                                        {'model.num_heads': 1}]
  late = study.ask()  # a worker asking after the last point was taken runs nothing
  assert studies.take_slot(study, late, sweep.n_trials) is None and studies.unclaimed(study, 5) == 0


def test_each_worker_gets_its_own_accelerators():
  pool = runner.DevicePool('0,1,2,3', workers=2)
  with pool.take() as first, pool.take() as second:
    assert {first['CUDA_VISIBLE_DEVICES'], second['CUDA_VISIBLE_DEVICES']} == {'0,1', '2,3'}
  with runner.DevicePool(None, workers=2).take() as env:
    assert env == {}
  with pytest.raises(runner.SweepError, match='multiple of the workers'):
    runner.DevicePool('0,1,2', workers=2)


@pytest.mark.parametrize('spec, message', [
    ({'space': {'train.lr': {'low': 0.0, 'high': 1.0, 'log': True}}, 'n_trials': 2}, "a log range needs 'low' > 0"),
    ({'space': {'train.lr': {'low': 0.1, 'high': 0.01}}, 'n_trials': 2}, "must be below 'high'"),
    ({'space': {'train.lr': {'lo': 0.1, 'high': 1.0}}, 'n_trials': 2}, "unknown keys"),
    ({'space': {'train.lr': 'big'}, 'n_trials': 2}, 'give a non-empty list of choices'),
    ({'space': {'model.width': []}, 'n_trials': 2}, 'give a non-empty list of choices'),
    ({'space': [('train.lr', [0.1])], 'n_trials': 2}, '`space` must be a non-empty dict'),
    ({'space': {3: [0.1]}, 'n_trials': 2}, 'is not a config key'),
    ({'space': {'train.lr': [0.1]}}, 'needs a budget'),
    ({'space': {'train.lr': [0.1]}, 'n_trials': 2, 'grid': {'train.lr': [1]}}, 'not both'),
    ({'space': {'train.lr': [0.1]}, 'n_trials': 2, 'sampler': 'cmaes'}, "Unknown sampler 'cmaes'"),
    ({'space': {'train.lr': [0.1]}, 'n_trials': 2, 'sampler': {'name': 'tpe', 'bogus': 1}}, 'does not take'),
    ({'space': {'train.lr': [0.1]}, 'n_trials': 2, 'sampler': {'name': 'qmc', 'scramble': False}}, 'takes no options'),
    ({'space': {'train.lr': {'low': 0.1, 'high': 1.0}}, 'n_trials': 2, 'sampler': 'grid'}, 'choices only'),
    ({'space': {'train.lr': [0.1]}, 'n_trials': 2, 'pruner': 'asha'}, "Unknown pruner 'asha'"),
    ({'space': {'train.lr': [0.1]}, 'n_trials': 2, 'metric': 'loss'}, 'is not a result of a trial'),
    ({'space': {'train.lr': [0.1]}, 'n_trials': 2, 'metric': 'test/bleu', 'pruner': 'median'}, 'scored only at'),
    ({'space': {'train.lr': [0.1]}, 'n_trials': 2, 'direction': 'down'}, "'minimize' or 'maximize'"),
    ({'space': {'train.lr': [0.1]}, 'n_trials': 2, 'seed': '3'}, 'must be an integer'),
    ({'grid': {'train.lr': 0.1}}, 'non-empty list'),
    ({'grid': [('train.lr', [0.1, 0.2])]}, '`grid` must be a dict'),
    ({'grid': {'train.lr': [[0.1], 0.2]}}, 'swept values must be numbers'),
    ({'trials': {'train.lr': 0.1}}, '`trials` must be a list of dicts'),
    ({'trials': 3}, '`trials` must be a list of dicts'),
    ({'trials': [{'train.lr': {'low': 1}}]}, 'swept values must be numbers'),
    ({'grid': {'train.lr': [0.1]}, 'overrides': {'train.steps': [4]}}, 'swept values must be numbers'),
    ({'grid': {'train.lr': [0.1]}, 'overrides': ['train.steps', 4]}, '`overrides` must be a dict'),
    ({'grids': {}}, 'Unknown sweep keys'),
])
def test_bad_sweep_files_stop_with_one_line(spec, message):
  with pytest.raises(runner.SweepError, match=re.escape(message)) as error:
    runner.parse(spec, 'configs/gpt.py:tiny')
  assert '\n' not in str(error.value)


@pytest.mark.parametrize('text, message', [
    ('def get_sweep(:\n  return {}\n', 'line 1: '),
    ('import no_such_module_here\n', "fails when it is read (ModuleNotFoundError: No module named"),
    ('def get_sweep():\n  raise ValueError("no\\nsweep")\n', 'get_sweep() raised ValueError: no sweep;'),
    ('SWEEP = {"config": "configs/gpt.py:tiny"}\n', 'must define get_sweep()'),
    ('get_sweep = 3\n', 'must define get_sweep()'),
    ('def get_sweep():\n  return [{"train.lr": 0.1}]\n', 'get_sweep() returned a list, not a dict'),
    ('def get_sweep():\n  return {"config": 3, "grid": {"train.lr": [0.1]}}\n', "no 'config' string"),
])
def test_a_sweep_file_that_does_not_load_is_one_line(text, message, tmp_path):
  path = tmp_path / 'bad.py'
  path.write_text(text)
  with pytest.raises(runner.SweepError, match=re.escape(message)) as error:
    runner.load_sweep(str(path))
  assert '\n' not in str(error.value)


@pytest.mark.parametrize('spec, message', [
    ({'overrides': {'train.steps': 'abc'}, 'grid': {'train.lr': [0.1]}}, '--config.train.steps=abc'),
    ({'grid': {'train.steps': [4, 2.5]}}, '--config.train.steps=2.5'),
    ({'trials': [{'train.lr': 0.1}, {'model.width': 'wide'}]}, '--config.model.width=wide'),
    ({'space': {'train.steps': {'low': 2.0, 'high': 8.0}}, 'n_trials': 2}, '--config.train.steps=2.0'),
    ({'space': {'model.dropout': [0.1, True]}, 'n_trials': 2}, '--config.model.dropout=True'),
])
def test_a_value_the_trials_config_cannot_take_is_one_line_before_any_trial(spec, message):
  import launch
  sweep = runner.parse(spec, 'configs/gpt.py:tiny')
  with pytest.raises(launch.UserError, match=re.escape(f'The sweep gives its trials {message}, which')) as error:
    launch.check_sweep_overrides(sweep.config, runner.every_override(sweep))
  assert '\n' not in str(error.value) and 'give ' in str(error.value)
  launch.check_sweep_overrides(sweep.config, ['--config.train.steps=4', '--config.train.lr=1', '--config.seed=2'])


def test_bad_input_stops_the_sweep_command_with_one_line_before_trials(tmp_path):
  path = tmp_path / 'bad.py'
  good = "def get_sweep():\n  return {'config': 'configs/gpt.py:tiny', 'space': {'train.lr': [0.1]}, 'n_trials': 2}\n"
  cases = [  # (the sweep file, arguments, what stderr says)
      (good.replace('train.lr', 'train.lrr'), [], "Unknown config key 'train.lrr'. Did you mean 'train.lr'?"),
      (good, ['--sweep_storage=sqlite:////nonexistent/x.db'], 'cannot be opened'),
      (good.replace("'n_trials': 2", "'n_trials': 2, 'overrides': {'train.steps': 'abc'}"), [],
       "The sweep gives its trials --config.train.steps=abc, which configs/gpt.py:tiny cannot take"),
  ]
  # Each is refused by what launch.py --sweep calls before any trial: in-process, the first through the command.
  import launch
  for text, args, message in cases:
    path.write_text(text)
    flags = types.SimpleNamespace(sweep=str(path), workdir=str(tmp_path / 'run'), sweep_dry_run=False, sweep_workers=1,
                                  sweep_devices=None, sweep_heartbeat=30,
                                  sweep_storage=args[0].split('=', 1)[1] if args else None)
    with pytest.raises(launch.UserError, match=re.escape(message)) as error:
      runner.run_sweep_from_flags(flags, [], check_overrides=launch.check_sweep_overrides)
    assert '\n' not in str(error.value) and not os.path.exists(tmp_path / 'run')
  path.write_text(cases[0][0])
  result = sweep_process(str(path), str(tmp_path / 'run'))
  stdout, stderr = result.communicate(timeout=120)
  assert result.returncode == 1 and stderr.count('\n') == 1 and cases[0][2] in stderr, stderr
  assert not os.path.exists(tmp_path / 'run') and not started(stdout)
  with pytest.raises(studies.SweepError, match='--sweep_storage=postgresql://u:\\*\\*\\*@'):
    studies.open_storage('postgresql://u:secret@127.0.0.1:1/db')
  # A metric the trials do not log stops the sweep at the first trial that finishes, naming theirs.
  sweep = runner.parse({'space': {'train.lr': [0.1]}, 'n_trials': 2, 'metric': 'eval/bleu'}, 'configs/gpt.py:tiny')
  study = optuna.create_study()
  sweep_runner = runner.Runner(sweep, study, str(tmp_path))
  with pytest.raises(runner.SweepError, match='eval/bleu.* not among the results of trial t: eval/loss, step'):
    sweep_runner._finished(study.ask(), 't', {'mode': 'train', 'eval/loss': 1.0, 'step': 4}, 1.0)


def test_a_sweep_with_no_trial_ok_exits_1_after_its_table(corpus, cache, tmp_path):
  (tmp_path / 'failing.py').write_text(
      "def get_sweep():\n  return {'config': 'configs/gpt.py:tiny', 'trials': [{'model.num_heads': 3}],\n"
      "          'overrides': {'data.source': %r, 'compile_cache': %r}}\n" % (corpus, cache))
  workdir = str(tmp_path / 'sweep')
  stdout, stderr = (process := sweep_process(str(tmp_path / 'failing.py'), workdir)).communicate(timeout=300)
  assert process.returncode == 1 and started(stdout) == ['00-num_heads=3'], stderr[-2000:]
  assert stderr.count('\n') == 1 and stderr.startswith('error: No trial of the sweep finished ok (1 of 1 failed; the '
                                                       'first error: 00-num_heads=3: config.model.num_heads=3')
  assert [r['status'] for r in read_rows(workdir)] == ['failed']  # the table is written all the same
