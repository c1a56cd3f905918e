"""An agent harness written against the OpenAI API, named by a training run's config.

A harness is a function of yours that plays one episode of its task::

    def my_agent(client: openai.OpenAI, model: str, seed: int, **kwargs) -> float | None

It calls ``client.chat.completions.create(model=model, ...)`` (or ``client.completions``)
as often as it likes, with its own prompts, tools and edits, and returns the episode's reward,
or None when it posted the reward itself to ``/v1/episodes/{id}/reward`` (its episode id is
the client's default ``X-Episode-Id`` header, ``client.default_headers``). ``seed`` names the
task instance: train seeds count up from 0, held-out ones from ``agent.eval_seed_start``.

A run trains one with ``env.name='harness'`` and ``env.harness='module.path:function'``; the
``env`` group's other fields are the function's keyword arguments. The episodes are played
by ``rlax_llm.serve.harness_runner`` (docs/serving.md, "Training an OpenAI-API agent"). This
module only names and checks the function, without the ``serve`` extra, so that a config is
validated before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from rlax_llm import plugins

# The env.name of a run whose episodes an agent harness plays.
HARNESS = 'harness'


@dataclasses.dataclass(frozen=True)
class Harness:
  """A harness function and the keyword arguments the config gives it."""

  fn: Callable[..., float | None]
  kwargs: Mapping[str, Any]

  def __call__(self, client: Any, model: str, seed: int) -> float | None:
    """Plays the episode of ``seed``: ``fn(client, model, seed, **kwargs)``."""
    return self.fn(client, model, seed, **self.kwargs)


def is_harness(env: Mapping[str, Any] | Any) -> bool:
  """Whether an ``env`` config group (a ConfigDict or a mapping) names an agent harness."""
  return (env.get('name') if isinstance(env, Mapping) else getattr(env, 'name', None)) == HARNESS


def load_harness(env: Mapping[str, Any] | Any) -> Harness:
  """The ``Harness`` of an ``env`` config group: ``env.harness`` imported
  (``plugins.import_object``), the other fields (``name`` aside) its keyword arguments.

  Raises ValueError naming ``env.harness`` when it is unset, not an import path or cannot be
  imported, and when the function cannot be called as
  ``fn(client, model, seed, **kwargs)`` with these fields (a field it does not take, or a
  required argument left unset); TypeError when it names something that is not callable."""
  fields = dict(env.to_dict() if hasattr(env, 'to_dict') else env)
  if fields.pop('name', None) != HARNESS:
    raise ValueError(f'load_harness: env.name must be {HARNESS!r}; got {env!r:.100}.')
  spec = fields.pop('harness', None)
  if not spec:
    raise ValueError('env.name=\'harness\' needs env.harness, your agent function as '
                     '"module.path:function" (docs/serving.md, "Training an OpenAI-API '
                     'agent").')
  fn = plugins.import_object(spec, 'env.harness')
  if not callable(fn):
    raise TypeError(f'env.harness={spec!r} is a {type(fn).__name__}, not a function; name '
                     'fn(client, model, seed, **kwargs) -> reward.')
  try:
    inspect.signature(fn).bind(None, '', 0, **fields)
  except TypeError as error:
    raise ValueError(f'env.harness={spec!r} cannot be called as fn(client, model, seed, '
                     f'**kwargs) with the env fields {sorted(fields)}: {error}. Take '
                     '(client, model, seed) and those keyword arguments, or change the env '
                     'fields.') from None
  except ValueError:  # a builtin without a signature: called as it is
    pass
  return Harness(fn, fields)
