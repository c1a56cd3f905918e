"""What an OpenAI request asks for, checked before any compute: its fields' shapes and types,
its sampling parameters, and a completion's prompt ids.

``check_request`` refuses a malformed request with a 400 naming the field as OpenAI does
(``messages[2].role``, ``tools[0].function``, ``tool_choice.function.name``):

* ``messages``: a non-empty list of objects, each with a ``role`` among ``ROLES``; content a
  string or a list of ``{"type": "text", "text": str}`` parts (required for every role but an
  assistant's); an assistant's ``tool_calls`` a list of ``{"type": "function", "function":
  {"name": str, "arguments": str | object}}``; a ``'tool'`` message's ``tool_call_id`` a
  string.
* ``tools``: a list of ``{"type": "function", "function": {"name", "description"?,
  "parameters"?}}``, names ``[A-Za-z0-9_-]{1,64}`` and distinct.
* ``tool_choice``: ``'auto'``, ``'none'``, ``'required'`` or ``{"type": "function", "function":
  {"name": a tool given}}`` (the last two name a call the sampler cannot force: a 400 that says
  so).
* ``stream`` a bool, ``stream_options`` an object, ``user`` a string, ``stop`` a string or a
  list of strings, ``temperature`` / ``top_p`` numbers and ``top_k`` an int.

``sampling_params`` then turns the request into the engine's sampling spec, length cap and
stop ids (what the sampler cannot do is a 400 naming the parameter); ``text_prompt`` a
completion's prompt into ids; ``reward_fields`` checks an episode's closing request.
"""

from __future__ import annotations

import collections
import numbers
import re
from collections.abc import Mapping
from typing import Any

from rlax_llm.rollout.engine import MAX_STOP_IDS
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.serve.http_server import ApiError
from rlax_llm.tokenization import Tokenizer

# The message roles of OpenAI's chat API that a chat template can render ('developer' is
# rendered as 'system', as OpenAI does for models without a developer role).
ROLES = ('system', 'developer', 'user', 'assistant', 'tool')
# Request fields the sampler cannot honour, with the value that means "off".
_UNSUPPORTED = {'n': 1, 'presence_penalty': 0, 'frequency_penalty': 0, 'logit_bias': None,
                'best_of': 1, 'echo': False, 'suffix': None, 'top_logprobs': 0,
                'parallel_tool_calls': True}
# OpenAI's rule for a function's name.
_TOOL_NAME = re.compile(r'[A-Za-z0-9_-]{1,64}')
_SAMPLING_FIELDS = ('temperature', 'top_k', 'top_p')


def _invalid(param: str, message: str, code: str = 'invalid_value') -> ApiError:
  return ApiError(400, f'{param}: {message}', param=param, code=code)


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_object(value: Any, param: str, example: str) -> Mapping[str, Any]:
  if not isinstance(value, Mapping):
    raise _invalid(param, f'must be an object such as {example}; got {value!r:.100}.')
  return value


def _check_content(message: Mapping[str, Any], param: str, required: bool) -> None:
  content = message.get('content')
  if content is None:
    if required:
      raise _invalid(f'{param}.content', f'a {message["role"]!r} message needs its content '
                     '(a string).')
    return
  if isinstance(content, str):
    return
  if not isinstance(content, list):
    raise _invalid(f'{param}.content', 'must be a string or a list of text parts '
                   f'[{{"type": "text", "text": "..."}}]; got {content!r:.100}.')
  for j, part in enumerate(content):
    where = f'{param}.content[{j}]'
    part = _check_object(part, where, '{"type": "text", "text": "..."}')
    if part.get('type') != 'text':
      raise _invalid(f'{where}.type', f'{part.get("type")!r} is not supported: this endpoint '
                     'serves a text model; send text parts {"type": "text", "text": "..."}.',
                     code='unsupported_parameter')
    if not isinstance(part.get('text'), str):
      raise _invalid(f'{where}.text', f'must be a string; got {part.get("text")!r:.100}.')


def _check_tool_calls(calls: Any, param: str) -> None:
  if not isinstance(calls, list):
    raise _invalid(param, 'must be a list of {"id", "type": "function", "function": {"name", '
                   f'"arguments"}}}} objects; got {calls!r:.100}.')
  for j, call in enumerate(calls):
    where = f'{param}[{j}]'
    call = _check_object(call, where, '{"type": "function", "function": {...}}')
    if call.get('type', 'function') != 'function':
      raise _invalid(f'{where}.type', f'{call["type"]!r}: only "function" calls exist here.')
    if call.get('id') is not None and not isinstance(call['id'], str):
      raise _invalid(f'{where}.id', f'must be a string; got {call["id"]!r:.100}.')
    function = _check_object(call.get('function'), f'{where}.function',
                             '{"name": "f", "arguments": "{}"}')
    if not isinstance(function.get('name'), str) or not function['name']:
      raise _invalid(f'{where}.function.name', 'must be a non-empty string; got '
                     f'{function.get("name")!r:.100}.')
    if not isinstance(function.get('arguments'), (str, Mapping)):
      raise _invalid(f'{where}.function.arguments', 'must be a JSON string (or an object); got '
                     f'{function.get("arguments")!r:.100}.')


def _check_messages(messages: Any) -> None:
  if not isinstance(messages, list) or not messages:
    raise _invalid('messages', 'must be a non-empty list of objects such as {"role": "user", '
                   f'"content": "hi"}}; got {messages!r:.100}.')
  for i, message in enumerate(messages):
    param = f'messages[{i}]'
    message = _check_object(message, param, '{"role": "user", "content": "hi"}')
    role = message.get('role')
    if role not in ROLES:
      raise _invalid(f'{param}.role', f'{role!r} is not a role; use one of '
                     f'{", ".join(map(repr, ROLES))}.')
    _check_content(message, param, required=role != 'assistant')
    if message.get('name') is not None and not isinstance(message['name'], str):
      raise _invalid(f'{param}.name', f'must be a string; got {message["name"]!r:.100}.')
    if message.get('tool_calls') is not None:
      if role != 'assistant':
        raise _invalid(f'{param}.tool_calls', f'only an assistant message has tool calls; '
                       f'this one\'s role is {role!r}.')
      _check_tool_calls(message['tool_calls'], f'{param}.tool_calls')
    if role == 'tool' and not isinstance(message.get('tool_call_id'), str):
      raise _invalid(f'{param}.tool_call_id', 'a \'tool\' message must name the call it '
                     f'answers (a string); got {message.get("tool_call_id")!r:.100}.')


def _check_tools(tools: Any) -> list[str]:
  """The tools' names; ApiError for a malformed entry."""
  if not isinstance(tools, list):
    raise _invalid('tools', 'must be a list of {"type": "function", "function": {...}} '
                   f'objects; got {tools!r:.100}.')
  names = []
  for i, tool in enumerate(tools):
    param = f'tools[{i}]'
    tool = _check_object(tool, param, '{"type": "function", "function": {"name": "f"}}')
    if tool.get('type') != 'function':
      raise _invalid(f'{param}.type', f'{tool.get("type")!r}: only "function" tools are '
                     'supported.', code='unsupported_parameter')
    function = _check_object(tool.get('function'), f'{param}.function',
                             '{"name": "f", "description": "...", "parameters": {...}}')
    name = function.get('name')
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
      raise _invalid(f'{param}.function.name', f'{name!r:.100} must be a string of 1 to 64 '
                     'letters, digits, underscores or dashes.')
    if name in names:
      raise _invalid(f'{param}.function.name', f'{name!r} names two tools; tool names must be '
                     'distinct.')
    names.append(name)
    if function.get('description') is not None and not isinstance(function['description'],
                                                                   str):
      raise _invalid(f'{param}.function.description', 'must be a string; got '
                     f'{function["description"]!r:.100}.')
    if function.get('parameters') is not None and not isinstance(function['parameters'],
                                                                  Mapping):
      raise _invalid(f'{param}.function.parameters', 'must be a JSON Schema object; got '
                     f'{function["parameters"]!r:.100}.')
  return names


def _check_tool_choice(choice: Any, names: list[str] | None) -> None:
  if choice is None or choice in ('auto', 'none'):
    return
  if choice == 'required':
    forced, param = 'a tool call', 'tool_choice'
  elif isinstance(choice, Mapping):
    function = choice.get('function')
    if choice.get('type') != 'function' or not isinstance(function, Mapping):
      raise _invalid('tool_choice', 'must be "auto", "none", "required" or {"type": '
                     f'"function", "function": {{"name": "f"}}}}; got {choice!r:.100}.')
    name, param = function.get('name'), 'tool_choice.function.name'
    if name not in (names or ()):
      raise _invalid(param, f'{name!r:.100} is not among the request\'s tools '
                     f'({names or "none given"}).')
    forced = f'a call of {name!r}'
  else:
    raise _invalid('tool_choice', 'must be "auto", "none", "required" or {"type": '
                   f'"function", "function": {{"name": "f"}}}}; got {choice!r:.100}.')
  if not names:
    raise _invalid(param, f'{choice!r:.100} asks for {forced}, but the request has no tools.')
  raise _invalid(param, f'{choice!r:.100}: the sampler cannot force {forced}; use "auto" or '
                 '"none".', code='unsupported_parameter')


def check_request(body: Mapping[str, Any], chat: bool) -> None:
  """Refuses a malformed request (module docstring) with ApiError 400 naming the field; a
  chat's ``messages``, ``tools`` and ``tool_choice`` are checked when ``chat``."""
  if chat:
    _check_messages(body.get('messages'))
    names = None if body.get('tools') is None else _check_tools(body['tools'])
    _check_tool_choice(body.get('tool_choice'), names)
  for name in ('stream', 'echo'):
    if body.get(name) is not None and not isinstance(body[name], bool):
      raise _invalid(name, f'must be true or false; got {body[name]!r:.100}.')
  if body.get('stream_options') is not None:
    _check_object(body['stream_options'], 'stream_options', '{"include_usage": true}')
  if body.get('user') is not None and not isinstance(body['user'], str):
    raise _invalid('user', f'must be a string (the episode id); got {body["user"]!r:.100}.')
  stop = body.get('stop')
  if stop is not None and not isinstance(stop, str) and not (
      isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
    raise _invalid('stop', f'must be a string or a list of strings; got {stop!r:.100}.')
  for name in ('temperature', 'top_p'):
    if body.get(name) is not None and not _is_number(body[name]):
      raise _invalid(name, f'must be a number; got {body[name]!r:.100}.')
  if body.get('top_k') is not None and not _is_int(body['top_k']):
    raise _invalid('top_k', f'must be an int; got {body["top_k"]!r:.100}.')


def sampling_params(body: Mapping[str, Any], tokenizer: Tokenizer, *, max_decode_length: int,
                    default_max_tokens: int | None, fixed: SamplingSpec | None,
                    stats: collections.Counter[str]) -> tuple[SamplingSpec, int, list[int]]:
  """The request's sampling spec, length cap and stop ids (eos first).

  ``fixed`` (a training run's policy) replaces the request's ``temperature``, ``top_p`` and
  ``top_k`` (counted in ``stats['sampling_overridden']``); ``default_max_tokens`` (None: the
  engine's ``max_decode_length``) caps a request that names none. Raises ApiError 400 naming
  what the sampler cannot honour.
  """
  for name, off in _UNSUPPORTED.items():
    value = body.get(name)
    if value is not None and value != off and not (name == 'logit_bias' and not value):
      raise ApiError(400, f'{name}={value!r} is not supported by this endpoint\'s sampler '
                     f'(leave it out, or {off!r}).', param=name, code='unsupported_parameter')
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
  if fixed is not None:  # the run's policy, whatever the request asks
    spec = fixed
    if any(body.get(name) is not None for name in _SAMPLING_FIELDS):
      stats['sampling_overridden'] += 1
  else:
    get = lambda name, default: default if body.get(name) is None else body[name]
    try:
      spec = SamplingSpec(temperature=get('temperature', 1.0), top_k=get('top_k', 0),
                          top_p=get('top_p', 1.0))
    except ValueError as error:  # its message starts with the field: 'top_p=2 must be ...'
      param = next(n for n in _SAMPLING_FIELDS if str(error).startswith(f'{n}='))
      raise ApiError(400, str(error), param=param, code='invalid_value') from None
  cap = max_decode_length
  max_new = body.get('max_completion_tokens', body.get('max_tokens'))
  max_new = (default_max_tokens or cap) if max_new is None else max_new
  if not _is_int(max_new) or not 1 <= max_new <= cap:
    raise ApiError(400, f'max_tokens={max_new!r} must be an int in [1, {cap}] (the engine\'s '
                   'max_new_tokens).', param='max_tokens', code='invalid_value')
  seed = body.get('seed')
  if seed is not None and (not _is_int(seed) or not -2**63 <= seed < 2**63):
    raise ApiError(400, f'seed={seed!r} must be an int in [-2**63, 2**63).', param='seed')
  stop = body.get('stop') or []
  stop_ids = [tokenizer.eos_id]
  for text in [stop] if isinstance(stop, str) else stop:
    ids = tokenizer.encode(text)
    if len(ids) != 1:
      raise ApiError(400, f'stop={text!r}: the engine stops on single tokens and this '
                     f'encodes to {ids}; use stop strings that are one token each.',
                     param='stop', code='unsupported_parameter')
    stop_ids.append(ids[0])
  stop_ids = list(dict.fromkeys(stop_ids))
  if len(stop_ids) > MAX_STOP_IDS:
    raise ApiError(400, f'{len(stop_ids)} stop tokens (eos included); at most '
                   f'{MAX_STOP_IDS} are supported.', param='stop')
  return spec, max_new, stop_ids


def text_prompt(body: Mapping[str, Any], tokenizer: Tokenizer, vocab_size: int) -> list[int]:
  """A completion's prompt ids: ``prompt`` one string (encoded, with bos if the tokenizer
  adds one) or one non-empty list of ids in ``[0, vocab_size)``; ApiError 400 otherwise."""
  prompt = body.get('prompt')
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]  # one prompt in a batch of one
  if isinstance(prompt, str):
    try:
      ids = tokenizer.encode(prompt, add_bos=tokenizer.add_bos_token)
    except ValueError as error:
      raise ApiError(400, str(error), param='prompt') from None
  elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
    ids = list(prompt)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
      raise ApiError(400, f'prompt token ids {bad[:5]} are outside the vocabulary [0, '
                     f'{vocab_size}).', param='prompt')
  else:
    raise ApiError(400, f'prompt must be one string or one list of token ids; got '
                   f'{prompt!r:.100}.', param='prompt')
  if not ids:
    raise ApiError(400, 'the prompt is empty.', param='prompt')
  return ids


def reward_fields(body: Mapping[str, Any]
                  ) -> tuple[float | None, list[float] | None, int | None, int]:
  """An episode's closing request (``POST /v1/episodes/{id}/reward``) checked: ``(reward or
  None (the endpoint's reward_fn), turn_rewards or None, group_id or None, prompt_id (-1 when
  absent))``; ApiError 400 naming a field of the wrong type."""
  value, turns = body.get('reward'), body.get('turn_rewards')
  if value is not None and not _is_number(value):
    raise ApiError(400, f'reward must be a number (or null to use the endpoint\'s '
                   f'reward_fn); got {value!r}.', param='reward')
  if turns is not None and (not isinstance(turns, list) or not all(map(_is_number, turns))):
    raise ApiError(400, f'turn_rewards must be a list of numbers, one per call; got '
                   f'{turns!r:.100}.', param='turn_rewards')
  for name in ('group_id', 'prompt_id'):
    if body.get(name) is not None and not _is_int(body[name]):
      raise ApiError(400, f'{name} must be an int; got {body[name]!r}.', param=name)
  prompt_id = body.get('prompt_id')
  return value, turns, body.get('group_id'), -1 if prompt_id is None else prompt_id
