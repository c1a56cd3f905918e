"""Tool calls in the model's own format: one parser and one renderer per format.

A model calls a tool by writing text; which text depends on the checkpoint's chat template
(docs/environments.md has the table). ``tool_format_for`` picks the format from the template:

* ``'qwen'``: Qwen2.5 / Qwen3 (and Hermes-style templates): any number of
  ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`` blocks anywhere in the
  message, text around them allowed. The tools reach the model through the template
  (``apply_chat_template(..., tools=tools)``); a result goes back as a ``role: 'tool'`` message,
  which the template renders inside ``<tool_response></tool_response>``.
* ``'llama3'``: Llama 3.1 / 3.2 / 3.3 JSON tool calling: the whole message is the call,
  ``{"name": NAME, "parameters": {...}}`` (``"arguments"`` is accepted instead of
  ``"parameters"``), optionally after ``<|python_tag|>``; several calls are separated by ``;``.
  A message that does not start with ``{`` (after the tag) holds no call. Tools go through the
  template; a result is a ``role: 'tool'`` message (the template writes an ``ipython`` turn).
* ``'simple'``: for checkpoints whose template knows no tools (SmolLM2): the call syntax is
  ``'qwen'``'s (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, newlines
  optional), the tools are described in the system message by ``simple_tools_prompt`` (our own
  text), and a result comes back as a user message ``<tool_response>\\nRESULT\\n</tool_response>``.

Parsing is linear in the text and bounded: at most ``MAX_TOOL_CALLS`` calls per message and at
most ``MAX_CALL_CHARS`` characters of JSON per call; past either cap, and on anything malformed
(invalid JSON, no ``name``, ``arguments`` not an object, an unclosed or stray tag, a message cut
mid-call), ``parse_tool_calls`` raises ``ToolCallError`` saying what was wrong, at which
character, with the text there, so that an environment can show the model its mistake.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlax_llm.errors import ToolCallError

FORMATS = ('qwen', 'llama3', 'simple')
# Caps on one message: a message with more calls, or a call with more JSON, is malformed.
MAX_TOOL_CALLS = 16
MAX_CALL_CHARS = 16_384
# Characters of the message shown around the position of an error.
EXCERPT_CHARS = 40

OPEN_TAG, CLOSE_TAG = '<tool_call>', '</tool_call>'
PYTHON_TAG = '<|python_tag|>'
RESPONSE_OPEN, RESPONSE_CLOSE = '<tool_response>', '</tool_response>'
_WHITESPACE = ' \t\n\r'
# The key of the arguments object in each format (the first is what ``render_tool_call`` writes).
_ARGUMENT_KEYS = {'qwen': ('arguments',), 'simple': ('arguments',),
                  'llama3': ('parameters', 'arguments')}


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One parsed tool call.

  name: the tool's name. arguments: the JSON object of its arguments (``{}`` when the call
  gives none). raw: the exact text of the call in the message (tags included for ``'qwen'`` /
  ``'simple'``; the JSON object for ``'llama3'``).
  """

  name: str
  arguments: dict[str, Any]
  raw: str


def _reject_constant(name: str) -> None:
  raise ValueError(f'{name} is not valid JSON (write a number or a string)')


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def check_format(fmt: str) -> str:
  """``fmt`` if it is one of ``FORMATS``; else ValueError listing them."""
  if fmt not in FORMATS:
    raise ValueError(f'unknown tool-call format {fmt!r}; choose one of {FORMATS} '
                     '(tool_format_for(tokenizer) picks it from the chat template).')
  return fmt


def _excerpt(text: str, position: int) -> str:
  start = max(0, position - EXCERPT_CHARS // 2)
  return repr(text[start:position + EXCERPT_CHARS // 2])


def _error(what: str, text: str, position: int, fmt: str) -> ToolCallError:
  if fmt == 'llama3':
    fix = 'write {"name": "TOOL", "parameters": {...}} as the whole message'
  else:
    fix = 'write <tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>'
  return ToolCallError(f'malformed tool call: {what} at character {position} (text there: '
                       f'{_excerpt(text, position)}); {fix}.')


def _skip_whitespace(text: str, position: int, end: int) -> int:
  while position < end and text[position] in _WHITESPACE:
    position += 1
  return position


def _decode_object(text: str, position: int, fmt: str) -> tuple[ToolCall, int]:
  """The call whose JSON object starts at ``text[position] == '{'``: (call, end position).
  Decodes at most ``MAX_CALL_CHARS`` characters."""
  window_end = min(len(text), position + MAX_CALL_CHARS)
  window = text[position:window_end]
  try:
    value, end = _DECODER.raw_decode(window)
  except json.JSONDecodeError as e:
    cut = e.pos >= len(window) - 1 or e.msg.startswith('Unterminated')
    if cut and window_end < len(text):
      raise _error(f'a call longer than {MAX_CALL_CHARS} characters (the cap on one call)',
                   text, position, fmt) from None
    if cut:
      raise _error('the message ends inside the call (cut mid-call)', text, position,
                   fmt) from None
    raise _error(f'invalid JSON ({e.msg})', text, position + e.pos, fmt) from None
  except (ValueError, RecursionError) as e:
    raise _error(f'invalid JSON ({e})', text, position, fmt) from None
  raw = window[:end]
  if not isinstance(value, dict):
    raise _error(f'the call is a JSON {type(value).__name__}, not an object', text, position,
                 fmt)
  name = value.get('name')
  if not isinstance(name, str) or not name:
    raise _error(f'"name" must be a non-empty string, got {name!r}', text, position, fmt)
  keys = _ARGUMENT_KEYS[fmt]
  unknown = sorted(set(value) - {'name', *keys})
  if unknown:
    raise _error(f'unknown keys {unknown} (a call has "name" and "{keys[0]}")', text,
                 position, fmt)
  given = [key for key in keys if key in value]
  if len(given) > 1:
    raise _error(f'both {given} given; use "{keys[0]}"', text, position, fmt)
  arguments = value[given[0]] if given else {}
  if not isinstance(arguments, dict):
    raise _error(f'"{given[0]}" must be a JSON object, got {type(arguments).__name__} '
                 f'{arguments!r:.60}', text, position, fmt)
  return ToolCall(name=name, arguments=arguments, raw=raw), position + end


def _parse_tagged(text: str, fmt: str) -> list[ToolCall]:
  """``<tool_call>{json}</tool_call>`` blocks anywhere in ``text`` (formats qwen, simple)."""
  calls: list[ToolCall] = []
  position = 0
  while True:
    start = text.find(OPEN_TAG, position)
    stray = text.find(CLOSE_TAG, position, len(text) if start < 0 else start)
    if stray >= 0:
      raise _error(f'{CLOSE_TAG} without an opening {OPEN_TAG}', text, stray, fmt)
    if start < 0:
      return calls
    if len(calls) == MAX_TOOL_CALLS:
      raise _error(f'more than {MAX_TOOL_CALLS} tool calls in one message (the cap)', text,
                   start, fmt)
    body = _skip_whitespace(text, start + len(OPEN_TAG),
                            min(len(text), start + len(OPEN_TAG) + MAX_CALL_CHARS))
    if body >= len(text):
      raise _error(f'unclosed {OPEN_TAG} (the message ends inside the call)', text, start, fmt)
    if text[body] != '{':
      raise _error(f'expected a JSON object after {OPEN_TAG}', text, body, fmt)
    call, end = _decode_object(text, body, fmt)
    close = _skip_whitespace(text, end, min(len(text), end + MAX_CALL_CHARS))
    if not text.startswith(CLOSE_TAG, close):
      cut = CLOSE_TAG.startswith(text[close:close + len(CLOSE_TAG)])  # text ends in the tag
      what = (f'unclosed {OPEN_TAG} (the message ends inside the call)' if cut
              else f'expected {CLOSE_TAG} after the JSON object')
      raise _error(what, text, close, fmt)
    position = close + len(CLOSE_TAG)
    calls.append(dataclasses.replace(call, raw=text[start:position]))


def _parse_llama3(text: str) -> list[ToolCall]:
  """The whole message as ``{json}`` calls separated by ``;``, after an optional
  ``<|python_tag|>``; a message that does not start with ``{`` holds no call."""
  position = _skip_whitespace(text, 0, len(text))
  tagged = text.startswith(PYTHON_TAG, position)
  if tagged:
    position = _skip_whitespace(text, position + len(PYTHON_TAG), len(text))
  if position >= len(text) or text[position] != '{':
    if tagged:
      raise _error(f'expected a JSON object after {PYTHON_TAG}', text, position, 'llama3')
    return []
  calls: list[ToolCall] = []
  while True:
    if len(calls) == MAX_TOOL_CALLS:
      raise _error(f'more than {MAX_TOOL_CALLS} tool calls in one message (the cap)', text,
                   position, 'llama3')
    call, end = _decode_object(text, position, 'llama3')
    calls.append(call)
    position = _skip_whitespace(text, end, len(text))
    if position >= len(text):
      return calls
    if text[position] != ';':
      raise _error('text after the tool call (a call is the whole message; separate several '
                   'with ";")', text, position, 'llama3')
    position = _skip_whitespace(text, position + 1, len(text))
    if position >= len(text) or text[position] != '{':
      raise _error('expected a JSON object after ";"', text, position, 'llama3')


def parse_tool_calls(text: str, fmt: str) -> list[ToolCall]:
  """The tool calls in an assistant message, in order; ``[]`` when it makes none.

  text: the message as decoded text. fmt: one of ``FORMATS`` (module docstring).
  Raises ToolCallError (what was wrong, the character position, the text there) for a
  malformed call or one past the caps (``MAX_TOOL_CALLS``, ``MAX_CALL_CHARS``); ValueError for
  an unknown ``fmt``. Linear in ``len(text)``.
  """
  if not isinstance(text, str):
    raise TypeError(f'parse_tool_calls expects the message text as a str, got '
                    f'{type(text).__name__}: {text!r:.80}.')
  if check_format(fmt) == 'llama3':
    return _parse_llama3(text)
  return _parse_tagged(text, fmt)


def render_tool_call(name: str, arguments: Mapping[str, Any], fmt: str) -> str:
  """The text a model writes to call ``name`` with ``arguments`` in format ``fmt`` (what the
  checkpoint's template writes for an assistant ``tool_calls`` entry); ``parse_tool_calls``
  of it gives the call back. Used for demonstrations and scripted policies."""
  if check_format(fmt) == 'llama3':
    return json.dumps({'name': name, 'parameters': dict(arguments)}, ensure_ascii=False)
  body = json.dumps({'name': name, 'arguments': dict(arguments)}, ensure_ascii=False)
  return f'{OPEN_TAG}\n{body}\n{CLOSE_TAG}'


def format_tool_result(content: str, fmt: str, name: str | None = None) -> dict[str, str]:
  """The chat message that carries a tool's result back to the model in format ``fmt``.

  ``'qwen'`` / ``'llama3'``: ``{'role': 'tool', 'content': content}`` (plus ``'name'`` when
  given), which the checkpoint's template renders (``<tool_response>`` in a user turn; an
  ``ipython`` turn). ``'simple'``: a user message ``<tool_response>\\ncontent\\n</tool_response>``
  (templates without tools render every role as given, and not all accept ``'tool'``).
  """
  if check_format(fmt) == 'simple':
    return {'role': 'user', 'content': f'{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}'}
  message = {'role': 'tool', 'content': content}
  if name is not None:
    message['name'] = name
  return message


def simple_tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
  """The system-message text that describes ``tools`` (OpenAI-style function schemas) and the
  ``'simple'`` call syntax to a model whose chat template knows no tools."""
  lines = ['You can call these tools (JSON schemas):']
  lines += [json.dumps(tool.get('function', tool), ensure_ascii=False) for tool in tools]
  lines.append(f'To call a tool, write {OPEN_TAG}{{"name": "TOOL", "arguments": {{...}}}}'
               f'{CLOSE_TAG}. The result comes back as {RESPONSE_OPEN}RESULT'
               f'{RESPONSE_CLOSE}.')
  return '\n'.join(lines)


def with_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
               fmt: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """``(messages, template_kwargs)`` that present ``tools`` to a model in format ``fmt``:
  ``tokenizer.apply_chat_template(messages, **template_kwargs)`` renders the conversation.

  ``'qwen'`` / ``'llama3'``: the messages unchanged and ``{'tools': tools}`` (the template
  writes its own tool prompt). ``'simple'``: ``simple_tools_prompt(tools)`` added to the
  system message (a new first message if there is none) and no kwargs. No tools: unchanged.
  """
  messages = [dict(m) for m in messages]
  if not tools:
    check_format(fmt)
    return messages, {}
  if check_format(fmt) != 'simple':
    return messages, {'tools': [dict(tool) for tool in tools]}
  prompt = simple_tools_prompt(tools)
  if messages and messages[0].get('role') == 'system':
    messages[0]['content'] = f'{messages[0].get("content") or ""}\n\n{prompt}'.lstrip()
  else:
    messages.insert(0, {'role': 'system', 'content': prompt})
  return messages, {}


def tool_format_for(tokenizer_or_template: Any) -> str:
  """The tool-call format of a checkpoint: ``'qwen'`` if its chat template writes
  ``<tool_call>``, ``'llama3'`` if it is a Llama 3 template (``<|start_header_id|>``) that
  takes ``tools``, else ``'simple'`` (also for no template).

  tokenizer_or_template: a ``Tokenizer`` (its ``chat_template`` is read), a template str, or
  None.
  """
  template = getattr(tokenizer_or_template, 'chat_template', tokenizer_or_template)
  if not isinstance(template, str):
    return 'simple'
  if OPEN_TAG in template:
    return 'qwen'
  if '<|start_header_id|>' in template and 'tools' in template:
    return 'llama3'
  return 'simple'


def run_tool_calls(calls: Sequence[ToolCall],
                   functions: Mapping[str, Callable[..., Any]]) -> list[str]:
  """Runs each call as ``functions[call.name](**call.arguments)``; returns each result as
  text, in order (``format_tool_result`` makes the messages). Never raises for a call: an
  unknown tool, arguments the function does not take, or a function that raises gives a result
  ``error: ...`` that says so (the model sees its mistake in the next turn)."""
  results = []
  for call in calls:
    function = functions.get(call.name)
    if function is None:
      results.append(f'error: unknown tool {call.name!r}; the tools are {sorted(functions)}.')
      continue
    try:
      results.append(str(function(**call.arguments)))
    except Exception as e:  # noqa: BLE001  (a tool's failure is shown to the model)
      results.append(f'error: {call.name} raised {type(e).__name__}: {e}')
  return results
