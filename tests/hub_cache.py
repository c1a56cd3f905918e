"""Hub datasets laid out on disk exactly as huggingface_hub caches them, for offline tests.

``cache_dataset(cache, 'org/name', {path: bytes})`` writes
``datasets--org--name/{blobs/SHA256, refs/REVISION, snapshots/COMMIT/PATH -> ../../blobs/..}``;
``fake_hub.hub_environment(None, cache, offline=True)`` (tests/fake_hub.py) points
huggingface_hub at it. ``cache_shipped_datasets(cache)`` writes small stand-ins of the
datasets configs/math.py names (GSM8K's card and Parquet layout, MATH-500's root
``test.jsonl``).
"""

import hashlib
import io
import json
import os
import pathlib

import pyarrow
import pyarrow.parquet as pq


def parquet_bytes(rows: list[dict]) -> bytes:
  sink = io.BytesIO()
  pq.write_table(pyarrow.Table.from_pylist(rows), sink)
  return sink.getvalue()


def jsonl_bytes(rows: list[dict]) -> bytes:
  return ''.join(json.dumps(r) + '\n' for r in rows).encode()


def card_bytes(configs: dict[str, dict[str, str]], default: str | None = None) -> bytes:
  """A README.md whose YAML declares ``configs`` as {config: {split: path glob}}."""
  lines = ['---', 'configs:']
  for name, splits in configs.items():
    lines.append(f'- config_name: {name}')
    if name == default:
      lines.append('  default: true')
    lines.append('  data_files:')
    for split, path in splits.items():
      lines += [f'  - split: {split}', f'    path: {path}']
  return ('\n'.join(lines + ['---', '# A test dataset', ''])).encode()


def commit_of(repo_id: str, revision: str) -> str:
  return hashlib.sha1(f'{repo_id}@{revision}'.encode()).hexdigest()


def cache_dataset(cache: pathlib.Path, repo_id: str, files: dict[str, bytes],
                  revision: str = 'main') -> pathlib.Path:
  """Writes ``files`` as the cached snapshot of ``repo_id`` at ``revision``; returns the
  snapshot folder."""
  repo = pathlib.Path(cache) / ('datasets--' + repo_id.replace('/', '--'))
  commit = commit_of(repo_id, revision)
  snapshot = repo / 'snapshots' / commit
  for path, data in files.items():
    blob = repo / 'blobs' / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = snapshot / path
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
  ref = repo / 'refs' / revision
  ref.parent.mkdir(parents=True, exist_ok=True)
  ref.write_text(commit)
  return snapshot


def gsm8k_rows(count: int, start: int = 0) -> list[dict]:
  """GSM8K-shaped records: a worked answer with calculator notes, the final one after ####."""
  return [{'question': f'Natalia sold {i} clips in April and half as many in May. How many '
                       'clips did she sell altogether?',
           'answer': f'She sold {i}/2 = <<{i}/2={i // 2}>>{i // 2} in May.\n'
                     f'#### {i + i // 2}'}
          for i in range(2 * start + 2, 2 * (start + count) + 2, 2)]


def math500_rows(count: int) -> list[dict]:
  """MATH-500-shaped records: problem, solution with \\boxed{}, the bare answer, subject."""
  return [{'problem': f'Compute ${i} \\cdot \\frac{{1}}{{{i + 1}}}$.',
           'solution': f'It is $\\boxed{{\\frac{{{i}}}{{{i + 1}}}}}$.',
           'answer': f'\\frac{{{i}}}{{{i + 1}}}', 'subject': 'Algebra', 'level': 1,
           'unique_id': f'test/algebra/{i}.json'} for i in range(1, count + 1)]


def cache_shipped_datasets(cache: pathlib.Path) -> None:
  """Small stand-ins of openai/gsm8k (configs main and socratic) and HuggingFaceH4/MATH-500."""
  cache_dataset(cache, 'openai/gsm8k', {
      'README.md': card_bytes({'main': {'train': 'main/train-*', 'test': 'main/test-*'},
                               'socratic': {'train': 'socratic/train-*',
                                            'test': 'socratic/test-*'}}),
      'main/train-00000-of-00001.parquet': parquet_bytes(gsm8k_rows(40)),
      'main/test-00000-of-00001.parquet': parquet_bytes(gsm8k_rows(200, start=100)),
      'socratic/train-00000-of-00001.parquet': parquet_bytes(gsm8k_rows(3, start=200)),
      'socratic/test-00000-of-00001.parquet': parquet_bytes(gsm8k_rows(3, start=300)),
  })
  cache_dataset(cache, 'HuggingFaceH4/MATH-500', {'test.jsonl': jsonl_bytes(math500_rows(120))})
