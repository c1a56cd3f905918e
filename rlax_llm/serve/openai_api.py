"""The OpenAI-compatible endpoint: an agent harness written against the OpenAI API, trained.

``Endpoint(worker, model_name=...)`` serves, in-process (uvicorn in a thread, 127.0.0.1 by
default, optional bearer token; a host other machines reach needs a token or
``allow_unauthenticated_network=True``):

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
Chat prompts are built so that an episode's calls stitch (``serve.chat_prompts``).

A request is checked whole before any compute: a body over ``max_request_bytes`` is a 413
(``serve.http_server.read_json_body``), a malformed field a 400 naming it
(``serve.openai_requests``), and what the sampler cannot do a 400 naming the parameter. A
prompt longer than the engine's prefill length is a 400 with both lengths; an unknown model a
404. ``stream=true`` answers in OpenAI's streaming shape token by token as the driver draws
them (a chat with tools: once the reply is complete and its calls parsed;
``serve.openai_responses``).

The modules by job: ``http_server`` (errors, body cap, host policy, the server thread),
``openai_requests`` (checks and sampling parameters), ``chat_prompts`` (template and
splicing), ``openai_responses`` (payloads and stream chunks), ``open_episodes`` (keys,
abandonment, requests in flight), ``recorder`` (calls and trajectories), ``scheduler`` (the
generation thread); this one wires them into the app.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Self

import numpy as np

from rlax_llm import extras
from rlax_llm.envs.tool_calls import tool_format_for
from rlax_llm.rollout.driver import Sample
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.serve import chat_prompts, openai_responses as responses
from rlax_llm.serve.http_server import (DEFAULT_MAX_REQUEST_BYTES, ENDPOINT, ApiError,
                                        ServerThread, check_exposure, read_json_body)
from rlax_llm.serve.open_episodes import EPISODE_HEADER, OpenEpisodes
from rlax_llm.serve.openai_requests import (check_request, reward_fields, sampling_params,
                                            text_prompt)
from rlax_llm.serve.recorder import Call, EpisodeRecorder, RewardFn
from rlax_llm.serve.scheduler import Busy, Scheduler, Ticket

fastapi = extras.require('fastapi', ENDPOINT)  # the serve extra
JSONResponse = fastapi.responses.JSONResponse
StreamingResponse = fastapi.responses.StreamingResponse

# Seconds between two checks of whether a waiting client is still connected.
_DISCONNECT_POLL_S = 0.05
# Seconds between two looks at a streamed sample's tokens (a chunk's text at most this often).
_STREAM_POLL_S = 0.02


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


class Endpoint:
  """The endpoint's app, its generation thread, its recorder and (once started) its server.

  Args:
    worker: the inference worker serving the model (weights loaded).
    model_name: the model id clients ask for (``/v1/models``; others get a 404).
    api_key: a bearer token every request must carry (None: no authentication).
    host, port: where ``start`` listens (port 0: a free one).
    allow_unauthenticated_network: serve a ``host`` that is not loopback without an
      ``api_key`` (a trusted network); False: such an endpoint is refused (ConfigError).
    max_request_bytes: the largest request body taken; larger ones get a 413.
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
               host: str = '127.0.0.1', port: int = 0,
               allow_unauthenticated_network: bool = False,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               reward_fn: RewardFn | None = None, max_waiting: int = 64, seed: int = 0,
               refresh: Callable[[], None] | None = None, sampling: SamplingSpec | None = None,
               max_tokens: int | None = None, max_open_episodes: int = 4096,
               episode_ttl_s: float = 3600.0):
    check_exposure(host, api_key, allow_unauthenticated_network)
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or (
        max_request_bytes < 1):
      raise ValueError(f'max_request_bytes={max_request_bytes!r} must be an int >= 1 (the '
                       f'default is {DEFAULT_MAX_REQUEST_BYTES}, 4 MiB).')
    self.worker = worker
    self.tokenizer = worker.tokenizer
    self.model_name = model_name
    self.api_key = api_key
    self.host, self.port = host, port
    self.max_request_bytes = max_request_bytes
    self.recorder = EpisodeRecorder(reward_fn, max_open=max_open_episodes,
                                    ttl_s=episode_ttl_s)
    self.sampling = sampling
    self.max_tokens = max_tokens
    self.scheduler = Scheduler(worker, max_waiting=max_waiting, refresh=refresh)
    self.tool_format = tool_format_for(self.tokenizer)
    self.stats: collections.Counter[str] = collections.Counter()
    self.episodes = OpenEpisodes(seed)
    self._server: ServerThread | None = None
    self.app = self._build_app()

  # ----------------------------------------------------------------------------- serving

  @property
  def base_url(self) -> str:
    """``http://HOST:PORT/v1``, the ``base_url`` of an OpenAI client (after ``start``)."""
    return f'http://{self.host}:{self.port}/v1'

  def start(self, timeout_s: float = 30.0) -> Self:
    """Serves the app with uvicorn in a daemon thread; returns once it accepts requests."""
    self._server = ServerThread(self.app, self.host, self.port,
                                authenticated=self.api_key is not None)
    self._server.start(timeout_s)
    self.port = self._server.port
    return self

  def stop(self) -> None:
    """Stops the HTTP server and the generation thread."""
    if self._server is not None:
      self._server.stop()
      self._server = None
    self.scheduler.stop()

  def open_episode(self, name: str, key_data: np.ndarray, *, episode_id: int | None = None,
                   group_id: int | None = None, prompt_id: int = -1) -> None:
    """Opens episode ``name`` before its first call (``EpisodeRecorder.open``, with these
    ids): call ``n`` of it samples with the PRNG key ``fold_in(key, n)`` (``key_data``: uint32
    key data), whatever ``seed`` it asks for, so its tokens depend on its key alone (a training
    run's episodes)."""
    self.recorder.open(name, episode_id=episode_id, group_id=group_id, prompt_id=prompt_id)
    self.episodes.open(name, key_data)

  def abandon(self, name: str) -> None:
    """Ends episode ``name`` from the server's side (its harness timed out): its requests in
    flight are cancelled (their slots freed) and later ones answered 409
    ``episode_abandoned``; what it recorded stays in the recorder."""
    self.episodes.abandon(name)
    self.stats['abandoned'] += 1

  def __enter__(self) -> Self:
    return self.start()

  def __exit__(self, *exc_info) -> None:
    self.stop()

  # --------------------------------------------------------------------------------- app

  def _build_app(self) -> fastapi.FastAPI:
    # Authentication is a dependency, not a middleware: Starlette's http middleware wraps
    # the request's receive channel, and a handler behind it never sees a disconnect. It runs
    # before a handler reads the body, so a client without the token sends none of it in.
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
      return self._close(episode_id, await read_json_body(request, self.max_request_bytes))

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

  def _close(self, episode_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """``POST /v1/episodes/{id}/reward``: closes the episode (``EpisodeRecorder.close``)."""
    value, turns, group_id, prompt_id = reward_fields(body)
    try:
      episode = self.recorder.close(episode_id, value, turns, group_id=group_id,
                                    prompt_id=prompt_id)
    except KeyError:
      raise ApiError(404, f'no open episode {episode_id!r}: it has no calls or was closed '
                     'already.', code='episode_not_found') from None
    except ValueError as error:
      raise ApiError(400, str(error), param='reward') from None
    return {'episode_id': episode_id, 'reward': episode.reward, 'calls': len(episode.calls),
            'trajectories': len(episode.trajectories), 'id': episode.episode_id}

  # -------------------------------------------------------------------------- completion

  def _parse(self, request: fastapi.Request, body: Mapping[str, Any], chat: bool
             ) -> tuple[_Request, SamplingSpec, int, list[int]]:
    """The request checked whole (fields, sampling, prompt length) before anything runs."""
    self._check_model(body.get('model'))
    check_request(body, chat)
    episode = request.headers.get(EPISODE_HEADER) or body.get('user') or (
        f'episode-{uuid.uuid4().hex}')
    self.episodes.check_not_abandoned(episode)
    sampling, max_new, stop_ids = sampling_params(
        body, self.tokenizer, max_decode_length=self.worker.engine.max_decode_length,
        default_max_tokens=self.max_tokens, fixed=self.sampling, stats=self.stats)
    tools = body.get('tools') or None
    if chat:
      prompt_ids, messages = chat_prompts.chat_prompt(
          self.tokenizer, self.tool_format, body['messages'], tools,
          self.recorder.attached(episode), self.stats)
    else:
      prompt_ids = text_prompt(body, self.tokenizer, self.worker.model.config.vocab_size)
      messages = None
    limit = self.worker.engine.max_prefill_length
    if len(prompt_ids) > limit:
      self.stats['prompt_too_long'] += 1
      raise ApiError(400, f'This model\'s maximum prompt length is {limit} tokens; the prompt '
                     f'has {len(prompt_ids)} tokens. Shorten it (or serve with a larger '
                     'max_prompt_len).', param='messages' if chat else 'prompt',
                     code='context_length_exceeded')
    parse_tools = chat and tools is not None and body.get('tool_choice') != 'none'
    call = _Request(episode, body, chat, prompt_ids, messages, parse_tools)
    return call, sampling, max_new, stop_ids

  async def _complete(self, request: fastapi.Request, chat: bool):
    body = await read_json_body(request, self.max_request_bytes)
    call, sampling, max_new, stop_ids = self._parse(request, body, chat)
    episode = call.episode
    try:
      ticket = self.scheduler.submit(call.prompt_ids, sampling, max_new, stop_ids,
                                     self.episodes.key_data(episode, body.get('seed')))
    except Busy as error:
      raise ApiError(429, str(error), code='server_busy', kind='rate_limit_error') from None
    except ValueError as error:
      raise ApiError(400, str(error)) from None
    self.episodes.track(episode, ticket)
    with_usage = bool((body.get('stream_options') or {}).get('include_usage'))
    if body.get('stream') and not call.parse_tools:  # token by token, as the driver samples
      return StreamingResponse(self._stream(call, ticket, with_usage),
                               media_type='text/event-stream',
                               headers={EPISODE_HEADER: episode,
                                        'X-Params-Version': str(self.worker.version)})
    try:
      sample = await self._wait(request, ticket)
    except Exception as error:  # noqa: BLE001  (the batch failed: this request's error only)
      raise self._generation_failed(error) from None
    finally:
      self.episodes.untrack(episode, ticket)
    if sample is None or sample.finish_reason == 'cancelled':  # the client or episode is gone
      self.episodes.check_not_abandoned(episode)
      return fastapi.Response(status_code=499)
    payload = self._answer(call, sample)
    headers = {EPISODE_HEADER: episode,
               'X-Params-Version': str(max(sample.versions, default=self.worker.version))}
    if body.get('stream'):  # with tools: whole, once the calls are parsed
      return StreamingResponse(responses.whole_stream_events(payload, chat, with_usage),
                               headers=headers, media_type='text/event-stream')
    return JSONResponse(payload, headers=headers)

  def _generation_failed(self, error: Exception) -> ApiError:
    self.stats['generation_errors'] += 1
    return ApiError(500, f'generation failed: {type(error).__name__}: {error}',
                    kind='server_error', code='generation_failed')

  def _answer(self, call: _Request, sample: Sample) -> dict[str, Any]:
    """Records ``sample`` under the call's episode (and the chat state its next call extends)
    and returns the response's payload."""
    text = self.tokenizer.decode(sample.tokens, stop_at_eos=True)
    index = self.recorder.record(call.episode, Call(
        tuple(call.prompt_ids), tuple(sample.tokens), tuple(sample.logprobs),
        tuple(sample.supports), tuple(sample.versions), sample.finish_reason, text))
    if not call.chat:
      payload = responses.completion_payload(self.tokenizer, self.model_name, call.body,
                                             sample, text)
    else:
      calls = (responses.tool_calls(text, self.tool_format, self.stats) if call.parse_tools
               else [])
      reply = responses.reply_message(text, calls, call.episode, index)
      state = chat_prompts.state_after(
          call.messages, reply, self.tool_format, [*call.prompt_ids, *sample.tokens],
          sample.tokens[-1] if sample.finish_reason == 'stop' else None)
      try:
        self.recorder.attach(call.episode, state)
      except KeyError:  # closed (or evicted) while this call ran: nothing to extend
        pass
      payload = responses.chat_payload(self.tokenizer, self.model_name, call.body, sample,
                                       reply)
    payload['usage'] = responses.usage(len(call.prompt_ids), len(sample.tokens))
    return payload

  async def _wait(self, request: fastapi.Request, ticket: Ticket) -> Sample | None:
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

  async def _stream(self, call: _Request, ticket: Ticket, with_usage: bool):
    """Server-sent events of a sample as it is drawn: a chunk for each piece of text the
    tokens decoded so far add (at most one per ``_STREAM_POLL_S``; text ending in a partial
    character waits for its next token), then the finish reason, the usage if asked and
    ``[DONE]``. The call is recorded once its sample is complete. A client that goes away
    cancels the sample (its slot freed); a failed batch ends the stream with an error
    event."""
    head = responses.stream_head(self.model_name, call.chat)
    logprobs = responses.wants_logprobs(call.body, call.chat)
    sent, covered = '', 0  # the text sent and the tokens it came from

    def piece(sample: Sample, hi: int, text: str) -> str:
      """The chunk of the text that tokens ``[covered, hi)`` add to what was sent."""
      return responses.event(head, responses.choice(
          call.chat, text[len(sent):], logprobs=responses.piece_logprobs(
              self.tokenizer, sample, covered, hi, call.chat) if logprobs else None))

    future = asyncio.wrap_future(ticket.future)
    try:
      if call.chat:
        yield responses.event(head, responses.choice(True, '', role=True))
      while not future.done():
        await asyncio.wait({future}, timeout=_STREAM_POLL_S)
        live = ticket.live
        if future.done() or live is None:
          continue
        n = len(live.versions)  # Sample.append adds versions last: tokens[:n] are complete
        text = self.tokenizer.decode(live.tokens[:n], stop_at_eos=True)
        if len(text) > len(sent) and text.startswith(sent) and not text.endswith('\ufffd'):
          yield piece(live, n, text)
          sent, covered = text, n
      if ticket.future.cancelled():
        return
      try:
        sample = future.result()
      except Exception as error:  # noqa: BLE001  (the batch failed: this request's error only)
        yield f'data: {self._generation_failed(error).response().body.decode()}\n\n'
        return
      if sample.finish_reason == 'cancelled':
        return
      payload = self._answer(call, sample)
      text = self.tokenizer.decode(sample.tokens, stop_at_eos=True)
      if len(text) > len(sent) and text.startswith(sent):
        yield piece(sample, len(sample.tokens), text)
      yield responses.event(head, responses.choice(call.chat, None,
                                                   finish=responses.finish_reason(sample)))
      for line in responses.closing_events(head, payload['usage'] if with_usage else None):
        yield line
      self.stats['streamed'] += 1
    finally:
      if not ticket.future.done():  # the client went away mid-stream: free its slot
        ticket.cancel.set()
        self.stats['disconnects'] += 1
      self.episodes.untrack(call.episode, ticket)
