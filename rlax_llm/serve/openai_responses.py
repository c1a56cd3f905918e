"""A sample as OpenAI's API answers it: the assistant message (its tool calls parsed in the
checkpoint's format), the ``text_completion`` / ``chat.completion`` payloads with the sampled
tokens' log-probs, and the server-sent events of a stream (``chat.completion.chunk`` /
``text_completion`` chunks, the usage if asked, ``[DONE]``).
"""

from __future__ import annotations

import collections
import itertools
import json
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rlax_llm.envs.tool_calls import ToolCall, parse_tool_calls
from rlax_llm.errors import ToolCallError
from rlax_llm.rollout.driver import Sample
from rlax_llm.tokenization import Tokenizer


def tool_calls(text: str, fmt: str, stats: collections.Counter[str]) -> list[ToolCall]:
  """The tool calls in a reply's ``text`` (tool format ``fmt``); none for a malformed one,
  counted in ``stats['malformed_tool_calls']`` (the reply is then plain content)."""
  try:
    return parse_tool_calls(text, fmt)
  except ToolCallError:
    stats['malformed_tool_calls'] += 1
    return []


def reply_message(text: str, calls: Sequence[ToolCall], episode: str, index: int
                  ) -> dict[str, Any]:
  """The assistant message: the text around the tool calls, and the calls (ids
  ``call_<episode tail>_<call index>_<i>``; ``arguments`` a JSON string)."""
  if not calls:
    return {'role': 'assistant', 'content': text}
  content = text
  for call in calls:
    content = content.replace(call.raw, '', 1)
  return {'role': 'assistant', 'content': content.strip() or None, 'tool_calls': [
      {'id': f'call_{episode[-8:]}_{index}_{i}', 'type': 'function',
       'function': {'name': call.name, 'arguments': json.dumps(call.arguments,
                                                               ensure_ascii=False)}}
      for i, call in enumerate(calls)]}


def finish_reason(sample: Sample) -> str:
  """OpenAI's finish reason of a sample without tool calls: ``'length'`` or ``'stop'``."""
  return 'length' if sample.finish_reason == 'length' else 'stop'


def wants_logprobs(body: Mapping[str, Any], chat: bool) -> bool:
  """Whether the request asks for the sampled tokens' log-probs (``logprobs=true`` for a chat,
  any ``logprobs`` for a completion)."""
  return bool(body.get('logprobs')) if chat else body.get('logprobs') is not None


def piece_logprobs(tokenizer: Tokenizer, sample: Sample, lo: int, hi: int | None, chat: bool
                   ) -> dict[str, Any]:
  """The log-probs of tokens ``[lo, hi)`` of ``sample`` in a chat's or a completion's shape
  (a completion's ``text_offset`` is relative to the first of them)."""
  pairs = [(tokenizer.decode([t], stop_at_eos=False), float(lp))
           for t, lp in zip(sample.tokens[lo:hi], sample.logprobs[lo:hi])]
  if chat:
    return {'content': [{'token': t, 'logprob': lp, 'bytes': list(t.encode()),
                         'top_logprobs': []} for t, lp in pairs]}
  offsets = list(itertools.accumulate((len(t) for t, _ in pairs), initial=0))[:-1]
  return {'tokens': [t for t, _ in pairs], 'token_logprobs': [lp for _, lp in pairs],
          'top_logprobs': None, 'text_offset': offsets}


def completion_payload(tokenizer: Tokenizer, model: str, body: Mapping[str, Any],
                       sample: Sample, text: str) -> dict[str, Any]:
  """A ``text_completion`` of ``sample`` (decoded: ``text``), without its usage."""
  logprobs = (piece_logprobs(tokenizer, sample, 0, None, chat=False)
              if wants_logprobs(body, chat=False) else None)
  return {'id': f'cmpl-{uuid.uuid4().hex}', 'object': 'text_completion',
          'created': int(time.time()), 'model': model,
          'choices': [{'index': 0, 'text': text, 'logprobs': logprobs,
                       'finish_reason': finish_reason(sample)}]}


def chat_payload(tokenizer: Tokenizer, model: str, body: Mapping[str, Any], sample: Sample,
                 reply: Mapping[str, Any]) -> dict[str, Any]:
  """A ``chat.completion`` whose message is ``reply``, without its usage (finish reason
  ``'tool_calls'`` when the reply has calls)."""
  logprobs = (piece_logprobs(tokenizer, sample, 0, None, chat=True)
              if wants_logprobs(body, chat=True) else None)
  finish = 'tool_calls' if reply.get('tool_calls') else finish_reason(sample)
  return {'id': f'chatcmpl-{uuid.uuid4().hex}', 'object': 'chat.completion',
          'created': int(time.time()), 'model': model,
          'choices': [{'index': 0, 'message': dict(reply), 'logprobs': logprobs,
                       'finish_reason': finish}]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
  """OpenAI's ``usage`` object."""
  return {'prompt_tokens': prompt_tokens, 'completion_tokens': completion_tokens,
          'total_tokens': prompt_tokens + completion_tokens}


def stream_head(model: str, chat: bool) -> dict[str, Any]:
  """The fields every chunk of a new stream repeats: its id, creation time, model, object."""
  return {'id': f'{"chatcmpl" if chat else "cmpl"}-{uuid.uuid4().hex}',
          'created': int(time.time()), 'model': model,
          'object': 'chat.completion.chunk' if chat else 'text_completion'}


def choice(chat: bool, text: str | None, *, role: bool = False, finish: str | None = None,
           logprobs: Any = None) -> dict[str, Any]:
  """One streamed choice: a chat ``delta`` (with the role in the first) or a completion's
  ``text`` piece; the last carries the finish reason and no text."""
  if chat:
    delta = {} if text is None and not role else {'content': text}
    if role:
      delta = {'role': 'assistant', **delta}
    return {'index': 0, 'delta': delta, 'logprobs': logprobs, 'finish_reason': finish}
  return {'index': 0, 'text': text or '', 'logprobs': logprobs, 'finish_reason': finish}


def event(head: Mapping[str, Any], chunk_choice: Mapping[str, Any]) -> str:
  """A server-sent event of one chunk with one choice."""
  return f'data: {json.dumps({**head, "choices": [chunk_choice]})}\n\n'


def closing_events(head: Mapping[str, Any], usage_: Mapping[str, int] | None) -> Iterator[str]:
  """A stream's last events: the usage (when asked: ``usage_`` not None), then ``[DONE]``."""
  if usage_ is not None:
    yield f'data: {json.dumps({**head, "choices": [], "usage": dict(usage_)})}\n\n'
  yield 'data: [DONE]\n\n'


def whole_stream_events(payload: Mapping[str, Any], chat: bool, with_usage: bool
                        ) -> Iterator[str]:
  """``payload`` (a whole completion) as server-sent events: one chunk with the whole reply
  (a chat's tool calls included), one with the finish reason, the usage if asked, ``[DONE]``.
  """
  only = payload['choices'][0]
  head = {'id': payload['id'], 'created': payload['created'], 'model': payload['model'],
          'object': 'chat.completion.chunk' if chat else 'text_completion'}
  if chat:
    message = only['message']
    first = choice(True, message.get('content'), role=True, logprobs=only['logprobs'])
    if message.get('tool_calls'):
      first['delta']['tool_calls'] = [{'index': i, **call}
                                      for i, call in enumerate(message['tool_calls'])]
  else:
    first = {**only, 'finish_reason': None}
  yield event(head, first)
  yield event(head, choice(chat, None, finish=only['finish_reason']))
  yield from closing_events(head, payload['usage'] if with_usage else None)
