"""TensorBoard event files of a run: one of ``rlax_llm.metrics.MetricsWriter``'s outputs.

``TensorBoardWriter`` (``tensorboardX``) writes, into the run directory:

* one scalar per metric key (tag = key) for each step;
* keys ``hist/NAME``, vector metrics of bin fractions over ``HISTOGRAM_BIN_EDGES[key]`` (the
  trainer's ``hist/log_ratio``, per-token log pi_theta - log pi_behaviour), as histogram
  ``NAME``; ``check_bins`` validates them;
* ``write_rollouts``: what scalars cannot show, histograms of the rewards, the advantages,
  the completion lengths and the per-token staleness of a step's rollouts, and every
  ``text_every`` steps a markdown table of sampled prompts and completions (tag ``samples``).

A resumed run passes ``resume_step``: TensorBoard purges the events of later steps.

A ``gs://`` run directory: tensorboardX's own ``gs://`` writer re-uploads the whole event
file through ``google-cloud-storage`` at every flush, another client with its own
credentials and emulator settings than the rest of the run. So the events are written to a
local staging directory and each event file is uploaded to the run directory through
``rlax_llm.storage`` (one object upload: a reader sees the previous upload or this one, never
a torn file) at ``flush``, at ``close``, and from ``write`` when ``SYNC_EVERY_S`` have passed
since the last upload. A crash loses at most the events since then; TensorBoard reads the
uploaded files as it reads local ones.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from rlax_llm import storage
from rlax_llm.losses.diagnostics import LOG_RATIO_BIN_EDGES


def _import_tensorboardx():
  """``tensorboardX``, imported without the ``import torch`` its writer module makes when torch
  is installed (only to accept torch tensors, which this module never passes): that import
  costs about 1.1 CPU s in every process that starts a run (a run's start 3.5 -> 2.1 s with
  torch installed beside, as in the tests' environment). A process that already holds torch
  keeps it; torch imports normally afterwards."""
  if 'torch' in sys.modules or 'tensorboardX' in sys.modules:
    return importlib.import_module('tensorboardX')
  sys.modules['torch'] = None  # ``import torch`` raises ImportError, which tensorboardX catches
  try:
    return importlib.import_module('tensorboardX')
  finally:
    del sys.modules['torch']


tensorboardX = _import_tensorboardx()

# Vector metrics: key -> bin edges. Each is drawn as a TensorBoard histogram (tag: the key
# without 'hist/'), from bin fractions computed where the data lives (the trainer's step).
HISTOGRAM_BIN_EDGES = {'hist/log_ratio': LOG_RATIO_BIN_EDGES}
TEXT_SAMPLES = 4  # prompts shown per ``samples`` text entry (the first row of each group)
SYNC_EVERY_S = 30.0  # a gs:// run directory: the staged event files are uploaded this often


def check_bins(key: str, value: Any) -> np.ndarray:
  """``value`` as float64 ``[bins]`` bin fractions of the ``hist/`` metric ``key``.

  Raises ValueError when ``key`` has no edges in ``HISTOGRAM_BIN_EDGES`` or ``value`` is not
  a vector with one entry per bin.
  """
  if key not in HISTOGRAM_BIN_EDGES:
    raise ValueError(f'metric {key!r}: keys starting with hist/ are binned histograms, and '
                     f'only {sorted(HISTOGRAM_BIN_EDGES)} have bin edges; add its edges to '
                     'rlax_llm.tensorboard_writer.HISTOGRAM_BIN_EDGES or rename the metric.')
  arr = np.asarray(jax.device_get(value), dtype=np.float64)
  bins = len(HISTOGRAM_BIN_EDGES[key]) - 1
  if arr.shape != (bins,):
    raise ValueError(f'metric {key!r} has shape {arr.shape}; its edges make {bins} bins, so '
                     f'it must be a vector of {bins} bin fractions.')
  return arr


def _markdown_cell(text: str) -> str:
  return str(text).replace('|', '\\|').replace('\n', '<br>')


class TensorBoardWriter:
  """Event files in ``workdir`` (see the module docstring).

  Args:
    workdir: the run directory (a local directory that exists, or a ``gs://`` URL: the
      events are staged locally and uploaded, see the module docstring).
    text_every: ``write_rollouts`` writes sampled completions as text at steps that are
      multiples of this (0: never).
    resume_step: a resumed run's restored step: events of later steps are purged.
  """

  def __init__(self, workdir: str | os.PathLike, *, text_every: int = 0,
               resume_step: int | None = None):
    self._text_every = text_every
    self._remote = storage.path(workdir) if storage.is_gcs(workdir) else None
    self._staging = (tempfile.mkdtemp(prefix='rlax-tensorboard-') if self._remote is not None
                     else None)
    self._synced = time.monotonic()
    self._tb = tensorboardX.SummaryWriter(
        logdir=self._staging or str(workdir),
        purge_step=None if resume_step is None else resume_step + 1)

  def write(self, step: int, values: Mapping[str, int | float],
            binned: Mapping[str, np.ndarray]) -> None:
    """One step's checked scalars and ``check_bins``' bin fractions."""
    for key, value in values.items():
      self._tb.add_scalar(key, value, step)
    for key, fractions in binned.items():
      self._write_binned(step, key, fractions)
    if self._remote is not None and time.monotonic() - self._synced >= SYNC_EVERY_S:
      self.flush()

  def _sync(self) -> None:
    """Uploads every staged event file to the ``gs://`` run directory."""
    for local in sorted(p for p in pathlib.Path(self._staging).iterdir() if p.is_file()):
      storage.upload_file(local, self._remote / local.name)
    self._synced = time.monotonic()

  def _write_binned(self, step: int, key: str, fractions: np.ndarray) -> None:
    """A TensorBoard histogram from bin fractions (moments from the bin centres)."""
    edges = np.asarray(HISTOGRAM_BIN_EDGES[key])
    used = np.flatnonzero(fractions > 0)
    if not used.size or not np.all(np.isfinite(fractions)):
      return
    centres = (edges[:-1] + edges[1:]) / 2
    self._tb.add_histogram_raw(
        key.removeprefix('hist/'), min=float(edges[used[0]]), max=float(edges[used[-1] + 1]),
        num=float(fractions.sum()), sum=float(fractions @ centres),
        sum_squares=float(fractions @ centres**2), bucket_limits=edges[1:].tolist(),
        bucket_counts=fractions.tolist(), global_step=int(step))

  def write_histogram(self, step: int, key: str, values: Any) -> None:
    """A histogram of ``values`` (any shape, flattened; non-finite dropped); none when no
    finite value is left."""
    arr = np.asarray(jax.device_get(values), dtype=np.float64).ravel()
    arr = arr[np.isfinite(arr)]
    if arr.size:
      self._tb.add_histogram(key, arr, int(step))

  def write_text(self, step: int, key: str, text: str) -> None:
    """A text entry (markdown)."""
    self._tb.add_text(key, text, int(step))

  def write_rollouts(self, step: int, prompts: Sequence[Any], rollouts: Any,
                     advantages: Any = None, staleness: Any = None) -> None:
    """Histograms of one step's rollouts and, every ``text_every`` steps, samples as text.

    Args:
      step: the step (as in ``write``).
      prompts: the batch's prompts (``rlax_llm.tasks.base.Prompt``); row ``i`` of
        ``rollouts`` answers ``prompts[rollouts.group_ids[i]]``.
      rollouts: the scored ``rlax_llm.data_types.Rollouts`` (``rewards`` filled in).
      advantages: float [B'] of the rows trained on, or None (no update this step).
      staleness: int [tokens] of the trained tokens (``trainer version - sampling
        version``), or None.

    Histogram tags: ``reward``, ``advantages``, ``staleness``, ``completion/length``.
    Text tag: ``samples`` (prompt, completion, reward, sampling version of the first row of
    the first ``TEXT_SAMPLES`` groups).
    """
    self.write_histogram(step, 'reward', rollouts.rewards)
    self.write_histogram(step, 'completion/length', np.sum(rollouts.completion_mask, 1))
    if advantages is not None:
      self.write_histogram(step, 'advantages', advantages)
    if staleness is not None:
      self.write_histogram(step, 'staleness', staleness)
    if self._text_every and step % self._text_every == 0:
      rows = ['| prompt | completion | reward | version |', '| --- | --- | --- | --- |']
      group_ids = np.asarray(rollouts.group_ids)
      for group in sorted(set(group_ids.tolist()))[:TEXT_SAMPLES]:
        i = int(np.flatnonzero(group_ids == group)[0])
        versions = np.asarray(rollouts.versions[i])
        version = int(versions.max()) if versions.size else -1
        reward = 'n/a' if rollouts.rewards is None else f'{float(rollouts.rewards[i]):.3g}'
        rows.append(f'| {_markdown_cell(prompts[group].text)} | '
                    f'{_markdown_cell(rollouts.completions[i])} | {reward} | {version} |')
      self.write_text(step, 'samples', '\n'.join(rows))

  def flush(self) -> None:
    """Writes the pending events to disk (and uploads them to a ``gs://`` run directory)."""
    self._tb.flush()
    if self._remote is not None:
      self._sync()

  def close(self) -> None:
    """Flushes and closes the event file (uploaded to a ``gs://`` run directory, whose local
    staging directory is then removed)."""
    self._tb.close()
    if self._remote is not None:
      self._sync()
      shutil.rmtree(self._staging, ignore_errors=True)
