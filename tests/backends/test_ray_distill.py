"""On-policy distillation on Ray: the teacher in an actor of its own (``TeacherRole``), asked
by the driver's controller for each batch's scores, gives the run the local backend gives
(every metric but ``time/``, ``distill/`` included). Its local counterpart in the default
run: tests/test_distill_resume.py (a local distillation run, and its exact resume)."""

import pytest

ray = pytest.importorskip('ray')

from rlax_llm.backends import build_run  # noqa: E402
from rlax_llm.config import run_spec  # noqa: E402
from rlax_llm.metrics import read_metrics  # noqa: E402

from smoke_config import smoke_config  # noqa: E402  (tests/smoke_config.py)


def _run(backend, workdir):
  config = smoke_config(
      backend=backend, total_steps=3, warmup__steps=0, rl__distill__kind='gkd',
      rl__distill__top_k=4, rl__distill__with_reward=False, teacher__enabled=True,
      rl__learning_rate=3e-3, log__tensorboard=False, eval__every_steps=0,
      checkpoint__every_steps=0, checkpoint__every_seconds=0.0, staleness__j=2,
      staleness__k=2)
  with build_run(config, workdir, run_spec(config)) as run:
    run.execute()
  return [{k: v for k, v in row.items() if not k.startswith('time/')}
          for row in read_metrics(workdir / 'metrics.jsonl')]


@pytest.mark.slow  # Ray's actors compile the roles again: past 45 s on a loaded machine
def test_a_distillation_run_on_ray_equals_local(cluster, tmp_path):
  del cluster
  ray_rows = _run('ray', tmp_path / 'ray')
  assert len(ray_rows) == 3 and all('distill/gkd' in r and 'distill/reverse_kl' in r
                                    for r in ray_rows)
  assert ray_rows == _run('local', tmp_path / 'local')
