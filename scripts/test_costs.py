"""Sums the test suite's costs per file from a ``RLAX_TEST_COSTS`` log (tests/conftest.py).

  RLAX_TEST_COSTS=/tmp/costs.jsonl bash scripts/test.sh
  python scripts/test_costs.py /tmp/costs.jsonl [--top=30]

Prints JSON: the totals, the files by CPU seconds (own + children), and the costliest tests.
"""

import argparse
import collections
import json


def summarise(rows: list[dict], top: int) -> dict:
  """Totals, per-file sums (sorted by CPU, largest first) and the ``top`` costliest tests."""
  files = collections.defaultdict(lambda: {'tests': 0, 'cpu_s': 0.0, 'wall_s': 0.0})
  for row in rows:
    entry = files[row['test'].split('::', 1)[0]]
    entry['tests'] += 1
    entry['cpu_s'] += row['cpu_s'] + row['child_cpu_s']
    entry['wall_s'] += row['wall_s']
  by_cost = sorted(files.items(), key=lambda kv: -kv[1]['cpu_s'])
  tests = sorted(rows, key=lambda r: -(r['cpu_s'] + r['child_cpu_s']))[:top]
  return {
      'tests': len(rows),
      'cpu_s': round(sum(r['cpu_s'] + r['child_cpu_s'] for r in rows), 1),
      'wall_s': round(sum(r['wall_s'] for r in rows), 1),
      'files': [{'file': f, **{k: round(v, 1) for k, v in e.items()}} for f, e in by_cost],
      'costliest_tests': tests,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('log', help='the JSON-lines file RLAX_TEST_COSTS named')
  parser.add_argument('--top', type=int, default=30, help='how many single tests to list')
  args = parser.parse_args()
  with open(args.log, encoding='utf-8') as f:
    rows = [json.loads(line) for line in f if line.strip()]
  print(json.dumps(summarise(rows, args.top), indent=1))


if __name__ == '__main__':
  main()
