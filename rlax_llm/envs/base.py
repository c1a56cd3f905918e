"""What every multi-turn environment provides: ``reset(seed)``, ``step(action)``, a state key.

An environment speaks text, like a task: ``reset(seed)`` returns the first user message,
``step(action)`` takes the assistant message's text and returns the next observation, the
turn's reward and whether the episode is over. The episode runner tokenizes both (the ids the
model sampled are kept as sampled; the observation's tokens are masked from the loss). An
environment is a pure function of its seed and the actions it is given: two resets with one
seed and the same actions give identical transcripts. Bad actions are the model's mistakes, not
errors: a malformed tool call, an unknown tool, a tool that raises, an invalid move are
described in the observation (``info['error']``) and cost the turn; ``step`` never raises for
any action text. Tools are described as OpenAI-style function schemas (``tools``), which the
chat template or ``tool_calls.with_tools`` shows the model.

``info`` (JSON-safe) may hold:

* ``'messages'``: the chat messages to append for this observation when it is not one user
  message, e.g. tool results (``tool_calls.format_tool_result``); ``observation_messages``
  reads it.
* ``'error'``: what was wrong with the action (the turn was spent, nothing else changed).
* ``'success'``: on the last step, whether the episode reached its goal.
* ``'truncated'``: the episode ended because it used ``max_turns`` turns.

``reward`` is the turn's reward (shaping, where an environment has it); the episode's reward is
the sum over its turns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

from rlax_llm.tasks._util import CounterRng, check_int


@dataclasses.dataclass(frozen=True)
class EnvStep:
  """What one ``step`` returns: the next observation (text), the turn's reward, whether the
  episode is over, and ``info`` (module docstring)."""

  observation: str
  reward: float
  done: bool
  info: dict


@runtime_checkable
class Environment(Protocol):
  """A multi-turn environment (module docstring).

  name: the environment's name (the ``ENVS`` key for the built-in ones).
  max_turns: the episode ends after this many ``step`` calls at the latest.
  tools: OpenAI-style function schemas (``{'type': 'function', 'function': {'name': ...,
    'description': ..., 'parameters': {JSON schema}}}``); ``[]`` for none.
  """

  name: str
  max_turns: int
  tools: list[dict]

  def reset(self, seed: int) -> str:
    """Starts an episode; returns the first user message. Deterministic for ``seed``."""
    ...

  def step(self, action: str) -> EnvStep:
    """Applies the assistant message ``action`` (decoded text). Never raises for any text."""
    ...

  def state_key(self) -> str:
    """The canonical current state: equal keys mean identical states (GiGPO's step groups
    gather the turns taken from one state across a group's trajectories)."""
    ...


def observation_messages(step: EnvStep) -> list[dict[str, Any]]:
  """The chat messages that carry ``step``'s observation to the model: ``info['messages']``
  when the environment gives them (tool results), else one user message."""
  messages = step.info.get('messages')
  if messages is not None:
    return [dict(m) for m in messages]
  return [{'role': 'user', 'content': step.observation}]


class TextEnv:
  """A base for environments: the turn count, the turn limit and the episode's end, so that a
  subclass implements only ``_reset(seed) -> str``, ``_step(action) -> EnvStep`` and
  ``state_key``. ``step`` ends the episode (``info['truncated'] = True``) when ``max_turns``
  turns are spent without it ending on its own, and raises if called after the end."""

  name = 'text_env'

  def __init__(self, max_turns: int, tools: list[dict] | None = None):
    self.max_turns = check_int(type(self).__name__, 'max_turns', max_turns, 1)
    self.tools = list(tools or [])
    self.turn = 0
    self.done = True

  def reset(self, seed: int) -> str:
    """Starts the episode of ``seed`` (an int in ``[0, 2**64)``); the first user message."""
    seed = check_int(type(self).__name__, 'seed', seed, 0, (1 << 64) - 1)
    self.turn, self.done = 0, False
    return self._reset(seed)

  def step(self, action: str) -> EnvStep:
    """One turn (``Environment.step``); raises RuntimeError after the episode's end and
    TypeError for an action that is not text (the runner's mistakes, not the model's)."""
    if self.done:
      raise RuntimeError(f'{self.name}: step() after the episode ended (or before reset()); '
                         'call reset(seed) to start an episode.')
    if not isinstance(action, str):
      raise TypeError(f'{self.name}: the action must be the assistant message as a str, got '
                      f'{type(action).__name__}: {action!r:.80}.')
    self.turn += 1
    result = self._step(action)
    if not result.done and self.turn >= self.max_turns:
      result = dataclasses.replace(result, done=True,
                                   info={**result.info, 'truncated': True, 'success': False})
    self.done = result.done
    return result

  def _reset(self, seed: int) -> str:
    raise NotImplementedError

  def _step(self, action: str) -> EnvStep:
    raise NotImplementedError

  def state_key(self) -> str:
    raise NotImplementedError


def check_demo_error_rate(owner: str, value: object, mistake: str) -> float:
  """An environment's ``demo_error_rate`` (the fraction of its oracle's demonstrations that
  make ``mistake``) as a float; ValueError naming ``owner`` unless it is a number in
  ``[0, 1]``."""
  if (isinstance(value, bool) or not isinstance(value, (int, float))
      or not 0.0 <= value <= 1.0):
    raise ValueError(f'{owner} demo_error_rate must be a number in [0, 1] (the fraction of '
                     f'demonstrations that {mistake}), got {value!r}.')
  return float(value)


def draw_demo_error(stream: str, seed: int, rate: float) -> bool:
  """Whether the oracle's demonstration of ``seed`` makes its mistake: a draw below ``rate``,
  a pure function of ``(stream, seed)`` (the same in every process); never for rate 0."""
  return rate > 0 and CounterRng(stream, seed).uniform() < rate
