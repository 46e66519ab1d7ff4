"""A bfloat16 model's train step multiplies no float32 matrices: `train.hlo.float32_dots` counts the
matmuls with float32 operands, and every family's lowered step (the program before XLA's CPU passes,
which upcast bfloat16 dots to float32 here) has none with model.dtype='bfloat16', Muon's included
when its Newton-Schulz runs in bfloat16 as on accelerators. The cross-entropy's float32 sums are
not matmuls. And bfloat16 is what the presets compute in on accelerators (model.dtype='auto')."""
import importlib
import os

import jax
import jax.numpy as jnp
import pytest

import support
from train import bench, hlo


def lowered_train_step(config):
  """`config`'s train step as --mode=bench and --mode=compile build it, lowered on abstract arrays (not compiled)."""
  return bench.lower_train_step(config, platform='cpu')


def test_the_count_reads_operand_types_in_lowered_and_compiled_text():
  def matmuls(x, y, image, kernel):
    float32 = x @ x
    with jax.default_matmul_precision('BF16_BF16_F32'):  # float32 arrays, bfloat16 operands
      rounded = float32 @ float32
    summed_in_float32 = jnp.einsum('ij,jk->ik', y, y, preferred_element_type=jnp.float32)
    return rounded, y @ y, summed_in_float32, jax.lax.conv(image, kernel, (1, 1), 'SAME')

  lowered = jax.jit(matmuls).lower(jnp.ones((4, 4)), jnp.ones((4, 4), jnp.bfloat16), jnp.ones((1, 2, 5, 5)),
                                   jnp.ones((3, 2, 3, 3)))
  assert hlo.float32_dots(lowered.as_text(dialect='hlo')) == 2  # x @ x and the convolution
  # XLA:CPU computes the bfloat16 products in float32: the compiled program holds more.
  assert hlo.float32_dots(lowered.compile().as_text()) > 2
  # Operand types written beside their names, as older XLA versions print them.
  text = '\n'.join(['ENTRY %main (p: f32[4,4], q: bf16[4,4]) -> f32[4,4] {',
                    '  %p = f32[4,4]{1,0} parameter(0)', '  %q = bf16[4,4]{1,0} parameter(1)',
                    '  %dot.1 = f32[4,4]{1,0} dot(f32[4,4]{1,0} %p, f32[4,4]{1,0} %p), lhs_contracting_dims={1}',
                    '  %dot.2 = f32[4,4]{1,0} dot(bf16[4,4]{1,0} %q, bf16[4,4]{1,0} %q), lhs_contracting_dims={1}',
                    '  ROOT %dot.3 = f32[4,4]{1,0} dot(%p, %p), algorithm=dot_bf16_bf16_f32', '}'])
  assert hlo.float32_dots(text) == 1


# One block (every preset's blocks are alike): lowering time grows with the depth, the operand types do not.
ONE_BLOCK = {'model.num_layers': 1}


@pytest.mark.parametrize('family, preset, overrides', [
    ('gpt', 'tiny', ONE_BLOCK),
    ('gpt', 'default', {'train.muon_ns_dtype': 'bfloat16', **ONE_BLOCK}),  # Muon, QK-norm, ReLU^2, soft-capped logits
    ('gpt', 'llama', ONE_BLOCK),
    ('bert', 'tiny', ONE_BLOCK),
    ('transformer', 'tiny', {}),
    ('classifier', 'tiny', {}),
    ('rnn_lm', 'tiny', {}),
    ('seq2seq', 'tiny', {}),
], ids=lambda value: value if isinstance(value, str) else '')
def test_a_bfloat16_train_step_lowers_without_float32_matmuls(family, preset, overrides):
  config = support.with_overrides(importlib.import_module(f'configs.{family}').get_config(preset),
                                  {'model.dtype': 'bfloat16', **overrides})
  assert hlo.float32_dots(lowered_train_step(config).as_text(dialect='hlo')) == 0


def test_float32_newton_schulz_is_counted():
  """Muon's float32 Newton-Schulz (this CPU's 'auto'): 3 matmuls per shape of the 4-layer GPT's matrices."""
  from configs import gpt
  config = support.with_overrides(gpt.get_config('default'), {'model.dtype': 'bfloat16'})
  assert hlo.float32_dots(lowered_train_step(config).as_text(dialect='hlo')) == 3 * 3


def test_a_step_lowered_for_an_accelerator_resolves_muon_for_it():
  """The 'auto' settings resolved for the target, the optimizer's too: on GPU the preset's model
  (model.dtype='auto') and Muon's Newton-Schulz ('auto') compute in bfloat16, whatever this host is."""
  from configs import gpt
  config = support.with_overrides(gpt.get_config('default'), {'model.attention': 'xla'})  # cuDNN's lowers on GPU only
  assert (config.model.dtype, config.train.optimizer, config.train.muon_ns_dtype) == ('auto', 'muon', 'auto')
  assert hlo.float32_dots(bench.lower_train_step(config, platform='gpu').as_text(dialect='hlo')) == 0


FAMILIES_WITH_DTYPE = ('gpt', 'bert', 'transformer', 'classifier', 'rnn_lm', 'seq2seq')


def test_every_preset_computes_in_bfloat16_on_accelerators_and_float32_here():
  """model.dtype='auto' in every preset of the families with a compute dtype, resolved where the task
  resolves its model config (so model.json records the dtype it ran): bfloat16 on GPU and TPU (with
  cuDNN attention on GPU), float32 on this CPU, where runs, tests and fixtures keep their numbers."""
  for family in FAMILIES_WITH_DTYPE:
    module = importlib.import_module(f'configs.{family}')
    assert {preset: module.get_config(preset).model.dtype for preset in module.PRESETS} == \
        dict.fromkeys(module.PRESETS, 'auto'), family
  from configs import gpt
  resolved = [bench.bench_task(gpt.get_config('tiny'), platform).model_config for platform in ('cpu', 'gpu', 'tpu')]
  assert [(c.dtype, c.attention) for c in resolved] == [('float32', 'xla'), ('bfloat16', 'cudnn'),
                                                        ('bfloat16', 'splash')]
  assert bench.bench_task(gpt.get_config('tiny')).model_config.dtype == 'float32'  # this process: CPU


def test_a_reloaded_run_resolves_an_auto_dtype_override(tmp_path):
  import shutil

  from train.rundir import run_config
  workdir = tmp_path / 'gpt_tiny'
  shutil.copytree(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'legacy_runs', 'gpt_tiny'),
                  workdir)
  assert run_config(str(workdir), {'model.dtype': 'auto'})[1].dtype == 'float32'
  assert run_config(str(workdir), {'model.dtype': 'bfloat16'})[1].dtype == 'bfloat16'
