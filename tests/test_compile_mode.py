"""Compile mode (`--mode=compile`): it compiles the very step `--mode=bench` compiles and reads it
right; the targets resolve for their platform; mistakes end in one line. Only the H100 test needs
the optional packages of requirements-aot.txt (skipped without them)."""
import importlib.util
import os

import pytest

import support
from errors import UserError
from train import hlo, targets

# One block: the compiled step is compared kernel by kernel and buffer by buffer, which one block
# checks as well as two, at about half the compile time of each of the three compilations.
TINY_GPT = {'train.batch_size': 16, 'train.grad_accum': 2, 'model.num_layers': 1}
MB = 2**20


def test_compile_mode_describes_the_step_bench_compiles(tmp_path, monkeypatch):
  """From one host device the launcher gives JAX the 8 that cpu-8 needs, compiles, prints one JSON
  line and writes the HLO into the workdir (nothing else); bench's own compiled step, on the 8 devices
  of this process, has the same kernels and buffers."""
  from configs import gpt
  from train import bench
  from train.bench import run_benchmark
  # The ceiling probe's size is not what this test checks (only MFU's arithmetic on it): a small one.
  probe = bench.matmul_tflops
  monkeypatch.setattr(bench, 'matmul_tflops', lambda dtype: probe(dtype, size=256))
  workdir = tmp_path / 'compiled'
  result = support.launch(['--config=configs/gpt.py:tiny', *support.override_args(TINY_GPT), '--mode=compile',
                           '--compile_target=cpu-8', f'--workdir={workdir}'], devices=1)
  assert result.returncode == 0, result.stderr[-3000:]
  out = support.last_json(result.stdout)
  timed = run_benchmark(support.with_overrides(gpt.get_config('tiny'), TINY_GPT), steps=1, decode=False)
  assert out['attention_kernel'] == timed['attention_kernel'] == 'xla (einsum + softmax)'
  assert {k: out[k] for k in timed['hlo']} == timed['hlo'] and out['fusions'] > 0
  # Data parallel over 8 devices: the gradients' all-reduce, at least every float32 parameter once.
  assert out['collective_bytes']['all-reduce'] >= 4 * out['params']
  xla = timed['memory']['xla_mb']
  assert [round(out[f'{k}_bytes'] / MB, 1) for k in ('temp', 'argument', 'output', 'alias')] == \
      [xla['temp'], xla['argument'], xla['output'], xla['alias']]
  assert (out['target'], out['devices'], out['mesh']) == ('cpu-8', 8, {'data': 8, 'fsdp': 1, 'expert': 1, 'tensor': 1})
  assert (out['params'], out['attention'], out['rng_impl']) == (timed['params'], 'xla', 'threefry')
  # 8 CPU devices of one process share its cores: the machine's ceiling is one device's matmul.
  assert timed['parallel_devices'] == 1 and timed['mfu'] == pytest.approx(timed['achieved_tflops'] /
                                                                            timed['matmul_tflops'], rel=0.01)
  assert out['per_device_total_bytes'] == out['temp_bytes'] + out['argument_bytes'] + out['output_bytes'] - \
      out['alias_bytes']
  assert out['fits'] and out['compile_s'] > 0 and out['init_compile_s'] > 0
  assert set(out['decode']) == {'1', '8'} and all(d['temp_bytes'] > 0 for d in out['decode'].values())
  assert os.listdir(workdir) == ['train_step.hlo.txt'] and out['hlo_path'] == str(workdir / 'train_step.hlo.txt')
  assert hlo.summary((workdir / 'train_step.hlo.txt').read_text())['fusions'] == out['fusions']


def test_a_mesh_the_target_lacks_is_one_line_and_leaves_nothing(tmp_path):
  workdir = tmp_path / 'never'
  result = support.launch(['--config=configs/gpt.py:tiny', '--mode=compile', '--compile_target=cpu-8',
                           '--config.mesh.data=3', f'--workdir={workdir}'], devices=1)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [result.stderr.strip()]
  assert result.stderr.startswith('error: config.mesh does not fit --compile_target=cpu-8 (8 x cpu)')
  assert not workdir.exists()


def test_a_missing_plugin_names_what_to_install(monkeypatch):
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name: None)
  for target, package in (('h100x8', 'jax-cuda12-plugin and nvidia-cudnn-cu12'), ('v5e-8', 'libtpu')):
    with pytest.raises(UserError) as error:
      targets.resolve(target)
    message = str(error.value)
    assert '\n' not in message and package in message
    assert 'requirements-aot.txt' in message and 'JAX_PLATFORMS=cpu' in message


def test_auto_choices_resolve_for_the_platform_compiled_for():
  from configs import gpt
  from train.bench import bench_task
  from train.state import resolve_rng_impl
  config = support.with_overrides(gpt.get_config('tiny'), {'model.dtype': 'bfloat16'})
  assert [bench_task(config, p).model_config.attention for p in ('cpu', 'gpu', 'tpu')] == ['xla', 'cudnn', 'splash']
  assert [resolve_rng_impl('auto', p) for p in ('cpu', 'gpu', 'tpu')] == ['threefry', 'rbg', 'rbg']


def test_tpu_slice_names_become_libtpu_topologies():
  topology = lambda name: targets.tpu_topology(name, *name.split('-')[:1], int(name.split('-')[1]))
  assert [topology(n) for n in ('v5e-8', 'v5e-16', 'v5p-16', 'v4-32', 'v4-128')] == \
      ['v5e:2x4', 'v5e:4x4', 'v5p:2x2x2', 'v4:2x2x4', 'v4:4x4x4']
  with pytest.raises(UserError, match='power of two'):
    topology('v5e-6')


def test_hlo_counts_read_tuple_types_and_kernel_names():
  text = '\n'.join([
      'ENTRY %main.1 (p0: f32[8,4]) -> f32[8,4] {',
      '  %fusion.1 = (f32[2]{0}, /*index=1*/f32[3]{0}) fusion(f32[8,4]{1,0} %p0), kind=kLoop, calls=%fc.1',
      '  %fusion.2 = f32[2]{0} fusion(f32[8,4]{1,0} %p0), kind=kInput, calls=%fc.2',
      '  %scatter.3 = f32[8,4]{1,0} scatter(%p0, %i, %u), update_window_dims={1}, to_apply=%add',
      '  %custom-call.4 = (bf16[2,8,4]{2,1,0}, u8[0]{0}) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax"',
      '  %custom-call.5 = (bf16[2,8,4]{2,1,0}) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmaxBackward"',
      '  %splash_mha_fwd_residuals.1 = (f32[8]{0}) custom-call(%a), custom_call_target="tpu_custom_call"',
      '  %splash_mha_dq_no_residuals.1 = (f32[8]{0}) custom-call(%a), custom_call_target="tpu_custom_call"',
      '  %splash_mha_dkv_no_residuals.1 = f32[8]{0} custom-call(%a), custom_call_target="tpu_custom_call"',
      '  %splash_mqa_fwd_residuals.2 = (f32[8]{0}) custom-call(%a), custom_call_target="tpu_custom_call"',
      '  ROOT %splash_mqa_dq_no_residuals.2 = f32[8]{0} custom-call(%a), custom_call_target="tpu_custom_call"',
      '}'])
  counts = hlo.summary(text)
  assert counts.pop('collective_bytes') == {kind: 0 for kind in hlo.KINDS}
  assert counts == {'fusions': 2, 'scatters': 1, 'fmha_calls': {'forward': 1, 'backward': 1},
                    'splash_calls': {'forward': 2, 'backward': 3}}


@pytest.mark.skipif(bool(targets.missing_packages('gpu')),
                    reason='the H100 target needs jax-cuda12-plugin and cuDNN (pip install -r requirements-aot.txt)')
def test_h100_target_compiles_cudnn_attention_and_rbg(tmp_path):
  """In a requirements-aot.txt environment: 'auto' resolves for the GPU, not for this CPU."""
  from configs import gpt
  from train import aot
  config = support.with_overrides(gpt.get_config('tiny'), {'model.dtype': 'bfloat16'})
  out = aot.compile_for_target(config, 'h100', str(tmp_path))
  assert (out['device_kind'], out['attention'], out['rng_impl']) == ('NVIDIA H100 80GB HBM3', 'cudnn', 'rbg')
  assert out['attention_kernel'] == 'cudnn fused attention'
  assert out['fmha_calls'] == {'forward': 2, 'backward': 2}  # one per layer each way
  assert out['fits'] and out['device_memory_bytes'] == targets.GPUS['h100'][0]
  assert {d['attention_kernel'] for d in out['decode'].values()} == {'cudnn fused attention'}
