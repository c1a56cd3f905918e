"""The endpoint's HTTP layer: errors in OpenAI's shape, a request body read within a size cap,
who may be served without a token, and the uvicorn server in a thread.

* ``ApiError``: an error answered as ``{"error": {"message", "type", "param", "code"}}``, so
  the official ``openai`` client raises its own exception types.
* ``read_json_body``: the body as a JSON object, refused with a 413 past ``max_bytes``, from
  its ``Content-Length`` before a byte is read, else counted as it streams in (a chunked body),
  never buffered whole first; the 413 closes the connection, so the rest is never read.
* ``check_exposure``: a host that is not loopback without a bearer token is refused unless the
  caller says the network is trusted.
* ``ServerThread``: an ASGI app served by uvicorn in a daemon thread, on a port it binds first.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
import time
from typing import Any

from rlax_llm import extras
from rlax_llm.errors import ConfigError

# The serve extra's packages (MissingExtra without them).
ENDPOINT = 'the OpenAI-compatible endpoint'
fastapi = extras.require('fastapi', ENDPOINT)
uvicorn = extras.require('uvicorn', ENDPOINT)
JSONResponse = fastapi.responses.JSONResponse

# The default cap on a request body: a chat of a few hundred thousand words, far above any
# prompt the engine's prefill takes, far below what would hurt the host's memory.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


class ApiError(Exception):
  """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

  Args:
    status: the HTTP status (400 a malformed request, 401, 404, 409, 413, 429, 500).
    message: what was wrong, the value seen and how to fix it.
    param: the request field at fault, as OpenAI names it (``messages[2].role``), or None.
    code: a machine-readable reason (``invalid_value``, ``unsupported_parameter``, ...).
    kind: OpenAI's error ``type`` (``invalid_request_error``, ``authentication_error``, ...).
  """

  def __init__(self, status: int, message: str, *, param: str | None = None,
               code: str | None = None, kind: str = 'invalid_request_error'):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                    code, kind)

  def response(self) -> JSONResponse:
    """The error as a response; a 413 closes the connection (``Connection: close``), so the
    server reads no more of the body it refused."""
    return JSONResponse({'error': {'message': self.message, 'type': self.kind,
                                   'param': self.param, 'code': self.code}},
                        status_code=self.status,
                        headers={'Connection': 'close'} if self.status == 413 else None)


def _too_large(size: str, max_bytes: int) -> ApiError:
  return ApiError(413, f'the request body is {size}; this endpoint takes at most {max_bytes} '
                  'bytes (shorten the request, or serve with a larger max_request_bytes / '
                  '--max_request_mib).', code='request_too_large')


async def read_json_body(request: fastapi.Request, max_bytes: int) -> dict[str, Any]:
  """The request's body, a JSON object, read at most ``max_bytes`` bytes far.

  A ``Content-Length`` above the cap is refused before any of the body is read; a body without
  one (chunked) is counted as it arrives and refused once it passes the cap, the rest unread.
  Raises ApiError: 413 ``request_too_large``, or 400 for a body that is not a JSON object.
  """
  declared = request.headers.get('content-length')
  if declared is not None:
    if not declared.isdigit():
      raise ApiError(400, f'Content-Length={declared!r} is not a number of bytes.')
    if int(declared) > max_bytes:
      raise _too_large(f'{int(declared)} bytes (Content-Length)', max_bytes)
  chunks, size = [], 0
  async for chunk in request.stream():
    size += len(chunk)
    if size > max_bytes:
      raise _too_large(f'over {max_bytes} bytes ({size} read so far)', max_bytes)
    chunks.append(chunk)
  try:
    body = json.loads(b''.join(chunks))
  except ValueError:
    raise ApiError(400, 'the request body is not valid JSON.') from None
  if not isinstance(body, dict):
    raise ApiError(400, f'the request body must be a JSON object; got {type(body).__name__}.')
  return body


def is_loopback(host: str) -> bool:
  """Whether ``host`` (an address or a name) reaches this machine only: every address it
  resolves to is a loopback address (``127.0.0.0/8``, ``::1``). ``0.0.0.0``, ``::`` and a name
  that does not resolve are not."""
  try:
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
  except (socket.gaierror, UnicodeError):
    return False
  addresses = {info[4][0].split('%')[0] for info in infos}
  return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def check_exposure(host: str, api_key: str | None, allow_unauthenticated_network: bool
                   ) -> None:
  """Refuses to serve the model without a token on an address other machines can reach.

  Raises ConfigError (one line, naming the command line's flags and ``Endpoint``'s arguments)
  when ``host`` is not loopback, ``api_key`` is None and ``allow_unauthenticated_network`` is
  False. (``ServerThread.start`` warns when it serves such a host.)
  """
  if api_key is not None or allow_unauthenticated_network or is_loopback(host):
    return
  raise ConfigError(
      f'--host={host} is not a loopback address and no token is set, so anyone on the network '
      'could use the model: set a token (--api_key_env=NAME; Endpoint(api_key=...)), or, on a '
      'trusted network, pass --allow_unauthenticated_network '
      '(Endpoint(allow_unauthenticated_network=True)).')


class ServerThread:
  """``app`` served by uvicorn in a daemon thread on ``host:port`` (port 0: a free one, known
  as ``port`` once ``start`` returns); ``authenticated``: whether the app requires a token
  (if not, serving a host other than loopback logs a warning)."""

  def __init__(self, app: fastapi.FastAPI, host: str, port: int, authenticated: bool):
    self.app, self.host, self.port, self.authenticated = app, host, port, authenticated
    self._server: uvicorn.Server | None = None
    self._thread: threading.Thread | None = None

  def start(self, timeout_s: float) -> None:
    """Binds the socket and serves; returns once the server accepts requests. Raises
    RuntimeError if it does not within ``timeout_s``."""
    sock = socket.socket(socket.AF_INET6 if ':' in self.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((self.host, self.port))
    self.port = sock.getsockname()[1]
    # A connection still open 5 s after stop() (a client hung mid-call) is closed.
    config = uvicorn.Config(self.app, log_level='warning', lifespan='off',
                            timeout_graceful_shutdown=5)
    self._server = uvicorn.Server(config)
    self._thread = threading.Thread(target=self._server.run, kwargs={'sockets': [sock]},
                                    name='rlax-serve-http', daemon=True)
    self._thread.start()
    if not self.authenticated and not is_loopback(self.host):
      logging.warning('serving on %s:%d without a bearer token: anyone who can reach it can use '
                      'the model (allow_unauthenticated_network).', self.host, self.port)
    deadline = time.monotonic() + timeout_s
    while not self._server.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f'the endpoint did not start on {self.host}:{self.port} within '
                           f'{timeout_s} s.')
      time.sleep(0.01)

  def stop(self) -> None:
    """Stops serving (connections still open after 5 s are closed); a no-op if not started."""
    if self._server is not None:
      self._server.should_exit = True
      self._thread.join()
      self._server = None
