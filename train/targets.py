"""The devices `--mode=compile` compiles for, which need not be the ones this process runs on.

  cpu, cpu-N            this host's CPU devices: all of them, or the first N (more than one needs
                        XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)
  h100, h200, h100xN    NVIDIA Hopper GPUs, N (up to 8) on one host: XLA's GPU compiler, run on this
                        CPU against a description of the card (jax-cuda12-plugin; cuDNN for the fused
                        attention)
  v5e-8, v5p-16, v4-32  TPU slices by their usual names (v4 and v5p count TensorCores, two per chip;
                        v5e and v6e count chips), or `generation:topology` as libtpu names it
                        (v5e:4x4): libtpu's compiler, for every host of a multi-host slice at once.
                        v4 stops with one line: libtpu 0.0.42 describes its slices per TensorCore.

The accelerator targets need the optional packages of requirements-aot.txt and a process whose
only JAX backend is the CPU (JAX_PLATFORMS=cpu: an installed CUDA plugin without a GPU fails to
start otherwise); `launch.py --mode=compile` sets that itself.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

import jax

from errors import UserError

GiB = 2**30
INSTALL = ('pip install -r requirements-aot.txt (in a separate virtual environment; docs/accelerators.md: '
           '"Compiling for an accelerator you do not have") and run with JAX_PLATFORMS=cpu')
# GpuTargetConfig of a Hopper card, as XLA's GPU compiler reads it (values of an H100 SXM; cuDNN 9.8).
_HOPPER_TARGET_CONFIG = """
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth} l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: {memory}
  shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{description}"
"""
# name: (memory per device in bytes as the card reports it, bandwidth in bytes/s, description)
GPUS = {'h100': (84_929_347_584, 3_352_320_000_000, 'NVIDIA H100 80GB HBM3'),
        'h200': (150_754_820_096, 4_800_000_000_000, 'NVIDIA H200')}
GPUS_PER_HOST = 8
# generation: (HBM per chip, TensorCores a slice name counts per chip, dimensions of its topology)
TPUS = {'v4': (32 * GiB, 2, 3), 'v5p': (95 * GiB, 2, 3), 'v5e': (16 * GiB, 1, 2), 'v6e': (32 * GiB, 1, 2)}
# platform: (module, the package that installs it) of requirements-aot.txt
PLUGINS = {'gpu': (('jax_plugins.xla_cuda12', 'jax-cuda12-plugin'), ('nvidia.cudnn', 'nvidia-cudnn-cu12')),
           'tpu': (('libtpu', 'libtpu'),)}


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  platform: str  # 'cpu' | 'gpu' | 'tpu': what 'auto' attention, the PRNG and Pallas kernels resolve for
  devices: tuple  # jax.Device; for GPU and TPU targets, compile-only devices of a topology
  memory_per_device: int  # bytes a device holds (CPU: the host's RAM over its devices)


def resolve(name: str) -> Target:
  """The Target named `name` (module docstring); UserError naming what is missing otherwise."""
  if name == 'cpu' or re.fullmatch(r'cpu-\d+', name):
    return _cpu(name)
  gpu = re.fullmatch(r'(h100|h200)(?:x(\d+))?', name)
  if gpu:
    return _gpu(name, gpu.group(1), int(gpu.group(2) or 1))
  tpu = re.fullmatch(r'(v4|v5p|v5e|v6e)(?:-(\d+)|:(\d+(?:x\d+)+))', name)
  if tpu:
    generation, cores, topology = tpu.groups()
    return _tpu(name, generation, f'{generation}:{topology}' if topology else tpu_topology(name, generation, int(cores)))
  raise UserError(f'--compile_target={name} is not a target; use cpu, cpu-8, h100, h100x8, h200, or a TPU slice '
                  f'such as v5e-8, v5p-16, v4-32 (or v5e:2x4).')


def _cpu(name: str) -> Target:
  devices = jax.devices('cpu')
  count = len(devices) if name == 'cpu' else int(name.split('-')[1])
  if not 0 < count <= len(devices):
    raise UserError(f'--compile_target={name} needs {count} host CPU devices and JAX started with {len(devices)}; '
                    f'set XLA_FLAGS=--xla_force_host_platform_device_count={count} before it starts.')
  host_memory = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  return Target(name, 'cpu', tuple(devices[:count]), host_memory // count)


def _gpu(name: str, card: str, count: int) -> Target:
  if not 0 < count <= GPUS_PER_HOST:
    raise UserError(f'--compile_target={name}: one host holds 1 to {GPUS_PER_HOST} GPUs; use {card}x8 or fewer.')
  _require_plugin(name, 'gpu')
  from jax.experimental import topologies
  memory, bandwidth, description = GPUS[card]
  config = _HOPPER_TARGET_CONFIG.format(memory=memory, bandwidth=bandwidth, description=description)
  topology = _topology(name, lambda: topologies.get_topology_desc(platform='cuda', target_config=config,
                                                                  topology=f'1x1x{count}'))
  return Target(name, 'gpu', tuple(topology.devices), memory)


def tpu_topology(name: str, generation: str, cores: int) -> str:
  """libtpu's topology of the slice `generation`-`cores`: the usual shape, e.g. v4-32 -> v4:2x2x4."""
  _, cores_per_chip, dimensions = TPUS[generation]
  chips = cores // cores_per_chip
  shape = [2, 2, 1] if dimensions == 3 else [1, 1]
  if chips < 4 or chips & (chips - 1) or cores % cores_per_chip:
    raise UserError(f'--compile_target={name}: slices hold a power of two of at least 4 chips '
                    f'({4 * cores_per_chip} or more, doubling); or name the topology, e.g. {generation}:2x2'
                    f'{"x1" if dimensions == 3 else ""}.')
  while shape[0] * shape[1] * (shape[2] if dimensions == 3 else 1) < chips:
    smallest = min(shape)
    shape[max(i for i, size in enumerate(shape) if size == smallest)] *= 2  # the last of the smallest
  return f'{generation}:{"x".join(map(str, shape))}'


def _tpu(name: str, generation: str, topology_name: str) -> Target:
  _require_plugin(name, 'tpu')
  from jax.experimental import topologies
  topology = _topology(name, lambda: topologies.get_topology_desc(topology_name=topology_name, platform='tpu'))
  devices = tuple(topology.devices)
  chips = len({tuple(device.coords) for device in devices})
  if chips != len(devices):  # libtpu 0.0.42 describes v4 slices this way
    raise UserError(f'--compile_target={name}: libtpu describes this slice as {len(devices)} devices on {chips} chips '
                    f'(one per TensorCore), and JAX meshes need one device per chip (megacore); compile for '
                    f'another generation (v5p has the same chip count per name) until libtpu offers it.')
  return Target(name, 'tpu', devices, TPUS[generation][0])


def missing_packages(platform: str) -> list[str]:
  """The packages of requirements-aot.txt that compiling for `platform` ('gpu' | 'tpu') needs and lacks."""
  def installed(module: str) -> bool:
    parent = module.split('.')[0]
    return importlib.util.find_spec(parent) is not None and importlib.util.find_spec(module) is not None
  return [package for module, package in PLUGINS[platform] if not installed(module)]


def _require_plugin(target: str, platform: str) -> None:
  missing = missing_packages(platform)
  if missing:
    raise UserError(f'--compile_target={target} needs {" and ".join(missing)}, not installed here: {INSTALL}.')


def _topology(name: str, load):
  """`load()`'s topology; its failure (a CUDA plugin that started without JAX_PLATFORMS=cpu, a
  topology libtpu does not know) as one line."""
  try:
    return load()
  except (RuntimeError, NotImplementedError, ValueError) as e:
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise UserError(f'--compile_target={name}: JAX could not load its devices ({first_line}); compiling for it '
                    f'needs JAX_PLATFORMS=cpu and a topology its plugin knows.') from e
