"""What a compiled program runs, counted from its HLO text (`compiled.as_text()`).

XLA prints one instruction per line, `name = TYPE opcode(operands), attributes`, where TYPE is one
token (`f32[16,1024]{1,0}`) or a parenthesised tuple that may hold spaces and comments. Every
computation is counted: the entry, loop bodies (once, not times their trip count) and the bodies
of fusions, so an op XLA fused still counts where it sits.

  fusions        fusion instructions (kernels XLA generated; on CPU, loops it emitted)
  scatters       scatter instructions (e.g. an embedding's gradient; slow on GPUs and TPUs)
  fmha_calls     cuDNN fused attention (`__cudnn$fmha...` custom calls): {'forward', 'backward'}
  splash_calls   Pallas TPU kernels (`tpu_custom_call`): {'forward', 'backward' (splash attention's
                 dq and dkv kernels)}
"""
from __future__ import annotations

import collections
import re

_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?(\S+)\s+=\s+(.*)$')  # (name, what follows ' = ')
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def _opcode(rest: str) -> str | None:
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
    instruction = _INSTRUCTION.match(line)
    opcode = instruction and _opcode(instruction.group(2))
    if opcode:
      counts[opcode] += 1
  return counts


def summary(hlo_text: str) -> dict[str, object]:
  """The counts of the module docstring, for one compiled program."""
  opcodes = opcode_counts(hlo_text)
  fmha = [t for t in _CUSTOM_CALL_TARGET.findall(hlo_text) if t.startswith('__cudnn$fmha')]
  fmha_backward = sum(1 for t in fmha if t.endswith('Backward'))
  # Pallas calls carry their kernel's name: splash_mha_fwd..., and splash_mha_dq... + splash_mha_dkv...
  # for the gradients (two backward calls per forward one).
  splash = [_INSTRUCTION.match(line).group(1) for line in hlo_text.splitlines()
            if 'custom_call_target="tpu_custom_call"' in line and _INSTRUCTION.match(line)]
  splash_backward = sum(1 for name in splash if re.match(r'splash_mha_d(q|kv)', name))
  return {'fusions': opcodes['fusion'], 'scatters': opcodes['scatter'],
          'fmha_calls': {'forward': len(fmha) - fmha_backward, 'backward': fmha_backward},
          'splash_calls': {'forward': len(splash) - splash_backward, 'backward': splash_backward}}
