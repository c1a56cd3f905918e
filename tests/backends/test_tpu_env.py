"""Placement on TPU hosts: the environment that makes an actor's libtpu open only the chips
Ray assigned to it (``rlax_llm.backends.tpu_env``), and what two actors sharing a v5e-8 host
get on a Ray cluster with fake ``'TPU'`` resources (no TPU here: Ray schedules by them); for a
trainer spanning the hosts of a multi-host slice, the order of its processes by the hosts'
TPU worker ids (fake ``TPU_WORKER_ID`` values here) and the environment of each."""

import os
import pathlib
import socket

import pytest
from jax._src import xla_bridge  # (backends_are_initialized: no public equivalent)
from smoke_config import smoke_config  # tests/smoke_config.py

from rlax_llm.backends import build_run
from rlax_llm.backends import ray as ray_backend
from rlax_llm.backends import ray_actors
from rlax_llm.backends.tpu_env import (HostReport, chip_environment, host_worker_id,
                                       process_order, slice_environment)
from rlax_llm.config import run_spec
from rlax_llm.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def tpu_variables(environ):
  """The TPU topology variables of an environment. Left out: TPU_SKIP_MDS_QUERY (`import jax`
  sets it on a machine without TPU chips) and TPU_LIBRARY_PATH (`import libtpu` sets it where
  libtpu is installed); neither says which chips a process owns."""
  return {k: v for k, v in environ.items()
          if k.startswith(('TPU_', 'CLOUD_TPU_'))
          and k not in ('TPU_SKIP_MDS_QUERY', 'TPU_LIBRARY_PATH')}


def split(host_chips, per_process):
  """The environments of ``host_chips // per_process`` processes splitting a host."""
  return [chip_environment(range(first, first + per_process), host_chips)
          for first in range(0, host_chips, per_process)]


def assert_partition(envs, host_chips, bounds):
  """Disjoint chip sets covering the host, one shape, distinct ports, one-process systems."""
  chips = [[int(c) for c in env['TPU_VISIBLE_CHIPS'].split(',')] for env in envs]
  assert sorted(c for cs in chips for c in cs) == list(range(host_chips))
  ports = [env['TPU_PROCESS_PORT'] for env in envs]
  assert len(set(ports)) == len(envs)
  for env, cs, port in zip(envs, chips, ports, strict=True):
    assert env['TPU_CHIPS_PER_PROCESS_BOUNDS'] == env['TPU_CHIPS_PER_HOST_BOUNDS'] == bounds
    assert env['TPU_PROCESS_BOUNDS'] == env['TPU_HOST_BOUNDS'] == '1,1,1'
    assert env['TPU_PROCESS_ADDRESSES'] == f'localhost:{port}' and int(port) == 8476 + cs[0]
    assert env['CLOUD_TPU_TASK_ID'] == '0'


def test_v5e_8_two_workers_of_four_chips():
  first, second = split(8, 4)
  assert first == {
      'TPU_VISIBLE_CHIPS': '0,1,2,3', 'TPU_CHIPS_PER_PROCESS_BOUNDS': '2,2,1',
      'TPU_PROCESS_BOUNDS': '1,1,1', 'TPU_CHIPS_PER_HOST_BOUNDS': '2,2,1',
      'TPU_HOST_BOUNDS': '1,1,1', 'TPU_PROCESS_PORT': '8476',
      'TPU_PROCESS_ADDRESSES': 'localhost:8476', 'CLOUD_TPU_TASK_ID': '0'}
  assert second['TPU_VISIBLE_CHIPS'] == '4,5,6,7' and second['TPU_PROCESS_PORT'] == '8480'
  assert_partition([first, second], 8, '2,2,1')


@pytest.mark.parametrize('host_chips, per_process, bounds', [
    (8, 2, '1,2,1'), (8, 1, '1,1,1'),  # v5e-8: 4 x 2 chips, 8 x 1 chip
    (4, 2, '1,2,1'), (4, 1, '1,1,1'),  # v4-8 (4 chips): 2 x 2, 4 x 1
])
def test_splits_of_v5e_8_and_v4_8(host_chips, per_process, bounds):
  assert_partition(split(host_chips, per_process), host_chips, bounds)


@pytest.mark.parametrize('host_chips', [8, 4, 1])
def test_the_whole_host_needs_nothing(host_chips):
  """Ray removes TPU_VISIBLE_CHIPS for an actor holding its whole host; libtpu's defaults
  are the host's shape. Ray's own value (fake resources: no /dev/accel) is accepted."""
  assert chip_environment(range(host_chips), host_chips) == {}
  visible = ','.join(map(str, range(host_chips)))
  assert chip_environment(range(host_chips), host_chips, {'TPU_VISIBLE_CHIPS': visible}) == {}


def test_ray_strings_and_ray_set_environment_agree():
  """Ray's ids are strings; the variables Ray sets itself (TPU_VISIBLE_CHIPS, and the host
  bounds for 1 and 2 chips) are the values produced here, so applying them changes nothing
  Ray set."""
  ray_set = {'TPU_VISIBLE_CHIPS': '2,3', 'TPU_CHIPS_PER_HOST_BOUNDS': '1,2,1',
             'TPU_HOST_BOUNDS': '1,1,1', 'PATH': '/bin'}
  env = chip_environment(['3', '2'], 8, ray_set)
  assert {k: env[k] for k in ray_set if k != 'PATH'} == {k: v for k, v in ray_set.items()
                                                       if k != 'PATH'}
  assert env['TPU_PROCESS_PORT'] == '8478'


@pytest.mark.parametrize('chips, host_chips, message', [
    ([0, 1, 2], 4, 'given 3 chips'),  # 3 chips on a 2x2 host
    (range(8), 4, 'given 8 chips'),  # more than the host
    ([0, 1, 2, 3, 4, 5], 8, 'given 6 chips'),
    ([], 8, 'given 0 chips'),
    ([1, 2], 8, 'not an aligned block'),  # straddles two 2-chip blocks
    ([0, 2], 8, 'not an aligned block'),  # not consecutive
    ([2, 3, 4, 5], 8, 'not an aligned block'),
    ([8], 8, 'not an aligned block'),  # outside the host
    ([-1], 8, 'not an aligned block'),
    (['1', '1'], 8, 'twice'),
    ([0], 2, 'A TPU host has 1/4/8 chips'),
])
def test_impossible_splits_are_refused(chips, host_chips, message):
  with pytest.raises(ConfigError, match=message):
    chip_environment(chips, host_chips)


@pytest.mark.parametrize('name, value', [
    ('TPU_VISIBLE_CHIPS', '0,1'),  # another actor's chips
    ('TPU_CHIPS_PER_HOST_BOUNDS', '2,4,1'),  # the whole host's shape over 4 chips
    ('TPU_HOST_BOUNDS', '2,1,1'),
])
def test_a_conflicting_environment_is_refused(name, value):
  with pytest.raises(ConfigError, match=f'{name}=.*need {name}='):
    chip_environment([4, 5, 6, 7], 8, {name: value})


@pytest.fixture(scope='module')
def fake_tpu_host():
  """A private Ray cluster on loopback whose one node has 8 fake 'TPU' chips (a v5e-8)."""
  ray = pytest.importorskip('ray')
  # Each test module's cluster is shut down with its module (tests/backends/conftest.py), so
  # one still running here leaked from an earlier test: fail rather than skip these checks.
  assert not ray.is_initialized(), ('a Ray cluster is still running in this process (leaked '
                                    'by an earlier test); this module needs its own')
  # Actors import rlax_llm and this module (its helpers travel by reference).
  path = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / 'tests'), str(ROOT / 'tests/backends'),
                                       os.environ.get('PYTHONPATH')]))
  ray.init(num_cpus=2, resources={'TPU': 8}, _node_ip_address='127.0.0.1',
           runtime_env={'env_vars': {'PYTHONPATH': path, 'JAX_PLATFORMS': 'cpu',
                                     'XLA_FLAGS': os.environ.get('XLA_FLAGS', '')}},
           include_dashboard=False, log_to_driver=False, configure_logging=False)
  yield ray
  ray.shutdown()


def test_two_actors_on_one_v5e_8_host_see_their_own_chips(fake_tpu_host):
  """Two actors asking for 4 'TPU' each, as ``ray.worker_resources={'TPU': 4}`` makes the
  workers do, placed on one 8-chip host: after ``pin_tpu_chips`` (what the roles' __init__
  run first), each process's environment names its own 4 chips, a 2x2 block, a one-process
  TPU system and its own port. An actor without TPU resources is left alone."""
  ray = fake_tpu_host

  class Probe:
    def __init__(self):
      # Importing the backend (as an actor's process does) must not start a JAX backend:
      # libtpu reads the variables when it does.
      self.jax_up_before = xla_bridge.backends_are_initialized()
      self.applied = ray_actors.pin_tpu_chips()

    def environment(self):
      return self.jax_up_before, self.applied, tpu_variables(os.environ)

  on_tpu = ray.remote(num_cpus=0, resources={'TPU': 4})(Probe)
  reports = ray.get([actor.environment.remote() for actor in (on_tpu.remote(), on_tpu.remote())])
  envs = [env for *_, env in reports]
  for jax_up_before, applied, env in reports:
    assert not jax_up_before
    assert applied == env  # the process sees exactly what was applied, nothing else
  assert_partition(sorted(envs, key=lambda e: e['TPU_VISIBLE_CHIPS']), 8, '2,2,1')
  _, applied, env = ray.get(ray.remote(num_cpus=0)(Probe).remote().environment.remote())
  assert applied == {} and env == {}


@pytest.mark.slow  # about 24 s; two actors on one host stay in CI above (suite time)
def test_a_runs_worker_actors_sharing_a_host_see_their_own_chips(fake_tpu_host, tmp_path):
  """The roles themselves: a Ray run with two workers of ``ray.worker_resources={'TPU': 4}``
  on the 8-chip host; inside each worker actor's process (JAX already up, on CPU here) the
  environment names its own 2x2 block and port. The trainer asks for no TPU: untouched."""
  ray = fake_tpu_host
  config = smoke_config(backend='ray', rollout__workers=2, log__tensorboard=False,
                        checkpoint__every_steps=0, checkpoint__every_seconds=0.0)
  config.ray.worker_resources = {'TPU': 4}
  with build_run(config, tmp_path, run_spec(config)) as run:
    actors = [handle.actor for handle in run.controller.workers]
    actors.append(run.controller.trainer.actor)
    *workers, trainer = ray.get([actor.__ray_call__.remote(
        lambda self: tpu_variables(os.environ)) for actor in actors])
  assert_partition(sorted(workers, key=lambda e: e['TPU_VISIBLE_CHIPS']), 8, '2,2,1')
  assert trainer == {}


# ------------------------------------------------- a trainer spanning a multi-host slice


def report(worker_id, host):
  return HostReport(worker_id, f'host-{host}', f'10.0.0.{host}')


def test_processes_are_ordered_by_their_hosts_worker_ids():
  """Process p is the host whose TPU worker id is p, whatever order Ray created the actors
  in (a v5e-16: 4 hosts); off TPU (no worker ids) the creation order stays."""
  reports = [report(2, 7), report(0, 5), report(3, 9), report(1, 6)]
  assert process_order(reports) == [1, 3, 0, 2]
  assert process_order([report(None, 1), report(None, 2)]) == [0, 1]


@pytest.mark.parametrize('ids, message', [
    ([0, 0], r'TPU worker id 0 is reported by 2 trainer actors, on host-0 \(10.0.0.0\), '
             r'host-1 \(10.0.0.1\): two actors on one host, or hosts of two slices; each '
             r'trainer actor must hold one whole host'),
    ([0, 2], r'the 2 trainer actors report TPU worker ids \[0, 2\] \(0: host-0 \(10.0.0.0\), '
             r'2: host-1 \(10.0.0.1\)\), but the hosts of a 2-host slice are workers 0..1: '
             r'worker id\(s\) \[1\] are not in the trainer; .*ray.trainer_processes = the '
             r"slice's host count"),
    ([1, None], r'trainer actors on host-1 \(10.0.0.1\) have no TPU worker id'),
])
def test_a_duplicate_or_missing_worker_id_is_refused(ids, message):
  with pytest.raises(ConfigError, match=message):
    process_order([report(worker_id, host) for host, worker_id in enumerate(ids)])


def test_the_worker_id_is_read_from_the_environment_else_the_metadata():
  asked = []

  def metadata(key):
    asked.append(key)
    return '3'
  assert host_worker_id({'TPU_WORKER_ID': '1'}, metadata) == 1 and not asked
  assert host_worker_id({}, metadata) == 3 and asked == ['agent-worker-number']
  assert host_worker_id({}) is None  # off TPU: the metadata is not asked
  with pytest.raises(ConfigError, match=r"TPU_WORKER_ID='-1' is not a TPU worker id"):
    host_worker_id({'TPU_WORKER_ID': '-1'})


def test_each_host_of_a_trainer_slice_gets_its_worker_id_and_every_host():
  """A v5p-16 trainer (2 hosts x 4 chips): process 1 is worker 1 of the slice's two hosts,
  listed by worker id; GKE's own TPU_WORKER_HOSTNAMES (DNS names) is kept."""
  hosts = ['10.0.0.5', '10.0.0.6']
  assert slice_environment(1, hosts, ['0', '1', '2', '3'], 4, {'PATH': '/bin'}) == {
      'TPU_WORKER_ID': '1', 'TPU_WORKER_HOSTNAMES': '10.0.0.5,10.0.0.6'}
  gke = {'TPU_WORKER_ID': '1', 'TPU_WORKER_HOSTNAMES': 'job-0.svc,job-1.svc'}
  assert slice_environment(1, hosts, range(4), 4, gke) == {'TPU_WORKER_ID': '1'}


@pytest.mark.parametrize('chips, current, message', [
    (range(2), {}, r'this one was given 2 of its host\'s 4 chips. Set the "TPU" count in '
                   r'ray.trainer_resources to 4'),
    (range(4), {'TPU_WORKER_ID': '0'}, r"TPU_WORKER_ID='0', where the multi-host trainer needs "
                                       r"TPU_WORKER_ID='1'"),
    (range(4), {'CLOUD_TPU_TASK_ID': '0'}, r"CLOUD_TPU_TASK_ID='0'"),
    (range(4), {'TPU_PROCESS_BOUNDS': '1,1,1'}, r'needs no TPU_PROCESS_BOUNDS \(a one-process'),
    (range(4), {'TPU_WORKER_HOSTNAMES': 'a,b,c'}, r'needs 2 hosts, as the trainer has'),
])
def test_a_slice_environment_that_cannot_form_the_slice_is_refused(chips, current, message):
  with pytest.raises(ConfigError, match=message):
    slice_environment(1, ['10.0.0.5', '10.0.0.6'], chips, 4, current)


@pytest.mark.slow  # three real actors, about 30 s; the ordering rules are tested as functions above (suite time)
def test_the_driver_orders_trainer_actors_by_the_worker_id_each_reads_on_its_host(
    fake_tpu_host):
  """Three trainer actors whose processes see the fake TPU_WORKER_ID 2, 0, 1 (as each host's
  environment would give them): each reports it with its hostname and node address, and the
  driver (``order_trainers``) makes process p the actor of worker id p. Duplicate and
  missing ids stop the launch with the error naming them."""
  ray = fake_tpu_host
  role = ray.remote(num_cpus=0)(ray_actors.TrainerRole)

  def actors(*ids):
    return [role.options(runtime_env={'env_vars': {'TPU_WORKER_ID': str(i)}}).remote()
            for i in ids]

  created = actors(2, 0, 1)
  ordered, reports = ray_backend.order_trainers(created)
  assert ordered == [created[1], created[2], created[0]]
  assert [r.worker_id for r in reports] == [0, 1, 2]
  node = ray.nodes()[0]['NodeManagerAddress']  # the one node's, as Ray reports it
  assert {(r.hostname, r.address) for r in reports} == {(socket.gethostname(), node)}
  with pytest.raises(ConfigError, match=r'TPU worker id 0 is reported by 2 trainer actors'):
    ray_backend.order_trainers(actors(0, 0))
  with pytest.raises(ConfigError, match=r'worker id\(s\) \[1\] are not in the trainer'):
    ray_backend.order_trainers(actors(0, 2))
