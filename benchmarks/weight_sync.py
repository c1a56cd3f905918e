"""Benchmark: weight synchronisation per update, on the paths a run uses, and whole params vs
lossless sparse deltas.

Transfers (``--sizes``): for each model size, the trainer's params as device arrays are
pushed to a parameter server and pulled by a worker, full (every leaf whole, base -1) and,
for the bf16 copy, as a delta from the version the worker holds, along the two real paths:

* ``local``: in one process (one CPU device), the objects the local backend uses
  (``ParameterServer.push`` of the trainer's arrays, shard by shard; ``update``,
  ``delta.apply`` and ``delta.verify`` as ``paramserver.receiver.Receiver.apply`` runs them);
* ``ray``: three Ray actors, trainer -> server -> worker, the trainer (its params split over
  ``--trainer_devices`` CPU devices of its own) pushing ``local_shards(params, to_host=True)``
  to the backend's own ``ServerRole`` (``push_shards``; ``full``; ``full_host_params``: the
  whole arrays gathered with ``host_params()`` first) and the worker pulling with
  ``fetch_update`` (the calls of ``rlax_llm.backends.ray``), timed end to end from the
  driver (its call of the trainer's push and then of the worker's pull; the trainer's new
  arrays, as after a step, made before), which sends version numbers only: ``driver_weight_bytes`` counts the array bytes
  of everything it sent and received. Once per transport of ``--transports``, interleaved
  in one run (one server actor each, the same trainer and worker actors): ``auto``, the
  default (row ``ray/<dtype>``: on one machine the trainer copies into the server's
  shared-memory slot and the worker maps it, ``rlax_llm.paramserver.shm``), and
  ``object_store`` (row ``ray[object_store]/<dtype>``: the trainer's ``ray.put``, the
  worker reading the trainer's object zero-copy).

Per path and form: seconds, bytes, and ``GB/s`` (bytes / seconds); the memory-copy bandwidth
of this machine (``np.copyto`` into a touched buffer, and into a fresh one) is measured in
the same run, and ``full_fp32_vs_memcpy`` is a full fp32 sync's bandwidth over it (goal
>= 0.5). What is pushed: the fp32 master weights (what the trainer pushes by default), and a
bf16 copy (what it pushes with ``model.inference_param_dtype='bfloat16'``); its delta moves
the elements that changed (a synthetic update changing ``--changed`` of the bf16 elements,
the density the GRPO updates below measure). With both dtypes and the local path,
``cast_to_bfloat16``: the seconds to make the bf16 copy of the fp32 weights once, on the
trainer's devices (what the backends do) and on a host with numpy (what a worker pulling fp32
would do instead). Sizes: ``smollm2`` (SmolLM2-135M-Instruct, the packaged GGUF's
weights), ``1b`` (TinyLlama-1.1B's shape with tied embeddings, 1.03 B params, random), ``tiny``
(a smoke test). Run the 1b case alone and last: it holds about 13 GB at its peak.

GRPO deltas (``--lrs``; empty to skip): SmolLM2-135M-Instruct is trained with real GRPO
updates (AdamW, the trainer's jitted step, rollouts sampled by the engine) at RL learning
rates; after each update the new version is encoded against the previous one
(``rlax_llm.paramserver.delta``) in two representations: the fp32 master weights, and a bf16
cast (what a bf16 inference worker would hold). Reported per update and representation:
bytes whole vs delta, the fraction of elements whose bits changed, and seconds to encode, to
apply, and to move the payload through pickle (protocol 5, a stand-in for a transport), whole
vs delta, all measured in the same run.

    .venv/bin/python benchmarks/weight_sync.py [--sizes=smollm2,1b] [--paths=local,ray]
        [--lrs=1e-6,1e-5] [--steps=3]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import pathlib
import pickle
import statistics
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rlax_llm.backends.ray_actors import ServerRole, fetch_update, push_shards
from rlax_llm.data_types import GenerationRequest, make_train_batch
from rlax_llm.losses import LossConfig, group_advantages
from rlax_llm.models import from_pretrained, smollm2_gguf_path
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.model import abstract_model, cast_params, split_module, with_param_dtype
from rlax_llm.models.presets import get_preset
from rlax_llm.paramserver import ParameterServer, local_shards
from rlax_llm.paramserver import delta as delta_lib
from rlax_llm.paramserver.shards import leaf_specs
from rlax_llm.rollout.worker import InferenceWorker
from rlax_llm.sampling_spec import SamplingSpec
from rlax_llm.sharding import make_mesh
from rlax_llm.tasks import ArithmeticTask
from rlax_llm.trainer.objectives import rl_objective
from rlax_llm.trainer.scoring import Policy
from rlax_llm.trainer.trainer import Trainer, make_optimizer

ROOT = pathlib.Path(__file__).resolve().parents[1]

SIZES = {
    'tiny': DecoderConfig(vocab_size=256, num_layers=2, embed_dim=64, mlp_dim=128),
    'smollm2': get_preset('smollm2-135m'),
    # TinyLlama-1.1B's shape with tied embeddings: 1.03 B params, 4.1 GB in fp32.
    '1b': DecoderConfig(vocab_size=32_000, num_layers=22, embed_dim=2048, num_heads=32,
                        num_kv_heads=4, head_dim=64, mlp_dim=5632, max_seq_len=2048),
}


def timed(fn):
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def memcpy_bandwidth(nbytes: int = 512 << 20) -> dict:
  """This machine's memory-copy bandwidth (GB/s, best of 5): into a buffer already touched
  (the physical limit), and into a freshly allocated one (page faults included)."""
  src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
  dst = np.empty_like(src)
  np.copyto(dst, src)
  touched = min(timed(lambda: np.copyto(dst, src))[0] for _ in range(5))
  fresh = min(timed(lambda: np.array(src, copy=True))[0] for _ in range(5))
  check = min(timed(lambda: delta_lib.checksum(src))[0] for _ in range(3))
  return {'memcpy_GBps': nbytes / touched / 1e9, 'memcpy_fresh_GBps': nbytes / fresh / 1e9,
          'checksum_GBps': nbytes / check / 1e9}


def host_params(size: str, dtype, changed: float = 0.0, seed: int = 0) -> dict:
  """Size ``size``'s params as host arrays of ``dtype``: SmolLM2's real weights, or random.
  With ``changed`` > 0: the next version, ``changed`` of the elements of every leaf moved by
  one unit in the last place (a sparse update, as a bf16 copy of an RL update is)."""
  if size == 'smollm2':
    module, _ = from_pretrained(smollm2_gguf_path())
    params = jax.tree.map(lambda x: np.asarray(x).astype(dtype), split_module(module)[1])
  else:
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: (rng.random(x.shape, np.float32) - 0.5).astype(dtype),
                          abstract_model(SIZES[size]).abstract_params())
  if changed:
    rng = np.random.default_rng(seed + 1)
    for leaf in jax.tree.leaves(params):
      flat = leaf.reshape(-1)
      idx = rng.choice(flat.size, max(1, int(changed * flat.size)), replace=False)
      bits = flat.view(np.dtype(f'u{flat.dtype.itemsize}'))
      bits[idx] += 1
  return params


def device_params(size: str, dtype, changed: float = 0.0, devices: int = 1):
  """``host_params`` as the trainer holds them: device arrays (copies), each leaf split over
  the first ``devices`` devices along its first axis they divide (else replicated)."""
  mesh = Mesh(np.asarray(jax.devices()[:devices]), ('fsdp',))

  def place(leaf):
    axis = next((i for i, d in enumerate(leaf.shape) if d % devices == 0), None)
    spec = P() if axis is None else P(*[None] * axis, 'fsdp')
    return jax.device_put(np.array(leaf, copy=True), NamedSharding(mesh, spec))
  return jax.block_until_ready(jax.tree.map(place, host_params(size, dtype, changed)))


def pull(fetch, version: int, base_version: int, base: list | None, paths: list[str]):
  """What ``Receiver.apply`` (``rlax_llm.paramserver.receiver``) does with a fetched update,
  without the engine: returns ``(leaves, update, {fetch_s, apply_s, verify_s})``."""
  fetch_s, update = timed(lambda: fetch(version, base_version))
  apply_s, leaves = timed(lambda: delta_lib.apply(base or [None] * update.num_leaves, update))
  verify_s, _ = timed(lambda: delta_lib.verify(leaves, update.checksums, paths, version))
  return leaves, update, {'fetch_s': fetch_s, 'apply_s': apply_s, 'verify_s': verify_s}


def local_path(size: str, dtype, changed: float, repeats: int) -> dict:
  """The local backend's path in this process: full and (bf16) delta updates."""
  params = device_params(size, dtype)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
  paths = list(leaf_specs(params))
  to_host_s, _ = timed(functools.partial(local_shards, params, to_host=True))
  server = ParameterServer(keep=1)
  full = []
  # Two untimed rounds first: from the third push on, the server writes into the buffers of
  # the version it dropped (as in a run, from its third update on).
  for version in range(2 + repeats):
    push_s, _ = timed(functools.partial(server.push, version, params))
    _, update, times = pull(server.update, version, -1, None, paths)
    if version >= 2:
      full.append({'push_s': push_s, **times, 'bytes': update.nbytes,
                   'total_s': push_s + sum(times.values())})
  update = None
  stored = jax.tree.leaves(server.get(1 + repeats).params)
  checksum_s = sum(timed(lambda x=x: delta_lib.checksum(x))[0] for x in stored)
  stored = server = None
  gc.collect()
  out = {'bytes': nbytes, 'full': _median(full), 'to_host_s': to_host_s,
         'checksum_s': checksum_s}
  if dtype == ml_dtypes.bfloat16:
    server = ParameterServer(keep=2)
    server.push(0, params)
    base, _, _ = pull(server.update, 0, -1, None, paths)
    new = device_params(size, dtype, changed)
    push_s, _ = timed(lambda: server.push(1, new))
    _, update, times = pull(server.update, 1, 0, base, paths)
    out['delta'] = {'push_s': push_s, **times, 'bytes': update.nbytes,
                    'changed_fraction': update.density, 'total_s': push_s + sum(times.values())}
  return out


def cast_costs(size: str, repeats: int) -> dict:
  """Seconds to make the bfloat16 inference copy of the float32 master weights once
  (best of ``repeats``): on the trainer's devices (``cast_params``, what the backends do before
  each push with ``model.inference_param_dtype='bfloat16'``) and on a worker's host (numpy,
  what a worker pulling the float32 version would do instead, per worker)."""
  params = device_params(size, np.float32)
  inference = with_param_dtype(abstract_model(SIZES[size]), jnp.bfloat16)
  host = [np.asarray(x) for x in jax.tree.leaves(params)]
  jax.block_until_ready(cast_params(params, inference))  # compiled once per leaf shape
  device_s = min(timed(lambda: jax.block_until_ready(cast_params(params, inference)))[0]
                 for _ in range(repeats))
  host_s = min(timed(lambda: [x.astype(ml_dtypes.bfloat16) for x in host])[0]
               for _ in range(repeats))
  return {'device_cast_s': device_s, 'host_cast_s': host_s,
          'float32_bytes': sum(x.nbytes for x in host)}


def _median(rows: list[dict]) -> dict:
  """Each figure's median over ``rows``, and the fastest ``total_s`` as ``best_total_s``."""
  out = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
  return {**out, 'best_total_s': min(r['total_s'] for r in rows),
          'runs': {key: [round(r[key], 4) for r in rows] for key in ('total_s', 'push_s')
                   if key in rows[0]}}


def _array_bytes(value) -> int:
  """Bytes of the numpy/JAX arrays in ``value`` (what would be weights)."""
  leaves = jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, (np.ndarray, jax.Array)))
  return sum(int(x.nbytes) for x in leaves if isinstance(x, (np.ndarray, jax.Array)))


class RayTrainer:
  """The trainer's end of the Ray path: params as device arrays in its own process, pushed
  as ``TrainerRole._publish`` does."""

  def __init__(self, servers, size, dtype_name, devices):
    self.servers, self.size, self.dtype = servers, size, np.dtype(dtype_name)
    self.devices = devices
    self.params = device_params(size, self.dtype, devices=devices)

  def next_version(self, changed):
    self.params = None
    gc.collect()
    self.params = device_params(self.size, self.dtype, changed, self.devices)

  def step(self):
    """New arrays, as after a train step (a jax.Array caches its host copy once made)."""
    self.params = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), self.params))

  def push(self, version, transport, mode='shards'):
    start = time.perf_counter()
    payload = local_shards(self.params if mode == 'shards' else
                           jax.tree.map(np.asarray, jax.device_get(self.params)), to_host=True)
    host_s = time.perf_counter() - start
    push_shards(self.servers[transport], version, payload)
    return {'to_host_s': host_s, 'push_s': time.perf_counter() - start}


class RayWorker:
  """The worker's end: pulls from the server actor and checks, as ``Receiver.pull``."""

  def __init__(self, servers, size):
    self.servers = servers
    self.paths = list(leaf_specs(abstract_model(SIZES[size]).abstract_params()))
    self.held = {}  # transport -> (version, leaves) pulled from its server

  def pull(self, version, transport):
    start = time.perf_counter()
    fetch = functools.partial(fetch_update, self.servers[transport])
    held_version, held = self.held.get(transport, (-1, None))
    leaves, update, times = pull(fetch, version, held_version, held, self.paths)
    self.held[transport] = (version, leaves)
    return {**times, 'pull_s': time.perf_counter() - start, 'bytes': update.nbytes,
            'changed_fraction': update.density}

  def forget(self, transport):
    self.held.pop(transport, None)


def ray_path(size: str, dtype, changed: float, repeats: int, devices: int,
             transports: list[str]) -> dict:
  """Trainer actor (its params split over ``devices`` CPU devices of its own) -> server
  actor (the backend's ``ServerRole``, one per transport of ``transports``) -> worker actor,
  timed from the driver, which only sends version numbers; its array bytes are counted.
  Returns each transport's figures; the transports and forms run interleaved."""
  import ray  # pylint: disable=import-outside-toplevel  # optional and heavy: Ray path only
  driver = {'sent': 0, 'received': 0, 'weight_bytes': 0}

  def call(method, *args):
    driver['sent'] += len(pickle.dumps(args))
    driver['weight_bytes'] += _array_bytes(args)
    out = ray.get(method.remote(*args))
    driver['received'] += len(pickle.dumps(out))
    driver['weight_bytes'] += _array_bytes(out)
    return out

  servers = {t: ray.remote(num_cpus=0, max_concurrency=4)(ServerRole).remote(2, t)
             for t in transports}
  flags = f'--xla_force_host_platform_device_count={devices}'
  trainer = ray.remote(num_cpus=1)(RayTrainer).options(
      runtime_env={'env_vars': {'PYTHONPATH': str(ROOT), 'JAX_PLATFORMS': 'cpu',
                                'XLA_FLAGS': flags}}).remote(
          servers, size, np.dtype(dtype).name, devices)
  worker = ray.remote(num_cpus=1)(RayWorker).remote(servers, size)
  try:
    version = 0
    # Warm-up: the actors start, the paths and the object store run; keep + 1 versions, so
    # that the servers' rings hold all their slots (made, pages touched, mapped).
    for _ in range(3):
      for transport in transports:
        call(trainer.step)
        call(trainer.push, version, transport)
        call(worker.pull, version, transport)
      version += 1
    rows = {(t, mode): [] for t in transports for mode in ('shards', 'host_params')}
    for repeat in range(repeats):
      # Interleaved in ABBA order: the object store's memory alternates between fresh pages
      # and reused ones from put to put (0.5 vs 0.1 s for 538 MB), whatever is put.
      for transport, mode in list(rows)[::1 if repeat % 2 == 0 else -1]:
        call(trainer.step)  # not timed: the sync starts from the trainer's new arrays
        call(worker.forget, transport)
        start = time.perf_counter()
        pushed = call(trainer.push, version, transport, mode)
        pulled = call(worker.pull, version, transport)
        rows[transport, mode].append({
            'total_s': time.perf_counter() - start, 'push_s': pushed['push_s'],
            'to_host_s': pushed['to_host_s'], 'pull_s': pulled['pull_s'],
            'verify_s': pulled['verify_s'], 'bytes': pulled['bytes']})
        version += 1
    out = {t: {'full': _median(rows[t, 'shards']),
               'full_host_params': _median(rows[t, 'host_params'])} for t in transports}
    if dtype == ml_dtypes.bfloat16:
      call(trainer.next_version, changed)
      for transport in transports:
        call(trainer.step)
        start = time.perf_counter()
        pushed = call(trainer.push, version, transport)
        pulled = call(worker.pull, version, transport)  # from a version the worker holds
        out[transport]['delta'] = {
            'total_s': time.perf_counter() - start, 'push_s': pushed['push_s'],
            'pull_s': pulled['pull_s'], 'bytes': pulled['bytes'],
            'changed_fraction': pulled['changed_fraction']}
    for row in out.values():
      row['driver'] = {'sent_bytes': driver['sent'], 'received_bytes': driver['received'],
                       'driver_weight_bytes': driver['weight_bytes']}
    return out
  finally:
    for server in servers.values():
      ray.get(server.close.remote())
    for actor in (trainer, worker, *servers.values()):
      ray.kill(actor)


def transfers(sizes: list[str], paths: list[str], dtypes: list[str], changed: float,
              repeats: int, memcpy_bytes: int, trainer_devices: int,
              transports: list[str]) -> dict:
  """Every (size, dtype, path)'s figures, with GB/s, and a full fp32 sync's bandwidth over
  the memory-copy bandwidth (the higher of the measurements before and after)."""
  bandwidth = memcpy_bandwidth(memcpy_bytes)
  print(json.dumps({'memory': bandwidth}), flush=True)
  out = {'memory': bandwidth}
  if 'ray' in paths:
    import ray  # pylint: disable=import-outside-toplevel  # optional and heavy: Ray path only
    env = {'PYTHONPATH': str(ROOT), 'JAX_PLATFORMS': 'cpu'}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _node_ip_address='127.0.0.1', runtime_env={'env_vars': env})
  try:
    _transfers(out, sizes, paths, dtypes, changed, repeats, trainer_devices, transports)
  finally:
    if 'ray' in paths:
      ray.shutdown()
  out['memory_end'] = memcpy_bandwidth(memcpy_bytes)
  limit = max(out['memory']['memcpy_GBps'], out['memory_end']['memcpy_GBps'])
  for size in sizes:
    for key, row in out[size].items():
      if key.endswith('/float32'):
        row['full_fp32_vs_memcpy'] = row['full']['GBps'] / limit
  return out


def _transfers(out: dict, sizes: list[str], paths: list[str], dtypes: list[str],
               changed: float, repeats: int, trainer_devices: int,
               transports: list[str]) -> None:
  for size in sizes:
    n = int(sum(np.prod(x.shape) for x in jax.tree.leaves(
        abstract_model(SIZES[size]).abstract_params())))
    out[size] = {'params': n}
    for dtype_name in dtypes:
      dtype = np.dtype(dtype_name) if dtype_name != 'bfloat16' else ml_dtypes.bfloat16
      for path in paths:
        runs = 1 if size == '1b' else repeats
        if path == 'local':
          rows = {f'local/{dtype_name}': local_path(size, dtype, changed, runs)}
        else:
          rows = {f'ray/{dtype_name}' if t == 'auto' else f'ray[{t}]/{dtype_name}': row
                  for t, row in ray_path(size, dtype, changed, runs, trainer_devices,
                                         transports).items()}
        for key, row in rows.items():
          for form in ('full', 'full_host_params', 'delta'):
            if form in row:
              row[form]['GBps'] = row[form]['bytes'] / row[form]['total_s'] / 1e9
              row[form]['model_GBps'] = (n * np.dtype(dtype).itemsize / row[form]['total_s']
                                         / 1e9)
          out[size][key] = row
          print(json.dumps({size: {key: row}}), flush=True)
        gc.collect()
    if 'local' in paths and {'float32', 'bfloat16'} <= set(dtypes):
      out[size]['cast_to_bfloat16'] = cast_costs(size, 1 if size == '1b' else repeats)
      print(json.dumps({size: {'cast_to_bfloat16': out[size]['cast_to_bfloat16']}}), flush=True)
      gc.collect()


def measure(base, new) -> dict:
  encode_s, delta = timed(lambda: delta_lib.encode(base, new, base_version=0, version=1))
  apply_s, rebuilt = timed(lambda: delta_lib.apply(base, delta))
  exact = all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(rebuilt, new))
  full_s, _ = timed(lambda: pickle.loads(pickle.dumps(new, protocol=5)))
  delta_s, _ = timed(lambda: pickle.loads(pickle.dumps(delta, protocol=5)))
  full_bytes = sum(x.nbytes for x in new)
  return {'full_bytes': full_bytes, 'delta_bytes': delta.nbytes,
          'bytes_ratio': delta.nbytes / full_bytes, 'changed_fraction': delta.density,
          'encode_s': encode_s, 'apply_s': apply_s, 'bit_exact': exact,
          'move_full_s': full_s, 'move_delta_s': delta_s}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--sizes', default='smollm2', help=f'of {sorted(SIZES)}; "" to skip')
  parser.add_argument('--paths', default='local,ray')
  parser.add_argument('--dtypes', default='float32,bfloat16')
  parser.add_argument('--changed', type=float, default=0.024,
                      help='fraction of bf16 elements a delta update changes')
  parser.add_argument('--repeats', type=int, default=4)
  parser.add_argument('--transports', default='auto,object_store',
                      help='Ray transports (paramserver.transport) compared, interleaved')
  parser.add_argument('--trainer_devices', type=int, default=4,
                      help='CPU devices the Ray trainer actor splits its params over')
  parser.add_argument('--memcpy_mb', type=int, default=512, help='buffer of the memcpy figure')
  parser.add_argument('--lrs', default='1e-6,1e-5', help='GRPO delta study; "" to skip')
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--prompts', type=int, default=4)
  parser.add_argument('--samples', type=int, default=4)
  args = parser.parse_args()
  split = lambda text: [x for x in text.split(',') if x]
  report = {'benchmark': 'weight_sync'}
  if split(args.sizes):
    report['transfers'] = transfers(split(args.sizes), split(args.paths), split(args.dtypes),
                                    args.changed, args.repeats, args.memcpy_mb << 20,
                                    args.trainer_devices, split(args.transports))
  if split(args.lrs):
    report.update(grpo_deltas(args))
  print(json.dumps(report, indent=2))


def grpo_deltas(args) -> dict:
  """Sparse deltas of real GRPO updates of SmolLM2 (fp32 and a bf16 cast), per lr."""
  module, tokenizer = from_pretrained(smollm2_gguf_path())
  model, params0 = split_module(module)
  mesh = make_mesh({'data': 1}, jax.devices()[:1])
  spec = SamplingSpec(1.0)
  task = ArithmeticTask(format='chat', answer_format='last_integer', num_eval=4)
  worker = InferenceWorker(model, tokenizer, mesh, max_prompt_len=64, max_new_tokens=24,
                           slots=args.prompts * args.samples)
  worker.load(0, params0)
  rollouts = worker.generate(
      [GenerationRequest(task.train_prompt(i), args.samples, spec, 24)
       for i in range(args.prompts)], jax.random.key(0))
  rewards = np.asarray([task.score(task.train_prompt(g), c)
                        for g, c in zip(rollouts.group_ids, rollouts.completions)], np.float32)
  rewards = rewards + 0.1 * np.random.RandomState(0).randn(len(rewards)).astype(np.float32)
  batch = make_train_batch(rollouts, np.asarray(group_advantages(rewards, rollouts.group_ids)))

  results = {}
  for lr in [float(x) for x in args.lrs.split(',') if x]:
    trainer = Trainer(model, params0, make_optimizer(lr),
                      functools.partial(rl_objective, Policy(model, spec), LossConfig()), mesh)
    previous = [np.asarray(x) for x in jax.tree.leaves(trainer.host_params())]
    updates = []
    for _ in range(args.steps):
      trainer.step(batch)
      current = [np.asarray(x) for x in jax.tree.leaves(trainer.host_params())]
      updates.append({
          'float32': measure(previous, current),
          'bfloat16': measure([x.astype(ml_dtypes.bfloat16) for x in previous],
                              [x.astype(ml_dtypes.bfloat16) for x in current]),
      })
      previous = current
    summary = {}
    for rep in ('float32', 'bfloat16'):
      rows = [u[rep] for u in updates]
      summary[rep] = {key: statistics.median(r[key] for r in rows)
                      for key in rows[0] if key != 'bit_exact'}
      summary[rep]['bit_exact'] = all(r['bit_exact'] for r in rows)
    results[f'{lr:g}'] = {'updates': updates, 'median': summary}
    print(json.dumps({lr: summary}), flush=True)
  return {'model': 'SmolLM2-135M-Instruct', 'steps': args.steps,
          'batch_rows': len(rollouts), 'learning_rates': results}


if __name__ == '__main__':
  main()
