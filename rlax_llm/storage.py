"""Where a run's files live: one layer for local paths and ``gs://`` URLs.

A workdir is a URL: a local path or ``gs://BUCKET/...``. Everything a run writes
(``config.json``, ``metrics.jsonl``, ``ledger.jsonl``, ``summary.json``, TensorBoard events,
evaluation outputs, the workdir's claim) goes through this module; checkpoints go through
Orbax, which writes ``gs://`` itself (TensorStore for the arrays, ``etils.epath`` for the
rest). Paths are ``etils.epath.Path`` values, the path type Orbax uses: local paths behave as
``pathlib`` paths, ``gs://`` paths go through ``gcsfs`` (fsspec; the ``gcs`` extra,
``pip install 'rlax_llm[gcs]'``).

* ``path(url)``: the path of a URL or local path; ``is_gcs(path)``: whether it is ``gs://``.
* ``write_text_atomic(path, text)``: a reader sees the old content or the new one, never a
  part. Locally a temporary file, fsync and ``os.replace``; on GCS one object upload, which is
  atomic.
* ``AppendLog(path)``: append-only JSON-lines files (``metrics.jsonl``, ``ledger.jsonl``,
  evaluation outputs). Locally an ``open(path, 'a')`` flushed after each write (a crash may
  leave a torn last line, which readers skip). Object stores have no append: on GCS each
  ``append`` uploads its lines as a part object ``.NAME.part-<hex>`` and composes
  ``NAME + part -> NAME`` (GCS compose, atomic, guarded by the generation this writer last
  wrote), then deletes the part. A host that dies mid-append leaves ``NAME`` as it was (an
  upload is all or nothing, so is a compose): a reader never sees a torn line. The part it
  leaves behind is removed by the next ``AppendLog`` on that file.
* ``create_exclusive``, ``read_lease``, ``renew_lease``, ``delete_if_generation``: the object
  primitives of the workdir's lease on GCS (``rlax_llm.workdir_claim``): an object created only if
  absent (``ifGenerationMatch=0``), its metadata renewed and deleted only while its generation
  is the one the holder created.
* ``listdir``, ``read_bytes``, ``upload_file``, ``rename_dir``, ``absolute``: what the
  workdir's readers and writers need beyond ``epath``. Listings are never cached, epath's
  included (gcsfs caches them by default, and other processes, Orbax's TensorStore among
  them, write the workdir).

GCS credentials are Google's application default credentials (a TPU VM's service account,
``gcloud auth application-default login``); ``gcsfs`` and TensorStore both read them. The
first ``path`` of a bucket checks them and the bucket once (``check_bucket``: one listing, no
retries), so a command given a bucket it cannot use (no credentials, no such bucket, no
permission, no network) fails in seconds with one ``WorkdirError`` naming the fix. Against a
local emulator set ``STORAGE_EMULATOR_HOST`` (gcsfs) and ``TENSORSTORE_GCS_HTTP_URL``
(TensorStore, Orbax's array storage) to its URL: this module then talks to it anonymously and
turns off gcsfs's first probe of a bucket's type over gRPC (an emulator does not answer it and
gcsfs waits a minute before falling back).

GCS allows about one write per second to one object name; the run writes ``metrics.jsonl`` and
``ledger.jsonl`` once per step (gcsfs retries a throttled write), so steps much shorter than a
second run slower on ``gs://`` than on a local disk.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import secrets
import shutil
import threading
from typing import Any

from etils import epath

from rlax_llm import extras
from rlax_llm.errors import WorkdirError, WorkdirInUse

GCS_SCHEME = extras.GCS_SCHEME  # 'gs://': where a path needs the gcs extra is decided there
_GCS_PROTOCOLS = ('gs', 'gcs')  # the names fsspec (and so epath) looks gcsfs up by
_PART_PREFIX = '.part-'  # leftover-append objects: .NAME.part-<hex> beside NAME

Path = epath.Path

_FS_LOCK = threading.Lock()
_FS: dict[str | None, Any] = {}  # gcsfs filesystems by emulator URL (None: GCS), made on use


def path(url: str | os.PathLike) -> epath.Path:
  """The path of ``url``: a local path (relative or absolute) or a ``gs://BUCKET/...`` URL.

  The first ``gs://`` path of a bucket in a process checks that the bucket can be used
  (``check_bucket``), so a command given an unusable one fails in seconds with the fix."""
  text = os.fspath(url)
  if text.startswith(GCS_SCHEME):
    check_bucket(text)  # first: gcsfs's own search for credentials takes 15 s when there are none
    _gcs()  # configures gcsfs for epath before its first gs:// use (emulator, gRPC probe)
  return epath.Path(text)


def is_gcs(p: str | os.PathLike) -> bool:
  """Whether ``p`` is a ``gs://`` URL."""
  return os.fspath(p).startswith(GCS_SCHEME)


def absolute(p: str | os.PathLike) -> epath.Path:
  """``p`` made absolute (a local path against the working directory; a URL as it is)."""
  return path(p) if is_gcs(p) else epath.Path(pathlib.Path(p).absolute())


def _emulator() -> str | None:
  """The GCS emulator's URL when one is configured (``STORAGE_EMULATOR_HOST``), else None."""
  host = os.environ.get('STORAGE_EMULATOR_HOST', '')
  if host in ('', 'default'):
    return None
  return host if host.startswith(('http://', 'https://')) else f'http://{host}'


def _gcsfs_banner(record: logging.LogRecord) -> bool:
  """False for gcsfs's import-time INFO line ``gcsfs experimental features enabled ...``."""
  return not record.getMessage().startswith('gcsfs experimental features enabled')


def _require_gcsfs() -> Any:
  """``gcsfs.core`` (MissingExtra naming the gcs extra without it), imported without the
  banner gcsfs logs at import on every run (``_gcsfs_banner``)."""
  logging.getLogger('gcsfs').addFilter(_gcsfs_banner)
  return extras.require('gcsfs.core', f'a {GCS_SCHEME} path')


def _gcs() -> Any:
  """The gcsfs filesystem (listings uncached) of GCS or of the configured emulator."""
  emulator = _emulator()
  with _FS_LOCK:
    if emulator not in _FS:
      # Lazy: gcsfs (aiohttp, google-auth; the gcs extra) is needed only for gs:// paths.
      import fsspec  # pylint: disable=import-outside-toplevel
      gcsfs_core = _require_gcsfs()
      kwargs: dict[str, Any] = {'use_listings_cache': False}
      # Other processes and TensorStore (Orbax's array writer) write the workdir, so epath's
      # gcsfs (Orbax's, made by fsspec) must not answer from a cached listing either; a
      # user's own fsspec setting wins.
      fsspec.config.conf.setdefault('gs', {}).setdefault('use_listings_cache', False)
      # fsspec logs an INFO line for each file it opens (its readahead cache): one per object
      # read, which drowns a run's log.
      logging.getLogger('fsspec.caching').setLevel(logging.WARNING)
      if emulator is not None:
        # The core filesystem: gcsfs's default one first probes each bucket's type over gRPC,
        # which an emulator does not serve (a minute's wait per bucket). epath (and so Orbax)
        # looks the class up by protocol, so it gets the same one.
        for protocol in _GCS_PROTOCOLS:
          fsspec.register_implementation(protocol, gcsfs_core.GCSFileSystem, clobber=True)
        kwargs.update(token='anon', endpoint_url=emulator)
      _FS[emulator] = (gcsfs_core.GCSFileSystem(**kwargs) if emulator is not None
                       else fsspec.filesystem('gs', **kwargs))
    return _FS[emulator]


_CHECKED: set[tuple[str | None, str]] = set()  # (emulator URL, bucket) found usable
GCS_API = 'https://storage.googleapis.com'
_GCS_SCOPE = 'https://www.googleapis.com/auth/devstorage.read_write'
BUCKET_CHECK_TIMEOUT_S = 10.0  # the one request that checks a bucket (no retries)


def check_bucket(url: str | os.PathLike) -> None:
  """Checks that ``url``'s bucket can be used from this machine, once per bucket and process:
  credentials (Google's application default credentials; none against an emulator) and one
  listing of at most one object under the URL's prefix, without retries, within
  ``BUCKET_CHECK_TIMEOUT_S``. gcsfs would otherwise retry each failing request for about a
  minute and end in pages of aiohttp tracebacks.

  Raises:
    WorkdirError: one line naming the fix: no credentials or expired ones (``gcloud auth
      application-default login``), a bucket that does not exist, one the credentials may
      not read, or GCS not reachable.
  """
  bucket, prefix = _bucket_object(url)
  emulator = _emulator()
  if (emulator, bucket) in _CHECKED:
    return
  _require_gcsfs()
  # Lazy: google-auth and requests come with gcsfs (the gcs extra, which _gcs required).
  import requests  # pylint: disable=import-outside-toplevel
  where = f'{GCS_SCHEME}{bucket}'
  login = ('run `gcloud auth application-default login` (on a VM or in a pod: give it a '
           f'service account with read and write on {where})')
  headers = {}
  if emulator is None:
    import google.auth  # pylint: disable=import-outside-toplevel
    import google.auth.exceptions  # pylint: disable=import-outside-toplevel
    import google.auth.transport.requests  # pylint: disable=import-outside-toplevel
    try:
      credentials, _ = google.auth.default(scopes=[_GCS_SCOPE])
      credentials.refresh(google.auth.transport.requests.Request())
    except google.auth.exceptions.DefaultCredentialsError:
      raise WorkdirError(f'{url}: this machine has no Google credentials for GCS; {login}.'
                         ) from None
    except google.auth.exceptions.RefreshError as e:
      raise WorkdirError(f'{url}: the Google credentials were refused ({_first_line(e)}); '
                         f'{login}.') from None
    except google.auth.exceptions.TransportError as e:
      raise WorkdirError(f'{url}: GCS could not be reached to sign in ({_first_line(e)}); '
                         'check the network.') from None
    headers['Authorization'] = f'Bearer {credentials.token}'
  api = emulator or GCS_API
  try:
    answer = requests.get(f'{api}/storage/v1/b/{bucket}/o', headers=headers,
                          params={'maxResults': '1', 'prefix': prefix, 'fields': 'kind'},
                          timeout=BUCKET_CHECK_TIMEOUT_S)
  except requests.RequestException as e:
    raise WorkdirError(f'{url}: GCS ({api}) could not be reached ({type(e).__name__}); check '
                       'the network.') from None
  if answer.status_code == 404:
    raise WorkdirError(f'{url}: the bucket {bucket!r} does not exist; create it (`gcloud '
                       f'storage buckets create {where} --location=REGION`, in the TPU\'s '
                       'region) or fix the name.')
  if answer.status_code in (401, 403):
    refused = 'refused the credentials' if answer.status_code == 401 else 'refused access'
    raise WorkdirError(f'{url}: GCS {refused} to bucket {bucket!r} (HTTP {answer.status_code}'
                       f'{": " + _first_line(_message(answer)) if _message(answer) else ""}); '
                       f'grant this account read and write there (roles/storage.objectUser '
                       f'on {where}), or {login}.')
  if answer.status_code >= 400:
    raise WorkdirError(f'{url}: GCS answered HTTP {answer.status_code} listing bucket '
                       f'{bucket!r} ({_first_line(_message(answer))}).')
  _CHECKED.add((emulator, bucket))


def _message(answer: Any) -> str:
  """The ``error.message`` of a GCS JSON error answer, else its text."""
  try:
    return str(answer.json()['error']['message'])
  except (ValueError, KeyError, TypeError):
    return answer.text or ''


def _first_line(error: object) -> str:
  return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _key(p: str | os.PathLike) -> str:
  """``bucket/object`` of a ``gs://`` URL, as gcsfs names it."""
  return os.fspath(p)[len(GCS_SCHEME):]


def _bucket_object(p: str | os.PathLike) -> tuple[str, str]:
  bucket, _, name = _key(p).partition('/')
  return bucket, name


# ---------------------------------------------------------------------- reading, listing


def read_bytes(p: str | os.PathLike) -> bytes:
  """The content of the file (object) ``p``; FileNotFoundError when there is none."""
  if is_gcs(p):
    return _gcs().cat_file(_key(p))
  return pathlib.Path(p).read_bytes()


def read_text(p: str | os.PathLike, encoding: str = 'utf-8') -> str:
  """The content of ``p`` decoded; FileNotFoundError when there is none."""
  return read_bytes(p).decode(encoding)


def listdir(p: str | os.PathLike) -> list[str]:
  """The names directly under the directory (prefix) ``p``, fresh from the store; ``[]`` when
  there is none."""
  if is_gcs(p):
    fs = _gcs()
    try:
      entries = fs.ls(_key(p), detail=False, refresh=True)
    except FileNotFoundError:
      return []
    prefix = _key(p).rstrip('/') + '/'
    return sorted({e[len(prefix):].split('/')[0] for e in entries if e.startswith(prefix)} - {''})
  directory = pathlib.Path(p)
  return sorted(q.name for q in directory.iterdir()) if directory.is_dir() else []


# ----------------------------------------------------------------------------- writing


def write_text_atomic(p: str | os.PathLike, text: str, encoding: str = 'utf-8') -> None:
  """Writes ``text`` to ``p`` so readers see the old file or the new one, never a part.

  Local: a temporary file in the same directory, fsynced, ``os.replace``d onto ``p``, then the
  directory fsynced (best effort); the file gets mode 0666 minus the umask, like
  ``open(p, 'w')``. Not for ``.lock``: replacing the lock file would break the claim.
  GCS: one upload of the object (GCS replaces an object atomically).
  """
  if is_gcs(p):
    _gcs().pipe_file(_key(p), text.encode(encoding))
    return
  p = pathlib.Path(p)
  tmp = p.with_name(f'.{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp')
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
  try:
    with os.fdopen(fd, 'w', encoding=encoding) as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, p)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  try:
    dir_fd = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY)
  except OSError:
    return
  try:
    os.fsync(dir_fd)
  except OSError:
    pass
  finally:
    os.close(dir_fd)


def upload_file(local: str | os.PathLike, p: str | os.PathLike) -> None:
  """Copies the local file ``local`` to ``p`` (one upload on GCS: atomic)."""
  if is_gcs(p):
    _gcs().put_file(os.fspath(local), _key(p))
  else:
    shutil.copyfile(local, p)


def rename_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
  """Moves the directory ``src`` to ``dst`` (on GCS: copies every object, then deletes)."""
  if is_gcs(src):
    _gcs().mv(_key(src), _key(dst), recursive=True)
  else:
    pathlib.Path(src).rename(dst)


class AppendLog:
  """An append-only file whose appends are whole lines (see the module docstring).

  Args:
    p: the file (local path or ``gs://`` URL); created on the first append if absent.
  """

  def __init__(self, p: str | os.PathLike):
    self.path = path(p)
    self._file = None
    self._generation: int | None = None
    if is_gcs(self.path):
      fs = _gcs()
      self._remove_parts(fs)
      try:
        self._generation = int(fs.info(_key(self.path))['generation'])
      except FileNotFoundError:
        self._generation = 0  # absent: created by the first append
    else:
      self._file = open(self.path, 'a', encoding='utf-8')  # noqa: SIM115 (open until close)

  def _remove_parts(self, fs: Any) -> None:
    """Deletes the part objects an append that died before its compose left behind."""
    stem = f'{_key(self.path.parent)}/.{self.path.name}{_PART_PREFIX}'
    for name in listdir(self.path.parent):
      if f'{_key(self.path.parent)}/{name}'.startswith(stem):
        fs.rm_file(f'{_key(self.path.parent)}/{name}')

  def append(self, text: str) -> None:
    """Appends ``text`` (whole lines, each ending with a newline) and makes it durable to
    readers: flushed locally, composed into the object on GCS."""
    if self._file is not None:
      self._file.write(text)
      self._file.flush()
      return
    data = text.encode('utf-8')
    bucket, name = _bucket_object(self.path)
    fs = _gcs()
    if not self._generation:
      self._generation = _upload(fs, bucket, name, data, if_generation_match=0)
      return
    part_name = f'{name.rpartition("/")[0]}/.{self.path.name}{_PART_PREFIX}{secrets.token_hex(6)}'
    _upload(fs, bucket, part_name, data)
    self._generation = _compose(fs, bucket, name, [name, part_name], self._generation)
    fs.rm_file(f'{bucket}/{part_name}')

  def close(self) -> None:
    """Closes the local file (GCS appends are already in the object). Idempotent."""
    if self._file is not None:
      self._file.close()


def _precondition_error(p: str, what: str) -> WorkdirInUse:
  return WorkdirInUse(f'{p} was changed by another writer while this one {what} (its GCS '
                      'generation is not the one this writer last wrote); two runs may share '
                      'this workdir. Stop the other run, or pass another --workdir.')


def _upload(fs: Any, bucket: str, name: str, data: bytes, if_generation_match: int | None = None,
            metadata: dict[str, str] | None = None) -> int:
  """One multipart upload of ``data`` to ``bucket/name``; returns the new generation.

  ``if_generation_match``: the upload happens only if the live generation is that one
  (0: only if the object does not exist), else FileExistsError (GCS answers 412).
  """
  resource = {'name': name, **({'metadata': metadata} if metadata else {})}
  boundary = f'rlax{secrets.token_hex(8)}'
  body = (f'--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n'
          f'{json.dumps(resource)}\r\n--{boundary}\r\n'
          'Content-Type: application/octet-stream\r\n\r\n').encode() + data + (
              f'\r\n--{boundary}--').encode()
  params = {} if if_generation_match is None else {'ifGenerationMatch': str(if_generation_match)}
  out = fs.call('POST', f'{fs._location}/upload/storage/v1/b/{{}}/o', bucket,  # pylint: disable=protected-access
                uploadType='multipart', data=body, json_out=True,
                headers={'Content-Type': f'multipart/related; boundary={boundary}'}, **params)
  fs.invalidate_cache(f'{bucket}/{name}')
  return int(out['generation'])


def _compose(fs: Any, bucket: str, name: str, sources: list[str], if_generation_match: int
             ) -> int:
  """GCS compose of ``sources`` into ``name``, only if ``name``'s live generation is
  ``if_generation_match``; returns the new generation."""
  try:
    out = fs.call('POST', 'b/{}/o/{}/compose', bucket, name, json_out=True,
                  ifGenerationMatch=str(if_generation_match),
                  json={'kind': 'storage#composeRequest', 'destination': {'name': name},
                        'sourceObjects': [{'name': s} for s in sources]})
  except FileExistsError:
    raise _precondition_error(f'gs://{bucket}/{name}', 'appended to it') from None
  fs.invalidate_cache(f'{bucket}/{name}')
  return int(out['generation'])


# ---------------------------------------------------------------- the lease's primitives


def create_exclusive(p: str | os.PathLike, data: bytes, metadata: dict[str, str]) -> int:
  """Creates the object ``p`` with ``data`` and custom ``metadata`` only if it does not exist
  (``ifGenerationMatch=0``); returns its generation. FileExistsError when it exists."""
  bucket, name = _bucket_object(p)
  return _upload(_gcs(), bucket, name, data, if_generation_match=0, metadata=metadata)


def read_lease(p: str | os.PathLike) -> tuple[int, dict[str, str]] | None:
  """The generation and custom metadata of the object ``p``, read together (one request);
  None when it does not exist."""
  bucket, name = _bucket_object(p)
  fs = _gcs()
  try:
    out = fs.call('GET', 'b/{}/o/{}', bucket, name, json_out=True)
  except FileNotFoundError:
    return None
  return int(out['generation']), dict(out.get('metadata') or {})


def renew_lease(p: str | os.PathLike, generation: int, metadata: dict[str, str]) -> bool:
  """Replaces the custom metadata of ``p`` if its generation is still ``generation``;
  False when the object is gone or was replaced (another holder took it over)."""
  bucket, name = _bucket_object(p)
  try:
    _gcs().call('PATCH', 'b/{}/o/{}', bucket, name, json={'metadata': metadata},
                ifGenerationMatch=str(generation), json_out=True)
  except (FileExistsError, FileNotFoundError):
    return False
  return True


def delete_if_generation(p: str | os.PathLike, generation: int) -> bool:
  """Deletes ``p`` if its generation is ``generation``; False when it is gone or another."""
  bucket, name = _bucket_object(p)
  fs = _gcs()
  try:
    fs.call('DELETE', 'b/{}/o/{}', bucket, name, ifGenerationMatch=str(generation))
  except (FileExistsError, FileNotFoundError):
    return False
  finally:
    fs.invalidate_cache(f'{bucket}/{name}')
  return True
