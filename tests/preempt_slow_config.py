"""``configs/default.py:smoke`` plus a reward component that can make every step slow, for the
preemption-notice test (tests/test_resume.py): ``reward.slow`` is a weight-0 function reward
(so it changes no reward the run trains on) that sleeps ``RLAX_TEST_SLOW_REWARD_S`` seconds
per batch when that environment variable is set (the calls are serialized; each of a batch's
``ROWS`` rows sleeps its share), and returns 0.0.

    python -m rlax_llm.launch --config=tests/preempt_slow_config.py ...
"""

import os
import pathlib
import threading
import time

import ml_collections

from rlax_llm.cli import load_config_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROWS = 16  # rows per batch of the smoke config: rl.prompts_per_step 4 x rl.group_size 4
_LOCK = threading.Lock()


def get_config() -> ml_collections.ConfigDict:
  config = load_config_file(f'{ROOT / "configs/default.py"}:smoke')
  with config.unlocked():
    config.reward.slow = ml_collections.ConfigDict(dict(
        kind='function', fn='tests.preempt_slow_config:slow_reward', weight=0.0,
        timeout_s=600.0))
  return config


def slow_reward(prompt, completion) -> float:
  """0.0, after ``RLAX_TEST_SLOW_REWARD_S / ROWS`` seconds (calls one at a time)."""
  del prompt, completion
  seconds = float(os.environ.get('RLAX_TEST_SLOW_REWARD_S', '0'))
  with _LOCK:
    time.sleep(seconds / ROWS)
  return 0.0
