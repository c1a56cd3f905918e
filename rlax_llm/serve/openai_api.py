"""The OpenAI-compatible endpoint: an agent harness written against the OpenAI API, trained.

``Endpoint(worker, model_name=...)`` serves, in-process (uvicorn in a thread, 127.0.0.1 by
default, optional bearer token):

* ``GET /v1/models``: the one model served.
* ``POST /v1/completions``: a text prompt, or token ids (a list of ints).
* ``POST /v1/chat/completions``: messages rendered by the model's chat template (a tokenizer
  without one: their texts concatenated, ``PlainRenderer``); ``tools``
  presented in the checkpoint's own tool format (``rlax_llm.envs.tool_calls``), tool calls in
  the reply parsed with that format's parser and returned as OpenAI ``tool_calls``
  (``finish_reason`` ``'tool_calls'``). A malformed call comes back as plain content, counted.
* ``POST /v1/episodes/{id}/reward``: closes an episode with its reward (or the endpoint's
  ``reward_fn``'s) and queues its trajectories (``Endpoint.recorder.take()``).

Every call is recorded under an episode id (header ``X-Episode-Id``, else the ``user`` field,
else a new id, returned in the ``X-Episode-Id`` response header): its prompt ids, the ids the
engine sampled, their behaviour log-probs and weight versions (``rlax_llm.serve.recorder``).

Chat prompts are built so that an episode's calls stitch: when a request's messages extend the
previous call's messages plus the reply it got, the prompt is that call's prompt and sampled
ids, the template's end of the assistant turn, then the new messages' ids, never a
re-tokenisation of the sampled text. Otherwise the messages are rendered afresh, and the
recorder splits the episode where the ids stop extending (docs/serving.md).

Sampling: ``temperature``, ``top_p``, ``top_k`` (a vLLM extension), ``max_tokens``
(``max_completion_tokens``), ``seed``, ``stop`` (strings that are one token each) and
``logprobs`` are honoured; what the sampler cannot do (``n`` > 1, penalties, ``logit_bias``,
top alternatives, a forced tool call, a response format) is a 400 naming the parameter.
``stream=true`` answers in OpenAI's streaming shape token by token as the driver draws them
(a chat with tools: once the reply is complete and its calls parsed). A prompt longer than
the engine's prefill length is a 400 with both lengths; an unknown model a 404.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import itertools
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import fastapi
import jax
import numpy as np
import uvicorn
from fastapi.responses import JSONResponse, StreamingResponse

from rlax_llm.envs.tool_calls import (
  ToolCall,
  format_tool_result,
  parse_tool_calls,
  render_tool_call,
  tool_format_for,
)
from rlax_llm.errors import ToolCallError
from rlax_llm.models.files.chat_template import template_messages
from rlax_llm.rollout.driver import Sample
from rlax_llm.rollout.engine import MAX_STOP_IDS
from rlax_llm.rollout.episodes import make_renderer
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.serve.recorder import Call, EpisodeRecorder, RewardFn
from rlax_llm.serve.scheduler import Busy, Scheduler

EPISODE_HEADER = 'X-Episode-Id'
# Request fields the sampler cannot honour, with the value that means "off".
_UNSUPPORTED = {'n': 1, 'presence_penalty': 0, 'frequency_penalty': 0, 'logit_bias': None,
                'best_of': 1, 'echo': False, 'suffix': None, 'top_logprobs': 0,
                'parallel_tool_calls': True}
# tool_choice values the endpoint honours (it cannot force a call: 'required' or a named
# function is a 400).
_TOOL_CHOICES = (None, 'auto', 'none')
# Seconds between two checks of whether a waiting client is still connected.
_DISCONNECT_POLL_S = 0.05
# Seconds between two looks at a streamed sample's tokens (a chunk's text at most this often).
_STREAM_POLL_S = 0.02


class ApiError(Exception):
  """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

  def __init__(self, status: int, message: str, *, param: str | None = None,
               code: str | None = None, kind: str = 'invalid_request_error'):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                    code, kind)

  def response(self) -> JSONResponse:
    return JSONResponse({'error': {'message': self.message, 'type': self.kind,
                                   'param': self.param, 'code': self.code}},
                        status_code=self.status)


@dataclasses.dataclass(frozen=True)
class _Request:
  """A completion request as parsed: its episode, body, kind, prompt ids, template messages
  (chat) and whether its reply's tool calls are parsed."""

  episode: str
  body: Mapping[str, Any]
  chat: bool
  prompt_ids: list[int]
  messages: list[dict[str, Any]] | None
  parse_tools: bool


@dataclasses.dataclass
class _ChatState:
  """What the next chat call of an episode needs to extend this one: the template messages up
  to and including the reply, and the ids the model saw and sampled."""

  messages: list[Any]  # canonical forms (``_canonical``)
  ids: list[int]
  last_token: int | None  # the reply's stop token (None: cut by its length)


class Endpoint:
  """The endpoint's app, its generation thread, its recorder and (once started) its server.

  Args:
    worker: the inference worker serving the model (weights loaded).
    model_name: the model id clients ask for (``/v1/models``; others get a 404).
    api_key: a bearer token every request must carry (None: no authentication).
    host, port: where ``start`` listens (port 0: a free one).
    reward_fn: ``reward_fn(episode_id, calls) -> float`` for episodes closed without a reward.
    max_waiting: requests that may wait for the engine; more get a 429.
    seed: the root of the PRNG keys of requests without a ``seed``.
    refresh: called before every decode step (e.g. a pull of newer weights).
    sampling: the policy every request samples with (a training run's: the trainer scores
      the tokens under this transform), the requests' ``temperature``, ``top_p`` and
      ``top_k`` ignored (counted in ``stats['sampling_overridden']``); None: each request's.
    max_tokens: the length cap of a request that names none (None: the engine's
      ``max_new_tokens``).
    max_open_episodes, episode_ttl_s: the recorder's bounds on open episodes
      (``EpisodeRecorder``).
  """

  def __init__(self, worker: InferenceWorker, *, model_name: str, api_key: str | None = None,
               host: str = '127.0.0.1', port: int = 0, reward_fn: RewardFn | None = None,
               max_waiting: int = 64, seed: int = 0,
               refresh: Callable[[], None] | None = None, sampling: SamplingSpec | None = None,
               max_tokens: int | None = None, max_open_episodes: int = 4096,
               episode_ttl_s: float = 3600.0):
    self.worker = worker
    self.tokenizer = worker.tokenizer
    self.model_name = model_name
    self.api_key = api_key
    self.host, self.port = host, port
    self.recorder = EpisodeRecorder(reward_fn, max_open=max_open_episodes,
                                    ttl_s=episode_ttl_s)
    self.sampling = sampling
    self.max_tokens = max_tokens
    self.scheduler = Scheduler(worker, max_waiting=max_waiting, refresh=refresh)
    self.tool_format = tool_format_for(self.tokenizer)
    self.stats: collections.Counter[str] = collections.Counter()
    self._root = jax.random.key(seed)
    self._counter = itertools.count()
    self._lock = threading.Lock()
    # Episodes opened with a key (``open_episode``): name -> [key data, calls submitted].
    self._keys: dict[str, list] = {}
    self._abandoned: set[str] = set()
    self._tickets: dict[str, list] = collections.defaultdict(list)  # in flight, per episode
    self._server: uvicorn.Server | None = None
    self._thread: threading.Thread | None = None
    self.app = self._build_app()

  # ----------------------------------------------------------------------------- serving

  @property
  def base_url(self) -> str:
    """``http://HOST:PORT/v1``, the ``base_url`` of an OpenAI client (after ``start``)."""
    return f'http://{self.host}:{self.port}/v1'

  def start(self, timeout_s: float = 30.0) -> Self:
    """Serves the app with uvicorn in a daemon thread; returns once it accepts requests."""
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
    deadline = time.monotonic() + timeout_s
    while not self._server.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f'the endpoint did not start on {self.host}:{self.port} within '
                           f'{timeout_s} s.')
      time.sleep(0.01)
    return self

  def stop(self) -> None:
    """Stops the HTTP server and the generation thread."""
    if self._server is not None:
      self._server.should_exit = True
      self._thread.join()
      self._server = None
    self.scheduler.stop()

  def open_episode(self, name: str, key_data: np.ndarray, *, episode_id: int | None = None,
                   group_id: int | None = None, prompt_id: int = -1) -> None:
    """Opens episode ``name`` before its first call (``EpisodeRecorder.open``, with these
    ids): call ``n`` of it samples with the PRNG key ``fold_in(key, n)`` (``key_data``: uint32
    key data), whatever ``seed`` it asks for, so its tokens depend on its key alone (a training
    run's episodes)."""
    self.recorder.open(name, episode_id=episode_id, group_id=group_id, prompt_id=prompt_id)
    with self._lock:
      self._keys[name] = [np.asarray(key_data, np.uint32), 0]

  def abandon(self, name: str) -> None:
    """Ends episode ``name`` from the server's side (its harness timed out): its requests in
    flight are cancelled (their slots freed) and later ones answered 409
    ``episode_abandoned``; what it recorded stays in the recorder."""
    with self._lock:
      self._abandoned.add(name)
      tickets = list(self._tickets.get(name, ()))
    for ticket in tickets:
      ticket.cancel.set()
    self.stats['abandoned'] += 1

  def __enter__(self) -> Self:
    return self.start()

  def __exit__(self, *exc_info) -> None:
    self.stop()

  # --------------------------------------------------------------------------------- app

  def _build_app(self) -> fastapi.FastAPI:
    # Authentication is a dependency, not a middleware: Starlette's http middleware wraps
    # the request's receive channel, and a handler behind it never sees a disconnect.
    app = fastapi.FastAPI(title='rlax_llm OpenAI-compatible endpoint',
                          dependencies=[fastapi.Depends(self._authenticate)])

    @app.exception_handler(ApiError)
    async def api_error(request: fastapi.Request, error: ApiError):
      del request
      return error.response()

    @app.get('/v1/models')
    async def models():
      return {'object': 'list', 'data': [self._model_card()]}

    @app.get('/v1/models/{model:path}')
    async def model(model: str):
      self._check_model(model)
      return self._model_card()

    @app.post('/v1/completions')
    async def completions(request: fastapi.Request):
      return await self._complete(request, chat=False)

    @app.post('/v1/chat/completions')
    async def chat_completions(request: fastapi.Request):
      return await self._complete(request, chat=True)

    @app.post('/v1/episodes/{episode_id}/reward')
    async def reward(episode_id: str, request: fastapi.Request):
      body = await _json_body(request)
      value, turns = body.get('reward'), body.get('turn_rewards')
      if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ApiError(400, f'reward must be a number (or null to use the endpoint\'s '
                       f'reward_fn); got {value!r}.', param='reward')
      if turns is not None and (not isinstance(turns, list) or not all(
          isinstance(r, (int, float)) and not isinstance(r, bool) for r in turns)):
        raise ApiError(400, f'turn_rewards must be a list of numbers, one per call; got '
                       f'{turns!r:.100}.', param='turn_rewards')
      ids = {name: body.get(name) for name in ('group_id', 'prompt_id')}
      for name, given in ids.items():
        if given is not None and (isinstance(given, bool) or not isinstance(given, int)):
          raise ApiError(400, f'{name} must be an int; got {given!r}.', param=name)
      try:
        episode = self.recorder.close(episode_id, value, turns, group_id=ids['group_id'],
                                      prompt_id=-1 if ids['prompt_id'] is None
                                      else ids['prompt_id'])
      except KeyError:
        raise ApiError(404, f'no open episode {episode_id!r}: it has no calls or was closed '
                       'already.', code='episode_not_found') from None
      except ValueError as error:
        raise ApiError(400, str(error), param='reward') from None
      return {'episode_id': episode_id, 'reward': episode.reward, 'calls': len(episode.calls),
              'trajectories': len(episode.trajectories), 'id': episode.episode_id}

    return app

  def _authenticate(self, request: fastapi.Request) -> None:
    if self.api_key is None:
      return
    given = request.headers.get('authorization', '')
    if not hmac.compare_digest(given.encode(), f'Bearer {self.api_key}'.encode()):
      self.stats['unauthorized'] += 1
      raise ApiError(401, 'Incorrect or missing API key: send the header "Authorization: '
                     'Bearer <key>" with the key the endpoint was started with.',
                     code='invalid_api_key', kind='authentication_error')

  def _model_card(self) -> dict[str, Any]:
    return {'id': self.model_name, 'object': 'model', 'created': 0, 'owned_by': 'rlax_llm'}

  def _check_model(self, model: Any) -> None:
    if model != self.model_name:
      self.stats['unknown_model'] += 1
      raise ApiError(404, f'The model `{model}` does not exist; this endpoint serves '
                     f'`{self.model_name}`.', param='model', code='model_not_found')

  # -------------------------------------------------------------------------- completion

  async def _complete(self, request: fastapi.Request, chat: bool):
    body = await _json_body(request)
    self._check_model(body.get('model'))
    episode = request.headers.get(EPISODE_HEADER) or body.get('user') or (
        f'episode-{uuid.uuid4().hex}')
    self._check_abandoned(episode)
    sampling, max_new, stop_ids = self._sampling(body)
    tools = body.get('tools') or None
    parse_tools = chat and tools is not None and body.get('tool_choice') != 'none'
    if chat:
      prompt_ids, messages = self._chat_prompt(episode, body, tools)
    else:
      prompt_ids, messages = self._text_prompt(body), None
    limit = self.worker.engine.max_prefill_length
    if len(prompt_ids) > limit:
      self.stats['prompt_too_long'] += 1
      raise ApiError(400, f'This model\'s maximum prompt length is {limit} tokens; the prompt '
                     f'has {len(prompt_ids)} tokens. Shorten it (or serve with a larger '
                     'max_prompt_len).', param='messages' if chat else 'prompt',
                     code='context_length_exceeded')
    try:
      ticket = self.scheduler.submit(prompt_ids, sampling, max_new, stop_ids,
                                     self._key_data(episode, body.get('seed')))
    except Busy as error:
      raise ApiError(429, str(error), code='server_busy', kind='rate_limit_error') from None
    except ValueError as error:
      raise ApiError(400, str(error)) from None
    self._track(episode, ticket)
    usage = bool((body.get('stream_options') or {}).get('include_usage'))
    call = _Request(episode, body, chat, prompt_ids, messages, parse_tools)
    if body.get('stream') and not parse_tools:  # token by token, as the driver samples them
      return StreamingResponse(self._stream(call, ticket, usage), media_type='text/event-stream',
                               headers={EPISODE_HEADER: episode,
                                        'X-Params-Version': str(self.worker.version)})
    try:
      sample = await self._wait(request, ticket)
    except Exception as error:  # noqa: BLE001  (the batch failed: this request's error only)
      self.stats['generation_errors'] += 1
      raise ApiError(500, f'generation failed: {type(error).__name__}: {error}',
                     kind='server_error', code='generation_failed') from None
    finally:
      self._untrack(episode, ticket)
    if sample is None or sample.finish_reason == 'cancelled':  # the client or episode is gone
      self._check_abandoned(episode)
      return fastapi.Response(status_code=499)
    payload = self._answer(call, sample)
    headers = {EPISODE_HEADER: episode,
               'X-Params-Version': str(max(sample.versions, default=self.worker.version))}
    if body.get('stream'):  # with tools: whole, once the calls are parsed
      return StreamingResponse(_stream_events(payload, chat, usage), headers=headers,
                               media_type='text/event-stream')
    return JSONResponse(payload, headers=headers)

  def _answer(self, call: _Request, sample: Sample) -> dict[str, Any]:
    """Records ``sample`` under the call's episode (and the chat state its next call extends)
    and returns the response's payload."""
    text = self.tokenizer.decode(sample.tokens, stop_at_eos=True)
    index = self.recorder.record(call.episode, Call(
        tuple(call.prompt_ids), tuple(sample.tokens), tuple(sample.logprobs),
        tuple(sample.supports), tuple(sample.versions), sample.finish_reason, text))
    if not call.chat:
      payload = self._completion_payload(call.body, sample, text)
    else:
      calls = self._tool_calls(text) if call.parse_tools else []
      reply = self._reply(text, calls, call.episode, index)
      if call.messages is not None:
        state = _ChatState([_canonical(m, self.tool_format) for m in call.messages]
                           + [_canonical(reply, self.tool_format)],
                           list(call.prompt_ids) + list(sample.tokens),
                           sample.tokens[-1] if sample.finish_reason == 'stop' else None)
        try:
          self.recorder.attach(call.episode, state)
        except KeyError:  # closed (or evicted) while this call ran: nothing to extend
          pass
      payload = self._chat_payload(call.body, sample, reply, bool(calls))
    payload['usage'] = {'prompt_tokens': len(call.prompt_ids),
                        'completion_tokens': len(sample.tokens),
                        'total_tokens': len(call.prompt_ids) + len(sample.tokens)}
    return payload

  async def _stream(self, call: _Request, ticket, usage: bool):
    """Server-sent events of a sample as it is drawn: a chunk for each piece of text the
    tokens decoded so far add (at most one per ``_STREAM_POLL_S``; text ending in a partial
    character waits for its next token), then the finish reason, the usage if asked and
    ``[DONE]``. The call is recorded once its sample is complete. A client that goes away
    cancels the sample (its slot freed); a failed batch ends the stream with an error
    event."""
    head = {'id': f'{"chatcmpl" if call.chat else "cmpl"}-{uuid.uuid4().hex}',
            'created': int(time.time()), 'model': self.model_name,
            'object': 'chat.completion.chunk' if call.chat else 'text_completion'}
    want_logprobs = bool(call.body.get('logprobs')) if call.chat else (
        call.body.get('logprobs') is not None)
    sent, covered = '', 0  # the text sent and the tokens it came from
    future = asyncio.wrap_future(ticket.future)
    try:
      if call.chat:
        yield _event(head, _choice(True, '', role=True))
      while not future.done():
        await asyncio.wait({future}, timeout=_STREAM_POLL_S)
        live = ticket.live
        if future.done() or live is None:
          continue
        n = len(live.versions)  # Sample.append adds versions last: tokens[:n] are complete
        text = self.tokenizer.decode(live.tokens[:n], stop_at_eos=True)
        if len(text) > len(sent) and text.startswith(sent) and not text.endswith('\ufffd'):
          yield _event(head, _choice(call.chat, text[len(sent):], logprobs=self._piece_logprobs(
              live, covered, n, call.chat) if want_logprobs else None))
          sent, covered = text, n
      if ticket.future.cancelled():
        return
      try:
        sample = future.result()
      except Exception as error:  # noqa: BLE001  (the batch failed: this request's error only)
        self.stats['generation_errors'] += 1
        failed = ApiError(500, f'generation failed: {type(error).__name__}: {error}',
                          kind='server_error', code='generation_failed')
        yield f'data: {failed.response().body.decode()}\n\n'
        return
      if sample.finish_reason == 'cancelled':
        return
      payload = self._answer(call, sample)
      text = self.tokenizer.decode(sample.tokens, stop_at_eos=True)
      if len(text) > len(sent) and text.startswith(sent):
        yield _event(head, _choice(call.chat, text[len(sent):], logprobs=self._piece_logprobs(
            sample, covered, len(sample.tokens), call.chat) if want_logprobs else None))
      yield _event(head, _choice(call.chat, None, finish=_finish(sample)))
      if usage:
        yield f'data: {json.dumps({**head, "choices": [], "usage": payload["usage"]})}\n\n'
      yield 'data: [DONE]\n\n'
      self.stats['streamed'] += 1
    finally:
      if not ticket.future.done():  # the client went away mid-stream: free its slot
        ticket.cancel.set()
        self.stats['disconnects'] += 1
      self._untrack(call.episode, ticket)

  def _piece_logprobs(self, sample: Sample, lo: int, hi: int, chat: bool) -> dict[str, Any]:
    """The log-probs of tokens ``[lo, hi)`` of ``sample`` in a stream chunk's shape."""
    pairs = self._token_logprobs(sample, lo, hi)
    if chat:
      return {'content': [{'token': t, 'logprob': lp, 'bytes': list(t.encode()),
                           'top_logprobs': []} for t, lp in pairs]}
    return {'tokens': [t for t, _ in pairs], 'token_logprobs': [lp for _, lp in pairs],
            'top_logprobs': None}

  def _check_abandoned(self, episode: str) -> None:
    with self._lock:
      abandoned = episode in self._abandoned
    if abandoned:
      raise ApiError(409, f'episode {episode!r} was ended by the trainer (its harness ran past '
                     'its timeout); start a new episode.', code='episode_abandoned')

  def _key_data(self, episode: str, seed: int | None) -> np.ndarray:
    """The PRNG key data of the episode's next call: ``fold_in(key, n)`` for an episode
    opened with a key (``open_episode``), else ``key(seed)``, else the endpoint's root key
    folded with a call counter."""
    with self._lock:
      entry = self._keys.get(episode)
      if entry is not None:
        entry[1] += 1
        key = jax.random.fold_in(jax.random.wrap_key_data(entry[0]), entry[1] - 1)
      elif seed is not None:
        key = jax.random.key(seed)
      else:
        key = jax.random.fold_in(self._root, next(self._counter))
    return np.asarray(jax.random.key_data(key))

  def _track(self, episode: str, ticket) -> None:
    with self._lock:
      self._tickets[episode].append(ticket)

  def _untrack(self, episode: str, ticket) -> None:
    with self._lock:
      tickets = self._tickets[episode]
      tickets.remove(ticket)
      if not tickets:
        del self._tickets[episode]

  async def _wait(self, request: fastapi.Request, ticket) -> Sample | None:
    """The ticket's sample, or None (its slot freed) if the client disconnects first or the
    ticket was cancelled before it started."""
    future = asyncio.wrap_future(ticket.future)
    while True:
      done, _ = await asyncio.wait({future}, timeout=_DISCONNECT_POLL_S)
      if done:
        return None if ticket.future.cancelled() else future.result()
      if await request.is_disconnected():
        ticket.cancel.set()
        self.stats['disconnects'] += 1
        return None

  def _sampling(self, body: Mapping[str, Any]) -> tuple[SamplingSpec, int, list[int]]:
    """The request's sampling spec, length cap and stop ids; ApiError for what the sampler
    cannot honour."""
    for name, off in _UNSUPPORTED.items():
      value = body.get(name)
      if value is not None and value != off and not (name == 'logit_bias' and not value):
        raise ApiError(400, f'{name}={value!r} is not supported by this endpoint\'s sampler '
                       f'(leave it out, or {off!r}).', param=name, code='unsupported_parameter')
    if body.get('tool_choice') not in _TOOL_CHOICES:
      raise ApiError(400, f'tool_choice={body["tool_choice"]!r}: the sampler cannot force a '
                     'tool call; use "auto" or "none".', param='tool_choice',
                     code='unsupported_parameter')
    response_format = body.get('response_format') or {'type': 'text'}
    if not isinstance(response_format, Mapping) or response_format.get('type') != 'text':
      raise ApiError(400, f'response_format={response_format!r}: the sampler cannot constrain '
                     'the output to a format; leave it out (or {"type": "text"}).',
                     param='response_format', code='unsupported_parameter')
    logprobs = body.get('logprobs')
    if logprobs not in (None, False, True, 0):
      raise ApiError(400, f'logprobs={logprobs!r}: only the sampled tokens\' log-probs are '
                     'recorded (logprobs=0 for completions, true for chat), not top '
                     'alternatives.', param='logprobs', code='unsupported_parameter')
    get = lambda name, default: default if body.get(name) is None else body[name]
    if self.sampling is not None:  # the run's policy, whatever the request asks
      spec = self.sampling
      if any(body.get(name) is not None for name in ('temperature', 'top_p', 'top_k')):
        self.stats['sampling_overridden'] += 1
    else:
      try:
        spec = SamplingSpec(temperature=get('temperature', 1.0), top_k=get('top_k', 0),
                            top_p=get('top_p', 1.0))
      except ValueError as error:
        raise ApiError(400, str(error), param='temperature', code='invalid_value') from None
    cap = self.worker.engine.max_decode_length
    max_new = body.get('max_completion_tokens', body.get('max_tokens'))
    max_new = (self.max_tokens or cap) if max_new is None else max_new
    if isinstance(max_new, bool) or not isinstance(max_new, int) or not 1 <= max_new <= cap:
      raise ApiError(400, f'max_tokens={max_new!r} must be an int in [1, {cap}] (the engine\'s '
                     'max_new_tokens).', param='max_tokens', code='invalid_value')
    seed = body.get('seed')
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not -2**63 <= seed < 2**63):
      raise ApiError(400, f'seed={seed!r} must be an int in [-2**63, 2**63).', param='seed')
    stop = body.get('stop') or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    stop_ids = [self.tokenizer.eos_id]
    for text in stop:
      ids = self.tokenizer.encode(text) if isinstance(text, str) else None
      if ids is None or len(ids) != 1:
        raise ApiError(400, f'stop={text!r}: the engine stops on single tokens and this '
                       f'encodes to {ids}; use stop strings that are one token each.',
                       param='stop', code='unsupported_parameter')
      stop_ids.append(ids[0])
    stop_ids = list(dict.fromkeys(stop_ids))
    if len(stop_ids) > MAX_STOP_IDS:
      raise ApiError(400, f'{len(stop_ids)} stop tokens (eos included); at most '
                     f'{MAX_STOP_IDS} are supported.', param='stop')
    return spec, max_new, stop_ids

  def _text_prompt(self, body: Mapping[str, Any]) -> list[int]:
    prompt = body.get('prompt')
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]  # one prompt in a batch of one
    if isinstance(prompt, str):
      try:
        ids = self.tokenizer.encode(prompt, add_bos=self.tokenizer.add_bos_token)
      except ValueError as error:
        raise ApiError(400, str(error), param='prompt') from None
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
      ids = list(prompt)
      vocab = self.worker.model.config.vocab_size
      bad = [t for t in ids if not 0 <= t < vocab]
      if bad:
        raise ApiError(400, f'prompt token ids {bad[:5]} are outside the vocabulary [0, '
                       f'{vocab}).', param='prompt')
    else:
      raise ApiError(400, f'prompt must be one string or one list of token ids; got '
                     f'{prompt!r:.100}.', param='prompt')
    if not ids:
      raise ApiError(400, 'the prompt is empty.', param='prompt')
    return ids

  def _chat_prompt(self, episode: str, body: Mapping[str, Any], tools
                   ) -> tuple[list[int], list[dict[str, Any]]]:
    """The prompt ids of a chat request and its template messages; spliced onto the
    episode's previous call where the messages extend it (the module docstring)."""
    raw = body.get('messages')
    if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) for m in raw):
      raise ApiError(400, f'messages must be a non-empty list of objects; got {raw!r:.100}.',
                     param='messages')
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) for t in tools)):
      raise ApiError(400, f'tools must be a list of objects; got {tools!r:.100}.',
                     param='tools')
    # The multi-turn runner's renderer: the tools in the checkpoint's format (with_tools),
    # the same ids for a conversation whichever of the two builds it.
    renderer = make_renderer(self.tokenizer, tools)
    try:
      messages = template_messages([_template_message(m, self.tool_format) for m in raw])
      fresh = renderer.prompt(messages)
      canonical = [_canonical(m, self.tool_format) for m in messages]
    except Exception as error:  # noqa: BLE001  (malformed messages, or a template that raises)
      raise ApiError(400, f'these messages cannot be rendered by the chat template: '
                     f'{type(error).__name__}: {error}', param='messages') from None
    state = self.recorder.attached(episode)
    k = 0 if state is None else len(state.messages)
    if state is None or len(messages) <= k or canonical[:k] != state.messages:
      return fresh, messages
    try:  # the multi-turn runner's definition of the ids between two assistant turns
      between = renderer.between_turns(messages[:k - 1], messages[k:], state.last_token)
    except ValueError:  # the template rewrites earlier turns: render afresh (a split)
      self.stats['chat_not_spliced'] += 1
      return fresh, messages
    self.stats['chat_spliced'] += 1
    return state.ids + between, messages

  def _tool_calls(self, text: str) -> list[ToolCall]:
    try:
      return parse_tool_calls(text, self.tool_format)
    except ToolCallError:
      self.stats['malformed_tool_calls'] += 1
      return []

  def _reply(self, text: str, calls: Sequence[ToolCall], episode: str, index: int
             ) -> dict[str, Any]:
    """The assistant message: the text around the tool calls, and the calls."""
    content = text
    for call in calls:
      content = content.replace(call.raw, '', 1)
    message: dict[str, Any] = {'role': 'assistant',
                               'content': content.strip() if calls else text}
    if calls:
      message['content'] = message['content'] or None
      message['tool_calls'] = [
          {'id': f'call_{episode[-8:]}_{index}_{i}', 'type': 'function',
           'function': {'name': call.name,
                        'arguments': json.dumps(call.arguments, ensure_ascii=False)}}
          for i, call in enumerate(calls)]
    return message

  def _token_logprobs(self, sample: Sample, lo: int = 0, hi: int | None = None
                      ) -> list[tuple[str, float]]:
    """``(token text, log-prob)`` of tokens ``[lo, hi)`` of ``sample``."""
    return [(self.tokenizer.decode([t], stop_at_eos=False), float(lp))
            for t, lp in zip(sample.tokens[lo:hi], sample.logprobs[lo:hi])]

  def _completion_payload(self, body, sample: Sample, text: str) -> dict[str, Any]:
    logprobs = None
    if body.get('logprobs') is not None:
      pairs = self._token_logprobs(sample)
      offsets = list(itertools.accumulate((len(t) for t, _ in pairs), initial=0))[:-1]
      logprobs = {'tokens': [t for t, _ in pairs], 'token_logprobs': [lp for _, lp in pairs],
                  'top_logprobs': None, 'text_offset': offsets}
    return {'id': f'cmpl-{uuid.uuid4().hex}', 'object': 'text_completion',
            'created': int(time.time()), 'model': self.model_name,
            'choices': [{'index': 0, 'text': text, 'logprobs': logprobs,
                         'finish_reason': _finish(sample)}]}

  def _chat_payload(self, body, sample: Sample, reply, tool_calls: bool) -> dict[str, Any]:
    logprobs = None
    if body.get('logprobs'):
      logprobs = self._piece_logprobs(sample, 0, len(sample.tokens), chat=True)
    return {'id': f'chatcmpl-{uuid.uuid4().hex}', 'object': 'chat.completion',
            'created': int(time.time()), 'model': self.model_name,
            'choices': [{'index': 0, 'message': reply, 'logprobs': logprobs,
                         'finish_reason': 'tool_calls' if tool_calls else _finish(sample)}]}


def _stream_events(payload: dict[str, Any], chat: bool, usage: bool):
  """``payload`` (a whole completion) as server-sent events in OpenAI's streaming shape: one
  chunk with the whole reply, one with the finish reason, the usage if asked, ``[DONE]``."""
  choice = payload['choices'][0]
  head = {'id': payload['id'], 'created': payload['created'], 'model': payload['model'],
          'object': 'chat.completion.chunk' if chat else 'text_completion'}
  if chat:
    message = choice['message']
    first = _choice(True, message.get('content'), role=True, logprobs=choice['logprobs'])
    if message.get('tool_calls'):
      first['delta']['tool_calls'] = [{'index': i, **call}
                                      for i, call in enumerate(message['tool_calls'])]
  else:
    first = {**choice, 'finish_reason': None}
  yield _event(head, first)
  yield _event(head, _choice(chat, None, finish=choice['finish_reason']))
  if usage:
    yield f'data: {json.dumps({**head, "choices": [], "usage": payload["usage"]})}\n\n'
  yield 'data: [DONE]\n\n'


def _choice(chat: bool, text: str | None, *, role: bool = False, finish: str | None = None,
            logprobs: Any = None) -> dict[str, Any]:
  """One streamed choice: a chat ``delta`` (with the role in the first) or a completion's
  ``text`` piece; the last carries the finish reason and no text."""
  if chat:
    delta = {} if text is None and not role else {'content': text}
    if role:
      delta = {'role': 'assistant', **delta}
    return {'index': 0, 'delta': delta, 'logprobs': logprobs, 'finish_reason': finish}
  return {'index': 0, 'text': text or '', 'logprobs': logprobs, 'finish_reason': finish}


def _event(head: dict[str, Any], choice: dict[str, Any]) -> str:
  return f'data: {json.dumps({**head, "choices": [choice]})}\n\n'


def _finish(sample: Sample) -> str:
  return 'length' if sample.finish_reason == 'length' else 'stop'


async def _json_body(request: fastapi.Request) -> dict[str, Any]:
  try:
    body = await request.json()
  except ValueError:
    raise ApiError(400, 'the request body is not valid JSON.') from None
  if not isinstance(body, dict):
    raise ApiError(400, f'the request body must be a JSON object; got {type(body).__name__}.')
  return body


def _template_message(message: Mapping[str, Any], fmt: str) -> dict[str, Any]:
  """An OpenAI message as chat templates take it: text parts joined into one string, tool
  call arguments (a JSON string in OpenAI's API) as objects. In the ``'simple'`` tool format
  (a template that knows no tools) tool calls become the assistant's text
  (``render_tool_call``) and a ``'tool'`` message the user message that carries a result
  (``format_tool_result``), as the environments present them."""
  message = dict(message)
  content = message.get('content')
  if isinstance(content, list):
    message['content'] = ''.join(part.get('text', '') for part in content
                                 if isinstance(part, Mapping))
  if message.get('tool_calls'):
    calls = []
    for call in message['tool_calls']:
      call = dict(call)
      function = dict(call.get('function') or {})
      if isinstance(function.get('arguments'), str):
        try:
          function['arguments'] = json.loads(function['arguments'])
        except ValueError:
          pass  # the template renders the string as given
      call['function'] = function
      calls.append(call)
    message['tool_calls'] = calls
  if fmt != 'simple':
    return message
  if message.get('role') == 'tool':
    return format_tool_result(str(message.get('content') or ''), fmt)
  if message.get('tool_calls'):
    texts = [message['content']] if message.get('content') else []
    for call in message.pop('tool_calls'):
      arguments = call['function'].get('arguments')
      texts.append(render_tool_call(str(call['function'].get('name')),
                                    arguments if isinstance(arguments, Mapping) else {}, fmt))
    message['content'] = '\n'.join(texts)
  return message


def _canonical(message: Mapping[str, Any], fmt: str) -> tuple:
  """What makes two messages the same turn for splicing: role, text, tool calls (name and
  arguments; not their ids, which a harness may rewrite) and the tool call answered."""
  message = _template_message(message, fmt)
  calls = tuple((c.get('function', {}).get('name'),
                 json.dumps(c.get('function', {}).get('arguments'), sort_keys=True))
                for c in message.get('tool_calls') or ())
  return (message.get('role'), message.get('content') or '', calls,
          message.get('tool_call_id'), message.get('name'))
