"""Hub datasets laid out on disk exactly as huggingface_hub caches them, and a fake hub.

``cache_dataset(cache, 'org/name', {path: bytes})`` writes
``datasets--org--name/{blobs/SHA256, refs/REVISION, snapshots/COMMIT/PATH -> ../../blobs/..}``;
``use_cache(monkeypatch, cache)`` points this process's hub settings at it, offline.
``cache_shipped_datasets(cache)`` writes small stand-ins of the datasets configs/math.py names
(GSM8K's card and Parquet layout, MATH-500's root ``test.jsonl``). ``FakeHub`` serves
datasets on loopback with the hub's HTTP API (what huggingface_hub calls to list and download
files; use it as ``HF_ENDPOINT``) and records the files it sent.
"""

import hashlib
import http.server
import io
import json
import os
import pathlib
import threading
import urllib.parse

import pyarrow
import pyarrow.parquet as pq


def parquet_bytes(rows: list[dict]) -> bytes:
  sink = io.BytesIO()
  pq.write_table(pyarrow.Table.from_pylist(rows), sink)
  return sink.getvalue()


def jsonl_bytes(rows: list[dict]) -> bytes:
  return ''.join(json.dumps(r) + '\n' for r in rows).encode()


def card_bytes(configs: dict[str, dict[str, str]], default: str | None = None) -> bytes:
  """A README.md whose YAML declares ``configs`` as {config: {split: path glob}}."""
  lines = ['---', 'configs:']
  for name, splits in configs.items():
    lines.append(f'- config_name: {name}')
    if name == default:
      lines.append('  default: true')
    lines.append('  data_files:')
    for split, path in splits.items():
      lines += [f'  - split: {split}', f'    path: {path}']
  return ('\n'.join(lines + ['---', '# A test dataset', ''])).encode()


def commit_of(repo_id: str, revision: str) -> str:
  return hashlib.sha1(f'{repo_id}@{revision}'.encode()).hexdigest()


def cache_dataset(cache: pathlib.Path, repo_id: str, files: dict[str, bytes],
                  revision: str = 'main') -> pathlib.Path:
  """Writes ``files`` as the cached snapshot of ``repo_id`` at ``revision``; returns the
  snapshot folder."""
  repo = pathlib.Path(cache) / ('datasets--' + repo_id.replace('/', '--'))
  commit = commit_of(repo_id, revision)
  snapshot = repo / 'snapshots' / commit
  for path, data in files.items():
    blob = repo / 'blobs' / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = snapshot / path
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
  ref = repo / 'refs' / revision
  ref.parent.mkdir(parents=True, exist_ok=True)
  ref.write_text(commit)
  return snapshot


def use_cache(monkeypatch, cache: pathlib.Path, offline: bool = True) -> None:
  """This process's hub settings: ``cache``, offline or not (also huggingface_hub's own flag,
  read at its import, which an earlier test may have made under HF_HUB_OFFLINE=1), no token."""
  from huggingface_hub import constants  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv('HF_HUB_CACHE', str(cache))
  monkeypatch.setenv('HF_HUB_OFFLINE', '1' if offline else '0')
  monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', offline)
  monkeypatch.delenv('HF_TOKEN', raising=False)


def gsm8k_rows(count: int, start: int = 0) -> list[dict]:
  """GSM8K-shaped records: a worked answer with calculator notes, the final one after ####."""
  return [{'question': f'Natalia sold {i} clips in April and half as many in May. How many '
                       'clips did she sell altogether?',
           'answer': f'She sold {i}/2 = <<{i}/2={i // 2}>>{i // 2} in May.\n'
                     f'#### {i + i // 2}'}
          for i in range(2 * start + 2, 2 * (start + count) + 2, 2)]


def math500_rows(count: int) -> list[dict]:
  """MATH-500-shaped records: problem, solution with \\boxed{}, the bare answer, subject."""
  return [{'problem': f'Compute ${i} \\cdot \\frac{{1}}{{{i + 1}}}$.',
           'solution': f'It is $\\boxed{{\\frac{{{i}}}{{{i + 1}}}}}$.',
           'answer': f'\\frac{{{i}}}{{{i + 1}}}', 'subject': 'Algebra', 'level': 1,
           'unique_id': f'test/algebra/{i}.json'} for i in range(1, count + 1)]


def cache_shipped_datasets(cache: pathlib.Path) -> None:
  """Small stand-ins of openai/gsm8k (configs main and socratic) and HuggingFaceH4/MATH-500."""
  cache_dataset(cache, 'openai/gsm8k', {
      'README.md': card_bytes({'main': {'train': 'main/train-*', 'test': 'main/test-*'},
                               'socratic': {'train': 'socratic/train-*',
                                            'test': 'socratic/test-*'}}),
      'main/train-00000-of-00001.parquet': parquet_bytes(gsm8k_rows(40)),
      'main/test-00000-of-00001.parquet': parquet_bytes(gsm8k_rows(200, start=100)),
      'socratic/train-00000-of-00001.parquet': parquet_bytes(gsm8k_rows(3, start=200)),
      'socratic/test-00000-of-00001.parquet': parquet_bytes(gsm8k_rows(3, start=300)),
  })
  cache_dataset(cache, 'HuggingFaceH4/MATH-500', {'test.jsonl': jsonl_bytes(math500_rows(120))})


class FakeHub:
  """The hub's dataset API on 127.0.0.1 (``url``) over ``repos``: {repo_id: {revision:
  {path: bytes}}}; ``gated`` repos answer 401 GatedRepo. ``downloads`` lists the file paths
  sent (GET), ``requests`` every (method, path)."""

  def __init__(self, repos: dict[str, dict[str, dict[str, bytes]]], gated: tuple = ()):
    self.repos, self.gated = repos, set(gated)
    self.downloads: list[str] = []
    self.requests: list[tuple[str, str]] = []
    hub = self

    class Handler(http.server.BaseHTTPRequestHandler):

      def log_message(self, *args):  # quiet
        pass

      def do_HEAD(self):  # pylint: disable=invalid-name
        hub._serve(self, body=False)

      def do_GET(self):  # pylint: disable=invalid-name
        hub._serve(self, body=True)

    self.server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    self.url = f'http://127.0.0.1:{self.server.server_address[1]}'
    self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
    self.thread.start()

  def close(self) -> None:
    self.server.shutdown()
    self.server.server_close()

  def _files(self, repo: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
    for name, files in self.repos.get(repo, {}).items():
      if revision in (name, commit_of(repo, name)):
        return commit_of(repo, name), files
    return None

  def _serve(self, handler, body: bool) -> None:
    url = urllib.parse.urlsplit(handler.path)
    self.requests.append((handler.command, url.path))
    parts = [urllib.parse.unquote(p) for p in url.path.split('/')[1:]]

    def reply(status, data=b'', headers=None, error=None):
      handler.send_response(status)
      for key, value in (headers or {}).items():
        handler.send_header(key, value)
      if error:
        handler.send_header('X-Error-Code', error)
        handler.send_header('X-Error-Message', error)
      handler.send_header('Content-Length', str(len(data)))
      handler.end_headers()
      if body:
        handler.wfile.write(data)

    api = parts[:2] == ['api', 'datasets']
    start = 2 if api else 1
    if (not api and parts[:1] != ['datasets']) or len(parts) < start + 2:
      return reply(404, error='EntryNotFound')
    repo = '/'.join(parts[start:start + 2])
    rest = parts[start + 2:]
    if repo not in self.repos:
      return reply(404, error='RepoNotFound')
    if repo in self.gated:
      return reply(401, error='GatedRepo')
    if api and (not rest or rest[0] == 'revision'):
      found = self._files(repo, rest[1] if rest else 'main')
      if found is None:
        return reply(404, error='RevisionNotFound')
      info = {'id': repo, 'sha': found[0], 'private': False,
              'siblings': [{'rfilename': p} for p in found[1]]}
      return reply(200, json.dumps(info).encode(), {'Content-Type': 'application/json'})
    if api and rest[0] == 'tree':
      found = self._files(repo, rest[1])
      if found is None:
        return reply(404, error='RevisionNotFound')
      tree = [{'type': 'file', 'path': p, 'size': len(d),
               'oid': hashlib.sha1(d).hexdigest()} for p, d in found[1].items()]
      return reply(200, json.dumps(tree).encode(), {'Content-Type': 'application/json'})
    if not api and rest[:1] == ['resolve'] and len(rest) >= 3:
      found = self._files(repo, rest[1])
      path = '/'.join(rest[2:])
      if found is None or path not in found[1]:
        return reply(404, error='EntryNotFound')
      data = found[1][path]
      if body:
        self.downloads.append(path)
      return reply(200, data, {'X-Repo-Commit': found[0],
                               'ETag': f'"{hashlib.sha256(data).hexdigest()}"'})
    return reply(404, error='EntryNotFound')
