"""The OpenAI-compatible endpoint, driven by the official ``openai`` client over loopback.

The model is a tiny decoder trained here for a few hundred steps to answer a word-level chat
(a Qwen-style template that renders ``tools``): asked ``What is 12*34?`` with a tool it calls
``calculate``; shown the tool's result it answers ``408``; asked ``Use a tool.`` it writes a
malformed call. It is sampled by our engine (temperature 1, seeded), so the trajectory check
compares the recorded tokens with the ids the driver really returned.
"""

import collections
import concurrent.futures
import json
import threading
import time

import httpx
import jax
import numpy as np
import optax
import pytest

openai = pytest.importorskip('openai')
tokenizers = pytest.importorskip('tokenizers')

from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.files.tokenizer import HFTokenizer
from rlax_llm.models.model import create_model
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.serve import chat_prompts
from rlax_llm.serve.http_server import ApiError
from rlax_llm.serve.openai_api import Endpoint
from rlax_llm.serve.recorder import Call, EpisodeRecorder, stitch
from rlax_llm.serve.scheduler import Busy, Scheduler
from rlax_llm.sharding import make_mesh

WORDS = ['<pad>', '[UNK]', '<|im_start|>', '<|im_end|>', '<tool_call>', '</tool_call>',
         '<tool_response>', '</tool_response>', 'system', 'user', 'assistant', 'tools:',
         'calculate', '{"name":', '"calculate",', '"arguments":', '{"expression":',
         '"12*34"}}', 'What', 'is', '12*34?', '408', 'Use', 'a', 'tool.']
WORDS += [f'w{i}' for i in range(32 - len(WORDS))]
TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}
{{- 'tools:' }}
{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls | default([]) %}
{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + call.arguments | tojson
    + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content
    + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
MODEL = 'tiny-calculator'
KEY = 'sk-test'
TOOLS = [{'type': 'function', 'function': {
    'name': 'calculate', 'description': 'Evaluates an arithmetic expression.',
    'parameters': {'type': 'object', 'properties': {'expression': {'type': 'string'}},
                   'required': ['expression']}}}]
QUESTION = [{'role': 'user', 'content': 'What is 12*34?'}]
TOOL_CALL = '<tool_call> {"name": "calculate", "arguments": {"expression": "12*34"}} </tool_call>'
VERSION = 5


def make_tokenizer() -> HFTokenizer:
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(WORDS)}, unk_token='[UNK]'))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  backend.add_special_tokens([tokenizers.AddedToken(w, special=True)
                              for w in ('<pad>', '<|im_start|>', '<|im_end|>')])
  backend.add_tokens([tokenizers.AddedToken(w) for w in WORDS[4:8]])
  return HFTokenizer(backend, eos_token='<|im_end|>', pad_token='<pad>', unk_token='[UNK]',
                     chat_template=TEMPLATE)


def demonstrations(tok):
  """(prompt ids, completion ids) the model learns: call the tool, answer from its result,
  and a malformed call to 'Use a tool.'."""
  call = {'role': 'assistant', 'content': None, 'tool_calls': [
      {'type': 'function', 'function': {'name': 'calculate',
                                        'arguments': {'expression': '12*34'}}}]}
  render = lambda ms: tok.apply_chat_template(ms, add_generation_prompt=True, tokenize=True,
                                              tools=TOOLS)
  return [(render(QUESTION), tok.encode(TOOL_CALL, add_eos=True)),
          (render(QUESTION + [call, {'role': 'tool', 'content': '408'}]),
           tok.encode('408', add_eos=True)),
          (render([{'role': 'user', 'content': 'Use a tool.'}]),
           tok.encode('<tool_call> {"name": </tool_call>', add_eos=True))]


def train(model, params, tok, steps=300):
  rows = demonstrations(tok)
  width = max(len(p) + len(c) for p, c in rows)
  tokens = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), np.float32)
  for r, (p, c) in enumerate(rows):
    tokens[r, :len(p) + len(c)] = p + c
    mask[r, len(p):len(p) + len(c)] = 1
  optimizer = optax.adam(1e-2)

  @jax.jit
  def step(params, state):
    def loss(params):
      logits = model.apply(params, tokens)[:, :-1]
      nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
      return (nll * mask[:, 1:]).sum() / mask.sum()
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  state = optimizer.init(params)
  for _ in range(steps):
    params, state, value = step(params, state)
  assert value < 0.01, value
  return params


@pytest.fixture(scope='module')
def trained():
  """The tiny model and its trained params."""
  config = DecoderConfig(vocab_size=len(WORDS), num_layers=2, embed_dim=32, num_heads=4,
                         num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=160)
  model, params = create_model(config, seed=0)
  return model, train(model, params, make_tokenizer())


@pytest.fixture(scope='module')
def worker(trained):
  model, params = trained
  worker = InferenceWorker(model, make_tokenizer(), make_mesh({'data': 1}, jax.devices()[:1]),
                           max_prompt_len=32, max_new_tokens=12, slots=4)
  worker.load(VERSION, params)
  return worker


@pytest.fixture
def endpoint(worker):
  worker.driver.before_step = None
  with Endpoint(worker, model_name=MODEL, api_key=KEY) as endpoint:
    yield endpoint


@pytest.fixture
def sampled(worker, monkeypatch):
  """Every (prompt ids, Sample) the driver returns, in order: what the engine sampled."""
  seen = []
  run = worker.driver.run

  def spy(jobs, *args, **kwargs):
    results = run(jobs, *args, **kwargs)
    seen.extend((list(job.prompt_ids), samples[0]) for job, samples in zip(jobs, results))
    return results

  monkeypatch.setattr(worker.driver, 'run', spy)
  return seen


def client(endpoint, episode=None, **kwargs):
  headers = {'X-Episode-Id': episode} if episode else None
  return openai.OpenAI(base_url=endpoint.base_url, api_key=kwargs.pop('api_key', KEY),
                       default_headers=headers, max_retries=0, **kwargs)


def post_reward(endpoint, episode, **body):
  return httpx.post(f'{endpoint.base_url}/episodes/{episode}/reward', json=body,
                    headers={'Authorization': f'Bearer {KEY}'})


def test_a_tool_calling_episode_records_exactly_what_the_engine_sampled(endpoint, sampled):
  chat = client(endpoint, 'ep-1')
  first = chat.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, seed=1,
                                       logprobs=True)
  choice = first.choices[0]
  assert choice.finish_reason == 'tool_calls'
  (call,) = choice.message.tool_calls
  assert call.function.name == 'calculate'
  assert json.loads(call.function.arguments) == {'expression': '12*34'}
  assert choice.message.content is None
  messages = QUESTION + [choice.message.model_dump(exclude_none=True),
                         {'role': 'tool', 'tool_call_id': call.id, 'content': '408'}]
  second = chat.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, seed=2)
  assert second.choices[0].message.content == '408'
  assert second.choices[0].finish_reason == 'stop'
  assert post_reward(endpoint, 'ep-1', reward=1.0).json()['trajectories'] == 1

  (episode,) = endpoint.recorder.take()
  assert episode.reward == 1.0 and len(episode.calls) == 2 and episode.name == 'ep-1'
  (trajectory,) = episode.trajectories
  (p1, s1), (p2, s2) = sampled
  tokens = trajectory.tokens.tolist()
  # The second call's prompt is the first call's prompt and sampled ids, then the tool's.
  assert p2[:len(p1) + len(s1.tokens)] == p1 + s1.tokens
  assert tokens == p2 + s2.tokens
  a, c = trajectory.turn_starts.tolist()
  b, d = trajectory.turn_ends.tolist()
  assert (a, b, d) == (len(p1), len(p1) + len(s1.tokens), len(tokens))
  assert tokens[a:b] == s1.tokens and tokens[c:d] == s2.tokens
  expected_mask = np.zeros(len(tokens), bool)
  expected_mask[a:b] = expected_mask[c:d] = True
  np.testing.assert_array_equal(trajectory.loss_mask, expected_mask)
  tool_tokens = endpoint.tokenizer.decode(tokens[b:c], stop_at_eos=False)
  assert '<tool_response> 408 </tool_response>' in tool_tokens
  logprobs = trajectory.behaviour_logprobs
  np.testing.assert_array_equal(logprobs[a:b], np.float32(s1.logprobs))
  np.testing.assert_array_equal(logprobs[c:d], np.float32(s2.logprobs))
  assert not logprobs[~expected_mask].any()
  np.testing.assert_array_equal(trajectory.support_sizes[a:b], s1.supports)
  np.testing.assert_array_equal(trajectory.versions[expected_mask], VERSION)
  np.testing.assert_array_equal(trajectory.versions[~expected_mask], -1)
  assert trajectory.token_turn.tolist() == [-1] * a + [0] * (b - a) + [-1] * (c - b) + [1] * (
      d - c)
  assert trajectory.episode_return == 1.0 and trajectory.termination == 'done'
  assert trajectory.texts == (TOOL_CALL, '408')
  assert trajectory.episode_id == trajectory.group_id == episode.episode_id
  # The log-probs the client got are the recorded behaviour log-probs.
  returned = [t.logprob for t in choice.logprobs.content]
  np.testing.assert_allclose(returned, s1.logprobs, rtol=1e-6)
  assert endpoint.stats['chat_spliced'] == 1


def test_an_edited_history_splits_the_episode(endpoint, sampled):
  chat = client(endpoint)
  first = chat.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, seed=1,
                                       user='ep-2')
  edited = [{'role': 'system', 'content': 'Use a tool.'}] + QUESTION + [
      first.choices[0].message.model_dump(exclude_none=True),
      {'role': 'tool', 'tool_call_id': 'x', 'content': '408'}]
  chat.chat.completions.create(model=MODEL, messages=edited, tools=TOOLS, seed=2, user='ep-2')
  assert post_reward(endpoint, 'ep-2', reward=0.5, group_id=7,
                     prompt_id=3).json()['trajectories'] == 2
  (episode,) = endpoint.recorder.take()
  (p1, s1), (p2, s2) = sampled
  one, two = episode.trajectories
  assert one.tokens.tolist() == p1 + s1.tokens and one.turn_starts.tolist() == [len(p1)]
  assert two.tokens.tolist() == p2 + s2.tokens and two.turn_starts.tolist() == [len(p2)]
  assert one.episode_return == two.episode_return == 0.5
  assert one.group_id == two.group_id == 7 and one.prompt_id == two.prompt_id == 3
  assert endpoint.recorder.stats['splits'] == 1


def test_completions_take_token_ids_and_stitch_them(endpoint, sampled):
  tok = endpoint.tokenizer
  prompt = demonstrations(tok)[0][0]
  chat = client(endpoint, 'ep-3')
  first = chat.completions.create(model=MODEL, prompt=prompt, seed=3, max_tokens=4,
                                  logprobs=0)
  assert first.choices[0].finish_reason == 'length'
  (_, s1), = sampled
  assert first.choices[0].logprobs.token_logprobs == pytest.approx(s1.logprobs, rel=1e-6)
  assert first.choices[0].text == tok.decode(s1.tokens)
  follow = prompt + s1.tokens + tok.encode('<|im_start|> user')
  chat.completions.create(model=MODEL, prompt=follow, seed=4, max_tokens=2)
  text = chat.completions.create(model=MODEL, prompt='What is', seed=5, max_tokens=2)
  assert text.usage.prompt_tokens == 2
  assert post_reward(endpoint, 'ep-3', turn_rewards=['x']).status_code == 400
  post_reward(endpoint, 'ep-3', reward=0.0, turn_rewards=[0.0, 1.0, 0.5]).raise_for_status()
  (episode,) = endpoint.recorder.take()
  stitched, fresh = episode.trajectories
  assert stitched.num_turns == 2 and fresh.num_turns == 1
  assert stitched.turn_rewards.tolist() == [0.0, 1.0] and fresh.turn_rewards.tolist() == [0.5]
  env = slice(len(prompt) + 4, len(follow))
  assert stitched.tokens[env].tolist() == tok.encode('<|im_start|> user')
  assert not stitched.loss_mask[env].any()


def test_a_malformed_tool_call_comes_back_as_content_and_is_counted(endpoint):
  reply = client(endpoint, 'ep-4').chat.completions.create(
      model=MODEL, messages=[{'role': 'user', 'content': 'Use a tool.'}], tools=TOOLS, seed=1)
  choice = reply.choices[0]
  assert choice.message.tool_calls is None and choice.finish_reason == 'stop'
  assert choice.message.content == '<tool_call> {"name": </tool_call>'
  assert endpoint.stats['malformed_tool_calls'] == 1


def test_a_template_without_tools_gets_the_simple_tool_format(worker, trained):
  """SmolLM2-like: the template knows no tools, so they are described in the system message,
  tool calls in the history become the assistant's text and results a user message."""
  plain = TEMPLATE.replace("'\\n<tool_call>\\n{\"name\": \"'", "'\\nX'")
  assert '<tool_call>' not in plain
  tok = make_tokenizer()
  tok = HFTokenizer(tok.backend, eos_token='<|im_end|>', pad_token='<pad>', unk_token='[UNK]',
                    chat_template=plain)
  simple = InferenceWorker(trained[0], tok, worker.mesh, max_prompt_len=150,
                           max_new_tokens=2, slots=1)
  simple.load(VERSION, trained[1])
  with Endpoint(simple, model_name=MODEL) as endpoint:
    assert endpoint.tool_format == 'simple'
    chat = client(endpoint, 'ep-s').chat.completions
    history = QUESTION + [{'role': 'assistant', 'content': None, 'tool_calls': [
        {'id': 'c1', 'type': 'function', 'function': {
            'name': 'calculate', 'arguments': '{"expression": "12*34"}'}}]},
                          {'role': 'tool', 'tool_call_id': 'c1', 'content': '408'}]
    chat.create(model=MODEL, messages=history, tools=TOOLS, seed=1)
    (call,) = endpoint.recorder.calls('ep-s')
  text = tok.decode(call.prompt_ids, stop_at_eos=False)
  assert text.startswith('<|im_start|> system')  # the tools' description
  assert ('<|im_start|> assistant <tool_call> {"name": "calculate", "arguments": '
          '{"expression": "12*34"}} </tool_call> <|im_end|>') in text
  assert '<|im_start|> user <tool_response> 408 </tool_response> <|im_end|>' in text


def test_auth_models_and_errors(endpoint):
  with pytest.raises(openai.AuthenticationError, match='Incorrect or missing API key'):
    client(endpoint, api_key='wrong').models.list()
  assert [m.id for m in client(endpoint).models.list()] == [MODEL]
  chat = client(endpoint, 'ep-5').chat.completions
  with pytest.raises(openai.NotFoundError, match='model `gpt-4o` does not exist'):
    chat.create(model='gpt-4o', messages=QUESTION)
  long = [{'role': 'user', 'content': ' '.join(['What'] * 40)}]
  with pytest.raises(openai.BadRequestError, match='maximum prompt length is 32 tokens; the '
                     'prompt has 45 tokens'):
    chat.create(model=MODEL, messages=long)
  for extra, match in [({'n': 2}, 'n=2 is not supported'),
                       ({'logit_bias': {'3': 5}}, 'logit_bias='),
                       ({'logprobs': True, 'top_logprobs': 2}, 'top_logprobs=2'),
                       ({'max_tokens': 13}, r'must be an int in \[1, 12\]'),
                       ({'temperature': -1}, 'temperature=-1'),
                       ({'stop': ['What is']}, "stop='What is'"),
                       ({'tool_choice': 'required', 'tools': TOOLS}, 'cannot force'),
                       ({'response_format': {'type': 'json_object'}}, 'response_format=')]:
    with pytest.raises(openai.BadRequestError, match=match):
      chat.create(model=MODEL, messages=QUESTION, **extra)
  with pytest.raises(openai.BadRequestError, match=r'messages\[0\]\.tool_calls: must be a list'):
    chat.create(model=MODEL, messages=[{'role': 'assistant', 'content': '',
                                        'tool_calls': 5}])
  with pytest.raises(openai.BadRequestError, match=r'seed=.* must be an int'):
    chat.create(model=MODEL, messages=QUESTION, seed=2**70)
  assert post_reward(endpoint, 'nobody', reward=1).status_code == 404
  assert endpoint.stats['unknown_model'] == 1 and endpoint.stats['prompt_too_long'] == 1
  assert endpoint.recorder.stats['calls'] == 0


def test_streaming_answers_in_openai_chunks(endpoint):
  chat = client(endpoint, 'ep-9')
  stream = chat.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, seed=1,
                                        stream=True, stream_options={'include_usage': True})
  chunks = list(stream)
  (call,) = chunks[0].choices[0].delta.tool_calls
  assert call.function.name == 'calculate' and call.index == 0
  assert chunks[1].choices[0].finish_reason == 'tool_calls'
  assert chunks[2].usage.completion_tokens == 8
  text = ''.join(c.choices[0].text for c in chat.completions.create(
      model=MODEL, prompt='What is', seed=1, max_tokens=3, stream=True) if c.choices)
  assert len(endpoint.recorder.calls('ep-9')) == 2
  assert text == endpoint.tokenizer.decode(endpoint.recorder.calls('ep-9')[1].completion_ids)


def test_a_reward_fn_closes_an_episode_and_its_errors_are_counted(worker):
  rewards = iter([0.25, RuntimeError('boom')])

  def reward_fn(episode_id, calls):
    value = next(rewards)
    if isinstance(value, Exception):
      raise value
    return value * len(calls)

  with Endpoint(worker, model_name=MODEL, reward_fn=reward_fn) as endpoint:
    chat = client(endpoint).completions
    for episode in ('ep-6', 'ep-7'):
      chat.create(model=MODEL, prompt='What is', max_tokens=1, user=episode)
      response = httpx.post(f'{endpoint.base_url}/episodes/{episode}/reward', json={})
      assert response.status_code == 200, response.text
    assert [e.reward for e in endpoint.recorder.take()] == [0.25, 0.0]
    assert endpoint.recorder.stats['reward_errors'] == 1


def test_a_disconnected_client_frees_its_slot_and_others_go_on(endpoint, worker):
  seen = threading.Event()

  def before_step(step):  # hold the first decode step until the server saw the disconnect
    del step
    if not seen.is_set():
      deadline = time.monotonic() + 10
      while not endpoint.stats['disconnects'] and time.monotonic() < deadline:
        time.sleep(0.01)
      seen.set()

  worker.driver.before_step = before_step
  with pytest.raises(openai.APITimeoutError):
    client(endpoint, 'gone', timeout=0.5).chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, seed=1)
  assert seen.wait(10)
  reply = client(endpoint, 'ep-8').chat.completions.create(model=MODEL, messages=QUESTION,
                                                           tools=TOOLS, seed=1)
  assert reply.choices[0].finish_reason == 'tool_calls'
  assert endpoint.stats['disconnects'] == 1
  assert endpoint.scheduler.stats['cancelled'] == 1
  # The call the client gave up is not recorded; the other episode's is.
  with pytest.raises(KeyError):
    endpoint.recorder.calls('gone')
  assert len(endpoint.recorder.calls('ep-8')) == 1


def test_a_failed_batch_fails_only_its_requests(endpoint, worker, monkeypatch):
  run = worker.driver.run
  failures = iter([RuntimeError('device lost')])

  def flaky(*args, **kwargs):
    failure = next(failures, None)
    if failure is not None:
      raise failure
    return run(*args, **kwargs)

  monkeypatch.setattr(worker.driver, 'run', flaky)
  chat = client(endpoint, 'ep-10').chat.completions
  with pytest.raises(openai.InternalServerError, match='generation failed: RuntimeError: '
                     'device lost'):
    chat.create(model=MODEL, messages=QUESTION, tools=TOOLS, seed=1)
  assert chat.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                     seed=1).choices[0].finish_reason == 'tool_calls'
  assert endpoint.scheduler.stats['batch_errors'] == 1
  assert len(endpoint.recorder.calls('ep-10')) == 1


def test_concurrent_episodes_run_together_and_draw_what_they_draw_alone(endpoint, sampled):
  chat = client(endpoint).chat.completions
  ask = lambda i: chat.create(model=MODEL, messages=QUESTION, tools=TOOLS, seed=10 + i,
                              user=f'c{i}', max_tokens=12, logprobs=True)
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    together = list(pool.map(ask, range(4)))
  alone = [ask(i) for i in range(4)]
  for a, b in zip(together, alone):
    assert [t.logprob for t in a.choices[0].logprobs.content] == pytest.approx(
        [t.logprob for t in b.choices[0].logprobs.content], abs=1e-5)
  assert all(len(endpoint.recorder.calls(f'c{i}')) == 2 for i in range(4))


def test_the_scheduler_refuses_more_than_max_waiting(worker):
  release = threading.Event()
  worker.driver.before_step = lambda step: release.wait(10)
  scheduler = Scheduler(worker, max_waiting=1)
  try:
    key = np.asarray(jax.random.key_data(jax.random.key(0)))
    prompt = demonstrations(worker.tokenizer)[0][0]
    submit = lambda: scheduler.submit(prompt, SamplingSpec(), 4, [worker.tokenizer.eos_id],
                                      key)
    running = submit()
    deadline = time.monotonic() + 10
    while scheduler.stats['batches'] == 0 and time.monotonic() < deadline:
      time.sleep(0.01)
    waiting = submit()
    with pytest.raises(Busy, match='max_waiting=1'):
      submit()
    release.set()
    assert running.future.result(10).tokens and waiting.future.result(10).tokens
    assert scheduler.stats['busy'] == 1
  finally:
    release.set()
    worker.driver.before_step = None
    scheduler.stop()


def test_stitch_extends_where_prompts_match_and_splits_where_they_do_not():
  call = lambda prompt, sampled, reason='stop': Call(
      tuple(prompt), tuple(sampled), tuple(-0.5 * (i + 1) for i in range(len(sampled))),
      (9,) * len(sampled), (3,) * len(sampled), reason, f'text{len(prompt)}')
  calls = [call([1, 2], [7, 8]), call([1, 2, 7, 8, 4], [9]), call([1, 5], [6], 'length'),
           call([1, 5, 6], [])]
  one, two = stitch(calls, episode_id=4, group_id=2, reward=1.5,
                    turn_rewards=[0.0, 1.0, 2.0, 3.0])
  assert one.tokens.tolist() == [1, 2, 7, 8, 4, 9]
  assert one.loss_mask.tolist() == [False, False, True, True, False, True]
  assert one.behaviour_logprobs.tolist() == [0, 0, -0.5, -1.0, 0, -0.5]
  assert one.support_sizes.tolist() == [0, 0, 9, 9, 0, 9]
  assert one.versions.tolist() == [-1, -1, 3, 3, -1, 3]
  assert one.token_turn.tolist() == [-1, -1, 0, 0, -1, 1]
  assert one.turn_starts.tolist() == [2, 5] and one.turn_ends.tolist() == [4, 6]
  assert one.turn_rewards.tolist() == [0.0, 1.0] and two.turn_rewards.tolist() == [2.0, 3.0]
  assert one.texts == ('text2', 'text5') and one.turn_mask.all()
  assert (one.episode_id, one.group_id, one.prompt_id, one.episode_return) == (4, 2, -1, 1.5)
  assert two.tokens.tolist() == [1, 5, 6]
  assert two.turn_starts.tolist() == [2, 3] and two.turn_ends.tolist() == [3, 3]
  # A turn's state is the ids before it: equal histories, equal states.
  assert one.state_ids[0] == stitch([call([1, 2], [5])])[0].state_ids[0]
  assert len({*one.state_ids.tolist(), *two.state_ids.tolist()}) == 4
  assert stitch([]) == []
  recorder = EpisodeRecorder()
  recorder.record('e', calls[0])
  with pytest.raises(ValueError, match='no reward_fn'):
    recorder.close('e')
  with pytest.raises(ValueError, match='1 calls but 2 turn_rewards'):
    recorder.close('e', 1.0, [1.0, 2.0])
  assert recorder.close('e', 1.0).trajectories[0].episode_return == 1.0
  with pytest.raises(ValueError, match='2 completion ids but 1 log-probs'):
    Call((1,), (2, 3), (0.0,), (1, 1), (0, 0), 'stop')


def test_messages_the_template_refuses_are_a_400_naming_messages():
  """Well-formed messages that the checkpoint's template itself raises on (a template that
  wants the user first) are a 400 on ``messages`` with the template's reason."""
  strict = ("{%- if messages[0].role != 'user' %}{{- raise_exception('the user speaks "
            "first') }}{%- endif %}" + TEMPLATE)
  tok = HFTokenizer(make_tokenizer().backend, eos_token='<|im_end|>', pad_token='<pad>',
                    unk_token='[UNK]', chat_template=strict)
  stats = collections.Counter()
  ids, _ = chat_prompts.chat_prompt(tok, 'qwen', QUESTION, None, None, stats)
  assert ids == tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
  with pytest.raises(ApiError, match='cannot be rendered by the chat template: .*the user '
                     'speaks first') as raised:
    chat_prompts.chat_prompt(tok, 'qwen', [{'role': 'system', 'content': 'hi'}] + QUESTION,
                             None, None, stats)
  assert (raised.value.status, raised.value.param) == (400, 'messages')
  assert not stats  # nothing spliced: no episode state
