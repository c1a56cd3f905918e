"""scripts/test_costs.py: the per-file sums of the suite's cost log (tests/conftest.py)."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location('test_costs_script', ROOT / 'scripts/test_costs.py')
test_costs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(test_costs)


def test_files_sum_cpu_with_children_and_the_compile_fields_where_logged():
  rows = [
      {'test': 'tests/a.py::x', 'wall_s': 2.0, 'cpu_s': 1.5, 'child_cpu_s': 0.5,
       'backend_s': 1.0, 'programs': 3},
      {'test': 'tests/a.py::y[1]', 'wall_s': 1.0, 'cpu_s': 1.0, 'child_cpu_s': 0.0},
      {'test': 'tests/b.py::z', 'wall_s': 9.0, 'cpu_s': 0.1, 'child_cpu_s': 8.0,
       'backend_s': 0.25, 'programs': 1},
  ]
  summary = test_costs.summarise(rows, top=1)
  assert (summary['tests'], summary['cpu_s'], summary['wall_s']) == (3, 11.1, 12.0)
  assert (summary['backend_s'], summary['programs']) == (1.2, 4)  # 1.25 rounds to even
  assert 'trace_s' not in summary  # no row logged it
  assert [f['file'] for f in summary['files']] == ['tests/b.py', 'tests/a.py']
  a = summary['files'][1]
  assert (a['tests'], a['cpu_s'], a['programs']) == (2, 3.0, 3)
  assert [t['test'] for t in summary['costliest_tests']] == ['tests/b.py::z']


def test_the_default_tier_leaves_out_extended_tests_by_id_or_function():
  rows = [{'test': t} for t in ('f.py::a[1]', 'f.py::a[2]', 'f.py::b', 'f.py::c')]
  kept = test_costs.default_tier(rows, {'f.py::a': None, 'f.py::b': None})
  assert [r['test'] for r in kept] == ['f.py::c']


def test_workers_sum_their_tests_and_say_when_each_went_idle():
  rows = [
      {'test': 'a.py::x', 'worker': 'gw0', 'end': 105.0, 'wall_s': 5.0, 'cpu_s': 4.0,
       'child_cpu_s': 1.0},
      {'test': 'b.py::y', 'worker': 'gw1', 'end': 130.0, 'wall_s': 20.0, 'cpu_s': 2.0,
       'child_cpu_s': 0.0},
      {'test': 'a.py::z', 'worker': 'gw0', 'end': 112.5, 'wall_s': 7.5, 'cpu_s': 7.0,
       'child_cpu_s': 0.0},
  ]
  assert test_costs.summarise(rows, top=0)['workers'] == {
      'gw0': {'tests': 2, 'cpu_s': 12.0, 'idle_from_s': 12.5},
      'gw1': {'tests': 1, 'cpu_s': 2.0, 'idle_from_s': 30.0}}
  assert 'workers' not in test_costs.summarise([{k: v for k, v in row.items()
                                                 if k not in ('worker', 'end')}
                                                for row in rows], top=0)
