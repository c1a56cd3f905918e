"""What a program compiled for a TPU slice needs and costs per chip, read from the compiler.

``launch.recipes.compile`` builds and compiles a run's programs; this module turns each
compiled program into a ``ProgramReport``: XLA's memory analysis per chip (arguments,
temporaries, outputs, aliased donations) against the chip's HBM and against the part of
``presets.memory_plan`` it stands for, the compile time, and the compiler's cost analysis
(FLOPs and bytes accessed per chip, each loop's body once per trip: ``loop_counted_costs``)
turned into a roofline estimate: ``max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)`` with the
chip's published peaks
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
    flops, bytes_accessed: the compiler's cost analysis per chip, each loop's body counted
      once per trip (``loop_counted_costs``; XLA's own analysis counts it once) unless
      ``per_trip`` is False.
    step_s: the roofline step time (seconds): the larger of ``flops`` over the chip's peak
      and the bytes read over its HBM bandwidth, those being ``bytes_accessed`` or, when
      larger, the arguments; ``bound``: ``'compute'`` or ``'memory'``.
    tokens_per_s_per_chip: tokens the program handles per second per chip at ``step_s``
      (trainer: rows x length; prefill: rows x bucket; decode: one per slot).
    mfu: model FLOPs (``2 N`` per token forward, ``6 N`` forward and backward; ``N`` the
      params a token uses, ``presets.active_params``: a mixture of experts counts its ``k``
      experts) per chip over the chip's peak for ``step_s``. None for the push, and when
      ``per_trip`` is False.
    loops: ``while`` loops in the optimized program (micro-batches, log-prob chunks, the
      scanned layer stack).
    per_trip: whether ``flops`` and ``bytes_accessed`` count each loop's body once per trip
      (True without loops). False when a loop's trips could not be read from the HLO: they
      are then XLA's counts (each body once), ``step_s`` a lower bound,
      ``tokens_per_s_per_chip`` an upper bound, and ``mfu`` is not given.
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
  per_trip: bool = True
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
            'loops': self.loops, 'loops_per_trip': self.per_trip,
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
    if not self.per_trip:
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
  loops = sum(' while(' in line for line in done.hlo.splitlines())
  counted = loop_counted_costs(done.hlo, flops, accessed) if loops else None
  if counted is not None:
    flops, accessed, _ = counted
  compute_s = flops / (slice_.peak_tflops * 1e12)
  # The program reads each of its arguments (params, optimizer state, KV cache) at least once
  # (with loops' bodies counted once, the scanned layers' weights would count once).
  memory_s = max(accessed, float(memory.argument_size_in_bytes)) / (slice_.hbm_gbps * 1e9)
  step_s = max(compute_s, memory_s)
  chips = mesh.devices.size
  rate = None if tokens is None or step_s == 0 else tokens / chips / step_s
  per_trip = not loops or counted is not None
  mfu = (None if model_flops is None or step_s == 0 or not per_trip
         else model_flops / chips / (step_s * slice_.peak_tflops * 1e12))
  return ProgramReport(
      program=program, slice=slice_.name, mesh=dict(mesh.shape),
      arguments=float(memory.argument_size_in_bytes), temporaries=float(memory.temp_size_in_bytes),
      outputs=float(memory.output_size_in_bytes), aliased=float(memory.alias_size_in_bytes),
      code=float(memory.generated_code_size_in_bytes), beside=float(beside),
      hbm=slice_.hbm_gib * GIB, plan=plan, lower_s=done.lower_s, compile_s=done.compile_s,
      flops=flops, bytes_accessed=accessed, step_s=step_s,
      bound='compute' if compute_s >= memory_s else 'memory', tokens_per_s_per_chip=rate,
      mfu=mfu, loops=loops, per_trip=per_trip)


# A computation of HLO text starts with its name (after ``ENTRY`` for the entry) and ends
# with a line starting ``}`` (``}, execution_thread="sparsecore"`` for a computation XLA:TPU
# offloads to the SparseCore, e.g. a MoE's scatter-add); a while loop names its condition and
# body computations.
_HEADER = re.compile(r'^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$')
_WHILE = re.compile(r'=\s*.*\swhile\(%([\w.\-]+)\).*?condition=%([\w.\-]+), body=%([\w.\-]+)')
_CALLEE = re.compile(r'\b(?:calls|to_apply|condition|body|true_computation|'
                     r'false_computation)=%([\w.\-]+)|branch_computations=\{([^}]*)\}')
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CONSTANT = re.compile(r'^\s*(%[\w.\-]+)\s*=\s*[su]\d+\[\][^ ]*\s+constant\((-?\d+)\)')
_LESS_THAN = re.compile(r'^\s*ROOT\s+%[\w.\-]+\s*=\s*pred\[\][^ ]*\s+compare\((%[\w.\-]+), '
                        r'(%[\w.\-]+)\), direction=LT')
_GET_ELEMENT = re.compile(r'^\s*(%[\w.\-]+)\s*=\s*.*get-tuple-element\((%[\w.\-]+)\), '
                          r'index=(\d+)')
_TUPLE = re.compile(r'^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*.*\stuple\(([^)]*)\)')


def _computations(hlo: str) -> tuple[str, dict[str, list[str]], str]:
  """``(the text before the first computation, {name: its lines}, the entry's name)``."""
  lines = hlo.splitlines()
  comps: dict[str, list[str]] = {}
  entry, name, start = '', None, len(lines)
  for i, line in enumerate(lines):
    if name is None:
      match = _HEADER.match(line)
      if match:
        name, start = match[2], min(start, i)
        comps[name] = [line]
        entry = match[2] if match[1] else entry
    else:
      comps[name].append(line)
      if line.startswith('}'):  # '}' or, for a SparseCore offload, '}, execution_thread=...'
        name = None
  return '\n'.join(lines[1:start]), comps, entry


def _trips(comps: dict[str, list[str]], owner: str, init: str, condition: str) -> int | None:
  """Trips of a while loop of ``owner`` whose condition is ``condition`` and initial state
  ``init``: its condition's ``counter < N`` against a constant ``N``, the counter's
  initial value a constant of ``owner`` too (0 when it is not one: a scan's counter)."""
  cond = comps.get(condition, [])
  constants = {m[1]: int(m[2]) for m in map(_CONSTANT.match, cond) if m}
  elements = {m[1]: int(m[3]) for m in map(_GET_ELEMENT.match, cond) if m}
  for line in cond:
    match = _LESS_THAN.match(line)
    if match and match[2] in constants and match[1] in elements:
      owner_constants = {m[1]: int(m[2]) for m in map(_CONSTANT.match, comps[owner]) if m}
      tuples = {m[1]: [o.strip().split(' ')[-1]
                       for o in re.sub(r'/\*.*?\*/', '', m[2]).split(',')]
                for m in map(_TUPLE.match, comps[owner]) if m}
      operands = tuples.get(init, [])
      index = elements[match[1]]
      start = (owner_constants.get(operands[index], 0) if index < len(operands) else 0)
      return constants[match[2]] - start
  return None


def loop_counted_costs(hlo: str, flops: float, accessed: float
                       ) -> tuple[float, float, int] | None:
  """``(flops, bytes accessed, loops)`` of an optimized program with each ``while`` loop's
  body counted once per trip.

  XLA's cost analysis (``flops``, ``accessed``: the compiled program's) counts a loop's body
  once. Each loop's trips are read from the optimized HLO (``hlo``; its ``known_trip_count``,
  else its condition ``i < N`` against a constant), and each body's own cost (``N`` layers of
  a scan, ``M`` micro-batches) from XLA's cost analysis of that body alone (the body made
  the entry of a module of the computations it calls, ``hlo_module_cost_analysis``); a
  nested body counts once per trip of every loop around it:
  ``total = flops + sum(own(body) * (trips(body) - 1))`` with ``own`` a body without the
  loops inside it and ``trips`` the product of its own and its enclosing loops' trips.
  A model from the compiler's counts, not a measurement. The bodies are analysed by jaxlib's
  ``hlo_module_cost_analysis`` on the CPU client (no public JAX API analyses one computation;
  its counts of the whole program agree with XLA:TPU's FLOPs and, within 4-7%, its bytes).
  None when a loop's trips or a body's cost cannot be read (the caller then gives the
  uncounted figures as lower bounds).
  """
  from jax._src.lib import _jax  # pylint: disable=import-outside-toplevel
  from jaxlib import _hlo  # pylint: disable=import-outside-toplevel
  head, comps, entry = _computations(hlo)
  if not entry:
    return None

  def callees(name: str) -> list[str]:
    out = []
    for line in comps.get(name, [])[1:]:
      for match in _CALLEE.finditer(line):
        out += [match[1]] if match[1] else [c.strip().lstrip('%') for c in match[2].split(',')]
    return out

  def direct_loops(name: str) -> list[tuple[str, str, str, str]]:
    """``(owner, init, condition, body)`` of the loops ``name`` runs, not inside another."""
    loops, seen, todo = [], set(), [name]
    while todo:
      comp = todo.pop()
      if comp in seen or comp not in comps:
        continue
      seen.add(comp)
      inner = set()
      for line in comps[comp][1:]:
        match = _WHILE.search(line)
        if match:
          loops.append((comp, match[1], match[2], match[3]))
          inner.update(match.group(2, 3))
      todo += [c for c in callees(comp) if c not in inner]
    return loops

  try:
    client = jax.devices('cpu')[0].client
  except RuntimeError:
    return None
  costs: dict[str, tuple[float, float]] = {}

  def cost(name: str) -> tuple[float, float]:
    """XLA's cost analysis of computation ``name`` alone (loops inside it counted once)."""
    if name not in costs:
      reach, todo = [], [name]
      while todo:
        comp = todo.pop()
        if comp not in reach and comp in comps:
          reach.append(comp)
          todo += callees(comp)
      text = '\n'.join(['HloModule loop_body', head] + [
          '\n'.join(lines).replace('ENTRY ', '', 1) if comp != name else
          'ENTRY ' + '\n'.join(lines).replace('ENTRY ', '', 1)
          for comp, lines in comps.items() if comp in reach])
      out = _jax.hlo_module_cost_analysis(client, _hlo.hlo_module_from_text(text))
      costs[name] = (float(out.get('flops', 0.0)), float(out.get('bytes accessed', 0.0)))
    return costs[name]

  total_flops, total_bytes, count = flops, accessed, 0
  todo = [(entry, 1)]
  try:
    while todo:
      name, trips = todo.pop()
      for owner, init, condition, body in direct_loops(name):
        known = _KNOWN_TRIPS.search(next(
            (line for line in comps[owner] if f'body=%{body}' in line), ''))
        n = int(known[1]) if known else _trips(comps, owner, init, condition)
        if n is None or n < 0:
          return None
        count += 1
        inner = [cost(b) for _, _, _, b in direct_loops(body)]
        own = [c - sum(i[k] for i in inner) for k, c in enumerate(cost(body))]
        total_flops += own[0] * (trips * n - 1)
        total_bytes += own[1] * (trips * n - 1)
        todo.append((body, trips * n))
  except (RuntimeError, ValueError):  # XLA could not parse or analyse a body's module
    return None
  return total_flops, total_bytes, count


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
