"""Benchmark mode and the memory estimate: the JSON line's fields are present and consistent (no
timing is asserted), every family's bench preset has the reference benchmark's shapes, and the
estimate counts sharded parameters exactly and warns before an obvious OOM."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import support
from train import memory
from train.bench import datasheet_tflops

FIELDS = ('model', 'params', 'batch', 'seq_len', 'tokens_per_s', 'step_ms', 'compile_s', 'model_flops_per_token',
          'achieved_tflops', 'mfu', 'decode_tokens_per_s', 'peak_rss_mb', 'attention_kernel',
          'attention_dropout_forces_einsum')


def test_bench_mode_ends_with_one_sane_json_line(monkeypatch, capsys):
  # What --mode=bench prints (launch.py's bench_mode: run_benchmark's dict as one JSON line), run in this process:
  # the command line's parsing is tests/test_launch.py's, and .ci/run runs the bench preset's shown command.
  # One block (compile time grows with depth; the counts below are per block, so one still checks them),
  # one timed step (after bench's 2 warm-up steps). The ceiling probe's size is not what this test checks (only
  # MFU's arithmetic on it): a small one, not CPU's 2048^2 matmuls (~8 s of CPU for the probe's twelve).
  import launch
  from configs import gpt
  from train import bench
  probe = bench.matmul_tflops
  monkeypatch.setattr(bench, 'matmul_tflops', lambda dtype: probe(dtype, size=256))
  config = support.with_overrides(gpt.get_config('tiny'), {'model.num_layers': 1, 'decode.max_new_tokens': 8})
  launch.print_line(bench.run_benchmark(config, steps=1))
  out = support.last_json(capsys.readouterr().out)
  assert all(field in out for field in FIELDS)
  assert out['model'] == 'gpt:tiny' and (out['batch'], out['seq_len']) == (8, 32)
  # 1 layer of width 32 (12 E^2 + 13 E), embeddings 8192 x 32 (vocab = data.vocab_size) + 64 x 32, final LN
  assert out['params'] == 1 * (12 * 32**2 + 13 * 32) + 8192 * 32 + 64 * 32 + 2 * 32
  c = dict(layers=1, width=32, vocab=8192, seq=32)
  assert out['model_flops_per_token'] == 6 * (c['layers'] * 12 * c['width']**2 + c['width'] * c['vocab']) + \
      12 * c['layers'] * c['seq'] * c['width']
  assert out['tokens_per_s'] == pytest.approx(8 * 32 / (out['step_ms'] / 1000), rel=0.01)
  assert out['real_tokens_per_s'] == pytest.approx(out['tokens_per_s'], rel=0.01)  # LM windows hold no padding
  assert out['achieved_tflops'] == pytest.approx(out['tokens_per_s'] * out['model_flops_per_token'] / 1e12, rel=0.01)
  assert out['parallel_devices'] == 1  # one CPU process
  assert out['mfu'] == pytest.approx(out['achieved_tflops'] / out['matmul_tflops'], rel=0.01)
  assert out['compile_s'] > 0 and out['peak_rss_mb'] > 50 and np.isfinite(out['final_loss'])
  assert set(out['decode_tokens_per_s']) == {'1', '8'} and all(v > 0 for v in out['decode_tokens_per_s'].values())
  xla, estimate = out['memory']['xla_mb'], out['memory']['estimate_mb']
  assert estimate['params'] + estimate['optimizer'] == pytest.approx(xla['argument'], rel=0.05)
  assert 0.5 < (estimate['gradients'] + estimate['activations']) / xla['temp'] < 2.0


@pytest.mark.parametrize('preset, expected', [
    ('configs/gpt.py:bench', dict(num_layers=6, width=384, num_heads=6, batch_size=8, seq_len=256, vocab_size=8192)),
    ('configs/bert.py:bench', dict(num_layers=6, width=384, num_heads=6, mlp_dim=1536, batch_size=16, seq_len=128,
                                   vocab_size=8192)),
    ('configs/transformer.py:bench', dict(encoder_layers=3, decoder_layers=3, width=256, num_heads=4, mlp_dim=1024,
                                          batch_size=32, seq_len=64, vocab_size=8000)),
])
def test_bench_presets_have_the_reference_shapes(preset, expected):
  import importlib
  path, name = preset.split(':')
  config = importlib.import_module(path[:-3].replace('/', '.')).get_config(name)
  flat = {**config.model, 'batch_size': config.train.batch_size, 'seq_len': config.data.seq_len,
          'vocab_size': config.data.vocab_size}
  assert {k: flat[k] for k in expected} == expected
  assert config.model.dropout == 0.0 and config.model.dtype == 'auto' and config.train.grad_clip == 0.0  # CPU: float32
  assert config.train.optimizer == 'adamw'


def test_memory_estimate_counts_shards_exactly_and_warns(monkeypatch, capsys):
  from configs import gpt, rnn_lm
  from train.state import TrainState
  from train.task import task_class
  mesh = jax.make_mesh((1, 8, 1), ('data', 'fsdp', 'tensor'))
  params = {'kernel': jax.ShapeDtypeStruct((64, 256), jnp.float32), 'bias': jax.ShapeDtypeStruct((256,), jnp.float32)}
  shardings = {'kernel': NamedSharding(mesh, P(None, 'fsdp')), 'bias': NamedSharding(mesh, P())}
  state = TrainState(params=params, extra={}, opt_state=(params, params), step=jax.ShapeDtypeStruct((), jnp.int32))
  state_sharding = TrainState(params=shardings, extra={}, opt_state=(shardings, shardings),
                              step=NamedSharding(mesh, P()))
  config = gpt.get_config('bench')
  config.mesh.update({'data': 1, 'fsdp': 8})
  model_config = task_class(config.family).resolve_model_config(config, None, vocab_size=8192)
  estimate = memory.estimate(config, model_config, state, state_sharding, mesh)
  assert estimate.params == (64 * 256 // 8 + 256) * 4 and estimate.optimizer == 2 * estimate.params
  # batch 8 over 8 devices = 1 sequence of 256 tokens: 6 layers x (9E + 2F + 2HS) + 2V logits, float32
  per_token = 6 * (9 * 384 + 2 * 1536 + 2 * 6 * 256) + 2 * 8192
  assert estimate.activations == 256 * per_token * 4
  full = dataclasses.replace(model_config, remat='full')
  one_block = 9 * 384 + 2 * 1536 + 2 * 6 * 256  # live again during its backward pass
  assert memory.activation_bytes(config, full, mesh) == 256 * (6 * 384 + one_block + 2 * 8192) * 4
  # The model's own MLP width: SwiGLU's mlp_hidden, not mlp_ratio * width.
  llama = dataclasses.replace(model_config, mlp='swiglu', mlp_hidden=1024)
  assert memory.activation_bytes(config, llama, mesh) == 256 * (6 * (9 * 384 + 2 * 1024 + 2 * 6 * 256) + 2 * 8192) * 4
  rnn = rnn_lm.get_config('tiny')
  assert memory.activation_bytes(config, task_class(rnn.family).resolve_model_config(rnn, None, vocab_size=9),
                                 mesh) is None
  monkeypatch.setattr(memory, 'available_bytes', lambda: 2**20)
  memory.log_estimate(config, full, state, state_sharding, mesh)
  printed = capsys.readouterr().out
  assert 'Memory per device (estimate): parameters' in printed and 'WARNING' in printed and 'train.grad_accum' in printed


def test_datasheet_peaks_by_device_kind():
  assert datasheet_tflops('TPU v4', 'bfloat16') == 275.0 and datasheet_tflops('TPU v5 lite', 'float32') == 197.0
  assert datasheet_tflops('NVIDIA H100 80GB HBM3', 'float32') == 494.7 and datasheet_tflops('cpu', 'float32') is None


@pytest.mark.parametrize('family', support.registered_families())
def test_bench_task_builds_the_model_training_builds(family):
  """The bench binds a stand-in tokenizer through the same Task.bind seam as training: BERT's bench
  model has its pretraining heads, and the loss runs on the synthetic batch."""
  from flax import nnx
  from train.bench import bench_task
  config = support.smallest_config(family)
  task = bench_task(config)
  # The token vocabularies the stand-in tokenizer sized (seq2seq: source and target; attention pooling: none),
  # not BERT's two segment ids (type_vocab_size).
  vocabularies = {name: value for name, value in dataclasses.asdict(task.model_config).items()
                  if name.endswith('vocab_size') and name != 'type_vocab_size'}
  assert set(vocabularies.values()) <= {config.data.vocab_size}, vocabularies
  # One jitted program builds the model and takes its loss: eagerly, every op of the initialiser and
  # the loss compiles on its own (~100 of them); two programs would compile the model twice.
  batch = {k: jnp.asarray(v) for k, v in task.example_batch(config.train.batch_size).items()}
  loss, metrics = jax.jit(lambda batch: task.loss(task.build_model(nnx.Rngs(0)), batch, deterministic=True))(batch)
  assert np.isfinite(float(loss)) and 'loss' in metrics
  if family == 'bert':
    assert task.model_config.heads == 'pretraining' and 'mlm_loss' in metrics
