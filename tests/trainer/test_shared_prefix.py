"""Shared-prefix scoring (``rl.shared_prefix``, Prefix Grouper): scoring only the completions,
with each group's prompt run once into a KV cache, gives the same log-probs, losses, gradients
and updates as scoring every position of every row; batches it cannot score exactly are
refused on the host."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlax_llm.cli import load_config_file
from rlax_llm.config import run_spec
from rlax_llm import roles
from rlax_llm.losses import LOSSES, LossConfig
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.trainer.scoring import Policy
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer import objectives
from rlax_llm.trainer.trainer import Trainer
from train_batches import random_train_batch  # tests/train_batches.py

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = 64
CONFIG = DecoderConfig(vocab_size=VOCAB, num_layers=2, embed_dim=32, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=32)
PROMPT, NEW, GROUP = 10, 6, 4


def _batch(seed=0, groups=2, group=GROUP, support=None, vocab=VOCAB):
  """The controller's layout: groups of consecutive rows sharing a ragged prompt, each row a
  right-padded prompt + completion of at most NEW tokens. The last group's first row has no
  loss tokens (its start reads 0): the block's prompt must still be found."""
  rng = np.random.RandomState(seed)
  rows, length = groups * group, PROMPT + NEW
  tokens = np.zeros((rows, length), np.int32)
  mask = np.zeros((rows, length), np.float32)
  for g in range(groups):
    size = rng.randint(2, PROMPT + 1)
    prompt = rng.randint(1, vocab, size)
    for r in range(group):
      b = g * group + r
      tokens[b, :size] = prompt
      n = rng.randint(1, NEW + 1)
      tokens[b, size:size + n] = rng.randint(1, vocab, n)
      if b != (groups - 1) * group:
        mask[b, size:size + n] = 1.0
  return random_train_batch(rng, tokens, mask, vocab, support, group)


def _starts(batch):
  return np.argmax(batch.loss_mask > 0, axis=1).astype(np.int32)


@pytest.mark.parametrize('spec', [SamplingSpec(), SamplingSpec(temperature=0.7, top_k=8,
                                                               top_p=0.9)])
@pytest.mark.parametrize('share,chunk', [(1, 0), (GROUP, 0), (GROUP, 4), (2, 5)])
def test_window_log_probs_equal_the_full_sequence_ones(spec, share, chunk):
  model, params = create_model(CONFIG, seed=1)
  policy = Policy(model, spec)
  batch = _batch(support=8 if spec.top_k else None)
  starts = _starts(batch)
  index = starts[:, None] - 1 + np.arange(NEW)  # position t scores token t + 1
  mask = np.take_along_axis(batch.loss_mask, index + 1, axis=1)

  def full_loss(p):
    s = policy.sequence_log_probs(p, batch.tokens, batch.support_sizes)
    return jnp.sum(s.logp * batch.loss_mask[:, 1:]), s

  def window_loss(p):
    s = policy.window_log_probs(p, batch.tokens, batch.support_sizes, jnp.asarray(starts),
                                width=NEW, share=share, chunk=chunk)
    return jnp.sum(s.logp * mask), s

  # Jitted, one program each: run eagerly, each of their ops compiles as its own program,
  # which from a cold compilation cache takes three times as long.
  (l_full, full), g_full = jax.jit(jax.value_and_grad(full_loss, has_aux=True))(params)
  (l_window, window), g_window = jax.jit(jax.value_and_grad(window_loss, has_aux=True))(params)
  on = mask > 0
  for name in ('logp', 'entropy', 'in_support'):
    expected = np.take_along_axis(np.asarray(getattr(full, name)), index, axis=1)
    np.testing.assert_allclose(np.asarray(getattr(window, name))[on], expected[on],
                               atol=1e-5, rtol=1e-5, err_msg=name)
  np.testing.assert_allclose(l_window, l_full, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_window)):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g_full)) > 1e-3


def test_sharing_reads_only_each_blocks_first_prompt():
  # What share means: the prefix of a block's other rows is not read. Corrupting it changes
  # nothing shared, and changes the unshared result (so the check has teeth).
  model, params = create_model(CONFIG, seed=2)
  policy = Policy(model, SamplingSpec())
  batch = _batch(seed=5)
  starts = _starts(batch)
  corrupted = batch.tokens.copy()
  corrupted[1, :starts[1]] = (corrupted[1, :starts[1]] + 1) % VOCAB
  score = lambda tokens, share: np.asarray(policy.window_log_probs(
      params, jnp.asarray(tokens), None, jnp.asarray(starts), width=NEW, share=share).logp)
  np.testing.assert_array_equal(score(batch.tokens, GROUP), score(corrupted, GROUP))
  assert np.abs(score(batch.tokens, 1)[1] - score(corrupted, 1)[1]).max() > 1e-3


def _trainer(loss_config, *, window, share, micro_batches=1, mesh_shape=None):
  model, params = create_model(CONFIG, seed=0)
  objective = functools.partial(objectives.rl_objective,
                                Policy(model, SamplingSpec(temperature=0.9)), loss_config,
                                window=window, share=share)
  shape = mesh_shape or {'data': 1}
  devices = jax.devices()[:int(np.prod(list(shape.values())))]
  check = (functools.partial(objectives.check_windows, window=window, share=GROUP)
           if window else None)
  # Plain SGD with rate 1: the param change is the gradient.
  return Trainer(model, params, optax.sgd(1.0), objective, make_mesh(shape, devices),
                 micro_batches=micro_batches, totals_fn=objectives.loss_totals,
                 reference_params=params if loss_config.kl_beta > 0 else None,
                 check_batch=check)


def _assert_same_update(a, b, ma, mb):
  np.testing.assert_allclose(ma['loss'], mb['loss'], rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(ma['grad_norm'], mb['grad_norm'], rtol=1e-4)
  np.testing.assert_allclose(ma['entropy'], mb['entropy'], rtol=1e-4)
  assert ma['grad_norm'] > 1e-3
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(x, y, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize('loss', sorted(LOSSES))
def test_every_loss_gives_the_unshared_update(loss):
  kl = 0.05 if loss == 'grpo' else 0.0  # the reference log-probs go through the window too
  config = LossConfig(loss=loss, kl_beta=kl)
  batch = _batch(seed=3)
  full = _trainer(config, window=0, share=1)
  shared = _trainer(config, window=NEW, share=GROUP)
  _assert_same_update(full, shared, full.step(batch), shared.step(batch))


def test_micro_batches_and_a_sharded_mesh_give_the_unshared_update():
  batch = _batch(seed=4, groups=4)
  config = LossConfig(loss='grpo')
  full = _trainer(config, window=0, share=1, micro_batches=2)  # metrics: micro-batch means
  shared = _trainer(config, window=NEW, share=GROUP // 2, micro_batches=2,
                    mesh_shape={'data': 2, 'fsdp': 2, 'tensor': 2})
  _assert_same_update(full, shared, full.step(batch), shared.step(batch))


def test_batches_it_cannot_score_are_refused_before_compute():
  batch = _batch(seed=6)
  objectives.check_windows(batch, NEW, GROUP)  # the controller's layout passes
  long = batch.loss_mask.copy()
  start = _starts(batch)[2]
  long[2, start:start + NEW + 1] = 1.0
  with pytest.raises(ValueError, match=r'rows \[2\] have loss tokens outside a window of 6'):
    objectives.check_windows(batch.replace(loss_mask=long), NEW, GROUP)
  mixed = batch.tokens.copy()
  mixed[6, 0] = (mixed[6, 0] + 1) % VOCAB
  with pytest.raises(ValueError, match=r'row blocks \[1\] .* do not share one prompt'):
    objectives.check_windows(batch.replace(tokens=mixed), NEW, GROUP)
  objectives.check_windows(batch.replace(tokens=mixed), NEW, 1)  # unshared: fine
  with pytest.raises(ValueError, match='not blocks of 3'):
    objectives.check_windows(batch, NEW, 3)
  trainer = _trainer(LossConfig(loss='grpo'), window=NEW, share=GROUP)
  before = jax.tree.map(np.asarray, trainer.params)
  with pytest.raises(ValueError, match='do not share one prompt'):
    trainer.step(batch.replace(tokens=mixed))
  assert trainer.version == 0
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.params)):
    np.testing.assert_array_equal(x, y)
  model, params = create_model(CONFIG, seed=0)
  policy = Policy(model, SamplingSpec())
  with pytest.raises(ValueError, match='width=16 must be in'):
    policy.window_log_probs(params, jnp.asarray(batch.tokens), None,
                            jnp.asarray(_starts(batch)), width=PROMPT + NEW)
  with pytest.raises(ValueError, match='share=3 must be >= 1 and divide the batch'):
    policy.window_log_probs(params, jnp.asarray(batch.tokens), None,
                            jnp.asarray(_starts(batch)), width=NEW, share=3)


@pytest.mark.parametrize('micro_batches,share', [(1, 8), (4, 2), (3, 1)])
def test_the_config_key_builds_the_shared_objective(micro_batches, share):
  config = load_config_file(str(ROOT / 'configs' / 'default.py'))
  config.rl.shared_prefix = True
  config.rl.micro_batches = micro_batches
  config.rl.prompts_per_step = 3 if micro_batches == 3 else 4
  model, params = create_model(CONFIG, seed=0)
  trainer = roles.build_trainer(config, run_spec(config), model, params,
                                make_mesh({'data': 1}, jax.devices()[:1]))
  assert trainer.check_batch.keywords == {'window': config.sampling.max_new_tokens,
                                          'share': config.rl.group_size if share > 1 else 1}
  objective = trainer.objective
  assert objective.keywords['window'] == config.sampling.max_new_tokens
  assert objective.keywords['share'] == share
