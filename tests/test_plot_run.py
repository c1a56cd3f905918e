"""scripts/plot_run.py: the results figure from a run's metrics.jsonl."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _plot(*args):
  return subprocess.run([sys.executable, str(ROOT / 'scripts' / 'plot_run.py'), *args],
                        capture_output=True, text=True, timeout=60, check=False)


def test_plots_a_run_and_keeps_the_last_row_of_a_repeated_step(tmp_path):
  rows = [{'step': s, 'reward/mean': 0.1 * s, 'staleness/mean': 0.0, 'loss': 0.0}
          for s in (1, 2, 3, 2, 3, 4)]  # steps 2-3 replayed after a resume
  rows[-1]['eval/accuracy'] = 0.75
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  (tmp_path / 'summary.json').write_text(json.dumps({'eval/start_accuracy': 0.25,
                                                     'eval/final_accuracy': 0.75}))
  sys.path.insert(0, str(ROOT / 'scripts'))
  try:
    import plot_run  # pylint: disable=import-outside-toplevel
  finally:
    sys.path.pop(0)
  loaded, config, summary = plot_run.load(tmp_path)
  assert [r['step'] for r in loaded] == [1, 2, 3, 4] and config == {}
  assert summary['eval/final_accuracy'] == 0.75
  result = _plot(str(tmp_path), f'--output={tmp_path / "out" / "fig.png"}')
  assert result.returncode == 0, result.stderr
  assert (tmp_path / 'out' / 'fig.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_a_directory_without_a_run_fails_with_a_clear_message(tmp_path):
  result = _plot(str(tmp_path))
  assert result.returncode == 1
  assert result.stderr.startswith(f"error: no metrics file at '{tmp_path / 'metrics.jsonl'}'")
  (tmp_path / 'metrics.jsonl').write_text('{"step": 1, "x": 1}\n')
  result = _plot(str(tmp_path))
  assert result.returncode == 1 and "has no ['reward/mean', 'staleness/mean']" in result.stderr
