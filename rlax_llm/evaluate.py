r"""``python -m rlax_llm.evaluate``: evaluates a policy on a task's held-out split, no training.

    python -m rlax_llm.evaluate --checkpoint=WORKDIR [--config.eval.samples=8] \
        [--output=eval.jsonl]
    python -m rlax_llm.evaluate --config=configs/smollm2.py --config.eval.samples=8

evaluates the params the config loads (an HF directory, hub id or GGUF file at
``model.path``, or the seeded init of the tiny model), or with ``--checkpoint`` the params
saved there (``load_policy_params``, the one function that reads a checkpoint), and prints
the metrics of ``rlax_llm.evaluation`` as one JSON line: a task's ``evaluate_policy``, an
environment run's (``env.name``) ``evaluate_episodes`` (greedy held-out episodes,
``eval/success``), as the run's own evaluation computes them (``evaluate_config``).

The config: with ``--checkpoint`` inside a run's workdir and no ``--config``, the run's own
``config.json`` (the model, task and sampling it trained with); ``--config.KEY=VALUE``
overrides apply to it (``--config.eval.samples=8``). With both, ``--config`` must agree with
the run's config in what it computes (``rlax_llm.run_config.config_changes``: only the keys of
``EVAL_CHANGES`` may differ), else the evaluation is refused naming the keys. Without
``--checkpoint``, ``--config`` (default: the packaged ``configs/default.py``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ml_collections
from absl import flags

from rlax_llm import cli, console, extras, launch_help, storage
from rlax_llm import config as config_lib
from rlax_llm import run_config
from rlax_llm.errors import ConfigError

if TYPE_CHECKING:  # for the hints only: this entry point imports no jax before validation
  from rlax_llm.rollout.worker import InferenceWorker
  from rlax_llm.tasks import Task

# ---------------------------------------------------------------------------- checkpoints


def load_policy_params(path: str | os.PathLike, template: Any) -> Any:
  """The params of the checkpoint at ``path`` (a run's workdir, or one of its checkpoint
  directories; ``rlax_llm.checkpoint.read_params``) onto ``template``'s structure."""
  from rlax_llm.checkpoint import read_params  # pylint: disable=import-outside-toplevel
  return read_params(path, template)


# ------------------------------------------------------------------------------------ CLI

# Keys an evaluation may set apart from the run it evaluates: the held-out split's size and
# the eval knobs, besides what a resumed run may change (how it is placed and logged).
EVAL_CHANGES = (*run_config.RESUMABLE_CHANGES, 'eval.', 'task.num_eval')


def run_workdir(checkpoint: str | os.PathLike) -> storage.Path | None:
  """The run workdir ``checkpoint`` lies in (the directory holding its ``config.json``: the
  workdir itself, ``checkpoints``, ``checkpoints/steps`` or a step directory; local or
  ``gs://``), or None."""
  path = storage.absolute(checkpoint)
  for directory in (path, *path.parents[:3]):
    if (directory / 'config.json').is_file():
      return directory
  return None


def config_for(argv: Sequence[str], checkpoint: str | None, doing: str = 'evaluating'
               ) -> ml_collections.ConfigDict:
  """The config to evaluate with (see the module docstring), from the config arguments;
  ``doing``: what the caller does with it, for the line that says which config it took
  (``python -m rlax_llm.serve``: which checkpoint step it serves).

  Raises:
    ConfigError: ``--config`` differs from the run's own config in what it computes, or the
      run's ``config.json`` cannot be read.
    SystemExit: ``'error: ...'`` from ``rlax_llm.cli.load_config``.
  """
  workdir = run_workdir(checkpoint) if checkpoint else None
  named = any(a.partition('=')[0] in ('--config', '-config') for a in argv)
  if workdir is None:
    if checkpoint and not named:
      console.phase(f'no run config.json beside {checkpoint}: {doing} with the packaged '
                    f'{cli.DEFAULT_CONFIG_PATH} (pass --config with the config the run used)')
    return cli.load_config(argv)
  path = workdir / 'config.json'
  try:
    saved = json.loads(storage.read_text(path))
  except (OSError, ValueError) as e:
    raise ConfigError(f'{path} cannot be read ({e}); pass --config=PATH[:VARIANT] with the '
                      'config the run trained with.') from None
  if not named:
    console.phase(f'{doing} with the run\'s own config, {path}')
    return cli.load_config(argv, base=run_config.saved_config(saved))
  config = cli.load_config(argv)
  differ = run_config.config_changes(saved, config, EVAL_CHANGES)
  if differ:
    raise ConfigError(
        f'--config={cli.config_spec(argv)} differs from the config the checkpoint\'s run '
        f'trained with ({path}) in what it computes ({", ".join(differ[:5])}'
        f'{", ..." if len(differ) > 5 else ""}); drop --config to evaluate with the run\'s own '
        f'config (--config.KEY=VALUE overrides apply to it; {", ".join(EVAL_CHANGES)} may '
        'differ).')
  return config


def policy_params(config: ml_collections.ConfigDict, checkpoint: str | None = None
                  ) -> tuple[config_lib.RunSpec, Task, Any, Any, Any]:
  """``(spec, task, model, params, tokenizer)``: the validated config's run spec, its task,
  model and tokenizer, and the params the config loads, or ``checkpoint``'s when given. A
  LoRA run's checkpoint (``lora.rank > 0``: the base and the adapters) is read onto the LoRA
  params' structure and merged (``lora.merge_program``): the params are the merged weights,
  as a run's workers sample with. What ``policy_worker`` and ``python -m rlax_llm.export``
  read."""
  extras.check_config(config, [checkpoint], backend=False)  # one local worker: not Ray
  # pylint: disable=import-outside-toplevel  # jax and the model code: after validation
  from rlax_llm import roles
  from rlax_llm.models import lora as lora_lib
  spec = config_lib.validate_config(config)
  task, model, params, tokenizer = roles.prepare(config)
  lora = lora_lib.from_config(config)
  if checkpoint and lora is not None:
    # The adapters' values come from the checkpoint; create() only gives their structure.
    lora_model, template = lora_lib.create(model, params, lora, seed=config.seed)
    params = lora_lib.merge_program(lora_model)(load_policy_params(checkpoint, template))
  elif checkpoint:
    params = load_policy_params(checkpoint, params)
  return spec, task, model, params, tokenizer


def policy_worker(config: ml_collections.ConfigDict, checkpoint: str | None = None,
                  version: int = 0) -> tuple[config_lib.RunSpec, Task, InferenceWorker]:
  """``(spec, task, worker)``: the validated config's run spec, its task, and one inference
  worker holding ``policy_params`` (the config's params, or ``checkpoint``'s merged ones) as
  ``version`` (an evaluation: 0; the endpoint: the checkpoint's params version). What an
  evaluation and the OpenAI-compatible endpoint (``python -m rlax_llm.serve``) run."""
  # pylint: disable=import-outside-toplevel  # jax and the model code: after validation
  from rlax_llm import roles
  from rlax_llm.models.model import cast_params
  spec, task, model, params, tokenizer = policy_params(config, checkpoint)
  worker = roles.build_worker(config, model, tokenizer, roles.meshes(config)['inference'][0])
  worker.load(version, cast_params(params, worker.model))  # the workers' dtype, as pushed
  return spec, task, worker


class HeldPolicy:
  """One in-process inference worker as the ``WorkerHandle`` of ``rlax_llm.controller``: it
  holds the evaluated params as its only version (0, ``policy_worker``), so it pulls nothing;
  each call runs at once. ``episodes`` and ``make_env``: an environment run's
  ``EpisodeSettings`` and ``roles.env_factory`` (to ``play`` with)."""

  def __init__(self, worker: InferenceWorker, episodes, make_env):
    self.worker = worker
    self.episodes = episodes
    self.make_env = make_env

  def generate(self, requests, rng_data, version, stop_after=None, first=0):
    """``InferenceWorker.generate`` with the held params (``version`` is 0)."""
    # pylint: disable=import-outside-toplevel  # jax and the model code: after validation
    import jax

    from rlax_llm.controller.protocols import done
    self._check(version)
    return done(self.worker.generate(requests, jax.random.wrap_key_data(rng_data), stop_after,
                                     first))

  def play(self, requests, rng_data, version, first=0):
    """``backends.play.play_requests`` with the held params (``version`` is 0)."""
    # pylint: disable=import-outside-toplevel  # jax and the model code: after validation
    from rlax_llm.backends.play import play_requests
    from rlax_llm.controller.protocols import done
    self._check(version)
    return done(play_requests(self.worker, self._no_pull, requests, rng_data, version, first,
                              self.episodes, self.make_env))

  def retire(self) -> None:
    """Nothing to stop: the calls ran in this thread."""

  def _check(self, version) -> None:
    if version != self.worker.version:
      raise ValueError(f'the evaluated policy holds version {self.worker.version} only; a '
                       f'call named version {version!r}.')

  def _no_pull(self, version: int, held: int):
    raise RuntimeError(f'the evaluated policy holds version {self.worker.version} only and '
                       f'has no parameter server to pull version {version} from (held: {held}).')


def evaluate_config(config: ml_collections.ConfigDict, checkpoint: str | None = None
                    ) -> dict[str, float]:
  """Builds the config's task, model and one inference worker, loads ``checkpoint`` when
  given, and returns the held-out metrics of the run's rollout kind
  (``rlax_llm.controller.rollout_kind``: a task's ``evaluation.evaluate_policy``, an
  environment run's ``evaluation.evaluate_episodes``), evaluated as a run evaluates: same
  prompts, requests and keys (the root key of ``config.seed``)."""
  # pylint: disable=import-outside-toplevel  # jax and the model code: after validation
  import jax
  import numpy as np

  from rlax_llm import roles
  from rlax_llm.controller import rollout_kind
  spec, task, worker = policy_worker(config, checkpoint)
  settings = spec.controller
  kind = rollout_kind(settings, task)
  policy = HeldPolicy(worker, settings.episodes, roles.env_factory(config, worker.tokenizer))

  def run(requests, key):
    rng_data = np.asarray(jax.random.key_data(key))
    return kind.merge([kind.submit(policy, requests, rng_data, worker.version, None, 0).result()])

  return kind.evaluate(run, task.eval_prompts(), jax.random.key(config.seed))


_USAGE = """\
usage: python -m rlax_llm.evaluate [--config=PATH[:VARIANT]] [--config.KEY=VALUE ...]
                                   [--checkpoint=PATH] [--output=FILE.jsonl]

Evaluates a policy on the config's held-out split without training and prints the metrics
as one JSON line: eval/accuracy (greedy), and with --config.eval.samples=N mean@N and
pass@k.

flags:
  --checkpoint=PATH        a run's workdir (its latest checkpoint) or a checkpoint directory,
                           local or gs://; default: the params the config loads (model.path
                           or seeded init)
  --config=PATH[:VARIANT]  config file and optional variant; default: with --checkpoint in a
                           run's workdir that run's config.json, else configs/default.py
  --config.KEY=VALUE       override one field, e.g. --config.task.num_eval=200
  --output=FILE.jsonl      also append the metrics line to this file (local or gs://)
  -h, --help               this text"""


def _help_text() -> str:
  return f'{_USAGE}\n\n{launch_help.config_listing()}\n'


def _define_flags(values) -> dict:
  """``--checkpoint`` and ``--output`` on the absl ``FlagValues`` ``values``."""
  return {'checkpoint': cli.checkpoint_flag(values, 'evaluate'),
          'output': flags.DEFINE_string('output', None, 'Also append the metrics to this JSONL '
                                        'file.', flag_values=values)}


def main(argv: Sequence[str]) -> None:
  """``python -m rlax_llm.evaluate [--config=PATH[:VARIANT]] [--config.a.b=v]
  [--checkpoint=PATH] [--output=FILE.jsonl]``: prints the metrics as JSON (and appends them
  to ``--output``).

  Raises:
    SystemExit: ``'error: ...'`` (status 1) for any ``RlaxError``, with its fix.
  """
  command = cli.command_line(argv, _help_text, _define_flags)
  if command is None:  # --help
    return
  checkpoint, output = command.values['checkpoint'], command.values['output']
  metrics = None
  with cli.one_line_errors():
    config = config_for(command.config_args, checkpoint)
    metrics = evaluate_config(config, checkpoint)
  if metrics is None:  # preempted
    return
  record = {'config': config.name, 'checkpoint': checkpoint, **metrics}
  line = json.dumps(record, sort_keys=True)
  if output:  # a local file or a gs:// object, appended whole lines (rlax_llm.storage)
    log = storage.AppendLog(output)
    try:
      log.append(line + '\n')
    finally:
      log.close()
  print(line)


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  console.setup_logging()
  main(sys.argv)
