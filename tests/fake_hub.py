"""A stand-in for the Hugging Face hub on loopback: the HTTP routes ``snapshot_download`` uses.

``FakeHub`` serves model and dataset repositories held in memory (``add_commit``) at
``hub.url``: ``GET /api/models/ORG/NAME/revision/REV`` (the commit a branch, tag or sha
names), ``GET /api/models/ORG/NAME/tree/REV`` (the file listing) and ``HEAD``/``GET
/ORG/NAME/resolve/REV/PATH`` (a file, with the ``X-Repo-Commit`` and ``ETag`` headers the
cache is keyed by); for a dataset the same under ``/api/datasets/`` and ``/datasets/``. Errors
carry the hub's ``X-Error-Code`` header (``RepoNotFound``, ``RevisionNotFound``,
``GatedRepo``, ``EntryNotFound``), which ``huggingface_hub`` turns into its own exception
types. ``downloads`` records every file body served, as ``(repo, path)`` where ``repo`` is a
model's id or ``datasets/ORG/NAME``.

``hub_environment(hub, cache)`` points ``huggingface_hub`` at it (or, with ``hub=None``, at
no endpoint: a cache the test laid out, read offline): ``HF_ENDPOINT``, ``HF_HUB_CACHE`` and
``HF_HUB_OFFLINE`` set in ``os.environ`` and ``huggingface_hub.constants`` reloaded (the
library reads them once, at import), as a fresh process with those variables would see them.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import importlib
import json
import os
import threading
import urllib.parse
from collections.abc import Iterator, Mapping


class FakeHub:
  """Model repositories served over HTTP on 127.0.0.1 (use as a context manager)."""

  def __init__(self, token: str = 'hf_test_token'):
    self.token = token  # the one token that opens gated repositories
    self.refs: dict[str, dict[str, str]] = {}  # repo id -> branch or tag -> commit sha
    self.commits: dict[str, dict[str, dict[str, bytes]]] = {}  # repo id -> sha -> files
    self.gated: set[str] = set()
    self.downloads: list[tuple[str, str]] = []  # (repo id, path) of every file body served
    self._server: http.server.ThreadingHTTPServer | None = None

  def add_commit(self, repo_id: str, files: Mapping[str, bytes], *, ref: str = 'main',
                 gated: bool = False, repo_type: str = 'model') -> str:
    """Makes ``files`` (path in the repo -> bytes) a commit of ``repo_id`` (a ``repo_type``
    'model' or 'dataset') that ``ref`` names; returns its sha."""
    repo_id = repo_id if repo_type == 'model' else f'{repo_type}s/{repo_id}'
    digest = hashlib.sha1(repo_id.encode())
    for path in sorted(files):
      digest.update(path.encode() + b'\0' + hashlib.sha256(files[path]).digest())
    sha = digest.hexdigest()
    self.commits.setdefault(repo_id, {})[sha] = dict(files)
    self.refs.setdefault(repo_id, {})[ref] = sha
    if gated:
      self.gated.add(repo_id)
    return sha

  @property
  def url(self) -> str:
    host, port = self._server.server_address[:2]
    return f'http://{host}:{port}'

  def __enter__(self) -> FakeHub:
    hub = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = 'HTTP/1.1'

      def log_message(self, *args):  # quiet
        pass

      def do_HEAD(self):  # noqa: N802 (http.server's name)
        hub._answer(self, body=False)

      def do_GET(self):  # noqa: N802
        hub._answer(self, body=True)

    self._server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    threading.Thread(target=self._server.serve_forever, daemon=True).start()
    return self

  def __exit__(self, *exc_info) -> None:
    self._server.shutdown()
    self._server.server_close()

  # ------------------------------------------------------------------------------ routes

  def _answer(self, request: http.server.BaseHTTPRequestHandler, body: bool) -> None:
    parts = [urllib.parse.unquote(p) for p in urllib.parse.urlsplit(request.path).path.split('/')]
    parts = parts[1:]  # the path starts with '/'
    # A dataset's routes are a model's with 'datasets' before the id: its key here.
    if parts[:2] == ['api', 'datasets'] and len(parts) >= 4:
      parts = ['api', 'models', f'datasets/{parts[2]}', *parts[3:]]
    elif parts[:1] == ['datasets'] and len(parts) >= 3:
      parts = [f'datasets/{parts[1]}', *parts[2:]]
    if parts[:2] == ['api', 'models'] and len(parts) == 4:
      parts += ['revision', 'main']  # repo_info of the default branch
    if parts[:2] == ['api', 'models'] and len(parts) >= 6:
      repo_id, route, revision = '/'.join(parts[2:4]), parts[4], parts[5]
      files = self._files(request, repo_id, revision)
      if files is None:
        return
      sha = self._sha(repo_id, revision)
      if route == 'revision':
        info = {'id': repo_id.removeprefix('datasets/'), 'sha': sha, 'private': False,
                'gated': 'auto' if repo_id in self.gated else False,
                'siblings': [{'rfilename': path} for path in sorted(files)]}
        if not repo_id.startswith('datasets/'):
          info['modelId'] = repo_id
        return self._send(request, 200, json.dumps(info).encode(), body)
      if route == 'tree':
        listing = [{'type': 'file', 'path': path, 'size': len(data),
                    'oid': hashlib.sha1(b'blob %d\0' % len(data) + data).hexdigest()}
                   for path, data in sorted(files.items())]
        return self._send(request, 200, json.dumps(listing).encode(), body)
    if len(parts) >= 5 and parts[2] == 'resolve':
      repo_id, revision, path = '/'.join(parts[:2]), parts[3], '/'.join(parts[4:])
      files = self._files(request, repo_id, revision)
      if files is None:
        return
      if path not in files:
        return self._error(request, 404, 'EntryNotFound', f'{path} not in {repo_id}')
      data = files[path]
      if body:
        self.downloads.append((repo_id, path))
      headers = {'X-Repo-Commit': self._sha(repo_id, revision),
                 'ETag': f'"{hashlib.sha256(data).hexdigest()}"'}
      return self._send(request, 200, data, body, headers)
    return self._error(request, 404, None, f'no route {request.path}')

  def _sha(self, repo_id: str, revision: str) -> str:
    return self.refs[repo_id].get(revision, revision)

  def _files(self, request, repo_id: str, revision: str) -> dict[str, bytes] | None:
    """The files of ``repo_id`` at ``revision``, or None after answering with the error."""
    if repo_id not in self.commits:
      self._error(request, 404, 'RepoNotFound', f'Repository {repo_id} not found')
      return None
    auth = request.headers.get('authorization', '')
    if repo_id in self.gated and auth != f'Bearer {self.token}':
      self._error(request, 401, 'GatedRepo', f'Access to model {repo_id} is restricted.')
      return None
    files = self.commits[repo_id].get(self._sha(repo_id, revision))
    if files is None:
      self._error(request, 404, 'RevisionNotFound', f'Invalid rev id: {revision}')
    return files

  def _error(self, request, status: int, code: str | None, message: str) -> None:
    headers = {'X-Error-Message': message} | ({'X-Error-Code': code} if code else {})
    self._send(request, status, json.dumps({'error': message}).encode(), True, headers)

  @staticmethod
  def _send(request, status: int, data: bytes, body: bool,
            headers: Mapping[str, str] | None = None) -> None:
    request.send_response(status)
    for key, value in (headers or {}).items():
      request.send_header(key, value)
    request.send_header('Content-Length', str(len(data)))
    request.end_headers()
    if body:
      request.wfile.write(data)


@contextlib.contextmanager
def hub_environment(hub: FakeHub | None, cache: os.PathLike[str] | str, *,
                    offline: bool = False, token: str | None = None) -> Iterator[None]:
  """``huggingface_hub`` pointed at ``hub`` (None: the default endpoint, for a cache read
  offline) with the cache ``cache`` (``offline``: reads the cache only; ``token``:
  ``HF_TOKEN``), restored on exit."""
  import huggingface_hub.constants  # pylint: disable=import-outside-toplevel

  values = {'HF_ENDPOINT': hub and hub.url, 'HF_HUB_CACHE': os.fspath(cache),
            'HF_HUB_OFFLINE': '1' if offline else '0', 'HF_TOKEN': token,
            'HF_HUB_DISABLE_PROGRESS_BARS': '1', 'HF_HUB_DISABLE_IMPLICIT_TOKEN': None,
            'TRANSFORMERS_OFFLINE': None, 'NO_PROXY': '127.0.0.1'}
  saved = {key: os.environ.get(key) for key in values}

  def apply(settings):
    for key, value in settings.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value
    importlib.reload(huggingface_hub.constants)

  apply(values)
  try:
    yield
  finally:
    apply(saved)
