"""``python -m launch.recipes serve-tpu-vm``: a run's checkpoint served on a TPU VM.

    python -m launch.recipes serve-tpu-vm --tpu-type=v5e-4 --zone=us-west4-a \
        --checkpoint=gs://BUCKET/runs/gsm8k --config=configs/gsm8k.py --dry-run

checks ``--config`` (the config the run trained with: the VM's setup and the checks read it;
the endpoint compares it with the checkpoint's ``config.json``) against the single-host slice
as the tpu-vm recipe does (``checks.check_local``, ``validate_config`` with the VM's chip
count), then prints (``--dry-run``) or runs the commands ``scripts.render_serve_tpu_vm``
renders: create the VM, copy and install this checkout, start ``python -m rlax_llm.serve``
detached on host 0, on the VM's loopback with a bearer token made there, and, as comments,
how to reach it through an ssh tunnel, fetch the token, follow the log and stop it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from launch.recipes import cli, scripts
from launch.recipes.checks import check_local, validate_on_devices
from launch.recipes.slices import SliceError, get_slice
from rlax_llm.cli import load_config


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python -m launch.recipes serve-tpu-vm', allow_abbrev=False,
      description='Serve a run\'s checkpoint (python -m rlax_llm.serve) on a single-host TPU '
      'VM: print (--dry-run) or run the commands. Config overrides: --config.KEY=VALUE.')
  parser.add_argument('--config', required=True,
                      help='the config file PATH[:VARIANT] the run trained with, inside this '
                      'checkout (--config.KEY=VALUE overrides follow it)')
  parser.add_argument('--checkpoint', required=True,
                      help='the run\'s workdir or a checkpoints/steps/<step> directory, as '
                      'the VM sees it: gs://BUCKET/... (or a path on the VM)')
  parser.add_argument('--tpu-type', required=True, help='single-host slice, e.g. v5e-4')
  parser.add_argument('--zone', required=True, help='gcloud --zone, e.g. us-west4-a')
  parser.add_argument('--name', help='TPU VM name (default: rlax-<config name>-serve)')
  parser.add_argument('--port', type=int, default=8000,
                      help='the endpoint\'s port on the VM\'s loopback and this machine\'s '
                      'tunnel end (default 8000)')
  parser.add_argument('--model-name', help='the served model name (default: model.name)')
  parser.add_argument('--project', help='gcloud --project (default: gcloud config)')
  parser.add_argument('--spot', action='store_true', help='create a Spot TPU VM')
  parser.add_argument('--runtime-version', help='TPU VM image (default: per slice table)')
  parser.add_argument('--ref', default='HEAD', help='git ref copied to the VM')
  parser.add_argument('--dry-run', action='store_true',
                      help='check and print the commands; run nothing')
  return parser


def run(argv: Sequence[str]) -> int:
  """The command line; returns the exit status."""
  opts, rest = build_parser().parse_known_args(argv)
  overrides = cli._split_overrides(rest)  # pylint: disable=protected-access
  slice_ = get_slice(opts.tpu_type)
  if slice_.multi_host:
    raise SliceError(f'--tpu-type={slice_.name} has {slice_.hosts} hosts; the endpoint runs on '
                     'one: pick a single-host slice (python -m launch.recipes slices).')
  spec, notes = cli._remote_spec(opts.config, opts.ref,  # pylint: disable=protected-access
                                 strict=not opts.dry_run)
  config = load_config([f'--config={opts.config}', *overrides])
  # pylint: disable-next=protected-access
  opts.name = opts.name or f'{cli._default_name(config)[:34].rstrip("-")}-serve'
  if not opts.checkpoint.startswith(('gs://', '/')):
    notes.append(f'--checkpoint={opts.checkpoint} is relative: the VM reads it from '
                 f'~/{scripts.REMOTE_DIR}/{opts.checkpoint}; a run\'s gs:// workdir is what '
                 'a new VM can read.')
  plan = check_local(config, slice_, 'tpu-vm')
  plan.notes = notes + plan.notes + validate_on_devices(config, plan.devices)
  recipe = scripts.render_serve_tpu_vm(config, plan, slice_, opts, spec, overrides)
  return cli.print_or_run(recipe.script(opts.dry_run), opts.dry_run)
