"""Finished supervised warm-ups shared by runs: ``warmup.cache`` (docs/config.md).

A warm-up is deterministic: the same model, task (or environment), warm-up settings, seed,
mesh and software train the same params, bit for bit. Runs that differ only in what comes
after it (the RL loss and its settings, the schedule, evaluation, logging, checkpoints) can
share one: a learning-rate sweep, a study's arms and seeds, a test suite. With
``warmup.cache=DIR`` (a local path or ``gs://``) each finished warm-up is kept at
``DIR/<fingerprint>``, in the format of a run's own ``checkpoints/warmup``
(``checkpoint.save_warmup``), and a run whose fingerprint is there restores it instead of
training. The run's own ``checkpoints/warmup`` is written either way, so resuming a run never
needs the cache.

The fingerprint (``fingerprint``) hashes everything a warm-up may read: the whole config less
the keys in ``NOT_READ`` (what runs after the warm-up, or how the run is placed and watched),
the trainer mesh's axes and sizes, the devices' kind, the process count, the versions of
jax, jaxlib, flax and optax, a digest of rlax_llm's own source files (so an edited model or
warm-up misses) and ``XLA_FLAGS`` (some flags change a reduction's order, so its bits). A
key missing from ``NOT_READ`` is hashed: a new config key can cost a miss, never a wrong
hit. What it cannot see is a file changed in place: a checkpoint or dataset rewritten under
the same path and revision; clear the cache (delete ``DIR``) after such a change.

The default config reads ``warmup.cache`` from the environment variable
``RLAX_LLM_WARMUP_CACHE`` (unset: no cache), as a machine-wide setting like JAX's
``JAX_COMPILATION_CACHE_DIR``; ``--config.warmup.cache=`` overrides it.

An entry appears whole or not at all on a local disk (written to a temporary directory, then
renamed; of two runs finishing the same warm-up at once the first rename wins). On ``gs://``
it is written in place, Orbax's commit file last, so a reader takes an unfinished entry for a
miss. An unreadable entry is a miss too (logged), and the run trains its warm-up.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import shutil
import uuid
from typing import Any

import jax
import jaxlib
import ml_collections

from rlax_llm import checkpoint, storage
from rlax_llm.config import in_groups
from rlax_llm.run_config import flatten

# Config keys (prefixes as ``config.in_groups`` reads them) that no warm-up reads: left out of
# the fingerprint, so runs differing only in these share a warm-up. The mesh section is
# replaced by the trainer mesh itself. ``READ_RL_KEYS``: the RL keys the warm-up does read
# (``roles.warm_trainer``), hashed although ``rl.`` is in ``NOT_READ``.
NOT_READ = ('name', 'total_steps', 'backend', 'checkpoint.', 'distributed.', 'eval.', 'local.',
            'log.', 'mesh.', 'paramserver.', 'ray.', 'reward.', 'rl.', 'rollout.', 'staleness.',
            'teacher.', 'agent.num_eval', 'agent.eval_seed_start', 'agent.timeout_s',
            'agent.max_concurrent_episodes', 'warmup.cache')
READ_RL_KEYS = ('rl.max_nonfinite_updates',)


@functools.cache
def _source_digest() -> str:
  """SHA-256 of rlax_llm's Python source files (paths and bytes), once per process."""
  root = pathlib.Path(__file__).resolve().parent
  digest = hashlib.sha256()
  for path in sorted(root.rglob('*.py')):
    digest.update(str(path.relative_to(root)).encode() + b'\0' + path.read_bytes() + b'\0')
  return digest.hexdigest()


def fingerprint(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> str:
  """The hex SHA-256 naming ``config``'s warm-up on ``mesh`` in a cache (module docstring)."""
  keys = {key: value for key, value in flatten(json.loads(config.to_json_best_effort())).items()
          if key in READ_RL_KEYS or not in_groups(key, NOT_READ)}
  device = mesh.devices.flat[0]
  what = {'config': keys, 'mesh': {str(k): int(v) for k, v in mesh.shape.items()},
          'device_kind': device.device_kind, 'platform': device.platform,
          'processes': jax.process_count(), 'jax': jax.__version__,
          'jaxlib': jaxlib.__version__, 'flax': importlib.metadata.version('flax'),
          'optax': importlib.metadata.version('optax'), 'rlax_llm': _source_digest(),
          'xla_flags': os.environ.get('XLA_FLAGS', '')}
  return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def restore(cache: str, key: str, params: Any) -> tuple[Any, dict[str, float]] | None:
  """The warm-up cached under ``key`` in the directory ``cache``, onto ``params``' shardings,
  with its metrics; None on a miss (no entry, an unfinished one, or an unreadable one)."""
  path = storage.absolute(cache) / key
  try:
    return checkpoint.restore_warmup(path, params)
  except Exception as error:  # pylint: disable=broad-except  (a bad entry is a miss)
    logging.warning('warm-up cache entry %s is unreadable (%s: %s); training the warm-up '
                    'instead.', path, type(error).__name__, str(error).splitlines()[0][:300]
                    if str(error) else '')
    return None


def save(cache: str, key: str, params: Any, metrics: dict[str, float]) -> None:
  """Adds a finished warm-up to ``cache`` under ``key`` (an existing entry is kept)."""
  root = storage.absolute(cache)
  path = root / key
  if storage.is_gcs(root) or jax.process_count() > 1:
    checkpoint.save_warmup(path, params, metrics)  # in place: Orbax commits it last
    return
  if path.exists():
    return
  root.mkdir(parents=True, exist_ok=True)
  staging = root / f'.{key}.{uuid.uuid4().hex}'
  checkpoint.save_warmup(staging, params, metrics)
  try:
    storage.rename_dir(staging, path)
  except OSError:  # another run added it first: keep theirs (the same bits)
    shutil.rmtree(staging, ignore_errors=True)
