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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rlax_llm.errors import ConfigError

BASE_PORT = 8476
"""libtpu's default slice-builder port; a process on chips ``c..`` listens on ``BASE_PORT + c``."""

CHIPS_PER_PROCESS_BOUNDS = {1: '1,1,1', 2: '1,2,1', 4: '2,2,1', 8: '2,4,1'}
"""Chips in one process -> their block's shape (x,y,z), as libtpu reads it."""

HOST_CHIPS = (1, 4, 8)
"""Chips per TPU VM host: 1 (v5e-1), 4 (v4, v5p, v5e-4, v6e-4 and multi-host slices), 8 (v5e-8,
v6e-8)."""

_RAY_SET = ('TPU_VISIBLE_CHIPS', 'TPU_CHIPS_PER_HOST_BOUNDS', 'TPU_HOST_BOUNDS')


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
