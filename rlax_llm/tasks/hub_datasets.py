"""Datasets on the Hugging Face hub (``hf://datasets/ORG/NAME[@REVISION]``) as local files.

``HubDataset(url, config)`` finds one config's splits and the files of each, and
``split_files(split)`` fetches one split's files (only those) into the hub cache through
``huggingface_hub`` and returns their local paths; ``rlax_llm.tasks.files.load_records`` reads
them (Parquet through pyarrow, JSONL). Where a split's files are, in order:

1. the ``configs:`` block of the dataset card (README.md's YAML: ``config_name``,
   ``data_files`` as ``[{split, path}]`` globs, ``default: true``), what the hub's own viewer
   and ``datasets`` read;
2. else the conventional names: ``SPLIT.jsonl``, ``SPLIT-00000-of-00001.parquet`` at the root
   or under ``data/`` (config ``default``), ``CONFIG/SPLIT-*.parquet``, ``CONFIG/SPLIT/*``;
3. else, when those are absent or in a format read here neither (CSV, a loading script), the
   hub's own Parquet conversion, the revision ``refs/convert/parquet``
   (``CONFIG/SPLIT/0000.parquet``), for datasets read at their default revision.

The settings are huggingface_hub's own, as it reads them (at its import), the same as for
models by hub id (``rlax_llm/models/files/hub.py``): ``HF_HUB_OFFLINE`` (read the cache only),
``HF_HUB_CACHE`` / ``HF_HOME`` (where the cache is), ``HF_ENDPOINT`` (a mirror) and
``HF_TOKEN`` or ``hf auth login`` (private and gated datasets). Offline, a dataset is read
from the snapshot its revision names in the cache, with the files cached there.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rlax_llm.extras import HUB_PREFIX

PARQUET_REVISION = 'refs/convert/parquet'
DEFAULT_CONFIG = 'default'


def _hub():
  """huggingface_hub, imported on first use (heavy: only tasks reading the hub need it), or
  ImportError with the install command."""
  try:
    # Lazy (heavy: only the tasks reading the hub need it); the submodules load on import.
    import huggingface_hub.constants  # pylint: disable=import-outside-toplevel
    import huggingface_hub.errors  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ImportError("reading hf:// datasets needs huggingface_hub, which is not installed; "
                      "run `pip install huggingface_hub` (or install rlax_llm with the 'data' "
                      'extra), or download the files and give their paths.') from None
  return huggingface_hub


def is_hub_url(path: object) -> bool:
  """Whether ``path`` names a hub location (a str starting with ``hf://``)."""
  return isinstance(path, str) and path.startswith(HUB_PREFIX)


def parse_dataset_url(url: str) -> tuple[str, str | None]:
  """``(repo_id, revision)`` of ``hf://datasets/ORG/NAME[@REVISION]`` (huggingface_hub's
  ``parse_hf_uri``). Raises ValueError for another form, naming the expected one."""
  hub = _hub()
  expected = 'write hf://datasets/ORG/NAME or hf://datasets/ORG/NAME@REVISION'
  try:
    uri = hub.parse_hf_uri(url)
  except hub.errors.HfUriError as e:
    raise ValueError(f'{url!r} is not a hub dataset ({e}); {expected}.') from None
  if uri.type != 'dataset':
    raise ValueError(f'{url!r} names a hub {uri.type}, not a dataset; {expected}.')
  if uri.path_in_repo:
    raise ValueError(f'{url!r} names a file or folder inside the dataset; {expected} and '
                     'choose its files with the hf_config and split options.')
  return uri.id, uri.revision


def _glob_regex(pattern: str) -> re.Pattern:
  """A ``data_files`` glob as the hub reads it: ``**`` crosses folders, ``*`` and ``?`` do
  not."""
  out = []
  for part in re.split(r'(\*\*/?|\*|\?)', pattern):
    if part.startswith('**'):
      out.append('(?:.*/)?' if part.endswith('/') else '.*')
    elif part == '*':
      out.append('[^/]*')
    elif part == '?':
      out.append('[^/]')
    else:
      out.append(re.escape(part))
  return re.compile(''.join(out))


Layout = dict[str, dict[str, list[str]]]  # config -> split -> repo paths


def card_layout(card_data: Mapping[str, Any], files: Sequence[str]) -> tuple[Layout, str | None]:
  """The configs a dataset card declares (``card_data['configs']``), with each split's files
  among ``files``, and the config marked ``default: true`` (or None)."""
  layout: Layout = {}
  default = None
  for entry in card_data.get('configs') or ():
    if not isinstance(entry, Mapping):
      continue
    name = str(entry.get('config_name', DEFAULT_CONFIG))
    if entry.get('default'):
      default = name
    data_files = entry.get('data_files')
    if isinstance(data_files, (str, list)) and all(isinstance(d, str) for d in
                                                   ([data_files] if isinstance(data_files, str)
                                                    else data_files)):
      data_files = [{'split': 'train', 'path': data_files}]
    elif isinstance(data_files, Mapping):
      data_files = [{'split': k, 'path': v} for k, v in data_files.items()]
    splits: dict[str, list[str]] = {}
    for item in data_files or ():
      if not isinstance(item, Mapping) or 'split' not in item:
        continue
      patterns = item.get('path', ())
      patterns = [patterns] if isinstance(patterns, str) else list(patterns)
      regexes = [_glob_regex(p) for p in patterns]
      splits[str(item['split'])] = [f for f in files if any(r.fullmatch(f) for r in regexes)]
    layout[name] = splits
  return layout, default


def conventional_layout(files: Sequence[str], suffixes: Sequence[str]) -> Layout:
  """Configs and splits of data files named by convention (module docstring), among the
  files ending in one of ``suffixes``: ``SPLIT.ext`` or ``data/SPLIT-*.ext`` (config
  ``default``), ``CONFIG/SPLIT-*.ext``, ``CONFIG/SPLIT/*.ext``, ``CONFIG/partial-SPLIT/*.ext``
  (the hub's Parquet conversion of a large split). A split name starts with a letter and
  ends at the first ``-`` or ``.`` of the file name."""
  layout: Layout = {}
  for path in files:
    if not path.lower().endswith(tuple(suffixes)):
      continue
    parts = path.split('/')
    named = re.match(r'([A-Za-z][A-Za-z0-9_]*)(?:[-.]|$)', parts[-1])
    if len(parts) == 1 and named:
      config, split = DEFAULT_CONFIG, named[1]
    elif len(parts) == 2 and named:
      config, split = (DEFAULT_CONFIG if parts[0] == 'data' else parts[0]), named[1]
    elif len(parts) == 2:
      config, split = DEFAULT_CONFIG, parts[0]
    elif len(parts) == 3:
      config, split = parts[0], parts[1].removeprefix('partial-')
    else:
      continue
    layout.setdefault(config, {}).setdefault(split, []).append(path)
  return layout


class HubDataset:
  """One config of a dataset on the hub: its splits and, on demand, their files.

  Attributes: ``url``; ``repo_id``; ``revision`` (what is read: the URL's, None for the
  default branch, or ``refs/convert/parquet``); ``config``; ``splits`` (split name -> the
  paths of its files in the repository).
  """

  def __init__(self, url: str, config: str = '', suffixes: Sequence[str] = ('.parquet',)):
    """Lists the dataset's files (online: the hub's listing; offline: the cached snapshot),
    reads its card and picks ``config`` ('' for the card's default, ``default``, or the only
    one). ``suffixes``: the file types the caller reads (others send it to the Parquet
    conversion). Raises ValueError for a bad URL, a missing dataset, revision or config (the
    configs listed), an unreachable hub or a dataset missing from the cache offline."""
    self.url = url
    self.repo_id, self.revision = parse_dataset_url(url)
    self.offline = bool(_hub().constants.HF_HUB_OFFLINE)
    self._snapshots: dict[str | None, pathlib.Path] = {}
    suffixes = tuple(s.lower() for s in suffixes)
    self.config, self.splits = config, {}
    files = self._list_files(self.revision)
    layout, default = card_layout(self._card_data(self.revision, files), files)
    if not layout:
      layout = conventional_layout(files, suffixes)
    if layout:
      self.config = self._choose(layout, config, default)
      self.splits = layout[self.config]
    usable = any(self.splits.values()) and all(
        p.lower().endswith(suffixes) for paths in self.splits.values() for p in paths)
    if not usable and self.revision is None:
      self.revision = PARQUET_REVISION
      layout = conventional_layout(self._list_files(self.revision), ('.parquet',))
      if layout:
        self.config = self._choose(layout, config, None)
        self.splits = layout[self.config]
        usable = True
    if not usable:
      found = sorted(files)[:20]
      raise ValueError(f'{self.url}: no data files this reader takes ({", ".join(suffixes)}) '
                       f'were found for its splits, and no Parquet conversion '
                       f'({PARQUET_REVISION}) to fall back on; files: {found}. Convert the '
                       'data to Parquet or JSONL, or download it and give the files as path.')

  def __repr__(self) -> str:
    return (f'HubDataset({self.repo_id!r}, revision={self.revision!r}, '
            f'config={self.config!r}, splits={sorted(self.splits)})')

  def split_files(self, split: str) -> list[pathlib.Path]:
    """Local paths of ``split``'s files, fetched into the hub cache when online (only these
    files). Raises ValueError for a split the config lacks (listing those it has) or files
    absent from the cache offline."""
    if split not in self.splits:
      raise ValueError(f'{self.url} (config {self.config!r}) has no split {split!r}; its '
                       f'splits: {sorted(self.splits)}.')
    paths = sorted(self.splits[split])
    if not paths or self.offline:
      folder = self._snapshots.get(self.revision)
    else:
      with self._hub_errors(self.revision):
        folder = pathlib.Path(_hub().snapshot_download(
            **self._repo(self.revision), **self._cached(), allow_patterns=paths))
    local = [folder / p for p in paths]
    if self.offline and (not paths or not all(f.is_file() for f in local)):
      raise ValueError(f'{self.url}: split {split!r} is not in the hub cache '
                       f'{_hub().constants.HF_HUB_CACHE} and HF_HUB_OFFLINE is set; run once '
                       f'online (unset HF_HUB_OFFLINE) or `hf download {self.repo_id} '
                       '--repo-type=dataset`.')
    if not paths:
      raise ValueError(f'{self.url} (config {self.config!r}): the card names files for split '
                       f'{split!r} but none of the dataset\'s files match them.')
    return local

  def _choose(self, layout: Layout, config: str, default: str | None) -> str:
    if config:
      if config not in layout:
        raise ValueError(f'{self.url} has no config {config!r}; its configs: '
                         f'{sorted(layout)} (set hf_config to one of them).')
      return config
    for name in (default, DEFAULT_CONFIG):
      if name in layout:
        return name
    if len(layout) == 1:
      return next(iter(layout))
    raise ValueError(f'{self.url} has several configs and no default: {sorted(layout)}; set '
                     'hf_config to one of them.')

  def _list_files(self, revision: str | None) -> list[str]:
    """The repository's file paths at ``revision``: the hub's listing, or offline those of
    the cached snapshot."""
    hub = _hub()
    with self._hub_errors(revision):
      if not self.offline:
        return hub.HfApi().list_repo_files(**self._repo(revision))
      # allow_patterns=[]: only resolve the cached snapshot (no file is required to be there).
      folder = pathlib.Path(hub.snapshot_download(**self._repo(revision), **self._cached(),
                                                  allow_patterns=[]))
    self._snapshots[revision] = folder
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob('*') if p.is_file())

  def _card_data(self, revision: str | None, files: Sequence[str]) -> Mapping[str, Any]:
    """The YAML of the dataset card (README.md), or {} when there is none."""
    if 'README.md' not in files:
      return {}
    if self.offline:
      path = self._snapshots[revision] / 'README.md'
    else:
      with self._hub_errors(revision):
        path = _hub().hf_hub_download(**self._repo(revision), **self._cached(),
                                      filename='README.md')
    return _hub().DatasetCard.load(path).data.to_dict()

  def _repo(self, revision: str | None) -> dict[str, Any]:
    """The arguments naming this dataset at ``revision`` to huggingface_hub."""
    return {'repo_id': self.repo_id, 'repo_type': 'dataset', 'revision': revision}

  def _cached(self) -> dict[str, Any]:
    """The arguments of huggingface_hub's downloads: offline, the cache only."""
    return {'local_files_only': self.offline}

  @contextlib.contextmanager
  def _hub_errors(self, revision: str | None):
    """huggingface_hub's errors inside as ValueErrors saying what to do."""
    errors, constants = _hub().errors, _hub().constants
    where = self.url if revision == self.revision else f'{self.url} (revision {revision})'
    try:
      yield
    except errors.GatedRepoError:
      raise ValueError(f'{where} is gated: accept its conditions on its hub page, then set '
                       'HF_TOKEN to a token of that account.') from None
    except errors.RepositoryNotFoundError:
      raise ValueError(f'{where}: no such dataset on the hub ({constants.ENDPOINT}); check the '
                       'name (if it is private, set HF_TOKEN to a token with access).') from None
    except errors.RevisionNotFoundError:
      raise ValueError(f'{where}: the dataset has no revision {revision!r}.') from None
    except (errors.LocalEntryNotFoundError, errors.IncompleteSnapshotError,
            errors.OfflineModeIsEnabled) as e:
      if self.offline or isinstance(e, errors.OfflineModeIsEnabled):
        raise ValueError(f'{where} is not in the hub cache {constants.HF_HUB_CACHE} and '
                         'HF_HUB_OFFLINE is set; run once online (unset HF_HUB_OFFLINE) or `hf '
                         f'download {self.repo_id} --repo-type=dataset`.') from None
      raise ValueError(f'{where}: the hub ({constants.ENDPOINT}) could not be reached and the '
                       f'dataset is not cached: {e}') from None
    except errors.HfHubHTTPError as e:
      raise ValueError(f'{where}: the hub answered {e}') from None
    except Exception as e:  # pylint: disable=broad-except  # transport errors: no hub base class
      name = type(e).__name__.lower()
      if 'connect' not in name and 'timeout' not in name:
        raise
      raise ValueError(f'{where}: the hub ({constants.ENDPOINT}) could not be reached '
                       f'({type(e).__name__}: {e}); check the network, or set HF_HUB_OFFLINE=1 '
                       'to read what the hub cache holds.') from None
