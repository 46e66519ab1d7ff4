"""Nadaraya-Watson attention pooling on D2L's noisy 1-D regression task (ch. 10.2).

Data: 50 training inputs x ~ U(0, 5) (sorted), targets y = 2 sin(x) + x^0.8 + N(0, 0.5^2), all
drawn from `config.seed`; 50 test inputs 0, 0.1, ..., 4.9 with noise-free targets.

Training (the parametric model): every training point is a query attending to all the *other*
training points (its own key is masked out, otherwise w -> infinity would copy each target and
reach zero loss); the loss is squared error / 2. Evaluation: the test queries attend to all 50
training points and are scored against the true function. `evaluate` compares with the
non-parametric (w = 1) fit and saves a picture of both fits and both attention matrices.
"""
from __future__ import annotations

import os

import grain
import jax.numpy as jnp
import numpy as np

import storage
from errors import ConfigError, UserError
from models.attention_pooling import NadarayaWatson, NadarayaWatsonConfig
from train import task as task_lib
from train.losses import example_weights

NUM_TRAIN = 50
NOISE_STD = 0.5


def true_function(x: np.ndarray) -> np.ndarray:
  return 2 * np.sin(x) + x**0.8


def regression_data(seed: int, num_train: int = NUM_TRAIN) -> dict[str, np.ndarray]:
  """{'x_train', 'y_train' [num_train], 'x_test', 'y_test' [50]} float32; y_test is noise-free."""
  rng = np.random.default_rng(seed)
  x_train = np.sort(rng.uniform(0, 5, num_train))
  y_train = true_function(x_train) + rng.normal(0.0, NOISE_STD, num_train)
  x_test = np.arange(0, 5, 0.1)
  arrays = {'x_train': x_train, 'y_train': y_train, 'x_test': x_test, 'y_test': true_function(x_test)}
  return {k: v.astype(np.float32) for k, v in arrays.items()}


def examples(queries: np.ndarray, targets: np.ndarray, data: dict[str, np.ndarray], leave_one_out: bool):
  """One example per query: {'query' [1], 'target' [1], 'keys', 'values', 'key_valid' [K]}."""
  num_keys = len(data['x_train'])
  out = []
  for i, (query, target) in enumerate(zip(queries, targets)):
    key_valid = np.ones(num_keys, bool)
    if leave_one_out:
      key_valid[i] = False
    out.append({'query': np.array([query], np.float32), 'target': np.array([target], np.float32),
                'keys': data['x_train'], 'values': data['y_train'], 'key_valid': key_valid})
  return out


def squared_error(model, batch):
  """(mean loss, {'loss': (sum of (f(q) - y)^2 / 2, count), 'mse': ...})."""
  predictions, _ = model(batch['query'], batch['keys'], batch['values'], batch['key_valid'][:, None, :])
  error = jnp.square(predictions - batch['target'])
  weights = example_weights(batch, jnp.ones(error.shape))
  error = error * weights
  count = weights.sum()
  return error.sum() / 2 / count, {'loss': (error.sum() / 2, count), 'mse': (error.sum(), count)}


def validate(config):
  if config.train.z_loss:
    raise ConfigError(f'config.train.z_loss={config.train.z_loss}: attention pooling regresses with a squared error, '
                      f'which has no z-loss; leave train.z_loss at 0.')
  if config.data.source != 'd2l_regression':
    raise ConfigError(f"config.data.source={config.data.source!r}: attention_pooling generates its own data; "
                      f"leave it 'd2l_regression'.")
  if config.train.batch_size > NUM_TRAIN:
    raise ConfigError(f'config.train.batch_size={config.train.batch_size} exceeds the {NUM_TRAIN} training points.')


class Task(task_lib.Task):
  model_config_class = NadarayaWatsonConfig

  @property
  def data(self) -> dict[str, np.ndarray]:
    """The regression data; regenerated from the seed, so a reloaded run needs no files for it."""
    return regression_data(self.config.seed)

  @classmethod
  def prepare(cls, config, workdir, platform=None):
    data = regression_data(config.seed)
    train = examples(data['x_train'], data['y_train'], data, leave_one_out=True)
    test = examples(data['x_test'], data['y_test'], data, leave_one_out=False)
    datasets = task_lib.Datasets(train=grain.MapDataset.source(train), eval=grain.MapDataset.source(test))
    return task_lib.Prepared(None, cls.resolve_model_config(config, platform), datasets)

  def build_model(self, rngs):
    width = self.model_config.initial_width
    return NadarayaWatson(parametric=True, width=width if width > 0 else None, rngs=rngs)

  def loss(self, model, batch, *, deterministic):
    return squared_error(model, batch)

  def count_tokens(self, batch):
    return batch['query'].size, batch['query'].size  # one query point per example

  def example_batch(self, batch_size):
    data = regression_data(0)
    batch = examples(data['x_train'], data['y_train'], data, leave_one_out=True)
    batch = (batch * (batch_size // len(batch) + 1))[:batch_size]
    return {k: np.stack([b[k] for b in batch]) for k in batch[0]}

  def fits(self, model) -> dict[str, np.ndarray]:
    """Test-set predictions and [50 test, 50 train] attention weights of both models."""
    keys, values = jnp.asarray(self.data['x_train']), jnp.asarray(self.data['y_train'])
    queries = jnp.asarray(self.data['x_test'])
    out = {}
    for name, pooling in (('nonparametric', NadarayaWatson(parametric=False)), ('parametric', model)):
      prediction, weights = pooling(queries, keys, values)
      out[name], out[f'{name}_weights'] = np.asarray(prediction), np.asarray(weights)
    return out

  def evaluate(self, model, workdir):
    fits = self.fits(model)
    mse = {name: float(np.mean((fits[name] - self.data['y_test'])**2)) for name in ('nonparametric', 'parametric')}
    path = os.path.join(workdir, 'attention_pooling.png')
    self.plot(fits, path)
    width = float(np.asarray(model.width[...])[0])
    print(f'Learned kernel width w = {width:.3f}. Test MSE against the true function: '
          f'non-parametric {mse["nonparametric"]:.4f}, parametric {mse["parametric"]:.4f}. Picture: {path}',
          flush=True)
    return {'width': width, 'test/mse_nonparametric': mse['nonparametric'],
            'test/mse_parametric': mse['parametric'], 'images': {'attention_pooling': path}}

  def plot(self, fits: dict[str, np.ndarray], path: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    d = self.data
    axes[0].plot(d['x_test'], d['y_test'], 'k-', label='truth')
    axes[0].plot(d['x_train'], d['y_train'], 'o', color='tab:gray', alpha=0.6, label='noisy training data')
    axes[0].plot(d['x_test'], fits['nonparametric'], '--', label='non-parametric (w = 1)')
    axes[0].plot(d['x_test'], fits['parametric'], '-', label='parametric (learned w)')
    axes[0].set_xlabel('x')
    axes[0].legend()
    for ax, name in zip(axes[1:], ('nonparametric', 'parametric')):
      image = ax.imshow(fits[f'{name}_weights'], cmap='Reds', aspect='auto')
      ax.set_title(f'{name} attention weights')
      ax.set_xlabel('training inputs (sorted keys)')
      ax.set_ylabel('test inputs (queries)')
      figure.colorbar(image, ax=ax)
    figure.tight_layout()
    storage.save_png(figure, path, dpi=100)
    plt.close(figure)

  def predict(self, model, lines, workdir):
    """One x per line -> the parametric fit f(x) from the training points."""
    try:
      queries = jnp.asarray([float(line) for line in lines], jnp.float32)
    except ValueError as e:
      raise UserError(f'attention_pooling predicts from numbers, one x per line: {e}') from e
    prediction, _ = model(queries, jnp.asarray(self.data['x_train']), jnp.asarray(self.data['y_train']))
    return [float(p) for p in np.asarray(prediction)]
