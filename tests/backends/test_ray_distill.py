"""On-policy distillation on Ray: the teacher in an actor of its own (``TeacherRole``), placed
on the resources its config names (``ray.teacher_resources``, as the trainer's and the
workers' are: ``ray.actor_options``) and asked by the driver's controller for each batch's
scores, gives the run the local backend gives (every metric but ``time/``, ``distill/``
included). Its local counterpart in the default run: tests/test_distill_resume.py (a local
distillation run, and its exact resume); the resource requests are checked without a
cluster here."""

import time

import pytest

ray = pytest.importorskip('ray')

from rlax_llm.backends import build_run  # noqa: E402
from rlax_llm.backends.ray import actor_options  # noqa: E402
from rlax_llm.backends.ray_actors import TeacherRole, TrainerRole, WorkerRole  # noqa: E402
from rlax_llm.config import run_spec  # noqa: E402
from rlax_llm.metrics import read_metrics  # noqa: E402

from smoke_config import smoke_config  # noqa: E402  (tests/smoke_config.py)


def test_each_role_asks_for_the_resources_its_config_names():
  """``ray.<role>_resources`` as Ray's options (``'CPU'`` as ``num_cpus``), the workers' and
  the teacher's restarts, the trainer's environment; the options are ones ``ray.remote`` accepts."""
  config = smoke_config(
      backend='ray', ray__trainer_resources={'TPU': 4, 'rlax_trainer': 4},
      ray__worker_resources={'TPU': 4}, ray__teacher_resources={'TPU': 1, 'CPU': 2},
      ray__worker_restarts=2, ray__teacher_restarts=1,
      ray__trainer_env={'XLA_FLAGS': '--xla_dump_to=/tmp/x'})
  options = {role: actor_options(config, role) for role in ('trainer', 'worker', 'teacher')}
  assert options == {
      'trainer': dict(num_cpus=0, resources={'TPU': 4, 'rlax_trainer': 4}, max_restarts=0,
                      runtime_env={'env_vars': {'XLA_FLAGS': '--xla_dump_to=/tmp/x'}}),
      'worker': dict(num_cpus=0, resources={'TPU': 4}, max_restarts=2, max_task_retries=2),
      'teacher': dict(num_cpus=2, resources={'TPU': 1}, max_restarts=1, max_task_retries=1)}
  for role, cls in (('trainer', TrainerRole), ('worker', WorkerRole), ('teacher', TeacherRole)):
    ray.remote(**options[role])(cls)  # Ray checks the options' names and values here
  # Nothing asked on a laptop: no CPU held, no resources.
  assert actor_options(smoke_config(backend='ray'), 'teacher') == dict(
      num_cpus=0, resources={}, max_restarts=3, max_task_retries=3)
  with pytest.raises(ValueError, match="role='server' is not one of the Ray roles"):
    actor_options(config, 'server')


def _run(backend, workdir, **fields):
  """The distillation run's metrics but ``time/``; on Ray, with the teacher's CPU held while
  the run trains (``held``: the cluster's CPUs the run's actors hold, read once it started)."""
  config = smoke_config(**(dict(
      backend=backend, total_steps=3, warmup__steps=0, rl__distill__kind='gkd',
      rl__distill__top_k=4, rl__distill__with_reward=False, teacher__enabled=True,
      rl__learning_rate=3e-3, log__tensorboard=False, eval__every_steps=0,
      checkpoint__every_steps=0, checkpoint__every_seconds=0.0, staleness__j=2,
      staleness__k=2) | fields))
  held = None
  with build_run(config, workdir, run_spec(config)) as run:
    if backend == 'ray':
      held = _cpus_held(expected=1)
    run.execute()
  return held, [{k: v for k, v in row.items() if not k.startswith('time/')}
                for row in read_metrics(workdir / 'metrics.jsonl')]


def _cpus_held(expected: int, wait_s: float = 20.0) -> int:
  """The cluster's CPUs held by actors, once it is ``expected`` (Ray reports the available
  resources with a delay) or ``wait_s`` passed."""
  deadline = time.monotonic() + wait_s
  while True:
    held = ray.cluster_resources()['CPU'] - ray.available_resources().get('CPU', 0)
    if held == expected or time.monotonic() > deadline:
      return held
    time.sleep(0.1)


@pytest.mark.slow  # Ray's actors compile the roles again: past 45 s on a loaded machine
def test_a_distillation_run_on_ray_equals_local(cluster, tmp_path):
  """The teacher actor asks for one CPU (``ray.teacher_resources``) and holds it while the run
  trains (the other actors ask for none); the run equals the local one."""
  del cluster
  held, ray_rows = _run('ray', tmp_path / 'ray', ray__teacher_resources={'CPU': 1})
  assert held == 1
  assert len(ray_rows) == 3 and all('distill/gkd' in r and 'distill/reverse_kl' in r
                                    for r in ray_rows)
  assert ray_rows == _run('local', tmp_path / 'local')[1]


@pytest.mark.slow  # two Ray runs of the roles; the restart options are checked in CI above
def test_a_killed_teacher_actor_restarts_and_the_run_is_unchanged(cluster, tmp_path):
  """The teacher actor's process is killed just before its 2nd scoring call (a lost process:
  ``no_restart=False``): Ray restarts it (``ray.teacher_restarts``), the new process loads
  the frozen teacher again and the call is retried there, and the run equals the local one."""
  del cluster
  config = smoke_config(
      backend='ray', total_steps=3, warmup__steps=0, rl__distill__kind='gkd',
      rl__distill__top_k=4, rl__distill__with_reward=False, teacher__enabled=True,
      rl__learning_rate=3e-3, log__tensorboard=False, eval__every_steps=0,
      checkpoint__every_steps=0, checkpoint__every_seconds=0.0, staleness__j=2,
      staleness__k=2)
  calls = []
  with build_run(config, tmp_path / 'ray', run_spec(config)) as run:
    ray_teacher = run.controller.kind.teacher.teacher
    score = ray_teacher.score

    def killed_before_the_second(tokens, loss_mask):
      calls.append(len(calls))
      if len(calls) == 2:
        ray.kill(ray_teacher.actor, no_restart=False)
      return score(tokens, loss_mask)
    ray_teacher.score = killed_before_the_second
    run.execute()
  assert len(calls) == 3
  rows = [{k: v for k, v in row.items() if not k.startswith('time/')}
          for row in read_metrics(tmp_path / 'ray' / 'metrics.jsonl')]
  assert rows == _run('local', tmp_path / 'local')[1]
