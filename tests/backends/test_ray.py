"""The Ray backend: each role in its own actor process, on a private Ray cluster on loopback.
The same seed gives the same metrics as the local backend; a worker process that dies is
restarted by Ray and carries on (or, past its restarts, is retired and its requests go to
the others) and the run completes; the driver carries no weight byte. (Checkpoints and
resume: tests/backends/test_ray_resume.py.)"""

import dataclasses
import re
import signal
import time

import jax
import numpy as np
import pytest

ray = pytest.importorskip('ray')

from rlax_llm.backends import build_run  # noqa: E402
from rlax_llm import roles  # noqa: E402
from rlax_llm.backends import ray as ray_backend  # noqa: E402
from rlax_llm.backends import ray_actors  # noqa: E402
from rlax_llm.checkpoint import PreemptionGuard  # noqa: E402
from rlax_llm.config import run_spec  # noqa: E402
from rlax_llm.data_types import Rollouts, TrainBatch  # noqa: E402
from rlax_llm.metrics import read_metrics  # noqa: E402
from rlax_llm.paramserver import delta as delta_lib  # noqa: E402
from rlax_llm.paramserver import local_shards  # noqa: E402

from memfd import holders  # noqa: E402  (tests/memfd.py)
from smoke_config import smoke_config  # noqa: E402  (tests/smoke_config.py)
from test_resume import Preempt  # noqa: E402


def smoke(backend, steps=6, **overrides):
  fields = dict(backend=backend, total_steps=steps, staleness__j=4, staleness__k=8,
                log__tensorboard=False, eval__every_steps=3,
                checkpoint__every_steps=0, checkpoint__every_seconds=0.0)
  return smoke_config(**(fields | overrides))


def strip(rows):
  return [{k: v for k, v in row.items() if not k.startswith('time/')} for row in rows]


def execute(config, workdir, wrap=None, state=None):
  """Runs ``config``; ``wrap(controller)`` may replace role handles (e.g. inject faults);
  ``state``: a list that receives the trainer's ``state()`` after the run."""
  with build_run(config, workdir, run_spec(config)) as run:
    if wrap is not None:
      wrap(run.controller)
    summary = run.execute()
    if state is not None:
      state.append(run.controller.trainer.state().result())
  return summary, read_metrics(workdir / 'metrics.jsonl')


def test_ray_and_local_give_the_same_run(cluster, tmp_path, monkeypatch):
  """The same run on both backends. While the Ray run trains, the driver (the controller's
  process) sends version numbers and receives rollouts and the trainer's metrics only: the
  trainer actor pushes to the server actor and the worker actors pull from it."""
  received, sent = [], []
  result = ray_backend.RayFuture.result

  def spy_result(self, timeout=None):
    value = result(self, timeout)
    received.append(value)
    return value

  def spy_generate(controller):
    for handle in controller.workers:
      def generate(*args, _generate=handle.generate):
        sent.append(args)
        return _generate(*args)
      handle.generate = generate

  monkeypatch.setattr(ray_backend.RayFuture, 'result', spy_result)
  states = []
  _, ray_rows = execute(smoke('ray'), tmp_path / 'ray', wrap=spy_generate, state=states)
  monkeypatch.undo()
  *during_run, after = received  # after: the trainer's state(), fetched once the run ended
  assert len(after) == 3 and any(isinstance(v, Rollouts) for v in during_run)
  # Rollouts, or a step's metrics (RayTrainer.step's future yields those, its version kept).
  assert all(isinstance(v, Rollouts) or (isinstance(v, dict) and 'loss' in v)
             for v in during_run), [type(v) for v in during_run]
  assert all(type(version) is int and rng.shape == (2,) for _, rng, version, *_ in sent)
  _, local_rows = execute(smoke('local'), tmp_path / 'local', state=states)
  assert strip(ray_rows) == strip(local_rows)
  assert max(r['staleness/max'] for r in ray_rows) <= 7
  # The Ray trainer's state() (an inspection method of both handles; the controller never
  # calls it) is the local one's: params, optimizer state and counters, fetched from the actor.
  (ray_params, ray_opt, ray_counters), (params, opt, counters) = states
  assert ray_counters == counters and counters['version'] == ray_rows[-1]['version']
  for a, b in zip(jax.tree.leaves((ray_params, ray_opt)), jax.tree.leaves((params, opt)),
                  strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # about 31 s; the bf16 copy is covered locally in tests/backends/test_inference_dtype.py
def test_a_bfloat16_inference_copy_on_ray_equals_local(cluster, tmp_path):
  """model.inference_param_dtype='bfloat16': the Ray trainer actor casts each version and
  pushes the bf16 copy, as the local trainer does, so the runs sample alike and their
  mismatch metrics (float32 recompute vs bf16 behaviour) agree, and are the bf16 gap's."""
  rows = {}
  for backend in ('ray', 'local'):
    config = smoke(backend, steps=3, staleness__j=1, staleness__k=1, eval__every_steps=0,
                   model__inference_param_dtype='bfloat16')
    _, rows[backend] = execute(config, tmp_path / backend)
  assert strip(rows['ray']) == strip(rows['local'])
  assert all(row['mismatch/max_abs_dlogp'] > 1e-3 for row in rows['ray'])
  # Whole bf16 leaves: 2 bytes a param in the first pull.
  assert rows['ray'][0]['sync/bytes'] == 2 * sum(
      leaf.size for leaf in jax.tree.leaves(roles.build_model(config, roles.build_task(
          config))[1]))


class KilledAtCall:
  """A worker handle whose actor process is killed just before its ``call``-th ``generate``
  call (a real process death: the call's result never comes)."""

  def __init__(self, handle, call):
    self._handle, self._call, self._calls = handle, call, 0

  def __getattr__(self, name):
    return getattr(self._handle, name)

  def generate(self, *args, **kwargs):
    self._calls += 1
    if self._calls == self._call:
      ray.kill(self._handle.actor, no_restart=True)
    return self._handle.generate(*args, **kwargs)


def test_a_dead_worker_process_is_replaced(cluster, tmp_path):
  def fault(controller):
    controller.workers[1] = KilledAtCall(controller.workers[1], 2)
  summary, rows = execute(smoke('ray', rollout__workers=2), tmp_path, wrap=fault)
  assert summary['workers/lost'] == 1 and len(rows) == 6
  assert 'inference worker 1 was lost' in summary['events'][0]


@pytest.mark.slow  # about 29 s; APRIL runs locally in tests/test_async.py (suite time)
def test_partial_rollouts_on_ray_equal_local(cluster, tmp_path):
  """APRIL's unfinished groups travel to the worker actors inside requests (with their
  keys and tokens) and come back continued: the same run as the local backend."""
  april = dict(rollout__oversample=1.0, rollout__stop_after_groups=4, rollout__slots=6,
               task__max_operand=9, task__num_eval=4, staleness__j=2, staleness__k=3)
  _, ray_rows = execute(smoke('ray', **april), tmp_path / 'ray')
  _, local_rows = execute(smoke('local', **april), tmp_path / 'local')
  assert strip(ray_rows) == strip(local_rows)
  assert sum(r['rollout/carried_groups'] for r in ray_rows) > 0


@pytest.mark.slow  # about 21 s; free mode runs locally in tests/test_async.py (suite time)
def test_free_running_on_ray_keeps_the_bound(cluster, tmp_path):
  """staleness.schedule='free': each worker actor asks the server actor for its latest
  version between decode steps (ServerRole.latest_version) and pulls it itself; the run
  completes with no trained token k or more versions old."""
  summary, rows = execute(smoke('ray', steps=8, staleness__j=1, staleness__k=2,
                                staleness__schedule='free'), tmp_path)
  assert summary['steps'] == 8 and len(rows) == 8
  assert all(r['staleness/max'] <= 1 and r['rollout/dropped_stale_groups'] == 0
             and r['update/skipped'] == 0 for r in rows)
  assert all('rollout/mixed_version_samples' in r for r in rows)
  # Each batch sampled with what the server held: the newest version or one behind.
  assert all(r['version'] - 2 <= r['sampling_version'] <= r['version'] - 1 for r in rows)


@pytest.mark.slow  # about 35 s; a dead worker process (retired) stays in CI above (suite time)
def test_a_killed_worker_actor_restarts_and_carries_on(cluster, tmp_path):
  """The worker actor's process is killed just before its 3rd call (``no_restart=False``: a
  lost process, not a retirement): Ray restarts it and runs the call there, the new process
  pulls its version from the server itself, and the run's rewards (every metric but timings
  and transport figures) equal the unkilled run's; the restart is in the metrics and the
  events, and no worker was lost."""
  class Killed(KilledAtCall):
    def generate(self, *args, **kwargs):
      self._calls += 1
      if self._calls == self._call:
        ray.kill(self._handle.actor, no_restart=False)
      return self._handle.generate(*args, **kwargs)

  def fault(controller):
    controller.workers[0] = Killed(controller.workers[0], 3)
  summary, rows = execute(smoke('ray', steps=4), tmp_path / 'ray', wrap=fault)
  _, reference = execute(smoke('local', steps=4), tmp_path / 'local')
  assert summary['workers/restarts'] == 1 and summary['workers/lost'] == 0
  assert [row['workers/restarts'] for row in rows][-1] == 1
  assert any('was lost and restarted' in event for event in summary['events'])
  assert [row['reward/mean'] for row in rows] == [row['reward/mean'] for row in reference]
  other = lambda rows: [{k: v for k, v in row.items()
                         if not k.startswith(('time/', 'sync/', 'workers/'))} for row in rows]
  assert other(rows) == other(reference)


def _arrays(value, seen=None):
  """Every numpy or JAX array inside ``value`` (containers, dataclasses, objects' fields)."""
  seen = set() if seen is None else seen
  if id(value) in seen:
    return
  seen.add(id(value))
  if isinstance(value, (np.ndarray, jax.Array)):
    yield value
  elif isinstance(value, dict):
    for item in value.values():
      yield from _arrays(item, seen)
  elif isinstance(value, (list, tuple)):
    for item in value:
      yield from _arrays(item, seen)
  elif dataclasses.is_dataclass(value) and not isinstance(value, type):
    for field in dataclasses.fields(value):
      yield from _arrays(getattr(value, field.name), seen)
  elif hasattr(value, '__dict__') and not isinstance(value, type):
    for item in vars(value).values():
      yield from _arrays(item, seen)


class DriverTraffic:
  """Records what the driver's Ray serializes (task arguments, ``ray.put``) and
  deserializes (what ``ray.get`` returns): every object entering or leaving this process
  through Ray. ``weight_bytes(signatures)``: the bytes of the arrays among them shaped like
  a param leaf (``(shape, dtype)`` in ``signatures``; the optimizer's moments too)."""

  def __init__(self, monkeypatch):
    from ray._private import serialization, worker  # pylint: disable=import-outside-toplevel  # ray's internals, here only
    self.values = []
    serialize = serialization.SerializationContext.serialize
    deserialize = worker.Worker.deserialize_objects

    def spy_serialize(context, value):
      self.values.append(value)
      return serialize(context, value)

    def spy_deserialize(self_, *args, **kwargs):
      values = deserialize(self_, *args, **kwargs)
      self.values.extend(values)
      return values

    monkeypatch.setattr(serialization.SerializationContext, 'serialize', spy_serialize)
    monkeypatch.setattr(worker.Worker, 'deserialize_objects', spy_deserialize)

  def weight_bytes(self, signatures) -> int:
    return sum(a.nbytes for value in self.values for a in _arrays(value)
               if (tuple(a.shape), np.dtype(a.dtype)) in signatures)


@pytest.mark.slow  # about 44 s; the default run checks the same traffic on the Ray
# preempted-and-resumed run (test_ray_resume.py), with a lighter control (suite time)
def test_the_driver_carries_no_weight_bytes(cluster, tmp_path, monkeypatch):
  """While a Ray run trains, is preempted (a checkpoint with a batch in flight) and resumes,
  every object crossing the driver through Ray is recorded: none holds an array shaped like
  a param (0 bytes), though rollouts, train batches and the controller's state crossed (the
  measurement sees the traffic both ways). Negative control: the old checkpoint path (the
  trainer's params and optimizer state fetched to the driver, ``state()``) measured the same
  way counts at least one model's bytes."""
  config = smoke('ray', steps=4, staleness__j=1, staleness__k=2, checkpoint__every_steps=2)
  config.checkpoint.every_seconds = 0.0
  _, params, _ = roles.build_model(config, roles.build_task(config))  # shapes only
  signatures = {(tuple(a.shape), np.dtype(a.dtype)) for a in jax.tree.leaves(params)}
  model_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
  traffic = DriverTraffic(monkeypatch)
  with build_run(config, tmp_path, run_spec(config), stop=Preempt(2)) as run:
    assert run.execute()['preempted']  # after step 2, with batch 3 in flight
  with build_run(config, tmp_path, run_spec(config)) as run:  # resumes from step 2
    run.execute()
    during = traffic.weight_bytes(signatures)
    crossed = sum(a.nbytes for v in traffic.values for a in _arrays(v))
    assert any(isinstance(v, Rollouts) for v in traffic.values) and crossed > 0  # received
    assert any(isinstance(v, TrainBatch) for v in traffic.values)  # sent
    traffic.values.clear()
    run.controller.trainer.state().result()  # the control: what Controller.save used to do
  assert [row['step'] for row in read_metrics(tmp_path / 'metrics.jsonl')] == [1, 2, 3, 4]
  assert during == 0
  assert traffic.weight_bytes(signatures) >= 2 * model_bytes


def test_init_ray_keeps_the_preemption_guards_signal_handlers(monkeypatch):
  """ray.init replaces the driver's SIGTERM handler (Ray's aborts the process); init_ray puts
  the PreemptionGuard's back, so SIGTERM to a Ray launch saves and exits 0
  (test_ray_resume.py's slow subprocess test sends a real one)."""
  def init(**kwargs):  # what ray.init does to the handlers, without a cluster
    del kwargs
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
  monkeypatch.setattr(ray, 'is_initialized', lambda: False)
  monkeypatch.setattr(ray, 'init', init)
  with PreemptionGuard() as guard:
    assert ray_backend.init_ray(smoke('ray'))
    assert signal.getsignal(signal.SIGTERM) == guard._handle  # pylint: disable=protected-access
    assert signal.getsignal(signal.SIGINT) == guard._handle  # pylint: disable=protected-access


def _plasma_objects() -> int:
  """How many objects this cluster's object store holds now (Ray's memory summary)."""
  from ray._private.internal_api import memory_summary  # pylint: disable=import-outside-toplevel  # ray's internals, here only
  summary = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
  return int(re.search(r'Plasma memory usage \d+ MiB, (\d+) objects', summary).group(1))


def test_the_server_actor_keeps_the_object_stores_arrays_and_they_never_change(cluster):
  """With ``paramserver.transport='object_store'`` (and between machines), the trainer
  writes each version into the object store once (``push_shards``); the server keeps its
  whole leaves as they are and hands workers the object's ref (``fetch_update`` reads it
  zero-copy); the objects of dropped versions are released."""
  class Pusher:
    """In a process of its own, as the trainer actor (which owns the objects it puts): pushes
    whole leaves through the object store, then drops its references to them (defined here:
    pickled by value for Ray)."""

    def push(self, server, version: int, seed: int) -> None:
      rng = np.random.default_rng(seed)
      params = {'a': rng.random((512, 512), np.float32), 'b': rng.random((7,), np.float32)}
      ray_actors.push_shards(server, version, local_shards(params, to_host=True))

  before = _plasma_objects()
  server = ray.remote(num_cpus=0, max_concurrency=4)(ray_actors.ServerRole).remote(
      2, 'object_store')
  pusher = ray.remote(num_cpus=0)(Pusher).remote()
  try:
    for version in range(6):  # the trainer's objects are released; new ones reuse the store
      ray.get(pusher.push.remote(server, version, seed=version))
      ray.put(np.ones(1 << 20, np.float32))  # more traffic through the store
      # Adopted, not copied: the stored leaves are views of the memory Ray deserialised.
      owned = ray.get(server.__ray_call__.remote(
          lambda role, v=version: [leaf.flags.owndata or leaf.flags.writeable
                                   for leaf in role.server._store[v][1]]))
      assert owned == [False, False]
      held_versions = ray.get(server.__ray_call__.remote(lambda role: role.server.versions()))
      assert ray.get(server.held_refs.remote()) == held_versions == list(
          range(max(0, version - 1), version + 1))
      for held in held_versions:
        # The big leaf comes as the trainer's object's ref, not serialised by the server.
        sent, refs = ray.get(server.update.remote(held, -1))
        assert len(refs) == 1 and sent.nbytes < 1024
        update = ray_actors.fetch_update(server, held, -1)
        leaves = delta_lib.apply([None, None], update)
        rng = np.random.default_rng(held)
        np.testing.assert_array_equal(leaves[0], rng.random((512, 512), np.float32))
        np.testing.assert_array_equal(leaves[1], rng.random((7,), np.float32))
        delta_lib.verify(leaves, update.checksums, ['a', 'b'], held)
      del sent, refs, update, leaves
      # Bounded: the objects of the two versions kept, no more (dropped ones released).
      for _ in range(50):
        if _plasma_objects() <= before + 2:
          break
        time.sleep(0.1)
      assert _plasma_objects() <= before + 2
  finally:
    ray.kill(server)
    ray.kill(pusher)


def peer(node: str | None = None):
  """An actor that is a trainer's or a worker's end in a process of its own (defined here:
  pickled by value for Ray): pushes versions of a small tree, pulls them as a worker does
  (verifying the checksums) and keeps what it pulled, as a worker keeps the version it
  holds. ``node``: the node id it pretends to be on (another machine)."""
  def params(version: int) -> dict:
    rng = np.random.default_rng(version)
    return {'a': rng.random((512, 512), np.float32), 'b': rng.random((7,), np.float32)}

  class Peer:
    def __init__(self):
      if node is not None:
        ray_actors._node_id = lambda: node  # pylint: disable=protected-access
      self.kept = {}

    def push(self, server, version: int) -> None:
      ray_actors.push_shards(server, version, local_shards(params(version), to_host=True))

    def pull(self, server, version: int, keep: bool = False) -> list[bool]:
      """Pulls ``version`` whole; returns, per leaf, whether it is a read-only view (no copy
      in this process); ``keep``: holds it until ``check``."""
      update = ray_actors.fetch_update(server, version, -1)
      leaves = delta_lib.apply([None, None], update)
      delta_lib.verify(leaves, update.checksums, ['a', 'b'], version)
      for got, want in zip(leaves, jax.tree.leaves(params(version))):
        np.testing.assert_array_equal(got, want)
      if keep:
        self.kept[version] = leaves
      return [not (leaf.flags.owndata or leaf.flags.writeable) for leaf in leaves]

    def check(self) -> None:
      """The versions kept still hold their values."""
      for version, leaves in self.kept.items():
        for got, want in zip(leaves, jax.tree.leaves(params(version))):
          np.testing.assert_array_equal(got, want)

  return ray.remote(num_cpus=0)(Peer).remote()

def test_on_one_machine_versions_move_through_the_servers_shared_memory(cluster):
  """Trainer, server and worker on one node (the default transport): the trainer copies each
  version into a slot of the server's ring, the server commits it by reference, the worker
  maps it read-only (no copy anywhere, nothing in the object store), checksums verified. A
  worker holding version 0 while 6 more pass (keep 2) keeps its bytes: its slot is never
  reused; the ring stays small. The actors killed, no process holds the ring's memory."""
  before = _plasma_objects()
  server = ray.remote(num_cpus=0, max_concurrency=4)(ray_actors.ServerRole).remote(2)
  trainer, worker = peer(), peer()
  try:
    for version in range(7):
      ray.get(trainer.push.remote(server, version))
      assert ray.get(worker.pull.remote(server, version, keep=version == 0)) == [True, True]
      ray.get(worker.check.remote())
      assert ray.get(server.held_refs.remote()) == []  # no object-store ref kept
    names = ray.get(server.__ray_call__.remote(lambda role: role.slots.names()))
    assert len(names) <= 4  # keep 2 + 1 being written + the one the worker holds
    stored = ray.get(server.__ray_call__.remote(
        lambda role: [leaf.flags.owndata for leaf in role.server.get(6).params.values()]))
    assert stored == [False, False]  # adopted: views of the slot
    assert _plasma_objects() <= before
  finally:
    for actor in (server, trainer, worker):
      ray.kill(actor)
  tag = names[0].rsplit('_', 1)[0]
  for _ in range(100):
    if not holders(tag):
      break
    time.sleep(0.1)
  assert holders(tag) == []


@pytest.mark.slow  # about 17 s; the same-node shared-memory path stays in CI (suite time)
def test_processes_on_other_machines_keep_the_object_store(cluster):
  """A trainer or a worker whose node id differs from the server's (faked) pushes and pulls
  through the object store; a worker on the server's machine still maps the slots."""
  server = ray.remote(num_cpus=0, max_concurrency=4)(ray_actors.ServerRole).remote(2)
  remote_peer = peer('another-node')
  local_peer = peer()
  try:
    assert ray.get(server.reserve.remote(0, 1 << 20, 'another-node')) is None
    ray.get(remote_peer.push.remote(server, 0))
    assert ray.get(server.held_refs.remote()) == [0]  # through the object store
    ray.get(local_peer.push.remote(server, 1))
    assert ray.get(server.held_refs.remote()) == [0]  # version 1: a slot
    for version in (0, 1):
      ray.get(remote_peer.pull.remote(server, version))
      ray.get(local_peer.pull.remote(server, version))
    sent, _ = ray.get(server.update.remote(1, -1, ('another-node', 'reader', [])))
    assert sent.nbytes == (512 * 512 + 7) * 4  # whole
    sent, refs = ray.get(server.update.remote(1, -1, (ray_actors._node_id(), 'reader', [])))  # pylint: disable=protected-access
    assert sent.nbytes == 0 and refs == []  # slot markers only
  finally:
    for actor in (server, remote_peer, local_peer):
      ray.kill(actor)
