"""The lm-eval harness's model of a run (evals/): parity with the harness's own Hugging Face backend
(`lm_eval --model hf`) on the repository's tasks (evals/tasks/), the compiled shapes it uses, and
`--mode=lm_eval` with its one-line errors.

The tests comparing numbers are marked `numerics` (.ci/run reruns them with AVX2 only and with XLA's
default compiler); the one-line errors are not.

The parity: a random GPT-2 and a random Llama-style decoder (grouped-query attention, a tokenizer
whose post-processor adds BOS) are imported as runs and exported again with `export_hf`; the
harness scores the run through evals.harness.RunLM (batched: padded rows and lengths) and the
exported directory through its `hf` backend (one request at a time, float32 on the CPU). Every
request agrees: log-likelihoods within 1e-4 with the same is_greedy, rolling log-likelihoods within
1e-4, generations equal. The models read 32 positions, so requests longer than that are cut on the
left (multiple choice), scored in several windows (perplexity) and generated from their last tokens.
"""
import json
import math
import os

import numpy as np
import pytest

import support

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
pytest.importorskip('accelerate')  # the harness's hf backend imports it
lm_eval = pytest.importorskip('lm_eval')

TASKS = ['python_choice', 'python_perplexity', 'python_line_completion']
MAX_LEN = 32
TOLERANCE = 1e-4  # the bound on each request's log-likelihood


@pytest.fixture(autouse=True)
def offline(monkeypatch):
  """The local tasks need no network: the Hub is off for the harness and `datasets`."""
  monkeypatch.setenv('HF_DATASETS_OFFLINE', '1')
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')


@pytest.fixture(autouse=True)
def without_environment_report(monkeypatch):
  """lm_eval.simple_evaluate adds a report of the environment to its results (torch's collect_env: a
  `python -m pip list` and a dozen more subprocesses, ~0.6 s of CPU per call), which no test here reads:
  in this process it is left out (a launch.py process still writes it)."""
  from lm_eval import evaluator
  monkeypatch.setattr(evaluator, 'add_env_info', lambda results: None)


def task_texts() -> list[str]:
  from evals import harness
  return [open(os.path.join(harness.TASKS_DIR, f'{name}.jsonl')).read() for name in TASKS]


def random_decoder(kind: str, directory: str) -> None:
  """A random transformers model of `kind` ('gpt2' or 'llama') over MAX_LEN positions, with a small
  BPE tokenizer of the tasks' text, saved in `directory`; the Llama tokenizer adds BOS to each text."""
  from tokenizers import processors

  from data.tokenizers import train_bpe
  bpe = train_bpe(task_texts() * 5, vocab_size=300)
  if kind == 'llama':
    bpe.tokenizer.post_processor = processors.TemplateProcessing(single='<bos> $A',
                                                                 special_tokens=[('<bos>', bpe.bos_id)])
    config = transformers.LlamaConfig(
        vocab_size=bpe.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_LEN, tie_word_embeddings=False, bos_token_id=bpe.bos_id,
        eos_token_id=bpe.eos_id, pad_token_id=bpe.pad_id)
    model_class = transformers.LlamaForCausalLM
  else:
    config = transformers.GPT2Config(vocab_size=bpe.vocab_size, n_positions=MAX_LEN, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=bpe.bos_id, eos_token_id=bpe.eos_id)
    model_class = transformers.GPT2LMHeadModel
  os.makedirs(directory)
  bpe.tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  torch.manual_seed(0)
  model = model_class(config)
  with torch.no_grad():
    # Far from the init, so that every tensor counts; the norms keep theirs (1, 0): random GPT-2
    # LayerNorm biases push every prompt to the same next token.
    for name, parameter in model.named_parameters():
      if 'ln' not in name and 'norm' not in name:
        parameter.normal_(0.0, 0.2)
  model.eval().save_pretrained(directory)


def samples_by_request(results: dict, task: str) -> list:
  """The harness's response to each request of `task`, in request order: (log-likelihood, is_greedy),
  a rolling log-likelihood, or a generation."""
  return [response[0] for sample in results['samples'][task] for response in sample['resps']]


@pytest.fixture(scope='module')
def scoring(tmp_path_factory):
  """kind ('gpt2' or 'llama') -> (its run, the exported HF directory, the harness's results for our
  model, for its hf backend), each built once."""
  from configs import gpt
  from evals import harness
  from train.rundir import load_run
  from train.trainer import import_hf_run
  built = {}

  def score(kind):
    if kind not in built:
      directory = tmp_path_factory.mktemp(kind)
      random_decoder(kind, str(directory / 'source'))
      workdir, exported = str(directory / 'run'), str(directory / 'hf')
      import_hf_run(gpt.get_config(gpt.HF_MODEL_TYPES[kind]), str(directory / 'source'), workdir)
      run = load_run(workdir)
      run.export_hf(exported)
      ours = lm_eval.simple_evaluate(model=harness.RunLM(run=run, batch_size=4), tasks=TASKS,
                                     task_manager=harness.task_manager(), log_samples=True)
      theirs = lm_eval.simple_evaluate(model='hf', model_args=hf_arguments(exported), tasks=TASKS,
                                       task_manager=harness.task_manager(), batch_size=1, log_samples=True)
      built[kind] = run, exported, ours, theirs
    return built[kind]
  return score


def hf_arguments(exported: str) -> dict:
  """`lm_eval --model hf --model_args pretrained=...,device=cpu,dtype=float32`."""
  return {'pretrained': exported, 'device': 'cpu', 'dtype': 'float32'}


@pytest.fixture(params=['gpt2', 'llama'])
def scored(request, scoring):
  return scoring(request.param)


@pytest.fixture(scope='module')
def hf_backend():
  """exported HF directory -> the harness's hf backend on it (`lm_eval --model hf`, one request at a time,
  float32 on the CPU), loaded once."""
  from lm_eval.models.huggingface import HFLM
  loaded = {}

  def backend(exported):
    if exported not in loaded:
      loaded[exported] = HFLM(pretrained=exported, device='cpu', dtype='float32', batch_size=1)
    return loaded[exported]
  return backend


@pytest.mark.numerics
def test_loglikelihoods_match_the_hf_backend_request_by_request(scored):
  run, _, ours, theirs = scored
  mine, reference = samples_by_request(ours, 'python_choice'), samples_by_request(theirs, 'python_choice')
  assert len(mine) == len(reference) == 25
  np.testing.assert_allclose([m[0] for m in mine], [r[0] for r in reference], rtol=0, atol=TOLERANCE)
  assert [m[1] for m in mine] == [r[1] for r in reference]
  assert ours['results']['python_choice']['acc,none'] == theirs['results']['python_choice']['acc,none']
  # Some contexts are longer than the window: they were cut on the left alike.
  lengths = [len(run.tokenizer.encode(s['arguments'][0][0] + s['arguments'][0][1], special_tokens=True))
             for s in ours['samples']['python_choice']]
  assert max(lengths) > MAX_LEN + 1


@pytest.mark.numerics
def test_rolling_loglikelihoods_match_the_hf_backend(scored):
  run, _, ours, theirs = scored
  mine, reference = samples_by_request(ours, 'python_perplexity'), samples_by_request(theirs, 'python_perplexity')
  np.testing.assert_allclose(mine, reference, rtol=0, atol=TOLERANCE)
  texts = [s['arguments'][0][0] for s in ours['samples']['python_perplexity']]
  assert max(len(run.tokenizer.encode(t, special_tokens=True)) for t in texts) > 2 * MAX_LEN  # >= 3 windows


@pytest.mark.numerics
def test_generations_equal_the_hf_backend(scored):
  run, _, ours, theirs = scored
  mine = samples_by_request(ours, 'python_line_completion')
  assert mine == samples_by_request(theirs, 'python_line_completion')
  assert len(set(mine)) > 1  # the prompts were not all continued alike
  # Some prompt keeps only its last max_len - max_gen_toks tokens, alike.
  prompts = [s['arguments'][0][0] for s in ours['samples']['python_line_completion']]
  assert max(len(run.tokenizer.encode(p, special_tokens=True)) for p in prompts) > MAX_LEN - 16


def direct_requests(kind: str, arguments: list[tuple]) -> list:
  from lm_eval.api.instance import Instance
  return [Instance(request_type=kind, doc={}, arguments=args, idx=0) for args in arguments]


@pytest.mark.numerics
def test_stop_strings_cut_generations_as_in_the_hf_backend(scored, hf_backend):
  """A stop string taken from the middle of a generation cuts it there in both backends (a batch of
  two prompts of different lengths, left-padded here)."""
  from evals import harness
  run, exported, _, _ = scored
  ours = harness.RunLM(run=run, batch_size=2)
  theirs = hf_backend(exported)
  prompt = 'def fibonacci(n):\n    a, b = 0, 1\n'
  free = {'until': [], 'max_gen_toks': 10, 'do_sample': False}
  [generated] = ours.generate_until(direct_requests('generate_until', [(prompt, free)]))
  assert theirs.generate_until(direct_requests('generate_until', [(prompt, free)])) == [generated]
  stop = generated[len(generated) // 2:len(generated) // 2 + 2]
  cut = {**free, 'until': [stop]}
  requests = direct_requests('generate_until', [(prompt, cut), ('x = 1\n', cut)])
  mine = ours.generate_until(requests)
  assert mine == theirs.generate_until(requests)
  assert mine[0] == generated[:generated.index(stop)]


@pytest.mark.numerics
def test_the_greedy_continuation_is_greedy_in_both_backends(scored, hf_backend):
  """is_greedy of the tokens transformers' greedy search continues a context with: True here and in
  the hf backend; with its last token changed: False in both."""
  from evals import harness
  run, exported, _, _ = scored
  ours = harness.RunLM(run=run, batch_size=2)
  theirs = hf_backend(exported)
  context = ours.tok_encode('def add(a, b):\n')
  mask = torch.ones((1, len(context)), dtype=torch.long)
  with torch.no_grad():
    continued = theirs.model.generate(torch.tensor([context]), attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
                                      do_sample=False)[0, len(context):].tolist()
  changed = continued[:-1] + [(continued[-1] + 1) % run.tokenizer.vocab_size]
  requests = [(None, context, continued), (None, context, changed)]
  mine, reference = ours._loglikelihood_tokens(requests), theirs._loglikelihood_tokens(requests)
  assert [greedy for _, greedy in mine] == [greedy for _, greedy in reference] == [True, False]
  np.testing.assert_allclose([m for m, _ in mine], [r for r, _ in reference], rtol=0, atol=TOLERANCE)


@pytest.mark.numerics
def test_many_request_lengths_compile_a_few_programs_with_the_unpadded_scores(scored, hf_backend):
  """40 requests of 40 lengths (up to past the window) in batches of 4: one program per length
  bucket (16, 32 positions) and one for a partial batch at most; each score is that of the request
  alone, unpadded, in transformers."""
  from evals import harness
  from train import compilation
  run, exported, _, _ = scored
  lm = harness.RunLM(run=run, batch_size=4)
  rng = np.random.default_rng(0)
  requests = [(None, list(rng.integers(4, 300, size=n)), list(rng.integers(4, 300, size=2))) for n in range(1, 41)]
  before = compilation.compiled('token_scores')
  scores = lm._loglikelihood_tokens(requests)
  assert compilation.compiled('token_scores') - before <= 3
  reference = hf_backend(exported).model.eval()  # the exported directory in transformers, loaded once
  for (_, context, continuation), (logprob, greedy) in zip(requests, scores):
    window = (context + continuation)[-(MAX_LEN + 1):]
    with torch.no_grad():
      logprobs = torch.log_softmax(reference(torch.tensor([window[:-1]])).logits[0], -1).numpy()
    positions = np.arange(len(window) - 1 - len(continuation), len(window) - 1)
    targets = np.asarray(window[1:])[positions]
    assert abs(logprob - logprobs[positions, targets].sum()) <= TOLERANCE
    assert greedy == bool(np.all(logprobs[positions].argmax(-1) == targets))


# ---------------------------------------------------------------------------------------- --mode=lm_eval
@pytest.mark.numerics
def test_launch_writes_the_harness_results_into_the_run(scoring):
  """--limit=3 scores 3 evenly spaced documents of each task: of python_choice's 8, i * 8 // 3; their
  metrics are those of the hf backend's scores of the same documents (the fixture's, of every document),
  aggregated as the harness does (accuracy: the mean; bits per byte: -sum log-likelihood / sum bytes / ln 2)."""
  run, _, _, theirs = scoring('gpt2')
  spaced = {'python_choice': [0, 2, 5], 'python_perplexity': [0, 1, 2]}
  chosen = {task: [sample for sample in theirs['samples'][task] if sample['doc_id'] in documents]
            for task, documents in spaced.items()}
  assert [len(samples) for samples in chosen.values()] == [3, 3]
  accuracy = np.mean([sample['acc'] for sample in chosen['python_choice']])
  loglikelihoods, byte_counts = zip(*[sample['bits_per_byte'] for sample in chosen['python_perplexity']])
  bits_per_byte = -sum(loglikelihoods) / sum(byte_counts) / math.log(2)
  result = support.launch(['--mode=lm_eval', f'--workdir={run.workdir}', '--tasks=python_choice,python_perplexity',
                           '--limit=3', '--batch_size=2'])
  assert result.returncode == 0, result.stderr[-3000:]
  line = support.last_json(result.stdout)
  assert (line['mode'], line['workdir'], line['step']) == ('lm_eval', run.workdir, 0)
  assert os.path.dirname(line['results_file']) == os.path.join(run.workdir, 'lm_eval')
  with open(line['results_file']) as f:
    written = json.load(f)
  assert written['results'] == line['results']
  assert (written['config']['limit'], written['config']['samples']) == (3, spaced)
  assert written['results']['python_choice']['sample_len'] == 3
  assert written['results']['python_choice']['acc,none'] == pytest.approx(accuracy, abs=1e-12)
  np.testing.assert_allclose(written['results']['python_perplexity']['bits_per_byte,none'], bits_per_byte, rtol=1e-6)


def test_bad_input_is_one_line_before_anything_is_written(scoring, tmp_path):
  """Each mistake stops with one line before the checkpoint loads or anything is written: through
  launch.py (its stderr and exit status, for the mistake launch.py itself finds), or in the function
  launch.py calls (its UserError, which launch.py prints so)."""
  from errors import UserError
  from evals import runner
  from train.rundir import save_config
  run = scoring('gpt2')[0]
  missing = tmp_path / 'tasks'
  missing.mkdir()
  (missing / 'gone.yaml').write_text('task: gone_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n'
                                     f'    test: {tmp_path}/nowhere.jsonl\ntest_split: test\noutput_type: '
                                     'loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n')
  other = str(tmp_path / 'rnn')
  os.makedirs(other)
  save_config(support.smallest_config('rnn_lm'), other)
  before = sorted(os.listdir(run.workdir))
  result = support.launch(['--mode=lm_eval', f'--workdir={run.workdir}'])
  assert (result.returncode, result.stderr.strip().splitlines()) == (1, [
      "error: --mode=lm_eval needs --tasks=A,B: task names (evals/tasks/, --include_path, lm-eval's own) or task "
      "YAML files."]), result.stderr[-2000:]
  called = [
      (dict(workdir=other, tasks=['python_choice']), f"{other} is a 'rnn_lm' run; lm-eval scores decoder language "
                                                     "models, runs of the families ('gpt',): pass the --workdir of one "
                                                     "of those."),
      (dict(tasks=['python_choice', 'no_such_task']), "--tasks: unknown task 'no_such_task': neither one of lm-eval"),
      (dict(tasks=['gone_task'], include_path=str(missing)), "--tasks: the data of task 'gone_task' cannot be read"),
      (dict(tasks=['python_choice'], include_path=str(tmp_path / 'nothing')), f'--include_path={tmp_path}/nothing is '
                                                                             'not a directory'),
      (dict(tasks=['python_choice'], batch_size=0), 'batch_size=0: give a whole number of requests per batch'),
  ]
  for arguments, message in called:
    with pytest.raises(UserError) as raised:
      runner.evaluate_run(**{'workdir': run.workdir, **arguments})
    assert str(raised.value).startswith(message) and '\n' not in str(raised.value), arguments
  assert sorted(os.listdir(run.workdir)) == before and os.listdir(other) == ['config.json']


# ---------------------------------------------------------------------------- tasks during training
TRAINING_TASKS = 'python_choice,python_perplexity'
SCORED = 'tasks/python_perplexity/bits_per_byte'
LOGGED = sorted(['tasks/python_choice/acc', 'tasks/python_choice/acc_norm', 'tasks/python_perplexity/word_perplexity',
                 'tasks/python_perplexity/byte_perplexity', SCORED])  # the task YAMLs' metric_list, filter 'none'


def with_tasks(corpus: str, **overrides):
  """configs/gpt.py:tiny on `corpus`, scoring 3 documents of each of TRAINING_TASKS during training."""
  from configs import gpt
  config = gpt.get_config('tiny')
  config.data.source = corpus
  return support.with_overrides(config, {'train.eval_tasks': TRAINING_TASKS, 'train.eval_tasks_limit': 3,
                                         'train.eval_every': 5, 'train.eval_tasks_every': 10,
                                         'train.async_checkpoints': False, **overrides})


def train_with_tasks(config, workdir: str) -> dict:
  """What launch.py's train mode runs: the trainer with the scorer of train.eval_tasks."""
  from evals.during_training import TrainingTasks
  from train.trainer import train_and_evaluate
  return train_and_evaluate(config, workdir, TrainingTasks(config, workdir))


@pytest.fixture(scope='module')
def task_corpus(tmp_path_factory):
  return support.write_corpus(str(tmp_path_factory.mktemp('task_corpus')))


@pytest.fixture(scope='module')
def trained_with_tasks(tmp_path_factory, task_corpus):
  """A tiny GPT trained 4 steps, evaluated every step and scoring the tasks (and saving) every 2, whose best
  checkpoint is the one of the worst bits per byte (best_mode=max: not the last step, as a rule):
  (its workdir, its result line, {evaluated step: the tasks/... it logged})."""
  workdir = str(tmp_path_factory.mktemp('tasks') / 'run')
  config = with_tasks(task_corpus, **{'train.steps': 4, 'train.eval_every': 1, 'train.eval_tasks_every': 2,
                                      'train.checkpoint_every': 2, 'train.log_every': 1, 'train.best_metric': SCORED,
                                      'train.best_mode': 'max', 'train.target': f'{SCORED}<=1e9'})
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv('HF_DATASETS_OFFLINE', '1')
    results = train_with_tasks(config, workdir)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  scored = {row['step']: {k: v for k, v in row.items() if k.startswith('tasks/')} for row in rows if 'eval/loss' in row}
  return workdir, results, scored


@pytest.mark.numerics
def test_tasks_scored_during_training_equal_lm_eval_of_the_same_checkpoint(trained_with_tasks):
  """The tasks' metrics logged at the last step equal `--mode=lm_eval --limit=3` (what launch.py
  calls) of that step's checkpoint; as train.best_metric (worst is best) the task metric picks the
  final evaluation's checkpoint among the steps that scored it; as train.target it is met at the
  first of them."""
  from evals import runner
  from evals.during_training import task_metrics
  workdir, results, scored = trained_with_tasks
  assert sorted(scored) == [1, 2, 3, 4] and not scored[1] and not scored[3]
  assert sorted(scored[2]) == sorted(scored[4]) == LOGGED
  assert results['final_eval_step'] == max((2, 4), key=lambda step: scored[step][SCORED])
  assert (results['target/met'], results['target/step']) == (True, 2)
  separate = runner.evaluate_run(workdir, TRAINING_TASKS.split(','), limit=3, batch_size=2,
                                 config_overrides={'train.final_eval_from': 'last'})
  assert separate['step'] == 4
  assert separate['results']['python_choice']['sample_len'] == 3
  logged = task_metrics(separate['results'])
  assert sorted(logged) == LOGGED
  # The live 8-device model and the reloaded one sum in other orders: the continuous metrics agree to 1e-5.
  # An accuracy is an argmax over a document's choices, and the tiny model's choices come within that of
  # each other: under XLA's AVX2 code generation with its default compiler settings one of the 3 documents
  # flipped. So each accuracy may differ by one document (the choices' log-likelihoods themselves are
  # checked request by request against the hf backend above).
  accuracies = [name for name in LOGGED if name.startswith('tasks/python_choice/')]
  continuous = [name for name in LOGGED if name not in accuracies]
  np.testing.assert_allclose([scored[4][name] for name in continuous], [logged[name] for name in continuous],
                             rtol=1e-5)
  np.testing.assert_allclose([scored[4][name] for name in accuracies], [logged[name] for name in accuracies],
                             atol=1 / 3 + 1e-9)


def test_tasks_during_training_refuse_bad_input_before_the_workdir(task_corpus, tmp_path):
  """Each mistake is one line before the workdir exists: through launch.py (a family that is no
  decoder: exit 1), or in what it calls; and a well-formed scorer scores evenly spaced documents."""
  from errors import UserError
  from evals.during_training import TrainingTasks
  from train.trainer import train_and_evaluate
  workdir = tmp_path / 'run'
  rnn = f'--config=configs/rnn_lm.py:{support.smallest_preset("rnn_lm")}'
  result = support.launch([rnn, '--config.train.eval_tasks=python_choice', f'--workdir={workdir}'])
  assert (result.returncode, result.stderr.strip().splitlines()) == (1, [
      "error: config.train.eval_tasks='python_choice': lm-eval tasks score decoder language models, the families "
      "('gpt',), not a 'rnn_lm' run; set --config.train.eval_tasks=''."]), result.stderr[-2000:]
  missing = tmp_path / 'tasks'
  missing.mkdir()
  (missing / 'gone.yaml').write_text('task: gone_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n'
                                     f'    test: {tmp_path}/nowhere.jsonl\ntest_split: test\noutput_type: '
                                     'loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n')
  with pytest.raises(UserError) as raised:
    TrainingTasks(with_tasks(task_corpus, **{'train.eval_tasks': 'gone_task',
                                             'train.eval_tasks_include_path': str(missing)}), str(workdir))
  assert str(raised.value).startswith("config.train.eval_tasks: the data of task 'gone_task' cannot be read")
  assert '\n' not in str(raised.value)
  tasks = TrainingTasks(with_tasks(task_corpus), str(workdir))
  assert tasks.samples == {'python_choice': [0, 2, 5], 'python_perplexity': [0, 1, 2]}  # of 8 and 4 documents
  assert 'python_choice 3 of 8, python_perplexity 3 of 4 documents, evenly spaced' in tasks.describe()
  assert tasks.metric_names == LOGGED
  trained = {
      'train.best_metric': ('tasks/python_choice/accuracy', "config.train.best_metric='tasks/python_choice/accuracy' "
                                                            'is no metric of train.eval_tasks'),
      'train.target': ('tasks/python_choice/accuracy>=0.5', "config.train.target='tasks/python_choice/accuracy>=0.5' "
                                                           "names 'tasks/python_choice/accuracy', which no evaluation"),
      'train.eval_tasks_every': (7, 'config.train.eval_tasks_every=7 must be a multiple of config.train.eval_every=5'),
  }
  for key, (value, message) in trained.items():
    with pytest.raises(UserError) as raised:
      train_and_evaluate(with_tasks(task_corpus, **{key: value}), str(workdir), tasks)
    assert str(raised.value).startswith(message) and '\n' not in str(raised.value), key
  with pytest.raises(UserError, match=r"^config.train.eval_tasks='python_choice,python_perplexity' needs the task "):
    train_and_evaluate(with_tasks(task_corpus), str(workdir))
  assert not workdir.exists()
