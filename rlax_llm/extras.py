"""Optional dependencies: the extra that installs each, their one import helper, and the check
a command makes before any compute.

``pip install rlax_llm`` alone runs the default config (``configs/default.py``: the local
backend, a local workdir, a generated task). What only some runs need is an extra of
``pyproject.toml``, and every import of such a package goes through ``require``, which raises
``MissingExtra`` (an ``RlaxError``, so the command line prints one ``error: ...`` line) naming
the extra to install:

    ray        backend='ray' (rlax_llm/backends/ray.py)
    gcs        a gs:// workdir, checkpoint or file (gcsfs, rlax_llm/storage.py)
    envs       env.name='grid' (gymnasium's FrozenLake, rlax_llm/envs/grid.py)
    math       task.scorer='math' (math-verify, run in the workers of tasks/math_scorer.py)
    serve      python -m rlax_llm.serve, env.name='harness' (fastapi, uvicorn, openai)
    data       Parquet task files and hf:// datasets (pyarrow, rlax_llm/tasks/files.py)
    jetstream  the JetStream adapter (rlax_llm/rollout/jetstream_adapter.py)
    all        ray, gcs, envs, math, serve and data

``check_config`` finds what a config needs (``needed``) and refuses a launch, an evaluation
or an endpoint in one line, before JAX starts, when any of it is missing; it looks packages
up without importing them (``importlib.util.find_spec``: math-verify's sympy and Ray take
seconds to import). Task data read through pyarrow counts too (Parquet files, and datasets
on the Hugging Face hub, whose splits are Parquet files or the hub's Parquet conversion):
refused before the task downloads or reads anything.
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from collections.abc import Iterable, Mapping
from typing import Any

from rlax_llm.errors import MissingExtra

# An optional package's top-level module -> the extra of pyproject.toml that installs it.
EXTRAS: dict[str, str] = {
    'ray': 'ray',
    'gcsfs': 'gcs',
    'gymnasium': 'envs',
    'math_verify': 'math',
    'fastapi': 'serve',
    'uvicorn': 'serve',
    'openai': 'serve',
    'pyarrow': 'data',
    'jetstream': 'jetstream',
    'grpc': 'jetstream',
}
# The modules each extra provides (those ``check_config`` looks for).
MODULES: dict[str, tuple[str, ...]] = {
    extra: tuple(m for m, e in EXTRAS.items() if e == extra)
    for extra in dict.fromkeys(EXTRAS.values())}

# google-jetstream's own declared dependencies pull TensorFlow: it is installed without them.
_JETSTREAM_PACKAGE = "pip install --no-deps 'google-jetstream==0.2.2'"
# The prefix of a gs:// URL (storage.GCS_SCHEME is this one: storage imports this module).
GCS_SCHEME = 'gs://'
# Task data that needs the data extra (pyarrow): files with these suffixes
# (rlax_llm.tasks.files reads them as Parquet) and hub datasets, paths with this prefix
# (rlax_llm.tasks.hub_datasets; the tasks import both from here).
PARQUET_SUFFIXES = ('.parquet', '.pq')
HUB_PREFIX = 'hf://'


def install_command(*extras: str) -> str:
  """The pip command installing ``extras`` (names of ``MODULES``), e.g.
  ``pip install 'rlax_llm[ray,envs]'``; the JetStream adapter's package is a second command."""
  unknown = sorted(set(extras) - set(MODULES))
  if unknown or not extras:
    raise ValueError(f'install_command{extras!r}: unknown or no extras {unknown}; choose from '
                     f'{sorted(MODULES)}.')
  names = ','.join(dict.fromkeys(extras))
  command = f"pip install 'rlax_llm[{names}]'"
  return command + (f' and {_JETSTREAM_PACKAGE}' if 'jetstream' in extras else '')


def extra_of(module: str) -> str:
  """The extra that installs ``module`` (a dotted name: its top-level package counts).
  Raises ValueError for a module that no extra installs."""
  root = module.partition('.')[0]
  if root not in EXTRAS:
    raise ValueError(f'no extra installs {module!r}; the optional packages are '
                     f'{sorted(EXTRAS)} (rlax_llm.extras.EXTRAS).')
  return EXTRAS[root]


def require(module: str, why: str) -> types.ModuleType:
  """``module`` imported (``importlib.import_module``), or ``MissingExtra`` naming its extra.

  module: the dotted name of an optional package or of one of its submodules (its top-level
    package is a key of ``EXTRAS``), e.g. ``'gymnasium.envs.toy_text.frozen_lake'``.
  why: what needs it, the start of the one-line message, e.g. ``"backend='ray'"``.
  Raises MissingExtra: ``"backend='ray' needs the ray extra: pip install 'rlax_llm[ray]'"``;
  when the package is there but something it imports is not, the message adds that import
  error.
  """
  extra = extra_of(module)
  try:
    return importlib.import_module(module)
  except ImportError as e:
    root = module.partition('.')[0]
    missing = getattr(e, 'name', None) or ''
    message = f'{why} needs the {extra} extra: {install_command(extra)}'
    if missing.partition('.')[0] != root:
      detail = ' '.join(str(e).split())
      message += f' ({root} is installed but does not import: {detail})'
    raise MissingExtra(message) from None


def available(module: str) -> bool:
  """Whether ``module`` (a top-level package name) is importable, without importing it."""
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):
    return False


def _get(group: Any, key: str, default: Any = None) -> Any:
  if isinstance(group, Mapping) or hasattr(group, 'get'):
    return group.get(key, default)
  return getattr(group, key, default)


def _strings(value: Any) -> Iterable[str]:
  """Every str in a config (a ConfigDict, mapping or sequence, nested)."""
  if hasattr(value, 'to_dict'):
    value = value.to_dict()
  if isinstance(value, str):
    yield value
  elif isinstance(value, Mapping):
    for item in value.values():
      yield from _strings(item)
  elif isinstance(value, (list, tuple)):
    for item in value:
      yield from _strings(item)


def needed(config: Any, paths: Iterable[str | None] = (), *,
           backend: bool = True) -> dict[str, str]:
  """The extras a run of ``config`` needs: ``{extra: what needs it}``, in ``MODULES`` order.

  config: a run config (``ml_collections.ConfigDict`` or a mapping with the default config's
    groups; a group it lacks needs nothing).
  paths: the command's paths outside the config (``--workdir``, ``--checkpoint``; None
    ignored); a ``gs://`` one needs gcs, as does a ``gs://`` string in the config. A task or
    environment string naming Parquet data (``PARQUET_SUFFIXES``) or a hub dataset
    (``HUB_PREFIX``) needs data.
  backend: whether the roles are placed by ``config.backend`` (a launch) rather than on one
    local worker (evaluation, the endpoint).
  """
  env, task = _get(config, 'env', {}) or {}, _get(config, 'task', {}) or {}
  why: dict[str, str] = {}
  if backend and _get(config, 'backend') == 'ray':
    why['ray'] = "backend='ray'"
  urls = [p for p in [*paths, *_strings(config)]
          if isinstance(p, str) and p.startswith(GCS_SCHEME)]
  if urls:
    why['gcs'] = f'the gs:// path {urls[0]!r}'
  if _get(env, 'name') == 'grid':
    why['envs'] = "env.name='grid'"
  # MathTask's scorer defaults to 'math' (math-verify; tests/test_extras.py checks it).
  if _get(task, 'name') == 'math' and _get(task, 'scorer', 'math') == 'math':
    why['math'] = "task.name='math' with scorer='math'"
  if _get(env, 'name') == 'harness':
    why['serve'] = "env.name='harness' (the endpoint its agent harness calls)"
  data = [text for text in [*_strings(task), *_strings(env)]
          if text.startswith(HUB_PREFIX) or text.endswith(PARQUET_SUFFIXES)]
  if data:
    kind = 'hub dataset' if data[0].startswith(HUB_PREFIX) else 'Parquet data'
    why['data'] = f'the {kind} {data[0]!r}'
  return {extra: why[extra] for extra in MODULES if extra in why}


def check_config(config: Any, paths: Iterable[str | None] = (), *,
                 backend: bool = True) -> None:
  """Raises ``MissingExtra`` in one line, before any compute, when an extra that ``config``
  needs (``needed``, same arguments) is not installed, e.g. ``"backend='ray' needs the ray
  extra, env.name='grid' needs the envs extra: pip install 'rlax_llm[ray,envs]'"``."""
  missing = {extra: why for extra, why in needed(config, paths, backend=backend).items()
             if not all(available(module) for module in MODULES[extra])}
  if missing:
    reasons = ', '.join(f'{why} needs the {extra} extra' for extra, why in missing.items())
    raise MissingExtra(f'{reasons}: {install_command(*missing)}')
