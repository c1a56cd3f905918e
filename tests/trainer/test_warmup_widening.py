"""The supervised warm-up's batch widths: each batch is widened to the longest so far (one
train-step program per new longest batch, not one per distinct width), and widening changes
no loss."""

import jax
import numpy as np
import pytest

from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import create_model
from rlax_llm.sharding import make_mesh
from rlax_llm.trainer import warmup
from rlax_llm.trainer.objectives import sft_objective
from rlax_llm.trainer.trainer import Trainer

MESH = make_mesh({'data': 1}, jax.devices()[:1])
CONFIG = DecoderConfig(vocab_size=11, num_layers=1, embed_dim=16, num_heads=2, num_kv_heads=1,
                       head_dim=8, mlp_dim=32, max_seq_len=16)
WIDTHS = (6, 8, 7, 8, 5)  # the width of the batch of each step


def _batch(start, batch_size, width=None):
  """Rows of ``width`` (default: by step) random ids, the loss on a ragged tail of each."""
  width = width or WIDTHS[start // batch_size]
  rng = np.random.default_rng(start)
  tokens = rng.integers(1, CONFIG.vocab_size, (batch_size, width)).astype(np.int32)
  loss_mask = np.zeros((batch_size, width), np.float32)
  for row in range(batch_size):
    loss_mask[row, 2:width - row % 2] = 1.0  # some rows end before the batch's width
  return {'tokens': tokens, 'loss_mask': loss_mask}


def test_each_step_trains_on_the_longest_width_so_far(monkeypatch):
  seen = []
  step = Trainer.step

  def recording(self, batch):
    seen.append(batch['tokens'].shape)
    return step(self, batch)

  monkeypatch.setattr(Trainer, 'step', recording)
  model, params = create_model(CONFIG, seed=0)
  _, metrics = warmup.supervised_warmup(model, params, _batch, MESH, steps=len(WIDTHS),
                                        batch_size=4, learning_rate=1e-3)
  assert seen == [(4, 6), (4, 8), (4, 8), (4, 8), (4, 8)]  # two programs, not four
  assert np.isfinite(metrics['warmup/loss'])


def test_a_widened_batch_has_the_same_loss_and_accuracy():
  model, params = create_model(CONFIG, seed=0)
  batch = _batch(0, 4, width=6)
  wide = warmup.widened(batch, 9)
  assert wide['tokens'].shape == wide['loss_mask'].shape == (4, 9)
  np.testing.assert_array_equal(wide['tokens'][:, :6], batch['tokens'])
  np.testing.assert_array_equal(wide['tokens'][:, 6:], np.repeat(batch['tokens'][:, 5:], 3, 1))
  assert wide['loss_mask'][:, 6:].sum() == 0 and wide['loss_mask'].dtype == np.float32
  loss, metrics = sft_objective(model, params, batch)
  wide_loss, wide_metrics = sft_objective(model, params, wide)
  np.testing.assert_allclose(wide_loss, loss, rtol=1e-6)
  np.testing.assert_allclose(wide_metrics['accuracy'], metrics['accuracy'], rtol=1e-6)
  same = warmup.widened(batch, 6)
  assert all(np.array_equal(same[k], batch[k]) for k in batch)


def test_widening_to_fewer_columns_is_refused():
  with pytest.raises(ValueError, match='cannot widen a batch of 6 columns to 5'):
    warmup.widened(_batch(0, 2, width=6), 5)
