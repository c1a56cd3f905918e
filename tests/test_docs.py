"""Docs that must follow the code: every config key is in docs/config.md."""

import pathlib
import re

import ml_collections
import pytest

from rlax_llm.config import load_config_file

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _leaves(config: ml_collections.ConfigDict, prefix: str = '') -> list[str]:
  out = []
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict) and len(value):
      out += _leaves(value, f'{prefix}{key}.')
    else:
      out.append(prefix + key)
  return out


@pytest.mark.parametrize('config', ['default.py', 'smollm2.py'])
def test_every_config_key_is_in_the_config_reference(config):
  listed = set(re.findall(r'`([a-z_][a-z0-9_.]*)`', (ROOT / 'docs' / 'config.md').read_text()))
  missing = [k for k in _leaves(load_config_file(str(ROOT / 'configs' / config)))
             if k not in listed]
  assert not missing, f'add these keys of configs/{config} to docs/config.md: {missing}'
