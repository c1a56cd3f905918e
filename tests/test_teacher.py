"""The teacher role of on-policy distillation (rlax_llm/trainer/teacher.py) and its wiring
(controller.completions.distill_batch, roles.build_teacher, rl.distill / teacher config): its
scores equal a direct forward of the teacher, a tokenizer mismatch is refused, a short
distillation run lowers the measured student-teacher KL and stays deterministic."""

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from smoke_config import smoke_config

from rlax_llm import memory_fit, roles
from rlax_llm.backends.local import build_run
from rlax_llm.cli import load_config_file
from rlax_llm.config import run_spec, validate_config
from rlax_llm.controller.completions import Distillation, distill_batch
from rlax_llm.data_types import TrainBatch
from rlax_llm.errors import ConfigError
from rlax_llm.loss_spec import DistillConfig, LossConfig
from rlax_llm.losses import batch_totals, gkd_loss
from rlax_llm.metrics import read_metrics
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models import lora as lora_lib
from rlax_llm.models.model import create_model
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.sharding import make_mesh
from rlax_llm.tokenization import CharTokenizer
from rlax_llm.trainer.objectives import loss_totals, rl_objective
from rlax_llm.trainer.scoring import Policy
from rlax_llm.trainer.teacher import Teacher, check_same_tokenizer
from rlax_llm.trainer.trainer import Trainer

ALPHABET = '0123456789+= '
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope='module')
def tiny():
  tokenizer = CharTokenizer(ALPHABET)
  config = DecoderConfig(vocab_size=tokenizer.vocab_size, num_layers=1, embed_dim=32,
                         num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=12)
  model, params = create_model(config, seed=3)
  tokens = np.random.default_rng(0).integers(0, tokenizer.vocab_size, (3, 12)).astype(np.int32)
  mask = np.zeros((3, 12), np.float32)
  mask[:, 5:10] = 1.0
  mask[2, 8:] = 0.0
  return tokenizer, model, params, tokens, mask


def _direct(model, params, tokens):
  """log-softmax of the teacher's logits, position t predicting token t + 1."""
  return np.asarray(jax.nn.log_softmax(model.apply(params, tokens)[:, :-1], axis=-1))


def test_teacher_logprobs_equal_a_direct_forward(tiny):
  tokenizer, model, params, tokens, mask = tiny
  scores = Teacher(model, params, tokenizer, tokenizer, top_k=4).score(tokens, mask)
  full = _direct(model, params, tokens)
  want = np.take_along_axis(full, tokens[:, 1:, None], -1)[..., 0]
  want = np.where(mask[:, 1:] > 0, want, 0.0)
  assert scores.logp.shape == tokens.shape and np.all(scores.logp[:, 0] == 0)
  np.testing.assert_allclose(scores.logp[:, 1:], want, rtol=1e-5, atol=1e-6)
  on = mask[:, 1:] > 0
  top = -np.sort(-full, axis=-1)[..., :4]
  np.testing.assert_allclose(scores.top_logp[:, 1:][on], top[on], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      np.take_along_axis(full, scores.top_ids[:, 1:], -1)[on], scores.top_logp[:, 1:][on],
      rtol=1e-5, atol=1e-6)
  assert np.all(scores.top_logp[:, 1:][~on] == 0) and np.all(scores.top_ids[:, 1:][~on] == 0)
  # The chunked path (rl.logprob_chunk) gives the same log-probs.
  chunked = Teacher(model, params, tokenizer, tokenizer, chunk=3).score(tokens, mask)
  np.testing.assert_allclose(chunked.logp, scores.logp, rtol=1e-5, atol=1e-6)


def test_teacher_scores_at_the_sampling_temperature(tiny):
  # A teacher equal to the student scores each token as the student sampled it (at
  # sampling.temperature): its reverse-KL advantage is 0, and distilling from itself is a
  # fixed point. At temperature 1 it would not be (the advantage would be log pi^1 - log
  # pi^0.7), so the scores differ there.
  tokenizer, model, params, tokens, mask = tiny
  scores = Teacher(model, params, tokenizer, tokenizer, temperature=0.7).score(tokens, mask)
  student = Policy(model, SamplingSpec(temperature=0.7)).sequence_log_probs(params, tokens)
  on = mask[:, 1:] > 0
  np.testing.assert_allclose(scores.logp[:, 1:][on], np.asarray(student.logp)[on], rtol=1e-5,
                             atol=1e-6)
  hot = Teacher(model, params, tokenizer, tokenizer).score(tokens, mask)
  assert np.abs(hot.logp - scores.logp)[:, 1:][on].min() > 1e-3
  # Full support whatever the sampler truncates: the teacher's top-k of the scaled logits.
  full = jax.nn.log_softmax(model.apply(params, tokens)[:, :-1] / 0.7, axis=-1)
  top = Teacher(model, params, tokenizer, tokenizer, top_k=3, chunk=5, temperature=0.7)
  got = top.score(tokens, mask)
  np.testing.assert_allclose(got.top_logp[:, 1:][on], -np.sort(-np.asarray(full))[..., :3][on],
                             rtol=1e-5, atol=1e-6)


def _gkd_batch(tiny, top_k=4, temperature=0.7):
  """A batch of ``tiny``'s tokens with the top-k of another model (the teacher) on it."""
  tokenizer, model, _, tokens, mask = tiny
  _, teacher_params = create_model(model.config, seed=11)
  scores = Teacher(model, teacher_params, tokenizer, tokenizer, top_k=top_k,
                   temperature=temperature).score(tokens, mask)
  rng = np.random.RandomState(0)
  return TrainBatch(tokens=tokens, loss_mask=mask,
                    behaviour_logprobs=np.where(mask > 0, -1.0, 0.0).astype(np.float32),
                    support_sizes=np.zeros_like(tokens), advantages=rng.randn(3).astype(
                        np.float32),
                    versions=np.where(mask > 0, 0, -1).astype(np.int32),
                    group_ids=np.arange(3, dtype=np.int32), teacher_top_ids=scores.top_ids,
                    teacher_top_logp=scores.top_logp)


GKD = DistillConfig('gkd', beta=0.3, weight=0.5, top_k=4)


def test_trainer_gkd_term_equals_gkd_loss_on_the_full_logits(tiny):
  _, model, params, tokens, mask = tiny
  batch = _gkd_batch(tiny)
  policy = Policy(model, SamplingSpec(temperature=0.7))
  # Directly: the student's whole log-softmax at the temperature, gathered at the teacher's ids.
  full = jax.nn.log_softmax(model.apply(params, tokens)[:, :-1] / 0.7, axis=-1)
  student = jnp.take_along_axis(full, batch.teacher_top_ids[:, 1:], axis=-1)
  want = float(gkd_loss(student, batch.teacher_top_logp[:, 1:], mask[:, 1:], GKD.beta))
  assert want > 1e-3
  tail = dataclasses.replace(GKD, tail=True)
  want_tail = float(gkd_loss(student, batch.teacher_top_logp[:, 1:], mask[:, 1:], GKD.beta,
                             tail=True))
  assert abs(want_tail - want) > 1e-4

  # The variants as one program (one compilation): plain, with the GKD term, the chunked
  # log-prob path and the shared-prefix windows (the loss tokens lie in [5, 10)), and as one
  # micro-batch of a batch with twice the loss tokens (the term is then its share); GKD with
  # the tail bucket, chunked.
  double = batch_totals(jnp.concatenate([mask[:, 1:]] * 2))
  variants = [(None, {}), (GKD, {}), (GKD, dict(logprob_chunk=3)),
              (GKD, dict(window=5, logprob_chunk=2)), (None, dict(totals=double)),
              (GKD, dict(totals=double)), (tail, dict(logprob_chunk=3))]
  run = jax.jit(lambda p, b: [rl_objective(policy, LossConfig(), p, b, None, gkd=g, **kw)
                              for g, kw in variants])
  ((plain, _), (loss, metrics), (_, chunked), (_, windowed), (plain_share, _), (share, _),
   (_, tailed)) = run(params, batch)
  for m in (metrics, chunked, windowed):
    np.testing.assert_allclose(float(m['distill/gkd']), want, rtol=1e-5)
  np.testing.assert_allclose(float(tailed['distill/gkd']), want_tail, rtol=1e-5)
  np.testing.assert_allclose(float(loss - plain), GKD.weight * want, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(float(share - plain_share), GKD.weight * want / 2, rtol=1e-4,
                             atol=1e-7)


def test_rl_objective_refuses_gkd_without_the_teachers_top_k(tiny):
  _, model, params, _, _ = tiny
  batch = dataclasses.replace(_gkd_batch(tiny), teacher_top_ids=None, teacher_top_logp=None)
  with pytest.raises(ValueError, match="needs the teacher's top-k in the batch"):
    rl_objective(Policy(model, SamplingSpec()), LossConfig(), params, batch, None, gkd=GKD)


def test_gkd_updates_lower_the_divergence_to_the_teacher(tiny):
  # The cheap counterpart of the gkd run test: trainer steps on GKD alone (advantages 0)
  # draw the student's distribution to the teacher's on its support.
  _, model, params, _, _ = tiny
  batch = _gkd_batch(tiny)
  batch = dataclasses.replace(batch, advantages=np.zeros(3, np.float32))
  objective = functools.partial(rl_objective, Policy(model, SamplingSpec(temperature=0.7)),
                                LossConfig(), gkd=GKD, logprob_chunk=4)
  trainer = Trainer(model, params, optax.adam(3e-2), objective,
                    make_mesh({'data': 1}, jax.devices()[:1]), totals_fn=loss_totals)
  divergence = [trainer.step(batch)['distill/gkd'] for _ in range(6)]
  assert divergence[-1] < 0.5 * divergence[0], divergence


def test_a_lora_student_distils_its_adapters_alone(tiny):
  # A LoRA student (lora.rank > 0): the GKD term's gradient trains the adapters; the frozen
  # base stays as it was, and the teacher (its own params, never the trainer's) too.
  tokenizer, model, params, tokens, mask = tiny
  batch = dataclasses.replace(_gkd_batch(tiny), advantages=np.zeros(3, np.float32))
  student, student_params = lora_lib.create(model, params,
                                            lora_lib.LoRAConfig(rank=4, alpha=8.0), seed=0)
  trainable = lora_lib.trainable_mask(student)
  objective = functools.partial(rl_objective, Policy(student, SamplingSpec(temperature=0.7)),
                                LossConfig(), gkd=GKD)
  trainer = Trainer(student, student_params, optax.adam(3e-2), objective,
                    make_mesh({'data': 1}, jax.devices()[:1]), totals_fn=loss_totals,
                    trainable=trainable)
  divergence = [trainer.step(batch)['distill/gkd'] for _ in range(6)]
  assert divergence[-1] < 0.8 * divergence[0], divergence
  changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
                         trainer.host_params(), student_params)
  flat_changed, flat_trainable = jax.tree.leaves(changed), jax.tree.leaves(trainable)
  assert any(flat_changed) and flat_changed == flat_trainable  # adapters, and only they
  _, teacher_params = create_model(model.config, seed=11)
  teacher = Teacher(model, teacher_params, tokenizer, tokenizer, top_k=4, temperature=0.7)
  np.testing.assert_array_equal(teacher.score(tokens, mask).top_logp, batch.teacher_top_logp)
  # And a run's config takes a LoRA student with a teacher.
  assert validate_config(_distill_config(1, lora__rank=4, rl__distill__kind='gkd',
                                         rl__distill__top_k=4)).distill.kind == 'gkd'


def test_tokenizer_mismatch_is_refused_naming_both():
  student = CharTokenizer(ALPHABET)
  with pytest.raises(ValueError, match=r"teacher 'big' and the student 'small' .*vocabulary "
                                       r'sizes differ: 15 vs 16'):
    check_same_tokenizer(CharTokenizer('0123456789+= '[:-1]), student, teacher_name="'big'",
                         student_name="'small'")
  with pytest.raises(ValueError, match=r"1 ids decode differently, e.g. id 15: ' ' vs '-'"):
    check_same_tokenizer(student, CharTokenizer('0123456789+=-'), teacher_name='t',
                         student_name='s')


def test_teacher_refuses_another_tokenizer_before_compute(tiny):
  tokenizer, model, params, _, _ = tiny
  with pytest.raises(ValueError, match='different tokenizers'):
    Teacher(model, params, tokenizer, CharTokenizer('0123456789+-='))


def test_distill_batch_mixes_reverse_kl_advantages_on_the_loss_tokens(tiny):
  tokenizer, model, params, tokens, mask = tiny
  teacher = Teacher(model, params, tokenizer, tokenizer)
  behaviour = np.where(mask > 0, -1.5, 0.0).astype(np.float32)
  batch = TrainBatch(tokens=tokens, loss_mask=mask, behaviour_logprobs=behaviour,
                     support_sizes=np.zeros_like(tokens), advantages=np.array([1., 0., -1.],
                                                                                np.float32),
                     versions=np.zeros_like(tokens), group_ids=np.zeros(3, np.int32))
  teacher_logp = teacher.score(tokens, mask).logp
  out, metrics = distill_batch(batch, Distillation(teacher, DistillConfig('reverse_kl',
                                                                          weight=0.5)))
  want = np.where(mask > 0, batch.advantages[:, None] + 0.5 * (teacher_logp + 1.5), 0.0)
  np.testing.assert_allclose(out.advantages, want, rtol=1e-6, atol=1e-6)
  again, _ = distill_batch(batch, Distillation(teacher, DistillConfig('reverse_kl',
                                                                      weight=0.5)))
  np.testing.assert_array_equal(again.advantages, out.advantages)  # bitwise, call to call
  on = mask > 0
  assert metrics['distill/reverse_kl'] == pytest.approx(float((-1.5 - teacher_logp[on]).mean()),
                                                        rel=1e-5)
  alone, _ = distill_batch(batch, Distillation(teacher, DistillConfig('reverse_kl',
                                                                      with_reward=False)))
  np.testing.assert_allclose(alone.advantages, np.where(on, teacher_logp + 1.5, 0.0),
                             rtol=1e-6, atol=1e-6)


def _distill_config(steps, **fields):
  return smoke_config(**(dict(
      total_steps=steps, rl__distill__kind='reverse_kl', rl__distill__with_reward=False,
      teacher__enabled=True, rl__learning_rate=3e-3, log__tensorboard=False,
      eval__every_steps=0, checkpoint__every_steps=0, checkpoint__every_seconds=0.0,
      staleness__j=2, staleness__k=2) | fields))


def test_distill_batch_of_a_multi_turn_row_signals_only_the_sampled_tokens(tiny):
  # An episode's row: turn 1 (model), an observation (environment), turn 2 (model), with
  # per-token turn advantages [B, T] as Episodes gives them; only the model's tokens change.
  tokenizer, model, params, tokens, _ = tiny
  teacher = Teacher(model, params, tokenizer, tokenizer)
  mask = np.zeros(tokens.shape, np.float32)
  mask[:, 3:5] = 1.0  # turn 1
  mask[:, 8:11] = 1.0  # turn 2; positions 5..7 are the observation
  turn_adv = np.where(mask > 0, np.where(np.arange(12) < 6, 0.5, -0.25), 0.0).astype(np.float32)
  batch = TrainBatch(tokens=tokens, loss_mask=mask,
                     behaviour_logprobs=np.where(mask > 0, -2.0, 0.0).astype(np.float32),
                     support_sizes=np.zeros_like(tokens), advantages=turn_adv,
                     versions=np.zeros_like(tokens), group_ids=np.zeros(3, np.int32))
  out, _ = distill_batch(batch, Distillation(teacher, DistillConfig('reverse_kl')))
  teacher_logp = teacher.score(tokens, mask).logp
  np.testing.assert_allclose(out.advantages, np.where(mask > 0, turn_adv + teacher_logp + 2.0,
                                                      0.0), rtol=1e-6, atol=1e-6)
  assert np.all(out.advantages[:, 5:8] == 0) and np.all(teacher_logp[:, 5:8] == 0)


@pytest.mark.parametrize('fields, message', [
    (dict(rl__distill__kind='reverse_kl'), 'teacher.enabled=False'),
    (dict(teacher__enabled=True), "rl.distill.kind='off' but"),
    (dict(rl__distill__kind='reverse_kl', teacher__enabled=True, teacher__name='qwen3-0.6b'),
     'needs config.teacher.path'),
    (dict(rl__distill__kind='reverse_kl', teacher__enabled=True, teacher__dtype='int4'),
     "teacher.dtype='int4' is not valid"),
    (dict(rl__distill__kind='reverse_kl', teacher__enabled=True, rl__distill__weight=-1.0),
     'distill.weight=-1.0'),
    (dict(rl__distill__kind='reverse_kl', teacher__enabled=True, backend='ray',
          ray__worker_resources={'TPU': 4}),
     r"ray.teacher_resources is empty but ray.worker_resources ask for 'TPU'"),
])
def test_config_refuses(fields, message):
  with pytest.raises(ConfigError, match=message):
    validate_config(smoke_config(**fields))


def test_config_accepts_the_free_schedule_and_a_teacher_with_its_own_chip():
  """The free schedule (its run: test_a_free_running_distillation_run_trains) and, on Ray
  beside roles on TPU chips, a teacher asking for resources of its own."""
  free = _distill_config(2, staleness__schedule='free', staleness__k=3)
  assert validate_config(free).controller.schedule == 'free'
  on_ray = _distill_config(2, backend='ray', ray__trainer_resources={'TPU': 4},
                           ray__teacher_resources={'TPU': 1})
  assert validate_config(on_ray).distill.enabled



def test_build_teacher_refuses_a_tiny_teacher_of_another_charset():
  config = _distill_config(1)
  spec = validate_config(config)
  task = roles.build_task(config)
  other = CharTokenizer('0123456789+-=')
  with pytest.raises(ValueError, match="the teacher 'tiny' and the student 'tiny'"):
    roles.build_teacher(config, spec, task, other)


@pytest.mark.parametrize('variant, with_reward', [('', False), (':reward', True),
                                                  (':smoke', False)])
def test_distill_recipe_validates(variant, with_reward):
  config = load_config_file(str(ROOT / 'configs' / 'distill.py') + variant)
  spec = validate_config(config, read_hub=False)
  assert spec.distill == DistillConfig('reverse_kl', with_reward=with_reward)
  assert config.teacher.enabled and config.teacher.name == config.model.name == 'smollm2-135m'
  assert config.rollout.oversample == 0  # every group trains: the teacher's signal is dense
  config.teacher.path = '/runs/teacher/export'  # the checkpoint the user passes
  assert validate_config(config, read_hub=False).distill.enabled


def _run(workdir, steps, **fields):
  config = _distill_config(steps, **fields)
  with build_run(config, workdir, run_spec(config)) as run:
    run.execute()
  return read_metrics(workdir / 'metrics.jsonl')


# The two run tests are slow (a run compiles the warm-up, the engine and the trainer: about
# 15 s warm, 60-120 s cold on a loaded 2-core machine). Their cheap counterparts in the default
# run: tests/losses/test_distill.py's test_reverse_kl_advantages_lower_the_kl_by_gradient
# descent (the signal lowers KL(student || teacher)) and
# test_distill_batch_mixes_reverse_kl_advantages_on_the_loss_tokens (the teacher's scores
# of a batch are a deterministic function of it); the gkd run's:
# test_gkd_updates_lower_the_divergence_to_the_teacher and
# test_trainer_gkd_term_equals_gkd_loss_on_the_full_logits.
@pytest.fixture(scope='module')
def distill_rows(tmp_path_factory):
  return _run(tmp_path_factory.mktemp('distill'), 8)


@pytest.mark.slow
def test_distillation_lowers_the_student_teacher_kl(distill_rows):
  kl = [row['distill/reverse_kl'] for row in distill_rows if 'distill/reverse_kl' in row]
  assert len(kl) == 8
  assert np.mean(kl[-2:]) < 0.7 * np.mean(kl[:2]), kl


@pytest.mark.slow
def test_distillation_run_with_async_schedule_is_deterministic(distill_rows, tmp_path):
  again = _run(tmp_path, 8)
  strip = lambda r: {k: v for k, v in r.items() if not k.startswith('time/')}
  assert [strip(r) for r in again] == [strip(r) for r in distill_rows]


@pytest.mark.slow
def test_gkd_run_lowers_the_student_teacher_kl(tmp_path):
  rows = _run(tmp_path, 8, rl__distill__kind='gkd', rl__distill__top_k=8,
              rl__distill__beta=0.5, rl__logprob_chunk=4)
  kl = [row['distill/reverse_kl'] for row in rows if 'distill/reverse_kl' in row]
  gkd = [row['distill/gkd'] for row in rows if 'distill/gkd' in row]
  assert len(kl) == len(gkd) == 8
  assert np.mean(kl[-2:]) < 0.7 * np.mean(kl[:2]), kl
  assert np.mean(gkd[-2:]) < 0.7 * np.mean(gkd[:2]), gkd


def test_memory_plan_counts_the_teacher_on_the_first_chip(tiny):
  config = _distill_config(1, teacher__quant='none')
  # A tiny teacher has the tiny student's shapes: the student's params stand for its own.
  _, student, teacher_params, _, _ = tiny
  one = {'data': 1, 'fsdp': 1, 'tensor': 1}
  plan = memory_fit.run_memory_plan(student.config, config, one, one, shared=True)
  alone = memory_fit.run_memory_plan(student.config, smoke_config(), one, one, shared=True)
  assert plan.teacher_params == sum(x.nbytes for x in jax.tree.leaves(teacher_params))
  assert plan.teacher_scoring > 0 and alone.teacher_bytes == 0
  (_, need, _), = plan.needs(1e12)
  (_, need_alone, _), = alone.needs(1e12)
  assert need == pytest.approx(need_alone + plan.teacher_bytes)
  assert any(line.startswith('teacher (on the first trainer chip): params')
             for line in plan.table(1e12))
  # Its own dtype and quantisation.
  plan_of = lambda **kw: memory_fit.run_memory_plan(student.config, _distill_config(1, **kw),
                                                    one, one, shared=True)
  assert plan_of(teacher__dtype='bfloat16').teacher_params == plan.teacher_params / 2
  assert plan_of(teacher__quant='int8').teacher_params < plan.teacher_params
  # A named preset teacher: SmolLM2-135M's 134.5M float32 params.
  smol = load_config_file(str(ROOT / 'configs' / 'distill.py'))
  held = memory_fit.teacher_memory_bytes(memory_fit.teacher_model(smol, None), smol)
  assert 134e6 * 4 < held['params'] < 135e6 * 4, held


def test_on_ray_the_memory_plan_gives_the_teacher_a_row_of_its_own(tiny):
  """``backend='ray'``: the teacher actor's chip (``ray.teacher_resources``) is a row of its
  own, against its chips' HBM, and the trainer's row no longer counts it (local: above)."""
  student = tiny[1]
  one = {'data': 1, 'fsdp': 1, 'tensor': 1}
  plan_of = lambda backend, shared: memory_fit.run_memory_plan(
      student.config, _distill_config(1, backend=backend), one, one, shared=shared)
  local, ray = plan_of('local', False), plan_of('ray', False)
  assert ray.teacher_apart and not local.teacher_apart and ray.teacher_bytes > 0
  assert ray.needs(1e12, 2e12, 3e12) == [
      ('trainer', ray.trainer_bytes, 1e12), ('inference', ray.inference_bytes, 2e12),
      ('teacher', ray.teacher_bytes, 3e12)]
  assert local.needs(1e12, 2e12, 3e12) == [
      ('trainer', local.trainer_bytes + local.teacher_bytes, 1e12),
      ('inference', local.inference_bytes, 2e12)]
  shared = plan_of('ray', True).needs(1e12)  # one row for the roles' chips, one the teacher's
  assert [chips for chips, _, _ in shared] == ['trainer + inference', 'teacher']
  assert shared[1] == ('teacher', ray.teacher_bytes, 1e12)  # a trainer chip's HBM unless told
  assert any(line.startswith('teacher (on its own chip): params') for line in ray.table(1e12))
  # Placed on a CPU host (the ray recipes' dry run with CPU teacher_resources): no HBM row.
  assert ray.needs(1e12, 2e12, teacher_on_host=True) == ray.needs(1e12, 2e12)[:2]
  on_host = ray.table(1e12, 2e12, teacher_on_host=True)
  assert any(line.startswith('teacher (on a CPU host, in host memory): params')
             for line in on_host)
  assert not any(line.startswith('teacher: ') for line in on_host), on_host


# A run compiles the engine, the trainer and the teacher: about 15 s warm, a minute cold on a
# loaded 2-core machine. Its counterparts in the default run: the config is accepted
# (test_config_accepts_the_free_schedule_and_a_teacher_with_its_own_chip), the teacher's
# signal is each token's own log pi_teacher - log pi_behaviour whatever drew it
# (test_distill_batch_mixes_reverse_kl_advantages_on_the_loss_tokens), and free-running runs
# in tests/test_async.py.
@pytest.mark.slow
def test_a_free_running_distillation_run_trains(tmp_path):
  """staleness.schedule='free' with a teacher: versions swap in mid-generation (samples of
  two versions; tests/test_async.py's ``swaps_mid_generation``), the teacher scores every
  trained batch, every step updates, and no trained token is k or more versions old. (No
  resume: a free-running run writes no checkpoints.)"""
  from test_async import swaps_mid_generation  # pylint: disable=import-outside-toplevel
  config = _distill_config(4, warmup__steps=0, staleness__schedule='free', staleness__j=1,
                           staleness__k=2)
  with build_run(config, tmp_path, run_spec(config)) as run:
    swaps_mid_generation([])(run.controller)
    summary = run.execute()
  rows = read_metrics(tmp_path / 'metrics.jsonl')
  assert summary['steps'] == 4 and len(rows) == 4
  assert sum(row['rollout/mixed_version_samples'] for row in rows) > 0
  assert all(np.isfinite(row['distill/reverse_kl']) and row['update/skipped'] == 0
             and row['grad_norm'] > 0 and row['staleness/max'] <= 1 for row in rows)
