"""Tests for rlax_llm.metrics."""

import json
import math
import pathlib
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from rlax_llm.metrics import (LedgerFile, MetricsFile, MetricsWriter, SummaryFile,
                              read_metrics)


def read_tb_scalars(workdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
  """tag -> [(step, value)] from every event file in workdir, parsed from TFRecord framing.

  Record layout: uint64 length, uint32 masked crc of the length, ``length`` bytes of data
  (a serialized ``Event``), uint32 masked crc of the data; all little-endian.
  """
  files = sorted(workdir.glob('events.out.tfevents.*'))
  assert files, f'no TensorBoard event file in {workdir}: {list(workdir.iterdir())}'
  scalars: dict[str, list[tuple[int, float]]] = {}
  for file in files:
    data = file.read_bytes()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack_from('<Q', data, offset)
      start = offset + 8 + 4
      event = event_pb2.Event.FromString(data[start : start + length])
      offset = start + length + 4
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def test_jsonl_holds_exact_values(tmp_path):
  workdir = tmp_path / 'run' / 'nested'  # created by the writer
  with MetricsWriter(workdir, tensorboard=False, console=False) as writer:
    writer.write(
      0,
      {
        'reward/mean': 0.41,
        'loss': np.float32(-0.25),
        'count': np.int32(12),
        'eval/accuracy': jnp.asarray(0.5, jnp.float32),
        'time/step_s': np.array(0.125),
        'done': True,
      },
    )
    writer.write(1, {'reward/mean': 1e-7, 'big': 2**40})
    # Every line is on disk before close.
    assert len(read_metrics(workdir / 'metrics.jsonl')) == 2
  lines = (workdir / 'metrics.jsonl').read_text().splitlines()
  assert json.loads(lines[0]) == {
    'step': 0,
    'reward/mean': 0.41,
    'loss': -0.25,
    'count': 12,
    'eval/accuracy': 0.5,
    'time/step_s': 0.125,
    'done': 1,
  }
  assert json.loads(lines[1]) == {'step': 1, 'reward/mean': 1e-7, 'big': 2**40}
  assert isinstance(json.loads(lines[0])['count'], int)
  assert read_metrics(workdir) == [json.loads(line) for line in lines]


def test_jsonl_appends_across_writers(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False, console=False) as writer:
    writer.write(0, {'loss': 1.0})
  with MetricsWriter(tmp_path, tensorboard=False, console=False) as writer:
    writer.write(1, {'loss': 0.5})
  assert read_metrics(tmp_path) == [{'step': 0, 'loss': 1.0}, {'step': 1, 'loss': 0.5}]


def test_non_finite_becomes_null(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False, console=False) as writer:
    writer.write(3, {'a': float('nan'), 'b': np.float32(np.inf), 'c': -math.inf, 'd': 1.5})
  line = (tmp_path / 'metrics.jsonl').read_text()
  assert json.loads(line) == {'step': 3, 'a': None, 'b': None, 'c': None, 'd': 1.5}
  assert 'NaN' not in line and 'Infinity' not in line


@pytest.mark.parametrize(
  'value, pattern',
  [
    (np.zeros((2, 3)), r"metric 'x' has shape \(2, 3\)"),
    (jnp.ones((4,)), r"metric 'x' has shape \(4,\)"),
    ('0.5', r"metric 'x' has value '0.5' of type str"),
    (np.complex64(1 + 2j), r"metric 'x' has dtype complex64"),
  ],
)
def test_non_scalar_raises_and_writes_nothing(tmp_path, value, pattern):
  with MetricsWriter(tmp_path, tensorboard=False, console=False) as writer:
    with pytest.raises(ValueError, match=pattern):
      writer.write(0, {'ok': 1.0, 'x': value})
  assert read_metrics(tmp_path) == []


def test_bad_step_and_keys_raise(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False, console=False) as writer:
    with pytest.raises(ValueError, match='step must be an int, got 1.5'):
      writer.write(1.5, {'loss': 1.0})
    with pytest.raises(ValueError, match="'step' is reserved"):
      writer.write(1, {'step': 2})
    with pytest.raises(ValueError, match='non-empty strings, got 3'):
      writer.write(1, {3: 1.0})


def test_tensorboard_event_file_holds_scalars(tmp_path):
  with MetricsWriter(tmp_path, console=False) as writer:
    writer.write(5, {'reward/mean': 0.75, 'loss': np.float32(-0.5)})
    writer.write(6, {'reward/mean': 0.25})
  scalars = read_tb_scalars(tmp_path)
  assert scalars['reward/mean'] == [(5, 0.75), (6, 0.25)]
  assert scalars['loss'] == [(5, -0.5)]


def test_tensorboard_off_writes_no_event_file(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False, console=False) as writer:
    writer.write(0, {'loss': 1.0})
  assert not list(tmp_path.glob('events.out.tfevents.*'))


def test_console_line(tmp_path, capsys):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(
      12,
      {'time/step_s': 0.2123456, 'other': 9.0, 'loss': -0.0131234, 'reward/mean': 0.41},
    )
  out = capsys.readouterr().out
  assert out == 'step 12 | reward/mean 0.41 | loss -0.01312 | time/step_s 0.2123\n'


def test_console_every_and_custom_keys(tmp_path, capsys):
  with MetricsWriter(
    tmp_path, tensorboard=False, console_every=2, console_keys=('kl', 'n')
  ) as writer:
    for step in range(4):
      writer.write(step, {'kl': 1234567.0, 'n': np.int64(3), 'loss': 1.0})
  assert capsys.readouterr().out.splitlines() == [
    'step 0 | kl 1.235e+06 | n 3',
    'step 2 | kl 1.235e+06 | n 3',
  ]


def test_console_off_prints_nothing(tmp_path, capsys):
  with MetricsWriter(tmp_path, tensorboard=False, console=False) as writer:
    writer.write(0, {'reward/mean': 1.0})
  assert capsys.readouterr().out == ''


@pytest.mark.parametrize('every', [0, -1, True, 1.0])
def test_console_every_is_validated(tmp_path, every):
  with pytest.raises(ValueError, match='console_every must be an int >= 1'):
    MetricsWriter(tmp_path, tensorboard=False, console_every=every)


def test_write_summary(tmp_path):
  writer = MetricsWriter(tmp_path, tensorboard=False, console=False)
  writer.close()
  path = writer.write_summary(
    {
      'final/accuracy': np.float32(0.5),
      'steps': 100,
      'model': 'tiny',
      'diverged': np.bool_(False),
      'curve': np.array([1.0, np.nan]),
      'per_task': {'countdown': jnp.asarray(0.25), 'gsm8k': [1, 2]},
    }
  )
  assert path == tmp_path / 'summary.json'
  text = path.read_text()
  assert '\n  ' in text  # pretty-printed
  assert json.loads(text) == {
    'final/accuracy': 0.5,
    'steps': 100,
    'model': 'tiny',
    'diverged': False,
    'curve': [1.0, None],
    'per_task': {'countdown': 0.25, 'gsm8k': [1, 2]},
  }
  writer.write_summary({'steps': 200})
  assert json.loads(path.read_text()) == {'steps': 200}
  assert not (tmp_path / 'summary.json.tmp').exists()


def test_close_is_idempotent_and_write_after_close_raises(tmp_path):
  writer = MetricsWriter(tmp_path, console=False)
  writer.write(0, {'loss': 1.0})
  writer.close()
  writer.close()
  with pytest.raises(RuntimeError, match='closed'):
    writer.write(1, {'loss': 1.0})
  assert read_metrics(tmp_path) == [{'step': 0, 'loss': 1.0}]


def test_read_metrics_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match='no metrics file'):
    read_metrics(tmp_path)
  (tmp_path / 'metrics.jsonl').write_text('{"step": 0}\n\n{"step": 1\n')
  with pytest.raises(ValueError, match=r'metrics.jsonl:3 is not valid JSON'):
    read_metrics(tmp_path)


def test_on_a_terminal_the_progress_line_is_rewritten_in_place(tmp_path, capsys):
  with MetricsWriter(tmp_path, tensorboard=False, total_steps=2, tty=True) as writer:
    writer.write(1, {'loss': 1.0})
    assert capsys.readouterr().out == '\r\033[Kstep 1/2 (50%) | loss 1'  # no newline yet
    writer.write(2, {'loss': 0.5})
  assert capsys.readouterr().out == '\r\033[Kstep 2/2 (100%) | loss 0.5\n'  # done: newline
  with MetricsWriter(tmp_path, tensorboard=False, total_steps=5, tty=True) as writer:
    writer.write(1, {'loss': 1.0})
  assert capsys.readouterr().out.endswith('loss 1\n')  # close ends an open line


def test_summary_table_shows_first_last_min_max_and_the_summary(tmp_path, capsys):
  with MetricsWriter(tmp_path, tensorboard=False, tty=False) as writer:
    for step, reward in enumerate([0.5, 0.25, 0.75, 0.5], 1):
      writer.write(step, {'reward/mean': reward, 'other': 1.0})
    capsys.readouterr()
    writer.write_summary({'eval/improvement': 0.125, 'events': []})
  assert capsys.readouterr().out.splitlines() == [
    'run summary',
    '  metric            first       last        min        max',
    '  reward/mean         0.5        0.5       0.25       0.75',
    '  eval/improvement       0.125',
  ]


@pytest.mark.parametrize('name, value', [('total_steps', -1), ('text_every', 1.5),
                                         ('text_every', True)])
def test_total_steps_and_text_every_are_validated(tmp_path, name, value):
  with pytest.raises(ValueError, match=f'{name} must be an int >= 0'):
    MetricsWriter(tmp_path, tensorboard=False, **{name: value})


def test_hist_keys_become_tensorboard_histograms_not_scalars(tmp_path):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  from rlax_llm.tensorboard_writer import HISTOGRAM_BIN_EDGES
  fractions = np.zeros(len(HISTOGRAM_BIN_EDGES['hist/log_ratio']) - 1)
  fractions[[0, 21]] = [0.25, 0.75]  # bins [-1, -0.95) and [0.05, 0.1)
  with MetricsWriter(tmp_path, console=False) as writer:
    writer.write(4, {'loss': 1.0, 'hist/log_ratio': fractions})
    with pytest.raises(ValueError, match=r"metric 'hist/log_ratio' has shape \(3,\); its "
                       'edges make 40 bins'):
      writer.write(5, {'hist/log_ratio': np.ones(3)})
    with pytest.raises(ValueError, match="metric 'hist/other': keys starting with hist/"):
      writer.write(5, {'hist/other': np.ones(3)})
  assert read_metrics(tmp_path) == [{'step': 4, 'loss': 1.0}]
  events = EventAccumulator(str(tmp_path), size_guidance={'histograms': 0})
  events.Reload()
  assert events.Tags()['scalars'] == ['loss']
  (hist,) = events.Histograms('log_ratio')
  h = hist.histogram_value
  assert (hist.step, h.num, h.min, h.max) == (4, 1.0, -1.0, pytest.approx(0.1))
  assert h.sum == pytest.approx(0.25 * -0.975 + 0.75 * 0.075)
  assert list(h.bucket)[0] == 0.25 and list(h.bucket)[21] == 0.75


def test_metrics_file_writes_null_for_non_finite_and_cuts_rows_after_the_resume_step(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  file = MetricsFile(path)
  for step in (1, 2, 3):
    file.write(step, {'loss': float(step), 'kl': math.inf})
  file.close()
  assert read_metrics(path)[0] == {'step': 1, 'loss': 1.0, 'kl': None}
  file = MetricsFile(path, resume_step=2)  # a resumed run: step 3 is written again
  file.write(3, {'loss': 30.0})
  file.close()
  assert [(r['step'], r['loss']) for r in read_metrics(path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_ledger_file_and_writer_ledger_append_step_rows(tmp_path):
  path = tmp_path / 'ledger.jsonl'
  file = LedgerFile(path)
  file.write(np.int64(1), {'prompt_ids': [3, 4], 'versions': [0]})
  file.close()
  with MetricsWriter(tmp_path, tensorboard=False, console=False) as writer:
    writer.ledger(2, {'prompt_ids': [5], 'versions': [1]})
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  assert rows == [{'step': 1, 'prompt_ids': [3, 4], 'versions': [0]},
                  {'step': 2, 'prompt_ids': [5], 'versions': [1]}]
  with MetricsWriter(tmp_path, tensorboard=False, console=False, resume_step=1) as writer:
    pass
  assert [json.loads(line)['step'] for line in path.read_text().splitlines()] == [1]
  with pytest.raises(RuntimeError, match='closed'):
    writer.ledger(3, {})


def test_summary_file_replaces_the_summary(tmp_path):
  summary = SummaryFile(tmp_path / 'summary.json')
  summary.write({'a': 1, 'b': None})
  summary.write({'a': 2})
  assert json.loads((tmp_path / 'summary.json').read_text()) == {'a': 2}
  assert [p.name for p in tmp_path.iterdir()] == ['summary.json']


def test_a_disabled_writer_writes_and_prints_nothing(tmp_path, capsys):
  workdir = tmp_path / 'run'
  with MetricsWriter(workdir, enabled=False) as writer:
    writer.write(1, {'loss': 1.0})
    writer.ledger(1, {'prompt_ids': []})
    path = writer.write_summary({'steps': 1})
  assert path == workdir / 'summary.json'
  assert not workdir.exists()
  assert capsys.readouterr().out == ''
