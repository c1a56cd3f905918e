"""The endpoint refuses what it cannot serve before any compute: malformed fields are a 400 in
OpenAI's shape naming the field, an oversized body a 413 (from its Content-Length before it is
sent, else counted as it streams in), and a host other machines reach without a token is
refused unless the network is declared trusted. Driven by the official ``openai`` client and
raw httpx / sockets."""

import logging
import socket

import httpx
import jax
import pytest

openai = pytest.importorskip('openai')
pytest.importorskip('fastapi')

from rlax_llm.envs.seeds import CHARSET
from rlax_llm.errors import ConfigError
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.serve.chat_prompts import canonical, template_message
from rlax_llm.serve.http_server import is_loopback
from rlax_llm.serve.openai_api import Endpoint
from rlax_llm.serve.openai_requests import check_request
from rlax_llm.sharding import make_mesh
from rlax_llm.tokenization import CharTokenizer

MODEL = 'tiny'
CAP = 64 * 1024  # the endpoint's body cap in these tests
TOOL = {'type': 'function', 'function': {'name': 'calculate', 'parameters': {
    'type': 'object', 'properties': {'expression': {'type': 'string'}}}}}
USER = {'role': 'user', 'content': '1+2='}


@pytest.fixture(scope='module')
def worker():
  """A worker over a random 1-layer decoder: nothing here is sampled, so nothing compiles."""
  tok = CharTokenizer(CHARSET)
  config = DecoderConfig(vocab_size=tok.vocab_size, num_layers=1, embed_dim=16, num_heads=2,
                         num_kv_heads=1, head_dim=8, mlp_dim=32, max_seq_len=64)
  model, params = create_model(config, seed=0)
  worker = InferenceWorker(model, tok, make_mesh({'data': 1}, jax.devices()[:1]),
                           max_prompt_len=40, max_new_tokens=6, slots=2)
  worker.load(0, params)
  return worker


@pytest.fixture
def endpoint(worker, monkeypatch):
  """The endpoint; a request that reaches the engine fails the test."""

  def run(*args, **kwargs):
    raise AssertionError('a refused request reached the engine')

  monkeypatch.setattr(worker.driver, 'run', run)
  with Endpoint(worker, model_name=MODEL, max_request_bytes=CAP) as endpoint:
    yield endpoint
  assert endpoint.scheduler.stats['batches'] == 0
  assert endpoint.recorder.stats['calls'] == 0


def post(endpoint, body, route='chat/completions', **kwargs):
  return httpx.post(f'{endpoint.base_url}/{route}', json=body, timeout=30, **kwargs)


def openai_client(endpoint):
  return openai.OpenAI(base_url=endpoint.base_url, api_key='none', max_retries=0)


MALFORMED = [
    # (the request's fields beside model, the param named)
    ({'messages': [USER, {'role': 'assistant', 'content': '3'}, {'role': 'robot',
                                                                 'content': 'hi'}]},
     'messages[2].role'),
    ({'messages': 'hi'}, 'messages'),
    ({'messages': []}, 'messages'),
    ({'messages': [USER, 'hi']}, 'messages[1]'),
    ({'messages': [{'role': 'user', 'content': 5}]}, 'messages[0].content'),
    ({'messages': [{'role': 'user'}]}, 'messages[0].content'),
    ({'messages': [{'role': 'user', 'content': [{'type': 'image_url', 'image_url': {
        'url': 'http://x/y.png'}}]}]}, 'messages[0].content[0].type'),
    ({'messages': [{'role': 'user', 'content': [{'type': 'text', 'text': 3}]}]},
     'messages[0].content[0].text'),
    ({'messages': [USER, {'role': 'assistant', 'tool_calls': 5}]}, 'messages[1].tool_calls'),
    ({'messages': [USER, {'role': 'assistant', 'tool_calls': [{'id': 'c', 'type': 'function'}]}]},
     'messages[1].tool_calls[0].function'),
    ({'messages': [USER, {'role': 'assistant', 'tool_calls': [
        {'id': 'c', 'type': 'function', 'function': {'arguments': '{}'}}]}]},
     'messages[1].tool_calls[0].function.name'),
    ({'messages': [USER, {'role': 'user', 'content': 'x', 'tool_calls': []}]},
     'messages[1].tool_calls'),
    ({'messages': [USER, {'role': 'tool', 'content': '3'}]}, 'messages[1].tool_call_id'),
    ({'messages': [USER], 'tools': [{'type': 'function'}]}, 'tools[0].function'),
    ({'messages': [USER], 'tools': {'type': 'function'}}, 'tools'),
    ({'messages': [USER], 'tools': [{'type': 'retrieval', 'function': {'name': 'f'}}]},
     'tools[0].type'),
    ({'messages': [USER], 'tools': [{'type': 'function', 'function': {'name': 'a b'}}]},
     'tools[0].function.name'),
    ({'messages': [USER], 'tools': [TOOL, TOOL]}, 'tools[1].function.name'),
    ({'messages': [USER], 'tools': [{'type': 'function', 'function': {
        'name': 'f', 'parameters': 'object'}}]}, 'tools[0].function.parameters'),
    ({'messages': [USER], 'tools': [TOOL], 'tool_choice': {
        'type': 'function', 'function': {'name': 'search'}}}, 'tool_choice.function.name'),
    ({'messages': [USER], 'tool_choice': 'required'}, 'tool_choice'),
    ({'messages': [USER], 'tools': [TOOL], 'tool_choice': 'sometimes'}, 'tool_choice'),
    ({'messages': [USER], 'stop': 5}, 'stop'),
    ({'messages': [USER], 'user': {'id': 1}}, 'user'),
    ({'messages': [USER], 'stream': 'yes'}, 'stream'),
    ({'messages': [USER], 'temperature': 'hot'}, 'temperature'),
    ({'messages': [USER], 'top_p': 2.0}, 'top_p'),
    ({'messages': [USER], 'top_k': 1.5}, 'top_k'),
]


@pytest.mark.parametrize('fields, param', MALFORMED, ids=[p for _, p in MALFORMED])
def test_a_malformed_chat_field_is_a_400_naming_it(endpoint, fields, param):
  response = post(endpoint, {'model': MODEL, **fields})
  assert response.status_code == 400, response.text
  error = response.json()['error']
  assert error['param'] == param and error['type'] == 'invalid_request_error', error
  assert error['message'].startswith(param), error['message']


@pytest.mark.parametrize('fields, param', [({'reward': 'high'}, 'reward'),
                                           ({'reward': True}, 'reward'),
                                           ({'turn_rewards': [1, 'x']}, 'turn_rewards'),
                                           ({'group_id': 1.5}, 'group_id'),
                                           ({'prompt_id': '3'}, 'prompt_id')])
def test_a_malformed_reward_field_is_a_400_naming_it(endpoint, fields, param):
  response = post(endpoint, fields, route='episodes/e/reward')
  assert response.status_code == 400, response.text
  assert response.json()['error']['param'] == param
  assert post(endpoint, {'reward': 1}, route='episodes/e/reward').status_code == 404


def test_the_openai_client_gets_its_own_error_naming_the_field(endpoint):
  chat = openai_client(endpoint).chat.completions
  with pytest.raises(openai.BadRequestError, match=r"messages\[1\]\.role: 'robot' is not a "
                     'role') as raised:
    chat.create(model=MODEL, messages=[USER, {'role': 'robot', 'content': 'beep'}])
  assert raised.value.status_code == 400 and raised.value.param == 'messages[1].role'
  with pytest.raises(openai.BadRequestError, match=r'tools\[0\]\.function: must be an '
                     'object') as raised:
    chat.create(model=MODEL, messages=[USER], tools=[{'type': 'function'}])
  assert raised.value.param == 'tools[0].function'
  with pytest.raises(openai.BadRequestError, match="'search' is not among the request's "
                     "tools") as raised:
    chat.create(model=MODEL, messages=[USER], tools=[TOOL],
                tool_choice={'type': 'function', 'function': {'name': 'search'}})
  assert raised.value.param == 'tool_choice.function.name'
  with pytest.raises(openai.BadRequestError, match='cannot force a call of'):
    chat.create(model=MODEL, messages=[USER], tools=[TOOL],
                tool_choice={'type': 'function', 'function': {'name': 'calculate'}})
  with pytest.raises(openai.BadRequestError, match='user: must be a string'):
    openai_client(endpoint).completions.create(model=MODEL, prompt='1+2=',
                                               extra_body={'user': 7})


def test_a_body_over_the_cap_is_a_413_before_it_is_sent(endpoint):
  """The Content-Length alone is refused: the server answers with no byte of the body sent."""
  host, port = endpoint.host, endpoint.port
  with socket.create_connection((host, port), timeout=10) as sock:
    sock.sendall(f'POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: '
                 f'application/json\r\nContent-Length: {30 * 2**20}\r\n\r\n'.encode())
    received = b''
    while chunk := sock.recv(65536):  # until the server closes the connection
      received += chunk
  answer = received.decode()
  assert answer.startswith('HTTP/1.1 413'), answer
  assert 'connection: close' in answer.lower()
  assert '"code":"request_too_large"' in answer and f'at most {CAP} bytes' in answer


def test_a_chunked_body_is_counted_as_it_streams_and_cut_at_the_cap(endpoint):
  chunk, total = b' ' * CAP, 1600  # 100 MiB offered, without a Content-Length
  sent = []

  def body():
    for i in range(total):
      sent.append(i)
      yield chunk

  response = httpx.post(f'{endpoint.base_url}/chat/completions', content=body(), timeout=30,
                        headers={'Content-Type': 'application/json'})
  assert response.status_code == 413, response.text
  assert response.json()['error']['code'] == 'request_too_large'
  # The server stopped reading past the cap; what the client wrote beyond it sits in the
  # sockets' buffers (a few MiB: 4 chunks on one machine, 50 on another, whose kernel grows
  # the buffers more), far from the whole 100 MiB.
  assert len(sent) < total // 10, len(sent)


def test_the_openai_client_gets_a_413_for_a_30_mb_message(endpoint):
  with pytest.raises(openai.APIStatusError, match=f'at most {CAP} bytes') as raised:
    openai_client(endpoint).chat.completions.create(
        model=MODEL, messages=[{'role': 'user', 'content': 'x' * (30 * 2**20)}])
  assert raised.value.status_code == 413 and raised.value.code == 'request_too_large'


def test_a_body_under_the_cap_is_read_and_judged_on_its_content(endpoint):
  big = {'role': 'user', 'content': '1' * (CAP - 200)}
  response = post(endpoint, {'model': MODEL, 'messages': [big]})
  assert response.status_code == 400, response.text
  assert response.json()['error']['code'] == 'context_length_exceeded'
  reward = post(endpoint, {'reward': 1.0, 'pad': 'x' * CAP}, route='episodes/e/reward')
  assert reward.status_code == 413  # every route reads its body under the cap
  assert post(endpoint, [1, 2]).json()['error']['message'].startswith(
      'the request body must be a JSON object')


@pytest.mark.parametrize('host, loopback', [('127.0.0.1', True), ('localhost', True),
                                            ('::1', True), ('127.0.0.2', True),
                                            ('0.0.0.0', False), ('::', False),
                                            ('192.0.2.1', False),
                                            ('no-such-host.invalid', False)])
def test_is_loopback(host, loopback):
  assert is_loopback(host) is loopback


def test_a_network_host_without_a_token_is_refused_unless_declared_trusted(worker, caplog):
  with pytest.raises(ConfigError) as raised:
    Endpoint(worker, model_name=MODEL, host='0.0.0.0')
  message = str(raised.value)
  assert '\n' not in message
  assert message.startswith('--host=0.0.0.0 is not a loopback address and no token is set')
  assert '--api_key_env' in message and '--allow_unauthenticated_network' in message
  Endpoint(worker, model_name=MODEL, host='0.0.0.0', api_key='k').scheduler.stop()
  with caplog.at_level(logging.WARNING), Endpoint(
      worker, model_name=MODEL, host='0.0.0.0', allow_unauthenticated_network=True) as open_:
    assert httpx.get(f'http://127.0.0.1:{open_.port}/v1/models').json()['data'][0]['id'] == MODEL
  assert f'serving on 0.0.0.0:{open_.port} without a bearer token' in caplog.text
  with pytest.raises(ValueError, match='max_request_bytes=0 must be an int >= 1'):
    Endpoint(worker, model_name=MODEL, max_request_bytes=0)


def test_well_formed_requests_pass_the_checks():
  """What OpenAI clients send (and the calculator harness's history, model_dump'ed) passes;
  a developer message is rendered as a system one."""
  history = [
      {'role': 'developer', 'content': 'Be brief.'},
      {'role': 'user', 'content': [{'type': 'text', 'text': 'What is '},
                                   {'type': 'text', 'text': '12*34?'}], 'name': 'ann'},
      {'role': 'assistant', 'content': None, 'tool_calls': [
          {'id': 'c1', 'type': 'function', 'function': {
              'name': 'calculate', 'arguments': '{"expression": "12*34"}'}}]},
      {'role': 'tool', 'tool_call_id': 'c1', 'content': '408'},
      {'role': 'assistant', 'content': '408'},
      {'role': 'system', 'content': 'Again.'}]
  for extra in [{}, {'tools': [TOOL], 'tool_choice': 'auto'}, {'tools': [TOOL],
                                                              'tool_choice': 'none'},
                {'tools': [], 'stop': ['\n'], 'stream': True, 'user': 'e',
                 'stream_options': {'include_usage': True}, 'temperature': 0, 'top_k': 3,
                 'top_p': 0.5}]:
    check_request({'model': MODEL, 'messages': history, **extra}, chat=True)
  check_request({'model': MODEL, 'prompt': [1, 2], 'echo': False}, chat=False)
  assert template_message(history[0], 'qwen') == {'role': 'system', 'content': 'Be brief.'}
  assert template_message(history[1], 'qwen')['content'] == 'What is 12*34?'
  assert canonical(history[0], 'qwen') == canonical({'role': 'system',
                                                     'content': 'Be brief.'}, 'qwen')
