"""Named model configs: published parameter counts; memory per device without allocation."""

import jax
import pytest

from rlax_llm.models.decoder_config import Execution
from rlax_llm.models.presets import PRESETS, count_params, get_preset, memory_per_device
from rlax_llm.sharding import make_mesh

# Published sizes (model cards), in billions of parameters.
PUBLISHED = {
    'smollm2-135m': 0.1349, 'qwen3-0.6b': 0.596, 'qwen3-1.7b': 1.72, 'qwen3-8b': 8.19,
    'qwen3-32b': 32.76, 'qwen2.5-7b': 7.62, 'llama-3.1-8b': 8.03, 'qwq-32b': 32.76,
    'qwen2.5-0.5b': 0.49, 'qwen2.5-1.5b': 1.54, 'llama-3.2-1b': 1.23,
}


@pytest.mark.parametrize('name', sorted(PRESETS))
def test_parameter_counts_match_published(name):
  assert count_params(get_preset(name)) / 1e9 == pytest.approx(PUBLISHED[name], rel=0.01)


def test_memory_per_device_shrinks_with_fsdp_and_tensor():
  config = get_preset('qwen3-8b')
  one = memory_per_device(config, make_mesh({'data': 1}, jax.devices()[:1]))
  eight = memory_per_device(config, make_mesh({'fsdp': 4, 'tensor': 2}))
  n = one['num_params']
  assert one['params_bytes'] == pytest.approx(4 * n)  # fp32 master weights, unsharded
  assert one['optimizer_bytes'] == pytest.approx(8 * n)  # AdamW: two fp32 moments
  assert eight['total_bytes'] == pytest.approx(one['total_bytes'] / 8, rel=0.01)
  data_parallel = memory_per_device(config, make_mesh({'data': 8}))
  assert data_parallel['total_bytes'] == pytest.approx(one['total_bytes'])  # replicated


def test_get_config_overrides_and_errors():
  assert get_preset('qwen3-0.6b', max_seq_len=128).max_seq_len == 128
  assert get_preset('qwen3-0.6b', execution=Execution(remat='full')).execution.remat == 'full'
  with pytest.raises(ValueError, match="Unknown model 'gpt5'.*qwen3-8b"):
    get_preset('gpt5')
