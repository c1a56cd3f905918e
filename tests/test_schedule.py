"""The controller's schedule as pure decisions (rlax_llm/schedule.py): staleness, launches,
evaluations, chunking, APRIL's carried groups, prompt replay, dynamic sampling and the
free-running mode (its launch window, the reload rule, the acceptance window)."""

import subprocess
import sys

import pytest

from rlax_llm import schedule
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.schedule import (ControllerSettings, chunk_bounds, chunk_stop, continue_carried,
                               eval_due, launch_due, reload_due, replay_count,
                               sampling_version, select_groups)


def settings(**fields):
  base = dict(total_steps=10, prompts_per_step=2, group_size=2, staleness_j=1, staleness_k=1,
              eval_every=0, seed=0, sampling=SamplingSpec(), max_new_tokens=4)
  return ControllerSettings(**(base | fields))


def test_schedule_imports_no_jax():
  code = ('import sys; import rlax_llm.schedule; '
          "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith("
          "('rlax_llm.config', 'rlax_llm.controller'))))")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       check=True).stdout
  assert out.strip() == '[]'


@pytest.mark.parametrize('j, k', [(1, 1), (1, 2), (2, 2), (4, 8), (3, 7), (16, 32)])
def test_schedule_keeps_staleness_in_bounds(j, k):
  versions = [sampling_version(i, j, k) for i in range(200)]
  assert versions == sorted(versions)  # never goes back
  for i, v in enumerate(versions):
    assert v % j == 0 and 0 <= i - v <= k - 1, (i, v)
    if i >= k:
      assert i - v >= k - j, (i, v)  # the pipeline is full
  if (j, k) == (1, 1):
    assert versions == list(range(200))  # lockstep


def test_sampling_version_examples():
  assert [sampling_version(i, 1, 2) for i in range(5)] == [0, 0, 1, 2, 3]  # one step behind
  assert [sampling_version(i, 2, 4) for i in range(8)] == [0, 0, 0, 0, 2, 2, 4, 4]


@pytest.mark.parametrize('j, k', [(1, 1), (1, 2), (2, 4), (4, 8)])
def test_launches_run_at_most_k_batches_ahead(j, k):
  s = settings(staleness_j=j, staleness_k=k, total_steps=20)
  for step in range(20):
    due = [i for i in range(25) if launch_due(i, step, s)]
    assert due == list(range(min(20, max(due) + 1)))  # a prefix of the run's batches
    assert max(due) - step <= k - 1  # batch `step` trains next; at most k in flight
    assert sampling_version(max(due), j, k) <= step
  assert not launch_due(20, 19, s)  # past the run


@pytest.mark.parametrize('j, k', [(1, 1), (1, 2), (2, 4), (4, 8), (3, 3)])
def test_free_running_launches_at_most_k_minus_j_batches_ahead(j, k):
  """Free-running: batch i launches once i - step <= k - j, whatever version exists. A
  worker then holds a version at most j - 1 behind the trainer's at launch (reload_due) and
  the trainer moves at most k - j versions before training it: every token's staleness is
  at most (j - 1) + (k - j) = k - 1."""
  s = settings(staleness_j=j, staleness_k=k, total_steps=20, schedule='free')
  for step in range(20):
    due = [i for i in range(25) if launch_due(i, step, s)]
    assert due == list(range(min(20, step + k - j + 1)))
    # The worst case: launched at `step` with a version j - 1 behind, trained at max(due).
    assert (max(due) - step) + (j - 1) <= k - 1
  assert not launch_due(20, 19, s)
  # (1, 1): lockstep; (1, 2): the deterministic schedule's window.
  lockstep = settings(schedule='free')
  assert [i for i in range(5) if launch_due(i, 2, lockstep)] == [0, 1, 2]


def test_reload_due_is_the_j_threshold():
  assert reload_due(latest=0, held=-1, j=4)  # nothing held: always
  assert not reload_due(latest=5, held=3, j=3) and reload_due(latest=6, held=3, j=3)
  assert reload_due(latest=4, held=3, j=1) and not reload_due(latest=3, held=3, j=1)


def test_eval_due():
  s = settings(total_steps=7, eval_every=3)
  assert [n for n in range(1, 8) if eval_due(n, s)] == [3, 6, 7]
  assert [n for n in range(1, 8) if eval_due(n, settings(total_steps=7))] == [7]


def test_versions_kept_covers_the_acceptance_window():
  assert settings().versions_kept == 3
  assert settings(staleness_j=2, staleness_k=4).versions_kept == 6
  assert 'keep_versions' not in {f.name for f in ControllerSettings.__dataclass_fields__.values()}


def test_chunk_bounds_are_contiguous_and_cover_the_batch():
  assert chunk_bounds(8, 2) == [(0, 4), (4, 8)]
  assert chunk_bounds(5, 2) == [(0, 3), (3, 5)]
  assert chunk_bounds(2, 3) == [(0, 1), (1, 2)]  # the third worker gets nothing
  assert chunk_bounds(4, 1) == [(0, 4)]
  for n in range(1, 12):
    for w in range(1, 5):
      bounds = chunk_bounds(n, w)
      assert bounds[0][0] == 0 and bounds[-1][1] == n and len(bounds) <= w
      assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_chunk_stop_shares_the_batch_stop():
  assert chunk_stop(0, 3, 6) is None  # APRIL off: run to the end
  assert chunk_stop(4, 3, 6) == 2  # ceil(4 * 3 / 6)
  assert chunk_stop(5, 3, 6) == 3
  assert chunk_stop(6, 3, 6) == 3  # never more than the chunk
  assert chunk_stop(4, 1, 8) == 1


def test_continue_carried():
  # Bound 5, k = 2: tokens from version 4 or later may continue; older ones restart.
  assert continue_carried([None, 4, 3, 5], 5, 2) == [True, True, False, True]
  assert continue_carried([2, 2], 3, 1) == [False, False]  # on-policy: any update restarts
  assert continue_carried([], 3, 1) == []


def test_replay_count():
  assert replay_count(pool_size=10, replay=0.5, open_slots=5) == 2  # floor(2.5)
  assert replay_count(pool_size=1, replay=0.5, open_slots=6) == 1  # what the pool holds
  assert replay_count(pool_size=10, replay=0.0, open_slots=6) == 0


def counts(selection):
  return {k.removeprefix('rollout/'): v for k, v in selection.stats.items()}


def test_select_without_oversampling_trains_every_group():
  groups = [(0, 'a', False), (0, 'b', True)]
  sel = select_groups(groups, [], 0, settings())
  assert sel.train == ['a', 'b'] and sel.recycled == []
  assert counts(sel) == dict(filtered_groups=0, recycled_groups=0, dropped_stale_groups=0,
                             padding_groups=0, trained_groups=2)


def test_select_drops_groups_of_the_batch_outside_the_acceptance_window():
  """Free-running mode's bound at training time: a group whose oldest token is k or more
  versions behind the trainer is dropped and counted, with or without oversampling; a batch
  left with none skips its update."""
  s = settings(staleness_k=2)
  groups = [(3, 'a', True), (1, 'b', True), (2, 'c', False)]
  sel = select_groups(groups, [], 3, s)  # 'b': 3 - 1 >= 2
  assert sel.train == ['a', 'c']
  assert counts(sel) == dict(filtered_groups=0, recycled_groups=0, dropped_stale_groups=1,
                             padding_groups=0, trained_groups=2)
  sel = select_groups([(0, 'x', True)], [], 3, s)
  assert sel.train is None and counts(sel)['dropped_stale_groups'] == 1
  s = settings(staleness_k=2, oversample=1.0)  # 4 groups asked, 2 trained
  sel = select_groups([(3, 'a', True), (1, 'b', True), (3, 'c', True), (3, 'd', False)],
                      [(1, 'old')], 3, s)
  assert sel.train == ['a', 'c'] and sel.recycled == []
  assert counts(sel) == dict(filtered_groups=1, recycled_groups=0, dropped_stale_groups=2,
                             padding_groups=0, trained_groups=2)


def test_select_trains_informative_groups_and_recycles_the_surplus():
  s = settings(oversample=1.0, staleness_k=2)  # 4 groups asked, 2 trained
  groups = [(3, 'a', True), (3, 'b', False), (3, 'c', True), (3, 'd', True)]
  sel = select_groups(groups, [(2, 'old'), (1, 'stale')], 3, s)
  # Fresh recycled groups go first; 'stale' (3 - 1 >= k) is dropped.
  assert sel.train == ['old', 'a']
  assert sel.recycled == [(3, 'c'), (3, 'd')]
  assert counts(sel) == dict(filtered_groups=1, recycled_groups=2, dropped_stale_groups=1,
                             padding_groups=0, trained_groups=2)


def test_short_batch_pad_tops_up_with_filtered_groups():
  s = settings(oversample=1.0)
  groups = [(0, 'a', False), (0, 'b', True), (0, 'c', False), (0, 'd', False)]
  sel = select_groups(groups, [], 0, s)
  assert sel.train == ['b', 'a'] and sel.recycled == []
  assert counts(sel) == dict(filtered_groups=2, recycled_groups=0, dropped_stale_groups=0,
                             padding_groups=1, trained_groups=1)


def test_a_batch_without_signal_skips_the_update():
  s = settings(oversample=1.0)
  sel = select_groups([(0, g, False) for g in 'abcd'], [], 0, s)
  assert sel.train is None and sel.recycled == []
  assert counts(sel)['filtered_groups'] == 4 and counts(sel)['padding_groups'] == 0


def test_short_batch_wait_keeps_the_informative_groups():
  s = settings(oversample=1.0, short_batches='wait', staleness_k=2)
  groups = [(1, 'a', False), (1, 'b', True), (1, 'c', False), (1, 'd', False)]
  sel = select_groups(groups, [], 1, s)
  assert sel.train is None and sel.recycled == [(1, 'b')]
  assert counts(sel) == dict(filtered_groups=3, recycled_groups=1, dropped_stale_groups=0,
                             padding_groups=0, trained_groups=0)
  # The next batch fills up with it (the version did not move): a full update.
  groups = [(1, 'e', True), (1, 'f', False), (1, 'g', True), (1, 'h', False)]
  sel = select_groups(groups, sel.recycled, 1, s)
  assert sel.train == ['b', 'e'] and sel.recycled == [(1, 'g')]
  assert counts(sel) == dict(filtered_groups=2, recycled_groups=1, dropped_stale_groups=0,
                             padding_groups=0, trained_groups=2)


def test_every_group_is_counted_once():
  s = settings(oversample=2.0, prompts_per_step=3, staleness_k=3)
  recycled = [(0, 'r0'), (2, 'r1')]
  groups = [(4, f'g{n}', n % 3 != 0) for n in range(9)]
  sel = select_groups(groups, recycled, 4, s)
  c = counts(sel)
  assert (c['trained_groups'] + c['padding_groups'] + c['filtered_groups']
          + c['dropped_stale_groups'] + c['recycled_groups']) == len(groups) + len(recycled)


def test_settings_validate_the_schedule():
  with pytest.raises(ValueError, match=r'staleness \(j, k\) = \(2, 1\): j must be <= k'):
    settings(staleness_j=2)
  with pytest.raises(ValueError, match='rollout.stop_after_groups=1 must be 0'):
    settings(stop_after_groups=1)
  assert settings(oversample=0.5, stop_after_groups=3).requested_groups == 3
  assert settings(oversample=0.5).replay_capacity == 12
  assert schedule.Selection(None, [], {}).train is None
  assert settings().schedule == 'deterministic'  # the default
  with pytest.raises(ValueError, match=r"staleness.schedule='async' is not valid; choose one "
                     r"of \['deterministic', 'free'\]"):
    settings(schedule='async')
