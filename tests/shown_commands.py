"""Every shell command the README and the docs show, and what checks it (issue #53).

A reader copies a command from a page; it must work, or the page must say why it cannot run here.
So each command shown (an indented code block's shell line, its `\\` continuations joined, or an
inline `python ...` / `pip ...` / `mkdocs ...` span) is in `SHOWN` with one of:

  Ci(step)        run exactly as written by that step of `.ci/run` (`shown commands`: by
                  `.ci/shown_commands.py`, in `SHOWN`'s order, each in a fresh bash in the repository root);
  ByTest(node)    a command whose paths are the reader's own (`/path/...`, `runs/<their run>`): the named
                  test runs the same mode and flags on files of its own;
  Needs(what)     marked on its page, on its line or in the paragraph around it, as needing an
                  'accelerator', a 'network' (a download, a bucket) or 'minutes' (more than a few on 2 CPU
                  cores: the page gives how long it took on a named machine, e.g. '~4 min on 2 cores of an
                  AMD EPYC'; the machine may be named once in the command's section);
  Synopsis()      a usage pattern with placeholders (`<family>`, `[...]`), not a command;
  SameAs(command) the launch `command` (run as written by a CI step) under another --workdir name, or with
                  a --config that gives the same config (`python launch.py --config=configs/transformer.py:default`
                  is `python launch.py`): CI does not train the same run twice; the test resolves both command
                  lines' configs and finds them equal.

tests/test_shown_commands.py fails on a command shown but not in `SHOWN` (or the reverse), a Needs
whose page does not say so, a ByTest naming no test or a test that does not run the command's family and
mode, and a Ci naming no step of `.ci/run`.
"""
from __future__ import annotations

import dataclasses
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ('README.md', 'docs')  # the README and every Markdown page under docs/
PROGRAMS = ('python', 'python3', 'pip', 'mkdocs', 'gcloud', 'gsutil', 'tensorboard', 'echo', 'printf', 'export', 'bash',
            'taskset', 'env', 'cd', 'git', 'source', 'nohup', 'time', 'curl', 'docker', 'sudo', 'apt-get', 'uv',
            '/tmp/aot/bin/python', '/tmp/aot/bin/pip')


@dataclasses.dataclass(frozen=True)
class Ci:
  step: str


@dataclasses.dataclass(frozen=True)
class ByTest:
  node: str


@dataclasses.dataclass(frozen=True)
class Needs:
  what: str  # 'accelerator' | 'network' | 'minutes'


@dataclasses.dataclass(frozen=True)
class Synopsis:
  pass


@dataclasses.dataclass(frozen=True)
class SameAs:
  command: str  # a command of SHOWN that a CI step runs as written


# What each need's mark looks like on a page (its line's comment, its block, or the paragraph before or after).
MARKS = {
    'accelerator': r'\b(GPUs?|TPUs?|H100|H200|accelerators?|pod)\b',
    'network': r'network|download|bucket|credentials',
    'minutes': r'\b\d+(\.\d+)?(\s*[-–]\s*\d+)?\s*(s|min|minutes?|h|hours?)\b',  # a duration, with its machine:
}
# The machines the project measures on, as its pages name them: a 'minutes' mark is a duration measured on one
# of these, named in the mark's context or in the section (heading to heading) that holds the command.
MACHINES = r'\b(AMD EPYC|Intel Xeon|H100|H200|A100|TPU v\d\w*|v[2-6][ep]?-\d+)\b'
NOT_RECORDED = r'machine was not recorded|CPU not recorded|machine not recorded'


@dataclasses.dataclass(frozen=True)
class Shown:
  """One command as a page shows it: `page` relative to the repository, its 1-based `line`, the
  command `text` (continuations joined, the trailing comment dropped), `context`: the text around
  it that may mark it (its comment, its block's other comments and the paragraphs before and after; a
  table row's own cells, the table's header and the paragraphs around the table), and `section`: the
  page's text from the heading above it to the next heading."""
  page: str
  line: int
  text: str
  context: str
  section: str = ''


def marked(shown: Shown, what: str) -> bool:
  """Whether the page marks `shown` as needing `what`; a 'minutes' mark names the machine it was measured
  on, in its context or its section, and does not say that machine was not recorded."""
  if not re.search(MARKS[what], shown.context):
    return False
  if what != 'minutes':
    return True
  return (bool(re.search(MACHINES, shown.context) or re.search(MACHINES, shown.section))
          and not re.search(NOT_RECORDED, shown.context))


def pages() -> list[str]:
  found = ['README.md']
  for root, _, files in os.walk(os.path.join(REPO, 'docs')):
    found += [os.path.relpath(os.path.join(root, f), REPO) for f in files if f.endswith('.md')]
  return sorted(found)


def _is_command(line: str) -> bool:
  words = line.split()
  while words and re.fullmatch(r'[A-Z_][A-Z0-9_]*=\S*', words[0]):  # VAR=value python ...
    words = words[1:]
  return bool(words) and words[0] in PROGRAMS


def _split_comment(line: str) -> tuple[str, str]:
  """(the command, its trailing `# comment`): a `#` outside quotes after whitespace starts the comment."""
  quote = None
  for i, char in enumerate(line):
    if quote:
      quote = None if char == quote else quote
    elif char in '\'"':
      quote = char
    elif char == '#' and (i == 0 or line[i - 1].isspace()):
      return line[:i].rstrip(), line[i + 1:].strip()
  return line.rstrip(), ''


def _paragraph(lines: list[str], start: int, step: int) -> str:
  """The non-blank lines from `start` walking by `step` (-1 up, +1 down) until a blank line."""
  found, i = [], start
  while 0 <= i < len(lines) and lines[i].strip():
    found.append(lines[i])
    i += step
  return ' '.join(found[::step])


def inline_spans(lines: list[str], first: int, last: int) -> list[tuple[int, str]]:
  """The code spans of the paragraph lines[first:last] as (0-based line where each opens, its text with
  whitespace runs as single spaces). A span may wrap onto the next lines, as Markdown lets it."""
  text = '\n'.join(lines[first:last])
  return [(first + text.count('\n', 0, span.start()), ' '.join(span.group(1).split()))
          for span in re.finditer(r'`([^`]+)`', text)]


def _section(lines: list[str], i: int) -> str:
  """The lines from the heading above line i (or the page's start) to the next heading, joined."""
  start = next((j for j in range(i, -1, -1) if lines[j].startswith('#')), 0)
  end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith('#')), len(lines))
  return ' '.join(lines[start:end])


def _code_block(page: str, lines: list[str], i: int, found: list[Shown]) -> int:
  """Append the commands of the indented code block starting at line i; return the line after it."""
  end = i
  while end < len(lines) and (lines[end].startswith('    ') or not lines[end].strip()):
    end += 1
  block = lines[i:end]
  comments = ' '.join(_split_comment(line.strip())[1] for line in block)
  around = _paragraph(lines, i - 2, -1) + ' ' + _paragraph(lines, end, 1)
  j = 0
  while j < len(block):
    first = j
    text, comment = _split_comment(block[j].strip())
    while text.endswith('\\') and j + 1 < len(block):
      j += 1
      more, more_comment = _split_comment(block[j].strip())
      text, comment = text[:-1].rstrip() + ' ' + more, f'{comment} {more_comment}'.strip()
    if _is_command(text):
      found.append(Shown(page, i + first + 1, text, f'{comment} {comments} {around}', _section(lines, i + first)))
    j += 1
  return end


def _paragraph_spans(page: str, lines: list[str], i: int, found: list[Shown]) -> int:
  """Append the commands of the paragraph (or table) starting at line i; return the line after it."""
  end = i + 1
  while end < len(lines) and lines[end].strip():
    end += 1
  paragraph = ' '.join(lines[i:end])
  around = _paragraph(lines, i - 2, -1) + ' ' + _paragraph(lines, end + 1, 1)
  header = next((line for line in range(i, end) if lines[line].startswith('|')), None)
  for line, span in inline_spans(lines, i, end):
    if len(span.split()) > 1 and _is_command(span):
      in_a_row = header is not None and line > header and lines[line].startswith('|')  # a table's row: its own cells
      if in_a_row:  # each row names its own machine: the section's other rows do not count
        found.append(Shown(page, line + 1, span, f'{lines[header]} {lines[line]} {around}'))
      else:
        found.append(Shown(page, line + 1, span, paragraph, _section(lines, line)))
  return end


def shown_in(page: str) -> list[Shown]:
  """The commands `page` shows, in order: an indented code block's (4-space lines after a blank line)
  and a paragraph's inline spans."""
  with open(os.path.join(REPO, page)) as f:
    lines = f.read().splitlines()
  found = []
  i = 0
  while i < len(lines):
    if lines[i].startswith('    ') and (i == 0 or not lines[i - 1].strip()):
      i = _code_block(page, lines, i, found)
    elif lines[i].strip():
      i = _paragraph_spans(page, lines, i, found)
    else:
      i += 1
  return found


def all_shown() -> list[Shown]:
  return [shown for page in pages() for shown in shown_in(page)]


RUN = Ci('shown commands')  # .ci/shown_commands.py, in this order
# A LoRA run's exports (merged, its base run's, the PEFT adapter): Run.export_hf as --mode=export_hf calls it.
LORA_EXPORT = ByTest('tests/test_lora.py::'
                     'test_a_gpt2_lora_run_exports_a_peft_adapter_and_a_merged_model_with_its_logits')
# A BERT LoRA classifier run and its exports (the base run's, the PEFT adapter, merged).
BERT_LORA = ByTest('tests/test_lora.py::test_a_bert_classifier_trains_adapters_and_its_new_head_and_exports_both_ways')

SHOWN: dict[str, Ci | ByTest | Needs | Synopsis | SameAs] = {
    # ----------------------------------------------------------------------- the two commands, the docs
    'pip install -r requirements.txt && python launch.py': Ci('README command 1'),
    'python launch.py': Ci('README command 1'),
    'pip install -r requirements-dev.txt && python -m pytest -q': Ci('test suite'),
    'ATTENTION_LINEAGE_TEST_COMPILER=default python -m pytest ...': Ci('numerics, AVX2 and default compiler'),
    'python -m pytest -q -n 0 tests/test_x.py': Synopsis(),
    'pip install wandb==0.31.0': Ci('install requirements-dev.txt'),  # requirements-dev.txt's pin
    'pip install -r requirements-docs.txt': Ci('install requirements-docs.txt'),
    'pip install -r requirements.txt': Ci('install requirements-dev.txt'),  # requirements-dev.txt includes it
    'pip install -r requirements-dev.txt': Ci('install requirements-dev.txt'),
    'mkdocs build --strict': Ci('docs build'),
    'python launch.py --config=configs/<family>.py[:preset] [--config.section.key=value ...] [--workdir=DIR] '
    '[--mode=MODE]': Synopsis(),
    # --------------------------------------------------------------------- run as written, in this order
    'python scripts/make_gettext_corpus.py --out_dir=/tmp/gettext': RUN,
    'python launch.py --config=configs/attention_pooling.py': RUN,
    'python3 -m venv .venv && source .venv/bin/activate': RUN,
    # docs/tutorial.md, in its order: the main job into a named workdir, then eval and predict on it
    # (the main job, its --mode=eval and its predict as README command 1's step runs them, under another name)
    'python launch.py --workdir=runs/first-hour': SameAs('python launch.py'),
    'python launch.py --mode=eval --workdir=runs/first-hour':
        SameAs('python launch.py --mode=eval --workdir=runs/transformer-default-...'),
    "echo 'three hundred and twelve' | python launch.py --mode=predict --workdir=runs/first-hour --input=-":
        SameAs("echo 'three hundred and twelve' | python launch.py --mode=predict --workdir=runs/transformer-default-... "
               '--input=-'),
    'python launch.py --config=configs/transformer.py:tiny --config.data.source=tsv:/tmp/gettext/train.tsv '
    '--workdir=runs/my-pairs': RUN,  # on the corpus make_gettext_corpus.py wrote above
    "python launch.py --config=configs/gpt.py:tiny --config.data.source='text:docs/*.md' --workdir=runs/my-text": RUN,
    "echo '## Install' | python launch.py --mode=predict --workdir=runs/my-text --input=-": RUN,
    'python launch.py --config=configs/transformer.py:default': SameAs('python launch.py'),  # configs/default.py
    'python launch.py --sweep=configs/sweeps/gpt_tiny_random.py --sweep_dry_run': RUN,
    'python launch.py --config=configs/rnn_lm.py': RUN,
    'python launch.py --config=configs/rnn_lm.py:random': RUN,
    'python launch.py --config=configs/seq2seq.py:long': RUN,
    'python launch.py --config=configs/gpt.py:bench --mode=bench': RUN,
    'python scripts/tfidf_baseline.py': RUN,
    'python scripts/make_folds.py --out=/tmp/bbc_folds': RUN,
    'python scripts/collectives_table.py configs/gpt.py:gpt2 --mesh=1,8,1 --batch=16 --seq_len=1024': RUN,
    'python scripts/collectives_table.py configs/bert.py:base --mesh=1,8,1 --batch=64 --seq_len=128': RUN,
    'python scripts/collectives_table.py configs/gpt.py:gpt2 --layers=2 --batch=16 --seq_len=1024 --optimizer=muon': RUN,
    'python scripts/fault_soak.py --workdir=/tmp/soak --kills=30 --seed=0': RUN,
    'python scripts/fault_soak.py --workdir=/tmp/soak-2p --processes=2 --kills=10 --seed=1': RUN,
    'python scripts/fault_soak.py --workdir=gs://bucket/soak --emulator --kills=10 --seed=2': RUN,
    'python scripts/make_figures.py': RUN,
    'python scripts/make_figures.py --check': RUN,  # after the figures above are redrawn: none stale
    'python docs/gen_config_reference.py > docs/reference/config.md': RUN,  # the committed copy, rewritten equal
    'python docs/gen_measurement_tables.py': RUN,  # the committed blocks, rewritten equal
    'pip install -r requirements-docs.txt && mkdocs serve': RUN,  # until it serves the site, then stopped
    'mkdocs serve': RUN,
    # ------------------------------------------------------- the reader's own files and runs: a test's own
    'python launch.py --config=configs/gpt.py:default --config.init_from=runs/gpt-default-... '
    '--config.train.lora_rank=8 --config.train.optimizer=adamw --config.data.source=\'text:/path/to/texts/*.txt\' '
    '--workdir=runs/gpt-lora':
        ByTest('tests/test_lora.py::test_the_base_weights_stay_bit_equal_while_the_adapters_train'),
    'python launch.py --mode=export_hf --workdir=runs/gpt-lora --hf_dir=hf/gpt-lora': LORA_EXPORT,
    'python launch.py --mode=export_hf --workdir=runs/gpt-default-... --hf_dir=hf/gpt-base': LORA_EXPORT,
    'python launch.py --mode=export_hf --workdir=runs/gpt-lora --hf_dir=hf/gpt-lora-adapter --hf_adapter': LORA_EXPORT,
    'pip install peft==0.21.2': Ci('install requirements-dev.txt'),  # requirements-dev.txt's pin
    'python launch.py --config=configs/bert.py:finetune --config.init_from=runs/bert-pretrain '
    '--config.train.lora_rank=8 --config.data.seq_len=128 --workdir=runs/bert-bbc-lora':
        BERT_LORA,
    'python launch.py --mode=export_hf --workdir=runs/bert-pretrain --hf_dir=hf/bert-base': BERT_LORA,
    'python launch.py --mode=export_hf --workdir=runs/bert-bbc-lora --hf_dir=hf/bert-bbc-adapter --hf_adapter':
        BERT_LORA,
    'python scripts/make_gettext_corpus.py --out_dir=DIR': ByTest('tests/test_make_gettext_corpus.py'),
    "python launch.py --config=configs/gpt.py --config.data.source='text:/data/owt/*.txt' --mode=prepare":
        ByTest('tests/test_cache_settings.py::test_a_launch_of_the_tests_builds_its_caches_in_the_temporary_folder'),
    "python launch.py --config=configs/gpt.py --config.data.source='text:/data/owt/*.txt' --workdir=runs/owt":
        ByTest('tests/test_cache_settings.py::test_a_launch_of_the_tests_builds_its_caches_in_the_temporary_folder'),
    'python launch.py --config=configs/classifier.py:default --config.data.source=tsv:/path/train.tsv':
        ByTest('tests/test_classifier.py::test_trains_on_a_tsv_and_reloads_with_label_names'),
    'python launch.py --config=configs/transformer.py:default --config.data.source=tsv:/path/pairs.tsv':
        ByTest('tests/test_transformer.py::test_train_evaluate_predict_on_a_tsv_corpus'),
    # .ci/readme_command.py runs these two on the workdir README command 1 wrote:
    "echo 'three hundred and twelve' | python launch.py --mode=predict --workdir=runs/transformer-default-... "
    '--input=-': Ci('README command 1'),
    'python launch.py --mode=eval --workdir=runs/transformer-default-...': Ci('README command 1'),
    "echo 'def fibonacci(n):' | python launch.py --mode=predict --workdir=runs/gpt-default-... --input=-":
        ByTest('tests/test_daily_loop.py::test_predict_says_when_an_input_is_cut_to_the_window'),
    "printf 'a sentence\\n' | python launch.py --mode=predict --workdir=runs/bert-base --input=-":
        ByTest('tests/test_bert_task.py::test_launch_predict_applies_config_overrides_to_a_trained_run'),
    "printf 'a sentence\\n' | python launch.py --mode=predict --workdir=runs/bert-bbc --config.task=features "
    '--config.features.pooling=mean --input=-':
        ByTest('tests/test_bert_task.py::test_launch_predict_applies_config_overrides_to_a_trained_run'),
    'python launch.py --mode=export_hf --workdir=runs/smollm --hf_dir=hf/smollm':
        ByTest('tests/test_llama.py::test_import_then_export_is_the_identity_and_loads_in_transformers'),
    'python launch.py --mode=export_hf --workdir=runs/qwen3-moe --hf_dir=hf/qwen3-moe':
        ByTest('tests/test_interop_moe.py::test_import_then_export_is_the_identity_and_loads_in_transformers'),
    'python launch.py --mode=lm_eval --workdir=runs/gpt-default-... '
    '--tasks=python_choice,python_perplexity,python_line_completion':
        ByTest('tests/test_lm_eval.py::test_launch_writes_the_harness_results_into_the_run'),
    'python launch.py --config=configs/gpt.py:default --workdir=runs/gpt-tasks '
    '--config.train.eval_tasks=python_choice,python_perplexity --config.train.best_metric=tasks/python_choice/acc '
    '--config.train.best_mode=max':
        ByTest('tests/test_lm_eval.py::test_tasks_scored_during_training_equal_lm_eval_of_the_same_checkpoint'),
    'export STORAGE_EMULATOR_HOST=http://localhost:9023':
        ByTest('tests/test_cloud_workdir.py::test_a_gs_workdir_trains_resumes_evaluates_predicts_and_reloads'),
    'export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false':
        ByTest('tests/test_cloud_workdir.py::test_a_gs_workdir_trains_resumes_evaluates_predicts_and_reloads'),
    'export TENSORSTORE_GCS_HTTP_URL=http://localhost:9023':
        ByTest('tests/test_cloud_workdir.py::test_a_gs_workdir_trains_resumes_evaluates_predicts_and_reloads'),
    'export GOOGLE_AUTH_TOKEN_FOR_TESTING=emulator':
        ByTest('tests/test_cloud_workdir.py::test_a_gs_workdir_trains_resumes_evaluates_predicts_and_reloads'),
    # ------------------------------------------------------------------- more than a few minutes on 2 cores
    'python launch.py --config=configs/gpt.py:default': Needs('minutes'),
    'python launch.py --config=configs/gpt.py:llama': Needs('minutes'),
    'python launch.py --config=configs/bert.py:finetune': Needs('minutes'),
    'python launch.py --config=configs/bert.py:default --workdir=runs/bert-pretrain': Needs('minutes'),
    'python launch.py --config=configs/bert.py:finetune --config.init_from=runs/bert-pretrain --workdir=runs/bert-bbc':
        Needs('minutes'),
    'python launch.py --config=configs/classifier.py:default': Needs('minutes'),
    'python launch.py --config=configs/seq2seq.py:long_bahdanau': Needs('minutes'),
    'python scripts/time_to_target.py --config=configs/gpt.py:default --baseline=gpt-2019 --steps=400 --rounds=2 '
    '--target=3.8783475756645203': Needs('minutes'),
    'python scripts/time_to_target.py --config=configs/classifier.py:default --baseline=classifier-2019 --minutes=3 '
    '--metric=test/accuracy --rounds=1': Needs('minutes'),
    'python scripts/time_to_target.py --config=configs/transformer.py:default --baseline=transformer-2019 '
    '--data=gettext --minutes=1.5 --metric=test/bleu --rounds=2': Needs('minutes'),
    'python launch.py --sweep=configs/sweeps/gpt_tiny_random.py --workdir=runs/rs --sweep_workers=2': Needs('minutes'),
    'python launch.py --sweep=configs/sweeps/gpt_tiny_lr.py --workdir=runs/grid': Needs('minutes'),
    'python launch.py --sweep=configs/sweeps/gpt_recipe_ablation.py --workdir=runs/gpt-recipe-ablation':
        Needs('minutes'),
    'python launch.py --sweep=configs/sweeps/transformer_recipe.py --workdir=runs/sweep-transformer --sweep_workers=1':
        Needs('minutes'),
    'python launch.py --sweep=configs/sweeps/classifier_recipe.py --workdir=runs/sweep-classifier --sweep_workers=1':
        Needs('minutes'),
    'python launch.py --sweep=configs/sweeps/gpt_recipe.py --workdir=runs/sweep-gpt-recipe': Needs('minutes'),
    'python scripts/sweep_bench.py': Needs('minutes'),
    'python scripts/sweep_bench.py --out=runs/sweep-bench': Needs('minutes'),
    'python scripts/speed_table.py --reference_dir=../shared/reference-bench --rounds=2 '
    '--only=gpt,bert,decode,transformer': Needs('minutes'),
    'python scripts/speed_table.py --rounds=3 --only=llama,llama-decode,transformer': Needs('minutes'),
    'python scripts/speed_table.py --rounds=2 --only=gpt,bert,decode': Needs('minutes'),
    'taskset -c 0 python launch.py --config=configs/gpt.py:llama --config.train.steps=2000 '
    '--config.train.max_minutes=15 --workdir=runs/q-llama': Needs('minutes'),
    'taskset -c 1 python launch.py --config=configs/gpt.py:default --config.train.steps=2000 '
    '--config.train.max_minutes=15 --workdir=runs/q-gpt2': Needs('minutes'),
    'python scripts/bits_per_byte.py runs/q-llama runs/q-gpt2': Needs('minutes'),  # of the two runs above
    'python scripts/data_scale.py make --kind=pairs --out_dir=/tmp/pairs-1g --megabytes=1000': Needs('minutes'),
    'python scripts/data_scale.py make --kind=labels --out_dir=/tmp/labels-1g --megabytes=1000': Needs('minutes'),
    'python scripts/data_scale.py make --kind=documents --out_dir=/tmp/documents-1g --megabytes=1000':
        Needs('minutes'),
    'python scripts/data_scale.py make --kind=text --out_dir=/tmp/text-1g --megabytes=1000': Needs('minutes'),
    'python scripts/data_scale.py measure --kind=pairs --corpus=/tmp/pairs-1g --cache_dir=/tmp/scale-cache-pairs':
        Needs('minutes'),
    'python launch.py --config=configs/transformer.py:default --config.data.source=tsv:/tmp/gettext/train.tsv '
    '--config.data.eval_source=tsv:/tmp/gettext/valid.tsv --config.data.test_source=tsv:/tmp/gettext/test.tsv '
    '--config.model.width=256 --config.model.num_heads=4 --config.model.encoder_layers=3 '
    '--config.model.decoder_layers=3 --config.model.mlp_dim=1024 --config.data.vocab_size=8000 '
    '--config.data.seq_len=128 --config.train.batch_size=8 --config.train.steps=100000 '
    '--config.train.schedule=constant --config.train.lr=1e-3 --config.train.warmup_steps=200 '
    '--config.train.eval_every=1000 --config.train.max_minutes=25 --config.train.final_eval_from=last '
    '--config.train.optimizer=adam --config.model.qk_norm=False --config.model.zero_init_out=False '
    '--config.model.pre_norm=False --config.model.dropout=0.1 --config.train.label_smoothing=0.1 '
    '--config.train.b2=0.98': Needs('minutes'),
    # --------------------------------------------------------------------- a network, or an accelerator
    'python3 -m venv /tmp/aot && /tmp/aot/bin/pip install -r requirements-aot.txt': Needs('network'),
    '/tmp/aot/bin/python launch.py --config=... --mode=compile --compile_target=v5e-8': Needs('network'),
    'python launch.py --config=configs/gpt.py:gpt2 --config.train.batch_size=16 --config.model.dtype=bfloat16 '
    '--config.model.dropout=0.0 --mode=compile --compile_target=h100': Needs('network'),
    'python launch.py $G --mode=compile --compile_target=h100 [--config.rng_impl=threefry]': Needs('network'),
    'python launch.py --config=configs/bert.py:base --config.train.batch_size=64 --config.model.dtype=bfloat16 '
    '--config.model.dropout=0.0 --config.model.attention_dropout=0.0 --mode=compile --compile_target=h100':
        Needs('network'),
    'python launch.py --config=configs/transformer.py:base --config.model.dtype=bfloat16 --config.model.dropout=0.0 '
    '--mode=compile --compile_target=h100': Needs('network'),
    'python launch.py $M --mode=compile --compile_target=v5e-8': Needs('network'),
    'python launch.py --config=configs/gpt.py:olmoe-1b-7b $E --config.mesh.fsdp=8 --mode=compile '
    '--compile_target=h100x8': Needs('network'),
    'python launch.py --config=configs/gpt.py:olmoe-1b-7b $E --config.mesh.fsdp=2 --config.mesh.expert=4 '
    '--mode=compile --compile_target=h100x8': Needs('network'),
    'python launch.py --config=configs/gpt.py:olmoe-1b-7b $E --config.mesh.expert=8 --mode=compile '
    '--compile_target=h100x8': Needs('network'),
    'python launch.py --config=configs/gpt.py:llama-3.2-1b --config.train.batch_size=16 --config.data.seq_len=1024 '
    '--config.model.dtype=bfloat16 --config.model.dropout=0.0 --config.mesh.data=1 --config.mesh.fsdp=8 '
    '--mode=compile --compile_target=v5e-8': Needs('network'),
    'python launch.py $G --config.model.num_layers=48 --config.model.width=1600 --config.model.num_heads=25 '
    '--config.mesh.data=1 --config.mesh.fsdp=8 --mode=compile --compile_target=v5p-16': Needs('network'),
    'python launch.py --config=configs/bert.py:base --config.task=features --mode=import_hf '
    '--hf_dir=/path/bert-base-uncased --workdir=runs/bert-base': Needs('network'),
    'python launch.py --mode=import_hf --hf_dir=/path/to/gpt2 --workdir=runs/gpt2': Needs('network'),
    'python launch.py --mode=import_hf --hf_dir=/path/to/SmolLM-135M --workdir=runs/smollm': Needs('network'),
    'python launch.py --mode=import_hf --hf_dir=/path/to/Qwen3-30B-A3B --workdir=runs/qwen3-moe': Needs('network'),
    'gcloud compute tpus tpu-vm ssh NAME --worker=all --command=...': Needs('accelerator'),
    'pip install -r requirements.txt "jax[cuda12]==0.10.2"': Needs('accelerator'),
    'pip install -r requirements.txt "jax[tpu]==0.10.2"': Needs('accelerator'),
    "gcloud compute tpus tpu-vm ssh NAME --worker=all --command='cd attention-lineage && python launch.py "
    "--config=configs/gpt.py:gpt2 --workdir=gs://BUCKET/runs/gpt2'": Needs('accelerator'),
    'python launch.py --mode=eval --workdir=gs://BUCKET/runs/gpt2': Needs('network'),
    "echo 'def fibonacci(n):' | python launch.py --mode=predict --workdir=gs://BUCKET/runs/gpt2 --input=- "
    '--output=gs://BUCKET/runs/gpt2/predictions.jsonl': Needs('network'),
    'gcloud auth application-default login': Needs('network'),
    'pip install optuna-dashboard && optuna-dashboard runs/rs/study.journal': Needs('network'),
    'tensorboard --logdir=gs://...': Needs('network'),
    'gsutil -m rsync -r gs://BUCKET/runs/gpt2/tensorboard tb/': Needs('network'),
    'python scripts/speed_table.py --gpu --reference_dir=.gpu --rounds=1 --only=gpt': Needs('accelerator'),
    'python scripts/speed_table.py --gpu --reference_dir=.gpu --rounds=1 --only=bert,decode': Needs('accelerator'),
    'python scripts/time_to_target.py --config=configs/gpt.py:default --baseline=gpt-2019 --steps=400 --rounds=2':
        Needs('accelerator'),
    'python scripts/time_to_target.py --config=configs/gpt.py:default --baseline=gpt-2019 --steps=400 --rounds=1 '
    '--size=model.num_layers=6,model.width=384,model.num_heads=6': Needs('accelerator'),
}

# Commands marked 'minutes' whose page does not yet give a duration measured on a named machine there (the
# machine was not recorded, or the page is being rewritten elsewhere): (page, command) -> what is missing.
# tests/test_shown_commands.py fails on an entry its page now marks, so this list only shrinks.
UNMEASURED: dict[tuple[str, str], str] = {
    ('README.md', 'python launch.py --config=configs/bert.py:finetune'): 'measured 2026-11-22, CPU not recorded',
    ('README.md', 'python launch.py --config=configs/seq2seq.py:long_bahdanau'): 'measured 2026-11-22, machine not recorded',
    ('docs/index.md', 'python launch.py --config=configs/bert.py:finetune'): 'measured 2026-11-22, CPU not recorded',
    ('docs/index.md', 'python launch.py --config=configs/seq2seq.py:long_bahdanau'): 'measured 2026-11-22, machine not recorded',
    ('docs/families/before-the-transformer.md', 'python launch.py --config=configs/seq2seq.py:long_bahdanau'):
        'measured 2026-11-22, machine not recorded',
    ('docs/families/bert.md', 'python launch.py --config=configs/bert.py:default --workdir=runs/bert-pretrain'):
        'no duration ("long on a CPU")',
    ('docs/families/bert.md', 'python launch.py --config=configs/bert.py:finetune --config.init_from=runs/bert-pretrain '
     '--workdir=runs/bert-bbc'): 'no duration',
    ('docs/families/gpt.md', 'python launch.py --config=configs/gpt.py:default'): 'the first of two: no machine',
    ('docs/families/gpt.md', 'python launch.py --config=configs/gpt.py:llama'): 'no duration ("minutes")',
    ('docs/families/gpt.md', 'python launch.py --sweep=configs/sweeps/gpt_recipe_ablation.py '
     '--workdir=runs/gpt-recipe-ablation'): '~30 min, the machine was not recorded',
    ('docs/families/transformer.md', 'python launch.py --config=configs/transformer.py:default '
     '--config.data.source=tsv:/tmp/gettext/train.tsv --config.data.eval_source=tsv:/tmp/gettext/valid.tsv '
     '--config.data.test_source=tsv:/tmp/gettext/test.tsv --config.model.width=256 --config.model.num_heads=4 '
     '--config.model.encoder_layers=3 --config.model.decoder_layers=3 --config.model.mlp_dim=1024 '
     '--config.data.vocab_size=8000 --config.data.seq_len=128 --config.train.batch_size=8 --config.train.steps=100000 '
     '--config.train.schedule=constant --config.train.lr=1e-3 --config.train.warmup_steps=200 '
     '--config.train.eval_every=1000 --config.train.max_minutes=25 --config.train.final_eval_from=last '
     '--config.train.optimizer=adam --config.model.qk_norm=False --config.model.zero_init_out=False '
     '--config.model.pre_norm=False --config.model.dropout=0.1 --config.train.label_smoothing=0.1 '
     '--config.train.b2=0.98'): '25 min by its own max_minutes; the CPU not recorded',
    ('docs/benchmarks.md', 'python scripts/speed_table.py --reference_dir=../shared/reference-bench --rounds=2 '
     '--only=gpt,bert,decode,transformer'): '~1 h, no machine',
    ('docs/benchmarks.md', 'python scripts/speed_table.py --rounds=2 --only=gpt,bert,decode'): 'no duration',
    ('docs/sweeps.md', 'python launch.py --sweep=configs/sweeps/gpt_tiny_random.py --workdir=runs/rs --sweep_workers=2'):
        '~4 min, no machine',
    ('docs/sweeps.md', 'python launch.py --sweep=configs/sweeps/gpt_tiny_lr.py --workdir=runs/grid'):
        'no duration ("minutes")',
}
