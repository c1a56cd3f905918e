"""A gs:// path that cannot be used fails in seconds with one line naming the fix
(``rlax_llm.storage.check_bucket``): no credentials, a bucket that does not exist, no
permission, GCS not reachable. Against the local emulator (tests/gcs_emulator.py) and, for
what an emulator cannot refuse, google-auth and requests stubbed with their real exception
types; never the real GCS."""

import os
import subprocess
import sys
import time
import types

import google.auth
import google.auth.exceptions
import pytest
import requests

import gcs_emulator  # tests/gcs_emulator.py
from one_device import ROOT, one_device_env
from rlax_llm import evaluate, storage
from rlax_llm.errors import WorkdirError

BUCKET = 'access-bucket'
LOGIN = 'gcloud auth application-default login'


@pytest.fixture(scope='module')
def emulator():
  with gcs_emulator.running(BUCKET) as url:
    yield url


@pytest.fixture
def real_gcs(monkeypatch):
  """This process pointed at GCS itself (no emulator), its checks forgotten afterwards."""
  for key in gcs_emulator.ENV_KEYS:
    monkeypatch.delenv(key, raising=False)
  monkeypatch.setattr(storage, '_CHECKED', set())


class _Credentials:
  token = 'ya29.test'

  def refresh(self, request):
    del request


def _answer(status: int, message: str = '') -> types.SimpleNamespace:
  body = {'error': {'code': status, 'message': message}}
  return types.SimpleNamespace(status_code=status, json=lambda: body, text=str(body))


def test_a_bucket_that_exists_is_checked_once(emulator, monkeypatch):
  del emulator
  storage.check_bucket(f'gs://{BUCKET}/runs/a')
  monkeypatch.setattr(requests, 'get', lambda *a, **k: pytest.fail('asked twice'))
  assert str(storage.path(f'gs://{BUCKET}/runs/b')) == f'gs://{BUCKET}/runs/b'


def test_a_bucket_that_does_not_exist_is_named_with_the_command_that_creates_it(emulator):
  del emulator
  start = time.perf_counter()
  with pytest.raises(WorkdirError) as e:
    storage.path('gs://no-such-bucket/runs/a')
  assert time.perf_counter() - start < storage.BUCKET_CHECK_TIMEOUT_S
  assert str(e.value) == ("gs://no-such-bucket/runs/a: the bucket 'no-such-bucket' does not "
                          'exist; create it (`gcloud storage buckets create gs://no-such-bucket '
                          "--location=REGION`, in the TPU's region) or fix the name.")


def test_no_credentials_names_the_login_command_at_once(real_gcs, monkeypatch):
  del real_gcs

  def no_credentials(*args, **kwargs):
    raise google.auth.exceptions.DefaultCredentialsError('Your default credentials were not '
                                                         'found.')
  monkeypatch.setattr(google.auth, 'default', no_credentials)
  monkeypatch.setattr(requests, 'get', lambda *a, **k: pytest.fail('GCS was asked'))
  start = time.perf_counter()
  with pytest.raises(WorkdirError) as e:
    storage.path('gs://my-bucket/runs/a')
  assert time.perf_counter() - start < 1.0
  assert str(e.value).startswith('gs://my-bucket/runs/a: this machine has no Google '
                                 f'credentials for GCS; run `{LOGIN}`')
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('status, message, says', [
    (403, 'me@example.com does not have storage.objects.list access to the Google Cloud '
     'Storage bucket.', "GCS refused access to bucket 'my-bucket' (HTTP 403: me@example.com"),
    (401, 'Invalid Credentials', "GCS refused the credentials to bucket 'my-bucket' (HTTP 401"),
])
def test_no_permission_names_the_bucket_and_the_role(real_gcs, monkeypatch, status, message,
                                                     says):
  del real_gcs
  monkeypatch.setattr(google.auth, 'default', lambda *a, **k: (_Credentials(), 'p'))
  asked = []

  def get(url, headers, params, timeout):
    asked.append((url, headers['Authorization'], params['prefix'], timeout))
    return _answer(status, message)
  monkeypatch.setattr(requests, 'get', get)
  with pytest.raises(WorkdirError) as e:
    storage.path('gs://my-bucket/runs/a')
  assert asked == [(f'{storage.GCS_API}/storage/v1/b/my-bucket/o', 'Bearer ya29.test', 'runs/a',
                    storage.BUCKET_CHECK_TIMEOUT_S)]
  assert says in str(e.value)
  assert 'roles/storage.objectUser on gs://my-bucket' in str(e.value) and LOGIN in str(e.value)


def test_gcs_out_of_reach_is_one_line_not_a_minute_of_retries(real_gcs, monkeypatch):
  del real_gcs
  monkeypatch.setattr(google.auth, 'default', lambda *a, **k: (_Credentials(), 'p'))

  def unreachable(*args, **kwargs):
    raise requests.ConnectionError('Name or service not known')
  monkeypatch.setattr(requests, 'get', unreachable)
  with pytest.raises(WorkdirError, match=r'^gs://my-bucket/runs/a: GCS \(https://storage'
                     r'.googleapis.com\) could not be reached \(ConnectionError\); check the '
                     r'network.$'):
    storage.path('gs://my-bucket/runs/a')


def test_evaluate_and_serve_reach_the_check_through_the_run_workdir(emulator):
  """``evaluate`` and ``serve`` find a --checkpoint's run through ``evaluate.config_for`` ->
  ``run_workdir`` (a storage path): the same one line, inside their ``one_line_errors``."""
  del emulator
  with pytest.raises(WorkdirError, match=r"^gs://gone-bucket/runs/a: the bucket 'gone-bucket' "
                     'does not exist'):
    evaluate.config_for([], 'gs://gone-bucket/runs/a')


def test_launch_on_a_missing_bucket_prints_one_error_line(emulator, tmp_path):
  """The launch (workdir_claim's gs:// claim came first, and gcsfs's retries) ends in one
  ``error:`` line naming the bucket, and no traceback."""
  env = dict(one_device_env(), **dict.fromkeys(gcs_emulator.ENV_KEYS, emulator))
  start = time.perf_counter()
  result = subprocess.run([sys.executable, '-m', 'rlax_llm.launch',
                           '--config=configs/default.py:smoke',
                           '--workdir=gs://missing-bucket/runs/a'], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
  elapsed = time.perf_counter() - start
  assert result.returncode == 1, result.stderr[-2000:]
  assert result.stderr.splitlines() == [
      "error: gs://missing-bucket/runs/a: the bucket 'missing-bucket' does not exist; create "
      'it (`gcloud storage buckets create gs://missing-bucket --location=REGION`, in the TPU\'s '
      'region) or fix the name.'], result.stderr[-3000:]
  assert elapsed < 60, elapsed  # the process's start-up and imports; the check itself: ms
  assert not os.listdir(tmp_path)
