"""Controller: deterministic given the seed; its state saves and restores exactly; verifier
errors never crash a step."""

import json
import pathlib
import threading
import traceback

import jax
import ml_collections
import numpy as np
import pytest

from rlax_llm import controller as controller_lib
from rlax_llm.backends.local import build_run
from rlax_llm.cli import load_config_file
from rlax_llm.config import run_spec
from rlax_llm.metrics import read_metrics
from rlax_llm.tasks import ArithmeticTask, Prompt
from rlax_llm.controller import ControllerState
from rlax_llm.errors import NonFiniteError
from rlax_llm import checkpoint
from rlax_llm.checkpoint import Checkpointer
from rlax_llm.data_types import Rollouts
from rlax_llm.paramserver import ParameterServer
from rlax_llm.trainer.trainer import Trainer
from rlax_llm.verifiers import as_reward, score_completions

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONTROLLER = pathlib.Path(controller_lib.__file__).parent  # the package's modules


def _smoke_config(steps=2, warmup=True):
  """The smoke config for ``steps`` RL steps. ``warmup=False``: without its warm-up, for runs
  whose rewards do not need a competent model (a test task's, e.g. _CoinTask, or a
  length-dependent shaping): the warm-up's 80 steps and its train step's compile are
  skipped."""
  config = load_config_file(str(ROOT / 'configs/default.py') + ':smoke')
  config.total_steps = steps
  if not warmup:
    config.warmup.steps = 0
  config.log.tensorboard = False
  return config


def _run(workdir, steps=3):
  """Runs the smoke config for ``steps`` steps in ``workdir``. Returns its summary, metrics
  rows, the controller's state, and the versions and ``embed`` params that
  ``test_versions_and_server_advance`` checks, read while the run is open, and the
  controller (closed: for what needs no running roles)."""
  config = _smoke_config(steps)
  with build_run(config, workdir, run_spec(config)) as run:
    summary = run.execute()
    ctl = run.controller
    server = ctl.trainer.server
    versions = dict(trainer=ctl.trainer.version, server=server.latest_version(),
                    worker=ctl.workers[0].worker.version)
    embed = dict(server=np.asarray(server.get(versions['server']).params['embed']),
                 trainer=np.asarray(ctl.trainer.trainer.params['embed']))
    state = ctl.state()
  return dict(summary=summary, rows=read_metrics(workdir / 'metrics.jsonl'), state=state,
              versions=versions, embed=embed, controller=ctl)


@pytest.fixture(scope='module')
def smoke_run(tmp_path_factory):
  """The smoke config run for 3 steps once for the module: the tests that check an
  unchanged config's run (its determinism, its versions, the refusal of a state of another
  version) share it."""
  return _run(tmp_path_factory.mktemp('smoke_run'))


def test_same_seed_same_run(smoke_run, tmp_path):
  """Replaying a run from the same seed selects identical prompts and samples."""
  again = _run(tmp_path)
  strip = lambda r: {k: v for k, v in r.items() if not k.startswith('time/')}
  assert [strip(r) for r in smoke_run['rows']] == [strip(r) for r in again['rows']]
  state1, state2 = smoke_run['state'], again['state']
  assert state1.data == state2.data == {'next_index': 3 * 4}  # prompts consumed
  assert state1.step == 3 and state1.trainer_version == 3 and state1.worker_version == 3
  np.testing.assert_array_equal(state1.rng, state2.rng)
  assert (smoke_run['summary']['eval/final_accuracy']
          == again['summary']['eval/final_accuracy'])


@pytest.mark.parametrize('invariant,rows', [(True, 'chunks'), (True, 'floor'),
                                             (False, 'chunks')])
def test_batch_invariant_run_trains_exactly_on_policy(tmp_path, invariant, rows):
  """With model.batch_invariant (either invariant_rows) the trainer's log-probs of a
  synchronous run's rollouts equal the workers' bit for bit: every importance ratio is
  exactly 1. The default numerics (the control) differ by rounding. No warm-up: what is
  checked needs no competence, and _CoinTask's rewards give every step a gradient (the
  params move between steps)."""
  config = _smoke_config(steps=3, warmup=False)
  config.model.batch_invariant = invariant
  config.model.invariant_rows = rows
  if rows == 'floor':
    config.mesh.trainer.data = 1  # it needs every row of a matmul on one device
  with build_run(config, tmp_path, run_spec(config)) as run:
    run.controller.kind.task = _CoinTask(num_eval=16)
    run.execute()
  rows = read_metrics(tmp_path / 'metrics.jsonl')
  assert len(rows) == 3
  assert all(row['grad_norm'] > 0 and not row['update/skipped'] for row in rows), rows
  gaps = [row['mismatch/max_abs_dlogp'] for row in rows]
  if invariant:
    assert gaps == [0.0] * 3
    assert all(row['is/ratio_min'] == row['is/ratio_max'] == 1.0 for row in rows)
  else:
    assert 0.0 < max(gaps) < 1e-5, gaps


def test_versions_and_server_advance(smoke_run):
  """After 3 steps the trainer, the server and the worker are at version 3, and the server's
  version 3 holds the trainer's params."""
  # The trainer pushed every version; the worker evaluated the final pushed one.
  assert smoke_run['versions'] == dict(trainer=3, server=3, worker=3)
  np.testing.assert_array_equal(smoke_run['embed']['server'], smoke_run['embed']['trainer'])


class ArgsSpy:
  """A worker handle that records the arguments of every ``generate`` call."""

  def __init__(self, handle, seen):
    self._handle, self._seen = handle, seen

  def __getattr__(self, name):
    return getattr(self._handle, name)

  def generate(self, *args):
    self._seen.append(args)
    return self._handle.generate(*args)


def test_no_parameter_bytes_pass_through_the_controller(tmp_path, monkeypatch):
  """The controller moves version numbers, never weights. While an asynchronous run with two
  workers trains and checkpoints, every call that reads or moves params (the trainer's
  ``host_params``, the server's ``push``/``update``/``get``, the checkpointer's
  ``save``) is made on the trainer's or a worker's own thread with no controller frame on the
  stack; the controller's ``generate`` calls carry a version number (an int) and the sampling
  key as their only array; its ``save`` calls carry its own state and rollouts, no
  weights; and the controller holds no parameter server and no checkpointer."""
  config = _smoke_config(steps=4)
  config.staleness.j, config.staleness.k = 1, 2
  config.rollout.workers = 2
  config.checkpoint.every_steps, config.checkpoint.every_seconds = 2, 0.0
  calls, generate_args = [], []

  def from_controller():  # a frame of the controller package's modules on the stack
    return CONTROLLER in {pathlib.Path(frame.filename).parent
                          for frame in traceback.extract_stack()}

  def spy(name, method):
    def wrapped(*args, **kwargs):
      calls.append((name, threading.current_thread().name, from_controller()))
      return method(*args, **kwargs)
    return wrapped

  save_args = []
  with build_run(config, tmp_path, run_spec(config)) as run:
    ctl = run.controller
    assert not any(isinstance(v, ParameterServer | Checkpointer) for v in vars(ctl).values())
    for name in ('push', 'update', 'get'):
      monkeypatch.setattr(ParameterServer, name, spy(name, getattr(ParameterServer, name)))
    monkeypatch.setattr(Trainer, 'host_params', spy('host_params', Trainer.host_params))
    monkeypatch.setattr(Checkpointer, 'save', spy('checkpoint', Checkpointer.save))
    ctl.workers = [ArgsSpy(w, generate_args) for w in ctl.workers]
    trainer_save = ctl.trainer.save
    # The controller asks for saves: the check above sees its frames (it is not vacuous).
    ctl.trainer.save = lambda *args: (save_args.append((*args, from_controller()))
                                      or trainer_save(*args))
    run.execute()
    server = ctl.trainer.server
  rows = read_metrics(tmp_path / 'metrics.jsonl')
  assert rows[-1]['version'] == 4 and server.versions()[-1] == 4
  by_name = {}
  for name, thread, from_controller in calls:
    assert not from_controller, (name, thread)
    by_name.setdefault(name, set()).add(thread.split('_')[0])
  # The trainer pushed versions 1..4 from its thread (its own arrays, shard by shard: no
  # host_params gather at all); the workers pulled from theirs.
  assert sum(name == 'push' for name, _, _ in calls) == 4
  assert by_name == {'push': {'trainer'}, 'update': {'inference'}, 'checkpoint': {'trainer'}}
  assert sum(name == 'update' for name, _, _ in calls) == rows[-1]['sync/updates'] > 4
  # Checkpoints after steps 2 and 4, written by the trainer's thread; the controller handed
  # over its step, its JSON state and the rollouts' arrays (the batch in flight: k = 2).
  assert [step for step, *_ in save_args] == [2, 4] and checkpoint.latest_step(tmp_path) == 4
  assert all(asked for *_, asked in save_args)
  for _, state, rollouts, _ in save_args:
    assert set(state) == set(ControllerState.__dataclass_fields__)
    assert json.loads(json.dumps(state)) == state
    assert set(rollouts) == {f'inflight_{n}' for n in range(len(state['inflight']))}
    for arrays in rollouts.values():
      assert set(arrays) <= set(Rollouts.__dataclass_fields__)
  for requests, rng_data, version, *_ in generate_args:
    assert type(version) is int and rng_data.shape == (2,) and rng_data.dtype == np.uint32
    assert all(r.resume is None for r in requests)  # no arrays ride in the requests either


def test_rejects_j_above_k(tmp_path):
  config = _smoke_config()
  config.staleness.j = 2
  with pytest.raises(ValueError, match=r'staleness \(j, k\) = \(2, 1\): j must be <= k'):
    with build_run(config, tmp_path, run_spec(config)):
      pass


@pytest.mark.parametrize('replay', [pytest.param(0.0, marks=pytest.mark.slow), 0.5])  # 0.5 covers it
def test_state_restores_the_run_exactly(tmp_path, replay):
  """Run 3 steps; in another process-like fresh build, restore the state (and params) after
  step 1 and run on: steps 2-3 are identical to the uninterrupted run (timings aside, and the
  weight-transport figures: a fresh worker receives the whole model, not a delta). With
  ``rollout.replay`` the replay pool is part of the state (rewards by _CoinTask, so that
  groups have unequal rewards and the pool fills)."""
  strip = lambda r: {k: v for k, v in r.items() if not k.startswith(('time/', 'sync/'))}
  full_config = _smoke_config(steps=3)
  full_config.rollout.replay = replay
  with build_run(full_config, tmp_path / 'full', run_spec(full_config)) as run:
    if replay:
      run.controller.kind.task = _CoinTask(num_eval=16)
    run.execute()
  full = read_metrics(tmp_path / 'full' / 'metrics.jsonl')

  config = _smoke_config(steps=1)
  config.rollout.replay = replay
  with build_run(config, tmp_path / 'first', run_spec(config)) as run:
    if replay:
      run.controller.kind.task = _CoinTask(num_eval=16)
    run.execute()
    state = ControllerState.from_dict(run.controller.state().to_dict())  # a JSON round trip
    params = run.controller.trainer.host_params().result()
    opt_state = jax.device_get(run.controller.trainer.trainer.opt_state)
  assert state.step == 1 and state.data == {'next_index': 4}
  assert bool(state.replay) == bool(replay)  # the pool is saved (and used: see below)
  if replay:
    assert sum(r['rollout/replayed_groups'] for r in full[1:]) > 0
  config.total_steps = 3
  with build_run(config, tmp_path / 'second', run_spec(config)) as run:
    ctl = run.controller
    if replay:
      ctl.kind.task = _CoinTask(num_eval=16)
    trainer = ctl.trainer.trainer
    ctl.trainer.load(jax.device_put(params, trainer.param_shardings),
                     jax.device_put(opt_state),
                     {'version': state.trainer_version, 'nonfinite_streak': 0})
    ctl.restore(state)
    run.execute()
  resumed = read_metrics(tmp_path / 'second' / 'metrics.jsonl')
  assert [r['step'] for r in resumed] == [2, 3]
  assert [strip(r) for r in resumed] == [strip(r) for r in full[1:]]


class _CoinTask(ArithmeticTask):
  """Rewards by completion-length parity: advantages are never all 0."""

  def score(self, prompt, completion):
    return float(len(completion) % 2)


def test_a_diverging_rl_run_stops_naming_the_step(tmp_path):
  config = _smoke_config(steps=20, warmup=False)  # rewards by _CoinTask
  config.rl.learning_rate = 1e10
  with build_run(config, tmp_path, run_spec(config)) as run:
    run.controller.kind.task = _CoinTask(num_eval=16)
    with pytest.raises(NonFiniteError, match=r'RL step \d+: 3 consecutive updates were '
                                             r'non-finite'):
      run.execute()
  rows = read_metrics(tmp_path / 'metrics.jsonl')
  assert any(r['update/skipped'] for r in rows) and len(rows) < 20


class _SparseTask(ArithmeticTask):
  """Only prompts with id divisible by 3 can give a group unequal rewards."""

  def score(self, prompt, completion):
    return float(len(completion) % 2) if prompt.prompt_id % 3 == 0 else 0.0


def test_dynamic_sampling_pads_short_batches_to_one_shape(tmp_path):
  """With few informative groups, updates are topped up with filtered groups: every update
  has prompts_per_step groups (one compiled shape), and every group is counted once."""
  config = _smoke_config(steps=6, warmup=False)  # rewards by _SparseTask
  config.rollout.oversample = 0.5  # 6 prompts per batch for 4 trained groups
  with build_run(config, tmp_path, run_spec(config)) as run:
    run.controller.kind.task = _SparseTask(num_eval=16)
    run.execute()
  rows = read_metrics(tmp_path / 'metrics.jsonl')
  updates = [r for r in rows if r['rollout/trained_groups']]
  assert updates and sum(r['rollout/padding_groups'] for r in rows) > 0
  assert all(r['rollout/trained_groups'] + r['rollout/padding_groups'] == 4 for r in updates)
  assert all(r['rollout/padding_groups'] == 0 for r in rows if not r['rollout/trained_groups'])
  counted = sum(r['rollout/trained_groups'] + r['rollout/padding_groups']
                + r['rollout/filtered_groups'] + r['rollout/dropped_stale_groups'] for r in rows)
  assert counted + rows[-1]['rollout/recycled_groups'] == 6 * len(rows)


def test_replay_reasks_prompts_whose_groups_had_unequal_rewards(tmp_path):
  """``rollout.replay``: a share of each batch re-asks prompts whose last group had unequal
  rewards (only ids divisible by 3 can, under _SparseTask), ahead of new stream prompts; the
  ledger keeps them apart, so the stream's prompts stay consecutive."""
  config = _smoke_config(steps=6, warmup=False)  # rewards by _SparseTask
  config.rollout.replay = 0.5  # at most 2 of the 4 prompts per batch
  with build_run(config, tmp_path, run_spec(config)) as run:
    run.controller.kind.task = _SparseTask(num_eval=16)
    run.execute()
    pool = list(run.controller.kind.replay)
  rows = read_metrics(tmp_path / 'metrics.jsonl')
  ledger = [json.loads(line) for line in (tmp_path / 'ledger.jsonl').read_text().splitlines()]
  seen, stream = set(), []
  for row, entry in zip(rows, ledger):
    replayed = entry.get('replayed_prompt_ids', [])
    assert row['rollout/replayed_groups'] == len(replayed) <= 2
    assert all(i % 3 == 0 and i in seen for i in replayed), (replayed, seen)
    assert len(replayed) + len(entry['prompt_ids']) == 4
    seen.update(entry['prompt_ids'] + replayed)
    stream += entry['prompt_ids']
  assert sum(row['rollout/replayed_groups'] for row in rows) > 0
  assert stream == sorted(stream) and len(set(stream)) == len(stream)
  assert all(p.prompt_id % 3 == 0 for p in pool)
  assert rows[-1]['rollout/replay_pool'] == len(pool)


def test_restore_refuses_a_state_of_another_version(smoke_run):
  state = ControllerState.from_dict(smoke_run['state'].to_dict())  # a copy: the run is shared
  state.trainer_version = 7
  with pytest.raises(ValueError, match='holds version 3 but the controller state expects 7'):
    smoke_run['controller'].restore(state)


class _FlakyTask(ArithmeticTask):
  """Scores named completions with odd values; 'boom' raises."""

  ODD = {'nan': float('nan'), 'big': 1e300, 'text': '1', 'none': None, 'np': np.float64(1.0),
         'bool': True}

  def score(self, prompt, completion):
    if completion == 'boom':
      raise RuntimeError('verifier crashed')
    if completion in self.ODD:
      return self.ODD[completion]
    return super().score(prompt, completion)


def test_verifier_errors_give_zero_reward_and_are_counted():
  task = _FlakyTask(num_eval=4)
  prompt = Prompt(prompt_id=0, text='1+2=', answer='3')
  completions = ['3', 'boom', 'nan', '4', 'big', 'text', 'none', 'np', 'bool']
  rewards, errors = score_completions(task, [prompt] * len(completions), completions)
  np.testing.assert_array_equal(rewards, [1.0, 0, 0, 0, 0, 0, 0, 1.0, 1.0])
  assert rewards.dtype == np.float32 and np.all(np.isfinite(rewards))
  assert errors == 5  # boom, nan, 1e300 (inf in float32), a string, None


@pytest.mark.parametrize('value, expected', [
    (1, 1.0), (0.5, 0.5), (np.float16(2), 2.0), (False, 0.0), (3.4e38, 3.4e38),
    (1e39, None), (-1e300, None), (float('inf'), None), (float('nan'), None), ('1', None),
    (None, None), (1j, None), (np.array(1.0), None), ([1.0], None)])
def test_as_reward(value, expected):
  got = as_reward(value)
  assert got == (None if expected is None else pytest.approx(expected, rel=1e-6))


def test_score_completions_alignment_error():
  with pytest.raises(ValueError, match='aligned'):
    score_completions(ArithmeticTask(num_eval=4), [], ['1'])


def test_shared_prefix_scoring_trains_like_full_scoring(tmp_path):
  """rl.shared_prefix through the whole loop: the controller's batches pass the layout check
  and each update equals the fully scored one to float rounding (2 steps, 2 micro-batches)."""
  rows = {}
  for shared in (False, True):
    config = _smoke_config(steps=2, warmup=False)  # rewards by length (below)
    config.rl.shared_prefix = shared
    config.rl.micro_batches = 2
    # A length-dependent reward: the smoke model is never right yet, this gives advantages.
    config.reward.overlong = ml_collections.ConfigDict(dict(weight=1.0, cache=4))
    with build_run(config, tmp_path / str(shared), run_spec(config)) as run:
      run.execute()
    rows[shared] = read_metrics(tmp_path / str(shared) / 'metrics.jsonl')
  assert len(rows[True]) == len(rows[False]) == 2
  for full, shared in zip(rows[False], rows[True]):
    assert full['reward/mean'] == shared['reward/mean']  # the same rollouts were trained
    for key in ('loss', 'grad_norm', 'entropy'):
      np.testing.assert_allclose(shared[key], full[key], rtol=1e-3, atol=1e-6, err_msg=key)
    assert full['grad_norm'] > 1e-3
