"""Docs that must follow the code: every config key is in docs/config.md."""

import pathlib
import re

import ml_collections
import pytest

from rlax_llm.cli import load_config_file

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


def algorithms_table() -> str:
  """README's algorithms table, rendered from rlax_llm.losses.LOSSES (the one definition)."""
  from rlax_llm.losses import LOSSES  # pylint: disable=import-outside-toplevel
  rows = ['| loss | advantages | ratio | objective | aggregation | clip (low, high) | reference |',
          '| --- | --- | --- | --- | --- | --- | --- |']
  for name, spec in LOSSES.items():
    clip = (f'{spec.eps_low:g}, {spec.eps_high:g}' if spec.objective in ('ppo_clip', 'cispo')
            else '-')
    rows.append(f'| `{name}` | {spec.advantage_estimator} | {spec.ratio} | {spec.objective} | '
                f'{spec.aggregation} | {clip} | {spec.reference} |')
  return '\n'.join(rows)


def test_readme_algorithms_table_matches_the_losses():
  assert algorithms_table() in (ROOT / 'README.md').read_text(), (
      'README.md\'s algorithms table differs from rlax_llm.losses.LOSSES; paste:\n'
      + algorithms_table())


@pytest.mark.parametrize('doc', ['README.md', 'docs/config.md', 'launch/README.md',
                                 'launch/tpu_vm/README.md', 'launch/multihost/README.md',
                                 'launch/ray/README.md', 'launch/gke/README.md'])
def test_relative_links_resolve(doc):
  path = ROOT / doc
  for target in re.findall(r'\]\(([^)#]+)', path.read_text()):
    if not target.startswith('http'):
      assert (path.parent / target).exists(), f'{doc} links to {target}, which does not exist'


def test_the_longest_files_scheduled_first_exist():
  """tests/conftest.py's LONGEST_FILES names test files: a renamed one would silently lose
  its place at the front of the test run."""
  from conftest import LONGEST_FILES as names  # pylint: disable=import-outside-toplevel
  assert len(set(names)) == len(names), names
  missing = [name for name in names if not (ROOT / name).is_file()]
  assert not missing, f'LONGEST_FILES names files that do not exist: {missing}'
