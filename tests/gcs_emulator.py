"""A local GCS emulator for the tests: ``gcp-storage-emulator`` plus generation preconditions.

``gcp-storage-emulator`` serves the GCS JSON API on loopback but ignores ``ifGenerationMatch``
(a second create-if-absent also returns 200), and the workdir lease of ``rlax_llm.storage``
rests on it. ``enforce_preconditions`` wraps the emulator's object handlers (insert, compose,
delete, patch) so that ``ifGenerationMatch=G`` is enforced as GCS does: ``0`` means "only if the object
does not exist", another value "only if its live generation is G"; a failed precondition
answers 412 and changes nothing. The server handles one request at a time (a plain
``http.server.HTTPServer``), so the check and the write cannot interleave with another request.
A resumable upload is checked when it is started (the lease and the workdir's files are small
objects sent in one request). Downloads answer with the object's generation in
``x-goog-generation`` as GCS does (TensorStore, Orbax's storage, reads it to make its
conditional writes) and honour ``ifGenerationMatch`` / ``ifGenerationNotMatch`` (412 / 304).

``running(bucket)`` starts ``python tests/gcs_emulator.py --port N --bucket B`` (in memory,
on a free loopback port) and points this process at it: ``STORAGE_EMULATOR_HOST`` for gcsfs
(``rlax_llm.storage``) and ``TENSORSTORE_GCS_HTTP_URL`` for TensorStore (Orbax's arrays);
child processes inherit both.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from http import HTTPStatus
from unittest import mock

from gcp_storage_emulator import server as server_lib
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

from ports import free_port  # tests/ports.py


def _precondition_failed(response, message: str) -> None:
  response.status = HTTPStatus.PRECONDITION_FAILED
  response.json({'error': {'code': 412, 'message': message,
                           'errors': [{'reason': 'conditionNotMet', 'message': message}]}})


def _object_name(request) -> str | None:
  if 'object_id' in request.params:
    return request.params['object_id']
  if 'name' in request.query:
    return request.query['name'][0]
  data = request.data
  if isinstance(data, dict):
    return (data.get('meta') or data).get('name')
  return None


def _checked(handler):
  """``handler`` that first enforces ``ifGenerationMatch`` on the object it writes."""

  @functools.wraps(handler)
  def wrapper(request, response, storage, *args, **kwargs):
    wanted = request.query.get('ifGenerationMatch')
    if wanted and 'upload_id' not in request.query:
      name = _object_name(request)
      try:
        live = storage.get_file_obj(request.params['bucket_name'], name)['generation']
      except NotFound:
        live = '0'
      if str(live) != wanted[0]:
        _precondition_failed(response, f'ifGenerationMatch={wanted[0]} but the live generation '
                             f'of {name} is {live}')
        return None
    return handler(request, response, storage, *args, **kwargs)

  return wrapper


def _download(handler):
  """``handler`` (a download) with GCS's generation headers and read preconditions."""

  @functools.wraps(handler)
  def wrapper(request, response, storage, *args, **kwargs):
    try:
      obj = storage.get_file_obj(request.params['bucket_name'], request.params['object_id'])
    except NotFound:
      return handler(request, response, storage, *args, **kwargs)
    live = str(obj['generation'])
    match = request.query.get('ifGenerationMatch')
    if match and match[0] != live:
      _precondition_failed(response, f'ifGenerationMatch={match[0]} but the live generation '
                           f'is {live}')
      return None
    not_match = request.query.get('ifGenerationNotMatch')
    if not_match and not_match[0] == live:
      response.status = HTTPStatus.NOT_MODIFIED
      response['x-goog-generation'] = live
      return None
    result = handler(request, response, storage, *args, **kwargs)
    response['x-goog-generation'] = live
    response['x-goog-metageneration'] = str(obj.get('metageneration', '1'))
    return result

  return wrapper


def enforce_preconditions() -> None:
  """Makes the emulator's object writes, metadata patches and deletes honour
  ``ifGenerationMatch``, and its downloads carry and honour generations (``_download``)."""
  names = ('insert', 'compose', 'delete', 'patch', 'download')
  wrapped = {getattr(objects, name): (_download if name == 'download' else _checked)(
      getattr(objects, name)) for name in names}
  for name in names:  # the router also calls objects.insert by name for some upload routes
    setattr(objects, name, wrapped[getattr(objects, name)])
  server_lib.HANDLERS = tuple(
      (regex, {method: wrapped.get(fn, fn) for method, fn in handlers.items()})
      for regex, handlers in server_lib.HANDLERS)


ENV_KEYS = ('STORAGE_EMULATOR_HOST', 'TENSORSTORE_GCS_HTTP_URL')


@contextlib.contextmanager
def running(bucket: str = 'test-bucket', timeout: float = 30.0) -> Iterator[str]:
  """Serves an emulator with ``bucket`` while the block runs, with this process's
  environment pointing at it; yields its URL."""
  port = free_port()
  proc = subprocess.Popen([sys.executable, __file__, '--port', str(port), '--bucket', bucket],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f'http://127.0.0.1:{port}'
  try:
    deadline = time.monotonic() + timeout
    while True:
      try:
        socket.create_connection(('127.0.0.1', port), timeout=1).close()
        break
      except OSError:
        if proc.poll() is not None or time.monotonic() > deadline:
          raise RuntimeError(f'the GCS emulator did not start (exit {proc.poll()})') from None
        time.sleep(0.1)
    with mock.patch.dict(os.environ, dict.fromkeys(ENV_KEYS, url)):  # restored on exit
      yield url
  finally:
    proc.terminate()
    proc.wait(timeout=10)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--port', type=int, required=True)
  parser.add_argument('--bucket', required=True)
  args = parser.parse_args()
  enforce_preconditions()
  server = server_lib.create_server('127.0.0.1', args.port, in_memory=True,
                                    default_bucket=args.bucket)
  server.run()


if __name__ == '__main__':
  main()
