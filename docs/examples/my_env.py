"""An environment of your own (docs/environments.md): guess a number, told higher or lower.

Select it with ``env.name='my_env:GuessEnv'`` and ``docs/examples`` on the Python path
(``PYTHONPATH=docs/examples``); the config's other ``env`` fields are its keyword arguments.
"""

import random
import re

from rlax_llm.envs import EnvStep, TextEnv


class GuessEnv(TextEnv):
  """Guess a secret integer in ``[1, high]``; each wrong guess is answered higher or lower."""

  name = 'guess'

  def __init__(self, high: int = 100, max_turns: int = 8):
    super().__init__(max_turns)  # counts the turns and ends the episode at max_turns
    self.high, self.secret = high, 0

  def _reset(self, seed: int) -> str:
    self.secret = random.Random(seed).randint(1, self.high)  # a pure function of the seed
    return f'I picked a number from 1 to {self.high}. Guess it: reply with one number.'

  def _step(self, action: str) -> EnvStep:
    numbers = re.findall(r'[0-9]{1,9}', action)
    if not numbers:  # a bad action is an observation that costs the turn, never an exception
      return EnvStep('error: no number in your message.', 0.0, False, {'error': 'no number'})
    guess = int(numbers[-1])
    if guess == self.secret:
      return EnvStep('Right!', 1.0, True, {'success': True})
    return EnvStep('Higher.' if guess < self.secret else 'Lower.', 0.0, False, {})

  def state_key(self) -> str:
    return f'guess/{self.secret}/{self.turn}'
