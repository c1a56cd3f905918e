"""``python -m rlax_llm.serve``: a config's policy served, its closed episodes written."""

import json
import queue
import threading

import httpx
import pytest

openai = pytest.importorskip('openai')

from smoke_config import smoke_config  # tests/smoke_config.py

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
  serve_main.main(['serve', '--help'])
  assert 'usage: python -m rlax_llm.serve' in capsys.readouterr().out
