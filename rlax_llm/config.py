"""Config contract and validation (docs/architecture.md "Configuration").

``validate_config`` runs before any compute: it checks every field (contract keys, choices,
numbers, the loss, the sampling transform, the task, the model's length, the meshes against
the devices and batch sizes) and fails with a message naming the key, the value seen and the
fix. Typed objects validate their own fields (``LossConfig``, ``SamplingSpec``, the task,
``DecoderConfig``); this module builds them from the config (``loss_config``,
``sampling_spec``) and says where in the config a bad value sits.

Before absl parses flags, ``check_config_spec`` loads the ``--config`` file once (a missing
file, a syntax error or an unknown variant fails with one line) and ``check_override_keys``
catches misspelled ``--config.a.b=v`` flags, suggesting the closest valid keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.machinery
import importlib.util
import math
import os
import pathlib
import traceback
from collections.abc import Sequence

import ml_collections

from rlax_llm.errors import ConfigError
from rlax_llm import losses
from rlax_llm.models.decoder_config import INVARIANT_ROWS_MODES, REMAT_POLICIES, DecoderConfig
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.schedule import ControllerSettings

DEFAULT_CONFIG_PATH = pathlib.Path(__file__).resolve().parent.parent / 'configs' / 'default.py'

# Keys every config must have (docs, scripts and users rely on them).
REQUIRED_KEYS = (
    'seed', 'total_steps', 'model.name', 'task.name', 'rl.loss', 'rl.group_size',
    'rl.learning_rate', 'staleness.j', 'staleness.k', 'backend', 'checkpoint.every_steps',
    'eval.every_steps', 'mesh',
)

# Choice fields -> valid values (the loss's, sampling's and task's come from their own types).
CHOICES = {
    'backend': ('local', 'ray'),
    'model.param_dtype': ('float32', 'bfloat16'),
    'model.dtype': ('float32', 'bfloat16'),
    'model.remat': REMAT_POLICIES,
    'model.invariant_rows': INVARIANT_ROWS_MODES,
    'rollout.on_swap': ('continue', 'discard'),
    'rollout.short_batches': ('pad', 'wait'),
}

POSITIVE_INTS = ('rl.group_size', 'rl.prompts_per_step', 'rl.max_nonfinite_updates',
                 'rl.micro_batches', 'checkpoint.keep',
                 'rollout.slots', 'rollout.workers',
                 'sampling.max_new_tokens', 'sampling.max_prompt_len', 'warmup.batch_size',
                 'log.console_every')
NON_NEGATIVE_INTS = ('seed', 'total_steps', 'rl.logprob_chunk', 'rl.lr_decay_steps',
                     'rollout.stop_after_groups', 'warmup.steps', 'warmup.warmup_steps',
                     'eval.every_steps', 'checkpoint.every_steps', 'log.text_every')
# Floats: key -> (lowest valid value, whether the lowest value itself is valid).
FLOATS = {
    'rl.learning_rate': (0.0, False),
    'rl.max_grad_norm': (0.0, True),
    'rl.weight_decay': (0.0, True),
    'warmup.learning_rate': (0.0, False),
    'checkpoint.every_seconds': (0.0, True),
}

# Keys a resumed run may change (``check_resume_config``): how long it runs, how it is watched,
# checkpointed and placed (the mesh: checkpoints reshard on restore), and rollout.fault (a
# removed test knob: runs saved with it resume). Every other key decides what the run
# computes and must equal the checkpointed run's.
RESUMABLE_CHANGES = ('total_steps', 'checkpoint.', 'log.', 'eval.every_steps', 'mesh.',
                     'local.', 'rollout.worker_timeout_s', 'rollout.fault.', 'distributed.',
                     'name')


def _get(config: ml_collections.ConfigDict, dotted: str):
  node = config
  for i, part in enumerate(dotted.split('.')):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      parent = '.'.join(dotted.split('.')[:i]) or '<root>'
      valid = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      raise ConfigError(f'config key {dotted!r} is missing: {parent!r} has no field {part!r}'
                        f' (fields there: {valid}).')
    node = node[part]
  return node


def _flat_keys(config: ml_collections.ConfigDict, prefix: str = '') -> list[str]:
  keys = []
  for key, value in config.items():
    name = f'{prefix}{key}'
    keys.append(name)
    if isinstance(value, ml_collections.ConfigDict):
      keys.extend(_flat_keys(value, name + '.'))
  return keys


@contextlib.contextmanager
def _naming(prefix: str):
  """Re-raises a ValueError from a typed object's validation as a ConfigError under
  ``config.<prefix>``: the types validate their fields (once, in one place), messages start
  with the field, and this adds where in the config it sits."""
  try:
    yield
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(f'config.{prefix}{e}') from None


def loss_config(config: ml_collections.ConfigDict) -> losses.LossConfig:
  """The ``LossConfig`` of ``config.rl`` (its fields by name; ``rl.mismatch`` when enabled)."""
  rl = config.rl
  fields = {f.name: rl[f.name] for f in dataclasses.fields(losses.LossConfig)
            if f.name != 'mismatch' and f.name in rl}
  mismatch = None
  if 'mismatch' in rl and rl.mismatch.enabled:
    with _naming('rl.'):
      mismatch = losses.MismatchConfig(**{k: v for k, v in rl.mismatch.items()
                                          if k != 'enabled'})
  with _naming('rl.'):
    return losses.LossConfig(**fields, mismatch=mismatch)


def sampling_spec(config: ml_collections.ConfigDict) -> SamplingSpec:
  """The rollout ``SamplingSpec`` of ``config.sampling`` (greedy is refused for rollouts)."""
  s = config.sampling
  with _naming('sampling.'):
    return SamplingSpec(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p
                        ).check_for_rollouts()


def controller_settings(config: ml_collections.ConfigDict) -> ControllerSettings:
  """The controller's ``ControllerSettings`` (schedule, staleness, rollout sampling)."""
  with _naming(''):
    settings = ControllerSettings(
        total_steps=config.total_steps, prompts_per_step=config.rl.prompts_per_step,
        group_size=config.rl.group_size, staleness_j=config.staleness.j,
        staleness_k=config.staleness.k, eval_every=config.eval.every_steps, seed=config.seed,
        sampling=sampling_spec(config), max_new_tokens=config.sampling.max_new_tokens,
        advantage_estimator=loss_config(config).estimator,
        oversample=config.rollout.oversample,
        worker_timeout_s=config.rollout.worker_timeout_s,
        stop_after_groups=config.rollout.get('stop_after_groups', 0),
        short_batches=config.rollout.get('short_batches', 'pad'),
        replay=config.rollout.get('replay', 0.0),
        eval_samples=config.eval.get('samples', 0),
        reward=config.reward.to_dict() if config.get('reward') else None)
  if settings.oversample and settings.advantage_estimator in losses.BASELINE_FREE:
    raise ConfigError(
        f'config.rollout.oversample={settings.oversample!r} drops groups whose rewards are all '
        f'equal, but under the {settings.advantage_estimator!r} advantage estimator (no group '
        'baseline) those groups train too (an all-wrong group is pushed down); set '
        'rollout.oversample=0 or use a group-relative estimator.')
  return settings


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ``ConfigError`` naming the first key that is missing or invalid.

  Checks everything that needs no model file: contract keys, choices, ints and floats, the
  loss (``loss_config``), the sampling transform (``sampling_spec``), the task's own fields
  (it is built), the tiny model's architecture and sequence length, staleness, and the
  meshes against the devices and the batch sizes. What needs a checkpoint's config or
  tokenizer (prompt lengths, memory) is checked by ``rlax_llm.roles`` before any compute.
  """
  for key in REQUIRED_KEYS:
    _get(config, key)
  for key, valid in CHOICES.items():
    value = _get(config, key)
    if value not in valid:
      raise ConfigError(f'config.{key}={value!r} is not valid; choose one of {list(valid)}.')
  for key in POSITIVE_INTS + NON_NEGATIVE_INTS:
    value = _get(config, key)
    low = 1 if key in POSITIVE_INTS else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ConfigError(f'config.{key}={value!r} must be an int >= {low}.')
  for key, (low, inclusive) in FLOATS.items():
    if key.startswith('warmup.') and config.warmup.steps == 0:
      continue
    value = _get(config, key)
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and (value >= low if inclusive else value > low))
    if not ok:
      raise ConfigError(f'config.{key}={value!r} must be a finite number '
                        f'{">=" if inclusive else ">"} {low}.')
  loss_config(config)
  sampling_spec(config)
  for key in ('staleness.j', 'staleness.k'):
    value = _get(config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ConfigError(f'config.{key}={value!r} must be an int >= 1 (RLAX staleness: j is '
                        'the reload threshold, k the acceptance window; (1, 1) is lockstep).')
  settings = controller_settings(config)
  _validate_micro_batches(config)
  _validate_checkpoint(config)
  task = _validate_task(config)
  if settings.reward:
    from rlax_llm import rewards  # pylint: disable=import-outside-toplevel
    with _naming(''):
      rewards.make_components(settings.reward, task, settings.max_new_tokens)
  _validate_model(config)
  _validate_meshes(config)


def _validate_micro_batches(config: ml_collections.ConfigDict) -> None:
  micro, rl = config.rl.micro_batches, config.rl
  rows = rl.prompts_per_step * rl.group_size
  if rows % micro:
    raise ConfigError(f'config.rl.micro_batches={micro} does not divide the batch of '
                      f'rl.prompts_per_step * rl.group_size = {rows} rows; choose a divisor.')
  if micro > 1 and loss_config(config).spec.objective == 'm2po':
    raise ConfigError(f'config.rl.micro_batches={micro} with rl.loss={rl.loss!r}: M2PO masks '
                      'tokens by a statistic of the whole batch, so it is not computed one '
                      'micro-batch at a time; set rl.micro_batches=1 (rl.logprob_chunk also '
                      'saves memory and works with M2PO).')


def _validate_checkpoint(config: ml_collections.ConfigDict) -> None:
  c = config.checkpoint
  if not isinstance(c.async_save, bool):
    raise ConfigError(f'config.checkpoint.async_save={c.async_save!r} must be True or False.')
  if config.backend == 'ray' and (c.every_steps or c.every_seconds):
    raise ConfigError('config.backend=\'ray\' does not write checkpoints yet; set '
                      'checkpoint.every_steps=0 and checkpoint.every_seconds=0, or use '
                      'backend=\'local\' (which checkpoints and resumes).')


def _flatten(tree, prefix=''):
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flatten(value, f'{prefix}{key}.'))
    else:
      out[f'{prefix}{key}'] = value
  return out


def check_resume_config(saved: dict, config: ml_collections.ConfigDict) -> None:
  """Raises ``ConfigError`` when ``config`` may not resume a run checkpointed with ``saved``
  (its ``config.json``): every key outside ``RESUMABLE_CHANGES`` must be equal.

  A key the saved config lacks was added to rlax_llm after the run was saved; it passes at
  the embedded default config's value (``configs/default.py``: a new key's default keeps
  what the code did before it existed) and is refused at any other, naming that value."""
  import json  # pylint: disable=import-outside-toplevel
  now = _flatten(json.loads(config.to_json_best_effort()))
  before = _flatten(saved)
  fixed = lambda key: not any(key == p or (p.endswith('.') and key.startswith(p))
                              for p in RESUMABLE_CHANGES)
  added = {key for key in now.keys() - before.keys() if fixed(key)}
  defaults = _flatten(json.loads(load_config_file(str(DEFAULT_CONFIG_PATH))
                                 .to_json_best_effort())) if added else {}
  expected = before | {key: defaults.get(key, '<absent>') for key in added}
  differ = [key for key in sorted(now.keys() | before.keys())
            if fixed(key) and now.get(key, '<absent>') != expected.get(key, '<absent>')]
  if differ:
    def change(key):
      if key not in added:
        return f'{key}: {before.get(key, "<absent>")!r} -> {now.get(key, "<absent>")!r}'
      default = (f'its default {defaults[key]!r} resumes' if key in defaults
                 else 'not in the default config')
      return f'{key}: added since the run was saved, {now[key]!r} ({default})'
    shown = ', '.join(change(key) for key in differ[:5])
    raise ConfigError(
        f'this workdir holds a checkpointed run whose config differs in what it computes '
        f'({shown}{", ..." if len(differ) > 5 else ""}). Resume with the same config (only '
        f'{", ".join(RESUMABLE_CHANGES)} may change), or pass a new --workdir. Nothing was '
        'overwritten.')


def _validate_task(config: ml_collections.ConfigDict):
  """The task ``config.task`` builds; ConfigError naming the field when it cannot."""
  from rlax_llm import tasks  # pylint: disable=import-outside-toplevel
  name = _get(config, 'task.name')
  if name not in tasks.TASKS:
    raise ConfigError(f'config.task.name={name!r} is not valid; choose one of '
                      f'{sorted(tasks.TASKS)}.')
  with _naming('task: '):
    return tasks.make_task(config.task.to_dict() | {'seed': config.seed})


def _validate_model(config: ml_collections.ConfigDict) -> None:
  from rlax_llm.models import presets  # pylint: disable=import-outside-toplevel
  m = config.model
  valid = ('tiny', *sorted(presets.PRESETS))
  if m.name not in valid:
    raise ConfigError(f'config.model.name={m.name!r} is not valid; choose one of '
                      f'{list(valid)}.')
  split = {f'mesh.{role}.{axis}': config.mesh[role][axis]
           for role in ('trainer', 'inference') for axis in ('fsdp', 'tensor')}
  if m.batch_invariant and any(size != 1 for size in split.values()):
    raise ConfigError(
        'config.model.batch_invariant=True makes sampler and trainer log-probs equal only when '
        'no role splits a matmul\'s contraction across devices (fsdp and tensor both do), but '
        + ', '.join(f'{k}={v}' for k, v in split.items() if v != 1)
        + '; shard with the data axis only or turn batch_invariant off.')
  s = config.sampling
  needed = s.max_prompt_len + s.max_new_tokens
  if m.name == 'tiny':
    if m.path is not None:
      raise ConfigError(f'config.model.path={m.path!r} is set but model.name=\'tiny\' builds '
                        'a model from scratch; set model.name to the checkpoint\'s preset or '
                        'clear model.path.')
    with _naming('model.tiny.'):
      tiny = m.tiny.to_dict()
      DecoderConfig(vocab_size=1, max_seq_len=m.max_seq_len, **tiny)
    if m.max_seq_len < needed:
      raise ConfigError(
          f'config.model.max_seq_len={m.max_seq_len} is shorter than sampling.max_prompt_len '
          f'({s.max_prompt_len}) + sampling.max_new_tokens ({s.max_new_tokens}) = {needed}; '
          'raise model.max_seq_len or shorten the prompts/completions.')
  elif m.path is None and m.name not in presets.PACKAGED_CHECKPOINTS:
    raise ConfigError(
        f'config.model.name={m.name!r} needs config.model.path (an HF directory or a .gguf file '
        f'of the model): no checkpoint of it ships with rlax_llm (packaged: '
        f'{sorted(presets.PACKAGED_CHECKPOINTS)}).')
  elif m.path is not None and not pathlib.Path(m.path).exists():
    raise ConfigError(f'config.model.path={m.path!r} does not exist; pass an HF directory '
                      'or a .gguf file of the model.')
  elif m.max_seq_len is not None and m.max_seq_len < needed:
    raise ConfigError(
        f'config.model.max_seq_len={m.max_seq_len} is shorter than sampling.max_prompt_len + '
        f'sampling.max_new_tokens = {needed}.')


def _validate_meshes(config: ml_collections.ConfigDict) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  from rlax_llm.sharding import role_meshes  # pylint: disable=import-outside-toplevel
  with _naming('mesh.'):
    meshes = role_meshes(_get(config, 'mesh.trainer').to_dict(),
                         _get(config, 'mesh.inference').to_dict(),
                         workers=config.rollout.workers, disjoint=config.mesh.disjoint)
  m = config.model
  data = {'mesh.trainer.data': meshes['trainer'].shape['data'],
          'mesh.inference.data': meshes['inference'][0].shape['data']}
  if m.batch_invariant and m.invariant_rows == 'floor' and any(v > 1 for v in data.values()):
    raise ConfigError(
        'config.model.invariant_rows=\'floor\' pads each weight matmul to 64 rows, but a '
        'data-parallel mesh gives each device a slice of them, which may be fewer: '
        + ', '.join(f'{k} resolves to {v}' for k, v in data.items() if v > 1)
        + '; use invariant_rows=\'chunks\' or one data shard per role.')
  rollout_batch = config.rl.prompts_per_step * config.rl.group_size
  checks = [('trainer', meshes['trainer'], 'rl.prompts_per_step * rl.group_size',
             rollout_batch)]
  if config.warmup.steps > 0:
    checks.append(('trainer', meshes['trainer'], 'warmup.batch_size', config.warmup.batch_size))
  checks.append(('inference', meshes['inference'][0], 'rollout.slots', config.rollout.slots))
  for role, mesh, name, size in checks:
    shards = mesh.shape['data'] * mesh.shape['fsdp']
    if size % shards:
      raise ConfigError(
          f'config.mesh.{role}: the batch axis is split over data x fsdp = {shards} devices '
          f'but {name} = {size} does not divide by {shards} (of {jax.device_count()} '
          f'devices); make it a multiple of {shards} or change mesh.{role}.')


def _where(error: BaseException, path: str) -> str:
  """' (configs/x.py, line 12)': the innermost frame of ``error`` in ``path`` (else anywhere)."""
  frames = traceback.extract_tb(error.__traceback__)
  ours = [f for f in frames if os.path.realpath(f.filename) == os.path.realpath(path)]
  frame = (ours or frames or [None])[-1]
  if frame is None:
    return ''
  name = path if ours else frame.filename
  return f' ({name}, line {frame.lineno})'


def _describe(error: BaseException) -> str:
  """'ValueError: message' on one line."""
  text = str(error).strip().replace('\n', ' ')
  return f'{type(error).__name__}: {text}' if text else type(error).__name__


def config_variants(path: str | os.PathLike) -> tuple[str, ...]:
  """The named variants a config file declares in its module-level ``VARIANTS`` tuple."""
  module_spec = importlib.util.spec_from_file_location('_rlax_llm_config_variants', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return tuple(getattr(module, 'VARIANTS', ()))


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """Loads ``path[:variant]`` the way ``config_flags`` does (``get_config(variant)``).

  Like ``config_flags``, everything after the first ``:`` is the variant, passed to
  ``get_config`` (``path:`` passes ``''``); without a ``:`` it calls ``get_config()``.

  Raises:
    ConfigError: the file does not exist, does not import (the message names the file and
      line), has no ``get_config``, ``get_config`` raises (for a variant: the file has no such
      variant) or returns something other than a ``ConfigDict``.
  """
  path, sep, variant = spec.partition(':')
  if not path:
    raise ConfigError(f'config spec {spec!r} names no file; pass --config=PATH[:VARIANT], '
                      'e.g. --config=configs/default.py:smoke.')
  file = pathlib.Path(path)
  if not file.exists():
    raise ConfigError(f'config file {path!r} does not exist (relative paths are read from '
                      f'{os.getcwd()}); pass --config=PATH[:VARIANT] naming an existing file.')
  if not file.is_file():
    raise ConfigError(f'config file {path!r} is not a file; pass --config=PATH[:VARIANT] '
                      'naming a Python file that defines get_config.')
  loader = importlib.machinery.SourceFileLoader('_rlax_llm_config', path)
  module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
  try:
    loader.exec_module(module)
  except SyntaxError as e:
    where = path if os.path.realpath(e.filename or path) == os.path.realpath(path) else e.filename
    text = f' ({e.text.strip()!r})' if e.text and e.text.strip() else ''
    raise ConfigError(f'config file {path} does not import: {type(e).__name__} at line '
                      f'{e.lineno} of {where}: {e.msg}{text}. Fix that line.') from e
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise ConfigError(f'config file {path} does not import: {_describe(e)}'
                      f'{_where(e, path)}.') from e
  get_config = getattr(module, 'get_config', None)
  if not callable(get_config):
    raise ConfigError(f'config file {path} has no get_config(); a config file must define '
                      'get_config(variant=None) returning an ml_collections.ConfigDict.')
  call = f'get_config({variant!r})' if sep else 'get_config()'
  try:
    config = get_config(variant) if sep else get_config()
  except (ValueError, KeyError, TypeError) as e:
    if not sep:
      raise ConfigError(f'{call} in {path} raised {_describe(e)}{_where(e, path)}.') from e
    raise ConfigError(f'{path} has no variant {variant!r} ({_describe(e)})') from e
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise ConfigError(f'{call} in {path} raised {_describe(e)}{_where(e, path)}.') from e
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f'{call} in {path} returned {type(config).__name__}, not an '
                      'ml_collections.ConfigDict; make it return the config.')
  return config


def config_spec(argv: Sequence[str]) -> str:
  """The ``--config`` value in ``argv`` (the last one, as absl takes), or the default file."""
  spec = str(DEFAULT_CONFIG_PATH)
  for i, arg in enumerate(argv):
    if arg == '--':
      break
    flag, eq, value = arg.partition('=')
    if flag in ('--config', '-config'):
      if eq:
        spec = value
      elif i + 1 < len(argv):
        spec = argv[i + 1]
  return spec


def check_config_spec(argv: Sequence[str]) -> ml_collections.ConfigDict:
  """Loads the ``--config=path[:variant]`` file named in ``argv`` (or the default) once.

  Runs before absl parses flags, so a bad config file fails with one line instead of
  ``config_flags``' traceback or a misleading "'seed' is missing".

  Returns:
    The loaded config (pass it to ``check_override_keys``).

  Raises:
    SystemExit: ``'error: ...'`` when ``load_config_file`` fails (see there).
  """
  try:
    return load_config_file(config_spec(argv))
  except ConfigError as e:
    raise SystemExit(f'error: {e}') from None


def check_override_keys(argv: Sequence[str],
                        config: ml_collections.ConfigDict | None = None) -> None:
  """Exits with a clear message if a ``--config.KEY=...`` flag names no config field.

  Args:
    argv: the command line without the program name.
    config: the ``--config`` file's config as ``check_config_spec(argv)`` returns it; loaded
      (and checked) here when ``None`` and there are overrides.
  """
  overrides = [a[len('--config.'):].split('=', 1) for a in argv if a.startswith('--config.')]
  if not overrides:
    return
  if config is None:
    config = check_config_spec(argv)
  valid = _flat_keys(config)
  for key, *value in overrides:
    if key in valid and value:
      _check_override_type(key, _get(config, key), value[0])
    if key not in valid:
      close = difflib.get_close_matches(key, valid, n=3)
      parent = key.rpartition('.')[0]
      siblings = [k.rpartition('.')[2] for k in valid if k.rpartition('.')[0] == parent]
      hint = f' Did you mean {" or ".join(close)}?' if close else ''
      raise SystemExit(f'error: --config.{key}: unknown config key {key!r}.{hint} '
                       f'Valid keys under {parent or "<root>"!r}: {sorted(siblings)}.')


def _check_override_type(key: str, current, text: str) -> None:
  """Exits if ``text`` cannot become the type of the field's current value."""
  kind = type(current)
  if kind is bool:
    ok = text.lower() in ('true', 'false', '1', '0')
  elif kind in (int, float):
    try:
      kind(text)
      ok = True
    except ValueError:
      ok = False
  else:
    return  # strings, None and nested values are parsed by config_flags itself
  if not ok:
    raise SystemExit(f'error: --config.{key}={text!r}: expected type {kind.__name__} '
                     f'(the default is {current!r}).')
