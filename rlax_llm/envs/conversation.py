"""How an episode's conversation becomes token ids: the chat-template renderers.

An environment run and the supervised warm-up on its oracle's episodes must produce the same
ids for the same conversation, so both render it here: ``make_renderer`` picks the
tokenizer's chat template with the environment's tools (``ChatRenderer``) or the texts alone
(``PlainRenderer``); ``first_messages`` is an episode's opening turn and ``observe`` the ids
fed between two assistant turns. ``demonstration`` plays an environment's oracle through the
same functions, as the ids and loss mask the episode runner (``rlax_llm.rollout.episodes``)
records for a model that samples exactly the oracle's actions; the warm-up
(``rlax_llm.trainer.warmup``) trains on them, and the OpenAI-compatible endpoint
(``rlax_llm.serve.chat_prompts``) renders its calls with ``make_renderer``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlax_llm.envs.base import Environment, EnvStep, observation_messages
from rlax_llm.envs.tool_calls import tool_format_for, with_tools
from rlax_llm.tokenization import Message, Tokenizer

# A content no template rewrites, standing in for an assistant turn while the runner finds
# the text the template writes around one.
_SENTINEL = 'RLAXASSISTANTTURN0x5f3a'


class PlainRenderer:
  """Conversations for a tokenizer without a chat template: the first observation is the
  prompt (with bos if the model expects one), later ones are appended as their text."""

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer

  def prompt(self, messages: Sequence[Message]) -> list[int]:
    """The ids of the messages' texts, concatenated (an episode's first prompt: the first
    user message's), with bos if the model expects one."""
    return self.tokenizer.encode(''.join(str(m.get('content') or '') for m in messages),
                                 add_bos=self.tokenizer.add_bos_token)

  def between_turns(self, history: Sequence[Message], new: Sequence[Message],
                    last_token: int | None) -> list[int]:
    """The ids of the new messages' texts, concatenated."""
    del history, last_token
    return self.tokenizer.encode(''.join(str(m['content']) for m in new))


class ChatRenderer:
  """Conversations rendered by the tokenizer's chat template, with ``tools`` presented in the
  checkpoint's own tool format (``tool_calls.with_tools``: the template's ``tools`` for
  Qwen / Llama 3 templates, a system prompt for others).

  ``between_turns`` is the delta between the template rendered without and with the new
  messages, so ``prompt(m0) + turn 1 + between_turns(...) + turn 2 ...`` equals the ids of
  the whole conversation rendered at once whenever the sampled turns are what the tokenizer
  would give for their text (tests/rollout/test_episodes.py checks it on SmolLM2's template
  and on a Qwen2.5-style one with tools). A template whose rendering of a conversation is not
  a prefix of its rendering of a longer one (one that rewrites earlier turns) is refused
  with the two texts.
  """

  def __init__(self, tokenizer: Tokenizer, tools: Sequence[Mapping[str, Any]] | None = None):
    if tokenizer.chat_template is None:
      raise ValueError(f'{tokenizer!r} has no chat template; use PlainRenderer.')
    self.tokenizer = tokenizer
    self.tools = list(tools or [])
    self.tool_format = tool_format_for(tokenizer)

  def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """The template's text of ``messages`` with the tools."""
    messages, variables = with_tools(messages, self.tools, self.tool_format)
    return self.tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, **variables)

  def prompt(self, messages: Sequence[Message]) -> list[int]:
    """The ids of ``messages`` with the assistant header appended (no bos added: the
    template writes its own)."""
    return self.tokenizer.encode(self.render(messages, True))

  def between_turns(self, history: Sequence[Message], new: Sequence[Message],
                    last_token: int | None) -> list[int]:
    """The ids that follow an assistant turn sampled after ``history`` and precede the next
    assistant turn: the template's end of the assistant turn, ``new`` (the observation
    messages) and the next assistant header. ``last_token``: the turn's last sampled id when
    it was a stop token, which the template's end-of-turn text starts with and the model
    already wrote (dropped here); None when the turn was cut by its length (the template's
    end-of-turn tokens are then inserted whole)."""
    header = self.render(history, True)
    turn = [*history, {'role': 'assistant', 'content': _SENTINEL}]
    before = self.render(turn, False)
    after = self.render([*turn, *new], True)
    if not before.startswith(header + _SENTINEL) or not after.startswith(before):
      raise ValueError('the chat template does not render a conversation as a prefix of the '
                       'conversation continued (it rewrites earlier turns), so turns cannot be '
                       f'appended token-faithfully: {before!r} vs {after!r}.')
    ids = self.tokenizer.encode(before[len(header) + len(_SENTINEL):] + after[len(before):])
    if last_token is not None and ids and ids[0] == last_token:
      ids = ids[1:]
    return ids


def make_renderer(tokenizer: Tokenizer, tools: Sequence[Mapping[str, Any]] | None = None
                  ) -> ChatRenderer | PlainRenderer:
  """How a conversation with ``tools`` becomes ``tokenizer``'s ids: its chat template with the
  tools (``ChatRenderer``), or the texts alone (``PlainRenderer``) when it has none."""
  if tokenizer.chat_template is None:
    return PlainRenderer(tokenizer)
  return ChatRenderer(tokenizer, tools)


def first_messages(observation: str) -> list[Message]:
  """The conversation an episode starts with: ``env.reset``'s observation as a user turn."""
  return [{'role': 'user', 'content': str(observation)}]


def observe(renderer: ChatRenderer | PlainRenderer, messages: list[Message], text: str,
            step: EnvStep, last_token: int | None) -> list[int]:
  """The ids fed after the assistant turn ``text`` (sampled after ``messages``, ending with
  ``last_token`` when a stop token ended it, else None) and before the next one: the turn's
  end, ``step``'s observation messages (``observation_messages``) and the next assistant
  header (``between_turns``). Appends the turn and the observation to ``messages``."""
  new = observation_messages(step)
  delta = renderer.between_turns(messages, new, last_token)
  messages += [{'role': 'assistant', 'content': text}, *new]
  return delta


def demonstration(env: Environment, seed: int, tokenizer: Tokenizer,
                  max_turns: int | None = None) -> tuple[list[int], list[bool]]:
  """The episode of ``env`` from ``seed`` played by its oracle (``env.oracle_action()`` each
  turn), as the token ids and loss mask ``EpisodeRunner`` records for a model that samples
  exactly the oracle's actions: the prompt, then per turn the action's ids and the eos that
  ends it (loss mask 1), then the observation's ids (loss mask 0; ``observe``), until the
  episode is done or ``max_turns`` turns (the environment's own when None or larger) are
  played. The supervised warm-up of an environment run trains on these rows.

  Returns ``(ids, loss_mask)``, two lists of one length. Raises TypeError when ``env`` has no
  ``oracle_action``.
  """
  if not callable(getattr(env, 'oracle_action', None)):
    raise TypeError(f'environment {env.name!r} ({type(env).__name__}) has no oracle_action(); '
                    'a warm-up on demonstrations needs one (docs/environments.md).')
  renderer = make_renderer(tokenizer, getattr(env, 'tools', None))
  messages = first_messages(env.reset(seed))
  ids = renderer.prompt(messages)
  mask = [False] * len(ids)
  turns = min(int(env.max_turns), max_turns or int(env.max_turns))
  for turn in range(turns):
    text = env.oracle_action()
    sampled = tokenizer.encode(text) + [tokenizer.eos_id]
    ids += sampled
    mask += [True] * len(sampled)
    step = env.step(text)
    if step.done or turn + 1 == turns:
      break
    delta = observe(renderer, messages, text, step, tokenizer.eos_id)
    ids += delta
    mask += [False] * len(delta)
  return ids, mask

