"""Reward shaping: the training reward as a weighted sum of components, each one reported.

``shape_rewards(rollouts, components)`` runs after ``rlax_llm.verifiers.score_rollouts`` and
returns ``(total float32 [B], {name: float32 [B]})``: the weighted sum the advantages are
computed from, and every component unweighted, for the controller to log as
``reward/<name>``. Components (``make_components`` builds them from a config group):

* ``task``: the verifier's reward (``rollouts.rewards``).
* ``format``: 1.0 where the completion has the task's expected form (the task's
  ``format_ok(completion)``, e.g. a closed ``\\boxed{}`` for math, a ```python block for
  code, an ``<answer>`` expression for countdown), or where ``re.search(pattern, completion)``
  matches (DOTALL) when a ``pattern`` is configured; else 0.0.
* ``overlong``: DAPO's soft overlong punishment (Yu et al., 2025, arXiv 2503.14476, eq. 13):
  with ``L`` the completion's length in tokens, ``L_max`` the generation cap and ``c`` the
  ``cache`` (the length of the punishment interval), the reward is 0 for
  ``L <= L_max - c``, ``((L_max - c) - L) / c`` for ``L_max - c < L <= L_max`` (falling
  linearly to -1 at the cap) and -1 beyond it.
* ``function``: a reward function of the user's own, ``fn='module.path:name'``, called as
  ``fn(prompt, completion) -> float`` (``prompt`` the ``rlax_llm.tasks.Prompt`` a row
  answers, ``completion`` its decoded text) for every row, in the verifier pool of the
  controller's process (``rlax_llm.verifiers.score_with``), each call limited to
  ``timeout_s`` seconds (default ``verifiers.DEFAULT_TIMEOUT_S``); a call that raises, runs
  late or returns a non-finite or non-numeric value gives 0 and is logged at ERROR
  (docs/custom_tasks.md).

Config (a ``reward`` group; each key a component, ``kind`` defaulting to the key, so two
components of one kind can coexist)::

    reward = dict(
        task=dict(weight=1.0),
        format=dict(weight=0.1),                        # optional pattern='<think>.*</think>'
        overlong=dict(weight=1.0, cache=64),            # max_length: sampling.max_new_tokens
        short=dict(kind='function', fn='my_pkg.rewards:short', weight=0.1),  # timeout_s=30
    )

A component with weight 0 is still computed and reported (monitoring without shaping). Text
only: nothing here imports model code.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlax_llm import plugins, verifiers
from rlax_llm.tasks.base import Prompt

KINDS = ('task', 'format', 'overlong', 'function')
# Each kind's parameters (besides ``kind`` and ``weight``).
PARAMETERS = {'task': set(), 'format': {'pattern'}, 'overlong': {'cache', 'max_length'},
              'function': {'fn', 'timeout_s'}}
RESERVED_NAMES = ('mean', 'std')  # the controller already logs reward/mean and reward/std
_MAX_FORMAT_CHARS = 1 << 20


@dataclasses.dataclass(frozen=True)
class RewardComponent:
  """One term of the shaped reward: ``fn(rollouts) -> float32 [B]`` (with ``uses_prompts``:
  ``fn(rollouts, prompts)``, ``prompts`` the batch's ``Prompt`` per group), scaled by
  ``weight``."""

  name: str
  weight: float
  fn: Callable[..., np.ndarray]
  uses_prompts: bool = False

  def __post_init__(self):
    if not isinstance(self.name, str) or not re.fullmatch(r'[A-Za-z0-9_.-]+', self.name):
      raise ValueError(f'reward component name {self.name!r} must be a non-empty str of '
                       'letters, digits, "_", "." or "-" (it becomes the metric reward/<name>).')
    if self.name in RESERVED_NAMES:
      raise ValueError(f'reward component name {self.name!r} is reserved (reward/{self.name} '
                       'is already a metric); rename it.')
    if (isinstance(self.weight, bool) or not isinstance(self.weight, (int, float))
        or not np.isfinite(self.weight)):
      raise ValueError(f'reward component {self.name!r} weight must be a finite number, got '
                       f'{self.weight!r}.')


def task_reward() -> Callable[[Any], np.ndarray]:
  """The verifier's reward, ``rollouts.rewards`` (set by ``score_rollouts``)."""
  def fn(rollouts) -> np.ndarray:
    if rollouts.rewards is None:
      raise ValueError('rollouts have no rewards; call verifiers.score_rollouts before '
                       'shape_rewards.')
    return np.asarray(rollouts.rewards, np.float32)
  return fn


def format_reward(task: Any = None, pattern: str | None = None) -> Callable[[Any], np.ndarray]:
  """1.0 per completion that ``re.search(pattern, ., DOTALL)`` matches, or (no pattern) that
  ``task.format_ok`` accepts; 0.0 otherwise (non-str completions included).

  Raises ValueError for an invalid pattern, or no pattern and a task without ``format_ok``.
  """
  if pattern is not None:
    try:
      compiled = re.compile(pattern, re.DOTALL)
    except (re.error, TypeError) as e:
      raise ValueError(f'reward format pattern {pattern!r} is not a valid regular expression: '
                       f'{e}.') from None
    check = lambda text: compiled.search(text[-_MAX_FORMAT_CHARS:]) is not None
  elif callable(getattr(task, 'format_ok', None)):
    check = task.format_ok
  else:
    raise ValueError(f'the format reward needs a pattern or a task with format_ok(); task '
                     f'{getattr(task, "name", task)!r} has none: set reward.<name>.pattern.')

  def fn(rollouts) -> np.ndarray:
    out = np.zeros(len(rollouts.completions), np.float32)
    for i, completion in enumerate(rollouts.completions):
      try:
        out[i] = 1.0 if isinstance(completion, str) and check(completion) else 0.0
      except Exception:  # pylint: disable=broad-except
        out[i] = 0.0
    return out
  return fn


def overlong_penalty(max_length: int, cache: int) -> Callable[[Any], np.ndarray]:
  """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13) on completion lengths in
  tokens (``rollouts.completion_mask.sum(1)``): 0 up to ``max_length - cache``, then linear
  down to -1 at ``max_length``, -1 beyond."""
  if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
    raise ValueError(f'overlong max_length must be an int >= 1 (sampling.max_new_tokens), got '
                     f'{max_length!r}.')
  if isinstance(cache, bool) or not isinstance(cache, int) or not 1 <= cache <= max_length:
    raise ValueError(f'overlong cache must be an int in [1, max_length={max_length}] (the '
                     f'punishment interval in tokens), got {cache!r}.')
  expected = max_length - cache

  def fn(rollouts) -> np.ndarray:
    lengths = np.asarray(rollouts.completion_mask, bool).sum(axis=1).astype(np.float64)
    penalty = np.where(lengths <= expected, 0.0, (expected - lengths) / cache)
    return np.where(lengths > max_length, -1.0, penalty).astype(np.float32)
  return fn


def function_reward(spec: str, timeout_s: float = verifiers.DEFAULT_TIMEOUT_S
                    ) -> Callable[[Any, Sequence[Prompt]], np.ndarray]:
  """The reward function at the import path ``spec`` (``'module.path:name'``), called as
  ``fn(prompt, completion) -> float`` on every row in the verifier pool
  (``verifiers.score_with``: ``timeout_s`` seconds per call; raising, late or non-finite gives
  0 and is logged).

  Returns ``component(rollouts, prompts) -> float32 [B]``, ``prompts`` one ``Prompt`` per
  group (row ``i`` answers ``prompts[rollouts.group_ids[i]]``).
  Raises ValueError, naming ``fn`` and the fix, when ``spec`` does not import, is not callable
  or cannot be called with two positional arguments, or ``timeout_s`` is not > 0.
  """
  fn = plugins.import_object(spec, 'fn')
  if not callable(fn):
    raise ValueError(f'fn={spec!r} is a {type(fn).__name__}, not a function; name a function '
                     'def reward(prompt, completion) -> float.')
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # some builtins have none: called as they are
    signature = None
  if signature is not None:
    try:
      signature.bind(None, '')
    except TypeError:
      raise ValueError(f'fn={spec!r} has the signature {signature}, which cannot be called as '
                       'fn(prompt, completion); define it as def reward(prompt, completion) '
                       '-> float (prompt: rlax_llm.tasks.Prompt, completion: str).') from None
  if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
      or not timeout_s > 0 or not np.isfinite(timeout_s)):
    raise ValueError(f'timeout_s must be a number of seconds > 0 (the limit of one call), got '
                     f'{timeout_s!r}.')

  def component(rollouts, prompts: Sequence[Prompt]) -> np.ndarray:
    rows = [prompts[g] for g in np.asarray(rollouts.group_ids)]
    values, _ = verifiers.score_with(fn, rows, list(rollouts.completions),
                                     timeout_s=float(timeout_s), what=f'Reward function {spec}')
    return values
  return component


def shape_rewards(rollouts: Any, components: list[RewardComponent],
                  prompts: Sequence[Prompt] | None = None
                  ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """``(sum_k weight_k * component_k, {name_k: component_k})``, float32 ``[B]`` each.

  ``rollouts`` needs ``rewards`` (for ``task``), ``completions`` and ``completion_mask``
  (and ``group_ids`` for ``function``); ``prompts``: the batch's prompts, one per group (what
  ``verifiers.score_rollouts`` takes), needed by components that ``uses_prompts``.
  Raises ValueError when no component is given, two share a name, a component needs prompts
  and none are given, or a component returns an array of the wrong shape or a non-finite
  value.
  """
  if not components:
    raise ValueError('shape_rewards needs at least one component (e.g. task with weight 1).')
  names = [c.name for c in components]
  if len(set(names)) != len(names):
    raise ValueError(f'reward component names must be unique, got {names}.')
  size = len(rollouts.completions)
  total = np.zeros(size, np.float64)
  parts: dict[str, np.ndarray] = {}
  for component in components:
    if component.uses_prompts and prompts is None:
      raise ValueError(f'reward component {component.name!r} reads the prompts; pass '
                       'shape_rewards(..., prompts=the batch\'s prompts).')
    values = np.asarray(component.fn(rollouts, prompts) if component.uses_prompts
                        else component.fn(rollouts), np.float32)
    if values.shape != (size,):
      raise ValueError(f'reward component {component.name!r} returned shape {values.shape}, '
                       f'expected ({size},).')
    if not np.all(np.isfinite(values)):
      raise ValueError(f'reward component {component.name!r} returned non-finite values '
                       f'{values[~np.isfinite(values)][:4].tolist()}.')
    parts[component.name] = values
    total += component.weight * values.astype(np.float64)
  with np.errstate(over='ignore'):
    total32 = total.astype(np.float32)
  if not np.all(np.isfinite(total32)):
    raise ValueError('the weighted reward overflows float32; lower the component weights.')
  return total32, parts


def make_components(config: Mapping[str, Any] | None, task: Any = None,
                    max_length: int | None = None) -> list[RewardComponent]:
  """Components from a ``reward`` config group (see the module docstring).

  config: ``{name: {'weight': w, 'kind': k (default: name), **params}}`` (a ConfigDict or a
    mapping); None or empty gives the identity shaping ``[task with weight 1]``.
  task: the task (for ``format`` without a pattern).
  max_length: the generation cap in tokens (``sampling.max_new_tokens``), for ``overlong``.
  Raises ValueError naming ``reward.<name>`` for an unknown kind or parameter or a bad value.
  """
  if config is not None and hasattr(config, 'to_dict'):
    config = config.to_dict()
  if not config:
    return [RewardComponent('task', 1.0, task_reward())]
  components = []
  for name, spec in config.items():
    if hasattr(spec, 'to_dict'):
      spec = spec.to_dict()
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
      spec = {'weight': spec}
    if not isinstance(spec, Mapping):
      raise ValueError(f'reward.{name} must be a group with a weight (and parameters), got '
                       f'{spec!r}.')
    spec = dict(spec)
    kind = spec.pop('kind', None) or name
    weight = spec.pop('weight', 1.0)
    params = {k: v for k, v in spec.items() if v is not None}
    if kind not in PARAMETERS:
      raise ValueError(f'reward.{name}: unknown kind {kind!r}; choose one of {KINDS} (set '
                       f'reward.{name}.kind when the name is not a kind).')
    unknown = sorted(set(params) - PARAMETERS[kind])
    if unknown:
      raise ValueError(f'reward.{name} ({kind}) got unknown parameter(s) {unknown}; it '
                       f'accepts {sorted(PARAMETERS[kind]) + ["kind", "weight"]}.')
    try:
      if kind == 'task':
        fn = task_reward()
      elif kind == 'format':
        fn = format_reward(task, params.get('pattern'))
      elif kind == 'function':
        if 'fn' not in params:
          raise ValueError("kind 'function' needs fn='module.path:name', a function "
                           'def reward(prompt, completion) -> float (docs/custom_tasks.md)')
        fn = function_reward(params['fn'],
                             params.get('timeout_s', verifiers.DEFAULT_TIMEOUT_S))
      else:
        length = params.get('max_length', max_length)
        if length is None:
          raise ValueError('overlong needs max_length (pass sampling.max_new_tokens)')
        fn = overlong_penalty(length, params.get('cache', max(1, length // 4)))
      components.append(RewardComponent(name, weight, fn, uses_prompts=kind == 'function'))
    except ValueError as e:
      raise ValueError(f'reward.{name}: {e}') from None
  return components
