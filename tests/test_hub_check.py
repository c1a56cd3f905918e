"""rlax_llm.hub_check: a config's hub ids checked before a launch, offline said in one line.

The hub is a fake ``HfApi`` raising huggingface_hub's own error types (never the network);
"no network" is a closed port on loopback."""

import socket
import time
import types

import httpx2
import pytest
from huggingface_hub import constants, errors

from rlax_llm import hub_check
from rlax_llm.cli import load_config
from rlax_llm.config import validate_config
from rlax_llm.errors import ConfigError

GSM8K = 'configs/gsm8k.py:Qwen2.5-1.5B-Instruct'


def _error(kind: type, url: str = 'https://huggingface.co/api/models/x') -> Exception:
  status = 403 if kind is errors.GatedRepoError else 404
  return kind(f'{status} Client Error', response=httpx2.Response(
      status, request=httpx2.Request('GET', url)))


class FakeApi:
  """``HfApi``'s metadata calls over repositories held here: ``{repo_id: {revision: sha}}``
  (revision None: the default branch); records every call."""

  def __init__(self, models=None, datasets=None, gated=()):
    self.repos = {'model': models or {}, 'dataset': datasets or {}}
    self.gated = set(gated)
    self.calls = []

  def _info(self, kind, repo_id, revision=None, timeout=None):
    self.calls.append((kind, repo_id, revision, timeout))
    if repo_id in self.gated:
      raise _error(errors.GatedRepoError)
    revisions = self.repos[kind].get(repo_id)
    if revisions is None:
      raise _error(errors.RepositoryNotFoundError)
    if revision not in revisions:
      raise _error(errors.RevisionNotFoundError)
    return types.SimpleNamespace(id=repo_id, sha=revisions[revision])

  def model_info(self, repo_id, revision=None, timeout=None):
    return self._info('model', repo_id, revision, timeout)

  def dataset_info(self, repo_id, revision=None, timeout=None):
    return self._info('dataset', repo_id, revision, timeout)

  def list_models(self, author=None, limit=None):
    self.calls.append(('list_models', author, limit))
    return [types.SimpleNamespace(id=r) for r in self.repos['model'] if r.startswith(author + '/')]

  def list_datasets(self, author=None, limit=None):
    self.calls.append(('list_datasets', author, limit))
    return [types.SimpleNamespace(id=r) for r in self.repos['dataset']
            if r.startswith(author + '/')]


def _hub() -> FakeApi:
  return FakeApi(models={'Qwen/Qwen2.5-1.5B-Instruct': {None: 'a' * 40, 'v1': 'b' * 40},
                         'Qwen/Qwen2.5-0.5B-Instruct': {None: 'c' * 40}},
                 datasets={'openai/gsm8k': {None: 'd' * 40}})


@pytest.fixture(scope='module')
def gsm8k():
  return load_config([f'--config={GSM8K}'])


def test_the_hub_ids_of_a_config_are_the_model_and_the_dataset(gsm8k):
  assert [(i.key, i.kind, i.repo_id, i.revision) for i in hub_check.hub_ids(gsm8k)] == [
      ('config.model.path', 'model', 'Qwen/Qwen2.5-1.5B-Instruct', None),
      ('config.task.path', 'dataset', 'openai/gsm8k', None)]


def test_offline_nothing_is_asked_and_one_line_says_what_was_not_verified(gsm8k):
  api = _hub()
  online, lines = hub_check.verify(gsm8k, api, offline='no network')
  assert not online and api.calls == []
  assert lines == ['model and dataset ids not verified: no network (offline); the run fetches '
                   'Qwen/Qwen2.5-1.5B-Instruct, hf://datasets/openai/gsm8k when it starts and '
                   "reads the task's data then"]


def test_hf_hub_offline_is_honoured_without_a_connection(monkeypatch):
  monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)
  monkeypatch.setattr(socket, 'create_connection', lambda *a, **k: pytest.fail('connected'))
  assert hub_check.offline_reason() == 'HF_HUB_OFFLINE is set'


def test_no_network_is_found_in_one_short_connect(monkeypatch):
  with socket.socket() as s:  # a loopback port nothing listens on
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', False)
  monkeypatch.delenv('HF_HUB_OFFLINE', raising=False)
  monkeypatch.setattr(constants, 'ENDPOINT', f'http://127.0.0.1:{port}')
  for proxy in ('HTTP_PROXY', 'http_proxy', 'HTTPS_PROXY', 'https_proxy'):
    monkeypatch.delenv(proxy, raising=False)
  start = time.perf_counter()
  assert hub_check.offline_reason() == 'no network'
  assert time.perf_counter() - start < hub_check.CONNECT_TIMEOUT_S + 1


def test_behind_a_proxy_the_proxy_is_what_must_answer(monkeypatch):
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    s.listen()
    monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', False)
    monkeypatch.delenv('HF_HUB_OFFLINE', raising=False)
    monkeypatch.setattr(constants, 'ENDPOINT', 'https://hub.invalid')
    monkeypatch.setenv('HTTPS_PROXY', f'http://127.0.0.1:{s.getsockname()[1]}')
    monkeypatch.delenv('NO_PROXY', raising=False)
    monkeypatch.delenv('no_proxy', raising=False)
    assert hub_check.offline_reason() is None


def test_online_the_ids_are_checked_at_their_revision_without_downloading(gsm8k):
  api = _hub()
  online, lines = hub_check.verify(gsm8k, api, offline=None)
  assert online
  assert [c[:3] for c in api.calls] == [('model', 'Qwen/Qwen2.5-1.5B-Instruct', None),
                                        ('dataset', 'openai/gsm8k', None)]
  assert lines[0] == ("config.model.path='Qwen/Qwen2.5-1.5B-Instruct': the hub model exists at "
                      'its default branch (commit aaaaaaaaaaaa); nothing was downloaded.')
  config = load_config([f'--config={GSM8K}', '--config.model.revision=v1'])
  online, lines = hub_check.verify(config, api, offline=None)
  assert '(commit bbbbbbbbbbbb)' in lines[0]


def test_a_mistyped_model_id_is_refused_with_a_did_you_mean():
  config = load_config([f'--config={GSM8K}', '--config.model.path=Qwen/Qwen2.5-1.5B-Instruc'])
  with pytest.raises(ConfigError) as e:
    hub_check.verify(config, _hub(), offline=None)
  assert str(e.value) == ("config.model.path='Qwen/Qwen2.5-1.5B-Instruc': no such model on the "
                          "hub (did you mean 'Qwen/Qwen2.5-1.5B-Instruct'?); check the id (a "
                          'private one needs HF_TOKEN set to a token with access).')


def test_a_missing_revision_or_dataset_is_refused_and_a_gated_model_noted():
  config = load_config([f'--config={GSM8K}', '--config.model.revision=v9'])
  with pytest.raises(ConfigError, match=r"config.model.revision: the hub model "
                     r"Qwen/Qwen2.5-1.5B-Instruct has no revision 'v9'"):
    hub_check.verify(config, _hub(), offline=None)
  config = load_config([f'--config={GSM8K}', '--config.task.path=hf://datasets/openai/gsm9k'])
  with pytest.raises(ConfigError, match=r"config.task.path='hf://datasets/openai/gsm9k': no such "
                     r"dataset on the hub \(did you mean 'openai/gsm8k'\?\)"):
    hub_check.verify(config, _hub(), offline=None)
  api = _hub()
  api.gated.add('Qwen/Qwen2.5-1.5B-Instruct')
  _, lines = hub_check.verify(load_config([f'--config={GSM8K}']), api, offline=None)
  assert 'is on the hub and gated' in lines[0] and 'HF_TOKEN' in lines[0]


def test_a_hub_that_stops_answering_leaves_the_dataset_unread(gsm8k):
  """The probe connected but a request failed: noted, and validation then reads no dataset
  (it would retry the hub for 25 s)."""
  api = _hub()

  def down(repo_id, revision=None, timeout=None):
    raise errors.HfHubHTTPError('503 Server Error', response=httpx2.Response(
        503, request=httpx2.Request('GET', 'https://huggingface.co/api/datasets/x')))
  api.dataset_info = down
  online, lines = hub_check.verify(gsm8k, api, offline=None)
  assert not online
  assert lines[1] == ("config.task.path='hf://datasets/openai/gsm8k' not verified: the hub did "
                      'not answer (HfHubHTTPError); the run fetches it when it starts.')


def test_a_config_without_hub_ids_asks_nothing():
  config = load_config(['--config=configs/default.py:smoke'])
  assert hub_check.verify(config, FakeApi(), offline=False) == (True, [])


def test_without_the_hub_the_config_is_validated_without_reading_the_dataset(gsm8k, monkeypatch):
  """read_hub=False: the task's class and fields are checked, its dataset is not read (the
  dry run offline); a wrong field is still refused."""
  from rlax_llm.tasks import hub_datasets  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(hub_datasets, 'HubDataset',
                      lambda *a, **k: pytest.fail('the dataset was read'))
  validate_config(gsm8k, read_hub=False)
  config = load_config([f'--config={GSM8K}', '--config.task.path=hf://models/openai/gsm8k'])
  with pytest.raises(ConfigError, match='names a hub model, not a dataset'):
    validate_config(config, read_hub=False)
