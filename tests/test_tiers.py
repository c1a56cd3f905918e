"""The extended tier's table (tests/tiers.py) names real tests, and each one's counterpart is a
test of the default run: no guarantee leaves the default run with its variant. (Against the
collected tests, tests/conftest.py checks the table at every run that collects a file whole.)"""

import ast
import functools
import pathlib
import shlex
import tomllib
import types

import pytest

from one_device import ROOT
from tiers import EXTENDED


@functools.cache
def _functions(path: str) -> frozenset[str]:
  """The test functions of a test file (methods as ``Class::test``)."""
  tree = ast.parse((ROOT / path).read_text(), filename=path)
  found = set()
  for node in tree.body:
    if isinstance(node, ast.FunctionDef) and node.name.startswith('test'):
      found.add(node.name)
    elif isinstance(node, ast.ClassDef) and node.name.startswith('Test'):
      found |= {f'{node.name}::{method.name}' for method in node.body
                if isinstance(method, ast.FunctionDef) and method.name.startswith('test')}
  return frozenset(found)


def _split(nodeid: str) -> tuple[str, str]:
  path, _, name = nodeid.partition('::')
  return path, name.split('[', 1)[0]


def _listed(nodeid: str) -> bool:
  return nodeid in EXTENDED or nodeid.split('[', 1)[0] in EXTENDED


def test_every_extended_test_and_its_counterpart_exist():
  for test, (counterpart, why) in EXTENDED.items():
    assert why.strip(), f'{test}: say what the variant adds to {counterpart}'
    for nodeid in (test, counterpart):
      path, name = _split(nodeid)
      assert (ROOT / path).is_file(), f'tests/tiers.py: {nodeid}: no file {path}'
      assert name in _functions(path), f'tests/tiers.py: {nodeid}: {path} has no {name}'
    assert not _listed(counterpart), f'{test}: its counterpart {counterpart} is itself extended'


def test_the_default_run_leaves_the_tier_out_and_the_script_brings_it_back():
  """pyproject's ``-m`` leaves ``extended`` out (tests/conftest.py marks the table's tests and
  stops a run whose table names a missing test or a counterpart outside the default run);
  ``bash scripts/test.sh --extended`` selects ``not slow``, ``--all`` everything."""
  ini = tomllib.loads((ROOT / 'pyproject.toml').read_text())['tool']['pytest']['ini_options']
  assert shlex.split(ini['addopts']) == ['-m', 'not slow and not extended'], ini['addopts']
  assert any(marker.startswith('extended:') for marker in ini['markers'])
  script = (ROOT / 'scripts/test.sh').read_text()
  assert "--extended) tier=(-m 'not slow'); limit=1800 ;;" in script
  assert "--all) tier=(-m ''); limit=1800 ;;" in script


class _Item:
  """What tests/conftest.py's hook reads of a collected test."""

  def __init__(self, nodeid: str, *markers: str):
    self.nodeid, self.markers = nodeid, set(markers)

  def add_marker(self, marker) -> None:
    self.markers.add(marker.name)

  def get_closest_marker(self, name: str):
    return name if name in self.markers else None


def test_the_hook_marks_the_table_and_refuses_a_stale_entry_or_counterpart(monkeypatch,
                                                                         pytestconfig):
  # tests/conftest.py as pytest registered it (sys.modules['conftest'] is whichever folder's
  # conftest was imported last, e.g. tests/backends/conftest.py).
  path = ROOT / 'tests' / 'conftest.py'
  (conftest,) = [m for m in pytestconfig.pluginmanager.get_plugins()
                 if pathlib.Path(getattr(m, '__file__', None) or '.') == path]
  config = types.SimpleNamespace(rootpath=ROOT, args=['tests/x.py'],
                                 invocation_params=types.SimpleNamespace(dir=ROOT))
  table = {'tests/x.py::test_a[1]': ('tests/x.py::test_a[0]', 'another number'),
           'tests/x.py::test_b': ('tests/x.py::test_c', 'a bigger case')}
  monkeypatch.setattr(conftest, 'EXTENDED', table)
  items = [_Item(n) for n in ('tests/x.py::test_a[0]', 'tests/x.py::test_a[1]',
                              'tests/x.py::test_b[p]', 'tests/x.py::test_b[q]',
                              'tests/x.py::test_c')]
  conftest.pytest_collection_modifyitems(None, config, items)
  assert [sorted(i.markers) for i in items] == [[], ['extended'], ['extended'], ['extended'], []]
  with pytest.raises(pytest.UsageError, match=r'test_a\[1\]: its file has no such test'):
    conftest.pytest_collection_modifyitems(None, config, [_Item('tests/x.py::test_a[0]'),
                                                          _Item('tests/x.py::test_c')])
  with pytest.raises(pytest.UsageError, match=r'its counterpart tests/x.py::test_c is not in '
                                              r'the default run \(slow or extended\)'):
    conftest.pytest_collection_modifyitems(None, config, [*items[:4], _Item(items[4].nodeid,
                                                                             'slow')])
  with pytest.raises(pytest.UsageError, match=r'its counterpart tests/x.py::test_a\[0\] is not '
                                              'a test'):
    conftest.pytest_collection_modifyitems(None, config, items[1:])
  # A file not collected whole (one test named on the command line) is not checked.
  config.args = ['tests/x.py::test_c']
  conftest.pytest_collection_modifyitems(None, config, [_Item('tests/x.py::test_c')])
