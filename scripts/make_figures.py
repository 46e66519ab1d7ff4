"""The documentation's figures, drawn from the committed measurement files only (measurements/).

  python scripts/make_figures.py [--out=docs/figures] [--check]

Writes, each from the files named:
  gpt_time_to_target.png          measurements/gpt_recipe_ablation.csv, measurements/gpt_time_to_target.csv
  gpt_learning_curves.png         measurements/gpt_learning_curves.csv (scripts/time_to_target.py's curves.csv)
  <study>_history.png             measurements/<study>.csv and configs/sweeps/<sweep>.py: Optuna's own
  <study>_importance.png            optimization history and fANOVA importances (optuna.visualization.matplotlib)
  token_cache_rss.png             measurements/token_cache_rss.csv
  speed_tables.png                measurements/speed_raw.jsonl (the lines speed_raw_provenance.csv dates),
                                  measurements/speed_xeon.csv
  gpt_moe_expert_load.png         measurements/moe_expert_load.csv: the latest measurement's rows (each logged
                                  step of one MoE run), drawn by train/pictures.py as the run draws it
  transformer_attention.png       measurements/transformer_attention.json (scripts/attention_map.py's record
                                  of a main-job run): its cross-attention heads, drawn by train/pictures.py

Each PNG records what it was drawn from: its text chunk `drawn_from` holds the JSON {repository path:
SHA-256} of every file read for it, so a figure older than its data is found from the files alone
(`stale_figures`, `--check`; tests/test_figures.py runs it). Every bar chart's value axis starts at 0.

A study is rebuilt in memory: `optuna.create_study` plus `add_trials` of every finished trial in its
CSV (the sweep's own sweep.csv), with the distributions the sweep file declares, so the plots are
Optuna's, not redrawn here. Pruned trials are left out (their rows hold the evaluation they were
pruned at, not a final score). The PNGs are committed under docs/figures/; rerun this when a
measurement file changes (`--check` lists the figures whose data changed since they were drawn, exit 1).
"""
from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import json
import os
import sys
import textwrap
import warnings

import matplotlib
import numpy as np

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import optuna  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from sweeps import runner, studies  # noqa: E402
from train import pictures  # noqa: E402

STUDIES = {  # measurements/<name>.csv: the sweep file that ran it
    'gpt_recipe_study': 'configs/sweeps/gpt_recipe.py',
    'transformer_recipe_study': 'configs/sweeps/transformer_recipe.py',
    'classifier_recipe_study': 'configs/sweeps/classifier_recipe.py',
}
RECIPE, BASELINE = '#1f77b4', '#aaaaaa'
DRAWN_FROM_KEY = 'drawn_from'  # the PNG text chunk naming the data files and their SHA-256
READ: set[str] = set()  # repository paths read since main() began the figure being drawn


def data_file(relative: str) -> str:
  """The absolute path of the repository file `relative`, noted as a source of the figure being drawn."""
  READ.add(relative)
  return os.path.join(REPO, relative)


def read_csv(name: str) -> list[dict[str, str]]:
  with open(data_file(f'measurements/{name}'), newline='', encoding='utf-8') as f:
    return list(csv.DictReader(f))


def sha256(path: str) -> str:
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def save(figure, out_dir: str, name: str) -> None:
  """Write `figure` as out_dir/name with the digests of the files read for it (DRAWN_FROM_KEY)."""
  path = os.path.join(out_dir, name)
  drawn_from = {relative: sha256(os.path.join(REPO, relative)) for relative in sorted(READ)}
  figure.savefig(path, dpi=110, bbox_inches='tight', metadata={DRAWN_FROM_KEY: json.dumps(drawn_from)})
  plt.close(figure)
  print(path)


def stale_figures(figures_dir: str, root: str = REPO) -> list[str]:
  """One line per PNG in `figures_dir` not drawn from the current files under `root`: no record of its
  data, or a file it was drawn from changed or gone since."""
  from PIL import Image  # matplotlib's own dependency
  stale = []
  for name in sorted(n for n in os.listdir(figures_dir) if n.endswith('.png')):
    with Image.open(os.path.join(figures_dir, name)) as image:
      record = image.text.get(DRAWN_FROM_KEY)
    if not record:
      stale.append(f'{name}: no record of the data it was drawn from')
      continue
    for relative, digest in json.loads(record).items():
      path = os.path.join(root, relative)
      if not os.path.isfile(path):
        stale.append(f'{name}: drawn from {relative}, which is gone')
      elif sha256(path) != digest:
        stale.append(f'{name}: {relative} changed since it was drawn')
  return stale


def gpt_time_to_target(out_dir: str) -> None:
  """The ablation's losses, and the recipe against the 2019 recipe: steps and seconds to its loss."""
  ablation = read_csv('gpt_recipe_ablation.csv')
  rounds = read_csv('gpt_time_to_target.csv')
  # One group of bars per measurement: the latest CPU one (the file's last AMD EPYC rows) and each H200 one.
  latest_cpu = [row for row in rounds if row['machine'].startswith('AMD')][-1]
  measured = lambda row: (row['date'], row['recorded_at'], row['machine'], row['setting'])
  settings = [(measured(latest_cpu), f"2 CPU cores\n{latest_cpu['date']}")]
  settings += [(measured(row), f"H200, {row['setting'].split(' (')[0]}\n{row['date']}")
               for row in rounds if row['machine'] == 'NVIDIA H200' and row['arm'] == '2019 recipe']
  figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={'width_ratios': [1.1, 1]})
  losses = [float(row['eval_loss']) for row in ablation]
  colors = [BASELINE if row['trial'] == 'the 2019 recipe' else RECIPE for row in ablation]
  left.barh(range(len(ablation)), losses, color=colors)
  left.set_yticks(range(len(ablation)), [row['trial'] for row in ablation], fontsize=8)
  left.invert_yaxis()
  left.set_xlim(0, max(losses) * 1.12)  # from zero: the differences at their true size
  for y, loss in enumerate(losses):
    left.text(loss + 0.01, y, f'{loss:.3f}', va='center', fontsize=8)
  left.set_xlabel('eval loss after 120 steps (lower is better)')
  left.set_title(f"GPT recipe ablation ({ablation[0]['date']}, {ablation[0]['recorded_at']})", fontsize=10)
  measures = [('steps', 'steps'), ('seconds', 'seconds'), ('seconds_excluding_compile', 'seconds without compiling')]
  width = 0.8 / len(measures)
  for m, (field, label) in enumerate(measures):
    ratios = []
    for key, _ in settings:
      pick = {row['arm']: row for row in rounds if measured(row) == key}
      ratios.append(float(pick['default recipe'][field]) / float(pick['2019 recipe'][field]))
    xs = [s + (m - 1) * width for s in range(len(settings))]
    bars = right.bar(xs, ratios, width, label=label, color=plt.cm.Blues(0.45 + 0.2 * m))
    right.bar_label(bars, [f'{r:.2f}x' for r in ratios], fontsize=8)
  right.axhline(1.0, color='black', linewidth=0.8)
  right.set_xticks(range(len(settings)), [label for _, label in settings], fontsize=8)
  right.set_ylabel('default recipe / 2019 recipe')
  right.set_title("To the 2019 recipe's step-400 eval loss (lower is better)", fontsize=10)
  right.legend(fontsize=8, loc='upper left')
  right.set_ylim(0, 1.35)
  save(figure, out_dir, 'gpt_time_to_target.png')


def gpt_learning_curves(out_dir: str) -> None:
  """Validation loss against steps and against seconds, the recipe and the 2019 recipe, every round."""
  rows = read_csv('gpt_learning_curves.csv')
  first = rows[0]
  target = float(first['target'])
  figure, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
  runs = sorted({(row['arm'], row['round']) for row in rows}, reverse=True)
  for arm, round_ in runs:
    curve = [row for row in rows if (row['arm'], row['round']) == (arm, round_)]
    style = {'color': RECIPE if arm == 'default recipe' else BASELINE, 'linewidth': 1.4,
             'label': f'{arm}, round {round_}', 'linestyle': '-' if round_ == '0' else '--'}
    for axis, field in zip(axes, ('step', 'seconds')):
      axis.plot([float(row[field]) for row in curve], [float(row['eval_loss']) for row in curve], **style)
  for axis, label in zip(axes, ('steps', 'seconds (the run\'s clock: set-up and compilation included)')):
    axis.axhline(target, color='black', linewidth=0.8, linestyle=':')
    axis.set_xlabel(label)
    axis.set_ylim(target - 0.4, target + 1.6)
    axis.grid(alpha=0.3)
  axes[0].text(0.98, target - 0.05, f"target {target:.4f} (the 2019 recipe's step-400 eval loss)", fontsize=8,
               va='top', ha='right', transform=axes[0].get_yaxis_transform())
  axes[0].set_ylabel('eval loss (8 validation batches)')
  axes[1].legend(fontsize=8)
  figure.suptitle(f"GPT default: the recipe against the 2019 recipe ({first['date']}, {first['recorded_at']}, "
                  f"{first['machine']})", fontsize=10)
  save(figure, out_dir, 'gpt_learning_curves.png')


def parsed(text: str, distribution):
  """A CSV cell as the value `distribution` holds (choices keep their type: False, 15.0, 'muon')."""
  if isinstance(distribution, optuna.distributions.CategoricalDistribution):
    return next(choice for choice in distribution.choices if str(choice) == text)
  if isinstance(distribution, optuna.distributions.IntDistribution):
    return int(float(text))
  return float(text)


def rebuilt_study(name: str, sweep_file: str) -> tuple[optuna.Study, str]:
  """The finished trials of measurements/<name>.csv as an Optuna study; and the sweep's metric."""
  sweep = runner.load_sweep(data_file(sweep_file))
  distributions = {key: studies.distribution(entry) for key, entry in sweep.space.items()}
  study = optuna.create_study(study_name=name, direction=sweep.direction)
  trials = []
  for row in read_csv(f'{name}.csv'):
    if row['status'] != 'ok' or not row.get(sweep.metric):
      continue
    params = {key: parsed(row[key], dist) for key, dist in distributions.items() if row.get(key, '') != ''}
    trials.append(optuna.trial.create_trial(params=params, distributions={k: distributions[k] for k in params},
                                            value=float(row[sweep.metric])))
  study.add_trials(trials)
  return study, sweep.metric


def study_figures(name: str, out_dir: str) -> None:
  """Optuna's optimization history and fANOVA importances of measurements/<name>.csv."""
  optuna.logging.set_verbosity(optuna.logging.WARNING)
  warnings.filterwarnings('ignore', category=optuna.exceptions.ExperimentalWarning)  # the matplotlib plots' label
  study, metric = rebuilt_study(name, STUDIES[name])
  with plt.rc_context():  # Optuna's plots switch matplotlib to its ggplot style: for these figures only
    axes = optuna.visualization.matplotlib.plot_optimization_history(study, target_name=metric)
    axes.set_title(f'{name}: optimization history ({len(study.trials)} finished trials)', fontsize=10)
    save(axes.figure, out_dir, f'{name}_history.png')
    axes = optuna.visualization.matplotlib.plot_param_importances(
        study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=0))
    axes.set_title(f'{name}: parameter importances for {metric} (fANOVA)', loc='left', fontsize=10)  # Optuna's
    save(axes.figure, out_dir, f'{name}_importance.png')


def token_cache_rss(out_dir: str) -> None:
  """Peak RSS of the first run and the restart against corpus size, per family."""
  rows = read_csv('token_cache_rss.csv')
  figure, axes = plt.subplots(figsize=(8, 4.6))
  families = list(dict.fromkeys(row['family'] for row in rows))
  for i, family in enumerate(families):
    color = 'tab:red' if 'before' in family else ('tab:blue', 'tab:orange', 'tab:green', 'tab:purple')[i % 4]
    for run, style in (('first run', '-o'), ('restart', '--s')):
      points = sorted((float(r['corpus_mb']), float(r['peak_rss_gb'])) for r in rows
                      if r['family'] == family and r['run'] == run)
      if points:
        machine = next(r['machine'] for r in rows if r['family'] == family).split(' 24')[0]
        axes.plot(*zip(*points), style, color=color, label=f'{family}, {run} ({machine})', markersize=5)
  axes.set_xscale('log')
  axes.set_yscale('log')
  axes.set_xlabel('corpus size (MB of text)')
  axes.set_ylabel('peak RSS (GB)')
  axes.set_title('Peak RSS against corpus size: first run (build + 2 steps) and restart (2 steps)', fontsize=10)
  axes.grid(True, which='both', alpha=0.3)
  axes.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.02, 1))
  save(figure, out_dir, 'token_cache_rss.png')


def dated_speed_lines() -> list[tuple[dict, dict]]:
  """(raw line, its provenance row) for the lines speed_raw_provenance.csv gives a machine."""
  with open(data_file('measurements/speed_raw.jsonl'), encoding='utf-8') as f:
    lines = [json.loads(line) for line in f if line.strip()]
  out = []
  for row in read_csv('speed_raw_provenance.csv'):
    if row['machine'] != 'not recorded':
      out += [(lines[n - 1], row) for n in range(int(row['first_line']), int(row['last_line']) + 1)]
  return out


def ratio_rows_from_raw() -> list[dict]:
  """Ours / reference per benchmark and round, as scripts/speed_table.py computes them."""
  rows = []
  for line, provenance in dated_speed_lines():
    ours, reference = line['ours'], line['reference']
    if line['name'] == 'decode':
      for batch in (1, 8):
        theirs = next(r['new_tokens_per_s'] for r in reference if r.get('batch') == batch)
        rows.append({'benchmark': f'GPT decode tokens/s batch {batch}', 'round': line['round'],
                     'ratio': ours['decode_tokens_per_s'][str(batch)] / theirs, 'provenance': provenance})
    else:
      label = {'gpt': 'GPT train tokens/s', 'bert': 'BERT train tokens/s',
               'transformer': 'Transformer seq2seq train target tokens/s'}[line['name']]
      rows.append({'benchmark': label, 'round': line['round'],
                   'ratio': ours['tokens_per_s'] / reference[-1]['tokens_per_s'], 'provenance': provenance})
  return rows


def speed_tables(out_dir: str) -> None:
  """Ours / the PyTorch reference per round, on the AMD EPYC (raw lines) and the Intel Xeon (its table)."""
  amd = ratio_rows_from_raw()
  xeon = [{'benchmark': r['benchmark'], 'round': int(r['round']), 'ratio': float(r['ours_over_reference']),
           'target': float(r['target'])} for r in read_csv('speed_xeon.csv')]
  targets = {r['benchmark']: r['target'] for r in xeon}
  benchmarks = list(targets)
  amd_dates = sorted({r['provenance']['date'] for r in amd})
  xeon_meta = read_csv('speed_xeon.csv')[0]
  machines = [(f"AMD EPYC, 2 cores ({', '.join(amd_dates)}; speed_raw.jsonl)", amd, 'tab:blue'),
              (f"Intel Xeon, 2 cores ({xeon_meta['date']}, {xeon_meta['recorded_at']})", xeon, 'tab:orange')]
  figure, axes = plt.subplots(figsize=(13, 5.2))
  width = 0.44  # each machine's share of a benchmark's slot: its rounds side by side
  for m, (label, rows, color) in enumerate(machines):
    for b, benchmark in enumerate(benchmarks):
      ratios = [r['ratio'] for r in sorted(rows, key=lambda r: r['round']) if r['benchmark'] == benchmark]
      step = width / max(len(ratios), 1)
      xs = [b + (m - 0.5) * width + (k + 0.5) * step - width / 2 for k in range(len(ratios))]
      bars = axes.bar(xs, ratios, step * 0.92, color=color, label=label if b == 0 else None)
      axes.bar_label(bars, [f'{ratio:.2f}' for ratio in ratios], fontsize=7, padding=2)
  for b, benchmark in enumerate(benchmarks):
    axes.plot([b - 0.47, b + 0.47], [targets[benchmark]] * 2, color='black', linestyle=':', linewidth=1,
              label='target' if b == 0 else None)
  axes.axhline(1.0, color='black', linewidth=0.8)
  axes.set_xticks(range(len(benchmarks)), [textwrap.fill(b, 18) for b in benchmarks], fontsize=8)
  axes.set_ylabel('ours / PyTorch reference (one bar per round)')
  axes.set_title('Speed against the PyTorch references (higher is better)', fontsize=10)
  axes.set_ylim(0, 5.3)
  axes.legend(fontsize=8, loc='upper left')
  save(figure, out_dir, 'speed_tables.png')


def transformer_attention(out_dir: str) -> None:
  """The main job's cross-attention on one test sentence, one heatmap per head, as the run draws it."""
  with open(data_file('measurements/transformer_attention.json'), encoding='utf-8') as f:
    record = json.load(f)
  panels = [[pictures.Panel(weights, record['target_tokens'], record['source_tokens'], f'head {h + 1}',
                            'English source', 'French translation, word by word')
             for h, weights in enumerate(record['heads'])]]
  figure = pictures.attention_figure(panels, textwrap.fill(
      f"The main job's cross-attention (decoder layer {record['decoder_layer']}, step {record['step']}): "
      f"\"{record['source']}\" -> \"{record['translation']}\" ({record['date']}, {record['recorded_at']}, "
      f"{record['machine']})", 110, break_on_hyphens=False))
  save(figure, out_dir, 'transformer_attention.png')


def gpt_moe_expert_load(out_dir: str) -> None:
  """Each MoE block's most and least loaded expert at every logged step of the latest measured run."""
  rows = read_csv('moe_expert_load.csv')
  latest = [row for row in rows if (row['date'], row['commit']) == (rows[-1]['date'], rows[-1]['commit'])]
  steps = sorted({int(row['step']) for row in latest})
  blocks = sorted({int(row['block']) for row in latest})
  load = {(int(row['step']), int(row['block'])): row for row in latest}
  grid = {kind: np.array([[float(load[step, block][kind]) for step in steps] for block in blocks])
          for kind in ('max_load', 'min_load')}
  first = latest[0]
  figure = pictures.expert_load_figure(steps, blocks, grid['max_load'], grid['min_load'], textwrap.fill(
      f"Expert load of {first['preset']} ({first['balancing']}; {first['date']}, {first['commit']}, "
      f"{first['machine']})", 90, break_on_hyphens=False))
  save(figure, out_dir, 'gpt_moe_expert_load.png')


FIGURES = (gpt_time_to_target, gpt_learning_curves, token_cache_rss, speed_tables, transformer_attention,
           gpt_moe_expert_load,
           *(functools.partial(study_figures, name) for name in STUDIES))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'figures'))
  parser.add_argument('--check', action='store_true',
                      help="draw nothing: list the figures in --out whose data changed since they were drawn")
  args = parser.parse_args()
  if args.check:
    stale = stale_figures(args.out)
    print('\n'.join(stale) or f'{args.out}: every figure is drawn from the current data')
    sys.exit(1 if stale else 0)
  os.makedirs(args.out, exist_ok=True)
  for draw in FIGURES:
    READ.clear()  # what the next figures are drawn from
    draw(args.out)


if __name__ == '__main__':
  main()
