"""What a compiled program communicates, read from its HLO text (`compiled.as_text()`).

  compiled = jax.jit(step, ...).lower(*args).compile()
  collectives(compiled.as_text())        # every collective instruction, with how often it runs
  collective_bytes(compiled.as_text())   # {'all-gather': bytes per step, 'all-reduce': ..., ...}

Works on the text of any backend's compiled (post-SPMD-partitioning) module: XLA:CPU, XLA:GPU
and TPU, synchronous collectives (`all-gather(...)`) and asynchronous pairs
(`all-gather-start` / `all-gather-done`: the `-done` instruction is counted, whose result is the
collective's output; the `-start` is not, so nothing counts twice).

Executions per step: a collective in a while loop's body runs once per iteration. XLA annotates
loops whose trip count it can prove (`known_trip_count` in the while's backend_config: scanned
layers, gradient accumulation, the chunked loss), and the multiplier of an instruction is the
product of the trip counts of the loops around it, summed over every place its computation is
called from (fusions, calls, async wrappers, conditional branches: each at most once, so a
collective in a conditional branch is counted as if its branch always ran; an async wrapper's
computation once per `async-start`). A loop without a
known trip count counts once and marks its collectives `static=False`.

Bytes are those of the collective's result on one device (for an all-gather the gathered array,
for an all-reduce the reduced one, for a reduce-scatter the scattered shard): the memory each
execution produces, a proxy for the traffic that is exact up to the algorithm's constant factor.
What else it runs (`summary`), counted over every computation (the entry, loop bodies once, not
times their trip count, and fusion bodies, so an op XLA fused still counts where it sits):

  fusions           fusion instructions (kernels XLA generated; on CPU, loops it emitted)
  scatters          scatter instructions (e.g. an embedding's gradient; slow on GPUs and TPUs)
  fmha_calls        cuDNN fused attention (`__cudnn$fmha...` custom calls): {'forward', 'backward'}
  splash_calls      Pallas TPU kernels (`tpu_custom_call`): {'forward', 'backward' (splash
                    attention's dq and dkv kernels)}
  collective_bytes  `collective_bytes` below

`float32_dots(hlo_text)` counts the matmuls (dot and convolution instructions) that multiply float32
operands, in a compiled module's text or a lowered one's (`jitted.lower(...).as_text(dialect='hlo')`:
the program before XLA's passes; XLA:CPU upcasts bfloat16 dots to float32 when it compiles).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import re

KINDS = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute')

# Bytes per element of HLO primitive types; sub-byte types count as one byte (an upper bound).
_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4, 'u32': 4,
                'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16}
_SMALL_DTYPES = ('f8', 's4', 'u4', 's2', 'u2', 'f4')  # fp8 variants and sub-byte integers: one byte
_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\]')
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(')
_CALLEES = re.compile(r'\b(calls|to_apply|body|condition|branch_computations|called_computations)='
                      r'(\{[^}]*\}|%?[\w.\-]+)')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the compiled module.

  kind: one of KINDS ('all-gather', ...; an async pair is reported under its collective's kind).
  name: the instruction's name in the HLO text (e.g. 'all-gather.25', 'all-reduce-done.3').
  computation: the HLO computation holding it (ENTRY, a while body, a fusion, ...).
  arrays: the result's arrays as (dtype, shape) pairs: one, or several for a combined collective
    (XLA merges small all-reduces into one with a tuple result).
  bytes: the result's size on one device, all arrays together, for one execution.
  multiplier: executions per run of the module (the trip counts of the enclosing loops).
  static: False when some enclosing loop's trip count is unknown (then counted once).
  """
  kind: str
  name: str
  computation: str
  arrays: tuple[tuple[str, tuple[int, ...]], ...]
  bytes: int
  multiplier: int
  static: bool

  @property
  def dtype(self) -> str:
    """The first result array's HLO dtype ('f32', 'bf16', ...)."""
    return self.arrays[0][0]

  @property
  def shape(self) -> tuple[int, ...]:
    """The first result array's shape (the only one unless the collective is combined)."""
    return self.arrays[0][1]

  @property
  def bytes_per_step(self) -> int:
    return self.bytes * self.multiplier

  def leads_with(self, dims: tuple[int, ...]) -> bool:
    """Whether some result array's shape starts with `dims`, e.g. (batch, length): an activation."""
    return any(shape[:len(dims)] == tuple(dims) for _, shape in self.arrays)


def _arrays(type_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
  """'(f32[16,32]{1,0}, bf16[8])' -> (('f32', (16, 32)), ('bf16', (8,)))."""
  return tuple((dtype, tuple(int(d) for d in dims.split(',') if d)) for dtype, dims in _ARRAY.findall(type_text)
               if dtype in _DTYPE_BYTES or dtype.startswith(_SMALL_DTYPES))


def _size(arrays) -> int:
  total = 0
  for dtype, shape in arrays:
    count = 1
    for d in shape:
      count *= d
    total += count * _DTYPE_BYTES.get(dtype, 1)
  return total


@dataclasses.dataclass
class _Module:
  entry: str | None = None
  # callee -> [(caller, executions of the callee per execution of the caller, trip count known)]
  callers: dict[str, list[tuple[str, int, bool]]] = dataclasses.field(default_factory=dict)
  # (computation, instruction name, op, result type text) of every collective
  found: list[tuple[str, str, str, str]] = dataclasses.field(default_factory=list)


def _parse(hlo_text: str) -> _Module:
  module, current = _Module(), None
  for line in hlo_text.splitlines():
    if not line.startswith((' ', '\t', '}')) and (header := _COMPUTATION.match(line)):
      current = header.group(1)
      if line.startswith('ENTRY'):
        module.entry = current
      continue
    instruction = _INSTRUCTION.match(line) if current else None
    if instruction is None:
      continue
    name, type_text, op = instruction.groups()
    if op in KINDS or (op.endswith('-done') and op[:-len('-done')] in KINDS):
      module.found.append((current, name, op, type_text))
    if op.endswith('-done') or op == 'async-update':
      continue  # an async pair names its wrapped computation at the start and again here: counted once
    trip = _TRIP_COUNT.search(line) if op == 'while' else None
    for _, callees in _CALLEES.findall(line):
      for callee in re.findall(r'%?([\w.\-]+)', callees):
        factor = int(trip.group(1)) if trip else 1
        module.callers.setdefault(callee, []).append((current, factor, op != 'while' or trip is not None))
  return module


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective of a compiled module's HLO text, in text order, with its executions per run.

  Args:
    hlo_text: `compiled.as_text()` of a jitted function (a train step: one run = one step).
  Returns:
    [Collective], one per all-gather / all-reduce / reduce-scatter / all-to-all /
    collective-permute instruction (or async `-done`), see `Collective`.
  """
  module = _parse(hlo_text)

  @functools.cache
  def executions(computation: str) -> tuple[int, bool]:
    if computation == module.entry or computation not in module.callers:
      return 1, True
    total, static = 0, True
    for caller, factor, known in module.callers[computation]:
      count, caller_static = executions(caller)
      total += count * factor
      static = static and known and caller_static
    return total, static

  found = []
  for computation, name, op, type_text in module.found:
    arrays = _arrays(type_text)
    multiplier, static = executions(computation)
    found.append(Collective(op.removesuffix('-done'), name, computation, arrays, _size(arrays), multiplier, static))
  return found


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """{kind: result bytes per run, on one device} for every kind in KINDS (0 where absent): the sum of
  `Collective.bytes * Collective.multiplier`. For a train step's HLO, bytes per step."""
  totals = dict.fromkeys(KINDS, 0)
  for collective in collectives(hlo_text):
    totals[collective.kind] += collective.bytes_per_step
  return totals


# ---------------------------------------------------------------------------- op and kernel counts
_NAMED_LINE = re.compile(r'^\s*(?:ROOT\s+)?%?(\S+)\s+=\s+(.*)$')  # (name, what follows ' = ')
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def _opcode_after_type(rest: str) -> str | None:
  """The opcode of an instruction given the text after `name = `: TYPE, one space, opcode, '('."""
  if rest.startswith('('):  # a tuple type: skip to its closing parenthesis
    depth = 0
    for end, char in enumerate(rest):
      depth += {'(': 1, ')': -1}.get(char, 0)
      if depth == 0:
        break
    rest = rest[end + 1:]
  else:
    rest = rest[rest.find(' '):] if ' ' in rest else ''
  match = re.match(r'\s*([a-z][\w-]*)\(', rest)
  return match.group(1) if match else None


def opcode_counts(hlo_text: str) -> collections.Counter:
  """{opcode: instructions} over every computation of the module."""
  counts = collections.Counter()
  for line in hlo_text.splitlines():
    instruction = _NAMED_LINE.match(line)
    opcode = instruction and _opcode_after_type(instruction.group(2))
    if opcode:
      counts[opcode] += 1
  return counts


def summary(hlo_text: str) -> dict[str, object]:
  """The counts of the module docstring, for one compiled program."""
  opcodes = opcode_counts(hlo_text)
  fmha = [t for t in _CUSTOM_CALL_TARGET.findall(hlo_text) if t.startswith('__cudnn$fmha')]
  fmha_backward = sum(1 for t in fmha if t.endswith('Backward'))
  # Pallas calls carry their kernel's name: splash_mha_fwd... (splash_mqa_... with grouped K/V heads),
  # and splash_mha_dq... + splash_mha_dkv...
  # for the gradients (two backward calls per forward one).
  splash = [_NAMED_LINE.match(line).group(1) for line in hlo_text.splitlines()
            if 'custom_call_target="tpu_custom_call"' in line and _NAMED_LINE.match(line)]
  splash_backward = sum(1 for name in splash if re.match(r'splash_m[hq]a_d(q|kv)', name))
  return {'fusions': opcodes['fusion'], 'scatters': opcodes['scatter'],
          'fmha_calls': {'forward': len(fmha) - fmha_backward, 'backward': fmha_backward},
          'splash_calls': {'forward': len(splash) - splash_backward, 'backward': splash_backward},
          'collective_bytes': collective_bytes(hlo_text)}


# ---------------------------------------------------------------------------- float32 matmuls
_MATMULS = ('dot', 'convolution')
# Dot algorithms that round float32 operands to bfloat16 (jax.default_matmul_precision('BF16_BF16_F32'),
# e.g. Muon's bfloat16 Newton-Schulz): bfloat16 matmuls, whatever the operands' type.
_BF16_ALGORITHM = re.compile(r'algorithm=dot_bf16_bf16_')


def _operand_names(rest: str, opcode: str) -> list[str]:
  """The operands of the instruction whose text after `name = ` is `rest`: names, each with its type
  when the text writes one ('f32[8]{0} %p0'), as the text gives them."""
  start = rest.find(f' {opcode}(') + len(opcode) + 2
  depth, end = 1, start
  while end < len(rest) and depth:
    depth += {'(': 1, ')': -1}.get(rest[end], 0)
    end += 1
  operands, depth, current = [], 0, ''
  for char in rest[start:end - 1]:
    depth += {'(': 1, '[': 1, '{': 1, ')': -1, ']': -1, '}': -1}.get(char, 0)
    if char == ',' and depth == 0:
      operands.append(current.strip())
      current = ''
    else:
      current += char
  return operands + ([current.strip()] if current.strip() else [])


def float32_dots(hlo_text: str) -> int:
  """Dot and convolution instructions with a float32 (or float64) operand, over every computation
  (each counted once where it sits). A bfloat16 product returned in float32 (preferred_element_type)
  is not counted, nor a float32 one whose algorithm rounds its operands to bfloat16."""
  dtypes, matmuls = {}, []
  for line in hlo_text.splitlines():
    instruction = _NAMED_LINE.match(line)
    if not instruction:
      continue
    name, rest = instruction.groups()
    result = _ARRAY.search(rest)
    dtypes[name.lstrip('%')] = result.group(1) if result else None
    opcode = _opcode_after_type(rest)
    if opcode in _MATMULS and not _BF16_ALGORITHM.search(rest):
      matmuls.append(_operand_names(rest, opcode))
  def dtype(operand: str) -> str | None:
    written = _ARRAY.match(operand)
    return written.group(1) if written else dtypes.get(operand.split()[-1].lstrip('%'))
  return sum(1 for operands in matmuls if any(dtype(operand) in ('f32', 'f64') for operand in operands))
