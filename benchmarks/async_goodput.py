"""Benchmark: trainer busy fraction and wall time, synchronous vs asynchronous (j, k), and the
free-running mode (``staleness.schedule='free'``) against the deterministic schedule.

Two settings, both through the real controller (``rlax_llm.controller``):

* **sleeps**: the trainer and the inference worker are replaced by calibrated sleeps
  (``--train_s`` per update, ``rollout_s`` per batch), so what is measured is the
  scheduler's overlap, apart from this machine's 2 cores. Runs for several rollout/train
  ratios and (j, k).
* **real**: the default config's tiny model, trainer and worker sharing this machine's CPU.

A small capacity model predicts the sleeps setting: per step, synchronous
``T_roll + T_train + c``; asynchronous (k > 1, generation of later batches overlapping
training) ``max(T_train + c_t, T_roll + c_r)``, with the per-step overheads ``c`` measured in
the same run with zero sleeps; busy fraction ``T_train / step``. The benchmark prints the
predictions next to the measurements (goal: within 20%) and projects a TPU pod with the
model (assumptions printed with it).

Free-running mode, in both settings, next to the deterministic schedule at the same (j, k):
goodput (trained samples per second of wall time), wall time, the trained tokens' mean
staleness and the samples whose tokens two versions drew (a swap mid-generation). In the
sleeps setting the worker emulates the free-running worker: its sleep is split into one
slice per token, and before each slice it takes the trainer's version when that is ``j`` or
more ahead of its own.

    .venv/bin/python benchmarks/async_goodput.py [--steps=30] [--train_s=0.2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import tempfile
import time

import numpy as np

from rlax_llm.controller import Controller
from rlax_llm.data_types import FollowLatest, Rollouts
from rlax_llm.metrics import MetricsWriter, read_metrics
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.schedule import ControllerSettings, reload_due
from rlax_llm.tasks import ArithmeticTask

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCHEDULES = [(1, 1), (1, 2), (2, 4), (4, 8)]


class SleepTrainer:
  """A trainer that takes ``seconds`` per update."""

  def __init__(self, seconds: float):
    self.seconds = seconds
    self.version = 0
    self.busy_s = 0.0
    self._pool = concurrent.futures.ThreadPoolExecutor(1)

  def _step(self, batch):
    del batch
    start = time.perf_counter()
    time.sleep(self.seconds)
    self.version += 1
    self.busy_s += time.perf_counter() - start
    return {'loss': 0.0, 'grad_norm': 0.0, 'update/skipped': 0.0}

  def step(self, batch):
    return self._pool.submit(self._step, batch)


class SleepWorker:
  """An inference worker that takes ``seconds`` per batch and returns empty completions.
  Given ``FollowLatest(j)`` (free-running), it draws ``width`` tokens of ``seconds / width``
  each and, before each, takes ``latest()`` (the trainer's version) when that is ``j`` or
  more ahead of its own."""

  def __init__(self, seconds: float, width: int = 4, latest=None):
    self.seconds = seconds
    self.width = width
    self.latest = latest
    self.version = -1
    self._pool = concurrent.futures.ThreadPoolExecutor(1)

  def _generate(self, requests, rng_data, version):
    del rng_data
    if isinstance(version, FollowLatest):
      drawn = []
      for _ in range(self.width):
        latest = self.latest()
        if reload_due(latest, self.version, version.j):
          self.version = latest
        drawn.append(self.version)
        time.sleep(self.seconds / self.width)
    else:
      self.version = version  # the weights it samples with (recorded per token)
      drawn = [version] * self.width
      time.sleep(self.seconds)
    counts = [r.num_samples for r in requests]
    b, w = sum(counts), self.width
    return Rollouts(
        prompt_ids=np.repeat([r.prompt.prompt_id for r in requests], counts),
        group_ids=np.repeat(np.arange(len(requests), dtype=np.int32), counts),
        prompt_tokens=np.ones((b, 2), np.int32), prompt_lengths=np.full(b, 2, np.int32),
        completion_tokens=np.ones((b, w), np.int32), completion_mask=np.ones((b, w), bool),
        behaviour_logprobs=np.zeros((b, w), np.float32),
        support_sizes=np.ones((b, w), np.int32),
        versions=np.tile(np.asarray(drawn, np.int32), (b, 1)),
        finish_reasons=np.full(b, 'stop'), completions=[''] * b,
        sampling=requests[0].sampling, timings={'generate_s': self.seconds})

  def generate(self, requests, rng_data, version, stop_after=None, first=0):
    del stop_after, first  # every request finishes within its sleep
    return self._pool.submit(self._generate, requests, rng_data, version)

  def retire(self) -> None:
    self._pool.shutdown(wait=False)


def quality(rows: list[dict], group_size: int, wall: float) -> dict:
  """Goodput (trained samples per second of ``wall``), the trained tokens' mean staleness
  (mean of the steps'), the samples two versions drew, the groups dropped as too stale."""
  return {
      'goodput_samples_per_s': sum(r['rollout/trained_groups'] for r in rows) * group_size
                               / wall,
      'staleness_mean': float(np.mean([r['staleness/mean'] for r in rows])),
      'mixed_version_samples': sum(r.get('rollout/mixed_version_samples', 0) for r in rows),
      'dropped_stale_groups': sum(r['rollout/dropped_stale_groups'] for r in rows)}


def run_sleeps(train_s: float, rollout_s: float, j: int, k: int, steps: int,
               schedule: str = 'deterministic') -> dict:
  task = ArithmeticTask(num_eval=4)
  settings = ControllerSettings(total_steps=steps, prompts_per_step=4, group_size=2,
                                staleness_j=j, staleness_k=k, eval_every=0, seed=0,
                                sampling=SamplingSpec(), max_new_tokens=4, schedule=schedule)
  trainer = SleepTrainer(train_s)
  worker = SleepWorker(rollout_s, latest=lambda: trainer.version)
  with tempfile.TemporaryDirectory() as workdir:
    with MetricsWriter(pathlib.Path(workdir), tensorboard=False, console=False) as writer:
      controller = Controller(settings, task, trainer, [worker], writer)
      controller.start_accuracy = controller.accuracy = 0.0  # no evaluation in this setting
      controller.evaluate = lambda: {'eval/accuracy': 0.0}
      start = time.perf_counter()
      controller.run()
      wall = time.perf_counter() - start
    rows = read_metrics(pathlib.Path(workdir) / 'metrics.jsonl')
  return {'wall_s': wall, 'step_s': wall / steps, 'busy_fraction': trainer.busy_s / wall,
          **quality(rows, settings.group_size, wall)}


def predict(train_s: float, rollout_s: float, k: int, steps: int, overhead: dict) -> dict:
  """The capacity model (see the module docstring)."""
  if k == 1:
    step = rollout_s + train_s + overhead['sync']
  else:
    step = max(train_s + overhead['async'], rollout_s + overhead['async'])
  wall = steps * step + (rollout_s if k > 1 else 0.0)
  return {'step_s': step, 'wall_s': wall, 'busy_fraction': steps * train_s / wall}


def run_real(j: int, k: int, steps: int, schedule: str = 'deterministic') -> dict:
  from rlax_llm.backends import local  # pylint: disable=import-outside-toplevel
  from rlax_llm.cli import load_config_file  # pylint: disable=import-outside-toplevel
  from rlax_llm.config import validate_config  # pylint: disable=import-outside-toplevel
  config = load_config_file(str(ROOT / 'configs/default.py'))
  config.total_steps = steps
  config.warmup.steps = 300
  config.eval.every_steps = 0
  config.log.tensorboard = False
  config.log.console_every = 1000
  config.staleness.j, config.staleness.k = j, k
  config.staleness.schedule = schedule
  # No checkpoints (free-running mode refuses them): the runs time the schedule, not Orbax.
  config.checkpoint.every_steps, config.checkpoint.every_seconds = 0, 0.0
  with tempfile.TemporaryDirectory() as workdir:
    with local.build_run(config, pathlib.Path(workdir), validate_config(config)) as run:
      start = time.perf_counter()
      run.controller.run()
      wall = time.perf_counter() - start
    rows = read_metrics(pathlib.Path(workdir) / 'metrics.jsonl')
  train_s = sum(r['time/train_s'] for r in rows)
  return {'wall_s': wall, 'step_s': wall / steps, 'busy_fraction': train_s / wall,
          'final_reward': rows[-1]['reward/mean'],
          **quality(rows, config.rl.group_size, wall)}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--steps', type=int, default=30)
  parser.add_argument('--train_s', type=float, default=0.2)
  parser.add_argument('--ratios', default='0.5,1.0,2.0', help='rollout time / train time')
  parser.add_argument('--real_steps', type=int, default=40, help='0: skip the real runs')
  parser.add_argument('--free', default='1,2;2,4;4,8',
                      help="(j, k) pairs run in free-running mode too ('': none)")
  parser.add_argument('--real_repeats', type=int, default=1,
                      help='real runs per (j, k) and mode, alternating; the medians are kept')
  args = parser.parse_args()
  free_pairs = [tuple(int(x) for x in pair.split(',')) for pair in args.free.split(';')
                if pair]

  zero = {f'{j},{k}': run_sleeps(0.0, 0.0, j, k, args.steps) for j, k in ((1, 1), (1, 2))}
  overhead = {'sync': zero['1,1']['step_s'], 'async': zero['1,2']['step_s']}
  sleeps, errors, free_sleeps = [], [], []
  for ratio in [float(r) for r in args.ratios.split(',')]:
    rollout_s = ratio * args.train_s
    for j, k in SCHEDULES:
      measured = run_sleeps(args.train_s, rollout_s, j, k, args.steps)
      model = predict(args.train_s, rollout_s, k, args.steps, overhead)
      error = abs(model['wall_s'] - measured['wall_s']) / measured['wall_s']
      errors.append(error)
      sleeps.append({'rollout_over_train': ratio, 'j': j, 'k': k, 'measured': measured,
                     'model': model, 'model_error': error})
      print(json.dumps(sleeps[-1]), flush=True)
      if (j, k) in free_pairs:  # the same setting, free-running, next to the deterministic
        free = run_sleeps(args.train_s, rollout_s, j, k, args.steps, 'free')
        free_sleeps.append({'rollout_over_train': ratio, 'j': j, 'k': k,
                            'deterministic': measured, 'free': free,
                            'goodput_ratio': free['goodput_samples_per_s']
                                             / measured['goodput_samples_per_s']})
        print(json.dumps(free_sleeps[-1]), flush=True)
  real, free_real = {}, {}
  if args.real_steps > 0:
    runs = {}  # (pair, mode) -> repeats, alternating modes so that load drifts hit both
    for _ in range(args.real_repeats):
      for j, k in ((1, 1), *free_pairs):
        for mode in ('deterministic', 'free') if (j, k) in free_pairs else ('deterministic',):
          runs.setdefault((f'{j},{k}', mode), []).append(run_real(j, k, args.real_steps, mode))
    for (key, mode), repeats in runs.items():
      (free_real if mode == 'free' else real)[key] = {
          name: float(np.median([r[name] for r in repeats])) for name in repeats[0]}
  # A TPU pod projection with the same model (assumptions, not measurements): a 32B model,
  # a 1024-chip slice split between training and inference, 45 s per update and 60 s per
  # rollout batch, weight sync 3 s (RLAX's QwQ-32B setting has a 45 s async step).
  pod = {f'{j},{k}': predict(45.0, 60.0, k, 100, {'sync': 3.0, 'async': 3.0})
         for j, k in ((1, 1), (16, 16), (16, 32))}
  async_ok = [s['measured']['busy_fraction'] for s in sleeps
              if s['k'] > 1 and s['rollout_over_train'] <= 1.0]
  print(json.dumps({
      'benchmark': 'async_goodput', 'steps': args.steps, 'train_s': args.train_s,
      'overhead_s': overhead, 'sleeps': sleeps, 'max_model_error': max(errors),
      'min_async_busy_fraction_when_rollout_le_train': min(async_ok),
      'real': real, 'pod_projection': pod,
      'free_sleeps': free_sleeps, 'free_real': free_real,
      'free_goodput_ratio_real': {key: run['goodput_samples_per_s']
                                  / real[key]['goodput_samples_per_s']
                                  for key, run in free_real.items()},
      'goals': {'busy_fraction': '>= 0.9 (sleeps, k > 1, rollout <= train)',
                'model_error': '<= 0.2'},
  }, indent=2))


if __name__ == '__main__':
  main()
