"""Nadaraya-Watson kernel regression as attention pooling (D2L ch. 10.2), trained in seconds on CPU.

Command:
  python launch.py --config=configs/attention_pooling.py
200 full-batch Adam steps learn the kernel width w; the result is compared with the
non-parametric fit (w = 1) by the leave-one-out loss and the test MSE against the true function
2 sin(x) + x^0.8 (measurements/attention_pooling.csv; docs/families/before-the-transformer.md). The
run writes attention_pooling.png: truth, noisy training points, both fits, and both attention
matrices (test inputs x training inputs).

Data: 50 noisy training points drawn from `seed` (--config.seed=1 for another draw).
"""
from configs.base import base_config


def get_config(preset: str = 'default'):
  c = base_config('attention_pooling', preset, {'default': {}})
  c.model.initial_width = 0.0  # starting w; 0 = drawn from U(0, 1) as in D2L
  c.data.source = 'd2l_regression'  # generated from config.seed; no other source
  c.train.steps = 200
  c.train.batch_size = 50  # the whole training set in every step
  c.train.optimizer = 'adam'
  c.train.lr = 0.3
  c.train.schedule = 'constant'
  c.train.warmup_steps = 0
  c.train.weight_decay = 0.0
  c.train.grad_clip = 0.0
  c.train.eval_every = 50
  c.train.eval_steps = 0
  c.train.log_every = 20
  c.train.best_metric = 'eval/mse'
  return c
