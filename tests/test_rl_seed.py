"""``rl.seed``: the RL batches' sampling keys apart from ``config.seed`` (model init, warm-up,
prompt stream, held-out split and evaluation), so that RL runs of one warm-up measure the RL
phase's own noise (benchmarks/staleness_study.py --rl_seeds). Unset it changes nothing; its
key is the controller state's and a resume keeps it.

Tiny shapes: the smoke config without its warm-up, 2 RL steps; the runs are shared."""

import pathlib

import jax
import numpy as np
import pytest

from rlax_llm.backends.local import build_run
from rlax_llm.cli import load_config_file
from rlax_llm.config import ConfigError, run_spec
from rlax_llm.controller import ControllerState
from rlax_llm.metrics import read_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = 2


def _config(rl_seed=None, steps=STEPS):
  config = load_config_file(str(ROOT / 'configs/default.py') + ':smoke')
  config.total_steps = steps
  config.warmup.steps = 0  # init params alone: what differs between runs is only the keys
  config.log.tensorboard = False
  config.rl.seed = rl_seed
  return config


def _strip(rows):
  return [{k: v for k, v in r.items() if not k.startswith(('time/', 'sync/'))} for r in rows]


def _run(config, workdir):
  """Runs ``config`` in ``workdir``; returns its stripped metrics rows, summary, controller
  state, first sampling roots and the trainer's params and optimizer state at the end."""
  with build_run(config, workdir, run_spec(config)) as run:
    summary = run.execute()
    ctl = run.controller
    sampling_root = ctl._sampling_root  # pylint: disable=protected-access
    roots = [np.asarray(jax.random.key_data(sampling_root(i))) for i in range(2)]
    state = ControllerState.from_dict(ctl.state().to_dict())  # a JSON round trip
    params = ctl.trainer.host_params().result()
    opt_state = jax.device_get(ctl.trainer.trainer.opt_state)
  return dict(rows=_strip(read_metrics(workdir / 'metrics.jsonl')), summary=summary,
              state=state, roots=roots, params=params, opt_state=opt_state)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """The same run with rl.seed unset, equal to config.seed (0) and 1."""
  return {name: _run(_config(rl_seed), tmp_path_factory.mktemp(f'rl_{name}'))
          for name, rl_seed in (('unset', None), ('same', 0), ('other', 1))}


def test_unset_keeps_the_config_seed_keys(runs):
  """rl.seed unset: batch ``i`` samples with ``fold_in(fold_in(key(config.seed), i), 0)``,
  the keys before rl.seed existed, and the state stores ``key(config.seed)``."""
  root = jax.random.key(0)
  for i, got in enumerate(runs['unset']['roots']):
    want = jax.random.key_data(jax.random.fold_in(jax.random.fold_in(root, i), 0))
    np.testing.assert_array_equal(got, np.asarray(want))
  np.testing.assert_array_equal(runs['unset']['state'].rng, np.asarray(jax.random.key_data(root)))


def test_rl_seed_equal_to_config_seed_is_the_unset_run(runs):
  assert runs['same']['rows'] == runs['unset']['rows']
  np.testing.assert_array_equal(runs['same']['state'].rng, runs['unset']['state'].rng)
  jax.tree.map(np.testing.assert_array_equal, runs['same']['params'], runs['unset']['params'])


def test_another_rl_seed_samples_differently_from_the_same_start(runs):
  """Same init params, prompts and held-out evaluation (config.seed's); other samples. (Not
  other params: the untrained model's rewards are all 0, so no update moves them.)"""
  unset, other = runs['unset'], runs['other']
  assert other['summary']['eval/start_accuracy'] == unset['summary']['eval/start_accuracy']
  assert other['state'].data == unset['state'].data  # the prompt stream: config.seed's
  assert not np.array_equal(other['state'].rng, unset['state'].rng)
  assert not np.array_equal(other['roots'][0], unset['roots'][0])
  # Different samples: the per-step figures of the sampled tokens differ.
  assert [r['entropy'] for r in other['rows']] != [r['entropy'] for r in unset['rows']]


def _load(ctl, state, source):
  """Loads ``source``'s params and optimizer state into ``ctl``'s (fresh) trainer."""
  trainer = ctl.trainer.trainer
  ctl.trainer.load(jax.device_put(source['params'], trainer.param_shardings),
                   jax.device_put(source['opt_state']),
                   {'version': state.trainer_version, 'nonfinite_streak': 0})


def test_resume_with_rl_seed_equals_the_uninterrupted_run(runs, tmp_path):
  """1 step with rl.seed=1, then a fresh run restored from its state runs step 2 exactly as
  the uninterrupted 2-step run; a resume under another rl.seed is refused."""
  first = _run(_config(1, steps=1), tmp_path / 'first')
  state = first['state']
  config = _config(1)
  with build_run(config, tmp_path / 'second', run_spec(config)) as run:
    _load(run.controller, state, first)
    run.controller.restore(state)
    run.execute()
  resumed = _strip(read_metrics(tmp_path / 'second' / 'metrics.jsonl'))
  assert [r['step'] for r in resumed] == [2]
  assert resumed == runs['other']['rows'][1:]

  config = _config(2)
  with build_run(config, tmp_path / 'refused', run_spec(config)) as run:
    _load(run.controller, state, first)
    with pytest.raises(ValueError, match=r"this run's rl.seed=2 \(config.seed=0\)"):
      run.controller.restore(state)


@pytest.mark.parametrize('value', [-1, True])
def test_config_refuses_an_invalid_rl_seed(value):
  config = _config()
  config.rl.seed = value
  with pytest.raises(ConfigError, match=rf'config.rl.seed={value!r} must be None'):
    run_spec(config)
