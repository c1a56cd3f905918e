"""Held-out evaluation: unbiased pass@k against brute force and its closed form, mean@k, the
harness (deterministic with a seed), greedy episode success, and the eval metrics a run
writes."""

import itertools
import math
import pathlib
import types

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scored_rows import Rows  # tests/scored_rows.py

from rlax_llm.evaluation import (
  episode_metrics,
  evaluate_episodes,
  evaluate_policy,
  pass_at_k,
  pass_ks,
  sampled_metrics,
)
from rlax_llm.sampling_spec import GREEDY, SamplingSpec
from rlax_llm.tasks import ArithmeticTask, Prompt

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _brute_force(n, c, k):
  """The fraction of the k-subsets of n samples (c of them correct) holding a correct one."""
  samples = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize('n', range(1, 9))
def test_pass_at_k_equals_brute_force_enumeration(n):
  for c in range(n + 1):
    for k in range(1, n + 1):
      got = pass_at_k(np.array([n]), np.array([c]), k)[0]
      assert got == pytest.approx(_brute_force(n, c, k), abs=1e-12), (n, c, k)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 200), data=st.data())
def test_pass_at_k_equals_the_binomial_closed_form(n, data):
  c = data.draw(st.integers(0, n))
  k = data.draw(st.integers(1, n))
  closed = 1.0 - math.comb(n - c, k) / math.comb(n, k)
  assert pass_at_k(np.array([n]), np.array([c]), k)[0] == pytest.approx(closed, abs=1e-9)


def test_pass_at_k_special_cases_and_vectorised():
  n = np.array([10, 10, 10, 5])
  c = np.array([0, 10, 3, 1])
  np.testing.assert_allclose(pass_at_k(n, c, 1), c / n)  # pass@1 = fraction correct
  assert pass_at_k(n[:3], c[:3], 8)[2] == 1.0  # n - c = 7 < k: every 8-subset has a correct one
  assert pass_at_k(np.array([1000]), np.array([1]), 1000)[0] == 1.0
  assert pass_at_k(np.array([1000]), np.array([0]), 500)[0] == 0.0


@pytest.mark.parametrize('n, c, k, message', [
    ([3], [1], 4, 'pass@4 needs at least 4 samples'),
    ([3], [4], 1, r'num_correct must lie in \[0, num_samples\]'),
    ([3], [-1], 1, r'num_correct must lie'),
    ([3], [1], 0, 'an int k >= 1'),
])
def test_pass_at_k_errors(n, c, k, message):
  with pytest.raises(ValueError, match=message):
    pass_at_k(np.array(n), np.array(c), k)


def test_pass_ks():
  assert pass_ks(0) == [] and pass_ks(1) == [1] and pass_ks(2) == [1, 2]
  assert pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6]


def test_sampled_metrics_mean_and_pass_at_k():
  # Prompt 0: rewards 1, 0, 0, 1; prompt 1: 0, 0, 0, 0; prompt 2: 0.5 (partial) x 4.
  rewards = np.array([1, 0, 0, 1, 0, 0, 0, 0, .5, .5, .5, .5])
  groups = np.repeat([0, 1, 2], 4)
  order = np.random.default_rng(0).permutation(12)  # row order does not matter
  metrics = sampled_metrics(rewards[order], groups[order], 4)
  assert metrics['eval/mean@4'] == pytest.approx((0.5 + 0 + 0.5) / 3)
  assert metrics['eval/pass@1'] == pytest.approx((0.5 + 0 + 0) / 3)  # partial is not correct
  assert metrics['eval/pass@2'] == pytest.approx((1 - 1 / 6) / 3)
  assert metrics['eval/pass@4'] == pytest.approx(1 / 3)
  with pytest.raises(ValueError, match='every prompt needs 4 samples'):
    sampled_metrics(rewards[:-1], groups[:-1], 4)


def _fake_policy(accuracy):
  """Answers right with probability ``accuracy`` per draw, from the request key; greedy
  answers right iff the first operand is even."""
  def generate(requests, key):
    ids, groups, texts = [], [], []
    for i, request in enumerate(requests):
      right = request.prompt.answer
      for s in range(request.num_samples):
        if request.sampling.temperature == 0:
          ok = int(request.prompt.text.split('+')[0]) % 2 == 0
        else:
          u = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, i), s))
          ok = bool(u < accuracy)
        ids.append(request.prompt.prompt_id)
        groups.append(i)
        texts.append(right if ok else right + '1')
    return Rows(np.array(ids), np.array(groups, np.int32), texts)
  return generate


def test_evaluate_policy_is_deterministic_with_a_seed_and_measures_the_policy():
  task = ArithmeticTask(num_eval=64)
  prompts = task.eval_prompts()
  run = lambda seed: evaluate_policy(
      task, prompts, _fake_policy(0.3), sampling=SamplingSpec(temperature=1.0), samples=8,
      max_new_tokens=4, key=jax.random.key(seed))
  first = run(0)
  assert run(0) == first
  assert run(1) != first
  even = np.mean([int(p.text.split('+')[0]) % 2 == 0 for p in prompts])
  assert first['eval/accuracy'] == pytest.approx(even)
  assert abs(first['eval/mean@8'] - 0.3) < 0.08  # 512 draws at p = 0.3
  assert first['eval/pass@1'] == pytest.approx(first['eval/mean@8'])  # rewards are 0/1
  assert first['eval/pass@1'] < first['eval/pass@2'] < first['eval/pass@4'] < first['eval/pass@8']
  assert abs(first['eval/pass@8'] - (1 - 0.7 ** 8)) < 0.1
  assert first['eval/verifier_errors'] == 0
  greedy_only = evaluate_policy(task, prompts, _fake_policy(0.3), sampling=SamplingSpec(),
                                samples=0, max_new_tokens=4, key=jax.random.key(0))
  assert set(greedy_only) == {'eval/accuracy', 'eval/verifier_errors'}
  with pytest.raises(ValueError, match='eval.samples=-1 must be an int >= 0'):
    evaluate_policy(task, prompts, _fake_policy(0.3), sampling=SamplingSpec(), samples=-1,
                    max_new_tokens=4, key=jax.random.key(0))


def test_run_writes_periodic_eval_and_each_reward_component(tmp_path):
  """A 2-step smoke run with eval every step, 2 draws per held-out prompt and a shaped reward:
  metrics.jsonl holds pass@k / mean@k at the start, every step and the end, and each reward
  component; the trained reward is their weighted sum."""
  # pylint: disable=import-outside-toplevel
  import ml_collections

  from rlax_llm.backends.local import build_run
  from rlax_llm.cli import load_config_file
  from rlax_llm.config import validate_config
  from rlax_llm.metrics import read_metrics
  config = load_config_file(str(ROOT / 'configs/default.py') + ':smoke')
  config.total_steps = 2
  config.log.tensorboard = False
  config.eval.every_steps = 1
  config.eval.samples = 2
  config.task.num_eval = 8
  config.warmup.steps = 0  # no SFT step to compile: the test is about what gets logged
  config.reward = ml_collections.ConfigDict(dict(
      task=dict(weight=1.0), format=dict(weight=0.5), overlong=dict(weight=2.0, cache=2)))
  spec = validate_config(config)
  with build_run(config, tmp_path, spec) as run:
    summary = run.execute()
  rows = read_metrics(tmp_path / 'metrics.jsonl')
  assert len(rows) == 2
  for row in rows:
    for key in ('eval/accuracy', 'eval/mean@2', 'eval/pass@1', 'eval/pass@2',
                'reward/task', 'reward/format', 'reward/overlong'):
      assert key in row and math.isfinite(row[key]), key
    assert 0 <= row['eval/pass@1'] <= row['eval/pass@2'] <= 1
    assert row['eval/pass@1'] == pytest.approx(row['eval/mean@2'])  # 0/1 rewards
    assert row['reward/mean'] == pytest.approx(
        row['reward/task'] + 0.5 * row['reward/format'] + 2.0 * row['reward/overlong'],
        abs=1e-5)
    assert -1 <= row['reward/overlong'] <= 0
  assert 'eval/start_pass@2' in rows[0] and 'eval/start_pass@2' not in rows[1]
  assert summary['eval/final_accuracy'] == rows[-1]['eval/accuracy']


def test_no_held_out_prompts_gives_nan_not_a_crash():
  metrics = evaluate_policy(ArithmeticTask(num_eval=0), [], _fake_policy(0.5),
                            sampling=SamplingSpec(), samples=2, max_new_tokens=4,
                            key=jax.random.key(0))
  assert math.isnan(metrics['eval/accuracy']) and metrics['eval/verifier_errors'] == 0


def _episode(seed: int, turns: int, fed: int, success: bool):
  """A trajectory's figures as ``episode_metrics`` reads them: a 3-token first prompt, then
  ``turns`` turns of 2 sampled tokens, with ``fed`` observation tokens after each but the last
  (loss mask 0), return ``seed / 10``."""
  mask, starts = [False] * 3, []
  for turn in range(turns):
    starts.append(len(mask))
    mask += [True, True] + ([False] * fed if turn < turns - 1 else [])
  return types.SimpleNamespace(episode_return=seed / 10, num_turns=turns, success=success,
                               turn_starts=np.asarray(starts, np.int32),
                               tokens=np.zeros(len(mask), np.int32),
                               loss_mask=np.asarray(mask, bool))


def test_evaluate_episodes_plays_one_greedy_episode_per_held_out_seed():
  prompts = [Prompt(prompt_id=-1 - i, text=str(100 + i), answer='') for i in range(4)]
  seen = []

  def play(requests, key):
    seen.append((requests, key))
    return [_episode(int(r.prompt.text) - 100, turns=1 + i % 2, fed=3, success=i < 1)
            for i, r in enumerate(requests)]

  key = jax.random.key(7)
  metrics = evaluate_episodes(prompts, play, max_new_tokens=5, key=key)
  (requests, passed_key), = seen
  assert passed_key is key
  assert [(r.prompt, r.num_samples, r.sampling, r.max_new_tokens) for r in requests] == [
      (p, 1, GREEDY, 5) for p in prompts]
  assert metrics == {'eval/accuracy': 0.25, 'eval/return': pytest.approx(0.15),
                     'eval/turns': 1.5, 'eval/success': 0.25, 'eval/env_tokens': 1.5}


def test_episode_metrics_count_the_fed_tokens_after_the_first_turn():
  episodes = [_episode(1, turns=3, fed=4, success=True), _episode(3, turns=1, fed=4,
                                                                   success=False)]
  assert episode_metrics(episodes, 'episode/') == {
      'episode/return': pytest.approx(0.2), 'episode/turns': 2.0, 'episode/success': 0.5,
      'episode/env_tokens': 4.0}  # 8 fed tokens in the first episode, none in the second


def test_evaluate_episodes_refuses_a_play_that_drops_episodes_and_has_nan_without_seeds():
  prompts = [Prompt(prompt_id=-1, text='1', answer='')]
  with pytest.raises(ValueError, match='play returned 0 trajectories for 1 held-out seeds'):
    evaluate_episodes(prompts, lambda requests, key: [], max_new_tokens=4,
                      key=jax.random.key(0))
  empty = evaluate_episodes([], lambda requests, key: [], max_new_tokens=4,
                            key=jax.random.key(0))
  assert set(empty) == {'eval/accuracy', 'eval/return', 'eval/turns', 'eval/success',
                        'eval/env_tokens'}
  assert all(math.isnan(v) for v in empty.values())
