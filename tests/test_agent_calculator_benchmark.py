"""benchmarks/agent_calculator.py: the calculator study runs the warm-up alone at each length
and the recipe (warm-up, then RL) for each seed, shares the warm-up between them through one
cache, judges the goal per seed and resumes finished runs."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'benchmarks'))
import agent_calculator  # benchmarks/ is not a package: on the path above

from rlax_llm.cli import load_config

# Held-out success of the fake runs: the warm-up alone by its length, and the RL run's end.
ALONE = {24: 0.44, 48: 0.30}
RL_AFTER = 0.9


def _fake_launch(calls):
  """A stand-in for ``subprocess.run`` of a launch: writes the workdir a finished run leaves
  (its config, summary and metrics rows), its figures by the command's warm-up length and
  total_steps."""

  def run(command, **kwargs):
    del kwargs
    calls.append(command)
    flags = dict(arg[2:].split('=', 1) for arg in command if arg.startswith('--'))
    workdir = pathlib.Path(flags['workdir'])
    workdir.mkdir(parents=True)
    config = load_config([arg for arg in command if arg.startswith('--config')])
    (workdir / 'config.json').write_text(config.to_json_best_effort())
    steps = int(flags.get('config.warmup.steps', agent_calculator.recipe_warmup_steps()))
    before = ALONE[steps]
    after = before if flags.get('config.total_steps') == '0' else RL_AFTER
    rows = [{'step': 0, 'eval/start_success': before}]
    if after != before:
      rows += [{'step': 2, 'grad_norm': 0.5, 'eval/success': after}]
    (workdir / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    (workdir / 'summary.json').write_text(json.dumps({
        'steps': 2 if after != before else 0, 'eval/start_accuracy': before,
        'eval/final_accuracy': after, 'time/rl_s': 1.0, 'preempted': False}))
    return subprocess.CompletedProcess(command, 0, '', '')

  return run


def test_the_recipes_warmup_runs_alone_first_and_every_run_shares_one_cache(tmp_path):
  recipe = agent_calculator.recipe_warmup_steps()
  assert recipe == 24  # configs/agent.py:calculator_erring
  jobs = agent_calculator.jobs(1, [48, 24], tmp_path)
  assert [name for name, _ in jobs] == ['seed1_warmup24', 'seed1_rl', 'seed1_warmup48']
  cache = f'--config.warmup.cache={tmp_path / "warmup_cache"}'
  for name, overrides in jobs:
    assert '--config.seed=1' in overrides and cache in overrides, (name, overrides)
    assert ('--config.total_steps=0' in overrides) == ('warmup' in name)
  assert '--config.warmup.steps=48' in dict(jobs)['seed1_warmup48']
  # Without the recipe's length among them the RL run goes first: nothing to restore.
  assert [name for name, _ in agent_calculator.jobs(0, [48], tmp_path)] == [
      'seed0_rl', 'seed0_warmup48']


def test_the_study_judges_each_seed_against_the_best_warmup_alone(tmp_path, monkeypatch,
                                                                   capsys):
  calls = []
  monkeypatch.setattr(agent_calculator.subprocess, 'run', _fake_launch(calls))
  monkeypatch.setattr(sys, 'argv', ['agent_calculator.py', '--seeds=0,1', '--min_points=45',
                                    f'--workdir={tmp_path}', '--', '--config.agent.num_eval=4'])
  agent_calculator.main()
  report = json.loads(capsys.readouterr().out)
  assert len(calls) == 6 and all('--config.agent.num_eval=4' in c for c in calls)
  assert [seed['seed'] for seed in report['seeds']] == [0, 1]
  seed = report['seeds'][0]
  assert seed['warmup_alone'] == {'24': 0.44, '48': 0.30}
  assert seed['plateau'] == 0.44 and seed['rl']['before'] == 0.44 and seed['rl']['after'] == 0.9
  assert seed['gain'] == pytest.approx(46.0) and seed['met'] and report['met']
  assert seed['rl_starts_where_the_warmup_ended'] is True
  assert seed['rl']['curve'] == [[0, 0.44], [2, 0.9]]
  # Judged per seed: a goal of 47 points is missed by every seed (+46 each).
  monkeypatch.setattr(sys, 'argv', ['agent_calculator.py', '--seeds=0', '--min_points=47',
                                    f'--workdir={tmp_path}', '--', '--config.agent.num_eval=4'])
  agent_calculator.main()
  again = json.loads(capsys.readouterr().out)
  assert not again['met'] and not again['seeds'][0]['met']
  # The finished runs were read from the workdir, not launched again.
  assert len(calls) == 6 and all(wall is None for wall in again['seeds'][0]['wall_s'].values())
  # Runs of another config there (another override) are cleared and launched again.
  monkeypatch.setattr(sys, 'argv', ['agent_calculator.py', '--seeds=0', '--warmup_alone=24',
                                    f'--workdir={tmp_path}', '--', '--config.agent.num_eval=5'])
  agent_calculator.main()
  rerun = json.loads(capsys.readouterr().out)
  assert len(calls) == 8 and all('--config.agent.num_eval=5' in c for c in calls[6:])
  assert all(wall is not None for wall in rerun['seeds'][0]['wall_s'].values())


def test_a_failed_run_stops_the_study_with_its_command_and_stderr(tmp_path, monkeypatch):
  def failing(command, **kwargs):
    del kwargs
    return subprocess.CompletedProcess(command, 1, '', 'error: config.env: bad value')

  monkeypatch.setattr(agent_calculator.subprocess, 'run', failing)
  with pytest.raises(SystemExit, match=r'seed0_warmup24 failed \(exit 1; .*calculator_erring'
                                       r'[\s\S]*bad value'):
    agent_calculator.run_one('seed0_warmup24', [], tmp_path / 'run', [])


def test_bad_warmup_lengths_are_refused(monkeypatch, capsys):
  monkeypatch.setattr(sys, 'argv', ['agent_calculator.py', '--warmup_alone=24,0'])
  with pytest.raises(SystemExit):
    agent_calculator.main()
  assert 'must be positive, got [24, 0]' in capsys.readouterr().err
