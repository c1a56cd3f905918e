"""Models by Hugging Face hub id: ``ORG/NAME`` (at a revision) to a local snapshot directory.

``resolve_model_path(path, revision)`` is the one place a model path becomes a local path
(``from_pretrained`` calls it, so every caller of ``model.path`` goes through it): a path
that exists on this machine is itself; ``ORG/NAME`` that does not is a hub repository,
fetched with ``huggingface_hub.snapshot_download`` into the hub cache (``HF_HOME`` /
``HF_HUB_CACHE``), with the token of ``HF_TOKEN`` or ``hf auth login`` and the offline
setting ``HF_HUB_OFFLINE=1`` (the cache only), all as ``huggingface_hub`` reads them. Only
``ALLOW_PATTERNS`` are fetched. ``is_hub_id`` is the syntactic check the config validation
and the recipes' dry run use (they download nothing).
"""

from __future__ import annotations

import logging
import os
import pathlib
import shlex

from rlax_llm.errors import CheckpointError, ConfigError
# The syntactic check of ``ORG/NAME`` is the leaf module's (the config boundary uses it too).
from rlax_llm.model_spec import is_hub_id

# The files ``from_pretrained`` reads from a Hugging Face model directory: the architecture,
# the generation defaults, the weights as safetensors (one file, or shards and their index)
# and the tokenizer. Never PyTorch pickles (``*.bin``, ``*.pth``), GGUF or ONNX exports.
ALLOW_PATTERNS = ('config.json', 'generation_config.json', '*.safetensors',
                  'model.safetensors.index.json', 'tokenizer.json', 'tokenizer_config.json',
                  'special_tokens_map.json', 'chat_template.jinja')
# Sub-folders (``original/``, ``onnx/``, ...) hold other formats of the same weights; the
# patterns above would match their ``*.safetensors`` too (``*`` spans ``/`` there).
IGNORE_PATTERNS = ('*/*',)

def resolve_model_path(path: str | os.PathLike[str], revision: str = '') -> pathlib.Path:
  """The local path of model ``path`` (an HF directory, a ``.gguf`` file, or a hub id).

  Args:
    path: a path on this machine (returned as is, existing or not: the loader names what is
      missing), or a hub repository id ``ORG/NAME`` (``is_hub_id``).
    revision: for a hub id, a branch, tag or commit sha; '' is the repository's default
      branch. Must be '' for a local path.
  Returns:
    The path, or the hub snapshot directory holding ``ALLOW_PATTERNS``' files of the repo.
  Raises:
    ConfigError: a revision given for a local path.
    CheckpointError: the repository or revision does not exist (or is private), it is gated
      and no token with access was given, it is not in the cache while ``HF_HUB_OFFLINE`` is
      set or the hub cannot be reached, or it holds no ``config.json`` or safetensors weights.
  """
  if not is_hub_id(path):
    if revision:
      raise ConfigError(f'model revision {revision!r} was given for {os.fspath(path)!r}, which '
                        'is a local path, not a hub id (ORG/NAME); leave the revision empty.')
    return pathlib.Path(path)
  return _download(os.fspath(path), revision)


def download_command(repo_id: str, revision: str = '') -> str:
  """The ``hf`` command (huggingface_hub's CLI) that puts what ``resolve_model_path`` needs of
  ``repo_id`` into the hub cache, e.g. before going offline."""
  words = ['hf', 'download', repo_id] + (['--revision', revision] if revision else [])
  words += ['--include', *ALLOW_PATTERNS, '--exclude', *IGNORE_PATTERNS]
  return shlex.join(words)


def _download(repo_id: str, revision: str) -> pathlib.Path:
  # huggingface_hub (and httpx under it) is imported only when a hub id is resolved.
  # pylint: disable=import-outside-toplevel
  import huggingface_hub
  from huggingface_hub import constants
  from huggingface_hub import errors as hub_errors

  where = f'hub model {repo_id!r}' + (f' at revision {revision!r}' if revision else '')
  page = f'{constants.ENDPOINT}/{repo_id}'
  try:
    snapshot = huggingface_hub.snapshot_download(
        repo_id, revision=revision or None, allow_patterns=list(ALLOW_PATTERNS),
        ignore_patterns=list(IGNORE_PATTERNS))
  except (hub_errors.HfHubHTTPError, hub_errors.LocalEntryNotFoundError) as error:
    raise CheckpointError(f'{where}{_fetch_failure(error, repo_id, revision)}') from error
  directory = pathlib.Path(snapshot)
  if not (directory / 'config.json').is_file():
    raise CheckpointError(f'{where} has no config.json at its top level ({page}): not a '
                          'transformers model repository; pick the repository of the model '
                          'itself.')
  if not any(directory.glob('*.safetensors')):
    raise CheckpointError(f'{where} has no *.safetensors weights at its top level ({page}); '
                          'rlax_llm reads safetensors only (never PyTorch *.bin pickles): pick '
                          'a repository that has them, or convert the weights and pass the '
                          'local directory.')
  logging.info('%s: commit %s, in %s', where, directory.name, directory)
  return directory


def _fetch_failure(error: Exception, repo_id: str, revision: str) -> str:
  """What went wrong in ``snapshot_download`` (``error``, one of huggingface_hub's) and the
  fix, to follow the model's name in a message."""
  # pylint: disable=import-outside-toplevel  # huggingface_hub: only when a hub id is resolved
  from huggingface_hub import constants
  from huggingface_hub import errors as hub_errors

  token_hint = ('give a token of an account with access (the HF_TOKEN environment variable, or '
                '`hf auth login`)')
  if isinstance(error, hub_errors.GatedRepoError):
    return f' is gated: accept its terms at {constants.ENDPOINT}/{repo_id} and {token_hint}.'
  if isinstance(error, hub_errors.RepositoryNotFoundError):
    return (f' is not on the hub ({constants.ENDPOINT}) and not a path on this machine: check '
            f'the id (ORG/NAME, as in {constants.ENDPOINT}/ORG/NAME); if the repository is '
            f'private, {token_hint}.')
  if isinstance(error, hub_errors.RevisionNotFoundError):
    return (f': the repository has no revision {revision!r}; give a branch, tag or commit sha '
            'it has, or an empty revision for its default branch.')
  if not isinstance(error, hub_errors.LocalEntryNotFoundError):  # another HTTP error
    return f' could not be fetched from {constants.ENDPOINT}: {error}'
  fetch = download_command(repo_id, revision)  # not (wholly) in the cache
  if constants.HF_HUB_OFFLINE:
    return (f' is not (completely) in the hub cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE '
            'is set, so nothing is downloaded: fetch it first on a machine online with the same '
            f'HF_HOME (`{fetch}`), or unset HF_HUB_OFFLINE.')
  return (f' could not be fetched from {constants.ENDPOINT} and is not (completely) in the hub '
          f'cache {constants.HF_HUB_CACHE}: check the network (HF_ENDPOINT, proxies), or fetch it '
          f'where there is one (`{fetch}`). The hub said: {error}')
