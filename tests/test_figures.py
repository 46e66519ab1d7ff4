"""The documentation's figures (scripts/make_figures.py, docs/figures/): drawn from the committed
measurements only, each no older than the data it was drawn from (the digests its PNG records), every
bar chart's value axis from zero, and no two labels drawn over each other."""
import os
import shutil

import matplotlib.figure
import matplotlib.text
from matplotlib.container import BarContainer
from matplotlib.transforms import Bbox

import support

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = os.path.join(ROOT, 'docs', 'figures')


def figures_module():
  return support.load_file('scripts/make_figures.py')


def shown_ticks(axis) -> list[matplotlib.text.Text]:
  """The major tick labels of `axis` inside its view (the locator also places some beyond it, undrawn)."""
  low, high = sorted(axis.get_view_interval())
  return [tick.label1 for tick in axis.get_major_ticks() if low <= tick.get_loc() <= high]


def overlapping_labels(figure) -> list[tuple[str, str]]:
  """Pairs of texts of `figure` (tick labels, axis labels, value labels, legends, the title) whose boxes
  overlap by more than a pixel each way."""
  figure.canvas.draw()
  renderer = figure.canvas.get_renderer()
  texts = list(figure.texts)
  for axes in figure.axes:
    texts += shown_ticks(axes.xaxis) + shown_ticks(axes.yaxis) + [axes.xaxis.label, axes.yaxis.label] + axes.texts
    texts += axes.get_legend().get_texts() if axes.get_legend() else []
  boxes = [(text.get_text(), text.get_window_extent(renderer)) for text in texts
           if text.get_visible() and text.get_text().strip()]
  overlaps = []
  for i, (first, a) in enumerate(boxes):
    for second, b in boxes[i + 1:]:
      both = Bbox.intersection(a, b)
      if both is not None and both.width > 1 and both.height > 1:
        overlaps.append((first, second))
  return overlaps


def bars_not_from_zero(figure) -> list[str]:
  """The axes of `figure` holding bars whose value axis does not start at 0."""
  wrong = []
  for axes in figure.axes:
    for bars in axes.containers:
      if isinstance(bars, BarContainer):
        low = min(axes.get_ylim() if bars.orientation == 'vertical' else axes.get_xlim())
        if low != 0:
          wrong.append(f'{axes.get_title() or axes.get_title(loc="left")!r}: from {low:.3g}')
  return wrong


def test_the_figures_are_drawn_from_the_committed_measurements_with_bars_from_zero_and_no_overlaps(
    tmp_path, monkeypatch):
  module = figures_module()
  drawn_save, problems = module.save, {}

  def checked_save(figure, out_dir, name):
    problems[name] = bars_not_from_zero(figure) + [f'{a!r} over {b!r}' for a, b in overlapping_labels(figure)]
    drawn_save(figure, out_dir, name)

  monkeypatch.setattr(module, 'save', checked_save)
  monkeypatch.setattr('sys.argv', ['make_figures.py', f'--out={tmp_path}'])
  module.main()
  drawn = sorted(path.name for path in tmp_path.iterdir())
  assert drawn == sorted(os.listdir(FIGURES))
  assert all((tmp_path / name).stat().st_size > 10_000 for name in drawn)
  assert {name: found for name, found in problems.items() if found} == {}
  assert module.stale_figures(str(tmp_path)) == []


def test_each_committed_figure_is_drawn_from_the_data_as_it_is_now(tmp_path):
  """Each PNG in docs/figures/ records the SHA-256 of every file it was drawn from, and they are the
  files' now: a measurement changed after its figure was drawn is caught (a planted change, below)."""
  module = figures_module()
  assert module.stale_figures(FIGURES) == []
  figures, data = tmp_path / 'docs' / 'figures', tmp_path / 'measurements'
  figures.mkdir(parents=True)
  data.mkdir()
  shutil.copy(os.path.join(FIGURES, 'gpt_learning_curves.png'), figures)
  shutil.copy(os.path.join(ROOT, 'measurements', 'gpt_learning_curves.csv'), data)
  assert module.stale_figures(str(figures), str(tmp_path)) == []
  with open(data / 'gpt_learning_curves.csv', 'a', encoding='utf-8') as f:
    f.write('2026-11-29,0000000,a later round\n')
  assert module.stale_figures(str(figures), str(tmp_path)) == [
      'gpt_learning_curves.png: measurements/gpt_learning_curves.csv changed since it was drawn']
  (data / 'gpt_learning_curves.csv').unlink()
  assert module.stale_figures(str(figures), str(tmp_path)) == [
      'gpt_learning_curves.png: drawn from measurements/gpt_learning_curves.csv, which is gone']
  matplotlib.figure.Figure().savefig(figures / 'drawn_by_hand.png')  # a PNG not made by make_figures
  assert module.stale_figures(str(figures), str(tmp_path))[0] == (
      'drawn_by_hand.png: no record of the data it was drawn from')
