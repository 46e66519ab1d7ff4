"""Benchmark mode: compile and time the training step (and cached decoding) of any config.

  python launch.py --config=configs/gpt.py:bench --mode=bench

No data is read: the task is bound to a stand-in tokenizer with `data.vocab_size` ids (through the
same `Task.bind` seam as a reloaded run) and batches are its synthetic `example_batch` with the
config's shapes. The state and the step are the trainer's own (`train.state.init_state`,
`steps.make_train_step`, same shardings, optimizer and donation), so what is timed here is what
training runs. Ends with one JSON line:

  model, params, batch, seq_len     what ran
  compile_s                         lowering + XLA compilation of the train step
  init_s                            compiling and running the sharded initialiser (`rng_impl`: the PRNG)
  compiles                          executables XLA built in this process: {'train_step', 'total'
                                    (init, step, matmul probe, decoding)}
  attention_kernel                  the attention the compiled train step runs, read from its HLO
                                    (fused cuDNN / Pallas kernels are custom calls; else XLA einsum)
  hlo                               what else the compiled train step runs (`train.hlo.summary`:
                                    fusions, scatters, cuDNN attention and Pallas calls)
  attention_dropout_forces_einsum   true when `attention` names a fused kernel but attention dropout
                                    > 0 makes training run the einsum path (the fused kernels cannot
                                    drop attention weights); attention_kernel then reads 'xla'
  step_ms, tokens_per_s             median over the timed steps (tokens = batch x seq_len)
  real_tokens_per_s                 the same, counting only the batch's non-padding tokens
                                    (`Task.count_tokens`; translation: target tokens)
  step_cpu_ms                       this process's CPU time per step, all threads (less sensitive than
                                    wall time to other jobs on a shared machine)
  model_flops_per_token             `Task.flops_per_token()` (each family documents its formula)
  achieved_tflops                   tokens_per_s x model_flops_per_token
  matmul_tflops, mfu                a square matmul in the model's dtype on one device, timed in this
                                    run before and after the steps (the ceiling it offers right now);
                                    mfu = achieved / (matmul x parallel_devices)
  parallel_devices                  how many such ceilings the run's devices add up to: every GPU /
                                    TPU device; on CPU one per process (its devices share its cores)
  datasheet_tflops, mfu_datasheet   TPU / GPU only: the vendor's dense peak for the dtype per device;
                                    mfu_datasheet = achieved / (peak x parallel_devices)
  decode_tokens_per_s               {batch: new tokens/s} of greedy cached generation (prompt 16,
                                    `decode.max_new_tokens` new, prefill included) for families
                                    with a `Task.generate`; null otherwise or with decode=False
  peak_rss_mb                       the process's peak resident memory
  memory                            XLA's compiled buffer sizes per device next to train/memory.py's
                                    estimate (arguments, outputs, temporaries: e.g. GPT's chunked
                                    cross-entropy, train.loss_chunk_tokens, keeps [B, L, V] float32
                                    logits out of them)
"""
from __future__ import annotations

import dataclasses
import resource
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import storage
from models.attention import attention_dropout_forces_einsum
from train import compilation, hlo, memory, sharding
from train import state as state_lib
from train.optim import make_optimizer
from train.task import task_without_data
from train.steps import jit_train_step
from train.validation import validate_config

DECODE_BATCHES = (1, 8)
DECODE_PROMPT = 16
# Dense vendor peaks in TFLOP/s by (device-kind substring, dtype). At JAX's default precision float32
# matmuls run as bfloat16 passes on TPU (so its bfloat16 peak applies) and as TF32 on Ampere and later GPUs.
DATASHEET_TFLOPS = {
    ('TPU v2', 'bfloat16'): 45.0, ('TPU v3', 'bfloat16'): 123.0, ('TPU v4', 'bfloat16'): 275.0,
    ('TPU v5 lite', 'bfloat16'): 197.0, ('TPU v5p', 'bfloat16'): 459.0, ('TPU v5', 'bfloat16'): 459.0,
    ('TPU v6', 'bfloat16'): 918.0,
    ('H100', 'bfloat16'): 989.0, ('H100', 'float32'): 494.7, ('H200', 'bfloat16'): 989.0,
    ('H200', 'float32'): 494.7, ('A100', 'bfloat16'): 312.0, ('A100', 'float32'): 156.0,
    ('L4', 'bfloat16'): 121.0, ('L4', 'float32'): 60.0,
}


@dataclasses.dataclass
class StandInTokenizer:
  """Just the sizes and special ids a task reads while building a model and a synthetic batch."""
  vocab_size: int
  pad_id: int = 0
  bos_id: int = 1
  eos_id: int = 2
  unk_id: int = 3


def datasheet_tflops(device_kind: str, dtype: str) -> float | None:
  key = 'float32' if dtype == 'float32' and 'TPU' not in device_kind else 'bfloat16'
  for (kind, kind_dtype), tflops in DATASHEET_TFLOPS.items():
    if kind in device_kind and kind_dtype == key:
      return tflops
  return None


def matmul_tflops(dtype: str, size: int | None = None, reps: int = 5) -> float:
  """TFLOP/s of a jit-compiled square matmul on the default device: the ceiling measured right now.
  Call it outside a mesh context (inside one, jit replicates the matmul on every device)."""
  size = size or (2048 if jax.default_backend() == 'cpu' else 8192)
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.dtype(dtype))
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.dtype(dtype))
  matmul = jax.jit(jnp.matmul)
  matmul(a, b).block_until_ready()
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * size**3 / statistics.median(times) / 1e12


def _timed(fn, reps: int) -> list[float]:
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return times


def bench_task(config, platform: str | None = None):
  """The config's task bound to a stand-in tokenizer, its 'auto' attention resolved for `platform`."""
  return task_without_data(config, StandInTokenizer(config.data.vocab_size), platform)


def generate_greedily(task, model, prompt: jax.Array, valid: jax.Array, new_tokens: int):
  """The decoding the benchmark times: `task.generate` greedy, prompt [B, P] -> new tokens [B, new_tokens]
  (no stop at EOS, so every row decodes all of them)."""
  return task.generate(model, prompt, valid, jax.random.key(0), max_new_tokens=new_tokens, temperature=0.0,
                       top_k=0, top_p=1.0, eos_id=None, pad_id=0)


def _decode_speed(task, model, new_tokens: int) -> dict[str, float] | None:
  """{batch: new tokens per second} of greedy generation, or None for non-generative families."""
  if task.generate is None:
    return None
  model.eval()
  speeds = {}
  for batch in DECODE_BATCHES:
    prompt = jnp.asarray(np.random.default_rng(batch).integers(4, task.tokenizer.vocab_size, (batch, DECODE_PROMPT)),
                         jnp.int32)
    valid = jnp.ones(prompt.shape, bool)
    run = lambda: generate_greedily(task, model, prompt, valid, new_tokens)
    jax.block_until_ready(run())  # compile
    speeds[str(batch)] = batch * new_tokens / statistics.median(_timed(run, 3))
  return speeds


def _utilisation(achieved: float | None, ceiling: float, dtype: str) -> dict[str, Any]:
  """Achieved TFLOP/s against the measured matmul `ceiling` (one device's) and the datasheet peak,
  times the devices that compute in parallel."""
  device = jax.devices()[0]
  peak = datasheet_tflops(device.device_kind, dtype) if device.platform != 'cpu' else None
  # Accelerators each compute on their own; a process's CPU devices share its cores, which one
  # device's matmul already uses.
  parallel = jax.process_count() if device.platform == 'cpu' else jax.device_count()
  return {'achieved_tflops': None if achieved is None else _significant(achieved),
          'matmul_tflops': _significant(ceiling), 'parallel_devices': parallel,
          'mfu': None if achieved is None else _significant(achieved / (ceiling * parallel)),
          'datasheet_tflops': peak,
          'mfu_datasheet': None if achieved is None or not peak else _significant(achieved / (peak * parallel))}


def run_benchmark(config, *, steps: int = 10, warmup: int = 2, profile_dir: str | None = None,
                  decode: bool = True) -> dict[str, Any]:
  """Compile and time `config`'s train step on synthetic batches; see the module docstring."""
  config = config.copy_and_resolve_references()
  validate_config(config)
  compilation.enable_cache('')  # count compilations; no persistent cache, so compile_s is a real compile
  task = bench_task(config)
  mesh = sharding.make_mesh(config.mesh)
  tx, _ = make_optimizer(config.train)
  spec = state_lib.state_spec(task.build_model, mesh, state_lib.resolve_rng_impl(config.rng_impl), tx)
  estimate = memory.estimate(config, task.model_config, spec.abstract, spec.shardings, mesh)
  batch_size, seq_len = config.train.batch_size, config.data.seq_len
  dtype = getattr(task.model_config, 'dtype', 'float32')  # models without one compute in float32
  local = task.example_batch(batch_size // jax.process_count())
  start = time.perf_counter()
  state = jax.block_until_ready(state_lib.init_state(spec, task.build_model, tx, config.seed))
  init_s = time.perf_counter() - start
  with sharding.use_mesh(mesh):
    batch = sharding.global_batch(local, mesh)
    step_fn = jit_train_step(task, spec, tx, config.train.grad_accum)
    start = time.perf_counter()
    compiled = step_fn.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
  # The matmul probe runs outside the mesh: inside it, jit would replicate the probe on every device
  # (8 fake CPU devices: the machine's cores doing 8 matmuls, an eighth of the ceiling).
  ceiling_before = matmul_tflops(dtype)
  state, scalars, times, cpu_per_step = _time_steps(compiled, state, batch, steps, warmup, profile_dir)
  ceiling = (ceiling_before + matmul_tflops(dtype)) / 2
  with sharding.use_mesh(mesh):
    model = state_lib.model_of(spec, state)
    new_tokens = decode_new_tokens(config, task.model_config)
    decode_speed = _decode_speed(task, model, new_tokens) if decode else None
  step_s = statistics.median(times)
  tokens_per_s = batch_size * seq_len / step_s
  real_tokens_per_s = float(task.count_tokens(local)[1]) * jax.process_count() / step_s
  flops = task.flops_per_token()
  device = jax.devices()[0]
  analysis, hlo_text = compiled.memory_analysis(), compiled.as_text()
  return {
      'model': f'{config.family}:{config.preset}', 'params': int(sum(x.size for x in jax.tree.leaves(state.params))),
      'batch': batch_size, 'seq_len': seq_len, 'tokens_per_s': round(tokens_per_s, 1),
      'real_tokens_per_s': round(real_tokens_per_s, 1),
      'step_ms': round(1000 * step_s, 2), 'step_ms_min_max': [round(1000 * min(times), 2), round(1000 * max(times), 2)],
      'step_cpu_ms': round(1000 * cpu_per_step, 2),
      'compile_s': round(compile_s, 2), 'init_s': round(init_s, 2), 'rng_impl': spec.rng_impl,
      'model_flops_per_token': flops, **_utilisation(tokens_per_s * flops / 1e12 if flops else None, ceiling, dtype),
      'decode_tokens_per_s': None if decode_speed is None else {k: round(v, 1) for k, v in decode_speed.items()},
      'peak_rss_mb': round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
      'memory': {'xla_mb': None if analysis is None else memory.xla_sizes_mb(analysis),
                 'estimate_mb': estimate.as_mb()},
      'device': f'{jax.device_count()} x {device.device_kind}', 'dtype': dtype,
      'attention': getattr(task.model_config, 'attention', None),
      'compiles': {'train_step': compilation.compiled('train_step'), 'total': compilation.compiled_total()},
      'attention_kernel': attention_kernel(hlo_text), 'hlo': hlo.summary(hlo_text),
      'attention_dropout_forces_einsum': attention_dropout_forces_einsum(model), 'scan_layers': config.model.get('scan_layers'),
      'remat': config.model.get('remat'), 'steps_timed': steps, 'final_loss': round(float(scalars['loss']), 4),
  }


def compile_train_step(config, devices=None, compiler_options: dict | None = None):
  """`config`'s train step as `run_benchmark` builds it (the trainer's state, shardings, donation),
  compiled for abstract state and batch on `config.mesh` over `devices` (default all): nothing is
  allocated or run. `compiler_options` go to XLA (`.compile(compiler_options)`). Returns the
  compiled step (`.as_text()`, `.memory_analysis()`)."""
  return lower_train_step(config, devices).compile(compiler_options)


def lower_train_step(config, devices=None, platform: str | None = None):
  """`compile_train_step`'s program lowered, before any XLA pass (a backend may upcast when it
  compiles): every 'auto' setting (the model's dtype and attention, Muon's Newton-Schulz dtype, the
  random number generator) resolved for `platform` (None: this process's backend)."""
  task = bench_task(config, platform)
  mesh = sharding.make_mesh(config.mesh, devices)
  tx, _ = make_optimizer(config.train, platform)
  spec = state_lib.state_spec(task.build_model, mesh, state_lib.resolve_rng_impl(config.rng_impl, platform), tx)
  batch = {name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding.batch_sharding(mesh))
           for name, value in task.example_batch(config.train.batch_size).items()}
  with sharding.use_mesh(mesh):
    step = jit_train_step(task, spec, tx, config.train.grad_accum)
    return step.lower(state_lib.with_shardings(spec.abstract, spec.shardings), batch)


def _time_steps(compiled, state, batch, steps: int, warmup: int, profile_dir: str | None):
  """(state, last scalars, wall seconds per timed step, CPU seconds per step)."""
  for _ in range(warmup):
    state, (scalars, _) = compiled(state, batch)
  jax.block_until_ready(scalars)
  times = []
  cpu_start = time.process_time()
  for _ in range(steps):
    begin = time.perf_counter()
    state, (scalars, _) = compiled(state, batch)
    float(scalars['loss'])  # wait for the step, as a training loop logging the loss would
    times.append(time.perf_counter() - begin)
  cpu_per_step = (time.process_time() - cpu_start) / steps
  if profile_dir:
    traces = storage.LocalMirror(profile_dir)  # the profiler writes local files; a gs:// profile_dir gets them after
    with jax.profiler.trace(traces.local):
      for _ in range(3):
        state, (scalars, _) = compiled(state, batch)
      float(scalars['loss'])
    traces.close()
  return state, scalars, times, cpu_per_step


def attention_kernel(hlo_text: str) -> str:
  """Which attention the compiled program runs, read from its HLO: fused kernels are custom calls."""
  if '__cudnn$fmha' in hlo_text:
    return 'cudnn fused attention'
  if 'splash_mha' in hlo_text or 'splash_mqa' in hlo_text:  # mqa: grouped K/V heads
    return 'splash attention (pallas)'
  if 'tpu_custom_call' in hlo_text:
    return 'pallas kernel (tpu_custom_call)'
  return 'xla (einsum + softmax)'


def decode_new_tokens(config, model_config) -> int:
  """New tokens the benchmark decodes: `decode.max_new_tokens`, as many as fit the model's positions
  after the benchmark prompt."""
  max_len = getattr(model_config, 'max_len', None)
  return config.decode.max_new_tokens if max_len is None else min(config.decode.max_new_tokens, max_len - DECODE_PROMPT)


def _significant(value: float, digits: int = 4) -> float:
  """`value` to `digits` significant digits: a tiny model's TFLOP/s and MFU keep their precision."""
  return float(f'{value:.{digits}g}')
