r"""Command-line entry point: ``python -m rlax_llm.launch``.

    python -m rlax_llm.launch                                  # configs/default.py
    python -m rlax_llm.launch --config=configs/default.py:smoke --config.total_steps=10 \
        --workdir=/tmp/run1
    python -m rlax_llm.launch --help                           # configs, variants, flags
    python -m rlax_llm.launch --config=configs/smollm2.py --print_config  # resolved config

``--config`` takes a config file (``path[:variant]``), ``--config.a.b=value`` overrides a
field, ``--workdir`` is where the run writes ``config.json``, ``metrics.jsonl``,
``summary.json``, ``ledger.jsonl``, TensorBoard events and ``checkpoints/`` (default
``./runs/<name>-<timestamp>-<hex>``). The config is validated (``rlax_llm.config.validate_config``)
before any compute. ``--print_config`` prints the resolved, validated config as JSON and
exits; ``--help`` lists the configs in ``configs/`` with their variants
(``rlax_llm.launch_help``).

Preemption and resume: SIGTERM or SIGINT makes the run save a checkpoint after the current
step and exit 0; launching again with the same ``--workdir`` (and the same config; only the
keys in ``config.RESUMABLE_CHANGES`` may differ) resumes from the latest checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import sys
import time

from absl import app, flags
from ml_collections import config_flags

from rlax_llm import console
from rlax_llm import distributed, launch_help
from rlax_llm import workdir as workdir_lib
from rlax_llm.errors import CheckpointError, ConfigError, NonFiniteError, Preempted
from rlax_llm.config import (DEFAULT_CONFIG_PATH, check_config_spec,
                             check_override_keys, check_resume_config, validate_config)

_FLAGS: dict[str, flags.FlagHolder] = {}


def define_flags() -> None:
  """Defines ``--config`` (with its overrides), ``--workdir`` and ``--print_config``.

  ``config_flags`` reads ``sys.argv`` when the flag is defined, so this runs after
  ``check_override_keys`` has vetted the overrides.
  """
  if _FLAGS:
    return
  _FLAGS['config'] = config_flags.DEFINE_config_file(
      'config', str(DEFAULT_CONFIG_PATH), 'Config file, optionally with :variant.',
      lock_config=True)
  _FLAGS['workdir'] = flags.DEFINE_string(
      'workdir', None, 'Run directory (default ./runs/<config name>-<timestamp>-<hex>).')
  _FLAGS['print_config'] = flags.DEFINE_bool(
      'print_config', False, 'Print the resolved, validated config as JSON and exit.')


def main(argv) -> None:
  del argv
  config = _FLAGS['config'].value
  try:
    # Multi-host: join the other hosts before JAX sees a device (validation builds meshes
    # over jax.devices(), after which jax.distributed.initialize refuses to run).
    distributed.initialize(config)
  except ValueError as e:
    raise SystemExit(f'error: {e}') from None
  try:
    validate_config(config)
  except ConfigError as e:
    raise SystemExit(f'error: {e}') from None
  workdir_flag = _FLAGS['workdir'].value
  workdir = (pathlib.Path(workdir_flag) if workdir_flag
             else workdir_lib.default_workdir(config.name))
  try:
    claim = workdir_lib.claim(workdir)
  except workdir_lib.WorkdirError as e:
    raise SystemExit(f'error: {e}') from None

  # Model, trainer and data imports only after validation: a bad flag fails in seconds.
  # pylint: disable=import-outside-toplevel
  from rlax_llm.backends import build_run
  from rlax_llm.checkpoint import PreemptionGuard

  start = time.perf_counter()
  with claim:
    resuming = workdir_lib.has_checkpoint(workdir)
    if resuming:
      try:
        check_resume_config(json.loads((workdir / 'config.json').read_text()), config)
      except ConfigError as e:
        raise SystemExit(f'error: {e}') from None
      except (OSError, ValueError) as e:
        raise SystemExit(f'error: workdir {workdir} holds checkpoints but its config.json '
                         f'cannot be read ({e}); pass a new --workdir.') from None
      logging.info('resuming the run in %s', workdir)
    workdir_lib.write_text_atomic(workdir / 'config.json',
                                  config.to_json_best_effort(indent=2, sort_keys=True))
    checkpointing = bool(config.checkpoint.every_steps or config.checkpoint.every_seconds)
    try:
      with PreemptionGuard() if checkpointing else contextlib.nullcontext() as guard:
        with build_run(config, workdir, stop=guard.requested if guard else None) as run:
          summary = run.execute()
    except Preempted as e:
      print(f'{e} Relaunch with --workdir={workdir} to continue.')
      return
    except (ConfigError, CheckpointError) as e:
      raise SystemExit(f'error: {e}') from None
    except NonFiniteError as e:
      raise SystemExit(f'error: the run diverged. {e} Metrics so far: '
                       f'{workdir / "metrics.jsonl"}.') from None
  wall = time.perf_counter() - start
  if summary.get('preempted'):
    print(f'preempted after step {summary["steps"]}; checkpoint saved. Relaunch with '
          f'--workdir={workdir} to resume.')
    return
  print(f'held-out greedy accuracy: RL start {summary["eval/start_accuracy"]:.3f} -> '
        f'final {summary["eval/final_accuracy"]:.3f} '
        f'({100 * summary["eval/improvement"]:+.1f} points) in {wall:.0f}s wall; '
        f'workdir {workdir}')


def _main_or_print_config(argv) -> None:
  """``--print_config`` prints the resolved config and returns; otherwise ``main`` runs."""
  if _FLAGS['print_config'].value:
    for name in ('absl', 'jax'):  # stdout is the config; stderr stays quiet unless it fails
      logging.getLogger(name).setLevel(logging.WARNING)
    launch_help.print_config(_FLAGS['config'].value)
    return
  main(argv)


def run_cli() -> None:
  argv = sys.argv[1:]
  if launch_help.wants_help(argv):  # before the config loads: help works with a broken one
    sys.stdout.write(launch_help.help_text())
    raise SystemExit(0)
  console.setup_logging()
  check_override_keys(argv, check_config_spec(argv))
  define_flags()
  app.run(_main_or_print_config)


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  run_cli()
