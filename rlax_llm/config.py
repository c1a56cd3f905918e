"""Config schema and validation (docs/config.md).

The schema is defined once: the packaged default config (``rlax_llm/configs/default.py``,
``rlax_llm.cli.DEFAULT_CONFIG_PATH``, which ``rlax_llm.cli`` loads with its variants and
overrides) names every key and its default; the tables here add only what a default cannot
say (choices, ranges, groups whose fields vary per config).

``validate_config`` runs before any compute: it walks the schema and builds the run's typed
values, each validating its own fields where it is defined (``LossConfig`` in ``loss_spec``,
``SamplingSpec``, ``ControllerSettings`` and ``EpisodeSettings`` in ``schedule``, the task,
the environment, the reward components, the model in ``model_spec``); this module adds where
in the config a bad value sits (messages name the key, the value seen and the fix). It
returns the ``RunSpec`` (``run_spec``) that the launcher hands to the backend, the roles and
the controller.

A leaf: it loads no JAX, Flax or model code. What needs the devices or a model's files (the
meshes, prompt lengths, memory) is checked by ``rlax_llm.roles.prepare`` before any compute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import math

import ml_collections

from rlax_llm import envs, loss_spec, model_spec, plugins, rewards, tasks
from rlax_llm.cli import DEFAULT_CONFIG_PATH, flat_keys, load_config_file, lookup
from rlax_llm.envs.seeds import env_seeds
from rlax_llm.errors import ConfigError
from rlax_llm.loss_spec import DistillConfig, LossConfig, MismatchConfig
from rlax_llm.model_spec import inference_param_dtype
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.schedule import (ON_SWAP, SCHEDULES, SHORT_BATCHES, ControllerSettings,
                               EpisodeSettings)
from rlax_llm.serve.harness import is_harness, load_harness
from rlax_llm.tasks.hub_datasets import is_hub_url, parse_dataset_url
from rlax_llm.tasks.prompt_length import OVERLONG_POLICIES
from rlax_llm.tokenization import CharTokenizer
from rlax_llm.transport_spec import check_transport

# Keys every config must have (docs, scripts and users rely on them).
REQUIRED_KEYS = (
    'seed', 'total_steps', 'model.name', 'task.name', 'rl.loss', 'rl.group_size',
    'rl.learning_rate', 'staleness.j', 'staleness.k', 'backend', 'checkpoint.every_steps',
    'eval.every_steps', 'mesh',
)

# Groups whose fields vary per config: a task's own fields, an environment's (env.name and
# its keyword arguments), Ray resources and the Ray trainer's environment variables, and two
# optional groups, the named reward components
# (none: the task's reward alone) and the tiny model's architecture (read only with
# model.name='tiny'). The schema does not fix their keys (a prefix ending in '.' keeps the
# group itself required); their owners validate them.
OPEN_GROUPS = ('task.', 'env.', 'ray.trainer_resources.', 'ray.worker_resources.',
               'ray.teacher_resources.', 'ray.trainer_env.', 'reward', 'model.tiny')

# model.routing_replay: 'off' (the trainer routes a mixture of experts by its own router) or
# 'r3' (rollout routing replay: by the experts the inference workers recorded).
ROUTING_REPLAY_MODES = ('off', 'r3')
# model.inference_moe_impl: how the inference workers' engine computes a mixture of experts'
# experts (``roles.inference_model``): '' (as the trainer, ``Execution.moe_impl``), 'ragged'
# (grouped matmuls), 'dense' (every expert on every token, prefill and decode), 'blocked'
# (the routed rows in blocks of one expert each; XLA:CPU's fastest), or
# 'dense_decode' (dense in the decode step only, the trainer's in prefill; docs/models.md).
INFERENCE_MOE_IMPLS = ('', *model_spec.MOE_IMPLS, 'dense_decode')

# Choice fields -> valid values, each named by the module that uses the value (the loss's,
# the sampling's and the task's other fields are checked by their own types).
CHOICES = {
    'backend': ('local', 'ray'),
    'model.param_dtype': model_spec.DTYPES,
    'model.dtype': model_spec.DTYPES,
    'model.inference_param_dtype': ('', *model_spec.DTYPES),  # '': model.param_dtype
    'model.inference_quant': model_spec.QUANT_MODES,
    'model.kv_cache_quant': model_spec.KV_CACHE_QUANT_MODES,
    'model.remat': model_spec.REMAT_POLICIES,
    'model.invariant_rows': model_spec.INVARIANT_ROWS_MODES,
    'model.routing_replay': ROUTING_REPLAY_MODES,
    'model.moe_impl': ('', *model_spec.MOE_IMPLS),  # '': Execution's default
    'model.inference_moe_impl': INFERENCE_MOE_IMPLS,
    'lora.sync': model_spec.LORA_SYNCS,
    'lora.base_quant': model_spec.QUANT_MODES,
    'lora.sync_dtype': model_spec.LORA_SYNC_DTYPES,
    'rollout.on_swap': ON_SWAP,
    'rollout.layer_loop': ('auto', *model_spec.LAYER_LOOPS),  # rollout.engine.Engine
    'rollout.short_batches': SHORT_BATCHES,
    'staleness.schedule': SCHEDULES,
    'sampling.overlong_prompts': OVERLONG_POLICIES,
    'teacher.dtype': model_spec.DTYPES,
    'teacher.quant': model_spec.QUANT_MODES,
}

POSITIVE_INTS = ('rl.group_size', 'rl.prompts_per_step', 'rl.max_nonfinite_updates',
                 'rl.micro_batches', 'checkpoint.keep',
                 'rollout.slots', 'rollout.workers', 'ray.trainer_processes',
                 'sampling.max_new_tokens', 'sampling.max_prompt_len', 'warmup.batch_size',
                 'log.console_every', 'agent.num_eval')
NON_NEGATIVE_INTS = ('seed', 'total_steps', 'rl.logprob_chunk', 'rl.lr_decay_steps',
                     'rollout.stop_after_groups', 'warmup.steps', 'warmup.warmup_steps',
                     'eval.every_steps', 'checkpoint.every_steps', 'log.text_every',
                     'ray.worker_restarts', 'ray.teacher_restarts', 'lora.rank',
                     'agent.max_turns', 'agent.max_concurrent_episodes', 'agent.max_turn_tokens',
                     'agent.eval_seed_start', 'teacher.seed')
# Floats: key -> (lowest valid value, whether the lowest value itself is valid).
FLOATS = {
    'rl.learning_rate': (0.0, False),
    'rl.max_grad_norm': (0.0, True),
    'rl.weight_decay': (0.0, True),
    'rl.moe_aux_loss_coef': (0.0, True),
    'lora.alpha': (0.0, False),
    'warmup.learning_rate': (0.0, False),
    'checkpoint.every_seconds': (0.0, True),
    'checkpoint.preemption_notice_s': (0.0, True),
    'agent.timeout_s': (0.0, False),
}


def in_groups(key: str, prefixes: tuple[str, ...]) -> bool:
  """Whether ``key`` is one of ``prefixes`` or under one (a prefix ending in '.': any key
  that starts with it; another: the key itself or a key below it)."""
  return any(key == p or (p.endswith('.') and key.startswith(p))
             or (not p.endswith('.') and key.startswith(p + '.')) for p in prefixes)


@functools.cache
def _schema() -> tuple[str, ...]:
  """Every key of the packaged default config outside ``OPEN_GROUPS``."""
  return tuple(key for key in flat_keys(load_config_file(str(DEFAULT_CONFIG_PATH)))
               if not in_groups(key, OPEN_GROUPS))


def _check_schema(config: ml_collections.ConfigDict) -> None:
  """Every schema key is present and no other key outside ``OPEN_GROUPS`` is."""
  for key in _schema():
    lookup(config, key)
  schema = set(_schema())
  for key in flat_keys(config):
    if key not in schema and not in_groups(key, OPEN_GROUPS):
      close = difflib.get_close_matches(key, sorted(schema), n=3)
      hint = f' Did you mean {" or ".join(close)}?' if close else ''
      raise ConfigError(f'config key {key!r} is not a config field (the schema is '
                        f'{DEFAULT_CONFIG_PATH.name}\'s keys).{hint} Remove or rename it.')


@contextlib.contextmanager
def naming(prefix: str):
  """Re-raises a ValueError from a typed object's validation as a ConfigError under
  ``config.<prefix>``: the types validate their fields (once, in one place), messages start
  with the field, and this adds where in the config it sits."""
  try:
    yield
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(f'config.{prefix}{e}') from None


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """The run's typed values, built once from a config by ``run_spec`` (which
  ``validate_config`` returns): what the roles and the controller read instead of the
  ``ConfigDict``'s fields.

  Attributes:
    loss: the trainer's loss (``config.rl``; ``rl.mismatch`` when enabled).
    sampling: the rollout sampling transform (``config.sampling``; greedy is refused).
    controller: the controller's settings (schedule, staleness, rollouts, eval, reward).
    keep_versions: the versions the parameter server holds (``paramserver.keep_versions``;
      0 there: the schedule's ``versions_kept``, ``k + 2``).
    transport: how the Ray backend moves versions between processes of one machine
      (``paramserver.transport``: ``'auto'``, shared-memory slots; ``'object_store'``).
    distill: on-policy distillation from ``config.teacher`` (``rl.distill``; kind 'off':
      none).
  """

  loss: LossConfig
  sampling: SamplingSpec
  controller: ControllerSettings
  keep_versions: int
  transport: str
  distill: DistillConfig = DistillConfig()


def run_spec(config: ml_collections.ConfigDict) -> RunSpec:
  """The ``RunSpec`` of ``config``: its loss, rollout sampling and controller settings, each
  validated by its type (``ConfigError`` naming the key when one is not). ``validate_config``
  calls it (and returns its result); a process that receives only the config (a Ray actor)
  calls it to build the same values."""
  loss = _loss_config(config)
  sampling = _sampling_spec(config)
  controller = _controller_settings(config, loss, sampling)
  return RunSpec(loss=loss, sampling=sampling, controller=controller,
                 keep_versions=_keep_versions(config, controller),
                 transport=_transport(config), distill=_distill_config(config))


def _transport(config: ml_collections.ConfigDict) -> str:
  """``paramserver.transport``, one of ``transport_spec.TRANSPORTS``."""
  with naming(''):
    return check_transport(config.paramserver.transport)


def _keep_versions(config: ml_collections.ConfigDict, settings: ControllerSettings) -> int:
  """``paramserver.keep_versions``, or the schedule's ``versions_kept`` (``k + 2``) for 0;
  fewer than that is refused: a worker could be asked for a version already dropped."""
  keep, needed = config.paramserver.keep_versions, settings.versions_kept
  if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
    raise ConfigError(f'config.paramserver.keep_versions={keep!r} must be an int >= 0 (0: '
                      f'staleness.k + 2 = {needed}).')
  if keep == 0:
    return needed
  if keep < needed:
    raise ConfigError(
        f'config.paramserver.keep_versions={keep} is below the {needed} versions the schedule '
        f'needs (staleness.k + 2 = {settings.staleness_k} + 2: the k versions it may still '
        'sample with and the bases of the workers\' deltas); set paramserver.keep_versions >= '
        f'{needed}, or 0 for exactly that.')
  return keep


def _loss_config(config: ml_collections.ConfigDict) -> LossConfig:
  """The ``LossConfig`` of ``config.rl`` (its fields by name; ``rl.mismatch`` when enabled)."""
  rl = config.rl
  fields = {f.name: rl[f.name] for f in dataclasses.fields(LossConfig) if f.name != 'mismatch'}
  mismatch = None
  if rl.mismatch.enabled:
    with naming('rl.'):
      mismatch = MismatchConfig(**{k: v for k, v in rl.mismatch.items() if k != 'enabled'})
  with naming('rl.'):
    return LossConfig(**fields, mismatch=mismatch)


def _distill_config(config: ml_collections.ConfigDict) -> DistillConfig:
  """The ``DistillConfig`` of ``rl.distill``, and the teacher it needs: ``teacher.enabled``
  exactly when ``rl.distill.kind`` is not 'off', and a teacher model name. Either schedule:
  the teacher scores the tokens a batch trains, whichever versions drew them (free-running),
  and the signal uses each token's own behaviour log-prob (docs/losses.md)."""
  with naming('rl.'):
    distill = DistillConfig(**config.rl.distill.to_dict())
  t = config.teacher
  if distill.enabled != t.enabled:
    raise ConfigError(
        f'config.rl.distill.kind={distill.kind!r} but config.teacher.enabled={t.enabled!r}: '
        'on-policy distillation needs a teacher and a teacher is loaded only for it. Set '
        "teacher.enabled=True with a distillation kind, or both off (kind='off').")
  if not distill.enabled:
    return distill
  valid = ('tiny', 'auto', *sorted(model_spec.PRESET_ARCHITECTURES))
  if t.name not in valid:
    raise ConfigError(f'config.teacher.name={t.name!r} is not valid; choose one of {valid}.')
  if t.name != 'tiny' and t.path is None and t.name not in model_spec.PACKAGED_CHECKPOINTS:
    raise ConfigError(f'config.teacher.name={t.name!r} needs config.teacher.path (a checkpoint '
                      'directory or a hub id): no checkpoint of it ships with rlax_llm.')
  if (t.name == 'tiny') != (config.model.name == 'tiny'):
    raise ConfigError(
        f"config.teacher.name={t.name!r} with config.model.name={config.model.name!r}: a "
        "'tiny' teacher has the tiny student's character tokenizer, so both are 'tiny' or "
        'neither is (the teacher must share the student\'s tokenizer).')
  return distill


def _sampling_spec(config: ml_collections.ConfigDict) -> SamplingSpec:
  """The rollout ``SamplingSpec`` of ``config.sampling`` (greedy is refused for rollouts)."""
  s = config.sampling
  with naming('sampling.'):
    return SamplingSpec(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p
                        ).check_for_rollouts()


def _controller_settings(config: ml_collections.ConfigDict, loss: LossConfig,
                         sampling: SamplingSpec) -> ControllerSettings:
  """The controller's ``ControllerSettings`` (schedule, staleness, rollout sampling, the
  estimator's fit to the rollouts: validated by the type), after the checks that name the
  config's keys better than its own would (staleness, a group of one)."""
  for key in ('staleness.j', 'staleness.k'):
    value = lookup(config, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ConfigError(f'config.{key}={value!r} must be an int >= 1 (RLAX staleness: j is '
                        'the reload threshold, k the acceptance window; (1, 1) is lockstep).')
  _validate_group_size(config, loss)
  r = config.rollout
  with naming(''):
    return ControllerSettings(
        total_steps=config.total_steps, prompts_per_step=config.rl.prompts_per_step,
        group_size=config.rl.group_size, staleness_j=config.staleness.j,
        staleness_k=config.staleness.k, eval_every=config.eval.every_steps, seed=config.seed,
        rl_seed=_rl_seed(config),
        sampling=sampling, max_new_tokens=config.sampling.max_new_tokens,
        advantage_estimator=loss.estimator, oversample=r.oversample,
        worker_timeout_s=r.worker_timeout_s, stop_after_groups=r.stop_after_groups,
        short_batches=r.short_batches, replay=r.replay, schedule=config.staleness.schedule,
        eval_samples=config.eval.samples,
        reward=(config.reward.to_dict() if config.get('reward') and not config.env.name
                else None),
        episodes=_episode_settings(config) if config.env.name else None)


def _rl_seed(config: ml_collections.ConfigDict) -> int | None:
  """``rl.seed``: None (the RL sampling keys follow ``config.seed``) or an int >= 0."""
  value = lookup(config, 'rl.seed')
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
    raise ConfigError(f'config.rl.seed={value!r} must be None (the RL sampling keys follow '
                      'config.seed) or an int >= 0 (their own seed); e.g. --config.rl.seed=1.')
  return value


def _episode_settings(config: ml_collections.ConfigDict) -> EpisodeSettings:
  """The ``EpisodeSettings`` of an environment run (``env.*``, ``agent.*``, ``rl.turn_*``;
  the type checks the turn estimators' knobs)."""
  a, rl, s = config.agent, config.rl, config.sampling
  turn_tokens = a.max_turn_tokens or s.max_new_tokens
  if turn_tokens > s.max_new_tokens:
    raise ConfigError(
        f'config.agent.max_turn_tokens={a.max_turn_tokens} exceeds sampling.max_new_tokens='
        f'{s.max_new_tokens}, the budget of the whole conversation after the first prompt; '
        'lower it or raise sampling.max_new_tokens.')
  concurrent = a.max_concurrent_episodes or config.rollout.slots
  if concurrent > config.rollout.slots:
    raise ConfigError(
        f'config.agent.max_concurrent_episodes={concurrent} exceeds rollout.slots='
        f'{config.rollout.slots} (an episode holds a KV-cache slot for its whole life); lower '
        'it or raise rollout.slots.')
  with naming(''):
    return EpisodeSettings(
        env=config.env.to_dict(), max_turns=a.max_turns or None,
        max_concurrent_episodes=concurrent, timeout_s=float(a.timeout_s),
        max_turn_tokens=turn_tokens, length=s.max_prompt_len + s.max_new_tokens + 1,
        num_eval=a.num_eval, eval_seed_start=a.eval_seed_start, gamma=rl.turn_gamma,
        omega=rl.turn_omega, norm=rl.turn_norm)


# What an environment run refuses: key -> (its value that does not apply, why). Each is a
# single-turn feature whose unit is a completion of a prompt, not an episode.
_NOT_FOR_EPISODES = {
    'rollout.stop_after_groups': (lambda v: v != 0, (
        'APRIL continues unfinished completions token by token; an episode in flight holds '
        'environment state, so it is played whole')),
    'rl.shared_prefix': (lambda v: v, (
        'it scores a window of max_new_tokens after one shared prompt; an episode interleaves '
        'turns and observations')),
    'rollout.oversample': (lambda v: v != 0,
                           'dynamic sampling filters and recycles single-turn groups'),
    'rollout.replay': (lambda v: v != 0, 'the replay pool re-asks single-turn prompts'),
    'staleness.schedule': (lambda v: v != 'deterministic',
                           'episodes are played with the version the schedule names'),
    'eval.samples': (lambda v: v != 0,
                     'held-out episodes are evaluated greedily (eval/success)'),
}


def _validate_episodes(config: ml_collections.ConfigDict) -> None:
  """An environment run: the environment builds, the single-turn features are off, and a
  checkpointed run samples every batch with the trainer's own version (``staleness.k = 1``):
  episodes in flight at a save are regenerated on resume, with weights the checkpoint
  holds."""
  for key, (applies, why) in _NOT_FOR_EPISODES.items():
    value = lookup(config, key)
    if applies(value):
      raise ConfigError(f'config.{key}={value!r} does not apply to an environment run '
                        f'(env.name={config.env.name!r}): {why}. Leave it at its default.')
  reward = config.reward.to_dict() if config.get('reward') else {}
  if reward not in ({}, {'task': {'weight': 1.0}}):
    raise ConfigError(f'config.reward={reward!r} shapes a task\'s verifier reward; an '
                      'environment run trains on the environment\'s own rewards. Remove the '
                      'reward components (or set env.name=\'\').')
  if checkpointing(config) and config.staleness.k > 1:
    raise ConfigError(
        f'config.staleness.k={config.staleness.k} with checkpoints in an environment run: '
        'episodes in flight at a checkpoint are regenerated on resume, with the weights of '
        'the version that sampled them, but a checkpoint holds only the trainer\'s; set '
        'staleness.k=1 (and j=1), or checkpoint.every_steps=0 and checkpoint.every_seconds=0.')
  if is_harness(config.env):  # an agent harness plays the episodes (docs/serving.md)
    with naming(''):
      load_harness(config.env)
    return
  with naming('env.'):
    env = envs.make_env(config.env)
  if config.warmup.steps > 0 and not callable(getattr(env, 'oracle_action', None)):
    raise ConfigError(f'config.warmup.steps={config.warmup.steps} warms up on the oracle\'s '
                      f'episodes, but environment {config.env.name!r} ({type(env).__name__}) '
                      'defines no oracle_action(); set warmup.steps=0 or implement it '
                      '(docs/environments.md).')


def validate_config(config: ml_collections.ConfigDict, *, read_hub: bool = True) -> RunSpec:
  """The run's typed values (``run_spec``), built once here with every check; raises
  ``ConfigError`` naming the first key that is missing or invalid.

  ``read_hub=False`` (a dry run without the network, ``rlax_llm.hub_check``): a task whose
  ``task.path`` is a hub dataset (``hf://``) is not built, since that reads the dataset; its
  class and fields are checked (``tasks.task_fields``), its data and reward components on
  the hosts.

  Checks everything that needs neither JAX nor a model file: every key of the schema (the
  packaged default config's), choices, ints and floats, the loss, the sampling transform,
  staleness and the controller's settings (``run_spec``), the task's own fields (it is built)
  and its reward components, the environment, the model's name, path, combinations and (the
  tiny model's) architecture and sequence length (``model_spec.check_config``). What needs
  the devices (the meshes) or a checkpoint's config or tokenizer (prompt lengths, memory) is
  checked by ``rlax_llm.roles.prepare`` before any compute.
  """
  for key in REQUIRED_KEYS:
    lookup(config, key)
  _check_schema(config)
  for key, valid in CHOICES.items():
    _check_choice(key, lookup(config, key), valid)
  for key in POSITIVE_INTS + NON_NEGATIVE_INTS:
    value = lookup(config, key)
    low = 1 if key in POSITIVE_INTS else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ConfigError(f'config.{key}={value!r} must be an int >= {low}.')
  for key, (low, inclusive) in FLOATS.items():
    if key.startswith('warmup.') and config.warmup.steps == 0:
      continue
    value = lookup(config, key)
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and (value >= low if inclusive else value > low))
    if not ok:
      raise ConfigError(f'config.{key}={value!r} must be a finite number '
                        f'{">=" if inclusive else ">"} {low}.')
  spec = run_spec(config)
  settings = spec.controller
  _validate_micro_batches(config, spec.loss)
  _validate_checkpoint(config)
  _validate_ray(config)
  _validate_free_running(config)
  if config.env.name:
    _validate_episodes(config)
  _validate_moe(config)
  task = _validate_task(config, read_hub)
  if settings.reward and task is not None:
    with naming(''):
      rewards.make_components(settings.reward, task, settings.max_new_tokens)
  model_spec.check_config(config)
  return spec


def _validate_moe(config: ml_collections.ConfigDict) -> None:
  """``model.routing_replay='r3'``, ``rl.moe_aux_loss_coef > 0`` and ``model.moe_impl`` or
  ``model.inference_moe_impl`` other than '' need a mixture of experts (known here for the
  tiny model and the presets; ``'auto'`` is checked when the workers' engines are built,
  ``roles.inference_model``): set on a dense model they would do nothing, which is refused
  rather than ignored. The aux loss needs the full forward (not ``rl.shared_prefix``)."""
  m = config.model
  used = [key for key, on in (('model.routing_replay', m.routing_replay != 'off'),
                              ('rl.moe_aux_loss_coef', config.rl.moe_aux_loss_coef > 0),
                              ('model.moe_impl', m.moe_impl != ''),
                              ('model.inference_moe_impl', m.inference_moe_impl != '')) if on]
  if not used:
    return
  if m.name == 'tiny':
    experts = m.tiny.to_dict().get('num_experts', 0)
  else:
    preset = model_spec.PRESET_ARCHITECTURES.get(m.name)
    experts = None if preset is None else preset.num_experts
  if experts == 0:
    raise ConfigError(f'config.{used[0]} applies to a mixture of experts, but '
                      f'model.name={m.name!r} is dense (num_experts=0); set it off '
                      "(routing_replay='off', moe_aux_loss_coef=0, moe_impl='', "
                      "inference_moe_impl=''), or "
                      'pick a MoE model (e.g. model.tiny.num_experts > 0).')
  if config.rl.moe_aux_loss_coef > 0 and config.rl.shared_prefix:
    raise ConfigError('config.rl.moe_aux_loss_coef > 0 needs the full forward but '
                      'rl.shared_prefix=True scores through a KV cache; set one of them off.')


def _check_choice(key: str, value, valid) -> None:
  if value not in valid:
    raise ConfigError(f'config.{key}={value!r} is not valid; choose one of {list(valid)}.')


def _validate_group_size(config: ml_collections.ConfigDict, loss: LossConfig) -> None:
  """A group of one has no group baseline to compare with: every advantage would be 0."""
  if config.rl.group_size == 1 and loss.estimator not in loss_spec.BASELINE_FREE:
    raise ConfigError(
        f'config.rl.group_size=1 with the {loss.estimator!r} advantage estimator (rl.loss='
        f'{config.rl.loss!r}): it compares each sample with the others of its group, so a '
        'group of one gets advantage 0 and the run would train nothing. Set rl.group_size >= 2, '
        f'or an estimator without a group baseline (rl.advantage_estimator in '
        f'{list(loss_spec.BASELINE_FREE)}).')


def _validate_micro_batches(config: ml_collections.ConfigDict, loss: LossConfig) -> None:
  micro, rl = config.rl.micro_batches, config.rl
  rows = rl.prompts_per_step * rl.group_size
  if rows % micro:
    raise ConfigError(f'config.rl.micro_batches={micro} does not divide the batch of '
                      f'rl.prompts_per_step * rl.group_size = {rows} rows; choose a divisor.')
  if micro > 1 and loss.spec.objective == 'm2po':
    raise ConfigError(f'config.rl.micro_batches={micro} with rl.loss={rl.loss!r}: M2PO masks '
                      'tokens by a statistic of the whole batch, so it is not computed one '
                      'micro-batch at a time; set rl.micro_batches=1 (rl.logprob_chunk also '
                      'saves memory and works with M2PO).')


def checkpointing(config: ml_collections.ConfigDict) -> bool:
  """Whether the run writes checkpoints (``checkpoint.every_steps`` or ``every_seconds``
  set); on either backend, the trainer's process writes them."""
  return bool(config.checkpoint.every_steps or config.checkpoint.every_seconds)


def _validate_checkpoint(config: ml_collections.ConfigDict) -> None:
  c = config.checkpoint
  if not isinstance(c.async_save, bool):
    raise ConfigError(f'config.checkpoint.async_save={c.async_save!r} must be True or False.')


def _validate_ray(config: ml_collections.ConfigDict) -> None:
  """``ray.trainer_processes`` > 1 is a Ray trainer gang (a local multi-host run is
  ``distributed.*``); ``ray.trainer_env`` maps variable names to strings; on Ray a teacher
  asks for resources of its own when the other roles ask for chips (``ray.teacher_resources``:
  Ray holds none for an actor that asks for none, so it would share, or fail to open, chips
  the trainer or a worker holds)."""
  r = config.ray
  others = [f'ray.{role}_resources' for role in ('trainer', 'worker')
            if 'TPU' in r[f'{role}_resources']]
  if (config.backend == 'ray' and config.teacher.enabled and others
      and not r.teacher_resources):
    raise ConfigError(
        f'config.ray.teacher_resources is empty but {" and ".join(others)} ask for \'TPU\': '
        'on-policy distillation\'s teacher actor would be given no chip of its own (Ray '
        'places it on any node and holds nothing for it, so it opens chips another actor '
        "holds, or runs on the CPU). Set --config.ray.teacher_resources='{\"TPU\": 1}' (a "
        'chip of its own; on a host shared with other actors, the same "TPU" count as '
        "theirs), or '{\"CPU\": 1}' to score on a CPU host on purpose.")
  if r.trainer_processes > 1 and config.backend != 'ray':
    raise ConfigError(f'config.ray.trainer_processes={r.trainer_processes} with backend='
                      f'{config.backend!r}: it sets how many Ray actors the trainer spans; '
                      "use backend='ray', or config.distributed.* for a multi-host local run.")
  for name, value in r.trainer_env.items():
    if not isinstance(value, str):
      raise ConfigError(f'config.ray.trainer_env.{name}={value!r} must be a string (an '
                        'environment variable of each trainer actor\'s process).')


def _validate_free_running(config: ml_collections.ConfigDict) -> None:
  """``staleness.schedule='free'`` needs roles that run at the same time (a version pushed
  while a batch is generated is what it picks up), and writes no checkpoints: which version
  drew which token depends on timing, so a resumed run could not continue it exactly."""
  if config.staleness.schedule != 'free':
    return
  if config.backend == 'local' and not config.local.concurrent:
    raise ConfigError("config.staleness.schedule='free' with local.concurrent=False: every "
                      'call runs inline, so no version is ever pushed while a batch is '
                      'generated and free-running would only be a slower deterministic '
                      "schedule; set local.concurrent=True or staleness.schedule="
                      "'deterministic'.")
  c = config.checkpoint
  if c.every_steps or c.every_seconds:
    raise ConfigError(
        "config.staleness.schedule='free' with checkpoints (checkpoint.every_steps="
        f'{c.every_steps!r}, checkpoint.every_seconds={c.every_seconds!r}): a free-running '
        'run is not reproducible (which version draws which token depends on timing), so it '
        'cannot be resumed exactly; set checkpoint.every_steps=0 and '
        "checkpoint.every_seconds=0, or use staleness.schedule='deterministic' (which "
        'checkpoints and resumes bit for bit).')


def effective_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """``config`` with the values a run uses in place of the placeholders it fills in: the
  loss's own defaults (``LossConfig.resolve``: e.g. DAPO's ``eps_high=0.28``) in ``rl``."""
  effective = config.copy_and_resolve_references()
  effective.unlock()
  resolved = _loss_config(config).resolve()
  for field in loss_spec.RESOLVED_FIELDS:
    effective.rl[field] = getattr(resolved, field)
  return effective


def _validate_task(config: ml_collections.ConfigDict, read_hub: bool = True):
  """The task ``config.task`` builds (a built-in name or a task class by import path);
  ConfigError naming the field when it cannot, or when the run needs what the task lacks: a
  ``charset`` for ``model.name='tiny'`` (its character tokenizer's alphabet), ``sft_example``
  for a warm-up. None, with only the class and fields checked, for a hub dataset task when
  not ``read_hub``."""
  name = lookup(config, 'task.name')
  if config.env.name:  # an environment run: its prompts are the environment's seeds
    with naming('agent.'):
      return env_seeds(config)
  if name not in tasks.TASKS and not plugins.is_import_path(name):
    raise ConfigError(f'config.task.name={name!r} is not valid; choose one of '
                      f'{sorted(tasks.TASKS)}, or a task class of yours as '
                      '"module.path:ClassName" (docs/custom_tasks.md).')
  fields = config.task.to_dict() | {'seed': config.seed}
  if not read_hub and is_hub_url(fields.get('path')):
    with naming('task: '):
      task_cls, _ = tasks.task_fields(fields)
      parse_dataset_url(fields['path'])
    _check_warmup(config, name, task_cls)
    return None
  with naming('task: '):
    task = tasks.make_task(fields)
  if config.model.name == 'tiny':
    if not task.charset:
      raise ConfigError(
          f'config.model.name=\'tiny\' builds a character-level model over the task\'s '
          f'charset, but task {name!r} has none (charset={task.charset!r}); use a pretrained '
          'model (e.g. --config=configs/smollm2.py), or give the task a charset property '
          '(docs/custom_tasks.md).')
    with naming(f'task: {name!r} charset: '):
      CharTokenizer(task.charset)
  _check_warmup(config, name, type(task))
  return task


def _check_warmup(config: ml_collections.ConfigDict, name: str, task_cls: type) -> None:
  if config.warmup.steps > 0 and not tasks.defines(task_cls, 'sft_example'):
    raise ConfigError(f'config.warmup.steps={config.warmup.steps} needs warm-up demonstrations '
                      f'but task {name!r} defines no sft_example(index); set warmup.steps=0 '
                      'or implement it (docs/custom_tasks.md).')
