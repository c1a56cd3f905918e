"""The Cloud TPU slice shapes the recipes know (``python -m launch.recipes slices``)."""

from __future__ import annotations

import dataclasses

from rlax_llm.errors import ConfigError


class SliceError(ConfigError):
  """A config (or recipe option) that does not fit the slice; the message says the fix."""


@dataclasses.dataclass(frozen=True)
class SliceType:
  """One Cloud TPU slice shape.

  Attributes:
    name: what the recipes take (``v5p-32``); v4 and v5p names count TensorCores (2 per
      chip), v5e and v6e names count chips.
    accelerator_type: ``gcloud ... --accelerator-type`` (v5e is ``v5litepod-N`` there).
    chips: TPU chips in the slice (JAX devices: one per chip on these generations).
    hosts: TPU VMs (JAX processes) in the slice.
    runtime_version: ``gcloud ... --version`` (the TPU VM image).
    hbm_gib: high-bandwidth memory per chip.
    gke_accelerator: the node label ``cloud.google.com/gke-tpu-accelerator``.
    gke_topology: the node label ``cloud.google.com/gke-tpu-topology``.
    peak_tflops: the chip's dense bfloat16 peak (TFLOP/s), as Cloud TPU's system
      architecture pages state it; the compile report's roofline divides FLOPs by it.
    hbm_gbps: the chip's HBM bandwidth (GB/s, same source); the roofline divides bytes
      accessed by it.
  """
  name: str
  accelerator_type: str
  chips: int
  hosts: int
  runtime_version: str
  hbm_gib: float
  gke_accelerator: str
  gke_topology: str
  peak_tflops: float = 0.0
  hbm_gbps: float = 0.0

  @property
  def generation(self) -> str:
    """``v4``, ``v5e``, ``v5p`` or ``v6e``."""
    return self.name.split('-')[0]

  @property
  def topology(self) -> str:
    """The name ``jax.experimental.topologies.get_topology_desc`` takes (``v5e:2x4``)."""
    return f'{self.generation}:{self.gke_topology}'

  @property
  def chips_per_host(self) -> int:
    return self.chips // self.hosts

  @property
  def multi_host(self) -> bool:
    return self.hosts > 1

  def describe(self) -> str:
    hosts = f'{self.hosts} hosts x {self.chips_per_host}' if self.multi_host else '1 host'
    return (f'{self.name} (gcloud {self.accelerator_type}: {self.chips} chips on {hosts}, '
            f'{self.hbm_gib:g} GiB HBM per chip)')


# generation -> (gcloud accelerator type pattern, runtime version, HBM GiB/chip, GKE label,
# bf16 peak TFLOP/s per chip, HBM GB/s per chip)
_GENERATIONS = {
    'v4': ('v4-{n}', 'tpu-ubuntu2204-base', 32, 'tpu-v4-podslice', 275, 1228),
    'v5e': ('v5litepod-{n}', 'v2-alpha-tpuv5-lite', 16, 'tpu-v5-lite-podslice', 197, 819),
    'v5p': ('v5p-{n}', 'v2-alpha-tpuv5', 95, 'tpu-v5p-slice', 459, 2765),
    'v6e': ('v6e-{n}', 'v2-alpha-tpuv6e', 32, 'tpu-v6e-slice', 918, 1640),
}
# (generation, size in the name, chips, hosts, topology)
_SHAPES = (
    ('v4', 8, 4, 1, '2x2x1'), ('v4', 16, 8, 2, '2x2x2'), ('v4', 32, 16, 4, '2x2x4'),
    ('v5e', 4, 4, 1, '2x2'), ('v5e', 8, 8, 1, '2x4'), ('v5e', 16, 16, 4, '4x4'),
    ('v5e', 32, 32, 8, '4x8'),
    ('v5p', 8, 4, 1, '2x2x1'), ('v5p', 16, 8, 2, '2x2x2'), ('v5p', 32, 16, 4, '2x2x4'),
    ('v5p', 64, 32, 8, '2x4x4'), ('v5p', 128, 64, 16, '4x4x4'),
    ('v6e', 4, 4, 1, '2x2'), ('v6e', 8, 8, 1, '2x4'), ('v6e', 16, 16, 4, '4x4'),
    ('v6e', 32, 32, 8, '4x8'),
)


def _make_slices() -> dict[str, SliceType]:
  out = {}
  for gen, n, chips, hosts, topology in _SHAPES:
    pattern, runtime, hbm, gke, tflops, gbps = _GENERATIONS[gen]
    out[f'{gen}-{n}'] = SliceType(f'{gen}-{n}', pattern.format(n=n), chips, hosts, runtime,
                                  hbm, gke, topology, tflops, gbps)
  return out


SLICES: dict[str, SliceType] = _make_slices()


def get_slice(name: str) -> SliceType:
  """The slice named ``name`` (``v5e-16``, or gcloud's ``v5litepod-16``)."""
  key = name.strip().lower()
  if key in SLICES:
    return SLICES[key]
  for slice_ in SLICES.values():
    if slice_.accelerator_type == key:
      return slice_
  raise SliceError(f'unknown TPU type {name!r}; choose one of {list(SLICES)} (the table: '
                   'python -m launch.recipes slices; add a row to _SHAPES in '
                   'launch/recipes/slices.py for another shape).')


def slice_table() -> str:
  """The slice table as text (``python -m launch.recipes slices``)."""
  head = ('name', 'gcloud type', 'chips', 'hosts', 'chips/host', 'HBM/chip', 'runtime',
          'GKE accelerator', 'GKE topology')
  rows = [head] + [(s.name, s.accelerator_type, str(s.chips), str(s.hosts),
                    str(s.chips_per_host), f'{s.hbm_gib:g} GiB', s.runtime_version,
                    s.gke_accelerator, s.gke_topology) for s in SLICES.values()]
  widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
  return '\n'.join('  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def with_chips(chips: int) -> str:
  """The names of the slices with ``chips`` chips, for a message."""
  names = [s.name for s in SLICES.values() if s.chips == chips]
  return ', '.join(names) if names else 'none in the table'


def smallest_single_host(generation: str) -> SliceType:
  """The single-host slice of ``generation`` (``v5e``) with the fewest chips: the default
  slice of a distillation teacher, which scores on one chip (``trainer.teacher.Teacher``)."""
  hosts = [s for s in SLICES.values() if s.generation == generation and not s.multi_host]
  return min(hosts, key=lambda s: s.chips)
