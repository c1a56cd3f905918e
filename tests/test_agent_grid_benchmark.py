"""benchmarks/agent_grid.py: the grid puzzle's GRPO vs GiGPO comparison runs both estimators on
the same budget and reads each run's before / after / curve from its workdir."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from rlax_llm.cli import load_config_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'benchmarks'))
import agent_grid  # benchmarks/ is not a package: on the path above

# A 2x2 grid of 2 turns, one step of 8 episodes (the tests' 8 host devices split the batch),
# two held-out episodes: what the slow test runs.
TINY = ['--config.env.size=2', '--config.env.max_turns=2', '--config.agent.num_eval=2',
        '--config.rl.prompts_per_step=4', '--config.rl.group_size=2',
        '--config.sampling.max_prompt_len=16', '--config.sampling.max_new_tokens=112',
        '--config.model.max_seq_len=129', '--config.agent.max_turn_tokens=4',
        '--config.rollout.slots=4', '--config.warmup.steps=2', '--config.warmup.batch_size=8']


def _flat(config) -> dict:
  return {k: v for k, v in json.loads(config.to_json()).items() if k != 'name'}


def test_the_validation_split_evaluates_on_validation_seeds():
  from rlax_llm.envs.seeds import VALIDATION_SEED_START, seed_split
  assert agent_grid.SPLITS['held_out'] == []  # the recipe's own held-out seeds
  (flag,) = agent_grid.SPLITS['validation']
  assert flag == f'--config.agent.eval_seed_start={VALIDATION_SEED_START}'
  assert seed_split(VALIDATION_SEED_START) == 'validation'


def test_the_two_estimators_differ_only_in_the_estimator():
  """Same budget: grid_small and grid_small_gigpo are one config but rl.advantage_estimator."""
  grpo, gigpo = (load_config_file(str(ROOT / f'configs/agent.py:{v}'))
                 for v in agent_grid.VARIANTS.values())
  assert gigpo.rl.advantage_estimator == 'gigpo'
  assert grpo.rl.advantage_estimator != 'gigpo'
  gigpo.rl.advantage_estimator = grpo.rl.advantage_estimator
  assert _flat(grpo) == _flat(gigpo)
  assert grpo.env.shaping == 0.0 and grpo.env.size == 4  # only the goal pays; holes matter


def _fake_run(workdir: pathlib.Path) -> None:
  """A workdir as a launch leaves it: metrics rows (eval every 2 steps) and the summary."""
  workdir.mkdir()
  rows = [{'step': 1, 'episode/success': 0.25, 'eval/start_success': 0.5, 'grad_norm': 0.0,
           'entropy': 0.2, 'credit/flat_groups': 1.0},
          {'step': 2, 'episode/success': 0.5, 'eval/success': 0.625, 'grad_norm': 0.5,
           'entropy': 0.1, 'credit/flat_groups': 0.5},
          {'step': 3, 'episode/success': 0.75, 'eval/success': 0.75, 'grad_norm': 0.25,
           'entropy': 0.05}]
  (workdir / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  (workdir / 'summary.json').write_text(json.dumps({
      'steps': 3, 'eval/start_accuracy': 0.5, 'eval/final_accuracy': 0.75,
      'warmup/time_s': 1.5, 'time/rl_s': 9.0}))


def test_read_run_and_the_means(tmp_path):
  _fake_run(tmp_path / 'run')
  run = agent_grid.read_run(tmp_path / 'run')
  assert run['before'] == 0.5 and run['after'] == 0.75
  assert run['curve'] == [[0, 0.5], [2, 0.625], [3, 0.75]]
  assert run['best'] == 0.75 and run['train_success_first_last'] == [0.25, 0.75]  # 1 each
  # The per-step diagnostics: only the metrics the run logged, None where a step lacks one.
  assert run['diagnostics'] == {'episode/success': [0.25, 0.5, 0.75], 'entropy': [0.2, 0.1, 0.05],
                                'grad_norm': [0.0, 0.5, 0.25],
                                'credit/flat_groups': [1.0, 0.5, None]}
  assert run['zero_grad_steps'] == 1
  means = agent_grid.summarise([
      {'estimator': 'grpo', 'seed': 0, **run},
      {'estimator': 'grpo', 'seed': 1, **run, 'after': 0.25},
      {'estimator': 'gigpo', 'seed': 0, **run}])
  assert means['grpo'] == {'before': 0.5, 'after': 0.5, 'gain': 0.0, 'seeds': [0, 1],
                           'train_success_first_last': [0.25, 0.75]}
  assert means['gigpo']['gain'] == 0.25


def test_plot_reads_the_printed_json_back(tmp_path):
  """--from_json with --plot draws the runs of a saved JSON (one panel per estimator)."""
  _fake_run(tmp_path / 'run')
  run = agent_grid.read_run(tmp_path / 'run')
  runs = [{'estimator': e, 'seed': s, **run} for e in ('grpo', 'gigpo') for s in (0, 1)]
  saved = tmp_path / 'grid.json'
  saved.write_text(json.dumps({'runs': runs, 'means': agent_grid.summarise(runs),
                               'split': 'held_out'}))
  result = subprocess.run(
      [sys.executable, 'benchmarks/agent_grid.py', f'--from_json={saved}',
       f'--plot={tmp_path / "grid.png"}'], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
      capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads(result.stdout)['gigpo']['gain'] == 0.25
  assert (tmp_path / 'grid.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


@pytest.mark.slow  # two launches: 1-7 minutes on a shared 2-core machine
def test_a_tiny_run_of_the_benchmark_prints_its_json():
  result = subprocess.run(
      [sys.executable, 'benchmarks/agent_grid.py', '--seeds=0', '--steps=1', '--parallel=2',
       '--', *TINY], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
      capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout)
  assert [(r['estimator'], r['seed']) for r in report['runs']] == [('grpo', 0), ('gigpo', 0)]
  for run in report['runs']:
    assert 0 <= run['before'] <= 1 and 0 <= run['after'] <= 1
    assert run['curve'][0] == [0, run['before']] and run['curve'][-1] == [1, run['after']]
    assert run['warmup_s'] is not None  # the warm-up ran
  assert set(report['means']) == {'grpo', 'gigpo'}
