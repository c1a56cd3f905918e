"""A run's saved ``config.json`` against a config: read back, compared, and whether it may
resume (docs/checkpoints.md).

A relaunch on a workdir that holds checkpoints resumes only with a config that computes the
same run (``check_resume_config``: every key outside ``RESUMABLE_CHANGES`` equal); an
evaluation reads the run's config back (``saved_config``) and compares it with the one it
runs (``config_changes``, with its own keys that may change). JAX-free, like
``rlax_llm.config``, whose schema (the packaged default config) supplies the types and the
keys added since a run was saved.
"""

from __future__ import annotations

import json

import ml_collections

from rlax_llm.cli import DEFAULT_CONFIG_PATH, load_config_file
from rlax_llm.config import OPEN_GROUPS, in_groups
from rlax_llm.errors import ConfigError

# Keys a resumed run may change (``check_resume_config``): how long it runs, how it is watched,
# checkpointed and placed (the mesh: checkpoints reshard on restore), how many weight
# versions the server keeps, how often a lost Ray worker restarts, over how many processes the
# Ray trainer runs (and their environment), where finished warm-ups are cached, and
# rollout.fault (a removed test knob: runs saved with it resume). Every other key decides
# what the run computes and must equal the checkpointed run's.
RESUMABLE_CHANGES = ('total_steps', 'checkpoint.', 'log.', 'eval.every_steps', 'mesh.',
                     'local.', 'rollout.worker_timeout_s', 'rollout.fault.', 'distributed.',
                     'paramserver.', 'ray.worker_restarts', 'ray.trainer_processes',
                     'ray.trainer_env.', 'name', 'warmup.cache')


def flatten(tree: dict, prefix: str = '') -> dict:
  """A nested dict (a config's JSON) as ``{'a.b.c': value}``."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(flatten(value, f'{prefix}{key}.'))
    else:
      out[f'{prefix}{key}'] = value
  return out


def config_changes(saved: dict, config: ml_collections.ConfigDict,
                   may_change: tuple[str, ...]) -> list[str]:
  """How ``config`` differs from ``saved`` (a run's ``config.json``) in what it computes:
  ``'key: before -> now'`` for every key outside ``may_change`` (prefixes as in
  ``RESUMABLE_CHANGES``), ``[]`` when none does.

  A key the saved config lacks was added to rlax_llm after the run was saved; it passes at
  the packaged default config's value (a new key's default keeps what the code did before it
  existed) and is listed at any other, naming that value."""
  now = flatten(json.loads(config.to_json_best_effort()))
  before = flatten(saved)
  fixed = lambda key: not in_groups(key, may_change)
  added = {key for key in now.keys() - before.keys() if fixed(key)}
  defaults = flatten(json.loads(load_config_file(str(DEFAULT_CONFIG_PATH))
                                .to_json_best_effort())) if added else {}
  expected = before | {key: defaults.get(key, '<absent>') for key in added}
  differ = [key for key in sorted(now.keys() | before.keys())
            if fixed(key) and now.get(key, '<absent>') != expected.get(key, '<absent>')]

  def change(key):
    if key not in added:
      return f'{key}: {before.get(key, "<absent>")!r} -> {now.get(key, "<absent>")!r}'
    default = (f'its default {defaults[key]!r} resumes' if key in defaults
               else 'not in the default config')
    return f'{key}: added since the run was saved, {now[key]!r} ({default})'
  return [change(key) for key in differ]


def check_resume_config(saved: dict, config: ml_collections.ConfigDict) -> None:
  """Raises ``ConfigError`` when ``config`` may not resume a run checkpointed with ``saved``
  (its ``config.json``): every key outside ``RESUMABLE_CHANGES`` must be equal
  (``config_changes``)."""
  differ = config_changes(saved, config, RESUMABLE_CHANGES)
  if differ:
    shown = ', '.join(differ[:5])
    raise ConfigError(
        f'this workdir holds a checkpointed run whose config differs in what it computes '
        f'({shown}{", ..." if len(differ) > 5 else ""}). Resume with the same config (only '
        f'{", ".join(RESUMABLE_CHANGES)} may change), or pass a new --workdir. Nothing was '
        'overwritten.')


def saved_config(saved: dict) -> ml_collections.ConfigDict:
  """A run's ``config.json`` as a ``ConfigDict`` that takes ``--config.KEY=VALUE`` overrides.

  The packaged default config supplies the types of fields saved as ``null`` (an override of
  ``model.path`` is then a string) and keys added since the run was saved (at their default,
  as ``config_changes`` assumes); ``OPEN_GROUPS`` are taken as saved, and keys retired since
  (no longer in the schema, so no longer read) are left out.
  """
  config = load_config_file(str(DEFAULT_CONFIG_PATH))

  def overlay(node: ml_collections.ConfigDict, values: dict, prefix: str) -> None:
    for key, value in values.items():
      name = f'{prefix}{key}'
      if in_groups(name, OPEN_GROUPS):
        node[key] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value
      elif key not in node:
        continue
      elif isinstance(value, dict) and isinstance(node[key], ml_collections.ConfigDict):
        overlay(node[key], value, name + '.')
      else:
        node[key] = value
    for key in set(node.keys()) - set(values):
      if in_groups(f'{prefix}{key}', OPEN_GROUPS):
        del node[key]

  overlay(config, saved, '')
  return config
