"""``warmup.cache``: a run restores a finished warm-up of the same fingerprint and equals the run
that trained it; what the fingerprint hashes; an unreadable or racing entry."""

import os

import jax
import numpy as np
import pytest

from rlax_llm import checkpoint, roles, warmup_cache
from rlax_llm import sharding as sharding_lib
from rlax_llm.backends import local as local_backend
from rlax_llm.config import run_spec
from rlax_llm.metrics import read_metrics
from rlax_llm.run_config import check_resume_config

from smoke_config import smoke_config  # tests/smoke_config.py


def _run(config, workdir):
  with local_backend.build_run(config, workdir, run_spec(config)) as r:
    r.execute()
    params = r.controller.trainer.host_params().result()
  return read_metrics(workdir / 'metrics.jsonl'), params


@pytest.fixture
def warmups(monkeypatch):
  """The warm-ups the runs trained (each call's step count)."""
  trained = []
  train = roles.supervised_warmup

  def counting(*args, **kwargs):
    trained.append(kwargs['steps'])
    return train(*args, **kwargs)
  monkeypatch.setattr(roles, 'supervised_warmup', counting)
  return trained


def _strip_times(rows):
  return [{k: v for k, v in row.items() if not k.startswith(('time/', 'warmup/time_s'))}
          for row in rows]


def test_a_run_restores_the_cached_warmup_and_equals_the_run_that_trained_it(tmp_path, warmups):
  cache = tmp_path / 'cache'
  config = smoke_config(total_steps=1, eval__every_steps=0, log__tensorboard=False,
                        warmup__steps=8, warmup__cache=str(cache))
  rows, params = _run(config, tmp_path / 'a')
  assert warmups == [8]
  entries = os.listdir(cache)
  assert len(entries) == 1 and len(entries[0]) == 64, entries  # one finished entry, no staging
  # Another run of what comes after the warm-up (its RL steps, evaluation): restored, not trained.
  again_rows, again_params = _run(config, tmp_path / 'b')
  assert warmups == [8]
  assert _strip_times(again_rows) == _strip_times(rows)
  jax.tree.map(np.testing.assert_array_equal, again_params, params)
  # The run's own copy: its resume does not need the cache.
  assert (tmp_path / 'b' / 'checkpoints' / checkpoint.WARMUP_DIRNAME).is_dir()


def _mesh():
  return sharding_lib.make_mesh({'data': 1, 'fsdp': -1, 'tensor': 1})


@pytest.mark.parametrize('key, value', [
    ('rl__learning_rate', 1e-2), ('rl__loss', 'm2po'), ('total_steps', 9),
    ('eval__every_steps', 1),
    ('log__tensorboard', False), ('staleness__k', 3), ('rollout__slots', 7),
    ('checkpoint__every_steps', 5), ('warmup__cache', '/elsewhere'), ('name', 'other')])
def test_what_runs_after_the_warmup_keeps_its_fingerprint(key, value):
  mesh = _mesh()
  base = warmup_cache.fingerprint(smoke_config(), mesh)
  assert warmup_cache.fingerprint(smoke_config(**{key: value}), mesh) == base


@pytest.mark.parametrize('key, value', [
    ('warmup__learning_rate', 1e-3), ('warmup__steps', 81), ('warmup__batch_size', 8),
    ('seed', 1), ('task__max_operand', 8), ('model__tiny__num_layers', 1),
    ('model__dtype', 'bfloat16'), ('rl__max_nonfinite_updates', 5),
    ('sampling__max_new_tokens', 9)])
def test_what_the_warmup_reads_changes_its_fingerprint(key, value):
  mesh = _mesh()
  assert (warmup_cache.fingerprint(smoke_config(**{key: value}), mesh)
          != warmup_cache.fingerprint(smoke_config(), mesh))


def test_the_mesh_and_xla_flags_change_the_fingerprint(monkeypatch):
  config = smoke_config()
  base = warmup_cache.fingerprint(config, _mesh())
  assert warmup_cache.fingerprint(config, sharding_lib.make_mesh(
      {'data': 2, 'fsdp': -1, 'tensor': 1})) != base
  monkeypatch.setenv('XLA_FLAGS',
                     os.environ.get('XLA_FLAGS', '') + ' --xla_cpu_enable_fast_math=true')
  assert warmup_cache.fingerprint(config, _mesh()) != base


def _params():
  return {'w': jax.numpy.arange(6.0).reshape(2, 3)}


def test_an_existing_entry_is_kept_and_no_staging_is_left(tmp_path):
  warmup_cache.save(str(tmp_path), 'k', _params(), {'warmup/loss': 1.0})
  warmup_cache.save(str(tmp_path), 'k', {'w': jax.numpy.zeros((2, 3))}, {'warmup/loss': 2.0})
  assert os.listdir(tmp_path) == ['k']
  params, metrics = warmup_cache.restore(str(tmp_path), 'k', _params())
  np.testing.assert_array_equal(params['w'], np.arange(6.0).reshape(2, 3))
  assert metrics == {'warmup/loss': 1.0}
  assert warmup_cache.restore(str(tmp_path), 'missing', _params()) is None


def test_an_unreadable_entry_is_a_miss_with_a_warning(tmp_path, caplog):
  warmup_cache.save(str(tmp_path), 'k', _params(), {})
  for root, _, files in os.walk(tmp_path / 'k'):
    for name in files:
      if name != 'commit_success.txt':
        with open(os.path.join(root, name), 'wb') as f:
          f.write(b'garbage')
  with caplog.at_level('WARNING'):
    assert warmup_cache.restore(str(tmp_path), 'k', _params()) is None
  assert 'warm-up cache entry' in caplog.text and 'unreadable' in caplog.text


def test_a_run_may_resume_with_another_cache(tmp_path):
  saved = smoke_config(warmup__cache=str(tmp_path / 'one')).to_dict()
  check_resume_config(saved, smoke_config(warmup__cache=str(tmp_path / 'two')))


def test_the_default_config_reads_the_cache_from_the_environment(monkeypatch, tmp_path):
  monkeypatch.setenv('RLAX_LLM_WARMUP_CACHE', str(tmp_path))
  assert smoke_config().warmup.cache == str(tmp_path)
  monkeypatch.delenv('RLAX_LLM_WARMUP_CACHE')
  assert smoke_config().warmup.cache == ''
