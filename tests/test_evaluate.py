"""``python -m rlax_llm.evaluate``: the checkpoint reader, the config it evaluates with (a
run's own config.json), one-line errors, and the CLI end to end."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.checkpoint import Checkpointer, CheckpointError
from rlax_llm.evaluate import load_policy_params

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_policy_params_from_a_run_checkpoint_and_mismatch_errors(tmp_path):
  params = {'embed': jnp.arange(6, dtype=jnp.float32).reshape(2, 3),
            'layers': [{'w': jnp.ones((3,), jnp.bfloat16)}]}
  checkpointer = Checkpointer(tmp_path)
  checkpointer.save(4, params=params, opt_state={'count': jnp.zeros(())}, trainer={},
                    controller={}, rollouts={})
  checkpointer.save_warmup(jax.tree.map(jnp.zeros_like, params), {})
  checkpointer.close()
  template = jax.tree.map(jnp.zeros_like, params)
  steps = tmp_path / 'checkpoints' / 'steps'
  for path in (tmp_path, tmp_path / 'checkpoints', steps, steps / '4'):
    loaded = load_policy_params(path, template)
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 loaded, params)
    assert loaded['layers'][0]['w'].dtype == jnp.bfloat16
  warm = load_policy_params(tmp_path / 'checkpoints' / 'warmup', template)
  assert float(np.asarray(warm['embed']).sum()) == 0.0
  with pytest.raises(CheckpointError, match=r"embed: saved \(2, 3\) float32, this run "
                     r"\(3, 2\) float32"):
    load_policy_params(tmp_path, dict(template, embed=jnp.zeros((3, 2))))
  with pytest.raises(CheckpointError, match=r"missing in the checkpoint: head"):
    load_policy_params(tmp_path, dict(template, head=jnp.zeros(1)))
  with pytest.raises(CheckpointError, match='no checkpoint at'):
    load_policy_params(tmp_path / 'missing', template)


def test_cli_rejects_a_bad_config_value_in_seconds():
  result = subprocess.run(
      [sys.executable, '-m', 'rlax_llm.evaluate', '--config=configs/default.py:smoke',
       '--config.eval.samples=-2'],
      cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode != 0
  assert 'config.eval.samples=-2 must be an int >= 0' in result.stderr


def test_cli_help_prints_usage_and_configs_without_a_traceback():
  result = subprocess.run([sys.executable, '-m', 'rlax_llm.evaluate', '--help'], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith('usage: python -m rlax_llm.evaluate')
  assert '--checkpoint=PATH' in result.stdout and 'configs/smollm2.py' in result.stdout
  assert 'Traceback' not in result.stderr


@pytest.mark.parametrize('group, message', [
    (dict(bonus=dict(weight=1.0)), "config.reward.bonus: unknown kind 'bonus'"),
    (dict(format=dict(weight=1.0, pattern='(')), 'config.reward.format: reward format pattern'),
])
def test_reward_config_is_validated_before_compute(group, message):
  # pylint: disable=import-outside-toplevel
  import ml_collections

  from rlax_llm.cli import load_config_file
  from rlax_llm.config import validate_config
  from rlax_llm.errors import ConfigError
  config = load_config_file(str(ROOT / 'configs/default.py') + ':smoke')
  config.reward = ml_collections.ConfigDict(group)
  with pytest.raises(ConfigError, match=message):
    validate_config(config)


def _evaluate(*args, timeout=180):
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
  return subprocess.run([sys.executable, '-m', 'rlax_llm.evaluate', *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope='module')
def run_workdir(tmp_path_factory):
  """A run's workdir as a launch leaves it (config.json, a checkpoint) whose model differs
  from the default config's (mlp_dim 128, not 256): its params fit only its own config."""
  # pylint: disable=import-outside-toplevel
  from smoke_config import smoke_config  # tests/smoke_config.py

  from rlax_llm import roles
  workdir = tmp_path_factory.mktemp('run')
  config = smoke_config(name='own_config', model__tiny__mlp_dim=128, task__num_eval=4,
                        warmup__steps=0)
  (workdir / 'config.json').write_text(config.to_json_best_effort(indent=2, sort_keys=True))
  _, _, params, _ = roles.prepare(config)
  checkpointer = Checkpointer(workdir)
  checkpointer.save(1, params=params, opt_state={'count': jnp.zeros(())}, trainer={},
                    controller={}, rollouts={})
  checkpointer.close()
  return workdir


def test_a_checkpoint_without_config_is_evaluated_with_its_runs_own_config(run_workdir):
  """No --config: the run's config.json (model, task, sampling), overrides applied to it; a
  step directory finds the workdir above it."""
  result = _evaluate(f'--checkpoint={run_workdir / "checkpoints" / "steps" / "1"}',
                     '--config.eval.samples=2')
  assert result.returncode == 0, result.stderr[-3000:]
  record = json.loads(result.stdout.strip().splitlines()[-1])
  assert record['config'] == 'own_config'
  assert f"rlax_llm: evaluating with the run's own config, {run_workdir / 'config.json'}" in (
      result.stderr), result.stderr[-3000:]
  assert 0.0 <= record['eval/accuracy'] <= 1.0 and 'eval/pass@2' in record


def test_a_checkpoint_with_a_config_that_differs_from_its_run_is_refused(run_workdir):
  result = _evaluate('--config=configs/default.py:smoke', f'--checkpoint={run_workdir}')
  assert result.returncode == 1 and result.stdout == '', result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  assert ('differs from the config the checkpoint\'s run trained with' in errors[0]
          and 'model.tiny.mlp_dim: 128 -> 256' in errors[0]
          and 'drop --config to evaluate with the run\'s own config' in errors[0]), errors[0]
