"""The environment a process needs to use only some of the TPU chips of its host.

libtpu claims every chip of the host unless told otherwise, and a chip can be held by one
process at a time. When Ray puts two actors on one TPU VM host (e.g. two inference workers
of 4 chips each on a v5e-8), each actor's process must be told, before JAX creates its TPU
client, which chips are its own and that it is a one-process TPU system of that size.

``chip_environment`` is a pure function from the chip ids Ray assigned to the actor
(``ray.get_runtime_context().get_accelerator_ids()['TPU']``) and the host's chip count to
those variables. Sources of each variable:

- ``TPU_VISIBLE_CHIPS``: the chip ids this process may open. Ray sets it itself for an actor
  that requests ``'TPU'`` resources (``ray/_private/accelerators/tpu.py``,
  ``TPUAcceleratorManager.set_current_process_visible_accelerator_ids``), unless
  ``RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS`` is set; the value here is the same.
- ``TPU_CHIPS_PER_PROCESS_BOUNDS``: the shape (x,y,z) of this process's block of chips:
  ``1,1,1`` for 1 chip, ``1,2,1`` for 2, ``2,2,1`` for 4, ``2,4,1`` for 8 (JAX's
  ``jax/_src/test_multiprocess.py``, which launches several processes on one TPU host; the
  "non-communicating processes" recipe in the JAX team's gist
  https://gist.github.com/skye/f82ba45d2445bb19d53545538754f9a3; jax-ml/jax#14977).
- ``TPU_PROCESS_BOUNDS``: the grid of processes forming this TPU system: ``1,1,1``, since
  each actor is a JAX program of its own (the roles never form one multi-process system).
- ``TPU_CHIPS_PER_HOST_BOUNDS`` / ``TPU_HOST_BOUNDS``: the older names of the two above,
  which Ray sets for 1- and 2-chip actors (to ``1,1,1``/``1,2,1`` and ``1,1,1``); set here to
  the same values so every libtpu version reads one consistent answer. Ray sets no bounds
  for a 4-chip actor: without this module libtpu would take the default whole-host shape
  (``2,4,1`` on a v5e-8) over 4 visible chips and fail.
- ``TPU_PROCESS_PORT`` / ``TPU_PROCESS_ADDRESSES``: the port libtpu's slice builder listens
  on (default 8476) and the addresses of the processes of this TPU system. Two processes on
  one host need distinct ports: ``8476 + the first chip id``, distinct because the chip sets
  of actors on one host are disjoint (same source as the bounds).
- ``CLOUD_TPU_TASK_ID``: this process's index in its TPU system: ``0``, the only one.

An actor holding every chip of its host needs none of this (Ray removes
``TPU_VISIBLE_CHIPS`` in that case), so the environment is empty. Chip ids are taken to be
one Ray ``'TPU'`` resource per physical chip (Ray's default; ``RAY_TPU_RESOURCE_PER_CHIP``
other than 1 is refused by the Ray backend).

A trainer spanning the hosts of a multi-host slice (``ray.trainer_processes``: one actor per
host, each holding its whole host) is the opposite case: libtpu brings the slice's hosts up
as one TPU system, in which each host's process has the index of the host's TPU worker id,
and ``jax.distributed.initialize`` is given the coordinator and process ids explicitly (by
the Ray backend), so JAX's process index must be that worker id, or the job's processes and
the TPU system's disagree. ``host_worker_id`` reads a host's worker id where libtpu and
Ray read it (``TPU_WORKER_ID``, set on GKE; else the TPU VM's metadata
``agent-worker-number``: ``TPUAcceleratorManager.get_current_node_tpu_worker_id`` in
``ray/_private/accelerators/tpu.py``, ``GkeTpuCluster`` / ``GceTpuCluster`` in
``jax/_src/clusters/cloud_tpu_cluster.py``); ``process_order`` orders the actors' reports
(``HostReport``) by it, refusing a duplicate or missing id; ``slice_environment`` gives each
process the variables libtpu's multi-host bring-up reads: ``TPU_WORKER_ID`` (its worker id,
which is its process index) and ``TPU_WORKER_HOSTNAMES`` (every host's address, by worker id;
a value already set, as GKE sets it, is kept), and refuses the one-process-system variables
above.
"""

from __future__ import annotations

import dataclasses
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence

from rlax_llm.errors import ConfigError

BASE_PORT = 8476
"""libtpu's default slice-builder port; a process on chips ``c..`` listens on ``BASE_PORT + c``."""

CHIPS_PER_PROCESS_BOUNDS = {1: '1,1,1', 2: '1,2,1', 4: '2,2,1', 8: '2,4,1'}
"""Chips in one process -> their block's shape (x,y,z), as libtpu reads it."""

HOST_CHIPS = (1, 4, 8)
"""Chips per TPU VM host: 1 (v5e-1), 4 (v4, v5p, v5e-4, v6e-4 and multi-host slices), 8 (v5e-8,
v6e-8)."""

_RAY_SET = ('TPU_VISIBLE_CHIPS', 'TPU_CHIPS_PER_HOST_BOUNDS', 'TPU_HOST_BOUNDS')

METADATA_URL = 'http://metadata.google.internal/computeMetadata/v1/instance/attributes/'
"""Where a TPU VM's attributes are read (``agent-worker-number``: the host's worker id)."""


def chip_environment(chips: Iterable[int | str], host_chips: int,
                     current: Mapping[str, str] | None = None) -> dict[str, str]:
  """The variables that make a process see exactly ``chips`` of its host (module docstring).

  Args:
    chips: the chip ids assigned to the process (ints or Ray's strings, e.g. ``['4', '5']``);
      1, 2, 4 or 8 of them, consecutive and starting at a multiple of their count (a block of
      the host's chip grid).
    host_chips: the number of chips on the host (1, 4 or 8).
    current: the process's environment as it is (e.g. ``os.environ``): where it already sets
      one of the variables Ray sets (``TPU_VISIBLE_CHIPS`` and the host bounds), its value must
      agree with the result, else ``ConfigError``.

  Returns:
    ``{name: value}`` to put into ``os.environ`` before JAX initialises its backend; empty when
    ``chips`` are the whole host.

  Raises:
    ConfigError: an impossible split (a count other than 1/2/4/8 or larger than the host, ids
      not an aligned block, ids outside the host) or a disagreement with ``current``.
  """
  ids = sorted(int(chip) for chip in chips)
  if host_chips not in HOST_CHIPS:
    raise ConfigError(f'A TPU host has {"/".join(map(str, HOST_CHIPS))} chips; got '
                      f'host_chips={host_chips}. Check the "TPU" resource the host joined Ray '
                      'with (one unit per chip).')
  count = len(ids)
  if count not in CHIPS_PER_PROCESS_BOUNDS or count > host_chips or host_chips % count:
    raise ConfigError(
        f'An actor on a {host_chips}-chip TPU host was given {count} chips ({ids}); a process '
        f'can hold 1, 2, 4 or 8 chips dividing its host. Set the "TPU" count in '
        f'ray.trainer_resources / ray.worker_resources to one of '
        f'{[n for n in CHIPS_PER_PROCESS_BOUNDS if n <= host_chips and host_chips % n == 0]}.')
  if len(set(ids)) != count:
    raise ConfigError(f'The chip ids {ids} name a chip twice; Ray assigns each chip once.')
  if (ids != list(range(ids[0], ids[0] + count)) or ids[0] % count or ids[0] < 0
      or ids[-1] >= host_chips):
    raise ConfigError(
        f'The chips {ids} on a {host_chips}-chip TPU host are not an aligned block of {count} '
        f'(chips {ids[0] - ids[0] % count}..{ids[0] - ids[0] % count + count - 1}, say), so '
        'libtpu cannot address them as one process. Give every actor on a host the same '
        '"TPU" count, so Ray assigns aligned blocks.')
  if count == host_chips:
    env = {}
  else:
    port = BASE_PORT + ids[0]
    bounds = CHIPS_PER_PROCESS_BOUNDS[count]
    env = {
        'TPU_VISIBLE_CHIPS': ','.join(map(str, ids)),
        'TPU_CHIPS_PER_PROCESS_BOUNDS': bounds,
        'TPU_PROCESS_BOUNDS': '1,1,1',
        'TPU_CHIPS_PER_HOST_BOUNDS': bounds,
        'TPU_HOST_BOUNDS': '1,1,1',
        'TPU_PROCESS_PORT': str(port),
        'TPU_PROCESS_ADDRESSES': f'localhost:{port}',
        'CLOUD_TPU_TASK_ID': '0',
    }
  for name in _RAY_SET:
    if current is None or name not in current or (not env and name != 'TPU_VISIBLE_CHIPS'):
      continue  # (the whole host: only the visible chips are checked; Ray clears the rest)
    seen = current[name]
    if name == 'TPU_VISIBLE_CHIPS':
      agrees, wanted = _chip_set(seen) == set(ids), ','.join(map(str, ids))
    else:
      agrees, wanted = seen == env[name], env[name]
    if not agrees:
      raise ConfigError(
          f'The process environment has {name}={seen!r}, but the chips Ray assigned ({ids} of '
          f'{host_chips}) need {name}={wanted!r}. Unset {name} where the host joins Ray '
          '(`ray start`) and in the runtime environment; Ray and rlax_llm set it per actor.')
  return env


def _chip_set(value: str) -> set[int]:
  return {int(chip) for chip in value.split(',') if chip.strip()}


@dataclasses.dataclass(frozen=True)
class HostReport:
  """What a trainer actor reports about its host (``TrainerRole.host`` in the Ray backend),
  for the driver to order a trainer spanning several hosts (``process_order``).

  Attributes:
    worker_id: the host's TPU worker id in its slice (``host_worker_id``); None off TPU.
    hostname: the host's name (``socket.gethostname()``), for messages.
    address: the host's address the other hosts reach (its Ray node address).
  """
  worker_id: int | None
  hostname: str
  address: str

  def describe(self) -> str:
    return f'{self.hostname} ({self.address})'


def gce_metadata(key: str, timeout: float = 5.0) -> str | None:
  """The TPU VM's metadata attribute ``key`` (``METADATA_URL``), or None when there is none
  (not a GCE VM, no such attribute, no answer within ``timeout`` seconds)."""
  request = urllib.request.Request(METADATA_URL + key, headers={'Metadata-Flavor': 'Google'})
  try:
    with urllib.request.urlopen(request, timeout=timeout) as response:
      return response.read().decode().strip() or None
  except (urllib.error.URLError, OSError):
    return None


def host_worker_id(environ: Mapping[str, str],
                   read_metadata: Callable[[str], str | None] | None = None) -> int | None:
  """The TPU worker id of the host a process runs on: ``TPU_WORKER_ID`` in ``environ`` (GKE
  sets it), else ``read_metadata('agent-worker-number')`` (a TPU VM's metadata:
  ``gce_metadata``; None: not asked, e.g. off TPU), else None.

  Raises:
    ConfigError: a value that is not an int >= 0.
  """
  value, source = environ.get('TPU_WORKER_ID'), 'TPU_WORKER_ID'
  if not value and read_metadata is not None:
    value, source = read_metadata('agent-worker-number'), 'the metadata agent-worker-number'
  if not value:
    return None
  try:
    worker_id = int(value)
  except ValueError:
    worker_id = -1
  if worker_id < 0:
    raise ConfigError(f'{source}={value!r} is not a TPU worker id (an int >= 0); unset '
                      'TPU_WORKER_ID where the host joins Ray, or set it to the host\'s worker '
                      'number in its slice.')
  return worker_id


def process_order(reports: Sequence[HostReport]) -> list[int]:
  """The order of the processes of a trainer spanning several hosts: ``order[p]`` is the
  index in ``reports`` (one per actor, in any order) of process ``p``, the host whose TPU
  worker id is ``p``. Off TPU (no report has a worker id) the reports' own order.

  Raises:
    ConfigError: some hosts report a worker id and others none; two report the same id (two
      actors on one host, or hosts of two slices); the ids are not ``0..len(reports) - 1``
      (a host of the slice is not in the trainer, or an actor runs on another slice).
  """
  count = len(reports)
  ids = [report.worker_id for report in reports]
  if all(worker_id is None for worker_id in ids):
    return list(range(count))
  fix = ('each trainer actor must hold one whole host of one multi-host trainer slice: '
         'ray.trainer_processes = the slice\'s host count, ray.trainer_resources = one host\'s '
         'chips of "TPU" and of a custom resource only the trainer slice\'s hosts have (the '
         'ray recipe, launch/ray, sets both)')
  unknown = [report.describe() for report in reports if report.worker_id is None]
  if unknown:
    raise ConfigError(f'trainer actors on {", ".join(unknown)} have no TPU worker id '
                      '(TPU_WORKER_ID, metadata agent-worker-number) while the others have '
                      f'one: the trainer spans TPU and non-TPU hosts; {fix}.')
  hosts: dict[int, list[int]] = {}  # worker id -> the indices of the reports naming it
  for index, report in enumerate(reports):
    hosts.setdefault(report.worker_id, []).append(index)
  for worker_id, same in sorted(hosts.items()):
    if len(same) > 1:
      raise ConfigError(f'TPU worker id {worker_id} is reported by {len(same)} trainer actors, '
                        f'on {", ".join(reports[i].describe() for i in same)}: two actors on '
                        f'one host, or hosts of two slices; {fix}.')
  missing = sorted(set(range(count)) - set(hosts))
  if missing:
    raise ConfigError(f'the {count} trainer actors report TPU worker ids {sorted(hosts)} '
                      f'({", ".join(f"{r.worker_id}: {r.describe()}" for r in reports)}), but '
                      f'the hosts of a {count}-host slice are workers 0..{count - 1}: worker '
                      f'id(s) {missing} are not in the trainer; {fix}.')
  return [hosts[worker_id][0] for worker_id in range(count)]


def slice_environment(worker_id: int, addresses: Sequence[str], chips: Iterable[int | str],
                      host_chips: int, current: Mapping[str, str]) -> dict[str, str]:
  """The variables for process ``worker_id`` of a trainer spanning a multi-host TPU slice
  (module docstring): libtpu brings the hosts ``addresses`` (every host's, by worker id) up as
  one TPU system in which this process is worker ``worker_id``, the process index JAX is
  given. To put into ``os.environ`` before JAX initialises its backend.

  Args:
    worker_id: this host's TPU worker id, the process's index in the ``jax.distributed`` job.
    addresses: every host's address, by worker id (``len``: the processes).
    chips: the chip ids Ray assigned to this process (all of its host's).
    host_chips: the host's chip count.
    current: the process's environment (``os.environ``): a ``TPU_WORKER_HOSTNAMES`` already
      there (GKE's) is kept; one naming another host count, another ``TPU_WORKER_ID`` or
      ``CLOUD_TPU_TASK_ID``, or a one-process TPU system (``TPU_PROCESS_BOUNDS`` /
      ``TPU_HOST_BOUNDS`` = ``1,1,1``) is refused.

  Returns:
    ``{'TPU_WORKER_ID': ..., 'TPU_WORKER_HOSTNAMES': ...}`` (the latter left out when
    ``current`` has it).

  Raises:
    ConfigError: the process does not hold its whole host, or ``current`` disagrees.
  """
  count = len(addresses)
  held = len({int(chip) for chip in chips})
  if held != host_chips:
    raise ConfigError(
        f'A trainer process of a {count}-host TPU slice holds every chip of its host (libtpu '
        f'brings the hosts up as one TPU system, one process per host); this one was given '
        f'{held} of its host\'s {host_chips} chips. Set the "TPU" count in '
        f'ray.trainer_resources to {host_chips}.')
  if not 0 <= worker_id < count:
    raise ConfigError(f'TPU worker id {worker_id} is not one of the {count} hosts '
                      f'{list(addresses)} (0..{count - 1}).')
  env = {'TPU_WORKER_ID': str(worker_id), 'TPU_WORKER_HOSTNAMES': ','.join(addresses)}
  wrong = {}
  for name in ('TPU_WORKER_ID', 'CLOUD_TPU_TASK_ID'):
    if current.get(name, env['TPU_WORKER_ID']) != env['TPU_WORKER_ID']:
      wrong[name] = f'{name}={env["TPU_WORKER_ID"]!r} (this host\'s worker id)'
  for name in ('TPU_PROCESS_BOUNDS', 'TPU_HOST_BOUNDS'):
    if current.get(name) == '1,1,1':
      wrong[name] = f'no {name} (a one-process TPU system of this host alone)'
  if 'TPU_WORKER_HOSTNAMES' in current:
    given = current['TPU_WORKER_HOSTNAMES'].split(',')
    if len(given) != count:
      wrong['TPU_WORKER_HOSTNAMES'] = f'{count} hosts, as the trainer has'
    del env['TPU_WORKER_HOSTNAMES']
  if wrong:
    raise ConfigError(
        f'The environment of trainer process {worker_id} of {count} has '
        + '; '.join(f'{name}={current[name]!r}, where the multi-host trainer needs {need}'
                    for name, need in wrong.items())
        + '. Unset it where the host joins Ray (`ray start`) and in ray.trainer_env.')
  return env
