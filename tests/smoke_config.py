"""configs/default.py:smoke with fields set, for tests that build runs from a config."""

import pathlib

import ml_collections

from rlax_llm.cli import load_config_file

ROOT = pathlib.Path(__file__).resolve().parent.parent


def smoke_config(**fields) -> ml_collections.ConfigDict:
  """``configs/default.py:smoke`` with ``fields`` set; ``a__b=v`` sets ``config.a.b = v``."""
  config = load_config_file(f'{ROOT / "configs/default.py"}:smoke')
  for dotted, value in fields.items():
    *parents, leaf = dotted.split('__')
    node = config
    for part in parents:
      node = node[part]
    node[leaf] = value
  return config
