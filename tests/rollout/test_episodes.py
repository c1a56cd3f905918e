"""Multi-turn episodes (rlax_llm.rollout.episodes) on a tiny random model and toy envs.

Trajectories are token-faithful (prompt and observations as the tokenizer encodes them,
masked; the model's ids as sampled, with behaviour log-probs the trainer's recompute of
the whole conversation reproduces); runs are reproducible; bad environments and contexts
end their own episode only, counted; chat templates' turn deltas equal whole renders; the
batch rows train through the existing objective.
"""

import dataclasses
import functools
import string
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.data_types import GenerationRequest, Trajectory, make_trajectory_batch
from rlax_llm.envs import CalculatorEnv, EnvStep
from rlax_llm.envs.tool_calls import format_tool_result, with_tools
from rlax_llm.losses import LossConfig
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.files.tokenizer import HFTokenizer
from rlax_llm.models.model import create_model
from rlax_llm.paramserver import ParameterServer
from rlax_llm.rollout.driver import VersionedParams
from rlax_llm.rollout.engine import Engine
from rlax_llm.envs.conversation import ChatRenderer
from rlax_llm.rollout.episodes import Episode, EpisodeRunner, state_id
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.sharding import make_mesh
from rlax_llm.tasks import Prompt
from rlax_llm.tokenization import CharTokenizer
from rlax_llm.trainer.objectives import rl_objective
from rlax_llm.trainer.scoring import Policy

ALPHABET = string.digits + string.ascii_lowercase + ' '
TOKENIZER = CharTokenizer(ALPHABET)
CONFIG = DecoderConfig(vocab_size=TOKENIZER.vocab_size, num_layers=2, embed_dim=32,
                       num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=96)
MESH = make_mesh({'data': 1}, jax.devices()[:1])
SPEC = SamplingSpec(1.0)


class ToyEnv:
  """Deterministic given its seed: the observation after turn ``n`` is ``'obs n'`` plus the
  action's length; the reward is the action's length mod 3; done after ``done_at`` turns.
  ``fail``: 'reset' or a turn number at which it raises (minus it: returns a NaN reward);
  ``sleep_s``: seconds each step
  takes; ``obs_len``: padding of every observation (a conversation that outgrows the cache)."""

  name = 'toy'
  tools: ClassVar[list] = []

  def __init__(self, max_turns=4, done_at=3, fail=None, sleep_s=0.0, obs_len=0):
    self.max_turns, self.done_at, self.fail = max_turns, done_at, fail
    self.sleep_s, self.obs_len = sleep_s, obs_len
    self.log = []  # (observation, reward) of every call, in order

  def reset(self, seed):
    if self.fail == 'reset':
      raise RuntimeError('reset failed')
    self.seed, self.turn = seed, 0
    observation = f'go {seed}'
    self.log.append((observation, None))
    return observation

  def step(self, action):
    self.turn += 1
    if self.fail == self.turn:
      raise RuntimeError('step failed')
    time.sleep(self.sleep_s)
    observation = f' obs {self.turn} {len(action)}' + 'z' * self.obs_len
    reward = float('nan') if self.fail == -self.turn else float(len(action) % 3)
    self.log.append((observation, reward))
    return EnvStep(observation, reward, self.turn >= self.done_at, {})

  def state_key(self):
    return f'{self.seed}:{self.turn}'


@pytest.fixture(scope='module')
def engine_and_params():
  model, params = create_model(CONFIG, seed=3)
  engine = Engine(model, MESH, slots=4, max_prefill_length=16, max_decode_length=48,
                  pad_id=TOKENIZER.pad_id)
  return engine, params


def runner(engine_and_params, **kwargs):
  engine, params = engine_and_params
  holder = VersionedParams()
  holder.set(7, engine.place_params(params))
  options = {'max_concurrent_episodes': 2, 'max_turn_tokens': 6, 'timeout_s': 60.0,
             **kwargs}
  return EpisodeRunner(engine, holder, TOKENIZER, **options)


def episodes(envs, seed0=0):
  return [Episode(env, seed=seed0 + i, group_id=i // 2, prompt_id=seed0 + i,
                  key=np.asarray(jax.random.key_data(jax.random.key(100 + seed0 + i))))
          for i, env in enumerate(envs)]


def assert_trainer_recomputes_the_behaviour_logprobs(engine, params, trajectories):
  """The trainer's recompute over each whole conversation (the batch rows) gives the
  behaviour log-probs the runner recorded turn by turn over the kept KV cache."""
  batch = make_trajectory_batch(trajectories, np.zeros(len(trajectories), np.float32)).train
  scored = Policy(engine.source_model, SPEC).sequence_log_probs(
      params, jnp.asarray(batch.tokens), jnp.asarray(batch.support_sizes))
  mask = np.asarray(batch.loss_mask[:, 1:]) > 0
  assert mask.sum() > 10
  np.testing.assert_allclose(np.asarray(scored.logp)[mask],
                             np.asarray(batch.behaviour_logprobs[:, 1:])[mask], atol=1e-5)


def test_trajectories_are_token_faithful(engine_and_params):
  envs = [ToyEnv() for _ in range(5)]  # more episodes than concurrent ones: they queue
  run = runner(engine_and_params)
  trajectories = run.run(episodes(envs), SPEC)
  assert run.stats['termination/done'] == 5 and run.stats['episodes'] == 5
  for x, env in zip(trajectories, envs):
    assert x.termination == 'done' and x.num_turns == 3
    # The prompt, then per turn: sampled ids (loss mask 1), then the observation's ids.
    expected, cursor = TOKENIZER.encode(env.log[0][0], add_bos=True), 0
    assert x.tokens[:len(expected)].tolist() == expected
    for n in range(3):
      start, end = int(x.turn_starts[n]), int(x.turn_ends[n])
      assert start == (len(expected) if n == 0 else cursor)
      turn = x.tokens[start:end].tolist()
      assert x.loss_mask[start:end].all() and (x.token_turn[start:end] == n).all()
      assert (x.versions[start:end] == 7).all()
      stopped = turn[-1] == TOKENIZER.eos_id
      assert stopped or len(turn) == 6
      assert x.texts[n] == TOKENIZER.decode(turn)
      observation, reward = env.log[n + 1]
      assert observation.startswith(f' obs {n + 1} {len(x.texts[n])}')
      assert x.turn_rewards[n] == reward
      if n < 2:
        obs_ids = TOKENIZER.encode(observation)
        assert x.tokens[end:end + len(obs_ids)].tolist() == obs_ids
        cursor = end + len(obs_ids)
    assert len(x.tokens) == int(x.turn_ends[-1])
    assert (x.loss_mask == (x.token_turn >= 0)).all()
    assert (x.versions[~x.loss_mask] == -1).all()
    assert (x.behaviour_logprobs[~x.loss_mask] == 0).all()
    assert x.turn_mask.all() and x.episode_return == pytest.approx(x.turn_rewards.sum())
    assert x.state_ids.tolist() == [state_id(f'{env.seed}:{n}') for n in range(3)]
  # Each prompt and observation token was prefilled once: never the conversation again.
  fed = sum(int((~x.loss_mask).sum()) + x.num_turns - 1 for x in trajectories)
  assert run.stats['prefilled_tokens'] == fed
  assert_trainer_recomputes_the_behaviour_logprobs(*engine_and_params, trajectories)


def test_two_runs_are_equal_bit_for_bit(engine_and_params):
  first = runner(engine_and_params).run(episodes([ToyEnv() for _ in range(3)]), SPEC)
  second = runner(engine_and_params).run(episodes([ToyEnv() for _ in range(3)]), SPEC)
  for a, b in zip(first, second):
    for field in dataclasses.fields(Trajectory):
      x, y = getattr(a, field.name), getattr(b, field.name)
      if isinstance(x, np.ndarray):
        assert x.dtype == y.dtype and np.array_equal(x, y), field.name
      else:
        assert x == y, field.name
  other = runner(engine_and_params).run(episodes([ToyEnv() for _ in range(3)], seed0=9), SPEC)
  assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(first, other))


def test_bad_input_ends_its_own_episode_and_is_counted(engine_and_params):
  envs = [ToyEnv(fail=2), ToyEnv(fail='reset'), ToyEnv(done_at=99, max_turns=3),
          ToyEnv(sleep_s=20.0), ToyEnv(obs_len=30), ToyEnv(), ToyEnv(fail=-1)]
  eps = episodes(envs)
  eps.append(Episode(ToyEnv(), seed=10 ** 17, key=eps[0].key))  # prompt of 20 > 16 tokens
  run = runner(engine_and_params, max_concurrent_episodes=3, timeout_s=12.0)
  trajectories = run.run(eps, SPEC)
  reasons = [x.termination for x in trajectories]
  assert reasons == ['env_error', 'env_error', 'turn_limit', 'timeout', 'context_full',
                     'done', 'env_error', 'context_full']
  raised = trajectories[0]
  assert raised.num_turns == 2 and raised.episode_return == 0.0
  assert (raised.turn_rewards == 0).all() and raised.turn_mask.tolist() == [True, False]
  assert trajectories[1].tokens.size == 0 and trajectories[1].num_turns == 0
  assert trajectories[2].num_turns == 3
  assert trajectories[3].num_turns == 1 and not trajectories[3].turn_mask[0]
  assert len(trajectories[4].tokens) < run.engine.cache_length
  assert trajectories[6].num_turns == 1 and trajectories[6].episode_return == 0.0
  assert trajectories[7].tokens.size == 0
  for reason, count in [('env_error', 3), ('turn_limit', 1), ('timeout', 1),
                        ('context_full', 2), ('done', 1)]:
    assert run.stats[f'termination/{reason}'] == count, reason
  # The healthy episode ran as it runs alone: nothing above disturbed it.
  alone = runner(engine_and_params).run([dataclasses.replace(eps[5], env=ToyEnv())], SPEC)
  assert alone[0].tokens.tolist() == trajectories[5].tokens.tolist()


def test_trajectory_rows_train_through_the_existing_objective(engine_and_params):
  engine, params = engine_and_params
  trajectories = runner(engine_and_params).run(episodes([ToyEnv() for _ in range(4)]), SPEC)
  returns = np.asarray([x.episode_return for x in trajectories], np.float32)
  batch = make_trajectory_batch(trajectories, returns - returns.mean(), turns=5)
  assert batch.turn_rewards.shape == (4, 5) and not batch.turn_mask[:, 3:].any()
  assert batch.token_turn.shape == batch.train.tokens.shape
  np.testing.assert_array_equal(batch.train.group_ids, [0, 0, 1, 1])
  objective = functools.partial(rl_objective, Policy(engine.source_model, SPEC),
                                LossConfig(loss='grpo'))
  loss, diags = jax.jit(objective)(params, batch.train, None)
  assert np.isfinite(float(loss))
  assert abs(float(diags['is/ratio_mean']) - 1.0) < 1e-5
  with pytest.raises(ValueError, match='holds length=4'):
    make_trajectory_batch(trajectories, returns, length=4)


def test_a_worker_plays_episodes_with_the_version_it_is_told(engine_and_params):
  """The inference role pulls the named version, plays in its own slots (one KV cache with
  its single-turn driver, which still works after) and returns whole trajectories: the
  tokens the runner alone samples with those weights."""
  engine, params = engine_and_params
  worker = InferenceWorker(engine.source_model, TOKENIZER, MESH, max_prompt_len=16,
                           max_new_tokens=48, slots=4)
  server = ParameterServer(keep=2)
  server.push(3, params)
  trajectories, stats = worker.play_at(
      3, server.update, episodes([ToyEnv() for _ in range(3)]), SPEC,
      max_concurrent_episodes=2, max_turn_tokens=6, timeout_s=60.0)
  assert worker.version == 3 and stats['sync/updates'] == 1
  assert stats['termination/done'] == 3
  alone = runner(engine_and_params).run(episodes([ToyEnv() for _ in range(3)]), SPEC)
  for x, y in zip(trajectories, alone):
    assert x.tokens.tolist() == y.tokens.tolist() and set(x.versions[x.loss_mask]) == {3}
  _, stats = worker.play_at(3, server.update, episodes([ToyEnv()]), SPEC,
                            max_concurrent_episodes=1, max_turn_tokens=6, timeout_s=60.0)
  assert 'sync/updates' not in stats  # held: no pull
  rollouts = worker.generate([GenerationRequest(Prompt(0, 'go 1', ''), 2, SPEC, 6)],
                             jax.random.key(0))  # the driver runs on the cache it shares
  assert rollouts.completion_mask.sum() >= 2 and set(rollouts.versions[
      rollouts.completion_mask].tolist()) == {3}


# ----------------------------------------------------------------------- chat templates

# Qwen2.5's template, abridged (no tool_calls field): the tools in a system prompt, tool
# results grouped into user turns.
QWEN_STYLE = """
{%- if tools %}
  {{- '<|im_start|>system\nCall tools inside <tool_call></tool_call> tags.\n\n<tools>' }}
  {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
  {{- '\n</tools><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'tool' %}
    {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
      {{- '<|im_start|>user' }}
    {%- endif %}
    {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
      {{- '<|im_end|>\n' }}
    {%- endif %}
  {%- else %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
TOOLS = [{'type': 'function', 'function': {'name': 'calculate', 'parameters': {
    'type': 'object', 'properties': {'expression': {'type': 'string'}}}}}]


@pytest.mark.parametrize('template', ['smollm2', 'qwen-style'])
def test_turn_deltas_equal_a_whole_conversation_render(smollm2_tokenizer, template):
  tok = smollm2_tokenizer
  if template == 'qwen-style':
    tok = HFTokenizer(tok.backend, **tok.special_tokens, chat_template=QWEN_STYLE)
  renderer = ChatRenderer(tok, TOOLS)
  # SmolLM2's template knows no tools: our system prompt; the Qwen-style one: its own.
  assert renderer.tool_format == ('simple' if template == 'smollm2' else 'qwen')
  im_end = tok.encode('<|im_end|>')
  assert len(im_end) == 1 and tok.eos_id == im_end[0]
  messages = [{'role': 'user', 'content': 'What is 123 * 45?'}]
  turns = [(('<tool_call>{"name": "calculate", "arguments": {"expression": "123*45"}}'
             '</tool_call>'), [format_tool_result('5535', renderer.tool_format, 'calculate')]),
           ('The answer is 5535.', [{'role': 'user', 'content': 'Correct. Anything else?'}]),
           ('No.', None)]
  ids = renderer.prompt(messages)
  for n, (action, new) in enumerate(turns):
    stopped = n != 1  # turn 1 is cut by its length: the template's end tokens are inserted
    sampled = tok.encode(action) + (im_end if stopped else [])
    ids += sampled
    if new is None:
      break
    ids += renderer.between_turns(messages, new, sampled[-1] if stopped else None)
    messages += [{'role': 'assistant', 'content': action}, *new]
    shown, variables = with_tools(messages, TOOLS, renderer.tool_format)
    whole = tok.encode(tok.apply_chat_template(shown, add_generation_prompt=True, **variables))
    assert ids == whole, (n, tok.decode(ids, stop_at_eos=False), tok.decode(whole,
                                                                          stop_at_eos=False))
  assert '<tools>' in tok.decode(ids, stop_at_eos=False) or template == 'smollm2'


def test_calculator_episodes_with_smollm2s_template(smollm2_tokenizer):
  """The calculator environment through SmolLM2's template on a tiny random model of its
  vocabulary: prompts are the template's render, tool results come back as masked turns,
  and the trainer's recompute of the whole conversation gives the behaviour log-probs."""
  tok = smollm2_tokenizer
  config = dataclasses.replace(CONFIG, vocab_size=tok.vocab_size, max_seq_len=512)
  model, params = create_model(config, seed=0)
  engine = Engine(model, MESH, slots=2, max_prefill_length=384, max_decode_length=96,
                  pad_id=tok.pad_id)
  holder = VersionedParams()
  holder.set(0, engine.place_params(params))
  run = EpisodeRunner(engine, holder, tok, max_concurrent_episodes=2, max_turn_tokens=8,
                      timeout_s=120.0)
  envs = [CalculatorEnv(max_turns=3) for _ in range(2)]
  trajectories = run.run(episodes(envs), SPEC)
  renderer = ChatRenderer(tok, envs[0].tools)
  for x, env in zip(trajectories, envs):
    assert x.termination == 'turn_limit' and x.num_turns == 3  # random text: no answer
    first = renderer.prompt([{'role': 'user', 'content': env.reset(x.prompt_id)}])
    assert x.tokens[:len(first)].tolist() == first
    assert 'calculate' in tok.decode(first)  # the tools, in SmolLM2's system prompt
    between = tok.decode(x.tokens[x.turn_ends[0]:x.turn_starts[1]], stop_at_eos=False)
    assert between.endswith('<|im_start|>assistant\n') and not x.loss_mask[
        x.turn_ends[0]:x.turn_starts[1]].any()
  assert_trainer_recomputes_the_behaviour_logprobs(engine, params, trajectories)


def test_a_template_that_rewrites_earlier_turns_is_refused(smollm2_tokenizer):
  tok = smollm2_tokenizer
  last_only = ("{%- for m in messages %}{%- if loop.last %}{{ m.content }}{%- endif %}"
               "{%- endfor %}")
  renderer = ChatRenderer(HFTokenizer(tok.backend, **tok.special_tokens,
                                      chat_template=last_only))
  with pytest.raises(ValueError, match='rewrites earlier turns'):
    renderer.between_turns([{'role': 'user', 'content': 'a'}],
                           [{'role': 'user', 'content': 'b'}], None)


class GoalEnv(ToyEnv):
  """ToyEnv whose last step reports ``info['success']`` (the odd seeds reach the goal)."""

  def step(self, action):
    step = super().step(action)
    info = {'success': self.seed % 2 == 1} if step.done else {}
    return dataclasses.replace(step, info=info)


def test_success_is_the_last_steps_and_needs_the_episode_done(engine_and_params):
  trajectories = runner(engine_and_params).run(
      episodes([GoalEnv(), GoalEnv(), GoalEnv(done_at=99, max_turns=2)]), SPEC)
  assert [x.termination for x in trajectories] == ['done', 'done', 'turn_limit']
  assert [x.success for x in trajectories] == [False, True, False]
