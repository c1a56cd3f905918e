"""Docs that must follow the code: every config key is in docs/config.md, the README's
algorithms table is the loss table, the README's results are RESULTS.md's headline, links
resolve, every module, file, function, method and config key docs/*.md names exists, and
the notebooks' code (colabs/*.ipynb) imports and uses only what exists."""

import ast
import importlib.util
import json
import pathlib
import re
import shlex
import sys

import ml_collections
import pytest

from rlax_llm.cli import load_config, load_config_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the recipes' tooling lives in the checkout, not the package

# pylint: disable=wrong-import-position
from launch.recipes import cli as recipes_cli
from launch.recipes.checks import check_local, memory_check, run_model
from launch.recipes.slices import get_slice
from notebook_code import notebook_code  # tests/notebook_code.py


def _leaves(config: ml_collections.ConfigDict, prefix: str = '') -> list[str]:
  out = []
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict) and len(value):
      out += _leaves(value, f'{prefix}{key}.')
    else:
      out.append(prefix + key)
  return out


@pytest.mark.parametrize('config', ['default.py', 'smollm2.py', 'math.py', 'python.py',
                                    'agent.py'])
def test_every_config_key_is_in_the_config_reference(config):
  listed = set(re.findall(r'`([a-z_][a-z0-9_.]*)`', (ROOT / 'docs' / 'config.md').read_text()))
  missing = [k for k in _leaves(load_config_file(str(ROOT / 'configs' / config)))
             if k not in listed]
  assert not missing, f'add these keys of configs/{config} to docs/config.md: {missing}'


def algorithms_table() -> str:
  """README's algorithms table, rendered from rlax_llm.losses.LOSSES (the one definition)."""
  from rlax_llm.losses import LOSSES  # pylint: disable=import-outside-toplevel
  rows = ['| loss | advantages | ratio | objective | aggregation | clip (low, high) | reference |',
          '| --- | --- | --- | --- | --- | --- | --- |']
  for name, spec in LOSSES.items():
    clip = (f'{spec.eps_low:g}, {spec.eps_high:g}' if spec.objective in ('ppo_clip', 'cispo')
            else '-')
    rows.append(f'| `{name}` | {spec.advantage_estimator} | {spec.ratio} | {spec.objective} | '
                f'{spec.aggregation} | {clip} | {spec.reference} |')
  return '\n'.join(rows)


def test_readme_algorithms_table_matches_the_losses():
  assert algorithms_table() in (ROOT / 'README.md').read_text(), (
      'README.md\'s algorithms table differs from rlax_llm.losses.LOSSES; paste:\n'
      + algorithms_table())


@pytest.mark.parametrize('doc', ['README.md', 'docs/config.md', 'docs/architecture.md',
                                 'docs/checkpoints.md', 'docs/storage.md',
                                 'docs/tasks.md', 'docs/custom_tasks.md',
                                 'docs/own_model_and_data.md', 'docs/models.md',
                                 'docs/serving.md', 'docs/rollout.md',
                                 'docs/environments.md',
                                 'benchmarks/RESULTS.md', 'benchmarks/LAB_NOTES.md',
                                 'launch/README.md',
                                 'launch/tpu_vm/README.md', 'launch/multihost/README.md',
                                 'launch/ray/README.md', 'launch/gke/README.md'])
def test_relative_links_resolve(doc):
  path = ROOT / doc
  for target in re.findall(r'\]\(([^)#]+)', path.read_text()):
    if not target.startswith('http'):
      assert (path.parent / target).exists(), f'{doc} links to {target}, which does not exist'


def test_the_longest_files_scheduled_first_exist():
  """tests/conftest.py's LONGEST_FILES names test files: a renamed one would silently lose
  its place at the front of the test run."""
  # By path: `import conftest` is whichever conftest.py pytest put first on sys.path
  # (tests/backends/ has its own).
  spec = importlib.util.spec_from_file_location('tests_conftest', ROOT / 'tests/conftest.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  names = module.LONGEST_FILES
  assert len(set(names)) == len(names), names
  missing = [name for name in names if not (ROOT / name).is_file()]
  assert not missing, f'LONGEST_FILES names files that do not exist: {missing}'


def _section(path: pathlib.Path, heading: str) -> str:
  """The text under the markdown heading ``heading`` (e.g. '## Results'), up to the next
  heading of the same or a higher level."""
  text = path.read_text()
  level = heading.split()[0]
  match = re.search(rf'^{re.escape(heading)}\n(.*?)(?=^#{{1,{len(level)}}} |\Z)', text,
                    re.MULTILINE | re.DOTALL)
  assert match, f'{path.name} has no {heading!r} section'
  return match.group(1)


def _first_table(text: str) -> list[list[str]]:
  """The rows (cells stripped) of the first markdown table in ``text``, header and
  separator left out."""
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith('|'))
  rows = []
  for line in lines[start + 2:]:
    if not line.startswith('|'):
      break
    rows.append([cell.strip() for cell in line.strip().strip('|').split(' | ')])
  return rows


def headline() -> dict[str, list[str]]:
  """benchmarks/RESULTS.md's headline table: figure -> [value, goal, command, date, machine]."""
  rows = _first_table(_section(ROOT / 'benchmarks' / 'RESULTS.md', '## Headline'))
  assert all(len(row) == 6 for row in rows), [row for row in rows if len(row) != 6]
  figures = [row[0] for row in rows]
  assert len(set(figures)) == len(figures), 'a figure appears twice in the headline table'
  return {row[0]: row[1:] for row in rows}


def test_readme_results_are_rows_of_the_headline_table_of_results_md():
  """README's Results is a short table: every figure is in RESULTS.md's headline table with
  the same value, goal and command, and there are about ten of them."""
  rows = _first_table(_section(ROOT / 'README.md', '## Results'))
  assert all(len(row) == 4 for row in rows), [row for row in rows if len(row) != 4]
  assert 5 <= len(rows) <= 12, f'README Results has {len(rows)} figures; keep about ten'
  readme = {row[0]: row[1:] for row in rows}
  assert len(readme) == len(rows), 'a figure appears twice in README Results'
  results = headline()
  only_readme = sorted(set(readme) - set(results))
  assert not only_readme, f'README Results figures missing from RESULTS.md: {only_readme}'
  differ = {f: (readme[f], results[f][:3]) for f in readme if readme[f] != results[f][:3]}
  assert not differ, f'value, goal or command differ (README, RESULTS.md): {differ}'


def test_every_headline_goal_is_judged():
  """A figure with a goal says whether it was met, as the goal was set: '(met', '(missed'
  (or, for a figure that is not a measurement, '(not judged'); no goal is left unjudged."""
  for figure, (_, goal, _, _, _) in headline().items():
    if goal.startswith('-'):
      continue
    assert re.search(r'\((met|missed|not judged)\b', goal), (figure, goal)


def test_every_headline_figure_names_a_command_and_when_and_where_it_was_measured():
  for figure, (value, _, command, date, machine) in headline().items():
    assert value and machine, figure
    assert re.fullmatch(r'\d{4}-\d{2}-\d{2}', date), (figure, date)
    assert command.startswith('`') and command.endswith('`'), (figure, command)
    words = command.strip('`').split()
    if words[0].startswith('benchmarks/'):
      assert (ROOT / words[0]).is_file(), f'{figure}: {words[0]} does not exist'
    else:
      assert words[:2] in (['bash', 'scripts/run.sh'], ['bash', 'scripts/test.sh'],
                           ['python', '-m']), (figure, command)


def test_readme_opens_with_what_it_is_then_the_two_commands():
  text = (ROOT / 'README.md').read_text()
  before, block = re.match(r'(.*?)```bash\n(.*?)```', text, re.DOTALL).groups()
  statement = [line for line in before.splitlines()[1:] if line.strip()]
  assert before.startswith('# rlax_llm\n') and 0 < len(statement) <= 5, statement
  commands = [line.split('#')[0].strip() for line in block.splitlines()]
  assert commands == ['bash scripts/run.sh', 'bash scripts/test.sh'], commands


def test_readme_keeps_to_this_repository():
  text = (ROOT / 'README.md').read_text()
  assert '../shared' not in text and '/work/' not in text


def test_weight_transfer_docs_name_the_gather_and_the_per_shard_push():
  """The docs that describe the weight transfer name the multi-host local backend's gather
  (`host_params()`) and the Ray trainer across hosts that pushes per shard
  (`ray.trainer_processes`), and no longer call that push planned."""
  for doc in ('README.md', 'docs/architecture.md'):
    text = (ROOT / doc).read_text()
    assert 'host_params()' in text and 'trainer_processes' in text, doc
    assert 'a Ray trainer spanning hosts' not in text, doc


def _bash_commands(doc: pathlib.Path) -> list[list[str]]:
  """The commands of ``doc``'s bash blocks as argument lists (continuation lines joined)."""
  blocks = re.findall(r'```bash\n(.*?)```', doc.read_text(), re.DOTALL)
  return [shlex.split(line) for block in blocks for line in block.replace('\\\n', ' ').splitlines()
          if line.strip() and not line.startswith('#')]


def test_own_model_and_data_commands_load_and_quote_the_printed_plan():
  """docs/own_model_and_data.md: its launch and recipe commands load (the config, every
  --config.KEY=VALUE key and type, the recipe's options), and the memory plan it quotes is
  the one the dry run prints for its command. (That the commands validate against the hub
  dataset was checked offline against a stand-in cache, as tests/hub_cache.py lays it out.)"""
  doc = ROOT / 'docs' / 'own_model_and_data.md'
  commands = [c for c in _bash_commands(doc) if c[:2] == ['python', '-m']]
  compiles = [c for c in commands if c[2:4] == ['launch.recipes', 'compile']]
  for command in compiles:  # "Before you book a TPU": the options and the config load
    opts, rest = recipes_cli.build_parser().parse_known_args(command[3:])
    assert opts.recipe == 'compile' and not rest, command
    load_config([f'--config={opts.config}'])
  commands = [c for c in commands if c not in compiles]
  assert len(compiles) == 2
  assert [c[2] for c in commands] == ['rlax_llm.launch', 'launch.recipes'], commands
  launch, recipe = commands
  config = load_config([a for a in launch[3:] if a.startswith('--config')])
  assert (config.model.path, config.task.path) == ('Qwen/Qwen2.5-0.5B-Instruct',
                                                   'hf://datasets/HuggingFaceH4/MATH-500')
  assert set(launch[3:]) - {a for a in launch if a.startswith('--config')} == {
      '--workdir=runs/own-smoke', '--print_config'}
  opts, rest = recipes_cli.build_parser().parse_known_args(recipe[3:])
  assert (opts.recipe, opts.dry_run, opts.workdir) == ('tpu-vm', True,
                                                       'gs://BUCKET/runs/math500-qwen')
  config = load_config([f'--config={opts.config}', *recipes_cli._split_overrides(rest)])
  slice_ = get_slice(opts.tpu_type)
  plan = memory_check(config, check_local(config, slice_, opts.recipe), slice_.hbm_gib,
                      slice_.hbm_gib, shared=True)
  assert f'# checked: {plan[-1]}\n' in doc.read_text(), plan[-1]


def test_own_model_and_data_quotes_the_cpu_runs_memory_plan():
  """docs/own_model_and_data.md's CPU run: the memory it says the run wants, with remat and
  chunked log-probs and without them, is the memory plan's for its command (one device,
  the roles sharing it), in whole GiB."""
  from rlax_llm import memory_fit  # pylint: disable=import-outside-toplevel
  doc = ROOT / 'docs' / 'own_model_and_data.md'
  launch = next(c for c in _bash_commands(doc) if c[:3] == ['python', '-m', 'rlax_llm.launch'])
  overrides = [a for a in launch[3:] if a.startswith('--config')]
  quoted = re.search(r'wants\s+about (\d+) GiB .*? without the two, about\s+(\d+) GiB',
                     doc.read_text(), re.DOTALL)
  assert quoted, 'own_model_and_data.md no longer quotes the CPU run\'s memory'
  one = {'data': 1, 'fsdp': 1, 'tensor': 1}
  planned = []
  for without in ([], ['--config.model.remat=none', '--config.rl.logprob_chunk=0']):
    config = load_config([*overrides, '--config.model.name=qwen2.5-0.5b', *without])
    plan = memory_fit.run_memory_plan(run_model(config), config, one, one, shared=True)
    planned.append(round((plan.trainer_bytes + plan.inference_bytes) / 2**30))
  assert [int(g) for g in quoted.groups()] == planned, planned


def resumable_keys() -> tuple[list[str], list[str]]:
  """``run_config.RESUMABLE_CHANGES`` as docs/checkpoints.md lists them (the list the resume's
  refusal prints): the sentence naming the keys of the schema, and the removed keys (absent
  from the packaged default config, kept so that old runs resume), named without backticks
  (the docs' stale-name check would flag them)."""
  from rlax_llm.run_config import RESUMABLE_CHANGES  # pylint: disable=import-outside-toplevel
  schema = _leaves(load_config_file(str(ROOT / 'configs' / 'default.py')))
  live = [k for k in RESUMABLE_CHANGES
          if any(s == k.rstrip('.') or s.startswith(k) for s in schema)]
  keys = [f'`{k}*`' if k.endswith('.') else f'`{k}`' for k in live]
  removed = [k.rstrip('.') for k in RESUMABLE_CHANGES if k not in live]
  return [f'only {", ".join(keys[:-1])} and {keys[-1]} may change'], removed


def test_checkpoints_doc_lists_the_keys_the_resume_error_lists():
  text = ' '.join((ROOT / 'docs' / 'checkpoints.md').read_text().split())
  (sentence,), removed = resumable_keys()
  assert sentence in text, ('docs/checkpoints.md\'s resumable keys differ from '
                            'run_config.RESUMABLE_CHANGES; write: ' + sentence)
  assert all(f'{k} (a removed' in text for k in removed), removed


def test_gsm8k_docstring_names_the_worker_meshes_the_recipes_check():
  """configs/gsm8k.py's docstring: the inference meshes it names on v5e-8 and on the 4-chip
  slices are the ones the recipes' check resolves for its variants."""
  from rlax_llm.configs import gsm8k  # pylint: disable=import-outside-toplevel
  doc = ' '.join(gsm8k.__doc__.split())
  named = set(re.findall(r'data (\d) x tensor (\d)', doc))
  resolved = set()
  for variant in gsm8k.VARIANTS:
    config = load_config([f'--config={ROOT / "configs" / "gsm8k.py"}:{variant}'])
    for slice_name in ('v5e-8', 'v4-8', 'v5p-8'):
      mesh = check_local(config, get_slice(slice_name), 'tpu-vm').inference_mesh
      resolved.add((str(mesh['data']), str(mesh['tensor'])))
  assert named == resolved, (named, resolved)
  assert 'on v5e-8 the worker mesh is data 4 x tensor 2 (Qwen2.5)' in doc


# --- Names in docs/*.md that must exist in the code -------------------------------------------
# Each docs page names modules, files, functions, methods and config keys in backticks; a
# rename or a deletion leaves those names stale. These checks read the code with `ast` (no
# imports: the Ray backend's module imports ray), so they run in a second.

DOCS = sorted((ROOT / 'docs').glob('*.md'))
PACKAGE = ROOT / 'rlax_llm'
# Groups whose fields vary per config (a task's and an environment's keyword arguments, reward
# components, Ray resources and environment variables); their keys are checked elsewhere.
_OPEN_KEYS = ('reward.', 'ray.trainer_resources.', 'ray.worker_resources.', 'ray.trainer_env.')
# Libraries' names that read like ours (`ray` is also a config group and a backend module).
_NOT_OURS = ('ray.put', 'ray.get', 'ray.init', 'ray.remote')


def _code_spans(text: str) -> list[str]:
  """The inline code spans of a markdown text (fenced blocks left out)."""
  text = re.sub(r'^```.*?^```', '', text, flags=re.MULTILINE | re.DOTALL)
  return re.findall(r'`([^`\n]+)`', text)


def _names_of(body: list[ast.stmt]) -> set[str]:
  """Names a module or class body defines: functions, classes, assignments, imports."""
  names = set()
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names |= {(a.asname or a.name).split('.')[0] for a in node.names}
    elif isinstance(node, (ast.If, ast.Try)):
      names |= _names_of(node.body + node.orelse)
  return names


class _Code:
  """What rlax_llm defines: each module's names, each class's attributes (its methods,
  fields and the ``self.x`` it assigns) and bases, each module's classes."""

  def __init__(self):
    self.modules: dict[str, set[str]] = {}  # dotted module name -> names it defines
    self.classes: dict[str, list[tuple[set[str], list[str]]]] = {}  # name -> (attrs, bases)
    self.module_classes: dict[str, list[str]] = {}
    self.init_args: dict[str, set[str]] = {}  # 'tasks' / 'envs' -> __init__ parameters
    for folder in (PACKAGE, ROOT / 'launch'):  # packages with or without an __init__.py
      for sub in [folder, *folder.rglob('*/')]:
        if sub.is_dir() and '__pycache__' not in sub.parts:
          self.modules['.'.join(sub.relative_to(ROOT).parts)] = set()
          self.module_classes['.'.join(sub.relative_to(ROOT).parts)] = []
    for path in [*PACKAGE.rglob('*.py'), *(ROOT / 'launch').rglob('*.py')]:
      parts = path.relative_to(ROOT).with_suffix('').parts
      name = '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)
      tree = ast.parse(path.read_text())
      self.modules[name] = _names_of(tree.body)
      self.module_classes[name] = []
      for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
          continue
        attrs = _names_of(node.body) | {
            n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
            and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
            and n.value.id == 'self'}
        bases = [b.id if isinstance(b, ast.Name) else getattr(b, 'attr', '') for b in node.bases]
        self.classes.setdefault(node.name, []).append((attrs, bases))
        self.module_classes[name].append(node.name)
        if parts[:2] in (('rlax_llm', 'tasks'), ('rlax_llm', 'envs')):
          # `task.path`: a field; `env.state_key()`: a method of an environment
          self.init_args.setdefault(parts[1], set()).update(attrs)
          for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == '__init__':
              args = item.args.args + item.args.kwonlyargs
              self.init_args[parts[1]].update(a.arg for a in args)
    self.basenames: dict[str, list[str]] = {}  # 'receiver' -> ['rlax_llm.paramserver.receiver']
    for name in self.modules:
      self.basenames.setdefault(name.rsplit('.', 1)[-1], []).append(name)

  def class_has(self, cls: str, attr: str, seen: frozenset = frozenset()) -> bool:
    return any(attr in attrs or any(self.class_has(b, attr, seen | {cls}) for b in bases
                                    if b in self.classes and b not in seen)
               for attrs, bases in self.classes.get(cls, []))

  def module_has(self, module: str, attr: str) -> bool:
    """``module.attr`` exists: a name of the module, a submodule, or an attribute of one of
    its classes (``driver.run`` for ``Driver.run``, ``engine.compilations()``)."""
    return (attr in self.modules[module] or f'{module}.{attr}' in self.modules
            or any(self.class_has(c, attr) for c in self.module_classes[module]))

  def resolve(self, dotted: list[str], modules: list[str]) -> bool:
    """Whether ``dotted`` (the parts after a module's name) names something in one of
    ``modules``: a module's name, then a class's attribute."""
    for module in modules:
      if not dotted:
        return True
      if f'{module}.{dotted[0]}' in self.modules:  # a submodule: files.gguf.read_gguf
        if self.resolve(dotted[1:], [f'{module}.{dotted[0]}']):
          return True
      elif self.module_has(module, dotted[0]):
        if len(dotted) == 1 or dotted[0] not in self.classes:
          return True  # attributes of values (not classes) are not followed
        if self.class_has(dotted[0], dotted[1]):
          return True
    return False


@pytest.fixture(scope='module')
def code() -> _Code:
  return _Code()


@pytest.fixture(scope='module')
def config_keys() -> set[str]:
  """Every key and group of the shipped configs ('rl', 'rl.mismatch', 'rl.mismatch.mode')."""
  keys = set()
  for path in sorted((ROOT / 'configs').glob('*.py')):
    for leaf in _leaves(load_config_file(str(path))):
      parts = leaf.split('.')
      keys |= {'.'.join(parts[:i]) for i in range(1, len(parts) + 1)}
  return keys


def _is_config_key(name: str, code: _Code, config_keys: set[str]) -> bool:
  """A key or group of the shipped configs, a key of an open group, or a task's or an
  environment's field (an argument or attribute of one of its classes)."""
  parts = name.split('.')
  return (name in config_keys or name.startswith(_OPEN_KEYS)
          or (parts[0] in ('task', 'env') and len(parts) == 2
              and parts[1] in code.init_args[f'{parts[0]}s'] | {'name', 'harness'}))


def stale_names(text: str, code: _Code, config_keys: set[str]) -> list[str]:
  """The code names in ``text``'s inline code that do not exist: ``rlax_llm.a.b`` dotted
  names, ``module.name`` (a module of rlax_llm by its last name, e.g. ``receiver.Receiver``),
  ``Class.attribute`` of a class of rlax_llm, config keys (``rl.loss``, ``--config.rl.loss``,
  ``config.rl.loss``; a task's or an environment's fields are its class's arguments) and
  repository paths (``rlax_llm/x.py``, ``tests/...``, ``benchmarks/...``)."""
  stale = []
  sections = {k for k in config_keys if '.' not in k}
  for span in _code_spans(text):
    for path in re.findall(r'(?<![\w./-])((?:rlax_llm|tests|benchmarks|launch|scripts|configs|'
                           r'docs|colabs)/[\w./-]*\w)', span):
      if not (ROOT / path).exists() and not re.search(r'\b[A-Z]+\b', path):  # FILE: a placeholder
        stale.append(path)
    for match in re.finditer(r'(?<![\w/-])(--config\.|config\.)?([A-Za-z_]\w*(?:\.\w+)*)'
                             r'(?![\w/-])', span):
      prefix, name = match.groups()
      if ((not prefix and '.' not in name) or name.startswith(_NOT_OURS) or name.endswith('_')
          or any(part.isupper() for part in name.split('.'))):
        continue  # a word; a library's function; `rl.turn_*`; KEY: a placeholder
      if re.search(r'\.(py|md|json|jsonl|txt|gguf|safetensors|jinja|cc|ipynb|sh|png)\b', name):
        continue  # a file name
      parts = name.split('.')
      if prefix == 'config.' and parts[0] not in sections:
        continue  # `config.with_execution(...)`: another object called config
      if prefix or (parts[0] in sections and parts[0] not in code.basenames):
        if not _is_config_key(name, code, config_keys):
          stale.append(match.group(0))
        continue
      if parts[0] in ('rlax_llm', 'launch') and f'{parts[0]}.{parts[1]}' in code.modules:
        if not code.resolve(parts[1:], [parts[0]]):
          stale.append(name)
      elif parts[0] in code.basenames:  # `receiver.Receiver`, or a key: `lora.sync`
        if not (code.resolve(parts[1:], code.basenames[parts[0]])
                or _is_config_key(name, code, config_keys)):
          stale.append(name)
      elif parts[0] in code.classes and not code.class_has(parts[0], parts[1]):
        stale.append(name)
  return stale


@pytest.mark.parametrize('doc', DOCS, ids=lambda p: p.name)
def test_docs_name_only_code_and_config_keys_that_exist(doc, code, config_keys):
  stale = stale_names(doc.read_text(), code, config_keys)
  assert not stale, f'docs/{doc.name} names what the code does not have: {stale}'


@pytest.mark.parametrize('doc', DOCS, ids=lambda p: p.name)
def test_docs_name_only_config_variants_that_exist(doc):
  """Every `configs/FILE.py:VARIANT` a page names (in a command, a table or the text) loads."""
  named = set(re.findall(r'(configs/[a-z0-9_]+\.py):([\w.-]*\w)', doc.read_text()))
  missing = []
  for path, variant in sorted(named - {(p, v) for p, v in named if v.isupper()}):  # VARIANT
    try:
      load_config_file(f'{ROOT / path}:{variant}')
    except ValueError as e:
      missing.append(f'{path}:{variant} ({e})')
  assert not missing, f'docs/{doc.name} names variants that do not load: {missing}'


def test_stale_names_finds_what_went_stale(code, config_keys):
  """The check above fails on names the docs really held after the code moved (the
  controller became a package; `InferenceWorker.maybe_reload` and `ParameterServer.pull`
  were deleted), on a misspelled key and on a task field no task takes, and passes the
  names that replaced them."""
  stale = ('`rlax_llm/controller.py`; `worker.maybe_reload`; `ParameterServer.pull(v)`; '
           '`--config.rl.los=m2po`; `rlax_llm.paramserver.publisher.Publish`; '
           '`task.question_fields`; `Receiver.ensure_version`')
  assert stale_names(stale, code, config_keys) == [
      'rlax_llm/controller.py', 'worker.maybe_reload', 'ParameterServer.pull',
      '--config.rl.los', 'rlax_llm.paramserver.publisher.Publish', 'task.question_fields',
      'Receiver.ensure_version']
  fresh = ('`rlax_llm/controller/loop.py`; `worker.receiver.pull`; `ParameterServer.update`; '
           '`--config.rl.loss=m2po`; `rlax_llm.paramserver.publisher.Publisher`; '
           '`task.question_field`; `Receiver.ensure`; `lora.sync`; `lora.pushed_params`; '
           '`files.gguf.read_gguf`; `env.state_key()`; `config.with_execution(remat=...)`')
  assert stale_names(fresh, code, config_keys) == []


# --- the notebooks' code ---

COLABS = sorted((ROOT / 'colabs').glob('*.ipynb'))


def _chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
  """``('name', ['a', 'b'])`` for ``name.a.b``; None when the chain starts elsewhere (a call)."""
  attrs = []
  while isinstance(node, ast.Attribute):
    attrs.append(node.attr)
    node = node.value
  return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def stale_code_names(source: str, code: _Code, config_keys: set[str]) -> list[str]:
  """What ``source`` (Python) imports from or uses of rlax_llm and launch that does not
  exist: imported modules and names, attributes of an imported module (``roles.plan_memory``)
  or class (``Episode.turns``), and the config keys read or set on a config that
  ``load_config_file`` / ``load_config`` returned (``config.rl.loss``). Values the code
  computes (a run, a model) are not followed."""
  tree = ast.parse(source)
  modules: dict[str, str] = {}  # local name -> dotted module
  classes: dict[str, str] = {}  # local name -> class name
  configs: set[str] = set()  # local names holding a config
  stale = []
  ours = ('rlax_llm', 'launch')
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split('.')[0] in ours:
          if alias.name not in code.modules:
            stale.append(alias.name)
          elif alias.asname:
            modules[alias.asname] = alias.name
          else:
            modules[alias.name.split('.')[0]] = alias.name.split('.')[0]
    elif isinstance(node, ast.ImportFrom) and (node.module or '').split('.')[0] in ours:
      if node.module not in code.modules:
        stale.append(node.module)
        continue
      for alias in node.names:
        local = alias.asname or alias.name
        if f'{node.module}.{alias.name}' in code.modules:
          modules[local] = f'{node.module}.{alias.name}'
        elif not code.module_has(node.module, alias.name):
          stale.append(f'{node.module}.{alias.name}')
        elif alias.name in code.module_classes[node.module]:
          classes[local] = alias.name
    elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
      called = node.value.func
      name = called.id if isinstance(called, ast.Name) else getattr(called, 'attr', '')
      if name in ('load_config_file', 'load_config'):
        configs |= {t.id for t in node.targets if isinstance(t, ast.Name)}
  sections = {k for k in config_keys if '.' not in k}
  called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
  for node in ast.walk(tree):
    found = _chain(node) if isinstance(node, ast.Attribute) else None
    if found is None:
      continue
    name, attrs = found
    if name in modules:
      if not code.resolve(attrs, [modules[name]]):
        stale.append('.'.join([modules[name], *attrs]))
    elif name in classes:
      if not code.class_has(classes[name], attrs[0]):
        stale.append(f'{classes[name]}.{attrs[0]}')
    elif name in configs and attrs[0] in sections:
      key = attrs[:-1] if id(node) in called else attrs  # config.rl.get(...): a method
      if key and not _is_config_key('.'.join(key), code, config_keys):
        stale.append(f'{name}.{".".join(attrs)}')
  return sorted(set(stale))


@pytest.mark.parametrize('notebook', COLABS, ids=lambda p: p.name)
def test_notebooks_use_only_code_and_config_keys_that_exist(notebook, code, config_keys):
  stale = stale_code_names(notebook_code(notebook), code, config_keys)
  assert not stale, f'colabs/{notebook.name} uses what the code does not have: {stale}'


def test_the_notebook_check_finds_a_planted_wrong_name(tmp_path, code, config_keys):
  """A copy of a real notebook with a wrong import, a wrong module attribute, a wrong class
  attribute and a misspelled config key: each is found; the copy as it was passes."""
  notebook = json.loads((ROOT / 'colabs' / 'agent_calculator.ipynb').read_text())
  copy = tmp_path / 'planted.ipynb'
  copy.write_text(json.dumps(notebook))
  assert stale_code_names(notebook_code(copy), code, config_keys) == []
  notebook['cells'].append({'cell_type': 'code', 'metadata': {}, 'outputs': [],
                            'execution_count': None, 'source': [
      'from rlax_llm.metrics import read_metric\n',
      'from rlax_llm.rollout.epsiodes import Episode as E\n',
      'import rlax_llm.evaluation as ev\n',
      'ev.no_such_function()\n',
      'roles.plan_memry(config)\n',
      'Episode.no_such_field\n',
      'config = load_config_file("configs/agent.py")\n',
      'config.rl.los = "grpo"\n',
      'config.rl.loss = "grpo"\n',
      '!pip install nothing\n']})
  copy.write_text(json.dumps(notebook))
  assert stale_code_names(notebook_code(copy), code, config_keys) == [
      'Episode.no_such_field', 'config.rl.los', 'rlax_llm.evaluation.no_such_function',
      'rlax_llm.metrics.read_metric', 'rlax_llm.roles.plan_memry', 'rlax_llm.rollout.epsiodes']
