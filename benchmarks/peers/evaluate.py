r"""The head-to-head's one evaluator: greedy held-out accuracy of every side's checkpoints.

Runs in rlax_llm's virtual environment, so no library grades itself: each Hugging Face
checkpoint a side saved (``<run_dir>/checkpoints.jsonl``) is read by rlax_llm's loader
(``from_pretrained``) into one inference worker built once from configs/smollm2.py (the
recipe's model, sampling lengths and chat rendering), its held-out prompts are decoded
greedily, and each completion is scored by benchmarks/peers/reward.py against the job's
``eval.jsonl`` rows. Step 0 is the job's exported model (every side's start).

    .venv/bin/python benchmarks/peers/evaluate.py --job=JOB.json --run_dirs=DIR[,DIR...] \
        [--num_eval=N] [--output=FILE.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parents[1]))

import common  # noqa: E402
import reward as reward_lib  # noqa: E402
from job import recipe_config  # noqa: E402


def check_rows(prompts, rows) -> None:
  """Raises unless the job's eval rows are the task's held-out prompts, in order."""
  for prompt, row in zip(prompts, rows):
    if prompt.answer != row['answer'] or list(prompt.messages) != [
        {k: v for k, v in m.items()} for m in row['messages']]:
      raise SystemExit(f'eval row {row["prompt_id"]} is not held-out prompt '
                       f'{prompt.prompt_id}: re-write the job (job.py).')


class Evaluator:
  """One inference worker of the recipe (its first ``num_eval`` held-out prompts); loads a
  checkpoint's weights into it and returns the greedy accuracy by benchmarks/peers/reward.py."""

  def __init__(self, job: dict[str, Any], num_eval: int | None = None):
    # pylint: disable=import-outside-toplevel  # jax and the model code
    import jax

    from rlax_llm.data_types import GenerationRequest
    from rlax_llm.evaluate import policy_worker
    from rlax_llm.sampling_spec import GREEDY
    config = recipe_config()
    config.model.path = job['model_dir']
    _, task, self.worker = policy_worker(config)
    self.rows = job['eval_rows'][:num_eval]
    prompts = task.eval_prompts()[:len(self.rows)]
    check_rows(prompts, self.rows)
    self.requests = [GenerationRequest(p, 1, GREEDY, config.sampling.max_new_tokens)
                     for p in prompts]
    self.key = jax.random.key(config.seed)
    self.version = 0

  def completions(self, model_dir: str | pathlib.Path | None = None) -> list[str]:
    """Greedy completions of the held-out prompts by the weights in ``model_dir`` (None: the
    ones held, first the job's export)."""
    # pylint: disable=import-outside-toplevel
    from rlax_llm.models import from_pretrained
    from rlax_llm.models.model import cast_params, split_module
    if model_dir is not None:
      module, _ = from_pretrained(model_dir)
      self.version += 1
      self.worker.load(self.version, cast_params(split_module(module)[1], self.worker.model))
    rollouts = self.worker.generate(self.requests, self.key)
    texts = [''] * len(self.requests)
    for group, text in zip(rollouts.group_ids, rollouts.completions):
      texts[int(group)] = text
    return texts

  def accuracy(self, model_dir: str | pathlib.Path | None = None) -> float:
    """Greedy held-out accuracy of ``model_dir``'s weights by the job's reward."""
    texts = self.completions(model_dir)
    return sum(reward_lib.reward(t, r['a'], r['op'], r['b'], r['answer'])
               for t, r in zip(texts, self.rows)) / len(self.rows)


def evaluate_runs(job: dict[str, Any], run_dirs: list[str], num_eval: int | None = None
                  ) -> dict[str, Any]:
  """``{'start': accuracy of the export, side: [{step, wall_s, accuracy}, ...]}`` over every
  checkpoint in ``run_dirs`` (each holding a ``side.json``)."""
  evaluator = Evaluator(job, num_eval)
  start = time.perf_counter()
  out: dict[str, Any] = {'num_eval': len(evaluator.rows), 'start': evaluator.accuracy()}
  for run_dir in run_dirs:
    side = json.loads((pathlib.Path(run_dir) / 'side.json').read_text())['side']
    out[side] = [{'step': 0, 'wall_s': 0.0, 'accuracy': out['start']}] + [
        {'step': c['step'], 'wall_s': c['wall_s'], 'accuracy': evaluator.accuracy(c['path'])}
        for c in common.read_jsonl(pathlib.Path(run_dir) / 'checkpoints.jsonl')]
  out['eval_s'] = time.perf_counter() - start
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--job', required=True)
  parser.add_argument('--run_dirs', required=True, help='comma-separated run directories')
  parser.add_argument('--num_eval', type=int, default=None, help='default: every eval row')
  parser.add_argument('--output', default=None)
  args = parser.parse_args()
  result = evaluate_runs(common.read_job(args.job), args.run_dirs.split(','), args.num_eval)
  text = json.dumps(result, indent=2)
  if args.output:
    pathlib.Path(args.output).write_text(text)
  print(text)


if __name__ == '__main__':
  main()
