"""benchmarks/staleness_study.py: the M2PO staleness study's cell order, launch flags, reading
of a finished run, aggregation, goal judgement and resumption (no learning: the cells are
fake workdirs or a fake runner)."""

import json
import pathlib
import sys

import pytest

from rlax_llm.cli import load_config
from rlax_llm.config import validate_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'benchmarks'))
import staleness_study as study_lib  # benchmarks/ is not a package: on the path above


def test_cell_order_runs_the_claim_first_and_tis_last():
  order = study_lib.cell_order(['grpo', 'grpo_tis', 'm2po'], [0, 16, 64, 256], [0, 1, 2])
  keys = [study_lib.cell_key(*c) for c in order]
  assert len(keys) == len(set(keys)) == 36
  assert keys[:4] == ['grpo-s0-seed0', 'm2po-s0-seed0', 'grpo-s256-seed0', 'm2po-s256-seed0']
  assert keys[4:12] == ['grpo-s0-seed1', 'm2po-s0-seed1', 'grpo-s256-seed1', 'm2po-s256-seed1',
                        'grpo-s0-seed2', 'm2po-s0-seed2', 'grpo-s256-seed2', 'm2po-s256-seed2']
  assert {k.split('-s')[1].split('-')[0] for k in keys[12:24]} == {'16', '64'}
  assert all(k.startswith('grpo_tis-') for k in keys[24:])


@pytest.mark.parametrize('loss', list(study_lib.LOSSES))
def test_launch_flags_are_a_valid_run_with_the_schedule(loss):
  """Every loss's cell at staleness 256 is a config the launcher accepts: (j, k) = (1, 257),
  the study's task and budget, the loss's own keys."""
  args = study_lib.parse_args(['--output=/nonexistent/x.json', '--set=--config.rl.group_size=4'])
  flags = study_lib.launch_flags(loss, 256, 2, args)
  config = load_config(flags)
  validate_config(config, read_hub=False)
  assert (config.staleness.j, config.staleness.k) == (1, 257)
  assert (config.seed, config.total_steps, config.rl.learning_rate) == (2, 800, 1e-5)
  assert (config.task.max_operand, config.task.operations) == (999, '+')
  assert config.rl.group_size == 4  # --set applies to every cell
  assert config.checkpoint.every_steps == 801  # the warm-up is saved, no step before the end
  assert config.rl.loss == ('m2po' if loss == 'm2po' else 'grpo')
  assert config.rl.old_logprobs == ('recompute' if loss == 'grpo_tis' else 'behaviour')


def _finished_run(workdir: pathlib.Path, start: float, final: float, masked: float = 0.1):
  """A workdir as a finished launch leaves it: 4 RL steps, evaluations at 2 and 4."""
  workdir.mkdir(parents=True)
  _write_run(workdir, start, final, masked)


def _write_run(workdir: pathlib.Path, start: float, final: float, masked: float = 0.1):
  rows = []
  for step in range(1, 5):
    row = {'step': step, 'reward/mean': 0.25 * step, 'staleness/mean': 3.0,
           'staleness/max': 3 + step % 2, 'clip_fraction': 0.5, 'is/ratio_mean': 1.25,
           'm2po/masked_fraction': masked * step}
    if step % 2 == 0:
      row['eval/accuracy'] = final if step == 4 else (start + final) / 2
    rows.append(row)
  (workdir / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  (workdir / 'summary.json').write_text(json.dumps({
      'steps': 4, 'eval/start_accuracy': start, 'eval/final_accuracy': final,
      'time/rl_s': 12.34, 'time/total_s': 20.0}))


def test_read_run_keeps_the_curve_and_the_step_series(tmp_path):
  assert study_lib.read_run(tmp_path / 'absent') is None
  _finished_run(tmp_path / 'run', 0.2, 0.6, masked=0.125)
  run = study_lib.read_run(tmp_path / 'run')
  assert (run['start'], run['final'], run['steps'], run['max_staleness']) == (0.2, 0.6, 4, 4)
  assert run['curve'] == [[0, 0.2], [2, 0.4], [4, 0.6]]
  assert run['series']['m2po/masked_fraction'] == [0.125, 0.25, 0.375, 0.5]
  assert run['series']['clip_fraction'] == [0.5] * 4
  assert 'is/m2' not in run['series']  # not logged by this run: skipped
  assert (run['rl_s'], run['total_s']) == (12.3, 20.0)
  summary = json.loads((tmp_path / 'run' / 'summary.json').read_text())
  (tmp_path / 'run' / 'summary.json').write_text(json.dumps({**summary, 'preempted': True}))
  assert study_lib.read_run(tmp_path / 'run') is None  # stopped by a signal: run it again


def _cell(final: float, masked: float = 0.0) -> dict:
  return {'start': 0.2, 'final': final, 'curve': [[0, 0.2], [2, 0.5], [4, final]],
          'series': {'m2po/masked_fraction': [masked, 3 * masked]}}


def test_aggregate_gives_mean_spread_and_marks_missing_seeds():
  cells = {'grpo-s0-seed0': _cell(0.6), 'grpo-s0-seed1': _cell(0.7),
           'm2po-s0-seed0': _cell(0.5, masked=0.25)}
  table = study_lib.aggregate(cells, ['grpo', 'm2po'], [0, 256], [0, 1])
  grpo = table['grpo']['0']
  assert grpo['finals'] == [0.6, 0.7] and grpo['complete']
  assert grpo['mean'] == pytest.approx(0.65) and grpo['spread'] == pytest.approx(0.1)
  assert grpo['curve_means'] == pytest.approx([0.55, 0.6])  # step 0 left out
  assert grpo['curve_mean'] == pytest.approx(0.575)
  m2po = table['m2po']['0']
  assert m2po['finals'] == [0.5, None] and not m2po['complete']
  assert m2po['series_means']['m2po/masked_fraction'] == 0.5
  assert '256' not in table['grpo']  # no seed finished: no row


def _table(grpo0, grpo256, m2po256):
  cells = {}
  for loss, s, finals in (('grpo', 0, grpo0), ('grpo', 256, grpo256), ('m2po', 256, m2po256)):
    for seed, final in enumerate(finals):
      cells[study_lib.cell_key(loss, s, seed)] = _cell(final)
  return study_lib.aggregate(cells, ['grpo', 'm2po'], [0, 256], [0, 1, 2])


def test_judge_reproduced_ordering_is_met():
  goals = study_lib.judge(_table([0.60, 0.62, 0.64], [0.40, 0.45, 0.42], [0.61, 0.66, 0.63]),
                          [0, 256])
  assert goals['grpo_falls']['status'] == 'met'
  assert goals['grpo_falls']['gap'] == pytest.approx(0.4233333 - 0.62)
  assert goals['grpo_falls']['spread'] == pytest.approx(0.05)  # grpo s=256's max - min
  assert goals['grpo_falls']['curve_mean_gap'] == pytest.approx((0.4233333 - 0.62) / 2)
  assert goals['grpo_falls']['paired_gaps'] == pytest.approx([-0.2, -0.17, -0.22])
  assert goals['m2po_holds']['status'] == 'met'  # above on-policy counts as holding


def test_judge_misses_inside_the_spread_and_waits_for_seeds():
  # GRPO at 256 only 0.03 lower with a 0.08 spread: not a fall; M2PO 0.2 lower: not holding.
  goals = study_lib.judge(_table([0.56, 0.60, 0.64], [0.55, 0.57, 0.59], [0.38, 0.42, 0.40]),
                          [0, 256])
  assert goals['grpo_falls']['status'] == goals['m2po_holds']['status'] == 'missed'
  pending = study_lib.judge(_table([0.6, 0.6, 0.6], [0.4, 0.4], [0.6, 0.6, 0.6]), [0, 256])
  assert pending['grpo_falls'] == {'status': 'pending'}
  assert pending['m2po_holds']['status'] == 'met'


def test_study_resumes_without_rerunning_finished_cells(tmp_path):
  ran = []

  def fake_run(loss, s, seed, args, root):
    ran.append(study_lib.cell_key(loss, s, seed))
    assert root == tmp_path / 'runs'
    return {**_cell(0.5 + 0.1 * seed), 'total_s': 1.0}

  argv = [f'--output={tmp_path / "study.json"}', '--losses=grpo,m2po', '--staleness=0,256']
  first = study_lib.study(study_lib.parse_args([*argv, '--seeds=0']), fake_run)
  assert ran == ['grpo-s0-seed0', 'm2po-s0-seed0', 'grpo-s256-seed0', 'm2po-s256-seed0']
  assert first['finished'] == first['cells_total'] == 4
  assert first['goals']['grpo_falls']['status'] == 'missed'  # equal means
  saved = json.loads((tmp_path / 'study.json').read_text())
  assert saved['cells'].keys() == first['cells'].keys()

  ran.clear()
  partial = study_lib.study(study_lib.parse_args([*argv, '--seeds=0,1', '--no_run']), fake_run)
  assert not ran and partial['finished'] == 4 and partial['cells_total'] == 8
  assert not partial['table']['grpo']['0']['complete']
  second = study_lib.study(study_lib.parse_args([*argv, '--seeds=0,1']), fake_run)
  assert ran == ['grpo-s0-seed1', 'm2po-s0-seed1', 'grpo-s256-seed1', 'm2po-s256-seed1']
  assert second['table']['grpo']['0']['finals'] == [0.5, 0.6]

  with pytest.raises(SystemExit, match='another --output'):
    study_lib.study(study_lib.parse_args([*argv, '--seeds=0', '--lr=1e-6']), fake_run)


def test_run_cell_reads_a_finished_workdir_back_without_launching(tmp_path, monkeypatch):
  _finished_run(tmp_path / 'm2po-s16-seed1', 0.25, 0.5)

  def no_launch(*args, **kwargs):
    raise AssertionError('a finished cell was launched again')

  monkeypatch.setattr(study_lib.subprocess, 'run', no_launch)
  args = study_lib.parse_args([f'--output={tmp_path / "s.json"}'])
  assert study_lib.run_cell('m2po', 16, 1, args, tmp_path)['final'] == 0.5


def test_the_default_output_is_in_the_runs_folder():
  args = study_lib.parse_args([])
  assert args.output == ROOT / 'runs' / 'staleness_study' / 'study.json'
  assert args.workdir is None  # then <output dir>/runs


@pytest.mark.parametrize('argv, message', [
    (['--staleness=0,x'], 'comma-separated integers'),
    (['--seeds=0,0'], 'distinct integers'),
    (['--losses=grpo,ppo'], 'expected distinct names'),
    (['--set=rl.lr=1'], '--set takes'),
    (['--steps=0'], 'must be > 0'),
])
def test_bad_arguments_are_refused(argv, message, capsys):
  with pytest.raises(SystemExit):
    study_lib.parse_args(['--output=x.json', *argv])
  assert message in capsys.readouterr().err


def test_plot_draws_every_loss_and_the_masked_fraction(tmp_path):
  cells = {}
  for loss in ('grpo', 'm2po'):
    for s in (0, 256):
      cells[study_lib.cell_key(loss, s, 0)] = {
          'curve': [[0, 0.2], [4, 0.5]],
          'series': {'m2po/masked_fraction': [0.0, 0.1, 0.2, 0.1]}}
  path = tmp_path / 'study.png'
  study_lib.plot({'losses': ['grpo', 'm2po'], 'staleness': [0, 256], 'seeds': [0],
                  'cells': cells}, path)
  assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_run_cell_resumes_from_the_seeds_stored_warmup(tmp_path, monkeypatch):
  """A seed's later cells start from its stored warm-up: the copy, beside a config.json the
  launcher accepts as that run's own (a checkpointed workdir needs one), then the warm-up of
  a first cell is stored for the others."""
  from rlax_llm.run_config import check_resume_config
  args = study_lib.parse_args([f'--output={tmp_path / "s.json"}'])
  (tmp_path / 'warmup' / 'seed1' / '0').mkdir(parents=True)
  (tmp_path / 'warmup' / 'seed1' / '0' / 'params').write_text('stored')
  launched = []

  def fake_launch(cmd, cwd, env, stdout, stderr):
    workdir = pathlib.Path(cmd[-1].removeprefix('--workdir='))
    launched.append(workdir.name)
    flags = [a for a in cmd if a.startswith('--config')]
    if workdir.name == 'grpo-s64-seed1':
      assert (workdir / 'checkpoints/warmup/0/params').read_text() == 'stored'
      check_resume_config(json.loads((workdir / 'config.json').read_text()),
                          load_config(flags))
    else:  # seed 2's first cell runs its own warm-up
      assert not (workdir / 'checkpoints').exists() and not (workdir / 'config.json').exists()
      (workdir / 'checkpoints/warmup/0').mkdir(parents=True)
    _write_run(workdir, 0.3, 0.4)
    return study_lib.subprocess.CompletedProcess(cmd, 0)

  monkeypatch.setattr(study_lib.subprocess, 'run', fake_launch)
  assert study_lib.run_cell('grpo', 64, 1, args, tmp_path)['final'] == 0.4
  assert study_lib.run_cell('m2po', 0, 2, args, tmp_path)['final'] == 0.4
  assert launched == ['grpo-s64-seed1', 'm2po-s0-seed2']
  assert (tmp_path / 'warmup' / 'seed2' / '0').is_dir()  # stored for seed 2's other cells
  assert not (tmp_path / 'grpo-s64-seed1' / 'checkpoints').exists()  # the last step's: gone


def test_a_cell_whose_rl_seed_is_its_warmup_seed_is_the_config_seed_cell():
  """--rl_seeds: rl.seed is passed only when it differs from the warm-up seed, so the rl-seed-0
  cells of warm-up seed 0 are the earlier study's seed-0 runs (reused, not run again)."""
  args = study_lib.parse_args(['--output=/nonexistent/x.json', '--rl_seeds=0,1'])
  assert study_lib.launch_flags('grpo', 256, 0, args, 0) == study_lib.launch_flags(
      'grpo', 256, 0, args)
  config = load_config(study_lib.launch_flags('m2po', 256, 0, args, 1))
  validate_config(config, read_hub=False)
  assert (config.seed, config.rl.seed) == (0, 1)
  assert load_config(study_lib.launch_flags('m2po', 256, 0, args)).rl.seed is None
  assert study_lib.cell_key('grpo', 256, 0, 1) == 'grpo-s256-seed0-rl1'


def test_rl_seeds_study_varies_the_rl_seed_on_the_first_seeds_warmup(tmp_path):
  """Every cell on warm-up seed 0, keys naming both seeds; the spread and the paired gaps
  judged are the RL seeds'; the old mode's settings (and so its JSON) are unchanged."""
  calls = []

  def fake_run(loss, s, seed, args, root, rl_seed=None):
    calls.append((loss, s, seed, rl_seed))
    final = {('grpo', 0): 0.6, ('grpo', 256): 0.4, ('m2po', 256): 0.6}.get((loss, s), 0.6)
    return {**_cell(final + 0.01 * rl_seed), 'total_s': 1.0}

  argv = [f'--output={tmp_path / "study.json"}', '--losses=grpo,m2po', '--staleness=0,256',
          '--rl_seeds=0,1,2']
  out = study_lib.study(study_lib.parse_args(argv), fake_run)
  assert {c[2] for c in calls} == {0} and [c[3] for c in calls[:4]] == [0] * 4
  assert out['order'][4:8] == ['grpo-s0-seed0-rl1', 'm2po-s0-seed0-rl1', 'grpo-s256-seed0-rl1',
                               'm2po-s256-seed0-rl1']
  assert out['rl_seeds'] == [0, 1, 2] and out['settings']['warmup_seed'] == 0
  row = out['table']['grpo']['256']
  assert row['finals'] == pytest.approx([0.4, 0.41, 0.42])
  assert row['spread'] == pytest.approx(0.02) and row['complete']
  goals = out['goals']
  assert goals['grpo_falls']['status'] == 'met' and goals['m2po_holds']['status'] == 'met'
  assert goals['grpo_falls']['paired_gaps'] == pytest.approx([-0.2] * 3)
  assert 'warmup_seed' not in study_lib.settings(study_lib.parse_args(argv[:3]))
  path = tmp_path / 'rl.png'
  study_lib.plot(out, path)
  assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_run_cell_with_an_rl_seed_resumes_from_the_warmup_seeds_checkpoint(tmp_path,
                                                                           monkeypatch):
  from rlax_llm.run_config import check_resume_config
  args = study_lib.parse_args([f'--output={tmp_path / "s.json"}', '--rl_seeds=0,2'])
  (tmp_path / 'warmup' / 'seed0' / '0').mkdir(parents=True)
  launched = []

  def fake_launch(cmd, cwd, env, stdout, stderr):
    workdir = pathlib.Path(cmd[-1].removeprefix('--workdir='))
    launched.append(workdir.name)
    assert (workdir / 'checkpoints/warmup/0').is_dir()
    flags = [a for a in cmd if a.startswith('--config')]
    assert '--config.rl.seed=2' in flags
    check_resume_config(json.loads((workdir / 'config.json').read_text()), load_config(flags))
    _write_run(workdir, 0.3, 0.4)
    return study_lib.subprocess.CompletedProcess(cmd, 0)

  monkeypatch.setattr(study_lib.subprocess, 'run', fake_launch)
  assert study_lib.run_cell('m2po', 256, 0, args, tmp_path, rl_seed=2)['final'] == 0.4
  assert launched == ['m2po-s256-seed0-rl2']
