"""``python -m rlax_llm.serve``: a config's policy served, its closed episodes written."""

import json
import logging
import queue
import threading

import httpx
import pytest

openai = pytest.importorskip('openai')

from smoke_config import smoke_config  # tests/smoke_config.py
from step_checkpoint import write_step_checkpoint  # tests/step_checkpoint.py

from rlax_llm import console
from rlax_llm.serve import __main__ as serve_main


def test_serve_answers_and_writes_the_closed_episodes(tmp_path):
  config = smoke_config(rollout__slots=2)
  path = tmp_path / 'episodes.jsonl'
  stop, urls = threading.Event(), queue.Queue()
  thread = threading.Thread(target=serve_main.serve, args=(config,), kwargs={
      'port': 0, 'api_key': 'k', 'episodes': str(path), 'stop': stop, 'started': urls.put})
  thread.start()
  try:
    url = urls.get(timeout=60)
    client = openai.OpenAI(base_url=url, api_key='k', max_retries=0)
    assert [m.id for m in client.models.list()] == ['tiny']
    reply = client.completions.create(model='tiny', prompt='1+2=', max_tokens=3, user='e1',
                                      seed=0)
    assert reply.usage.prompt_tokens == 5  # bos and 4 characters
    response = httpx.post(f'{url}/episodes/e1/reward', json={'reward': 1.0},
                          headers={'Authorization': 'Bearer k'})
    assert response.status_code == 200, response.text
  finally:
    stop.set()
    thread.join(60)
  (record,) = [json.loads(line) for line in path.read_text().splitlines()]
  assert record['name'] == 'e1' and record['episode_return'] == 1.0
  assert len(record['tokens']) == 5 + reply.usage.completion_tokens
  assert sum(record['loss_mask']) == reply.usage.completion_tokens
  assert record['versions'][5:] == [0] * reply.usage.completion_tokens


def test_an_api_key_variable_that_is_not_set_is_an_error(monkeypatch, capsys):
  monkeypatch.delenv('RLAX_TEST_KEY', raising=False)
  with pytest.raises(SystemExit, match='--api_key_env=RLAX_TEST_KEY names an environment'):
    serve_main.main(['serve', '--api_key_env=RLAX_TEST_KEY'])


def test_help_documents_every_flag_with_its_help_string(capsys):
  serve_main.main(['serve', '--help'])
  out = ' '.join(capsys.readouterr().out.split())
  assert out.startswith('usage: python -m rlax_llm.serve')
  values = serve_main.flags.FlagValues()
  for name in serve_main._define_flags(values):  # pylint: disable=protected-access
    assert values[name].help and f' --{name}: {values[name].help}' in out, name
  assert '--model_name: The model name clients ask for' in out
  assert '--port: Port to listen on (0: a free one; the base_url line says which). (default: ' \
         '8000)' in out


def test_a_checkpoint_is_served_as_its_step_and_version_under_model_name(tmp_path, caplog,
                                                                        monkeypatch):
  """--checkpoint of a step-5 checkpoint (params version 4: one update was skipped): the
  first log line names the step and version, X-Params-Version and the recorded tokens carry
  the version, and --model_name is what /v1/models lists."""
  config = smoke_config(rollout__slots=2)
  write_step_checkpoint(tmp_path, config, step=5, version=4)
  what, version = serve_main.serving_what(str(tmp_path))
  assert what == f'serving step 5 (params version 4) of {tmp_path}/checkpoints/steps/5'
  assert version == 4 and serve_main.serving_what(None)[1] == 0
  called = {}
  with monkeypatch.context() as patch:
    patch.setattr(serve_main, 'serve', lambda config, **kwargs: called.update(kwargs))
    with caplog.at_level(logging.INFO, logger=console.PHASE_LOGGER):
      serve_main.main(['serve', f'--checkpoint={tmp_path}', '--model_name=mine'])
  phases = [r.getMessage() for r in caplog.records if r.name == console.PHASE_LOGGER]
  assert phases == [what, f'serving with the run\'s own config, {tmp_path}/config.json']
  assert called['model_name'] == 'mine' and called['checkpoint'] == str(tmp_path)
  stop, urls = threading.Event(), queue.Queue()
  thread = threading.Thread(target=serve_main.serve, args=(config,), kwargs={
      'checkpoint': str(tmp_path), 'port': 0, 'model_name': 'mine', 'stop': stop,
      'started': urls.put})
  thread.start()
  try:
    url = urls.get(timeout=60)
    assert httpx.get(f'{url}/models').json()['data'][0]['id'] == 'mine'
    response = httpx.post(f'{url}/completions', json={
        'model': 'mine', 'prompt': '1+2=', 'max_tokens': 2, 'seed': 0,
        'logprobs': 0}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers['x-params-version'] == '4'
  finally:
    stop.set()
    thread.join(60)


def test_a_network_host_without_a_token_is_refused_before_the_model_loads(monkeypatch):
  loaded = []
  monkeypatch.setattr(serve_main.evaluate, 'policy_worker', lambda *a, **k: loaded.append(a))
  with pytest.raises(SystemExit) as raised:
    serve_main.main(['serve', '--host=0.0.0.0'])
  message = str(raised.value)
  assert message == ('error: --host=0.0.0.0 is not a loopback address and no token is set, so '
                     'anyone on the network could use the model: set a token '
                     '(--api_key_env=NAME; Endpoint(api_key=...)), or, on a trusted network, '
                     'pass --allow_unauthenticated_network '
                     '(Endpoint(allow_unauthenticated_network=True)).')
  assert not loaded
  with pytest.raises(SystemExit, match='--max_request_mib=0.0 must be > 0'):
    serve_main.main(['serve', '--max_request_mib=0'])


def test_a_trusted_network_flag_serves_without_a_token(monkeypatch):
  """--allow_unauthenticated_network: the endpoint is built on 0.0.0.0 with no token, with
  the --max_request_mib cap."""
  built = {}

  class Stop(Exception):
    pass

  def endpoint(worker, **kwargs):
    built.update(kwargs)
    raise Stop

  monkeypatch.setattr(serve_main.evaluate, 'policy_worker', lambda *a, **k: (None, None, None))
  monkeypatch.setattr('rlax_llm.serve.openai_api.Endpoint', endpoint)
  with pytest.raises(Stop):
    serve_main.main(['serve', '--host=0.0.0.0', '--allow_unauthenticated_network',
                     '--max_request_mib=0.5'])
  assert built['host'] == '0.0.0.0' and built['api_key'] is None
  assert built['allow_unauthenticated_network'] and built['max_request_bytes'] == 2**19
