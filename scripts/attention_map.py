"""The home page's attention heatmap as data: a finished main-job run's cross-attention on its first test
sentence, written to measurements/transformer_attention.json for scripts/make_figures.py.

  python launch.py --workdir=runs/main            # the main job (configs/transformer.py:default)
  python scripts/attention_map.py --workdir=runs/main [--out=measurements/transformer_attention.json]

It reloads the run (`load_run`: the checkpoint its final evaluation scored), translates the first sentence
of its translations.json with the run's beam search and records the weights that run's attention_0.png
draws in its top row: the cross-attention of decoder layer `pictures.layer`, one [target tokens, source
tokens] matrix per head, rounded to 3 decimals, with the tokens, the date, the commit, the machine and
the commands.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from time_to_target import cpu_model  # noqa: E402  (scripts/, this script's own folder)
from train import pictures  # noqa: E402
from train.rundir import load_run  # noqa: E402
from train.tasks.transformer import decoder_attention_weights  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, 'measurements', 'transformer_attention.json')


def first_test_sentence(workdir: str) -> str:
  with open(os.path.join(workdir, 'translations.json'), encoding='utf-8') as f:
    return json.load(f)[0]['source']


def attention_record(workdir: str) -> dict:
  """The run's last-layer cross-attention on its first test sentence: tokens and [heads, T, S] weights."""
  run = load_run(workdir)
  if run.config.family != 'transformer':
    raise SystemExit(f'--workdir={workdir} is a {run.config.family!r} run; give a run of the main job '
                     f'(python launch.py, the Transformer).')
  tok, text = run.tokenizer, first_test_sentence(workdir)
  source = run.task.encode_sources([text])
  output = run.task.translate_ids(run.model, source, int(run.config.decode.beam_size))[0]
  target_in = np.asarray([[tok.bos_id] + output], np.int32)
  layer = run.config.pictures.layer % run.model_config.decoder_layers
  weights = decoder_attention_weights(run.model, jnp.asarray(source), jnp.asarray(target_in))
  source_ids = [int(i) for i in source[0] if i != tok.pad_id]
  target_out = output + [tok.eos_id]
  cross = np.asarray(weights[f'decoder_blocks/{layer}/cross_attention'])[0, :, :len(target_out), :len(source_ids)]
  return {'source': text, 'translation': tok.decode(output), 'step': run.step, 'decoder_layer': layer + 1,
          'source_tokens': pictures.token_labels(tok, source_ids),
          'target_tokens': pictures.token_labels(tok, target_out),
          'heads': np.round(cross.astype(np.float64), 3).tolist()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', required=True, help='a finished run of `python launch.py`')
  parser.add_argument('--out', default=DEFAULT_OUT)
  args = parser.parse_args()
  if not os.path.isfile(os.path.join(args.workdir, 'translations.json')):
    raise SystemExit(f'--workdir={args.workdir} has no translations.json: give a finished run of the main job '
                     f'(python launch.py --workdir={args.workdir}).')
  commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
  record = {'date': datetime.date.today().isoformat(), 'recorded_at': commit, 'machine': cpu_model(),
            'command': f'python launch.py --workdir={args.workdir} && '
                       f'python scripts/attention_map.py --workdir={args.workdir}',
            **attention_record(args.workdir)}
  heads = record.pop('heads')
  # One matrix row per line: the file stays readable and its diffs small.
  rows = ',\n'.join('    [' + ',\n     '.join(json.dumps(row) for row in head) + ']' for head in heads)
  fields = ',\n'.join(f'  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}' for key, value in record.items())
  with open(args.out, 'w', encoding='utf-8') as f:
    f.write(f'{{\n{fields},\n  "heads": [\n{rows}\n  ]\n}}\n')
  print(args.out)


if __name__ == '__main__':
  main()
