r"""``python -m rlax_llm.serve``: the OpenAI-compatible endpoint over a config's policy.

    python -m rlax_llm.serve --config=configs/smollm2.py [--checkpoint=WORKDIR] \
        [--host=127.0.0.1] [--port=8000] [--api_key_env=RLAX_API_KEY] [--model_name=NAME] \
        [--allow_unauthenticated_network] [--max_request_mib=4] [--episodes=episodes.jsonl]

serves the params the config loads (or a run's checkpoint, as ``python -m rlax_llm.evaluate``
picks them: ``evaluate.policy_worker``) on one inference worker with the config's sampling
limits (``sampling.max_prompt_len``, ``sampling.max_new_tokens``, ``rollout.slots``) under
the model name ``--model_name`` (default ``config.model.name``), prints one JSON line with
the ``base_url``, and appends every closed episode's trajectories to ``--episodes`` (one JSON
object per trajectory) until SIGTERM or SIGINT. Its first log line names what it serves: the
checkpoint's step and params version (``checkpoint.checkpoint_step``), which every response
carries as ``X-Params-Version`` and every recorded token as its version, or the config's own
params (version 0). ``--help`` lists every flag with its help string. The bearer token is
read from the environment variable ``--api_key_env`` names, never from the command line; a
``--host`` other machines can reach without one is refused before the model loads, unless
``--allow_unauthenticated_network`` says the network is trusted. Request bodies over
``--max_request_mib`` MiB are refused (413).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

import ml_collections
from absl import flags

from rlax_llm import cli, console, evaluate
from rlax_llm.errors import ConfigError

# Seconds between two writes of the closed episodes to --episodes.
_DRAIN_S = 1.0


def trajectory_record(name: str, trajectory) -> dict:
  """One trajectory (``rlax_llm.data_types.Trajectory``) as a JSON object: its arrays as
  lists, and ``name``, the episode's name at the endpoint."""
  record = {'name': name}
  for field in dataclasses.fields(trajectory):
    value = getattr(trajectory, field.name)
    record[field.name] = value.tolist() if hasattr(value, 'tolist') else value
  return record


def serving_what(checkpoint: str | None) -> tuple[str, int]:
  """``(description, version)`` of what ``checkpoint`` serves: its step and params version
  (``checkpoint.checkpoint_step``: the version the response headers and recorded tokens
  carry), or, without one, the config's own params as version 0. Raises CheckpointError
  when there is no checkpoint at ``checkpoint``."""
  if not checkpoint:
    return 'serving the config\'s own params (model.path or the seeded init) as version 0', 0
  from rlax_llm.checkpoint import checkpoint_step  # pylint: disable=import-outside-toplevel
  step = checkpoint_step(checkpoint)  # Orbax and JAX: after --help and the flags' checks
  which = 'the warm-up\'s checkpoint' if step.step is None else f'step {step.step}'
  return f'serving {which} (params version {step.version}) of {step.path}', step.version


def serve(config: ml_collections.ConfigDict, *, checkpoint: str | None = None,
          host: str = '127.0.0.1', port: int = 8000, api_key: str | None = None,
          allow_unauthenticated_network: bool = False,
          max_request_bytes: int | None = None, episodes: str | None = None,
          model_name: str | None = None, stop: threading.Event | None = None,
          started: Callable[[str], None] | None = None) -> None:
  """Serves the config's policy (``checkpoint``'s params when given, as its params version:
  ``serving_what``) until ``stop`` is set (default: SIGTERM or SIGINT), writing closed
  episodes to the JSONL file ``episodes`` (``trajectory_record``). ``model_name``: the name
  clients ask for (default ``config.model.name``). ``started(base_url)`` is called once the
  endpoint accepts requests. A ``host`` that is not loopback without an ``api_key`` is a
  ConfigError, before the model loads, unless ``allow_unauthenticated_network``.
  ``max_request_bytes``: the largest request body taken (None: ``Endpoint``'s default,
  4 MiB)."""
  # pylint: disable=import-outside-toplevel  # jax, fastapi and the model: after validation
  from rlax_llm.serve.http_server import check_exposure
  from rlax_llm.serve.openai_api import Endpoint
  check_exposure(host, api_key, allow_unauthenticated_network)
  _, version = serving_what(checkpoint)
  _, _, worker = evaluate.policy_worker(config, checkpoint, version=version)
  if stop is None:
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
      signal.signal(signum, lambda *_: stop.set())
  endpoint = Endpoint(worker, model_name=model_name or config.model.name, api_key=api_key,
                      host=host,
                      port=port, allow_unauthenticated_network=allow_unauthenticated_network,
                      seed=config.seed, **({} if max_request_bytes is None else
                                           {'max_request_bytes': max_request_bytes}))

  def drain():
    closed = endpoint.recorder.take()
    if episodes and closed:
      with open(episodes, 'a', encoding='utf-8') as f:
        f.writelines(json.dumps(trajectory_record(episode.name, trajectory)) + '\n'
                     for episode in closed for trajectory in episode.trajectories)

  with endpoint:
    if started is not None:
      started(endpoint.base_url)
    while not stop.wait(_DRAIN_S):
      drain()
  drain()


_USAGE = """\
usage: python -m rlax_llm.serve [--config=PATH[:VARIANT]] [--config.KEY=VALUE ...]
                                [--checkpoint=PATH] [--host=127.0.0.1] [--port=8000]
                                [--api_key_env=NAME] [--model_name=NAME]
                                [--allow_unauthenticated_network] [--max_request_mib=4]
                                [--episodes=FILE.jsonl]

Serves a policy behind an OpenAI-compatible API (docs/serving.md) and records every call's
tokens, log-probs and versions under an episode id for RL. A --host other machines can
reach needs --api_key_env, or --allow_unauthenticated_network on a trusted network."""


def _help_text() -> str:
  """``--help``: the usage, then every flag with its help string and default."""
  lines = [_USAGE, '', 'flags:', *cli.flags_help(_define_flags, [
      ('--config=PATH[:VARIANT]', 'Config file and optional variant (default: with '
       '--checkpoint in a run\'s workdir that run\'s config.json, else configs/default.py).'),
      ('--config.KEY=VALUE', 'Override one field, e.g. --config.sampling.max_new_tokens=64.')])]
  return '\n'.join(lines) + '\n'


def _define_flags(values) -> dict:
  """The endpoint's flags (module docstring) on the absl ``FlagValues`` ``values``."""
  return {
      'checkpoint': cli.checkpoint_flag(values, 'serve'),
      'host': flags.DEFINE_string('host', '127.0.0.1', 'Address to listen on (not loopback: '
                                  'needs --api_key_env or --allow_unauthenticated_network).',
                                  flag_values=values),
      'port': flags.DEFINE_integer('port', 8000, 'Port to listen on (0: a free one; the '
                                   'base_url line says which).', flag_values=values),
      'api_key_env': flags.DEFINE_string('api_key_env', None, 'Environment variable holding '
                                         'the bearer token clients must send.',
                                         flag_values=values),
      'model_name': flags.DEFINE_string('model_name', None, 'The model name clients ask for '
                                        '(/v1/models, the requests\' "model"; default: '
                                        'config.model.name).', flag_values=values),
      'allow_unauthenticated_network': flags.DEFINE_bool(
          'allow_unauthenticated_network', False, 'Serve a --host that is not loopback '
          'without a token (a trusted network only).', flag_values=values),
      'max_request_mib': flags.DEFINE_float('max_request_mib', None, 'Largest request body '
                                            'taken, in MiB (larger: 413; default 4).',
                                            flag_values=values),
      'episodes': flags.DEFINE_string('episodes', None, 'Append closed episodes\' '
                                      'trajectories to this JSONL file.', flag_values=values)}


def main(argv: Sequence[str]) -> None:
  """The command line (module docstring). Raises SystemExit ``'error: ...'`` for any
  ``RlaxError``, with its fix."""
  command = cli.command_line(argv, _help_text, _define_flags)
  if command is None:  # --help
    return
  flag = command.values
  with cli.one_line_errors():
    api_key = None
    if flag['api_key_env']:
      api_key = os.environ.get(flag['api_key_env'])
      if not api_key:
        raise ConfigError(f'--api_key_env={flag["api_key_env"]} names an environment variable '
                          'that is not set; export it with the bearer token clients will send.')
    max_mib = flag['max_request_mib']
    max_bytes = None if max_mib is None else int(max_mib * 2**20)
    if max_bytes is not None and max_bytes < 1:
      raise ConfigError(f'--max_request_mib={max_mib} must be > 0 (default 4).')
    console.phase(serving_what(flag['checkpoint'])[0])  # the first line: what it serves
    config = evaluate.config_for(command.config_args, flag['checkpoint'], doing='serving')
    serve(config, checkpoint=flag['checkpoint'], host=flag['host'], port=flag['port'],
          api_key=api_key, allow_unauthenticated_network=flag['allow_unauthenticated_network'],
          max_request_bytes=max_bytes, episodes=flag['episodes'],
          model_name=flag['model_name'],
          started=lambda url: print(json.dumps({'base_url': url}), flush=True))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  console.setup_logging()
  main(sys.argv)
