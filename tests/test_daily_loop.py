"""The daily loop: early stopping and the best checkpoint, the wall-clock budget, one training per
workdir, Ctrl-C and interrupted setups, broken checkpoints, a full disk, metrics after a resume,
Weights & Biases (offline), long predict inputs."""
import errno
import glob
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time

import pytest

import support
from numerics import assert_close, transformer_terms
from train import checkpoint as ckpt
from train.rundir import load_run
from train import workdir_lock
from train.trainer import evaluate_run, train_and_evaluate


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return support.write_corpus(str(tmp_path_factory.mktemp('corpus')))


def tiny(corpus, **overrides):
  # One block: what these tests check (stops, checkpoints, locks, metrics) does not depend on the depth, and each
  # training traces and compiles its model again. A constant learning rate after the warmup: the train step
  # does not depend on train.steps (a cosine decays to its end there), so every training here runs one program
  # (the persistent compilation cache's), whatever its length.
  return support.tiny_gpt_config(corpus, **{'train.log_every': 1, 'train.async_checkpoints': False,
                                            'model.num_layers': 1, 'train.schedule': 'constant', **overrides})


def metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def logged(workdir, key, step):
  return next(m[key] for m in metrics(workdir) if m['step'] == step and key in m)


@pytest.fixture(scope='module')
def early_stopped_run(corpus, tmp_path_factory):
  """(workdir, results) of a run stopped early at step 15, its best checkpoint step 5's: the early stopping test's,
  and the run the predict test decodes from (what it checks holds for any trained run)."""
  workdir = str(tmp_path_factory.mktemp('early_stopped') / 'run')
  # best_mode=max on a falling eval loss: the first evaluation (step 5) stays the best. eval_steps=0:
  # every evaluation scores the whole split (56 windows: 7 batches of 8).
  config = tiny(corpus, **{'train.steps': 40, 'train.eval_every': 5, 'train.checkpoint_every': 100,
                           'train.best_mode': 'max', 'train.early_stopping_patience': 2, 'train.eval_steps': 0})
  return workdir, train_and_evaluate(config, workdir)


def test_early_stopping_ends_the_run_and_the_final_evaluation_scores_the_best_checkpoint(early_stopped_run):
  workdir, results = early_stopped_run
  assert results['step'] == 15 and 'early stopping' in results['stopped'], results
  assert results['final_eval_step'] == 5
  assert sorted(ckpt.Checkpointer(workdir, read_only=True).manager.all_steps()) == [5, 10, 15]
  # The final line holds the scored checkpoint's metrics (step 5), not the last step's, and
  # --mode=eval gives the same numbers: both are the eval loss logged at step 5.
  best = evaluate_run(workdir)
  assert best['step'] == 5
  # The same evaluation program on the same parameters and batches: equal to the bit.
  assert results['eval/loss'] == best['eval/loss'] == logged(workdir, 'eval/loss', 5)
  assert abs(results['eval/loss'] - logged(workdir, 'eval/loss', 15)) > 1e-3
  last = evaluate_run(workdir, {'train.final_eval_from': 'last'})
  assert last['step'] == 15
  # Reloading (and so predict and export) gives the model those numbers describe.
  assert load_run(workdir).step == 5
  assert load_run(workdir, config_overrides={'train.final_eval_from': 'last'}).step == 15
  assert last['eval/loss'] == logged(workdir, 'eval/loss', 15)
  # One value per name and step: --mode=eval wrote nothing into the run's metrics.
  keyed = [(m['step'], key) for m in metrics(workdir) for key in m if key != 'step']
  assert len(keyed) == len(set(keyed))


def test_max_minutes_saves_and_evaluates_and_the_budget_spans_resumes(corpus, tmp_path):
  workdir = str(tmp_path / 'run')
  config = tiny(corpus, **{'train.steps': 1000, 'train.max_minutes': 1e-4})  # spent during setup
  results = train_and_evaluate(config, workdir)
  assert results['step'] == 1 and 'max_minutes' in results['stopped'], results
  assert results['final_eval_step'] == 1 and 'eval/loss' in results
  assert ckpt.Checkpointer(workdir, read_only=True).latest_step() == 1
  again = train_and_evaluate(config, workdir)  # no budget left: one step, then stop again
  assert again['step'] == 2 and 'max_minutes' in again['stopped']


def test_a_second_training_is_refused_and_a_stale_lock_is_taken_over(corpus, tmp_path, capsys):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  lock = workdir / workdir_lock.LOCK_FILE
  holder = subprocess.Popen(['sleep', '120'])  # a live process on this host holds the workdir
  try:
    lock.write_text(json.dumps({'host': socket.gethostname(), 'pid': holder.pid, 'started': time.time(),
                                'heartbeat': time.time()}))
    result = support.launch(['--config=configs/gpt.py:tiny', f'--workdir={workdir}',
                             f'--config.data.source={corpus}', '--config.train.steps=2'])
    assert result.returncode == 1 and f'is being trained by pid {holder.pid}' in result.stderr, result.stderr[-2000:]
    assert 'Traceback' not in result.stderr
    assert os.listdir(workdir) == [workdir_lock.LOCK_FILE]  # nothing written beside the lock
  finally:
    holder.kill()
    holder.wait()
  results = train_and_evaluate(tiny(corpus, **{'train.steps': 2}), str(workdir))  # the holder is gone
  assert results['step'] == 2
  assert f'pid {holder.pid} is not running' in capsys.readouterr().out
  assert not lock.exists()  # released at the end

  # From another host, only the heartbeat's age tells a live holder from a dead one.
  other = {'host': 'another-host', 'pid': 1, 'started': time.time()}
  lock.write_text(json.dumps({**other, 'heartbeat': time.time()}))
  with pytest.raises(workdir_lock.WorkdirBusy, match='another-host'):
    workdir_lock.WorkdirLock(str(workdir)).acquire()
  lock.write_text(json.dumps({**other, 'heartbeat': time.time() - workdir_lock.STALE_AFTER_S - 60}))
  taken = workdir_lock.WorkdirLock(str(workdir), log=lambda message: None)
  taken.acquire()
  assert json.loads(lock.read_text())['pid'] == os.getpid()
  taken.release()
  assert not lock.exists()


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(corpus, tmp_path):
  workdir = str(tmp_path / 'run')
  # On 8 devices with tiny()'s model and schedule: the programs this file's trainings compiled (the cache's).
  args = ['--config=configs/gpt.py:tiny', f'--workdir={workdir}', f'--config.data.source={corpus}',
          '--config.train.steps=2000', '--config.train.log_every=1', '--config.model.num_layers=1',
          '--config.train.schedule=constant']
  process = support.launch(args, devices=8, background=True, start_new_session=True)
  deadline = time.time() + 120
  while time.time() < deadline and not (os.path.exists(f'{workdir}/metrics.jsonl') and len(metrics(workdir)) >= 5):
    time.sleep(0.05)
  process.send_signal(signal.SIGINT)
  stdout, stderr = process.communicate(timeout=120)
  assert process.returncode == 0, stderr[-3000:]
  step = ckpt.Checkpointer(workdir, read_only=True).latest_step()
  assert 5 <= step < 2000 and f'SIGINT: saved step {step}' in stdout + stderr
  assert not os.path.exists(os.path.join(workdir, workdir_lock.LOCK_FILE))


def test_sigterm_during_setup_leaves_no_workdir(corpus, tmp_path, monkeypatch):
  from train import trainer
  real_setup = trainer.setup_run

  def setup_then_terminated(*args, **kwargs):
    real_setup(*args, **kwargs)  # the tokenizer is saved by now
    os.kill(os.getpid(), signal.SIGTERM)

  monkeypatch.setattr(trainer, 'setup_run', setup_then_terminated)
  with pytest.raises(KeyboardInterrupt):
    train_and_evaluate(tiny(corpus), str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run')


def test_orphan_tokenizer_is_rebuilt_and_a_resume_must_keep_its_tokenizer(corpus, tmp_path, capsys):
  from data.tokenizers import train_tokenizer
  workdir = str(tmp_path / 'run')
  train_tokenizer('bpe', ['alpha beta gamma delta'] * 20, 300, True).save(workdir)  # a killed setup's leftover
  train_and_evaluate(tiny(corpus, **{'train.steps': 2}), workdir)  # the tiny preset asks for 'char'
  assert 'left by an interrupted setup' in capsys.readouterr().out
  assert load_run(workdir).tokenizer.kind == 'char'
  with pytest.raises(ckpt.CheckpointError, match="built with data.tokenizer='char'.*asks for data.tokenizer='bpe'"):
    train_and_evaluate(tiny(corpus, **{'train.steps': 4, 'data.tokenizer': 'bpe'}), workdir)


def test_a_broken_latest_checkpoint_is_skipped_and_metrics_are_not_repeated(corpus, tmp_path, capsys):
  workdir = str(tmp_path / 'run')
  config = tiny(corpus, **{'train.steps': 4, 'train.eval_every': 2, 'train.checkpoint_every': 2})
  train_and_evaluate(config, workdir)
  for path in glob.glob(f'{workdir}/checkpoints/4/model/**/*', recursive=True):
    if os.path.isfile(path):
      with open(path, 'r+b') as f:  # an upload cut short
        f.truncate(os.path.getsize(path) // 2)
  config.train.steps = 6
  results = train_and_evaluate(config, workdir)
  out = capsys.readouterr().out
  assert 'Skipped the checkpoint at step 4' in out and 'Resumed from the checkpoint at step 2' in out
  assert os.path.isdir(f'{workdir}/{ckpt.BROKEN_DIR}/4') and results['step'] == 6
  train_steps = [m['step'] for m in metrics(workdir) if 'train/loss' in m]
  assert train_steps == list(range(1, 7))  # steps 3-4 of the first run were dropped, not repeated
  # TensorBoard: the resumed writer starts with a START session log at step 3, which tells
  # TensorBoard to drop every earlier event from step 3 on (its purge rule).
  starts = [e.step for e in tensorboard_events(f'{workdir}/tensorboard')
            if e.HasField('session_log') and e.session_log.status == e.session_log.START]
  assert starts == [3], starts


def test_a_full_disk_during_a_checkpoint_is_one_error_and_the_rerun_resumes_from_the_last_intact_step(
    corpus, tmp_path, monkeypatch, capfd, caplog):
  from errors import UserError
  from orbax.checkpoint._src.path import async_path  # writes the commit marker; no public alias in Orbax 0.12.8
  workdir = str(tmp_path / 'run')
  real_write_text = async_path.write_text

  async def disk_full_in_step_4(path, text):
    if path.parent.name == '4.orbax-checkpoint-tmp' and path.name == 'commit_success.txt':
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return await real_write_text(path, text)

  monkeypatch.setattr(async_path, 'write_text', disk_full_in_step_4)
  config = tiny(corpus, **{'train.steps': 4, 'train.checkpoint_every': 2, 'train.async_checkpoints': True})
  with pytest.raises(UserError) as error:  # raised in a background thread of Orbax, as on a real disk
    train_and_evaluate(config, workdir)
  message = str(error.value)
  assert '\n' not in message, message
  assert message.startswith(f'No space left on device: the checkpoint of step 4 could not be written to '
                            f'{workdir}/checkpoints ('), message
  assert re.search(r'The run needs about [0-9.]+ MB there \(5 checkpoints of [0-9.]+ MB: train.keep_checkpoints=3, '
                   r'the best one, the one being written\)', message), message
  assert message.endswith('the last intact checkpoint is step 2, where rerunning the same command resumes.'), message
  assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]  # Orbax's threads log theirs
  assert os.listdir(f'{workdir}/checkpoints') == ['2']  # the half-written step 4 is gone
  # TensorStore's form of the same error (the arrays' writes) has no errno, only the text.
  assert ckpt.disk_full_reason(ValueError("RESOURCE_EXHAUSTED: Failed to write 12461 bytes to file 8: No space left on "
                                          "device [os_error_code='28']")) == 'No space left on device'
  monkeypatch.undo()
  assert train_and_evaluate(config, workdir)['step'] == 4
  assert 'Resumed from the checkpoint at step 2' in capfd.readouterr().out


def tensorboard_events(directory: str) -> list:
  """Every event of the event files in `directory` (TFRecord framing: length, its CRC, the record, its CRC)."""
  import struct
  from tensorboardX.proto import event_pb2
  events = []
  for path in sorted(glob.glob(f'{directory}/events.out.tfevents.*')):
    data = open(path, 'rb').read()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack('<Q', data[offset:offset + 8])
      events.append(event_pb2.Event.FromString(data[offset + 12:offset + 12 + length]))
      offset += 12 + length + 4
  return events


def wandb_history(path: str) -> dict[int, dict]:
  """{step: logged values} from a W&B transaction log (LevelDB-style records of protobufs)."""
  from wandb.proto import wandb_internal_pb2
  data = open(path, 'rb').read()
  offset, block, records, pending = 7, 32768, [], b''  # 7: the ':W&B' header
  while offset + 7 <= len(data):
    if block - offset % block < 7:  # a record header never straddles blocks
      offset += block - offset % block
      continue
    length, kind = int.from_bytes(data[offset + 4:offset + 6], 'little'), data[offset + 6]
    if kind == 0:
      break
    pending += data[offset + 7:offset + 7 + length]
    offset += 7 + length
    if kind in (1, 4):  # a whole record, or its last piece
      records.append(pending)
      pending = b''
  history = {}
  for raw in records:
    record = wandb_internal_pb2.Record()
    record.ParseFromString(raw)
    if record.WhichOneof('record_type') == 'history':
      items = {item.key or '/'.join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
      history[items['_step']] = items
  return history


def test_wandb_offline_run_holds_the_logged_metrics(corpus, tmp_path, monkeypatch):
  pytest.importorskip('wandb', reason='wandb is in requirements-dev.txt; the feature is optional')
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  workdir = str(tmp_path / 'run')
  config = tiny(corpus, **{'train.steps': 4, 'train.log_every': 2, 'train.eval_every': 4,
                           'logging.wandb_project': 'lineage-test'})
  train_and_evaluate(config, workdir)
  [log] = glob.glob(f'{workdir}/wandb/offline-run-*/run-*.wandb')
  history = wandb_history(log)
  for step, key in ((2, 'train/loss'), (4, 'train/loss'), (4, 'eval/loss')):
    assert step in history, f'step {step} is not in the W&B log {log}: its history holds steps {sorted(history)}'
    assert_close(history[step][key], logged(workdir, key, step), terms=1)  # the same number, as W&B stores it


def test_predict_says_when_an_input_is_cut_to_the_window(early_stopped_run, tmp_path):
  workdir, _ = early_stopped_run  # predicting writes nothing into the run
  lines = tmp_path / 'lines.txt'
  lines.write_text('alpha beta\n' + 'gamma ' * 2000 + '\n')
  output = tmp_path / 'new' / 'folder' / 'outputs.jsonl'  # its directory is made before the decoding
  result = support.launch(['--mode=predict', f'--workdir={workdir}', f'--input={lines}', f'--output={output}'])
  assert result.returncode == 0, result.stderr[-2000:]
  notes = [line for line in result.stderr.splitlines() if line.startswith('note:')]
  assert len(notes) == 1 and 'input 2 has 12000 tokens; the model read only its last 48' in notes[0], notes
  assert [json.loads(line) for line in output.read_text().splitlines()] == support.last_json(result.stdout)['outputs']
  refused = support.launch(['--mode=predict', f'--workdir={workdir}', f'--input={lines}', f'--output={tmp_path}'])
  assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
      f'error: --output={tmp_path} is a directory; name a file in it, e.g. --output={tmp_path}/predictions.jsonl.']
  assert '>>>' not in refused.stdout  # refused before decoding

  # Predict inputs follow the data files' rule, from a file and from stdin alike: UTF-8, or one line
  # naming the input, line and byte.
  cp1252 = tmp_path / 'cp1252.txt'
  cp1252.write_bytes(b'alpha\ncaf\xe9 beta\n')
  from_file = support.launch(['--mode=predict', f'--workdir={workdir}', f'--input={cp1252}'])
  with open(cp1252, 'rb') as stdin:
    process = support.launch(['--mode=predict', f'--workdir={workdir}', '--input=-'], background=True, stdin=stdin)
    _, stdin_errors = process.communicate(timeout=300)
  for name, returncode, stderr in ((str(cp1252), from_file.returncode, from_file.stderr),
                                   ('<stdin>', process.returncode, stdin_errors)):
    assert returncode == 1 and stderr.strip().splitlines() == [
        f'error: {name}:2: byte 4 of the line (0xe9) is not UTF-8; data files must be UTF-8: convert it '
        '(e.g. iconv -f cp1252 -t utf-8) or fix that line.'], stderr[-2000:]


def test_evaluation_scores_every_example_of_a_split_that_does_not_fill_its_batches(corpus, tmp_path):
  """56 validation windows in one eval batch of 64: the 8 fillers count for nothing, so the
  metrics equal the loss of the 56 windows computed in one unpadded batch."""
  import numpy as np
  from flax import nnx
  workdir = str(tmp_path / 'run')
  results = train_and_evaluate(tiny(corpus, **{'train.steps': 1, 'train.eval_batch_size': 64}), workdir)
  run = load_run(workdir)
  windows = type(run.task).prepare(run.config, workdir).datasets.eval
  assert len(windows) == 56
  batch = {'tokens': np.stack([windows[i]['tokens'] for i in range(len(windows))])}
  # Jitted: one program instead of each of the model's operations compiled for this batch's shapes.
  _, expected = nnx.jit(lambda model, batch: run.task.loss(model, batch, deterministic=True))(run.model, batch)
  for name in ('loss', 'accuracy'):
    total, count = (float(x) for x in expected[name])
    assert count == 56 * 32
    # One batch of 56 windows against one of 64 with 8 weight-0 fillers: the same tokens summed in
    # another order (the one-block tiny GPT's reductions, then the 56 x 32 tokens).
    terms = transformer_terms(1, 32, 4 * 32, 32, vocab=32, positions=56 * 32)
    assert_close(results[f'eval/{name}'], total / count, terms=terms)
    assert_close(logged(workdir, f'eval/{name}', 1), total / count, terms=terms)


def test_resuming_on_other_data_is_refused_unless_allowed_and_then_recorded(corpus, tmp_path):
  workdir = str(tmp_path / 'run')
  # best_mode=max on a falling loss: the first evaluation of each dataset is its best.
  settings = {'train.eval_every': 2, 'train.checkpoint_every': 2, 'train.best_mode': 'max', 'train.eval_steps': 0}
  train_and_evaluate(tiny(corpus, **settings, **{'train.steps': 4}), workdir)
  saved = open(os.path.join(workdir, 'config.json')).read()
  other = support.write_corpus(str(tmp_path / 'other'), seed=1)
  with pytest.raises(ckpt.CheckpointError, match=r"data.source=.*allow_data_change=True"):
    train_and_evaluate(tiny(other, **settings, **{'train.steps': 8}), workdir)
  assert open(os.path.join(workdir, 'config.json')).read() == saved  # the record is untouched
  results = train_and_evaluate(tiny(other, **settings, **{'train.steps': 8, 'train.allow_data_change': True}), workdir)
  history = json.load(open(os.path.join(workdir, 'config.json')))['data_history']
  assert [(h['step'], h['source']) for h in history] == [(0, corpus), (4, other)]
  # The best checkpoint is picked among the evaluations on the new validation data (steps 6, 8):
  # the old data's step 2 scored a higher loss, on other examples, and does not compete.
  assert results['final_eval_step'] == 6
  assert evaluate_run(workdir)['step'] == 6


def test_max_new_tokens_beyond_the_window_is_announced_not_cut_silently(capsys):
  import ml_collections
  from train import sampling

  class Characters:
    def encode(self, text):
      return list(text.encode())

  decode = ml_collections.ConfigDict({'max_new_tokens': 1000})
  notes = sampling.prompt_truncation_notes(Characters(), ['ab'], decode, max_len=64)
  assert len(notes) == 2 and 'decode.max_new_tokens=1000' in notes[0] and 'at most 63 new tokens' in notes[0]
  assert 'input 1 has 2 tokens; the model read only its last 1' in notes[1]
  decode.max_new_tokens = 63  # fits: prompt and new tokens share the 64 positions
  assert sampling.prompt_truncation_notes(Characters(), ['a'], decode, max_len=64) == []
