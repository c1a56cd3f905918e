"""Every bad config value fails before any compute, in seconds, naming the key.

``validate_config`` checks what needs neither JAX nor a model file; ``roles.prepare`` checks
what needs the devices (the meshes) or the model's config and tokenizer (prompt lengths,
memory) before the warm-up or any compilation.
"""

import pathlib
import time

import jax
import pytest

from rlax_llm import memory_fit, roles
from rlax_llm.backends import local as local_backend
from rlax_llm.cli import load_config_file
from rlax_llm.config import validate_config
from rlax_llm.errors import ConfigError
from rlax_llm.losses import LossConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAN, INF = float('nan'), float('inf')

BAD = [
    # key, value, message fragment
    ('rl.learning_rate', 0.0, 'config.rl.learning_rate=0.0 must be a finite number > 0'),
    ('rl.learning_rate', -1e-4, 'config.rl.learning_rate=-0.0001'),
    ('rl.learning_rate', NAN, 'config.rl.learning_rate=nan'),
    ('rl.learning_rate', INF, 'config.rl.learning_rate=inf'),
    ('warmup.learning_rate', 0.0, 'config.warmup.learning_rate=0.0'),
    ('rl.lr_decay_steps', -5, 'config.rl.lr_decay_steps=-5 must be an int >= 0'),
    ('rl.max_grad_norm', -1.0, 'config.rl.max_grad_norm=-1.0'),
    ('rl.weight_decay', NAN, 'config.rl.weight_decay=nan'),
    ('sampling.temperature', 0.0, 'config.sampling.temperature=0 (greedy) is not valid for RL'),
    ('sampling.temperature', -0.5, 'config.sampling.temperature=-0.5'),
    ('sampling.temperature', NAN, 'config.sampling.temperature=nan'),
    ('sampling.top_k', -1, 'config.sampling.top_k=-1'),
    ('sampling.top_p', 0.0, 'config.sampling.top_p=0.0'),
    ('sampling.top_p', 1.5, 'config.sampling.top_p=1.5'),
    ('sampling.max_new_tokens', 0, 'config.sampling.max_new_tokens=0 must be an int >= 1'),
    ('sampling.max_new_tokens', 40, 'config.model.max_seq_len=16 is shorter than'),
    ('sampling.max_prompt_len', 3, 'config.sampling.max_prompt_len=3 is too short'),
    ('model.max_seq_len', 8, 'config.model.max_seq_len=8 is shorter than'),
    ('model.tiny.num_heads', 3, 'config.model.tiny.num_heads (3) must be a multiple'),
    ('model.name', 'gpt5', "config.model.name='gpt5' is not valid"),
    ('model.name', 'qwen3-0.6b', "config.model.name='qwen3-0.6b' needs config.model.path"),
    ('model.dtype', 'float16', "config.model.dtype='float16' is not valid"),
    ('model.remat', 'some', "config.model.remat='some' is not valid"),
    ('rl.loss', 'trpo', "config.rl.loss='trpo' is not valid"),
    ('rl.eps_low', -0.1, 'config.rl.eps_low=-0.1 must be a finite number >= 0'),
    ('rl.kl_beta', NAN, 'config.rl.kl_beta=nan'),
    ('rl.m2po_tau', 0.0, 'config.rl.m2po_tau=0.0'),
    ('rl.group_size', 0, 'config.rl.group_size=0 must be an int >= 1'),
    ('rl.group_size', 1, "config.rl.group_size=1 with the 'grpo' advantage estimator "
     "(rl.loss='grpo'): it compares each sample with the others of its group, so a group of "
     'one gets advantage 0 and the run would train nothing. Set rl.group_size >= 2'),
    ('rl.prompts_per_step', 3, "config.mesh.trainer: the batch axis is split over data x fsdp"),
    ('rl.prompts_per_step', 2**22, 'the rollout batch needs about'),
    ('rl.max_nonfinite_updates', 0, 'config.rl.max_nonfinite_updates=0'),
    ('mesh.trainer.fsdp', 16, 'config.mesh.trainer: 8 devices do not divide'),
    ('mesh.trainer.data', 16, 'config.mesh.trainer: Mesh'),
    ('mesh.inference.data', 3, 'config.mesh.inference: the batch axis is split over'),
    ('mesh.disjoint', True, 'config.mesh.inference: worker 0 gets no device'),
    ('task.name', 'gsm8k', "config.task.name='gsm8k' is not valid; choose one of "
     "['arithmetic', 'countdown', 'math', 'python']"),
    ('task.max_operand', -1, 'config.task: ArithmeticTask max_operand must be >= 0, got -1'),
    ('task.format', 'chat', 'config.task.format=\'chat\' prompts are chat messages'),
    ('task.answer_format', 'fuzzy', "config.task: ArithmeticTask answer_format='fuzzy'"),
    ('staleness.k', 0, 'config.staleness.k=0 must be an int >= 1'),
    ('staleness.j', 4, 'config.staleness (j, k) = (4, 1): j must be <= k'),
    ('rollout.oversample', 5.0, 'config.rollout.oversample=5.0 must be in [0, 4]'),
    ('rollout.replay', 1.0, 'config.rollout.replay=1.0 must be in [0, 1)'),
    ('rollout.worker_timeout_s', 0.0, 'config.rollout.worker_timeout_s=0.0 must be > 0'),
    ('rollout.stop_after_groups', 3, 'config.rollout.stop_after_groups=3 must be 0 (off) or an '
     'int in [rl.prompts_per_step, groups requested per batch] = [4, 4]'),
    ('rollout.stop_after_groups', -1, 'config.rollout.stop_after_groups=-1 must be an int >= 0'),
    ('rollout.workers', 0, 'config.rollout.workers=0 must be an int >= 1'),
    ('rollout.on_swap', 'later', "config.rollout.on_swap='later' is not valid"),
    ('rollout.short_batches', 'drop', "config.rollout.short_batches='drop' is not valid"),
    ('backend', 'slurm', "config.backend='slurm' is not valid"),
    ('paramserver.keep_versions', 2, 'config.paramserver.keep_versions=2 is below the 3 '
     'versions the schedule needs (staleness.k + 2 = 1 + 2'),
    ('paramserver.keep_versions', -1, 'config.paramserver.keep_versions=-1 must be an int >= 0'),
    ('ray.worker_restarts', -1, 'config.ray.worker_restarts=-1 must be an int >= 0'),
    ('total_steps', -1, 'config.total_steps=-1 must be an int >= 0'),
    ('eval.every_steps', -2, 'config.eval.every_steps=-2'),
]


def _smoke():
  return load_config_file(str(ROOT / 'configs/default.py') + ':smoke')


def _set(config, dotted, value):
  *parents, leaf = dotted.split('.')
  node = config
  for part in parents:
    node = node[part]
  node[leaf] = value


def test_the_smoke_config_passes_every_check():
  config = _smoke()
  validate_config(config)
  roles.prepare(config)


def test_keep_versions_defaults_to_the_schedules_need_and_may_exceed_it():
  """0 keeps exactly ``k + 2`` versions; more is allowed; the message names the fix."""
  config = _smoke()
  config.staleness.j, config.staleness.k = 4, 8
  assert validate_config(config).keep_versions == 10
  config.paramserver.keep_versions = 12
  assert validate_config(config).keep_versions == 12
  config.paramserver.keep_versions = 9
  with pytest.raises(ConfigError, match=r'keep_versions=9 is below the 10 versions .* set '
                     r'paramserver.keep_versions >= 10, or 0 for exactly that'):
    validate_config(config)


def test_ray_with_checkpoints_is_valid():
  """The Ray backend checkpoints (its trainer actor writes) like the local one."""
  config = _smoke()
  config.backend = 'ray'
  config.checkpoint.every_steps, config.checkpoint.every_seconds = 2, 60.0
  validate_config(config)


@pytest.mark.parametrize('key, value, message', BAD, ids=lambda x: str(x))
def test_bad_value_fails_fast_naming_the_key(key, value, message):
  config = _smoke()
  config.unlock()
  _set(config, key, value)
  start = time.perf_counter()
  with pytest.raises(ConfigError) as error:
    validate_config(config)
    roles.prepare(config)
  assert time.perf_counter() - start < 10
  assert message in str(error.value), str(error.value)


@pytest.mark.parametrize('axis', ['mesh.trainer.fsdp', 'mesh.inference.tensor'])
def test_batch_invariant_with_a_split_contraction_is_refused(axis):
  config = _smoke()
  config.model.batch_invariant = True
  validate_config(config)
  _set(config, axis, 2)
  with pytest.raises(ConfigError, match=r'batch_invariant=True makes sampler and trainer '
                                        rf'log-probs equal only when.*{axis}=2; shard with '
                                        r'the data axis only'):
    validate_config(config)


def test_batch_invariant_with_a_bfloat16_inference_copy_is_refused():
  """Bitwise-equal sampler and trainer log-probs need the same weights: a bf16 inference
  copy of float32 master weights cannot give them."""
  config = _smoke()
  config.model.batch_invariant = True
  config.model.inference_param_dtype = 'float32'  # the trainer's dtype, named: allowed
  validate_config(config)
  config.model.inference_param_dtype = 'bfloat16'
  with pytest.raises(ConfigError, match=r"batch_invariant=True makes sampler and trainer "
                                        r"log-probs bitwise equal, but the workers hold the "
                                        r"params in model.inference_param_dtype='bfloat16' and "
                                        r"the trainer in model.param_dtype='float32'.*Set "
                                        r"model.inference_param_dtype=''"):
    validate_config(config)
  config.model.batch_invariant = False
  validate_config(config)
  config.model.inference_param_dtype = 'float16'
  with pytest.raises(ConfigError, match=r"model.inference_param_dtype='float16' is not valid; "
                                        r"choose one of \['', 'float32', 'bfloat16'\]"):
    validate_config(config)


def test_invariant_rows_floor_with_data_parallelism_is_refused():
  config = _smoke()
  config.model.batch_invariant = True
  config.model.invariant_rows = 'floor'
  config.mesh.trainer.data = 1
  validate_config(config)
  roles.check_meshes(config)  # one data shard per role
  config.mesh.inference.data = 2
  config.mesh.disjoint = False
  validate_config(config)  # the meshes are resolved on the devices, at launch
  with pytest.raises(ConfigError, match=r"invariant_rows='floor' pads each weight matmul to "
                                        r'64 rows.*mesh.inference.data resolves to 2'):
    roles.check_meshes(config)
  config.model.invariant_rows = 'rows'
  with pytest.raises(ConfigError, match=r"invariant_rows='rows' is not valid; choose one of"):
    validate_config(config)


def test_m2po_with_recompute_is_refused():
  config = _smoke()
  config.rl.loss = 'm2po'
  config.rl.old_logprobs = 'recompute'
  with pytest.raises(ConfigError, match=r"config.rl.old_logprobs='recompute' cannot be used "
                                        r"with loss='m2po'.*identically 0"):
    validate_config(config)


@pytest.mark.parametrize('estimator', ['reinforce', 'w_reinforce'])
def test_dynamic_sampling_with_a_baseline_free_estimator_is_refused(estimator):
  # Without a group baseline an equal-reward group still trains; dropping it would be silent.
  config = _smoke()
  config.rl.advantage_estimator = estimator
  validate_config(config)  # oversample 0: accepted
  config.rollout.oversample = 1.0
  with pytest.raises(ConfigError, match=rf"config.rollout.oversample=1.0 drops groups whose "
                                        rf"rewards are all equal, but under the '{estimator}'"):
    validate_config(config)


@pytest.mark.parametrize('estimator', ['gigpo', 'trajectory_grpo', 'turn_grpo'])
def test_multi_turn_estimator_is_known_but_refused_for_single_turn_rollouts(estimator):
  # The loss accepts the name (it is a registered estimator); the run refuses it while its
  # rollouts carry no turn arrays, before any compute, instead of failing at the first step.
  LossConfig(advantage_estimator=estimator)
  config = _smoke()
  config.rl.advantage_estimator = estimator
  with pytest.raises(ConfigError, match=rf"config.rl.advantage_estimator='{estimator}' is a "
                                        r"multi-turn estimator.*turn_rewards, turn_mask, "
                                        r"state_ids and token_turn.*'grpo'"):
    validate_config(config)


def test_mismatch_needs_recompute():
  config = _smoke()
  config.rl.mismatch.enabled = True
  with pytest.raises(ConfigError, match=r"config.rl.mismatch: the correction needs "
                                        r"old_logprobs='recompute'"):
    validate_config(config)
  config.rl.old_logprobs = 'recompute'
  config.rl.mismatch.level = 'row'
  with pytest.raises(ConfigError, match=r"config.rl.mismatch.level='row' is not valid"):
    validate_config(config)


@pytest.mark.parametrize('loss, estimator, refused', [
    ('grpo', None, True), ('rloo', None, True), ('drgrpo', None, True), ('dapo', None, True),
    ('grpo', 'median', True), ('grpo', 'gdpo', True), ('grpo', 'reinforce_pp', True),
    ('reinforce', None, False), ('grpo', 'reinforce', False), ('grpo', 'w_reinforce', False),
])
def test_group_size_one_is_refused_for_group_baselines_only(loss, estimator, refused):
  """A group of one has no baseline: every group-relative advantage is 0 (nothing trains);
  the estimators without a group baseline still learn from it."""
  config = _smoke()
  config.rl.loss, config.rl.advantage_estimator, config.rl.group_size = loss, estimator, 1
  config.rl.prompts_per_step = 8  # the batch still splits over the test's 8 devices
  if not refused:
    validate_config(config)
    return
  with pytest.raises(ConfigError, match=r"config.rl.group_size=1 with the '\w+' advantage "
                                        r'estimator.*advantage_estimator in \[.reinforce., '
                                        r'.w_reinforce.\]'):
    validate_config(config)


def test_batch_invariant_with_int8_rollouts_is_refused():
  config = _smoke()
  config.model.batch_invariant = True
  config.model.inference_quant = 'int8'
  with pytest.raises(ConfigError, match=r"batch_invariant=True makes sampler and trainer "
                                        r"log-probs bitwise equal, but "
                                        r"model.inference_quant='int8' samples with a quantised "
                                        r"copy.*Set model.inference_quant='none'"):
    validate_config(config)
  config.model.batch_invariant = False
  validate_config(config)


def test_a_run_whose_memory_plan_does_not_fit_is_refused_before_anything_is_built(
    monkeypatch, tmp_path):
  """``memory_fit.check_plan_fits`` (the local backend calls it once the meshes are resolved,
  before the trainer and workers exist): on CPU the plan's per-device bytes summed over the
  devices each role uses, against the host's available memory plus the params already
  loaded. Refused one byte short, accepted at the exact need; the message shows the plan
  and names the keys that shrink it."""
  config = _smoke()
  spec = validate_config(config)
  task, model, params, _ = roles.prepare(config)
  meshes = roles.meshes(config)
  held = sum(x.nbytes for x in jax.tree.leaves(params))
  monkeypatch.setattr(memory_fit, 'available_memory_bytes', lambda: 1e15)
  plan = memory_fit.check_plan_fits(config, model.config, meshes, held_bytes=held)
  trainer_devices = meshes['trainer'].devices.size
  inference_devices = sum(m.devices.size for m in meshes['inference'])
  need = (plan.trainer_bytes * trainer_devices
          + plan.inference_bytes / plan.workers_per_chip * inference_devices)
  assert plan.trainer_bytes > plan.params > 0 and plan.inference_bytes > 0
  monkeypatch.setattr(memory_fit, 'available_memory_bytes', lambda: need - held)
  memory_fit.check_plan_fits(config, model.config, meshes, held_bytes=held)  # fits exactly
  monkeypatch.setattr(memory_fit, 'available_memory_bytes', lambda: need - held - 1)
  with pytest.raises(ConfigError, match=r'needs at least .* GiB on the host .*trainer: params '
                     r'.*inference: .*raise config.rl.micro_batches, set config.model.remat=full'):
    memory_fit.check_plan_fits(config, model.config, meshes, held_bytes=held)
  # Through the local backend: refused before the trainer or any worker is built.
  built = []
  monkeypatch.setattr(roles, 'warm_trainer', lambda *a, **k: built.append('trainer'))
  monkeypatch.setattr(roles, 'check_fits', lambda *a, **k: None)  # the rollout check's own
  with pytest.raises(ConfigError, match='needs at least'):
    with local_backend.build_run(config, tmp_path, spec):
      pass
  assert built == []
