"""Asynchronous parameter-server RL: the (j, k) schedule, deterministic asynchrony, several
workers on their own devices, worker failures, dynamic sampling and recycling, and the
free-running mode."""

import concurrent.futures
import json
import random
import time

import jax
import numpy as np
import pytest

from rlax_llm.backends import local as local_backend
from rlax_llm.config import run_spec
from rlax_llm.data_types import FollowLatest
from rlax_llm.schedule import sampling_version
from rlax_llm.metrics import read_metrics

from smoke_config import smoke_config  # tests/smoke_config.py


def smoke(steps=6, j=1, k=1, **overrides):
  return smoke_config(total_steps=steps, staleness__j=j, staleness__k=k,
                      log__tensorboard=False, eval__every_steps=3, **overrides)


def strip(rows, prefixes=('time/',)):
  return [{key: value for key, value in row.items() if not key.startswith(prefixes)}
          for row in rows]


# Metrics of how a run was carried out (timings, weight traffic, the worker pool), not of
# what it computed.
SETUP_METRICS = ('time/', 'sync/', 'workers/')


# Metrics decided by the samples' tokens (and the schedule), equal whatever the batching.
SAMPLED_METRICS = ('step', 'sampling_version', 'reward/', 'completion/', 'verifier/',
                   'rollout/', 'staleness/', 'eval/', 'update/')


def assert_same_samples(rows, ref_rows, params, ref_params, learning_rate):
  """The runs drew the same tokens at every step (every metric the samples decide is equal)
  and trained to the same params up to float rounding: a token's behaviour log-prob depends
  on the batch it was decoded in, and the trainer's sums on its mesh, by rounding only.
  (Adam moves a weight whose gradient is near 0 by up to ``learning_rate`` a step whatever
  its size, so a few weights may differ by that much.)"""
  rows, ref_rows = strip(rows, SETUP_METRICS), strip(ref_rows, SETUP_METRICS)
  assert [sorted(r) for r in rows] == [sorted(r) for r in ref_rows]
  for row, ref in zip(rows, ref_rows):
    assert {k: v for k, v in row.items() if k.startswith(SAMPLED_METRICS)} == {
        k: v for k, v in ref.items() if k.startswith(SAMPLED_METRICS)}
    for k, v in row.items():
      np.testing.assert_allclose(v, ref[k], rtol=1e-4, atol=1e-5, err_msg=k)
  diff = np.concatenate([np.abs(np.asarray(a) - np.asarray(b)).ravel()
                         for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params))])
  assert np.mean(diff > 1e-6) < 1e-3, np.mean(diff > 1e-6)
  assert diff.max() <= 2 * learning_rate * len(rows), diff.max()


def run(config, workdir, wrap=None):
  """Runs ``config``; ``wrap(controller)`` may replace role handles (e.g. inject delays)."""
  with local_backend.build_run(config, workdir, run_spec(config)) as r:
    if wrap is not None:
      wrap(r.controller)
    summary = r.execute()
    params = r.controller.trainer.host_params().result()
  return summary, read_metrics(workdir / 'metrics.jsonl'), params


class Delayed:
  """A role handle whose ``names`` calls sleep ``seconds()`` in the caller's thread first."""

  def __init__(self, handle, seconds, names=('generate', 'step')):
    self._handle, self._seconds, self._names = handle, seconds, names

  def __getattr__(self, name):
    attr = getattr(self._handle, name)
    if name not in self._names:
      return attr

    def call(*args, **kwargs):
      time.sleep(self._seconds())
      return attr(*args, **kwargs)
    return call


def delays(seed, max_s=0.05):
  def wrap(controller):
    rng = random.Random(seed)
    seconds = lambda: rng.uniform(0, max_s)  # a different timing every run
    controller.workers = [Delayed(w, seconds) for w in controller.workers]
    controller.trainer = Delayed(controller.trainer, seconds)
  return wrap


@pytest.fixture(scope='module')
def reference_1_1(tmp_path_factory):
  """The synchronous reference: (1, 1), every call inline, no threads."""
  return run(smoke(local__concurrent=False), tmp_path_factory.mktemp('sync'))


def test_the_smoke_run_updates_at_every_step(reference_1_1):
  """The runs these tests compare train for real: every RL step has a non-zero gradient and
  pushes weights that differ from the last version's (with all rewards equal, every check
  of params and versions here would hold for a run that never trained)."""
  _, rows, _ = reference_1_1
  assert len(rows) == 6
  assert all(r['grad_norm'] > 0 and r['update/skipped'] == 0 for r in rows), rows
  assert all(0 < r['reward/mean'] < 1 for r in rows), [r['reward/mean'] for r in rows]
  # sync/density: the fraction of the weights' bytes each pushed version changed.
  assert rows[-1]['sync/density'] > 0.5, rows[-1]


def test_lockstep_on_threads_reproduces_the_synchronous_run(reference_1_1, tmp_path):
  _, rows, params = run(smoke(), tmp_path)
  _, ref_rows, ref_params = reference_1_1
  assert strip(rows) == strip(ref_rows)
  jax.tree.map(np.testing.assert_array_equal, params, ref_params)
  assert all(r['staleness/max'] == 0 for r in rows)


@pytest.mark.parametrize('concurrent', [False, True])
def test_step_times_count_the_generation(tmp_path, concurrent):
  """``time/rollout_s`` and ``time/step_s`` include generating the batch: inline, the
  worker generates inside the launch, before the step trains (it used to read ~0 there)."""
  delay = 0.3

  def wrap(controller):
    controller.workers = [Delayed(w, lambda: delay, ('generate',))
                          for w in controller.workers]
  _, rows, _ = run(smoke(steps=2, local__concurrent=concurrent), tmp_path, wrap=wrap)
  assert len(rows) == 2
  for row in rows:
    assert row['time/rollout_s'] >= delay, row
    assert row['time/step_s'] >= row['time/rollout_s'] + row['time/train_s'], row


def test_async_run_is_deterministic_under_random_timings(tmp_path):
  """(4, 8): the same metrics and params whatever the role timings, and no trained token is
  k or more versions old."""
  config = smoke(steps=10, j=4, k=8)
  base = run(config, tmp_path / 'a')
  for seed in (1, 2):
    other = run(smoke(steps=10, j=4, k=8), tmp_path / f'd{seed}', wrap=delays(seed))
    assert strip(other[1]) == strip(base[1])
    jax.tree.map(np.testing.assert_array_equal, other[2], base[2])
  inline = run(smoke(steps=10, j=4, k=8, local__concurrent=False), tmp_path / 'inline')
  assert strip(inline[1]) == strip(base[1])
  rows = base[1]
  assert max(r['staleness/max'] for r in rows) <= 7
  assert [r['sampling_version'] for r in rows] == [sampling_version(i, 4, 8) for i in range(10)]
  # Staleness 4..7 once the pipeline is full.
  assert all(4 <= r['staleness/mean'] <= 7 for r in rows[8:])


def test_rollouts_are_trained_filtered_or_recycled(tmp_path):
  """Dynamic sampling: every generated group is trained, filtered (equal rewards) and counted,
  dropped as too stale and counted, or still recycled at the end."""
  config = smoke(steps=6, j=2, k=3, rollout__oversample=0.5)
  summary, rows, _ = run(config, tmp_path, wrap=delays(7, 0.02))
  per_batch = 6  # ceil(4 * 1.5)
  generated = per_batch * len(rows)
  trained = sum(r.get('rollout/trained_groups', 0) for r in rows)
  filtered = sum(r['rollout/filtered_groups'] for r in rows)
  padding = sum(r['rollout/padding_groups'] for r in rows)
  stale = sum(r['rollout/dropped_stale_groups'] for r in rows)
  recycled_at_end = rows[-1]['rollout/recycled_groups']
  assert trained + padding + filtered + stale + recycled_at_end == generated
  assert filtered > 0
  assert max(r['staleness/max'] for r in rows) <= 2
  again = run(smoke(steps=6, j=2, k=3, rollout__oversample=0.5), tmp_path / 'again')
  assert strip(again[1]) == strip(rows)


def accounted(rows, per_batch):
  """New groups (requested minus carried in) == every way a group leaves the pipeline."""
  new = sum(per_batch - r.get('rollout/carried_groups', 0) for r in rows)
  out = sum(r.get('rollout/trained_groups', 0) + r['rollout/filtered_groups']
            + r['rollout/padding_groups'] + r['rollout/dropped_stale_groups'] for r in rows)
  waiting = rows[-1]['rollout/recycled_groups'] + rows[-1].get('rollout/unfinished_groups', 0)
  return new, out + waiting


def april(**overrides):
  """8 groups of 4 per batch on 6 slots (groups straddle waves), stopped after 4."""
  fields = dict(steps=8, rollout__oversample=1.0, rollout__stop_after_groups=4,
                rollout__slots=6, task__num_eval=4)
  return smoke(**(fields | overrides))


def test_partial_rollouts_are_continued_deterministically(tmp_path):
  """APRIL: each batch stops once 4 of its 8 groups finished; the unfinished groups are
  continued in a later batch (or restarted when too stale), every group is accounted for,
  no trained token is k or more versions old, and random timings change nothing."""
  summary, rows, params = run(april(j=2, k=3), tmp_path, wrap=delays(3, 0.02))
  new, accounted_for = accounted(rows, per_batch=8)
  assert new == accounted_for
  carried = sum(r['rollout/carried_groups'] for r in rows)
  restarted = sum(r['rollout/restarted_groups'] for r in rows)
  assert carried - restarted > 0, 'no partial group was continued'
  assert max(r['staleness/max'] for r in rows) <= 2
  inline = run(april(j=2, k=3, local__concurrent=False), tmp_path / 'inline')
  assert strip(inline[1]) == strip(rows)
  jax.tree.map(np.testing.assert_array_equal, inline[2], params)


def test_partial_rollouts_on_policy_restart_what_saw_an_update(tmp_path):
  """k = 1: a carried group that saw an update cannot be trained with its old tokens, so it
  is regenerated from scratch; the run stays on-policy."""
  _, rows, _ = run(april(), tmp_path)
  new, accounted_for = accounted(rows, per_batch=8)
  assert new == accounted_for
  assert sum(r.get('rollout/trained_groups', 0) for r in rows) > 0
  assert sum(r['rollout/restarted_groups'] for r in rows) > 0
  assert all(r['staleness/max'] == 0 for r in rows)


def test_short_batches_wait_trains_only_full_informative_batches(tmp_path):
  """short_batches='wait': a batch with fewer than 4 informative groups skips its update and
  keeps them (still fresh on-policy: the version did not move); every update trains 4
  informative groups, none padding, and every group is accounted for."""
  _, rows, _ = run(april(rollout__stop_after_groups=0, rollout__short_batches='wait'),
                   tmp_path)
  new, accounted_for = accounted(rows, per_batch=8)
  assert new == accounted_for
  assert all(r['rollout/padding_groups'] == 0 for r in rows)
  assert {r['rollout/trained_groups'] for r in rows} == {0, 4}
  waited = [r for r in rows if r['rollout/trained_groups'] == 0]
  assert waited and all(r.get('update/skipped') == 1.0 for r in waited)
  assert all(r['staleness/max'] == 0 for r in rows)


def test_two_workers_on_disjoint_devices_match_one(reference_1_1, tmp_path):
  """8 devices: trainer on 4, two workers on 2 each; a sample's tokens depend only on its
  key, which depends on its place in the batch, not on the worker: the run draws the
  single-worker reference's tokens."""
  config = smoke(rollout__workers=2, rollout__slots=8, mesh__disjoint=True)
  config.mesh.trainer.data = 4
  config.mesh.inference.data = 2
  with local_backend.build_run(config, tmp_path, run_spec(config)) as r:
    trainer_devices = set(r.controller.trainer.trainer.mesh.devices.flat)
    worker_devices = [set(w.worker.mesh.devices.flat) for w in r.controller.workers]
    summary = r.execute()
    params = r.controller.trainer.host_params().result()
  assert len(trainer_devices) == 4 and [len(d) for d in worker_devices] == [2, 2]
  assert not trainer_devices & worker_devices[0] and not worker_devices[0] & worker_devices[1]
  rows = read_metrics(tmp_path / 'metrics.jsonl')
  _, ref_rows, ref_params = reference_1_1
  assert_same_samples(rows, ref_rows, params, ref_params, config.rl.learning_rate)


class InjectedFault(RuntimeError):
  """A failure a test injects into a worker handle."""


class Faulty:
  """A worker handle that fails from its ``call``-th ``generate`` call on: ``'die'`` (the
  call raises ``InjectedFault``) or ``'hang'`` (the call never answers)."""

  def __init__(self, handle, call, kind):
    self._handle, self._call, self._kind, self._calls = handle, call, kind, 0

  def __getattr__(self, name):
    return getattr(self._handle, name)

  def generate(self, *args, **kwargs):
    self._calls += 1
    if self._calls < self._call:
      return self._handle.generate(*args, **kwargs)
    future = concurrent.futures.Future()
    if self._kind == 'die':
      future.set_exception(InjectedFault(f'injected fault: worker die at call {self._calls}'))
    return future


@pytest.mark.parametrize('kind', ['die', pytest.param('hang', marks=pytest.mark.slow)])  # hang: 27 s
def test_a_lost_worker_is_replaced_and_the_run_completes(reference_1_1, tmp_path, kind):
  # The timeout covers the first calls' compilation on this machine, not a hang.
  config = smoke(rollout__workers=2, rollout__worker_timeout_s=20.0)

  def fault(controller):  # worker 1 fails at its third call
    controller.workers[1] = Faulty(controller.workers[1], 3, kind)
  summary, rows, params = run(config, tmp_path, wrap=fault)
  assert summary['workers/lost'] == 1
  assert 'inference worker 1 was lost during batch' in summary['events'][0]
  assert ('no answer within worker_timeout_s=20.0' if kind == 'hang'
          else 'InjectedFault') in summary['events'][0]
  # Re-issued requests carry the same keys and version: the reference's tokens, whichever
  # worker drew them.
  _, ref_rows, ref_params = reference_1_1
  assert_same_samples(rows, ref_rows, params, ref_params, config.rl.learning_rate)
  summary_json = json.loads((tmp_path / 'summary.json').read_text())
  assert summary_json['workers/lost'] == 1


def test_weight_update_accounting(tmp_path):
  """Each version a worker needs is sent once: whole the first time, then as a delta or
  whole leaves, never more than the whole model per update."""
  _, rows, params = run(smoke(steps=4), tmp_path)
  model_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
  last = rows[-1]
  # Versions 0..4 for rollouts and evaluations (evaluations reuse the version just pushed).
  assert last['sync/updates'] == 5
  assert model_bytes <= last['sync/bytes'] <= last['sync/updates'] * model_bytes
  assert 0 < last['sync/density'] <= 1


def free(steps=6, j=1, k=2, **overrides):
  """The smoke run in free-running mode (no checkpoints: it is refused there)."""
  config = smoke(steps=steps, j=j, k=k, staleness__schedule='free',
                 checkpoint__every_steps=0, checkpoint__every_seconds=0.0, **overrides)
  config.eval.every_steps = 0  # held-out evaluation at the start and the end only
  return config


def swaps_mid_generation(generated, wait_s=2.0):
  """A ``run`` wrap: each free-running ``generate_at`` waits, before its second decode step,
  until the server is ``j`` versions ahead of the worker (at most ``wait_s``; the trainer,
  training an earlier batch meanwhile, pushes them), so the worker's next refresh swaps a
  version in mid-sequence. The calls' rollouts are appended to ``generated``."""
  def wrap(controller):
    for handle in controller.workers:
      worker, server, call = handle.worker, handle.server, {}
      inner = worker.generate_at

      def generate_at(version, *args, inner=inner, worker=worker, call=call, **kwargs):
        call.update(free=isinstance(version, FollowLatest), start=worker.driver.steps,
                    j=getattr(version, 'j', 0))
        out = inner(version, *args, **kwargs)
        if call['free']:
          generated.append(out)
        return out

      def before_step(step, worker=worker, server=server, call=call):
        if call['free'] and step == call['start'] + 1:
          deadline = time.monotonic() + wait_s
          while (server.latest_version() - worker.version < call['j']
                 and time.monotonic() < deadline):
            time.sleep(0.005)

      worker.generate_at = generate_at
      worker.driver.before_step = before_step
  return wrap


def test_free_running_swaps_weights_mid_generation_within_the_bound(tmp_path):
  """staleness.schedule='free' at (j, k) = (1, 2): versions pushed while a batch is generated
  enter it between decode steps (one sequence's tokens carry two versions, each recorded),
  no trained token is k or more versions old, and nothing is dropped (the launch window
  keeps the bound)."""
  generated = []
  summary, rows, _ = run(free(), tmp_path, wrap=swaps_mid_generation(generated))
  assert summary['steps'] == 6 and len(rows) == 6
  mixed = [row[row >= 0] for r in generated for row in r.versions
           if len(set(row[row >= 0].tolist())) > 1]
  assert mixed, [r.versions for r in generated]
  for versions in mixed:  # on_swap='continue': later tokens, newer versions
    assert np.all(np.diff(versions) >= 0), versions
  assert sum(r['rollout/mixed_version_samples'] for r in rows) == sum(
      int(r.mixed_versions.sum()) for r in generated)
  assert all(r['update/skipped'] == 0 and r['rollout/trained_groups'] == 4 for r in rows)
  assert all(r['staleness/max'] <= 1 and r['rollout/dropped_stale_groups'] == 0
             for r in rows)
  # Each batch reports its oldest token's version; the ledger the versions trained.
  assert [r['sampling_version'] for r in rows] == [
      r.oldest_version for r in generated]
  ledger = [json.loads(line) for line in (tmp_path / 'ledger.jsonl').read_text().splitlines()]
  for row in ledger:
    assert all(row['version'] - 1 - v < 2 for v in row['trained_versions']), row
  # Every version a swap brought in was pulled by the worker (deltas after the first).
  assert rows[-1]['sync/updates'] >= 6


def test_free_running_keeps_the_bound_at_larger_j_and_k(tmp_path):
  """(2, 4) under random role timings: up to k - j + 1 = 3 batches in flight, the worker
  reloading when 2 versions behind; no trained token is 4 or more versions old."""
  _, rows, _ = run(free(steps=8, j=2, k=4), tmp_path, wrap=delays(5, 0.05))
  assert len(rows) == 8
  assert all(r['staleness/max'] <= 3 and r['rollout/dropped_stale_groups'] == 0
             for r in rows)
  assert all(r['update/skipped'] == 0 for r in rows)
