"""benchmarks/compile_time.py: the earlier tree it measures, its ratios, and a tiny run of
each program in its own process."""

import argparse
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'benchmarks'))

import compile_time  # pylint: disable=wrong-import-position


def _args(**overrides) -> argparse.Namespace:
  fields = dict(model='tiny', batch=4, length=16, remat='full', logprob_chunk=8, slots=2,
                prompt=8, new=8, steps=1, layer_loop='auto')
  fields.update(overrides)
  return argparse.Namespace(**fields)


def test_the_earlier_tree_is_a_detached_worktree_of_the_ref_and_is_removed(tmp_path):
  head = subprocess.run(['git', '-C', str(ROOT), 'rev-parse', 'HEAD'], check=True,
                        capture_output=True, text=True).stdout.strip()
  tree = compile_time.add_worktree(head, tmp_path / 'before')
  try:
    got = subprocess.run(['git', '-C', str(tree), 'rev-parse', 'HEAD'], check=True,
                         capture_output=True, text=True).stdout.strip()
    assert got == head
    assert (tree / 'rlax_llm' / 'models' / 'decoder.py').exists()
  finally:
    compile_time.remove_worktree(tree)
  assert not tree.exists()
  assert len(compile_time.merge_base('HEAD')) == 40


def test_compare_gives_scanned_over_unrolled():
  scanned = {'lower_s': 1.0, 'compile_s': 2.0, 'step_s': 0.5}
  unrolled = {'lower_s': 3.0, 'compile_s': 8.0, 'step_s': 0.4}
  out = compile_time.compare(scanned, unrolled)
  assert out['compile_ratio'] == 0.25
  assert out['lower_and_compile_ratio'] == 3.0 / 11.0
  assert out['step_ratio'] == 0.5 / 0.4
  assert out['scanned'] is scanned and out['unrolled'] is unrolled


def test_each_program_is_measured_in_a_fresh_process():
  for program in compile_time.PROGRAMS:
    out = compile_time.run_child(program, ROOT, _args())
    assert out['compile_s'] > 0 and out['lower_s'] > 0, out
    assert out['step_s'] > 0 and out['tokens_per_s'] > 0, out
  assert out['tokens_per_s'] == 2 / out['step_s']  # decode: one token per slot per step
  for loop in ('scan', 'unrolled'):  # this tree's engine in the layer loop asked for
    assert compile_time.run_child('decode', ROOT, _args(layer_loop=loop))['layer_loop'] == loop
