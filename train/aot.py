"""Compile mode: compile a config's real steps for devices this process need not have, and read them.

  python launch.py --config=configs/gpt.py:gpt2 --mode=compile --compile_target=h100

The train step is the one `--mode=bench` times and training runs (`train.state` state and shardings,
the task's loss, the optimizer, gradient accumulation, `steps.jit_train_step`), lowered on abstract
arrays placed on the target's devices (`train.targets`) and compiled by the target's compiler; for
the generative families the greedy decoding the benchmark times is compiled too. Nothing runs,
so nothing is timed. 'auto' attention, the PRNG and Pallas's interpret flag resolve for the
target's platform. The compiled train step's HLO text is written to `<workdir>/train_step.hlo.txt`
(the only file this mode writes). One JSON line:

  target, devices, device_kind, mesh     what it was compiled for ({axis: size})
  model, params, batch, seq_len, dtype, attention (resolved), rng_impl
  attention_kernel                       the attention the compiled step runs (as in bench)
  fmha_calls, splash_calls, scatters, fusions   counts in the compiled step (`train.hlo.summary`)
  f32_dots, f32_dots_lowered             matmuls (dots, convolutions) with float32 operands in the compiled
                                         step and in the step as lowered, before the compiler's passes
                                         (`train.hlo.float32_dots`); 0 expected for a bfloat16 step
                                         compiled for a GPU (XLA:CPU upcasts bfloat16 dots, so on CPU
                                         read f32_dots_lowered). Muon's Newton-Schulz counts where it
                                         runs in float32 (`train.muon_ns_dtype`, float32 on CPU)
  collective_bytes                       {kind: bytes per device per step} of its collectives (`train.hlo`)
  temp_bytes, argument_bytes, output_bytes, alias_bytes   XLA's buffer sizes per device
  per_device_total_bytes                 temp + argument + output - alias (donated state counted once)
  device_memory_bytes, fits              the target's memory per device; per_device_total_bytes <= it
  estimate_bytes                         `train.memory`'s estimate per device, for comparison
  compile_s, init_compile_s              lowering + compiling the train step / the sharded initialiser
  decode                                 generative families: {batch: {compile_s, temp_bytes, argument_bytes,
                                         output_bytes, attention_kernel}} of greedy decoding, else null
  hlo_path                               the train step's HLO text
"""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import storage
from errors import ConfigError
from train import bench, hlo, memory, sharding, targets
from train import state as state_lib
from train.optim import make_optimizer
from train.steps import jit_train_step
from train.validation import validate_config

HLO_FILE = 'train_step.hlo.txt'


def compile_for_target(config, target_name: str, workdir: str) -> dict:
  """Compile `config`'s steps for `target_name` (train.targets) and describe them (module docstring);
  `workdir` receives the HLO text, and is created only once everything compiled."""
  config = config.copy_and_resolve_references()
  target = targets.resolve(target_name)
  _check_mesh_fits(config, target)
  validate_config(config, num_devices=len(target.devices))
  task = bench.bench_task(config, target.platform)
  mesh = sharding.make_mesh(config.mesh, devices=list(target.devices))
  tx, _ = make_optimizer(config.train, target.platform)
  spec = state_lib.state_spec(task.build_model, mesh, state_lib.resolve_rng_impl(config.rng_impl, target.platform),
                              tx)
  with sharding.use_mesh(mesh):
    lowered, train_step, compile_s = _compiled(jit_train_step(task, spec, tx, config.train.grad_accum),
                                               _abstract_state(spec), _abstract_batch(task, config, mesh))
    _, _, init_compile_s = _compiled(state_lib.jit_initialiser(spec, task.build_model, tx, config.seed))
    decode = _compile_decoding(config, task, spec)
  hlo_text = train_step.as_text()
  sizes = _buffer_sizes(train_step)
  estimate = memory.estimate(config, task.model_config, spec.abstract, spec.shardings, mesh,
                             available=target.memory_per_device)
  storage.path(workdir).mkdir(parents=True, exist_ok=True)
  hlo_path = os.path.join(workdir, HLO_FILE)
  storage.write_atomically(hlo_path, hlo_text)
  return {
      'target': target.name, 'devices': len(target.devices), 'device_kind': target.devices[0].device_kind,
      'mesh': dict(mesh.shape), 'model': f'{config.family}:{config.preset}',
      'params': int(sum(np.prod(x.shape) for x in jax.tree.leaves(spec.abstract.params))),
      'batch': config.train.batch_size, 'seq_len': config.data.seq_len,
      'dtype': getattr(task.model_config, 'dtype', 'float32'),
      'attention': getattr(task.model_config, 'attention', None), 'rng_impl': spec.rng_impl,
      'attention_kernel': bench.attention_kernel(hlo_text), **hlo.summary(hlo_text),
      'f32_dots': hlo.float32_dots(hlo_text), 'f32_dots_lowered': hlo.float32_dots(lowered.as_text(dialect='hlo')),
      **sizes,
      'device_memory_bytes': target.memory_per_device,
      'fits': sizes['per_device_total_bytes'] <= target.memory_per_device, 'estimate_bytes': estimate.total,
      'compile_s': round(compile_s, 2), 'init_compile_s': round(init_compile_s, 2), 'decode': decode,
      'hlo_path': hlo_path,
  }


def _check_mesh_fits(config, target: targets.Target) -> None:
  try:
    sharding.mesh_shape(config.mesh, len(target.devices))
  except ValueError as e:
    raise ConfigError(f'config.mesh does not fit --compile_target={target.name} ({len(target.devices)} x '
                      f'{target.devices[0].device_kind}): {e}') from None


def _compiled(jitted, *args):
  """(jitted lowered for `args`, that compiled, seconds both took)."""
  start = time.perf_counter()
  lowered = jitted.lower(*args)
  compiled = lowered.compile()
  return lowered, compiled, time.perf_counter() - start


def _abstract_state(spec: state_lib.StateSpec) -> state_lib.TrainState:
  return state_lib.with_shardings(spec.abstract, spec.shardings)


def _abstract_batch(task, config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """The global training batch as abstract arrays split over the mesh like `sharding.global_batch`'s."""
  batch_sharding = sharding.batch_sharding(mesh)
  example = task.example_batch(config.train.batch_size)
  return {name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=batch_sharding)
          for name, value in example.items()}


def _buffer_sizes(compiled) -> dict[str, int]:
  """XLA's buffer sizes per device of a compiled program, and their total (donated buffers once)."""
  analysis = compiled.memory_analysis()
  sizes = {f'{name}_bytes': int(getattr(analysis, f'{name}_size_in_bytes'))
           for name in ('temp', 'argument', 'output', 'alias')}
  sizes['per_device_total_bytes'] = (sizes['temp_bytes'] + sizes['argument_bytes'] + sizes['output_bytes']
                                     - sizes['alias_bytes'])
  return sizes


def _compile_decoding(config, task, spec: state_lib.StateSpec) -> dict | None:
  """{batch: what compiling the benchmark's greedy decoding for `batch` prompts gave}, or None for
  families without `Task.generate`. Parameters are placed as training places them; prompts replicated."""
  if task.generate is None:
    return None
  new_tokens = bench.decode_new_tokens(config, task.model_config)

  def decode(params, extra, prompt, valid):
    model = nnx.merge(spec.graphdef, params, extra)
    model.eval()
    return bench.generate_greedily(task, model, prompt, valid, new_tokens)

  replicated = NamedSharding(spec.mesh, P())
  params, extra = (state_lib.with_shardings(getattr(spec.abstract, part), getattr(spec.shardings, part))
                   for part in ('params', 'extra'))
  results = {}
  for batch in bench.DECODE_BATCHES:
    prompt = jax.ShapeDtypeStruct((batch, bench.DECODE_PROMPT), jnp.int32, sharding=replicated)
    valid = jax.ShapeDtypeStruct((batch, bench.DECODE_PROMPT), jnp.bool_, sharding=replicated)
    _, compiled, seconds = _compiled(jax.jit(decode), params, extra, prompt, valid)
    sizes = _buffer_sizes(compiled)
    results[str(batch)] = {'compile_s': round(seconds, 2), 'temp_bytes': sizes['temp_bytes'],
                           'argument_bytes': sizes['argument_bytes'], 'output_bytes': sizes['output_bytes'],
                           'attention_kernel': bench.attention_kernel(compiled.as_text())}
  return results
