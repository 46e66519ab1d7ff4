"""Two processes on localhost (jax.distributed, CPU collectives over gloo), 4 fake devices each,
train the same losses as one process with 8 devices (this one: tests/conftest.py's 8 devices); their
checkpoint restores in one process; both built shards of the token cache they read."""
import glob
import json
import os

import numpy as np
import pytest

import support
from numerics import assert_close, transformer_terms

STEPS = 4
# The tiny GPT with one block: the processes' collectives are the same for every block, and each of the
# three processes compiles a smaller program. STEP_TERMS: the reductions behind one of its steps
# (support.TINY_GPT_STEP_TERMS with one block; tests/numerics.py).
STEP_TERMS = transformer_terms(1, 32, 4 * 32, 32, vocab=32, positions=8 * 32)

OVERRIDES = {'model.num_layers': 1, 'train.steps': STEPS, 'train.eval_every': STEPS,
             'train.checkpoint_every': STEPS, 'train.log_every': 1, 'train.eval_steps': 1, 'mesh.data': 4,
             'mesh.fsdp': 2, 'train.async_checkpoints': False,
             'data.cache_shard_mb': 0.001}  # ~1 KB token-cache shards: each process builds several


def train_losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return {m['step']: m['train/loss'] for m in map(json.loads, f) if 'train/loss' in m}


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp('multiprocess')
  corpus = support.write_corpus(str(root / 'corpus'), files=4, lines=40)
  args = ['--config=configs/gpt.py:tiny', *support.override_args({'data.source': corpus, **OVERRIDES})]
  # Each run its own token cache (a shared one would be built by the single process alone). The single
  # process is this one: the command line is not what is compared.
  from train.trainer import train_and_evaluate
  config = support.tiny_gpt_config(corpus, **OVERRIDES, **{'data.cache_dir': f'{root}/single-cache'})
  single = train_and_evaluate(config, str(root / 'single'))
  address = f'localhost:{support.free_port()}'
  processes = [support.launch(args + [f'--workdir={root}/multi', f'--config.data.cache_dir={root}/multi-cache',
                                      f'--coordinator_address={address}', '--num_processes=2', f'--process_id={i}'],
                              devices=4, background=True, start_new_session=True)
               for i in range(2)]
  outputs = [p.communicate(timeout=240) for p in processes]
  for p, (_, stderr) in zip(processes, outputs):
    assert p.returncode == 0, stderr[-3000:]
  return str(root / 'single'), single, str(root / 'multi'), support.last_json(outputs[0][0])


def test_two_processes_train_the_same_losses_as_one(runs):
  single_dir, single, multi_dir, multi = runs
  single_losses, multi_losses = train_losses(single_dir), train_losses(multi_dir)
  assert sorted(multi_losses) == list(range(1, STEPS + 1))
  for step in range(1, STEPS + 1):
    assert_close(multi_losses[step], single_losses[step], terms=step * STEP_TERMS)
  assert_close(multi['eval/loss'], single['eval/loss'], terms=(STEPS + 1) * STEP_TERMS)


def test_two_process_checkpoint_restores_in_one_process(runs):
  _, _, multi_dir, multi = runs
  evaluation = support.launch(['--mode=eval', f'--workdir={multi_dir}'], devices=1)
  assert evaluation.returncode == 0, evaluation.stderr[-3000:]
  result = support.last_json(evaluation.stdout)
  assert result['step'] == STEPS
  assert_close(result['eval/loss'], multi['eval/loss'], terms=STEP_TERMS)


def test_both_processes_built_shards_of_the_token_cache(runs):
  _, _, multi_dir, _ = runs
  [cache] = glob.glob(os.path.join(os.path.dirname(multi_dir), 'multi-cache', 'lm-*'))
  shards = sorted(glob.glob(os.path.join(cache, '[0-9]*[0-9].json')))
  built_by = [json.load(open(path))['built_by_process'] for path in shards]
  assert len(built_by) >= 4 and built_by == [i % 2 for i in range(len(built_by))]
