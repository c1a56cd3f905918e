"""An installed wheel runs and resumes: ``pip wheel .``, installed into a fresh virtualenv
outside the checkout, launches the packaged default config's smoke variant from a directory
that is not the checkout, and a relaunch on the same workdir resumes it.

The virtualenv (``venv --without-pip``) gets rlax_llm only from the wheel (``pip install
--no-deps --target`` into its site-packages); its dependencies come from this interpreter's
site-packages through a ``.pth`` line, which adds that directory to ``sys.path`` without
running the ``.pth`` files there, so an editable install of the checkout stays out.

A wheel build and two launches: about 30 s on 2 CPU cores, in the default test run.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(args, cwd, timeout=300):
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
  assert result.returncode == 0, (args, result.stdout[-2000:], result.stderr[-3000:])
  return result


@pytest.fixture(scope='module')
def venv(tmp_path_factory):
  """``(python, site-packages)`` of a fresh virtualenv holding the wheel built from ROOT."""
  base = tmp_path_factory.mktemp('wheel')
  isolation = [] if importlib.util.find_spec('setuptools') is None else ['--no-build-isolation']
  _run([sys.executable, '-m', 'pip', 'wheel', str(ROOT), '--no-deps', '-q', *isolation,
        '-w', str(base / 'dist')], cwd=base)
  wheel, = (base / 'dist').glob('rlax_llm-*.whl')
  _run([sys.executable, '-m', 'venv', '--without-pip', str(base / 'venv')], cwd=base)
  python = base / 'venv' / 'bin' / 'python'
  site = pathlib.Path(_run([str(python), '-c', 'import sysconfig; '
                            "print(sysconfig.get_paths()['purelib'])"], cwd=base).stdout.strip())
  deps = sorted({sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']})
  (site / '_rlax_llm_test_deps.pth').write_text('\n'.join(deps) + '\n')
  _run([sys.executable, '-m', 'pip', 'install', '--no-deps', '--no-index', '-q',
        '--target', str(site), str(wheel)], cwd=base)
  return python, site


def test_the_installed_wheel_launches_the_packaged_default_and_resumes(venv, tmp_path):
  python, site = venv
  cwd = tmp_path / 'elsewhere'
  cwd.mkdir()
  where = _run([str(python), '-c', 'import rlax_llm.cli as c; print(c.__file__); '
                'print(c.DEFAULT_CONFIG_PATH)'], cwd=cwd).stdout.split()
  assert pathlib.Path(where[0]).is_relative_to(site), where  # from the wheel, not ROOT
  default = pathlib.Path(where[1])
  assert default == site / 'rlax_llm' / 'configs' / 'default.py' and default.is_file()

  # No --config: the packaged default; --help lists the packaged configs.
  printed = _run([str(python), '-m', 'rlax_llm.launch', '--print_config'], cwd=cwd)
  assert json.loads(printed.stdout)['name'] == 'default'
  listing = _run([str(python), '-m', 'rlax_llm.launch', '--help'], cwd=cwd).stdout
  assert f'{default} (the default)  variants: smoke' in listing, listing

  workdir = tmp_path / 'run'
  short = [f'--config={default}:smoke', f'--workdir={workdir}', '--config.warmup.steps=8',
           '--config.task.num_eval=4', '--config.eval.every_steps=0',
           '--config.log.tensorboard=false']
  _run([str(python), '-m', 'rlax_llm.launch', *short, '--config.total_steps=1'], cwd=cwd)
  steps = lambda: [json.loads(line)['step']
                   for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert steps() == [1]
  resumed = _run([str(python), '-m', 'rlax_llm.launch', *short, '--config.total_steps=2'],
                 cwd=cwd)
  assert 'resuming the run in' in resumed.stderr, resumed.stderr[-3000:]
  assert steps() == [1, 2]
