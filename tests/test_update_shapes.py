"""Dynamic sampling never changes the update's shape: whatever number of informative groups a
batch keeps, every update trains ``prompts_per_step`` groups (``short_batches='wait'``
carries a short batch's groups into the next one), so the trainer compiles its step once and
a long run compiles nothing new after its first update (the SmolLM2 head-to-head recipe:
no program compiled after step 1 in 22 steps, benchmarks/RESULTS.md "Peak memory on the
head-to-head recipe")."""

import pathlib

from rlax_llm.backends.local import build_run
from rlax_llm.cli import load_config_file
from rlax_llm.config import run_spec
from rlax_llm.metrics import read_metrics
from rlax_llm.tasks import ArithmeticTask
from rlax_llm.trainer import trainer as trainer_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent


class _SparseTask(ArithmeticTask):
  """Only prompts with id divisible by 3 can give a group unequal rewards, so batches keep
  different numbers of informative groups."""

  def score(self, prompt, completion):
    return float(len(completion) % 2) if prompt.prompt_id % 3 == 0 else 0.0


def test_waiting_for_informative_groups_compiles_one_update_step(tmp_path):
  # Trainers alike share their jitted step (trainer._programs is memoised per process): an
  # earlier test file in this process may have compiled the smoke config's step for another
  # batch shape, so this run starts from fresh programs and counts only its own compiles.
  trainer_lib._programs.cache_clear()  # pylint: disable=protected-access
  config = load_config_file(str(ROOT / 'configs/default.py') + ':smoke')
  config.total_steps = 6
  config.warmup.steps = 0  # the rewards are _SparseTask's: no competent model needed
  config.log.tensorboard = False
  config.rollout.oversample = 0.5  # 6 prompts per batch for 4 trained groups
  config.rollout.short_batches = 'wait'
  with build_run(config, tmp_path, run_spec(config)) as run:
    run.controller.kind.task = _SparseTask(num_eval=16)
    run.execute()
    trainer = run.controller.trainer.trainer
  rows = read_metrics(tmp_path / 'metrics.jsonl')
  informative = {r['rollout/trained_groups'] + r['rollout/recycled_groups'] for r in rows}
  updates = [r for r in rows if r['rollout/trained_groups']]
  assert len(informative) > 1, informative  # the batches kept different numbers of groups
  assert len(updates) >= 2 and all(r['rollout/trained_groups'] == 4 for r in updates)
  assert trainer.version == len(updates)
  assert trainer._step._cache_size() == 1  # pylint: disable=protected-access
