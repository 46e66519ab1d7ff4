"""Requests per second of the lm-eval model of a run (evals/harness.py `RunLM`) against the harness's
Hugging Face backend (`HFLM`, torch on the CPU) on the same weights exported with --mode=export_hf:
log-likelihood and generation requests at each --batch_sizes, in alternating order, each timed warm
(one untimed pass first, so our compiled programs and torch's first-call set-up are not timed).

  python scripts/lm_eval_speed.py --workdir=RUN [--batch_sizes=1,32] [--rounds=2] [--out=FILE.jsonl]

The requests come from the Python standard library's sources (the GPT family's built-in corpus, read
in sorted order, so every run times the same ones):
  loglikelihood    --loglikelihood contexts of 384 characters, each with the next 48 as its continuation
  generate_until   --generations contexts of 256 characters ending at a line's end, greedy, until a
                   newline, at most --max_gen_toks tokens (as evals/tasks/python_line_completion.yaml)
One JSON line per (round, backend, request kind, batch size) is printed and appended to --out: the
requests, seconds, requests/s, the CPU and the load average before it.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

CONTEXT_CHARS, CONTINUATION_CHARS, PROMPT_CHARS = 384, 48, 256


def stdlib_text(characters: int) -> str:
  """At least `characters` of the standard library's top-level modules, in sorted order."""
  text = []
  for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()['stdlib'], '*.py'))):
    text.append(open(path, encoding='utf-8', errors='replace').read())
    if sum(map(len, text)) > characters:
      return ''.join(text)
  raise SystemExit('The standard library holds too little text for these requests.')


def requests(loglikelihood: int, generations: int, max_gen_toks: int) -> dict[str, list]:
  """{'loglikelihood': Instances, 'generate_until': Instances} cut from the standard library."""
  from lm_eval.api.instance import Instance
  step = CONTEXT_CHARS + CONTINUATION_CHARS
  text = stdlib_text((loglikelihood + generations) * step * 2)
  scored = [(text[i * step:i * step + CONTEXT_CHARS], text[i * step + CONTEXT_CHARS:(i + 1) * step])
            for i in range(loglikelihood)]
  prompts, start = [], loglikelihood * step
  while len(prompts) < generations:
    end = text.index('\n', start + PROMPT_CHARS) + 1
    prompts.append(text[end - PROMPT_CHARS:end])
    start = end + step
  until = {'until': ['\n'], 'max_gen_toks': max_gen_toks, 'do_sample': False}
  return {'loglikelihood': [Instance('loglikelihood', {}, pair, i) for i, pair in enumerate(scored)],
          'generate_until': [Instance('generate_until', {}, (p, until), i) for i, p in enumerate(prompts)]}


def timed(model, kind: str, instances: list) -> float:
  """Seconds of one warm pass of `instances` through `model` (a pass before it, untimed)."""
  getattr(model, kind)(instances)
  started = time.perf_counter()
  getattr(model, kind)(instances)
  return time.perf_counter() - started


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', required=True, help='a GPT-family run that --mode=export_hf can export')
  parser.add_argument('--batch_sizes', default='1,32')
  parser.add_argument('--loglikelihood', type=int, default=128)
  parser.add_argument('--generations', type=int, default=32)
  parser.add_argument('--max_gen_toks', type=int, default=32)
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--out', default='')
  args = parser.parse_args(argv)
  os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
  os.environ.setdefault('HF_HUB_OFFLINE', '1')
  import torch
  from lm_eval.models.huggingface import HFLM

  from evals import harness
  from train.rundir import load_run
  run = load_run(args.workdir)
  exported = tempfile.mkdtemp(prefix='lm-eval-speed-')
  run.export_hf(exported)
  cpu = next(line.split(':', 1)[1].strip() for line in open('/proc/cpuinfo') if line.startswith('model name'))
  work = requests(args.loglikelihood, args.generations, args.max_gen_toks)
  batch_sizes = [int(b) for b in args.batch_sizes.split(',')]
  models = {}
  for round_ in range(args.rounds):
    backends = ('ours', 'hf') if round_ % 2 == 0 else ('hf', 'ours')
    for batch_size in batch_sizes:
      for backend in backends:
        if (backend, batch_size) not in models:
          models[backend, batch_size] = (
              harness.RunLM(run=run, batch_size=batch_size) if backend == 'ours' else
              HFLM(pretrained=exported, device='cpu', dtype='float32', batch_size=batch_size))
        for kind, instances in work.items():
          load = open('/proc/loadavg').read().split()[0]
          seconds = timed(models[backend, batch_size], kind, instances)
          row = {'round': round_, 'backend': backend, 'kind': kind, 'batch_size': batch_size,
                 'requests': len(instances), 'seconds': round(seconds, 3),
                 'requests_per_s': round(len(instances) / seconds, 2), 'load': load,
                 'cpu': f'{os.cpu_count()} x {cpu}', 'torch_threads': torch.get_num_threads()}
          print(json.dumps(row), flush=True)
          if args.out:
            with open(args.out, 'a') as f:
              f.write(json.dumps(row) + '\n')


if __name__ == '__main__':
  main()
