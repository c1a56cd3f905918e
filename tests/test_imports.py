"""The package's import structure: no cycles (not even behind a function-level import), and
every module importable first in a fresh interpreter (that the config boundary loads no jax is
tests/test_cli.py's).

A cycle between modules works only in the import orders that happen to be tried, and a
function-level import that closes one hides it from every import-time check: so the static
graph here counts imports inside functions too. Importing ``a.b.c`` runs ``a/b/__init__.py``
first, so an import of a submodule from outside its package is also an edge to the package.
And no public function or class of the package is code that only tests use.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

from notebook_code import notebook_code  # tests/notebook_code.py

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'rlax_llm'


def _modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of the package."""
  found = {}
  for path in sorted(PACKAGE.rglob('*.py')):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix('').parts)
    if parts[-1] == '__init__':
      parts.pop()
    found['.'.join(parts)] = path
  return found


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, dict[str, str]]:
  """Module -> {imported module: 'top' | 'function, line N'}: every import of an ``rlax_llm``
  module anywhere in its source, plus the ``__init__`` of each package it enters from outside.
  """

  def target(name: str) -> str | None:
    while name and name not in modules:
      name = name.rpartition('.')[0]
    return name or None

  graph: dict[str, dict[str, str]] = {}
  for module, path in modules.items():
    tree = ast.parse(path.read_text(encoding='utf-8'))
    top = {id(node) for node in tree.body}
    edges = graph.setdefault(module, {})
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        names = [f'{node.module}.{alias.name}' if f'{node.module}.{alias.name}' in modules
                 else node.module for alias in node.names]
      else:
        continue
      where = 'top' if id(node) in top else f'function, line {node.lineno}'
      for name in names:
        imported = target(name) if name.startswith('rlax_llm') else None
        if imported is None or imported == module:
          continue
        edges.setdefault(imported, where)
        parts = imported.split('.')
        for k in range(2, len(parts)):
          package = '.'.join(parts[:k])
          if package in modules and not (module + '.').startswith(package + '.'):
            edges.setdefault(package, f'{where} (runs {package}/__init__.py)')
  return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), sorted."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  found: list[list[str]] = []

  def visit(node: str) -> None:
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for nxt in graph[node]:
      if nxt not in index:
        visit(nxt)
        low[node] = min(low[node], low[nxt])
      elif nxt in on_stack:
        low[node] = min(low[node], index[nxt])
    if low[node] == index[node]:
      component = []
      while True:
        top = stack.pop()
        on_stack.discard(top)
        component.append(top)
        if top == node:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return sorted(found)


def test_the_package_has_no_import_cycle():
  graph = import_graph(_modules())
  found = cycles(graph)
  described = [
      '; '.join(f'{a} -> {b} ({graph[a][b]})' for a in component for b in sorted(graph[a])
                if b in component)
      for component in found]
  assert not found, 'import cycles:\n' + '\n'.join(described)


def test_the_cycle_check_sees_function_level_and_package_init_imports(tmp_path):
  """The check can fail: a cycle closed inside a function, and one through a package's
  ``__init__``, are both found."""
  root = tmp_path / 'rlax_llm'
  (root / 'tasks').mkdir(parents=True)
  (root / '__init__.py').write_text('')
  (root / 'controller.py').write_text('from rlax_llm import config\n')
  (root / 'config.py').write_text('def f():\n  from rlax_llm.controller import g\n')
  (root / 'tasks' / '__init__.py').write_text('from rlax_llm.tasks import math\n')
  (root / 'tasks' / 'math.py').write_text('from rlax_llm import verifiers\n')
  (root / 'tasks' / 'base.py').write_text('')
  (root / 'verifiers.py').write_text('from rlax_llm.tasks.base import x\n')
  modules = {}
  for path in sorted(root.rglob('*.py')):
    parts = list(path.relative_to(tmp_path).with_suffix('').parts)
    if parts[-1] == '__init__':
      parts.pop()
    modules['.'.join(parts)] = path
  graph = import_graph(modules)
  assert graph['rlax_llm.config']['rlax_llm.controller'] == 'function, line 2'
  assert cycles(graph) == [['rlax_llm.config', 'rlax_llm.controller'],
                           ['rlax_llm.tasks', 'rlax_llm.tasks.math', 'rlax_llm.verifiers']]


_IMPORT_EACH_FIRST = r'''
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
  for loaded in [m for m in sys.modules if m == 'rlax_llm' or m.startswith('rlax_llm.')]:
    del sys.modules[loaded]
  try:
    importlib.import_module(name)
  except Exception:
    failed.append(name + ':\n' + traceback.format_exc(limit=3))
print('\n'.join(failed))
'''


def test_every_module_imports_first_in_a_fresh_package():
  """Each module, imported before any other module of the package (third-party modules stay
  loaded between them, which does not change our import order), imports without error."""
  result = subprocess.run([sys.executable, '-c', _IMPORT_EACH_FIRST, *_modules()],
                          capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert not result.stdout.strip(), result.stdout[-5000:]


# The package's layers, lowest first: a module imports only from its own layer or lower ones
# (``test_no_module_imports_from_a_higher_layer``). A module belongs to the layer of the
# longest pattern naming it: ``'a.b'`` names ``a.b`` and everything under it, ``'a.b.'`` only
# what is under it (a package whose ``__init__`` belongs lower than its modules).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # Text, errors, files and the pure schedule: no model, no config.
    ('foundation', ('rlax_llm', 'rlax_llm.errors', 'rlax_llm.console', 'rlax_llm.storage',
                    'rlax_llm.workdir', 'rlax_llm.workdir_claim', 'rlax_llm.plugins',
                    'rlax_llm.sandbox',
                    'rlax_llm._sandbox_child', 'rlax_llm.tokenization', 'rlax_llm.sharding',
                    'rlax_llm.sampling_spec', 'rlax_llm.loss_spec', 'rlax_llm.model_spec',
                    'rlax_llm.transport_spec', 'rlax_llm.schedule',
                    'rlax_llm.serve')),  # the serve package's __init__ imports nothing
    # What a run is about: prompts, scores, environments and their conversations' ids, the
    # agent harnesses a config may name; text only.
    ('tasks and environments', ('rlax_llm.tasks', 'rlax_llm.verifiers', 'rlax_llm.rewards',
                                'rlax_llm.data_types', 'rlax_llm.data', 'rlax_llm.evaluation',
                                'rlax_llm.envs', 'rlax_llm.serve.harness')),
    # Config files, overrides and validation (config.py, a leaf: it reads the typed values'
    # JAX-free specs, loss_spec, model_spec, sampling_spec, schedule, in the foundation, and
    # the task and environment registries, and imports no JAX); a run's saved config; the
    # check of its hub ids (hub_check). Nothing below imports a config.
    ('config', ('rlax_llm.cli', 'rlax_llm.config', 'rlax_llm.run_config', 'rlax_llm.configs',
                'rlax_llm.distributed', 'rlax_llm.hub_check')),
    # The decoder, its files and its numerics (models.numerics: batch-invariant reductions
    # and products on jax alone, the lower layer of the logits math in policy.py).
    ('models', ('rlax_llm.models',)),
    ('policy and losses', ('rlax_llm.policy', 'rlax_llm.losses')),
    # The trainer (and what its process writes) never reaches into the inference side: the
    # backends connect it to the parameter server, whose workers' engine pulls from it.
    ('trainer', ('rlax_llm.trainer', 'rlax_llm.checkpoint', 'rlax_llm.warmup_cache',
                 'rlax_llm.metrics', 'rlax_llm.tensorboard_writer')),
    ('parameter server', ('rlax_llm.paramserver',)),
    ('rollout', ('rlax_llm.rollout',)),
    ('endpoint', ('rlax_llm.serve.',)),
    ('controller and role builders', ('rlax_llm.controller', 'rlax_llm.roles',
                                      'rlax_llm.memory_fit')),
    # Backends place the roles the builders make and run the controller's loop over them.
    ('backends', ('rlax_llm.backends',)),
    ('command lines', ('rlax_llm.launch', 'rlax_llm.launch_help', 'rlax_llm.evaluate',
                       'rlax_llm.serve.__main__', 'rlax_llm.export')),
)


def layer_of(module: str, layers=LAYERS) -> int | None:
  """The index in ``layers`` of the longest pattern naming ``module``, or None."""
  best, found = -1, None
  for index, (_, patterns) in enumerate(layers):
    for pattern in patterns:
      named = (module.startswith(pattern) if pattern.endswith('.')
               else module == pattern or module.startswith(pattern + '.'))
      if named and len(pattern) > best:
        best, found = len(pattern), index
  return found


def layer_violations(graph: dict[str, dict[str, str]], layers=LAYERS) -> list[str]:
  """Every import of ``graph`` from a higher layer, and every module in no layer, described."""
  found = [f'{module} is in no layer; add it to LAYERS' for module in sorted(graph)
           if layer_of(module, layers) is None]
  for module in sorted(graph):
    here = layer_of(module, layers)
    for imported, where in sorted(graph[module].items()):
      there = layer_of(imported, layers)
      if here is not None and there is not None and there > here:
        found.append(f'{module} ({layers[here][0]}) imports {imported} ({layers[there][0]}; '
                     f'{where})')
  return found


def test_no_module_imports_from_a_higher_layer():
  """Function-level imports and package ``__init__`` edges included (``import_graph``)."""
  violations = layer_violations(import_graph(_modules()))
  assert not violations, 'imports from a higher layer:\n' + '\n'.join(violations)


def test_the_layer_check_sees_an_upward_import_and_an_unplaced_module():
  layers = (('low', ('rlax_llm', 'rlax_llm.serve')), ('high', ('rlax_llm.serve.',)))
  graph = {'rlax_llm': {}, 'rlax_llm.serve': {},
           'rlax_llm.tokenization': {'rlax_llm.serve.api': 'function, line 3'},
           'rlax_llm.serve.api': {'rlax_llm.serve': 'top'}}
  assert layer_of('rlax_llm.serve', layers) == 0
  assert layer_of('rlax_llm.serve.api', layers) == 1
  assert layer_violations(graph, layers) == [
      'rlax_llm.tokenization (low) imports rlax_llm.serve.api (high; function, line 3)']
  assert layer_violations({'other': {}}, layers) == ['other is in no layer; add it to LAYERS']


# --- no library function that only tests call ---


def _used_names(source: str) -> set[str]:
  """The names ``source`` uses: names and attributes it reads or calls, and the words of its
  string constants (``'module.path:function'`` registries, ``getattr`` by name), docstrings
  and ``__all__`` left out."""
  tree = ast.parse(source)
  skipped = set()
  for node in ast.walk(tree):
    body = getattr(node, 'body', None)
    if (isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
      skipped.add(id(body[0].value))
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == '__all__'
                                            for t in node.targets):
      skipped |= {id(n) for n in ast.walk(node.value)}
  used = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Name):
      used.add(node.id)
    elif isinstance(node, ast.Attribute):
      used.add(node.attr)
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in skipped):
      used |= set(re.findall(r'\w+', node.value))
  return used


def _sources(root: pathlib.Path, pattern: str) -> list[pathlib.Path]:
  """The files under ``root`` matching ``pattern``, outside hidden folders: a virtualenv
  there (benchmarks/peers/.venv-trl from setup.sh) holds other projects' code, some of it in
  syntax newer than this Python."""
  return [path for path in sorted(root.rglob(pattern))
          if not any(part.startswith('.') for part in path.relative_to(root).parts[:-1])]


def unused_definitions(package: pathlib.Path, users: list[pathlib.Path],
                       docs: list[pathlib.Path]) -> list[str]:
  """``path:line name`` of each public top-level function and class of ``package`` that no
  module or notebook under ``users`` (the package included) uses and no page of ``docs``
  names: code only tests call (``tests/`` is never among ``users``)."""
  used: set[str] = set()
  for root in users:
    for path in _sources(root, '*.py'):
      used |= _used_names(path.read_text(encoding='utf-8'))
    for path in _sources(root, '*.ipynb'):
      used |= _used_names(notebook_code(path))
  documented = set(re.findall(r'\w+', ' '.join(p.read_text(encoding='utf-8') for p in docs)))
  found = []
  for path in sorted(package.rglob('*.py')):
    for node in ast.parse(path.read_text(encoding='utf-8')).body:
      if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
          and not node.name.startswith('_') and node.name not in used | documented):
        found.append(f'{path.relative_to(package.parent)}:{node.lineno} {node.name}')
  return found


def test_no_library_function_or_class_is_used_only_by_tests():
  """Public API a page of docs/ (or the README) names counts as used."""
  root = PACKAGE.parent
  users = [root / name for name in ('rlax_llm', 'launch', 'benchmarks', 'colabs', 'configs',
                                     'scripts')]
  docs = [*sorted((root / 'docs').glob('*.md')), root / 'README.md']
  unused = unused_definitions(PACKAGE, users, docs)
  assert not unused, ('only tests call these (delete them and their tests, or name the public '
                      'API in docs/):\n' + '\n'.join(unused))


def test_the_unused_check_finds_code_only_tests_call(tmp_path):
  package = tmp_path / 'rlax_llm'
  package.mkdir()
  (package / 'lib.py').write_text(
      '"""Mentions dead_in_docstring."""\n__all__ = ["exported_only"]\n'
      'def called(): pass\ndef registered(): pass\ndef documented(): pass\n'
      'def exported_only(): pass\ndef dead_in_docstring(): pass\nclass Dead: pass\n'
      'def _private(): pass\n')
  (package / 'user.py').write_text("from rlax_llm import lib\nlib.called()\n"
                                   "FN = 'rlax_llm.lib:registered'\n")
  (tmp_path / 'tests').mkdir()
  (tmp_path / 'tests' / 'test_lib.py').write_text('lib.exported_only(); lib.Dead()\n')
  (tmp_path / 'api.md').write_text('`lib.documented()` is public.\n')
  assert unused_definitions(package, [package], [tmp_path / 'api.md']) == [
      'rlax_llm/lib.py:6 exported_only', 'rlax_llm/lib.py:7 dead_in_docstring',
      'rlax_llm/lib.py:8 Dead']
