"""What a program compiled for a TPU slice needs and costs per chip, read from the compiler.

``launch.recipes.compile`` builds and compiles a run's programs; this module turns each
compiled program into a ``ProgramReport``: XLA's memory analysis per chip (arguments,
temporaries, outputs, aliased donations) against the chip's HBM and against the part of
``presets.memory_plan`` it stands for, the compile time, and the compiler's cost analysis
(FLOPs and bytes accessed per chip) turned into a roofline estimate: ``max(FLOPs / peak
FLOP/s, bytes / HBM bandwidth)`` with the chip's published peaks
(``slices.SliceType.peak_tflops``, ``hbm_gbps``). That estimate is a model from the
compiler's counts, not a measurement (no overlap, no collectives' time, no host work). It
also reads the optimized HLO (``s8_dot_lines``: int8 weights reaching the matrix unit) and
refuses a run whose programs do not fit (``refuse_unless_fits``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax

from launch.recipes.slices import SliceError, SliceType
from rlax_llm import memory_fit

GIB = 2**30


@dataclasses.dataclass
class ProgramReport:
  """One compiled program on one chip of its slice.

  Attributes:
    program: ``compile.PROGRAMS`` entry.
    slice: the slice it compiled for (``v5e-8``); ``mesh``: its mesh's axis sizes.
    arguments, temporaries, outputs, aliased, code: XLA's memory analysis per chip (bytes);
      ``aliased``: outputs written into donated arguments (counted once).
    beside: bytes per chip that other parts of the run hold on the same chips while this
      program runs (the other role's resident state when the roles share chips; the decode
      state during a prefill).
    hbm: the chip's HBM (bytes).
    plan: ``presets.memory_plan``'s figure for the same part (bytes), or None where the plan
      has none.
    lower_s, compile_s: seconds to trace and lower, and to compile.
    flops, bytes_accessed: the compiler's cost analysis per chip.
    step_s: the roofline step time (seconds): the larger of ``flops`` over the chip's peak
      and the bytes read over its HBM bandwidth, those being ``bytes_accessed`` or, when
      larger (a loop's body counted once), the arguments; ``bound``: ``'compute'`` or
      ``'memory'``.
    tokens_per_s_per_chip: tokens the program handles per second per chip at ``step_s``
      (trainer: rows x length; prefill: rows x bucket; decode: one per slot).
    mfu: model FLOPs (``2 N`` per token forward, ``6 N`` forward and backward; ``N`` the
      params) per chip over the chip's peak for ``step_s``. None for the push, and for a
      program with loops.
    loops: ``while`` loops in the optimized program (micro-batches, log-prob chunks, the
      scanned layer stack). XLA's cost analysis counts a loop's body once,
      not once per trip, so with loops ``flops``, ``bytes_accessed`` and ``step_s`` are
      lower bounds and ``tokens_per_s_per_chip`` an upper bound (``mfu`` is then not given).
    notes: what else the report says (e.g. the int8 operands of the decode's products).
  """
  program: str
  slice: str
  mesh: dict[str, int]
  arguments: float
  temporaries: float
  outputs: float
  aliased: float
  code: float
  beside: float
  hbm: float
  plan: float | None
  lower_s: float
  compile_s: float
  flops: float
  bytes_accessed: float
  step_s: float
  bound: str
  tokens_per_s_per_chip: float | None
  mfu: float | None
  loops: int = 0
  notes: list[str] = dataclasses.field(default_factory=list)

  @property
  def per_chip(self) -> float:
    """The program's peak bytes per chip: arguments, temporaries and the outputs not
    written into donated arguments, and its code."""
    return self.arguments + self.temporaries + self.outputs - self.aliased + self.code

  @property
  def need(self) -> float:
    """What the chip must hold while it runs: ``per_chip`` and ``beside``."""
    return self.per_chip + self.beside

  @property
  def fits(self) -> bool:
    return self.band != 'over'

  @property
  def band(self) -> str:
    """``memory_fit.fit_band`` of ``need`` against ``hbm``: fits / tight / over."""
    return memory_fit.fit_band(self.need, self.hbm)

  @property
  def plan_ratio(self) -> float | None:
    """``per_chip / plan`` (None without a plan figure)."""
    return None if not self.plan else self.per_chip / self.plan

  def as_dict(self) -> dict[str, Any]:
    """JSON-ready: the fields in GiB (memory) and seconds, and the derived figures."""
    gib = lambda n: None if n is None else round(n / GIB, 3)  # noqa: E731
    return {
        'program': self.program, 'slice': self.slice, 'mesh': self.mesh,
        'gib_per_chip': gib(self.per_chip), 'arguments_gib': gib(self.arguments),
        'temporaries_gib': gib(self.temporaries), 'outputs_gib': gib(self.outputs),
        'aliased_gib': gib(self.aliased), 'beside_gib': gib(self.beside),
        'need_gib': gib(self.need), 'hbm_gib': gib(self.hbm), 'plan_gib': gib(self.plan),
        'compiled_over_plan': None if self.plan_ratio is None else round(self.plan_ratio, 3),
        'fits': self.fits, 'band': self.band, 'lower_s': round(self.lower_s, 2),
        'compile_s': round(self.compile_s, 2), 'tflops_per_chip': self.flops / 1e12,
        'gb_accessed_per_chip': self.bytes_accessed / 1e9,
        'compiler_model': {
            'step_ms': round(1e3 * self.step_s, 4), 'bound': self.bound,
            'loops_counted_once': self.loops,
            'tokens_per_s_per_chip': (None if self.tokens_per_s_per_chip is None
                                      else round(self.tokens_per_s_per_chip, 1)),
            'mfu': None if self.mfu is None else round(self.mfu, 4)},
        'notes': self.notes}

  def line(self) -> str:
    """One line of the text report."""
    gib = lambda n: f'{n / GIB:.2f}'  # noqa: E731
    plan = ('plan n/a' if self.plan is None else
            f'plan {gib(self.plan)} GiB ({100 * (self.plan_ratio - 1):+.0f}%)')
    rate = ('' if self.tokens_per_s_per_chip is None
            else f', {self.tokens_per_s_per_chip:,.0f} tokens/s/chip')
    mfu = '' if self.mfu is None else f', MFU {100 * self.mfu:.1f}%'
    if self.loops:
      mfu += (f' (lower bound: {self.loops} loop(s), each body counted once; '
              'tokens/s an upper bound)')
    beside = f' + {gib(self.beside)} beside' if self.beside else ''
    return (f'{self.program} on {self.slice} {self.mesh}: {gib(self.per_chip)} GiB per chip '
            f'(arguments {gib(self.arguments)}, temporaries {gib(self.temporaries)}, outputs '
            f'{gib(self.outputs)}, aliased {gib(self.aliased)}){beside} of '
            f'{gib(self.hbm)} GiB HBM ({100 * self.need / self.hbm:.0f}%), {plan}; '
            f'compiled in {self.compile_s:.1f} s (lowered in {self.lower_s:.1f} s); compiler '
            f'model: {self.flops / 1e12:.3g} TFLOP and {self.bytes_accessed / 1e9:.3g} GB '
            f'per chip -> {1e3 * self.step_s:.3g} ms ({self.bound}-bound){rate}{mfu}'
            + ('; warning: ' + memory_fit.tight_warning('its chips', self.need, self.hbm)
               if self.band == 'tight' else ''))


@dataclasses.dataclass
class Compiled:
  compiled: Any
  lower_s: float
  compile_s: float
  hlo: str  # the optimized program as text


def report_of(program: str, done: Compiled, slice_: SliceType, mesh: jax.sharding.Mesh, *,
            plan: float | None, beside: float = 0.0, tokens: float | None = None,
            model_flops: float | None = None) -> ProgramReport:
  """``ProgramReport`` of a compiled program; ``tokens`` and ``model_flops``: the whole
  mesh's per execution (divided over its chips here)."""
  memory = done.compiled.memory_analysis()
  cost = done.compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  cost = cost or {}
  flops, accessed = float(cost.get('flops', 0.0)), float(cost.get('bytes accessed', 0.0))
  compute_s = flops / (slice_.peak_tflops * 1e12)
  # XLA counts a loop's body once (the scanned layers: one layer's weights read); the program
  # reads each of its arguments (params, optimizer state, KV cache) at least once.
  memory_s = max(accessed, float(memory.argument_size_in_bytes)) / (slice_.hbm_gbps * 1e9)
  step_s = max(compute_s, memory_s)
  chips = mesh.devices.size
  rate = None if tokens is None or step_s == 0 else tokens / chips / step_s
  loops = sum(' while(' in line for line in done.hlo.splitlines())
  mfu = (None if model_flops is None or step_s == 0 or loops
         else model_flops / chips / (step_s * slice_.peak_tflops * 1e12))
  return ProgramReport(
      program=program, slice=slice_.name, mesh=dict(mesh.shape),
      arguments=float(memory.argument_size_in_bytes), temporaries=float(memory.temp_size_in_bytes),
      outputs=float(memory.output_size_in_bytes), aliased=float(memory.alias_size_in_bytes),
      code=float(memory.generated_code_size_in_bytes), beside=float(beside),
      hbm=slice_.hbm_gib * GIB, plan=plan, lower_s=done.lower_s, compile_s=done.compile_s,
      flops=flops, bytes_accessed=accessed, step_s=step_s,
      bound='compute' if compute_s >= memory_s else 'memory', tokens_per_s_per_chip=rate,
      mfu=mfu, loops=loops)


_DEFINITION = re.compile(r'^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(\w+)\[')
_OPERAND = re.compile(r'%[\w.\-]+')


def s8_dot_lines(hlo: str) -> list[str]:
  """The lines of optimized HLO text whose dot or convolution takes an ``s8`` operand: the
  int8 weights reaching the matrix unit as int8, without a conversion to floating point
  first. An operand is named (``%fusion.137``); its type is read from the instruction that
  defines it (names are unique in an HLO module)."""
  lines = hlo.splitlines()
  types = {m[1]: m[2] for m in map(_DEFINITION.match, lines) if m}
  out = []
  for line in lines:
    for op in (' dot(', ' convolution('):
      if op in line:
        operands = line.split(op, 1)[1].split(')', 1)[0]
        if 's8[' in operands or any(types.get(name) == 's8'
                                    for name in _OPERAND.findall(operands)):
          out.append(line.strip())
  return out


def refuse_unless_fits(reports: Sequence[ProgramReport]) -> None:
  """Raises SliceError with the numbers when a program does not fit its chips' HBM."""
  over = [r for r in reports if not r.fits]
  if over:
    raise SliceError(
        'the compiler says ' + '; '.join(
            f'{r.program} needs {r.need / GIB:.2f} GiB per chip on {r.slice} '
            f'({r.per_chip / GIB:.2f} GiB its own + {r.beside / GIB:.2f} GiB held beside it) '
            f'but a chip has {r.hbm / GIB:g} GiB of HBM' for r in over)
        + f'; {memory_fit.SHRINK_HINT}.')
