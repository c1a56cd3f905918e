"""Config contract: every config in configs/ has the keys users rely on and validates."""

import pathlib

import pytest

from rlax_llm.config import REQUIRED_KEYS, ConfigError, load_config_file, validate_config

CONFIGS = sorted(pathlib.Path(__file__).resolve().parent.parent.glob('configs/*.py'))


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: p.name)
def test_configs_validate(path):
  config = load_config_file(str(path))
  validate_config(config)
  for key in REQUIRED_KEYS:
    node = config
    for part in key.split('.'):
      node = node[part]


def test_missing_key_names_it():
  config = load_config_file(str(CONFIGS[0]))
  del config.rl['group_size']
  with pytest.raises(ConfigError, match=r"'rl.group_size' is missing.*fields there"):
    validate_config(config)


def test_bad_staleness():
  config = load_config_file(str(CONFIGS[0]))
  config.staleness.k = 0
  with pytest.raises(ConfigError, match='staleness'):
    validate_config(config)
