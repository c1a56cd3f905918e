"""Training an agent harness written against the OpenAI API (``env.name='harness'``).

``HarnessRunner`` plays a tiny character-level model's episodes through the endpoint with
the real ``openai`` client: the recorded trajectories hold exactly the ids the engine samples
for each call's prompt and key (checked against the driver run directly), masks on the ids fed
between calls, a version on every sampled token; a harness that raises, never ends, or never
posts a reward is counted and does not change what a healthy episode beside it samples; a
worker's ``play`` hands a harness run's requests to it. And (slow) a launch of
``configs/agent.py:harness_smoke`` (the example calculator harness) trains.
"""

import json
import os
import pathlib
import subprocess
import sys
import threading

import httpx
import jax
import numpy as np
import pytest

openai = pytest.importorskip('openai')
pytest.importorskip('fastapi')

from char_model import CHAR_SPEC, CHAR_TURN_TOKENS, CHAR_VERSION, make_char_worker

from rlax_llm.backends.play import play_requests
from rlax_llm.cli import load_config_file
from rlax_llm.config import validate_config
from rlax_llm.data_types import TERMINATIONS, GenerationRequest
from rlax_llm.errors import ConfigError
from rlax_llm.metrics import read_metrics
from rlax_llm.rollout.driver import Job
from rlax_llm.rollout.episodes import Episode, request_episodes
from rlax_llm.schedule import EpisodeSettings
from rlax_llm.serve.calculator_agent import calculator_agent
from rlax_llm.serve.harness import Harness, load_harness
from rlax_llm.serve.harness_runner import HarnessRunner
from rlax_llm.serve.openai_api import EPISODE_HEADER
from rlax_llm.tasks.base import Prompt

ROOT = pathlib.Path(__file__).resolve().parents[2]
VERSION, SPEC, TURN_TOKENS = CHAR_VERSION, CHAR_SPEC, CHAR_TURN_TOKENS
SMALL = {'max_turns': 2, 'instruction': '{a}*{b}=', 'retry': '?', 'min_a': 1, 'max_a': 9,
         'min_b': 1, 'max_b': 9}
RELEASE = threading.Event()  # lets the hung harness's thread end when the module is done


def mixed(client, model, seed):
  """Seed 0, 1: the example agent; 2: raises after a call; 3: hangs after a call; 4: never
  posts a reward; 5: posts 0.5 itself (returns None)."""
  if seed < 2:
    return calculator_agent(client, model, seed, **SMALL)
  client.chat.completions.create(model=model, messages=[{'role': 'user', 'content': '1*2='}])
  if seed == 2:
    raise RuntimeError('the harness has a bug')
  if seed == 3:
    RELEASE.wait()
  if seed == 5:
    episode = client.default_headers[EPISODE_HEADER]
    response = httpx.post(f'{client.base_url}episodes/{episode}/reward', json={'reward': 0.5},
                          headers={'Authorization': f'Bearer {client.api_key}'})
    response.raise_for_status()
  return None


def episode(seed: int) -> Episode:
  key = np.asarray(jax.random.key_data(jax.random.key(100 + seed)))
  return Episode(env=None, seed=seed, key=key, group_id=seed // 2, prompt_id=seed)


def run(char_worker, seeds, timeout_s=60.0):
  runner = HarnessRunner(char_worker, Harness(mixed, {}), max_concurrent_episodes=4,
                         max_turn_tokens=TURN_TOKENS, timeout_s=timeout_s)
  return runner.run([episode(s) for s in seeds], SPEC), runner.stats


def engine_sample(char_worker, prompt, key_data, call):
  """What the driver samples for ``prompt`` with call ``call``'s key of an episode."""
  key = jax.random.fold_in(jax.random.wrap_key_data(key_data), call)
  job = Job(prompt_ids=tuple(int(t) for t in prompt), num_samples=1, sampling=SPEC,
            max_new_tokens=TURN_TOKENS, stop_ids=(char_worker.tokenizer.eos_id,),
            keys=np.asarray(jax.random.key_data(key))[None])
  (sample,), = char_worker.driver.run([job])
  return sample


@pytest.fixture(scope='module')
def char_worker():
  return make_char_worker()


@pytest.fixture(scope='module')
def mixed_run(char_worker):
  yield run(char_worker, range(6), timeout_s=5.0)
  RELEASE.set()


def test_trajectories_hold_what_the_engine_sampled(char_worker, mixed_run):
  trajectories, _ = mixed_run
  healthy = [x for x in trajectories if x.prompt_id < 2]
  assert [x.prompt_id for x in healthy] == [0, 1]  # one trajectory each: the calls stitch
  for x in healthy:
    assert x.num_turns == 2  # a tiny random model never answers: the retry message follows
    assert x.group_id == 0 and x.termination == 'done' and x.episode_return == 0.0
    for n in range(x.num_turns):
      start, end = x.turn_starts[n], x.turn_ends[n]
      sample = engine_sample(char_worker, x.tokens[:start], episode(x.prompt_id).key, n)
      assert x.tokens[start:end].tolist() == list(sample.tokens)
      np.testing.assert_allclose(x.behaviour_logprobs[start:end], sample.logprobs, atol=1e-6)
    model = x.loss_mask
    assert model.sum() == sum(x.turn_ends - x.turn_starts)
    assert (x.versions[model] == VERSION).all() and (x.versions[~model] == -1).all()
    between = x.tokens[x.turn_ends[0]:x.turn_starts[1]]
    # The retry message (and the eos the model did not write, if its reply was cut) is fed
    # with loss mask 0.
    assert char_worker.tokenizer.decode(between, stop_at_eos=False).endswith('?')
    assert not x.loss_mask[x.turn_ends[0]:x.turn_starts[1]].any()
    first_prompt = char_worker.tokenizer.decode(x.tokens[:x.turn_starts[0]])
    assert first_prompt.endswith('=') and '*' in first_prompt


def test_failing_harnesses_are_counted_and_block_nothing(char_worker, mixed_run):
  trajectories, stats = mixed_run
  by_seed = {x.prompt_id: x for x in trajectories}
  assert {s: by_seed[s].termination for s in range(2, 6)} == {
      2: 'env_error', 3: 'timeout', 4: 'no_reward', 5: 'done'}
  assert [by_seed[s].episode_return for s in range(2, 6)] == [0.0, 0.0, 0.0, 0.5]
  for s in range(2, 6):  # the call each made before it failed is kept
    assert by_seed[s].num_turns == 1 and by_seed[s].loss_mask.any()
  assert stats['termination/done'] == 3 and stats['termination/timeout'] == 1
  assert stats['termination/env_error'] == 1 and stats['termination/no_reward'] == 1
  assert set(TERMINATIONS) >= {x.termination for x in trajectories}
  # The hung harness did not delay the run past its own deadline (5 s).
  assert stats['wall_s'] < 20
  # Healthy episodes sample the same alone as beside failing ones.
  alone, _ = run(char_worker, [0, 1])
  assert [x.tokens.tolist() for x in alone] == [by_seed[s].tokens.tolist() for s in (0, 1)]


def test_a_harness_run_plays_its_requests_where_an_environment_run_would(char_worker):
  """``play_requests`` (what a worker's ``play`` runs) hands a harness run's requests
  to the harness runner: ``num_samples`` episodes a request, with the keys and group ids an
  environment run's episodes get (``request_episodes``)."""
  settings = EpisodeSettings(
      env={'name': 'harness', 'harness': 'rlax_llm.serve.calculator_agent:calculator_agent',
           **SMALL}, max_turns=None, max_concurrent_episodes=4, timeout_s=60.0,
      max_turn_tokens=TURN_TOKENS, length=47, num_eval=0, eval_seed_start=2**40)
  requests = [GenerationRequest(Prompt(prompt_id=i, text=str(i), answer=''), 2, SPEC,
                                TURN_TOKENS) for i in (3, 4)]
  rng = jax.random.key(5)
  trajectories, figures = play_requests(
      char_worker, None, requests, np.asarray(jax.random.key_data(rng)), VERSION, 10, settings,
      make_env=None)
  assert [(x.group_id, x.prompt_id) for x in trajectories] == [(10, 3)] * 2 + [(11, 4)] * 2
  assert figures['termination/done'] == 4 and 'sync/updates' not in figures  # held: no pull
  expected = request_episodes(requests, lambda: None, rng, 10)
  for x, played in zip(trajectories, expected):
    start, end = x.turn_starts[0], x.turn_ends[0]
    assert x.tokens[start:end].tolist() == list(
        engine_sample(char_worker, x.tokens[:start], played.key, 0).tokens)


def test_load_harness_checks_the_function_and_its_fields():
  harness = load_harness({'name': 'harness',
                          'harness': 'rlax_llm.serve.calculator_agent:calculator_agent',
                          'max_turns': 2})
  assert harness.fn is calculator_agent and harness.kwargs == {'max_turns': 2}
  with pytest.raises(ValueError, match='needs env.harness'):
    load_harness({'name': 'harness'})
  with pytest.raises(ValueError, match='cannot be called'):
    load_harness({'name': 'harness', 'harness': 'rlax_llm.serve.calculator_agent:'
                  'calculator_agent', 'colour': 'red'})
  config = load_config_file(f'{ROOT}/configs/agent.py:harness_smoke')
  config.env.harness = 'rlax_llm.serve.calculator_agent:nothing'
  with pytest.raises(ConfigError, match='env.harness'):
    validate_config(config)


@pytest.mark.slow  # a launch: 80-110 s on 2 shared cores (it compiles the trainer's step)
def test_the_harness_smoke_variant_trains(tmp_path):
  """The example calculator harness through ``python -m rlax_llm.launch``: two steps."""
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join([str(ROOT), env.get('PYTHONPATH', '')])
  result = subprocess.run(
      [sys.executable, '-m', 'rlax_llm.launch', '--config=configs/agent.py:harness_smoke',
       f'--workdir={tmp_path}'], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = read_metrics(tmp_path / 'metrics.jsonl')
  assert [r['step'] for r in rows] == [1, 2] and [r['version'] for r in rows] == [1, 2]
  for row in rows:
    assert row['termination/done'] == 1.0  # every episode ended with the harness's reward
    assert row['episode/turns'] == 2 and row['episode/env_tokens'] > 0
    # The trainer's recompute matches the recorded behaviour log-probs: the tokens and the
    # policy are the ones the endpoint sampled with.
    assert row['mismatch/max_abs_dlogp'] < 1e-4
    assert row['staleness/max'] == 0
  assert 'eval/success' in rows[-1]
  summary = json.loads((tmp_path / 'summary.json').read_text())
  assert summary['steps'] == 2
