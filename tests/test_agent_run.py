"""Training on an environment through ``python -m rlax_llm.launch --config=configs/agent.py``:
the smoke variant trains and is reproducible bit for bit, ``python -m rlax_llm.evaluate`` on
its checkpoint scores the held-out episodes as the run did, a checkpointed run resumed equals
the uninterrupted one, per-token (multi-turn) advantages reach the trainer's objective."""

import json
import math
import os
import pathlib
import subprocess
import sys
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_resume import run_once
from train_batches import random_train_batch  # tests/train_batches.py

from rlax_llm import losses
from rlax_llm.cli import load_config_file
from rlax_llm.data_types import TERMINATIONS, GenerationRequest
from rlax_llm.envs.base import EnvStep
from rlax_llm.losses import LossConfig
from rlax_llm.metrics import read_metrics
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.rollout.episodes import request_episodes
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.tasks.base import Prompt
from rlax_llm.trainer.objectives import rl_objective
from rlax_llm.trainer.scoring import Policy

ROOT = pathlib.Path(__file__).resolve().parent.parent
FINAL = ('eval/start_accuracy', 'eval/final_accuracy', 'eval/improvement')


class LowercaseEnv:
  """Two turns; each turn's reward is the fraction of lowercase letters in the action, so a
  random tiny model's episodes have unequal returns (a learning signal in every group)."""

  name = 'lowercase'
  tools: ClassVar[list] = []

  def __init__(self, max_turns: int = 2, **grid_fields):
    del grid_fields  # the smoke variant's env.size and env.instruction, unused
    self.max_turns = max_turns

  def reset(self, seed):
    self.seed, self.turn = seed, 0
    return f'go {seed % 100}'

  def step(self, action):
    self.turn += 1
    reward = sum(c.islower() for c in action) / max(1, len(action))
    return EnvStep(f'turn {self.turn}: {reward:.2f}', reward, self.turn >= self.max_turns,
                   {'success': reward > 0.5})

  def state_key(self):
    return f'{self.seed}:{self.turn}'


def _launch(*args, timeout=300, module='rlax_llm.launch'):
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join([str(ROOT), str(ROOT / 'tests'),
                                       env.get('PYTHONPATH', '')])
  result = subprocess.run([sys.executable, '-m', module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _metrics(workdir):
  """The run's metrics rows without the wall-clock ``time/`` ones."""
  return [{k: v for k, v in row.items() if not k.startswith('time/')}
          for row in read_metrics(workdir / 'metrics.jsonl')]


@pytest.fixture(scope='module')
def smoke_runs(tmp_path_factory):
  """``smoke_runs(n)``: the workdir of the ``n``-th launch of the smoke variant, launched on
  first use (the default run reads only the first; the second is for the extended tier's
  bit-for-bit test), with a checkpoint after the last step (python -m rlax_llm.evaluate)."""
  workdirs = {}

  def get(n: int) -> pathlib.Path:
    if n not in workdirs:
      workdir = tmp_path_factory.mktemp('agent') / f'run{n}'
      _launch('--config=configs/agent.py:smoke', f'--workdir={workdir}',
              '--config.checkpoint.every_steps=3', '--config.checkpoint.async_save=False')
      workdirs[n] = workdir
    return workdirs[n]

  return get


def test_the_smoke_variant_trains_on_episodes(smoke_runs):
  workdir = smoke_runs(0)
  rows = read_metrics(workdir / 'metrics.jsonl')
  assert [r['step'] for r in rows] == [1, 2, 3]
  assert [r['version'] for r in rows] == [1, 2, 3]  # every step made a version
  for row in rows:
    for key in ('reward/mean', 'loss', 'grad_norm', 'entropy', 'episode/turns',
                'episode/return', *(f'termination/{r}' for r in TERMINATIONS)):
      assert math.isfinite(row[key]), (key, row)
    assert sum(row[f'termination/{r}'] for r in TERMINATIONS) == pytest.approx(1.0)
    assert row['episode/env_tokens'] > 0  # observations between turns, masked from the loss
    assert 1 <= row['episode/turns'] <= 2
  assert 'eval/success' in rows[1] and 'eval/start_success' in rows[0]
  ledger = [json.loads(line) for line in (workdir / 'ledger.jsonl').read_text().splitlines()]
  assert [row['prompt_ids'] for row in ledger] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
  summary = json.loads((workdir / 'summary.json').read_text())
  assert summary['steps'] == 3 and summary['eval/final_accuracy'] is not None


def test_two_smoke_runs_are_equal_bit_for_bit(smoke_runs):
  first, second = (_metrics(smoke_runs(n)) for n in (0, 1))
  assert first == second


def test_evaluate_cli_scores_the_episodes_as_the_run_did(smoke_runs):
  """``python -m rlax_llm.evaluate --config=configs/agent.py:smoke --checkpoint=...`` plays
  the held-out seeds' greedy episodes (``evaluation.evaluate_episodes``, through the run's
  rollout kind), not the seeds as prompts: its figures are the run's own last evaluation."""
  workdir = smoke_runs(0)
  result = _launch('--config=configs/agent.py:smoke', f'--checkpoint={workdir}',
                   module='rlax_llm.evaluate')
  record = json.loads(result.stdout.strip().splitlines()[-1])
  last = read_metrics(workdir / 'metrics.jsonl')[-1]
  names = ('eval/accuracy', 'eval/success', 'eval/return', 'eval/turns', 'eval/env_tokens')
  assert {k: record[k] for k in names} == {k: last[k] for k in names}
  assert record['eval/accuracy'] == record['eval/success']
  assert record['eval/env_tokens'] > 0  # the episodes got past their first turn


def test_a_resumed_multi_turn_run_equals_the_uninterrupted_one(tmp_path):
  """GiGPO on an environment of the test's own (unequal returns: every step learns): a run
  checkpointed after each step, stopped after 2 and resumed to 3 (two launches), equals 3
  steps at once (run in this process first: one process start fewer, and its compiled
  programs are in the persistent cache when the launches ask for them)."""
  common = ['--config=configs/agent.py:smoke', '--config.env.name=test_agent_run:LowercaseEnv',
            '--config.env.max_turns=2', '--config.rl.advantage_estimator=gigpo']
  config = load_config_file(str(ROOT / 'configs' / 'agent.py') + ':smoke')
  config.env.name, config.env.max_turns = 'test_agent_run:LowercaseEnv', 2
  config.rl.advantage_estimator = 'gigpo'
  summary, _ = run_once(config, tmp_path / 'whole', None)
  assert summary['steps'] == 3
  resumed = tmp_path / 'resumed'
  checkpoints = ['--config.checkpoint.every_steps=1', '--config.checkpoint.async_save=False']
  _launch(*common, *checkpoints, '--config.total_steps=2', f'--workdir={resumed}')
  _launch(*common, *checkpoints, '--config.total_steps=3', f'--workdir={resumed}')
  whole = _metrics(tmp_path / 'whole')
  assert all(row['grad_norm'] > 0 for row in whole)  # per-token advantages trained
  assert all(row['termination/done'] == 1.0 for row in whole)
  # The resumed worker pulls its first weights whole (sync/), and the stopped run's last
  # step carries the run's final figures.
  comparable = lambda rows: [{k: v for k, v in row.items() if not k.startswith('sync/')
                              and k not in FINAL} for row in rows]
  assert comparable(_metrics(resumed)) == comparable(whole)


def test_request_episodes_key_and_group_as_generate_does():
  prompts = [Prompt(prompt_id=i, text=str(10 + i), answer='') for i in range(3)]
  requests = [GenerationRequest(p, 2, SamplingSpec(1.0), 8) for p in prompts]
  rng = jax.random.key(5)
  whole = request_episodes(requests, LowercaseEnv, rng)
  split = (request_episodes(requests[:1], LowercaseEnv, rng)
           + request_episodes(requests[1:], LowercaseEnv, rng, first=1))
  assert [(e.seed, e.group_id, e.prompt_id) for e in whole] == [
      (10, 0, 0), (10, 0, 0), (11, 1, 1), (11, 1, 1), (12, 2, 2), (12, 2, 2)]
  for a, b in zip(whole, split):
    np.testing.assert_array_equal(a.key, b.key)
  assert len({e.key.tobytes() for e in whole}) == 6
  assert len({id(e.env) for e in whole}) == 6  # a fresh environment per episode


def test_per_token_advantages_train_like_per_row_ones():
  """``[B, T]`` advantages aligned with the tokens give the loss of the ``[B]`` ones they
  broadcast (the objective takes their ``[:, 1:]``, as it does the loss mask)."""
  model, params = create_model(DecoderConfig(vocab_size=16, num_layers=1, embed_dim=16,
                                             num_heads=2, num_kv_heads=1, head_dim=8,
                                             mlp_dim=32, max_seq_len=12), seed=0)
  policy, loss_config = Policy(model, SamplingSpec(1.0)), LossConfig(loss='grpo')
  rng = np.random.RandomState(0)
  tokens = rng.randint(3, 16, (4, 12)).astype(np.int32)
  mask = np.zeros((4, 12), np.float32)
  mask[:, 4:10] = 1.0
  batch = random_train_batch(rng, tokens, mask, vocab=16)
  rows = jnp.asarray(np.linspace(-1.0, 1.0, batch.tokens.shape[0]), jnp.float32)
  per_row, _ = rl_objective(policy, loss_config, params, batch.replace(advantages=rows), None)
  tokens = jnp.broadcast_to(rows[:, None], batch.tokens.shape)
  per_token, _ = rl_objective(policy, loss_config, params,
                              batch.replace(advantages=tokens), None)
  np.testing.assert_allclose(per_token, per_row, rtol=1e-6)
  shifted = tokens.at[:, 0].set(100.0)  # position 0 predicts nothing: never used
  unused, _ = rl_objective(policy, loss_config, params, batch.replace(advantages=shifted), None)
  np.testing.assert_allclose(unused, per_row, rtol=1e-6)
  assert losses.TURN_ESTIMATORS  # the estimators an environment run may choose


@pytest.mark.slow  # a Ray cluster and a run per backend; CI keeps the local cases (suite time)
def test_the_ray_backend_plays_the_same_episodes(smoke_runs, tmp_path):
  """Ray worker actors build the environments and play in their own processes (only the
  trajectories come back): the run equals the local backend's."""
  pytest.importorskip('ray')
  _launch('--config=configs/agent.py:smoke', '--config.backend=ray',
          f'--workdir={tmp_path / "ray"}', timeout=600)
  without_sync = lambda rows: [{k: v for k, v in row.items() if not k.startswith('sync/')}
                               for row in rows]
  assert without_sync(_metrics(tmp_path / 'ray')) == without_sync(_metrics(smoke_runs(0)))
