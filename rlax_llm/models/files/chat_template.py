"""Chat templates rendered the way ``transformers`` renders them (jinja2, sandboxed).

``render(template, messages, add_generation_prompt=False, **variables)`` is what
``HFTokenizer.apply_chat_template`` uses; the environment, the message preparation and the
compile cache live here so that one place defines how a template sees a conversation.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may come under; templates read ``reasoning_content`` (or
# ``thinking``, gpt-oss), so transformers fills both from whichever is given.
_REASONING_KEYS = ('reasoning_content', 'thinking', 'reasoning')


@functools.cache
def chat_environment() -> jinja2.Environment:
  """The sandboxed jinja2 environment transformers renders chat templates in.

  ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension (``break`` / ``continue``), a ``{% generation %}`` block tag that
  renders its body unchanged (transformers uses it to locate assistant tokens), a ``tojson``
  filter that does not HTML-escape (``json.dumps`` with ``ensure_ascii=False`` by default), and
  the ``raise_exception(message)`` and ``strftime_now(format)`` globals.
  """
  class GenerationBlock(jinja2.ext.Extension):
    """``{% generation %} body {% endgeneration %}`` renders as ``body``."""

    tags: ClassVar[set[str]] = {'generation'}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method('_render_body'), [], [],
                                    body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
      return caller()

  def raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
             separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(format_string: str) -> str:
    return datetime.datetime.now().strftime(format_string)

  environment = ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[GenerationBlock, jinja2.ext.loopcontrols])
  environment.filters['tojson'] = tojson
  environment.globals['raise_exception'] = raise_exception
  environment.globals['strftime_now'] = strftime_now
  return environment


@functools.lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
  """``template`` compiled in ``chat_environment()`` (cached: compiling is the slow part)."""
  return chat_environment().from_string(template)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """Copies of ``messages`` as transformers hands them to a template.

  Keys whose value is None are dropped (templates test for a key, not for None), and a
  message's reasoning, given under any of ``_REASONING_KEYS``, is also put under ``thinking``
  and ``reasoning_content``.
  """
  if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
    raise TypeError(f'messages must be a list of dicts such as [{{"role": "user", "content": '
                    f'"hi"}}], got {type(messages).__name__}: {messages!r}.')
  if not messages:
    raise ValueError('messages is empty; a chat template needs at least one message, e.g. '
                     '[{"role": "user", "content": "hi"}].')
  plain = []
  for index, message in enumerate(messages):
    if not isinstance(message, Mapping):
      raise TypeError(f'messages[{index}] is a {type(message).__name__} ({message!r}); every '
                      'message must be a dict like {"role": "user", "content": "hi"}.')
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_KEYS if key in message), None)
    if reasoning is not None:
      message = {'thinking': reasoning, **message, 'reasoning_content': reasoning}
    plain.append(message)
  return plain


def render(template: str, messages: Sequence[Mapping[str, Any]], *,
           add_generation_prompt: bool = False, **variables: Any) -> str:
  """Renders ``messages`` with ``template``; ``variables`` are extra template variables."""
  return compile_template(template).render(
      **variables, messages=template_messages(messages),
      add_generation_prompt=add_generation_prompt)
