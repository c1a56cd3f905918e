"""benchmarks/distill_study.py: the arms' launch flags, reading a finished arm (steps and wall
seconds to the target, token rates), the goal's judgement, resumption, arguments and the plot
(no learning: the arms are fake workdirs or a fake runner)."""

import json
import pathlib
import sys

import pytest

from rlax_llm.cli import load_config
from rlax_llm.config import validate_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'benchmarks'))
import distill_study as study_lib  # benchmarks/ is not a package: on the path above


@pytest.mark.parametrize('arm', study_lib.ARMS)
def test_launch_flags_are_a_valid_run_of_each_arm(arm, tmp_path):
  """Each arm is a config the launcher accepts: its recipe, seed 0, its budget, the final step
  saved only, the teacher's export for the distillation arms."""
  args = study_lib.parse_args(['--output=/nonexistent/x.json', '--set=--config.rl.group_size=4',
                               '--distill_steps=120',
                               '--distill_set=--config.rl.learning_rate=5e-5'])
  config = load_config(study_lib.launch_flags(arm, args, tmp_path / 'teacher'))
  validate_config(config, read_hub=False)
  steps = 240 if arm == 'grpo' else 120
  assert (config.seed, config.total_steps, config.eval.every_steps) == (0, steps, 10)
  assert (config.checkpoint.every_steps, config.checkpoint.every_seconds) == (steps, 0)
  assert config.task.num_eval == 100 and config.rl.group_size == 4  # --set applies to all
  if arm == 'grpo':
    assert not config.teacher.enabled and config.rl.distill.kind == 'off'
    assert config.rl.learning_rate == 1e-5  # --distill_set leaves the teacher's run alone
  else:
    assert config.rl.learning_rate == 5e-5
    assert config.teacher.enabled and config.teacher.path == str(tmp_path / 'teacher')
    assert config.rl.distill.kind == 'reverse_kl'
    assert config.rl.distill.with_reward == (arm == 'distill_reward')


def _finished_arm(workdir: pathlib.Path, accuracies: dict[int, float], *, watched=True,
                  flags=None):
  """A workdir as a finished launch and the watcher leave it: 4 RL steps of 2 groups x 4
  samples, 10 s apart, the first arriving at 30 s after a 6 s step, evaluations at ``steps``;
  ``flags``: the launch's config arguments the watcher recorded."""
  workdir.mkdir(parents=True)
  (workdir / 'config.json').write_text(json.dumps({'rl': {'group_size': 4}}))
  rows = []
  for step in range(1, 5):
    row = {'step': step, 'time/step_s': 6.0, 'time/train_s': 2.0 * step,
           'time/rollout_tokens_per_s': 10.0 * step, 'rollout/trained_groups': 2,
           'completion/length_mean': 5.0}
    if step in accuracies:
      row['eval/accuracy'] = accuracies[step]
    rows.append(row)
  (workdir / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  (workdir / 'summary.json').write_text(json.dumps({
      'steps': 4, 'eval/start_accuracy': 0.25, 'eval/final_accuracy': accuracies[4],
      'time/rl_s': 40.04, 'time/total_s': 70.0}))
  if watched:
    (workdir / study_lib.WATCH_FILE).write_text(json.dumps(
        {'arrived': {str(s): 20.0 + 10 * s for s in range(1, 5)}, 'peak_rss_mib': 8146.04,
         'load_mean': 4.5, 'flags': flags}))


def test_read_arm_times_the_target_in_steps_and_wall_seconds(tmp_path):
  _finished_arm(tmp_path / 'arm', {2: 0.8, 4: 0.9})
  run = study_lib.read_arm(tmp_path / 'arm', 0.8)
  assert run['curve'] == [[0, 0.25], [2, 0.8], [4, 0.9]]
  assert run['wall_curve'] == [[24.0, 0.25], [40.0, 0.8], [60.0, 0.9]]  # start: 30 - 6
  assert (run['steps_to_target'], run['wall_s_to_target']) == (2, 40.0)
  assert (run['best'], run['best_step'], run['final']) == (0.9, 4, 0.9)
  # Rollout: median of 10, 20, 30, 40; train: 2 x 4 rows x 5 tokens / (2, 4, 6, 8) s.
  assert run['rollout_tokens_per_s'] == 25.0
  assert run['train_tokens_per_s'] == pytest.approx((40 / 4 + 40 / 6) / 2, rel=1e-4)
  assert (run['peak_rss_mib'], run['total_wall_s'], run['rl_s']) == (8146.0, 60.0, 40.0)
  assert run['load_mean'] == 4.5


def test_read_arm_not_reached_keeps_the_best_and_unfinished_is_none(tmp_path):
  _finished_arm(tmp_path / 'arm', {2: 0.7, 4: 0.6})
  run = study_lib.read_arm(tmp_path / 'arm', 0.8)
  assert run['steps_to_target'] is None and run['wall_s_to_target'] is None
  assert (run['best'], run['best_step']) == (0.7, 2)
  assert study_lib.read_arm(tmp_path / 'absent', 0.8) is None
  _finished_arm(tmp_path / 'unwatched', {4: 0.9}, watched=False)
  assert study_lib.read_arm(tmp_path / 'unwatched', 0.8) is None  # no wall times: not done
  _finished_arm(tmp_path / 'preempted', {4: 0.9})
  summary = json.loads((tmp_path / 'preempted' / 'summary.json').read_text())
  (tmp_path / 'preempted' / 'summary.json').write_text(json.dumps({**summary, 'preempted': True}))
  assert study_lib.read_arm(tmp_path / 'preempted', 0.8) is None  # a SIGTERM's exit 0


def _arm(steps_to, wall_to, steps=240, wall=3000.0):
  return {'steps_to_target': steps_to, 'wall_s_to_target': wall_to, 'steps': steps,
          'total_wall_s': wall}


def test_judge_needs_half_the_steps_and_half_the_wall_time():
  goals = study_lib.judge({'grpo': _arm(100, 2000.0), 'distill': _arm(50, 1000.0, 120),
                           'distill_reward': _arm(40, 1100.0, 120)}, 0.8)
  assert goals['distill']['status'] == 'met'  # exactly half of each counts
  assert (goals['distill']['grpo_steps'], goals['distill']['grpo_wall_s']) == (100, 2000.0)
  reward = goals['distill_reward']
  assert reward['status'] == 'missed' and reward['steps_met'] and not reward['wall_met']


def test_judge_not_reached_pending_and_grpo_short_of_the_target():
  goals = study_lib.judge({'grpo': _arm(100, 2000.0), 'distill': _arm(None, None, 120)}, 0.8)
  assert goals['distill']['status'] == 'missed' and not goals['distill']['steps_met']
  assert goals['distill_reward'] == {'status': 'pending'}
  # GRPO never got there: its whole run stands for its time to the target.
  short = study_lib.judge({'grpo': _arm(None, None), 'distill': _arm(110, 1400.0, 120)}, 0.8)
  assert short['distill']['status'] == 'met' and not short['distill']['grpo_reached']
  assert (short['distill']['grpo_steps'], short['distill']['grpo_wall_s']) == (240, 3000.0)


def test_study_resumes_arm_by_arm_and_refuses_other_settings(tmp_path):
  ran = []

  def fake_run(arm, args, root):
    ran.append(arm)
    assert root == tmp_path / 'runs'
    if arm == 'distill':
      raise SystemExit('interrupted')
    return {**_arm(100, 2000.0), 'start': 0.25, 'final': 0.85}

  argv = [f'--output={tmp_path / "study.json"}']
  with pytest.raises(SystemExit, match='interrupted'):
    study_lib.study(study_lib.parse_args(argv), fake_run)
  saved = json.loads((tmp_path / 'study.json').read_text())
  assert saved['finished'] == ['grpo'] and saved['goals']['distill'] == {'status': 'pending'}

  ran.clear()
  read = study_lib.study(study_lib.parse_args([*argv, '--no_run']), fake_run)
  assert not ran and read['arms'].keys() == {'grpo'}
  ran.clear()
  with pytest.raises(SystemExit, match='interrupted'):
    study_lib.study(study_lib.parse_args(argv), fake_run)
  assert ran == ['distill']  # grpo was not run again
  with pytest.raises(SystemExit, match='another --output'):  # another teacher
    study_lib.study(study_lib.parse_args([*argv, '--grpo_steps=200']), fake_run)


def test_a_new_distillation_budget_reruns_the_distillation_arms_only(tmp_path):
  ran = []

  def fake_run(arm, args, root):
    ran.append((arm, args.distill_steps))
    return {**_arm(100, 2000.0), 'start': 0.25, 'final': 0.85}

  argv = [f'--output={tmp_path / "study.json"}']
  study_lib.study(study_lib.parse_args(argv), fake_run)
  # By default the distillation arms get the steps GRPO took to reach the target.
  assert ran == [('grpo', 0), ('distill', 100), ('distill_reward', 100)]
  ran.clear()
  again = study_lib.study(study_lib.parse_args([*argv, '--distill_steps=60']), fake_run)
  assert ran == [('distill', 60), ('distill_reward', 60)]
  assert again['settings']['distill_steps'] == 60 and again['finished'] == list(study_lib.ARMS)
  # Tuning the distillation arms against the same teacher: only they run again.
  ran.clear()
  tuned = study_lib.study(study_lib.parse_args(
      [*argv, '--distill_steps=60', '--distill_set=--config.rl.distill.kind=gkd']), fake_run)
  assert ran == [('distill', 60), ('distill_reward', 60)]
  assert tuned['settings']['distill_set'] == ['--config.rl.distill.kind=gkd']


def test_the_default_budget_is_grpos_steps_to_the_target():
  args = study_lib.parse_args(['--output=x.json'])
  assert study_lib.distill_budget(args, _arm(60, 900.0)) == 60
  assert study_lib.distill_budget(args, _arm(None, None)) == 240  # not reached: all its steps
  given = study_lib.parse_args(['--output=x.json', '--distill_steps=30'])
  assert study_lib.distill_budget(given, _arm(60, 900.0)) == 30


def test_run_arm_reads_a_finished_workdir_back_without_launching(tmp_path, monkeypatch):
  args = study_lib.parse_args([f'--output={tmp_path / "s.json"}', '--distill_steps=4'])
  flags = study_lib.launch_flags('distill', args, tmp_path / 'teacher')
  _finished_arm(tmp_path / 'distill', {2: 0.5, 4: 0.85}, flags=flags)
  (tmp_path / 'distill' / 'checkpoints').mkdir()
  (tmp_path / 'teacher').mkdir()
  (tmp_path / 'teacher' / 'config.json').write_text('{}')
  launched = []

  def no_launch(command, *args, **kwargs):
    launched.append(command)
    raise RuntimeError('launched')

  monkeypatch.setattr(study_lib.subprocess, 'Popen', no_launch)
  run = study_lib.run_arm('distill', args, tmp_path)
  assert run['steps_to_target'] == 4 and run['flags'] == flags and not launched
  assert not (tmp_path / 'distill' / 'checkpoints').exists()  # its final save: not needed
  # A finished run of other config arguments (another --distill_set) is launched again.
  tuned = study_lib.parse_args([f'--output={tmp_path / "s.json"}', '--distill_steps=4',
                                '--distill_set=--config.rl.learning_rate=5e-5'])
  with pytest.raises(RuntimeError, match='launched'):
    study_lib.run_arm('distill', tuned, tmp_path)
  assert '--config.rl.learning_rate=5e-5' in launched[0]
  # The teacher's run launched again (another --set): the previous teacher's export goes.
  _finished_arm(tmp_path / 'grpo', {4: 0.9}, flags=['--config.seed=0'])
  with pytest.raises(RuntimeError, match='launched'):
    study_lib.run_arm('grpo', args, tmp_path)
  assert not (tmp_path / 'teacher').exists()


def test_a_distillation_arm_without_the_teacher_is_refused(tmp_path):
  args = study_lib.parse_args([f'--output={tmp_path / "s.json"}'])
  with pytest.raises(SystemExit, match='run the grpo arm first'):
    study_lib.run_arm('distill_reward', args, tmp_path)


@pytest.mark.parametrize('argv, message', [
    (['--set=rl.lr=1'], '--set takes'),
    (['--distill_set=--config.rl.lr'], '--distill_set takes'),
    (['--distill_steps=241'], 'no more steps than GRPO'),
    (['--distill_steps=-1'], 'in [0, --grpo_steps]'),
    (['--grpo_steps=0'], 'must be > 0'),
    (['--target=80'], 'is an accuracy'),
])
def test_bad_arguments_are_refused(argv, message, capsys):
  with pytest.raises(SystemExit):
    study_lib.parse_args(['--output=x.json', *argv])
  assert message in capsys.readouterr().err


def test_plot_draws_both_panels(tmp_path):
  arms = {arm: {'curve': [[0, 0.25], [10, 0.5 + i / 10]],
                'wall_curve': [[30.0, 0.25], [300.0, 0.5 + i / 10]]}
          for i, arm in enumerate(study_lib.ARMS[:2])}
  path = tmp_path / 'study.png'
  study_lib.plot({'settings': {'target': 0.8}, 'arms': arms}, path)
  assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_launch_is_watched_and_a_failure_names_its_log(tmp_path):
  """``_launch`` records each metrics line's arrival, the peak memory and the load; a launch
  that fails raises with its log's path (a stand-in process, not rlax_llm.launch)."""
  workdir = tmp_path / 'arm'
  workdir.mkdir()
  writes = ('import json, sys, time; f = open(sys.argv[1], "a")\n'
            'for step in (1, 2):\n'
            '  f.write(json.dumps({"step": step}) + "\\n"); f.flush(); time.sleep(0.6)\n')
  study_lib._launch([sys.executable, '-c', writes, str(workdir / 'metrics.jsonl')],
                    ['--config.seed=0'], workdir, tmp_path / 'arm.log')
  watched = json.loads((workdir / study_lib.WATCH_FILE).read_text())
  assert watched['flags'] == ['--config.seed=0']
  assert sorted(watched['arrived']) == ['1', '2']
  assert 0 < watched['arrived']['1'] < watched['arrived']['2']
  assert watched['peak_rss_mib'] > 0
  with pytest.raises(SystemExit, match='arm.log'):
    study_lib._launch([sys.executable, '-c', 'raise SystemExit(3)'], [], workdir,
                      tmp_path / 'arm.log')
