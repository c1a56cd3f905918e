r"""Command-line entry point: ``python -m rlax_llm.launch``.

    python -m rlax_llm.launch                                  # the packaged configs/default.py
    python -m rlax_llm.launch --config=configs/default.py:smoke --config.total_steps=10 \
        --workdir=/tmp/run1
    python -m rlax_llm.launch --help                           # configs, variants, flags
    python -m rlax_llm.launch --config=configs/smollm2.py --print_config  # resolved config

``--config`` takes a config file (``path[:variant]``; default ``rlax_llm/configs/default.py``,
which ships in the package), ``--config.a.b=value`` overrides a field (``rlax_llm.cli`` loads
both before absl parses the other flags), ``--workdir`` is where the run writes
``config.json``, ``metrics.jsonl``, ``summary.json``, ``ledger.jsonl``, TensorBoard events and
``checkpoints/`` (a local path or a ``gs://BUCKET/...`` URL, written through
``rlax_llm.storage`` without a mount; default ``./runs/<name>-<timestamp>-<hex>``). The
config is validated (``rlax_llm.config.validate_config``) before any compute.
``--print_config`` prints the resolved, validated config as JSON (with the values a loss
fills in) and exits; ``--help`` lists the packaged configs with their variants
(``rlax_llm.launch_help``). The flags are read as every entry point reads them
(``rlax_llm.cli.command_line``).

A failure the user can fix (``rlax_llm.errors.RlaxError``: a bad config, an unreadable
checkpoint or model file, a busy workdir, a diverged run) prints one ``error: ...`` line with
the fix and exits 1.

Several hosts (``config.distributed``): every process runs the same command with the same
``--workdir`` (required there); process 0 claims it for the job and writes the run's files,
every process trains and writes its checkpoint shards (``rlax_llm.distributed``).

Preemption and resume: SIGTERM or SIGINT makes the run save a checkpoint after the current
step (or, when that step would overrun ``checkpoint.preemption_notice_s``, abandon it and save
the state before it) and exit 0; launching again with the same ``--workdir`` (and the same config; only the
keys in ``run_config.RESUMABLE_CHANGES`` may differ) resumes from the latest checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time

import ml_collections
from absl import app, flags

from rlax_llm import cli, console, distributed, extras, launch_help, storage, workdir_claim
from rlax_llm import workdir as workdir_lib
from rlax_llm.config import checkpointing, validate_config
from rlax_llm.errors import ConfigError, NonFiniteError, Preempted, WorkdirError
from rlax_llm.run_config import check_resume_config


def define_flags(values: flags.FlagValues) -> dict[str, flags.FlagHolder]:
  """Defines ``--workdir`` and ``--print_config`` on ``values`` (``--config`` is
  ``rlax_llm.cli``'s)."""
  return {
      'workdir': flags.DEFINE_string(
          'workdir', None, 'Run directory: a local path or gs://BUCKET/... (default '
          './runs/<config name>-<timestamp>-<hex>).', flag_values=values),
      'print_config': flags.DEFINE_bool(
          'print_config', False, 'Print the resolved, validated config as JSON and exit.',
          flag_values=values)}


def main(config: ml_collections.ConfigDict, workdir_flag: str | None = None) -> None:
  """Validates ``config``, claims the workdir (``workdir_flag``: ``--workdir``, default
  ``./runs/<name>-<timestamp>-<hex>``) and runs (or resumes) the job.

  Raises:
    RlaxError: what the user must fix (``run_cli`` prints it as one line).
  """
  extras.check_config(config, [workdir_flag])  # a missing extra: one line, before any compute
  # Multi-host: join the other hosts before JAX sees a device (the process index below and
  # the roles' meshes start its backend, after which jax.distributed.initialize refuses to run).
  joined = distributed.initialize(config)
  spec = validate_config(config)
  # pylint: disable=import-outside-toplevel
  import jax  # lazy: this module stays light to import (--help); validation loads no JAX
  process = jax.process_index()
  if joined and jax.process_count() > 1 and not workdir_flag:
    raise ConfigError(f'process {process} of a {jax.process_count()}-process job has no '
                      '--workdir: every process of a job must pass the same --workdir (a '
                      'default one would differ between them).')
  workdir = (storage.path(workdir_flag) if workdir_flag
             else storage.path(workdir_lib.default_workdir(config.name)))
  # Process 0 claims the workdir for the job; the others learn whether it could
  # (workdir_claim.claim_for_job).
  claim = workdir_claim.claim_for_job(
      workdir, process, distributed.agree if jax.process_count() > 1 else None)

  # Model, trainer and data imports only after validation: a bad flag fails in seconds.
  from rlax_llm.backends import build_run
  from rlax_llm.checkpoint import PreemptionGuard

  start = time.perf_counter()
  with claim:
    resuming = workdir_lib.has_checkpoint(workdir)
    if resuming:
      try:
        saved = json.loads(storage.read_text(workdir / 'config.json'))
      except (OSError, ValueError) as e:
        raise WorkdirError(
            f'workdir {workdir} holds checkpoints but its config.json cannot be read ({e}); '
            'pass a new --workdir.') from None
      check_resume_config(saved, config)
      logging.info('resuming the run in %s', workdir)
    if process == 0:  # the job's files are process 0's (rlax_llm.distributed)
      storage.write_text_atomic(workdir / 'config.json',
                                    config.to_json_best_effort(indent=2, sort_keys=True))
    try:
      with PreemptionGuard() if checkpointing(config) else contextlib.nullcontext() as guard:
        stop = distributed.JobStop(guard.requested) if guard else None  # agreed by the job
        with build_run(config, workdir, spec, stop=stop) as run:
          summary = run.execute()
    except Preempted as e:
      print(f'{e} Relaunch with --workdir={workdir} to continue.')
      return
    except NonFiniteError as e:
      raise NonFiniteError(f'the run diverged. {e} Metrics so far: '
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


def run_cli() -> None:
  """``python -m rlax_llm.launch``: one ``error: ...`` line and status 1 for an ``RlaxError``;
  status 0 when preempted (a checkpoint was saved)."""
  # absl's own flags (--helpfull, --verbosity) are left to app.run.
  command = cli.command_line(sys.argv, launch_help.help_text, define_flags, known_only=True)
  if command is None:  # --help
    raise SystemExit(0)
  console.setup_logging()
  config = cli.load_config(command.config_args)

  def run(argv) -> None:
    del argv
    with cli.one_line_errors():
      if command.values['print_config']:
        for name in ('absl', 'jax'):  # stdout is the config; stderr stays quiet unless it fails
          logging.getLogger(name).setLevel(logging.WARNING)
        launch_help.print_config(config)
      else:
        main(config, command.values['workdir'])

  app.run(run, argv=[sys.argv[0], *command.rest])


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  run_cli()
