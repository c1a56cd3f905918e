"""A chat request's prompt ids: OpenAI messages as the checkpoint's chat template takes them,
rendered by the multi-turn runner's renderer, and spliced onto the episode's previous call
where the messages extend it.

When a request's messages are the previous call's messages, then the reply the endpoint gave
(same role, content and tool calls; tool call ids may differ), then new messages, its prompt is
the previous call's prompt and sampled ids followed by ``ChatRenderer.between_turns`` (the
template's end of the assistant turn, the new messages, the next assistant header), never a
re-tokenisation of the sampled text. Otherwise (an edited history, or a template that rewrites
earlier turns) the messages are rendered afresh, and the recorder splits the episode there
(docs/serving.md).

The messages are checked first (``openai_requests.check_request``); what the template itself
cannot render is a 400 naming ``messages``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from rlax_llm.envs.tool_calls import format_tool_result, render_tool_call
from rlax_llm.models.files.chat_template import template_messages
from rlax_llm.envs.conversation import make_renderer
from rlax_llm.serve.http_server import ApiError
from rlax_llm.tokenization import Tokenizer


@dataclasses.dataclass
class ChatState:
  """What the next chat call of an episode needs to extend this one: the template messages up
  to and including the reply (``canonical`` forms), the ids the model saw and sampled, and the
  reply's stop token (None: cut by its length)."""

  messages: list[tuple]
  ids: list[int]
  last_token: int | None


def template_message(message: Mapping[str, Any], fmt: str) -> dict[str, Any]:
  """An OpenAI message as chat templates take it: text parts joined into one string, tool
  call arguments (a JSON string in OpenAI's API) as objects, a ``'developer'`` message as a
  ``'system'`` one. In the ``'simple'`` tool format (a template that knows no tools) tool calls
  become the assistant's text (``render_tool_call``) and a ``'tool'`` message the user message
  that carries a result (``format_tool_result``), as the environments present them."""
  message = dict(message)
  if message.get('role') == 'developer':
    message['role'] = 'system'
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


def canonical(message: Mapping[str, Any], fmt: str) -> tuple:
  """What makes two messages the same turn for splicing: role, text, tool calls (name and
  arguments; not their ids, which a harness may rewrite) and the tool call answered."""
  message = template_message(message, fmt)
  calls = tuple((c.get('function', {}).get('name'),
                 json.dumps(c.get('function', {}).get('arguments'), sort_keys=True))
                for c in message.get('tool_calls') or ())
  return (message.get('role'), message.get('content') or '', calls,
          message.get('tool_call_id'), message.get('name'))


def chat_prompt(tokenizer: Tokenizer, fmt: str, raw: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None, state: ChatState | None,
                stats: collections.Counter[str]) -> tuple[list[int], list[dict[str, Any]]]:
  """The prompt ids of a chat request (``raw``: its checked messages, ``tools`` its tools or
  None) and its template messages, spliced onto ``state`` (the episode's previous call) where
  they extend it (module docstring). Counts ``stats['chat_spliced']`` /
  ``['chat_not_spliced']``; ApiError 400 ``messages`` for what the template cannot render."""
  # The multi-turn runner's renderer: the tools in the checkpoint's format (with_tools), the
  # same ids for a conversation whichever of the two builds it.
  renderer = make_renderer(tokenizer, tools)
  try:
    messages = template_messages([template_message(m, fmt) for m in raw])
    fresh = renderer.prompt(messages)
    forms = [canonical(m, fmt) for m in messages]
  except Exception as error:  # noqa: BLE001  (a template that raises on these messages)
    raise ApiError(400, f'these messages cannot be rendered by the chat template: '
                   f'{type(error).__name__}: {error}', param='messages') from None
  k = 0 if state is None else len(state.messages)
  if state is None or len(messages) <= k or forms[:k] != state.messages:
    return fresh, messages
  try:  # the multi-turn runner's definition of the ids between two assistant turns
    between = renderer.between_turns(messages[:k - 1], messages[k:], state.last_token)
  except ValueError:  # the template rewrites earlier turns: render afresh (a split)
    stats['chat_not_spliced'] += 1
    return fresh, messages
  stats['chat_spliced'] += 1
  return state.ids + between, messages


def state_after(messages: Sequence[Mapping[str, Any]], reply: Mapping[str, Any], fmt: str,
                ids: Sequence[int], last_token: int | None) -> ChatState:
  """The state a chat call leaves for the episode's next: its template ``messages`` and the
  ``reply`` it gave, the ``ids`` the model saw and sampled, and the reply's stop token."""
  return ChatState([canonical(m, fmt) for m in (*messages, reply)], list(ids), last_token)
