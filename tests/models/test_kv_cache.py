"""KV cache writes: the one-row path (attention before the writes) equals the plain writes."""

import jax.numpy as jnp
import numpy as np
import pytest

from rlax_llm.models.kv_cache import (KEY_POSITION_AXIS, VALUE_POSITION_AXIS, _blocks_with,
                                      _write_after, _write_blocks)


@pytest.mark.parametrize('length', [1, 3])
def test_blocks_with_and_write_after_equal_the_written_blocks(length):
  """What one-row decoding attends to (``_blocks_with``) and what it writes after attention
  (``_write_after``) are bitwise the blocks ``_write_blocks`` writes: new values land at
  ``starts[b] + t``, positions past the blocks are dropped, signed zeros are kept."""
  rng = np.random.RandomState(length)
  batch, kv, d, block, used = 4, 2, 3, 4, 2
  new = lambda *shape: jnp.asarray(rng.randn(*shape), jnp.float32)
  key_blocks = tuple(new(batch, kv, d, block) for _ in range(3))
  value_blocks = tuple(new(batch, kv, block, d) for _ in range(3))
  keys, values = (rng.randn(batch, length, kv, d).astype(np.float32) for _ in range(2))
  keys[0, 0, 0, 0] = values[0, 0, 0, 0] = -0.0
  keys, values = jnp.asarray(keys), jnp.asarray(values)
  starts = jnp.array([0, 3, 6, 7], jnp.int32)  # the last rows' later positions: dropped
  bits = lambda blocks: [np.asarray(b).view(np.int32) for b in blocks]
  out = new(batch, kv, 2, d)  # attention's output
  after = _write_after(out, (key_blocks, value_blocks), used, keys, values, starts)
  for blocks, update, axis, written in ((key_blocks, keys, KEY_POSITION_AXIS, after[0]),
                                        (value_blocks, values, VALUE_POSITION_AXIS, after[1])):
    expected = _write_blocks(blocks, update, starts, axis)
    np.testing.assert_array_equal(bits(_blocks_with(blocks, update, starts, axis)),
                                  bits(expected))
    np.testing.assert_array_equal(bits(written), bits(expected[:used] + blocks[used:]))
    assert not np.array_equal(bits(expected), bits(blocks))  # the writes did land
