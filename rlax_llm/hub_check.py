"""The Hugging Face hub ids a config names, checked before a launch (a dry run, ``--print_config``).

A config may name a model by hub id (``model.path='ORG/NAME'``, ``model.revision``) and a
task's data as a hub dataset (``task.path='hf://datasets/ORG/NAME[@REVISION]'``); the hosts
fetch both when the run starts. ``verify(config)`` checks them here first, downloading
nothing:

* with the hub reachable, each id exists at its revision (``HfApi.model_info`` /
  ``dataset_info``: metadata only, no weights); a missing one is refused with the ids of the
  same owner that are closest to it (a did-you-mean), a missing revision is refused, a gated
  one is noted (the hosts need ``HF_TOKEN``);
* without it (``HF_HUB_OFFLINE`` set, or no connection to the hub's endpoint within
  ``CONNECT_TIMEOUT_S``: one TCP connect, no retries) nothing is asked, and one note says what
  was not verified. The config is then validated without reading the hub dataset
  (``validate_config(read_hub=False)``: the task's class and fields only).

A config that names no hub id touches no network.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import socket
import urllib.parse
import urllib.request
from typing import Any

import ml_collections

from rlax_llm.errors import ConfigError
from rlax_llm.model_spec import is_hub_id
from rlax_llm.tasks import hub_datasets

CONNECT_TIMEOUT_S = 2.0  # the reachability probe: one TCP connect to the hub's endpoint
REQUEST_TIMEOUT_S = 10.0  # each metadata request once the hub answered the probe
_SUGGESTIONS_LISTED = 1000  # ids of the owner looked through for a did-you-mean


@dataclasses.dataclass(frozen=True)
class HubId:
  """One hub repository a config names: ``key`` (``config.model.path``), ``kind`` (``model``
  or ``dataset``), ``repo_id``, ``revision`` (None: the default branch), ``shown`` (the value
  as the config spells it)."""
  key: str
  kind: str
  repo_id: str
  revision: str | None
  shown: str


def hub_ids(config: ml_collections.ConfigDict) -> list[HubId]:
  """The hub repositories ``config`` names: ``model.path`` when it is a hub id and not a path
  on this machine, ``task.path`` when it is a hub dataset URL (ValueError for a malformed
  one, from ``hub_datasets.parse_dataset_url``)."""
  out = []
  model = config.get('model', ml_collections.ConfigDict())
  path = model.get('path')
  if isinstance(path, str) and is_hub_id(path) and not os.path.exists(path):
    out.append(HubId('config.model.path', 'model', path, model.get('revision') or None, path))
  task_path = config.get('task', ml_collections.ConfigDict()).get('path')
  if hub_datasets.is_hub_url(task_path):
    repo_id, revision = hub_datasets.parse_dataset_url(task_path)
    out.append(HubId('config.task.path', 'dataset', repo_id, revision, task_path))
  return out


def offline_reason(timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
  """Why the hub cannot be asked, or None when it can: ``HF_HUB_OFFLINE`` set (as
  huggingface_hub reads it), or no TCP connection to its endpoint (``HF_ENDPOINT``), or to the
  proxy the environment names for it, within ``timeout_s``."""
  from huggingface_hub import constants  # pylint: disable=import-outside-toplevel  # heavy
  if constants.HF_HUB_OFFLINE or os.environ.get('HF_HUB_OFFLINE', '').lower() in ('1', 'true',
                                                                                 'yes', 'on'):
    return 'HF_HUB_OFFLINE is set'
  endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
  # Behind a proxy (HTTPS_PROXY and the like, as huggingface_hub's client reads them) the
  # connection that must open is the proxy's.
  proxy = urllib.request.getproxies().get(endpoint.scheme)
  if proxy and not urllib.request.proxy_bypass(endpoint.hostname):
    endpoint = urllib.parse.urlsplit(proxy if '://' in proxy else f'http://{proxy}')
  port = endpoint.port or (443 if endpoint.scheme == 'https' else 80)
  try:
    with socket.create_connection((endpoint.hostname, port), timeout=timeout_s):
      return None
  except OSError:
    return 'no network'


def _closest(api: Any, item: HubId) -> list[str]:
  """The id of ``item``'s owner closest to it, if one is close (the hub's listing; [] when it
  fails)."""
  owner = item.repo_id.split('/')[0]
  listing = api.list_models if item.kind == 'model' else api.list_datasets
  try:
    ids = [info.id for info in listing(author=owner, limit=_SUGGESTIONS_LISTED)]
  except Exception:  # pylint: disable=broad-except  # a suggestion is optional
    return []
  return difflib.get_close_matches(item.repo_id, ids, n=1, cutoff=0.8)


def _check(api: Any, item: HubId) -> tuple[str, bool]:
  """One id asked of the hub: ``(line, answered)``, the line saying it was found (or that the
  hub did not answer: ``answered`` False), or ConfigError."""
  from huggingface_hub import errors  # pylint: disable=import-outside-toplevel
  info = api.model_info if item.kind == 'model' else api.dataset_info
  at = item.revision or 'its default branch'
  try:
    found = info(item.repo_id, revision=item.revision, timeout=REQUEST_TIMEOUT_S)
  except errors.GatedRepoError:
    return (f'{item.key}={item.shown!r} is on the hub and gated: accept its conditions on its '
            'hub page and set HF_TOKEN on the hosts to a token of that account.'), True
  except errors.RevisionNotFoundError:
    key = 'config.model.revision' if item.kind == 'model' else item.key
    raise ConfigError(f'{key}: the hub {item.kind} {item.repo_id} has no revision '
                      f'{item.revision!r}; give a branch, tag or commit sha it has (\'\' for its '
                      'default branch).') from None
  except errors.RepositoryNotFoundError:
    close = _closest(api, item)
    hint = f' (did you mean {close[0]!r}?)' if close else ''
    raise ConfigError(f'{item.key}={item.shown!r}: no such {item.kind} on the hub{hint}; check '
                      'the id (a private one needs HF_TOKEN set to a token with access).'
                      ) from None
  except (errors.HfHubHTTPError, OSError) as e:
    return (f'{item.key}={item.shown!r} not verified: the hub did not answer '
            f'({type(e).__name__}); the run fetches it when it starts.'), False
  sha = getattr(found, 'sha', None)
  return (f'{item.key}={item.shown!r}: the hub {item.kind} exists at {at}'
          + (f' (commit {sha[:12]})' if sha else '') + '; nothing was downloaded.'), True


def verify(config: ml_collections.ConfigDict, api: Any = None,
           offline: str | None | bool = False) -> tuple[bool, list[str]]:
  """Checks the hub ids ``config`` names (module docstring).

  Args:
    config: the run's config.
    api: the ``huggingface_hub.HfApi`` to ask (default: a new one; tests pass a fake).
    offline: why the hub cannot be asked (a str), None when it can, or False (the default)
      to find out (``offline_reason``).
  Returns:
    ``(online, lines)``: whether the hub answered (so ``validate_config`` may read the hub
    dataset: ``read_hub=online``), and one line per id checked, or one line saying what was
    not verified.
  Raises:
    ConfigError: an id the hub says does not exist (with a did-you-mean when one is close),
      or a revision it does not have.
  """
  try:
    ids = hub_ids(config)
  except ValueError as e:
    raise ConfigError(f'config.task.path: {e}') from None
  if not ids:
    return True, []
  reason = offline_reason() if offline is False else offline
  if reason is not None:
    kinds = [k for k in ('model', 'dataset') if any(i.kind == k for i in ids)]
    kinds = ' and '.join(kinds) + (' ids' if len(ids) > 1 else ' id')
    return False, [f'{kinds} not verified: {reason} (offline); the run fetches '
                   + ', '.join(i.shown for i in ids) + ' when it starts'
                   + (' and reads the task\'s data then' if any(i.kind == 'dataset'
                                                                 for i in ids) else '')]
  if api is None:
    from huggingface_hub import HfApi  # pylint: disable=import-outside-toplevel
    api = HfApi()
  checked = [_check(api, item) for item in ids]
  return all(answered for _, answered in checked), [line for line, _ in checked]
