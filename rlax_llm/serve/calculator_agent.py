"""An example agent harness: a calculator agent written with the plain ``openai`` client.

Nothing here knows about rlax_llm's trainer: it is the kind of loop an agent framework runs
against any OpenAI-compatible server. The task is the calculator environment's
(``rlax_llm.envs.CalculatorEnv``: the problem of a seed, ``a * b``, and its ``calculate``
tool), so a harness run and an environment run ask the same questions. Each turn the agent
sends the conversation with the tool as an OpenAI ``tools`` entry; when the reply has
``tool_calls`` it runs each (``calculate``; an error becomes the tool's text) and appends the
results as ``role: 'tool'`` messages; a reply with a final answer (``\\boxed{N}`` or
``Answer: N``) ends the episode with reward 1.0 if it is right, else 0.0; a reply with
neither gets the ``retry`` user message. ``max_turns`` replies without an answer: reward 0.

Train it with ``env.name='harness'`` and
``env.harness='rlax_llm.serve.calculator_agent:calculator_agent'`` (``configs/agent.py:harness``).
"""

from __future__ import annotations

import json
from typing import Any

from rlax_llm.envs.calculator import (
  CALCULATE_TOOL,
  DEFAULT_INSTRUCTION,
  CalculatorEnv,
  calculate,
  final_answer,
)

RETRY = 'Call the calculate tool, or give the final answer as \\boxed{N}.'


def calculator_agent(client: Any, model: str, seed: int, *, max_turns: int = 4,
                     max_tokens: int | None = None, instruction: str = DEFAULT_INSTRUCTION,
                     retry: str = RETRY, min_a: int = 100, max_a: int = 999, min_b: int = 10,
                     max_b: int = 99) -> float:
  """Plays the calculator problem of ``seed`` through ``client`` (an ``openai.OpenAI``) with
  ``model``; returns 1.0 for a right final answer, else 0.0 (the module docstring).

  ``max_tokens``: each reply's cap (None: the server's default); ``instruction``: the first
  user message, a ``str.format`` template over ``{a}`` and ``{b}``; ``min_a`` ... ``max_b``:
  the ranges ``a`` and ``b`` are drawn from (``CalculatorEnv``'s)."""
  problem = CalculatorEnv(min_a=min_a, max_a=max_a, min_b=min_b, max_b=max_b,
                          instruction=instruction)
  messages: list[dict[str, Any]] = [{'role': 'user', 'content': problem.reset(seed)}]
  extra = {} if max_tokens is None else {'max_tokens': max_tokens}
  for _ in range(max_turns):
    reply = client.chat.completions.create(model=model, messages=messages,
                                           tools=[CALCULATE_TOOL], **extra)
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if message.tool_calls:
      for call in message.tool_calls:
        messages.append({'role': 'tool', 'tool_call_id': call.id,
                         'content': _run_tool(call.function.name, call.function.arguments)})
      continue
    answer = final_answer(message.content or '')
    if answer is not None:
      return float(answer == problem.a * problem.b)
    messages.append({'role': 'user', 'content': retry})
  return 0.0


def _run_tool(name: str, arguments: str) -> str:
  """The text of one tool call's result: ``calculate``'s value, or ``error: ...``."""
  try:
    if name != 'calculate':
      raise ValueError(f'unknown tool {name!r}; the tool is calculate')
    expression = json.loads(arguments).get('expression')
    return calculate(str(expression))
  except Exception as error:  # noqa: BLE001  (the model sees its mistake, as in any agent)
    return f'error: {error}'
