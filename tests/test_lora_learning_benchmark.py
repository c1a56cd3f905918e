"""benchmarks/lora_learning.py in tiny form: its commands, and the curves, differences and goal
flags it reads from finished runs' workdirs (made up here; no run is launched)."""

import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    'lora_learning', ROOT / 'benchmarks/lora_learning.py')
lora_learning = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lora_learning)


def fake_run(workdir: pathlib.Path, curve: dict[int, float], kl: float | None = None) -> None:
  """A finished run's metrics.jsonl (a train row per step, eval rows) and summary.json."""
  workdir.mkdir(parents=True)
  rows = []
  for step in range(1, max(curve) + 1):
    row = {'step': step, 'loss': 0.1}
    if kl is not None:
      row.update({'mismatch/kl': kl * step, 'mismatch/p95_abs_dlogp': 0.5})
    if step in curve:
      row['eval/accuracy'] = curve[step]
    rows.append(row)
  rows[0]['eval/start_accuracy'] = curve[0]
  (workdir / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  (workdir / 'summary.json').write_text(json.dumps({
      'eval/start_accuracy': curve[0], 'eval/final_accuracy': curve[max(curve)],
      'time/rl_s': 12.5}))


def test_commands_carry_each_arms_switches_and_shorten_smollm2s_schedule_alike(tmp_path):
  tiny = lora_learning.command('tiny', 'int8_tis', 2, None, 20, tmp_path / 'w')
  assert tiny[1:4] == ['-m', 'rlax_llm.launch', '--config=configs/default.py']
  assert {'--config.model.inference_quant=int8', '--config.rl.old_logprobs=recompute',
          '--config.rl.mismatch.enabled=true', '--config.eval.every_steps=20',
          '--config.seed=2', f'--workdir={tmp_path / "w"}'} == set(tiny[4:])
  full = lora_learning.command('smollm2', 'full', 0, 160, 20, tmp_path / 'f')
  lora = lora_learning.command('smollm2', 'lora', 0, 160, 20, tmp_path / 'f')
  assert full[3] == '--config=configs/smollm2.py' and lora[3] == '--config=configs/smollm2.py:lora'
  assert full[4:] == lora[4:] == ['--config.total_steps=160', '--config.rl.lr_decay_steps=117',
                                  '--config.eval.every_steps=20', f'--workdir={tmp_path / "f"}']
  more = lora_learning.command('smollm2', 'lora', 1, 120, 20, tmp_path / 'g', num_eval=250)
  assert more[4:] == ['--config.total_steps=120', '--config.rl.lr_decay_steps=88',
                      '--config.eval.every_steps=20', '--config.task.num_eval=250',
                      '--config.seed=1', f'--workdir={tmp_path / "g"}']


def test_reads_curves_and_mismatch_and_judges_every_eval_from_the_step_on(tmp_path):
  fake_run(tmp_path / 'full0', {0: 0.3, 20: 0.6, 40: 0.9, 60: 0.95})
  fake_run(tmp_path / 'full1', {0: 0.4, 20: 0.7, 40: 0.9, 60: 0.97})
  fake_run(tmp_path / 'int8', {0: 0.35, 20: 0.5, 40: 0.89, 60: 0.93}, kl=0.001)
  fake_run(tmp_path / 'int8b', {0: 0.35, 20: 0.5, 40: 0.88, 60: 0.91}, kl=0.001)
  run = lora_learning.read_run(tmp_path / 'int8')
  assert run['curve'] == [(0, 0.35), (20, 0.5), (40, 0.89), (60, 0.93)]
  assert run['final_accuracy'] == 0.93 and run['rl_s'] == 12.5
  assert run['mismatch']['mismatch/kl']['steps'] == 60
  assert abs(run['mismatch']['mismatch/kl']['max'] - 0.06) < 1e-12
  assert abs(run['mismatch']['mismatch/kl']['mean'] - 0.0305) < 1e-12
  assert lora_learning.read_run(tmp_path / 'full0')['mismatch'] == {}

  runs = {'full': [lora_learning.read_run(tmp_path / d) for d in ('full0', 'full1')],
          'int8_tis': [lora_learning.read_run(tmp_path / 'int8')],
          'int8': [lora_learning.read_run(tmp_path / 'int8b')]}
  assert [s for s, _ in lora_learning.mean_curve(runs['full'])] == [0, 20, 40, 60]
  out = lora_learning.summarise(runs, ['int8'], from_step=40, max_points=3.0)['int8']
  tis, plain = out['int8_tis'], out['int8']
  assert [r['diff_points'] for r in tis['per_eval']] == [0.0, -15.0, -1.0, -3.0]
  assert tis['judged_evals'] == 2 and tis['max_abs_diff_points'] == 3.0 and tis['goal_met']
  assert plain['max_abs_diff_points'] == 5.0 and not plain['goal_met']  # 91 vs 96 at step 60
  assert tis['mismatch_by_seed'][0]['mismatch/kl']['steps'] == 60
  # No evaluation at or after the step: nothing judged, the goal not met.
  late = lora_learning.compare([[0, 0.5]], [[0, 0.5]], from_step=100, max_points=3.0)
  assert late['judged_evals'] == 0 and not late['goal_met']


def test_main_reads_finished_runs_without_launching_and_prints_one_json(tmp_path, monkeypatch,
                                                                       capsys):
  for arm in ('full', 'lora'):
    fake_run(tmp_path / f'tiny_{arm}_s0', {0: 0.3, 100: 0.9, 120: 0.92})
  monkeypatch.setattr(sys, 'argv', ['lora_learning.py', '--comparisons=lora',
                                    f'--root={tmp_path}'])
  monkeypatch.setattr(lora_learning.subprocess, 'Popen', None)  # a launch would fail here
  lora_learning.main()
  report = json.loads(capsys.readouterr().out)
  assert report['comparisons']['lora']['lora']['goal_met']
  assert report['mean_curves']['lora'] == [[0, 0.3], [100, 0.9], [120, 0.92]]
  assert '--config.lora.rank=16' in report['commands']['lora/s0']


def test_arms_keeps_some_arms_only_and_refuses_unknown_ones(tmp_path, monkeypatch, capsys):
  """--arms=full,int8_tis reads those two (the int8 arm has no run and is not launched)."""
  for arm in ('full', 'int8_tis'):
    fake_run(tmp_path / f'tiny_{arm}_s1', {0: 0.3, 100: 0.9, 120: 0.92 if arm == 'full' else 0.85},
             kl=1e-3)
  argv = ['lora_learning.py', '--comparisons=int8', '--seeds=1', f'--root={tmp_path}']
  monkeypatch.setattr(sys, 'argv', argv + ['--arms=full,int8_tis'])
  monkeypatch.setattr(lora_learning.subprocess, 'Popen', None)  # a launch would fail here
  lora_learning.main()
  report = json.loads(capsys.readouterr().out)
  assert set(report['runs']) == {'full', 'int8_tis'}
  result = report['comparisons']['int8']
  assert set(result) == {'int8_tis'} and not result['int8_tis']['goal_met']
  assert result['int8_tis']['max_abs_diff_points'] == 7.0
  monkeypatch.setattr(sys, 'argv', argv + ['--arms=full,lora'])
  with pytest.raises(SystemExit):
    lora_learning.main()
  assert 'lora not in the arms of --comparisons=int8' in capsys.readouterr().err


def test_an_int8_arm_starts_from_the_full_runs_warmup_with_its_own_config(tmp_path):
  base, arm = tmp_path / 'tiny_full_s0', tmp_path / 'tiny_int8_tis_s0'
  (base / 'checkpoints' / 'warmup' / '0').mkdir(parents=True)
  (base / 'checkpoints' / 'warmup' / '0' / 'params').write_text('w')
  (base / 'checkpoints' / 'steps' / '50').mkdir(parents=True)
  config = {'model': {'inference_quant': 'none'}, 'seed': 0,
            'rl': {'old_logprobs': 'behaviour', 'mismatch': {'enabled': False}}}
  (base / 'config.json').write_text(json.dumps(config))
  assert lora_learning.share_warmup(base, arm, lora_learning.TINY_ARMS['int8_tis'])
  assert (arm / 'checkpoints' / 'warmup' / '0' / 'params').read_text() == 'w'
  assert not (arm / 'checkpoints' / 'steps').exists()  # the RL steps are the arm's own
  assert json.loads((arm / 'config.json').read_text()) == {
      'model': {'inference_quant': 'int8'}, 'seed': 0,
      'rl': {'old_logprobs': 'recompute', 'mismatch': {'enabled': True}}}
  assert not lora_learning.share_warmup(base, arm, [])  # never over an existing workdir
  assert not lora_learning.share_warmup(tmp_path / 'none', tmp_path / 'x', [])
