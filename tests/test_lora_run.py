"""LoRA runs end to end. Adapter-only sync (``lora.sync='adapters'``: the base pushed and
pulled once, each version's adapters merged by the workers on pull) gives the run that merged
pushes give, bit for bit (rewards, versions, ledger, losses, final params), while the
parameter server receives only the adapters' bytes per version; on Ray too. A LoRA run
SIGTERMed and relaunched through ``python -m rlax_llm.launch`` equals the uninterrupted one,
and ``python -m rlax_llm.evaluate --checkpoint`` evaluates its checkpoint (the merged
weights)."""

import dataclasses
import json
import signal

import jax
import numpy as np
import pytest
from smoke_config import smoke_config  # tests/smoke_config.py
from test_resume import (
  _final_params,
  _launch,
  _wait_for_rows,
  assert_same_params,
  read,
  run_once,
  smoke,
)

from rlax_llm import evaluate, roles
from rlax_llm.backends import build_run
from rlax_llm.backends import local as local_backend
from rlax_llm.backends.ray import init_ray
from rlax_llm.config import run_spec
from rlax_llm.models import lora as lora_lib
from rlax_llm.paramserver import ParameterServer, shm
from rlax_llm.paramserver.shards import leaf_specs

LORA = {'lora__rank': 2, 'lora__targets': 'q,v,o,down'}


def lora_smoke(**fields):
  """A short LoRA run, one step off-policy (k=2: versions lag the batches they train)."""
  short = {'total_steps': 3, 'staleness__j': 1, 'staleness__k': 2, 'eval__every_steps': 2,
           'log__tensorboard': False, 'checkpoint__every_steps': 0,
           'checkpoint__every_seconds': 0.0}
  return smoke_config(**(short | LORA | fields))


def nbytes(tree) -> int:
  return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(tree))


def run_local(config, workdir, monkeypatch):
  """Runs ``config``; returns the final params and every push each server received:
  ``{'versions': [(version, bytes)], 'base': [...]}``."""
  pushes = []
  push = ParameterServer.push

  def spy(self, version, params, adopt=False):
    pushes.append((self, version, nbytes(params)))
    return push(self, version, params, adopt)
  monkeypatch.setattr(ParameterServer, 'push', spy)
  with local_backend.build_run(config, workdir, run_spec(config)) as r:
    r.execute()
    handle = r.controller.trainer
    params = handle.host_params().result()
    servers = {'versions': handle.server, 'base': handle.base_server}
    model = handle.trainer.model
  monkeypatch.undo()
  received = {name: [(v, n) for s, v, n in pushes if s is server]
              for name, server in servers.items()}
  return params, received, servers, model


def test_adapter_sync_equals_merged_pushes_and_sends_only_the_adapters(tmp_path, monkeypatch):
  """Both runs checkpoint their last step; ``evaluate --checkpoint`` then reads the adapter
  run's (the base and the adapters) and evaluates the merged weights."""
  runs = {sync: run_local(lora_smoke(lora__sync=sync, checkpoint__every_steps=3),
                          tmp_path / sync, monkeypatch)
          for sync in ('adapters', 'merged')}
  (params, received, _, model), (merged_params, merged_received, merged_servers, _) = (
      runs['adapters'], runs['merged'])
  metrics, ledger = read(tmp_path / 'adapters')
  assert (metrics, ledger) == read(tmp_path / 'merged')  # rewards, versions, losses, ...
  assert len(metrics) == 3 and any(row['staleness/mean'] > 0 for row in metrics)
  jax.tree.map(np.testing.assert_array_equal, params, merged_params)
  # lora.sync='merged' pushes the merged weights of the trainer's version.
  server = merged_servers['versions']
  assert merged_servers['base'] is None
  jax.tree.map(np.testing.assert_array_equal, server.get(server.latest_version()).params,
               lora_lib.merge_program(model)(params))
  # Per version the server received the adapters' bytes (float32 A and B) and nothing else;
  # the base went once, to its own server. Merged pushes carry the whole model every time.
  adapters, base = nbytes(lora_lib.adapter_tree(params)), nbytes(lora_lib.base_tree(params))
  assert [v for v, _ in received['versions']] == [0, 1, 2, 3]
  assert {n for _, n in received['versions']} == {adapters}
  assert received['base'] == [(0, base)]
  assert {n for _, n in merged_received['versions']} == {base}
  assert adapters < base / 10
  # The worker moved the base once, its first adapters whole, then at most the adapters per
  # version (as deltas: A does not change in the first update, while B is still zeros).
  last = [json.loads(line) for line in (tmp_path / 'adapters' / 'metrics.jsonl').open()][-1]
  assert last['sync/updates'] >= 2
  assert base + adapters < last['sync/bytes'] <= base + last['sync/updates'] * adapters, last
  # evaluate --checkpoint on the run's workdir (its config; launch would have saved it as
  # config.json, which evaluate then reads): the checkpoint merged.
  workdir = str(tmp_path / 'adapters')
  config = lora_smoke(checkpoint__every_steps=3)
  _, _, worker = evaluate.policy_worker(config, workdir)
  want = worker.engine.place_params(lora_lib.merge_program(model)(params))
  jax.tree.map(np.testing.assert_array_equal, worker.params, want)
  assert metrics[-1]['eval/accuracy'] == evaluate.evaluate_config(config, workdir)[
      'eval/accuracy']  # the run's last greedy evaluation, of the same weights


@pytest.mark.parametrize('quant', ['none', 'int8'])
def test_a_fresh_worker_pulls_the_base_once_then_adapter_versions(quant):
  """What a new or restarted worker does (a Ray actor restarted after its process died
  starts empty): it pulls the base once, checked against the base server's checksums, then
  the adapters of each version asked for (the second as a delta), and samples with the
  merged weights (an int8 worker: quantised from the merged weights on pull). A corrupted
  base is refused naming its leaf, and nothing is installed."""
  config = lora_smoke(model__inference_quant=quant)
  task = roles.build_task(config)
  model, params, tokenizer = roles.build_model(config, task)
  lmodel, first = lora_lib.create(model, params, lora_lib.from_config(config))
  keys = iter(jax.random.split(jax.random.key(7), 64))
  second = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.01 * jax.random.normal(next(keys), x.shape, x.dtype)
      if lora_lib.is_adapter_path(path) and path[-1].key == 'b' else x, first)
  base_server, server = ParameterServer(keep=1), ParameterServer(keep=2)
  base_server.push(0, lora_lib.pushed_base(lmodel, first, model))
  for version, tree in enumerate((first, second)):
    server.push(version, lora_lib.pushed_params(lmodel, tree, model))
  bases = []
  def fetch_base():
    bases.append(base_server.update(0))
    return bases[-1]
  mesh = roles.meshes(config)['inference'][0]
  worker = roles.build_worker(config, model, tokenizer, mesh, fetch_base)
  figures = [worker.receiver.pull(v, server.update) for v in (0, 1)]
  assert len(bases) == 1 and worker.version == 1
  adapters, base = nbytes(lora_lib.adapter_tree(first)), nbytes(lora_lib.base_tree(first))
  assert figures[0]['sync/bytes'] == base + adapters
  assert 0 < figures[1]['sync/bytes'] < adapters  # only B changed: a delta of the adapters
  want = worker.engine.place_params(lora_lib.merge_program(lmodel)(second))
  jax.tree.map(np.testing.assert_array_equal, worker.params, want)
  dtypes = {leaf.dtype for leaf in jax.tree.leaves(worker.params)}
  assert (np.dtype(np.int8) in dtypes) == (quant == 'int8')

  def corrupted():
    update = base_server.update(0)
    (flipped, *rest), *buckets = update.buckets
    full = flipped.full.copy()
    full.reshape(-1).view(np.uint8)[0] ^= 1
    return dataclasses.replace(update, buckets=(
        (dataclasses.replace(flipped, full=full), *rest), *buckets))
  fresh = roles.build_worker(config, model, tokenizer, mesh, corrupted)
  with pytest.raises(ValueError, match='fails its checksum'):
    fresh.receiver.pull(1, server.update)
  assert fresh.version == -1


@pytest.mark.slow  # two launches and a reference run: about 90 s on the loaded dev machine
def test_a_lora_run_sigtermed_and_relaunched_equals_the_uninterrupted_one(tmp_path):
  """Through ``python -m rlax_llm.launch`` (tests/test_resume.py's pattern), with the
  warm-up and checkpoints every 2 steps."""
  config = smoke(steps=5)
  config.lora.rank, config.lora.targets = 2, LORA['lora__targets']
  summary, ref_params = run_once(config, tmp_path / 'reference', None)
  assert summary['steps'] == 5
  workdir = tmp_path / 'run'
  extra = ('--config.lora.rank=2', f'--config.lora.targets={LORA["lora__targets"]}')
  proc = _launch(workdir, *extra)
  _wait_for_rows(workdir, 1, proc, timeout=240)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out
  assert read(workdir)[0] and len(read(workdir)[0]) < 5, 'the signal came too late'
  proc = _launch(workdir, *extra)
  out, _ = proc.communicate(timeout=240)
  assert proc.returncode == 0, out
  assert read(workdir) == read(tmp_path / 'reference')
  final = _final_params(workdir)
  assert_same_params(final, ref_params)
  assert any('_lora' in jax.tree_util.keystr(path)  # the checkpoint holds the adapters
             for path, _ in jax.tree_util.tree_flatten_with_path(final)[0])


@pytest.mark.slow  # a Ray cluster and two runs
def test_adapter_sync_on_ray_equals_merged_pushes_locally(tmp_path, monkeypatch):
  ray = pytest.importorskip('ray')
  _, received, _, _ = run_local(lora_smoke(lora__sync='merged'), tmp_path / 'local',
                                monkeypatch)
  config = lora_smoke(backend='ray')
  started = init_ray(config)
  try:
    with build_run(config, tmp_path / 'ray', run_spec(config)) as r:
      r.execute()
      handle = r.controller.trainer
      params = handle.state().result()[0]
      pushed = ray.get(handle.server.received.remote())
      pushed_base = ray.get(handle.base_server.received.remote())
  finally:
    if started:
      ray.shutdown()
  assert read(tmp_path / 'ray') == read(tmp_path / 'local')
  adapters, base = nbytes(lora_lib.adapter_tree(params)), nbytes(lora_lib.base_tree(params))
  assert [(v, n) for v, _, _, n in pushed] == [(v, adapters) for v in range(4)]
  assert [(v, n) for v, _, _, n in pushed_base] == [(0, base)]
  assert {n for _, n in received['versions']} == {base}


@pytest.mark.slow  # a Ray cluster and a local run
def test_the_int8_adapter_wire_on_ray_equals_the_local_run(tmp_path, monkeypatch):
  """lora.sync_dtype='int8' on Ray: the worker actors pull each version's int8 adapters and
  their scales, dequantise and merge them as a local worker does: the same run (rewards,
  versions, ledger, losses), and every version a quarter of the adapters' float32 bytes plus
  a float32 scale per rank component of each factor."""
  ray = pytest.importorskip('ray')
  fields = {'lora__sync_dtype': 'int8'}
  params, received, _, model = run_local(lora_smoke(**fields), tmp_path / 'local', monkeypatch)
  config = lora_smoke(backend='ray', **fields)
  started = init_ray(config)
  try:
    with build_run(config, tmp_path / 'ray', run_spec(config)) as r:
      r.execute()
      pushed = ray.get(r.controller.trainer.server.received.remote())
  finally:
    if started:
      ray.shutdown()
  assert read(tmp_path / 'ray') == read(tmp_path / 'local')
  adapters = lora_lib.adapter_tree(params)
  synced = lora_lib.synced_adapters(model.lora, adapters)
  wire = nbytes(synced)
  factors = len(jax.tree.leaves(adapters))
  assert wire == nbytes(adapters) // 4 + factors * model.lora.rank * 4
  assert received['versions'] == [(v, wire) for v in range(4)]
  # On Ray each version is a shared-memory slot of the same leaves, each leaf's start aligned.
  slot = shm.layout(list(leaf_specs(synced).values()))[1]
  assert wire <= slot < wire + 2 * factors * shm.ALIGN
  assert [(v, n) for v, _, _, n in pushed] == [(v, slot) for v in range(4)]
