"""Sums the test suite's costs per file from a ``RLAX_TEST_COSTS`` log (tests/conftest.py).

  RLAX_TEST_COSTS=/tmp/costs.jsonl bash scripts/test.sh
  python scripts/test_costs.py /tmp/costs.jsonl [--top=30]

Prints JSON: the totals, the files by CPU seconds (own + children), and the costliest tests;
with the seconds of JAX's compile path where the log has them (tracing, lowering, XLA's
compile or the persistent cache's read, and the number of programs), and per pytest-xdist
process its CPU seconds and when it went idle.
``--remeasured LOG ...`` replaces the rows of every test file those logs hold (a file measured
again after a change); ``--default_tier`` leaves out the tests tests/tiers.py moves to the
extended tier (a log of ``--extended`` or of an earlier tree: what the default run would cost).
"""

import argparse
import collections
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


# The compile-path fields of a row (tests/conftest.py's ``_JAX_EVENTS``, and ``programs``),
# summed where the log has them: logs written before they were added lack them.
JAX_FIELDS = ('trace_s', 'lower_s', 'backend_s', 'cache_read_s', 'programs')


def workers(rows: list[dict]) -> dict:
  """Per pytest-xdist process, where the log has it: its tests, CPU seconds (own + children)
  and ``idle_from_s``, when its last test ended, counted from the first test's start (the
  gap between the processes' ``idle_from_s`` is the run's imbalance)."""
  timed = [row for row in rows if 'worker' in row and 'end' in row]
  if not timed:
    return {}
  start = min(row['end'] - row['wall_s'] for row in timed)
  out = collections.defaultdict(lambda: {'tests': 0, 'cpu_s': 0.0, 'idle_from_s': 0.0})
  for row in timed:
    entry = out[row['worker'] or 'main']
    entry['tests'] += 1
    entry['cpu_s'] += row['cpu_s'] + row['child_cpu_s']
    entry['idle_from_s'] = max(entry['idle_from_s'], row['end'] - start)
  return {worker: {k: round(v, 1) for k, v in entry.items()}
          for worker, entry in sorted(out.items())}


def summarise(rows: list[dict], top: int) -> dict:
  """Totals, per-file sums (sorted by CPU, largest first) and the ``top`` costliest tests."""
  files = collections.defaultdict(lambda: {'tests': 0, 'cpu_s': 0.0, 'wall_s': 0.0})
  for row in rows:
    entry = files[row['test'].split('::', 1)[0]]
    entry['tests'] += 1
    entry['cpu_s'] += row['cpu_s'] + row['child_cpu_s']
    entry['wall_s'] += row['wall_s']
    for field in JAX_FIELDS:
      if field in row:
        entry[field] = entry.get(field, 0.0) + row[field]
  by_cost = sorted(files.items(), key=lambda kv: -kv[1]['cpu_s'])
  per_worker = workers(rows)
  tests = sorted(rows, key=lambda r: -(r['cpu_s'] + r['child_cpu_s']))[:top]
  return {
      'tests': len(rows),
      'cpu_s': round(sum(r['cpu_s'] + r['child_cpu_s'] for r in rows), 1),
      'wall_s': round(sum(r['wall_s'] for r in rows), 1),
      **{field: round(sum(r.get(field, 0.0) for r in rows), 1) for field in JAX_FIELDS
         if any(field in r for r in rows)},
      **({'workers': per_worker} if per_worker else {}),
      'files': [{'file': f, **{k: round(v, 1) for k, v in e.items()}} for f, e in by_cost],
      'costliest_tests': tests,
  }


def _read(path: str) -> list[dict]:
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


def _file(row: dict) -> str:
  return row['test'].split('::', 1)[0]


def replace_files(rows: list[dict], remeasured: list[dict]) -> list[dict]:
  """``rows`` less every row of a test file ``remeasured`` has rows of, plus ``remeasured``."""
  files = {_file(row) for row in remeasured}
  return [row for row in rows if _file(row) not in files] + remeasured


def default_tier(rows: list[dict], extended: dict) -> list[dict]:
  """``rows`` less the tests ``extended`` (tests/tiers.py's ``EXTENDED``) names: by node id, or
  by function for every parametrisation."""
  return [row for row in rows
          if row['test'] not in extended and row['test'].split('[', 1)[0] not in extended]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('log', help='the JSON-lines file RLAX_TEST_COSTS named')
  parser.add_argument('--top', type=int, default=30, help='how many single tests to list')
  parser.add_argument('--remeasured', nargs='*', default=[],
                      help="logs whose test files' rows replace the first log's")
  parser.add_argument('--default_tier', action='store_true',
                      help='leave out the tests tests/tiers.py moves to the extended tier')
  args = parser.parse_args()
  rows = _read(args.log)
  if args.remeasured:
    rows = replace_files(rows, [row for log in args.remeasured for row in _read(log)])
  if args.default_tier:
    sys.path.insert(0, str(ROOT / 'tests'))
    from tiers import EXTENDED  # pylint: disable=import-outside-toplevel
    rows = default_tier(rows, EXTENDED)
  print(json.dumps(summarise(rows, args.top), indent=1))


if __name__ == '__main__':
  main()
