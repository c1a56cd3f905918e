"""A notebook's code as one Python source, for the checks that read the notebooks' code
(tests/test_docs.py: the names it uses exist; tests/test_imports.py: it counts as a user)."""

import json
import pathlib


def notebook_code(path: pathlib.Path) -> str:
  """The code cells of the notebook at ``path`` joined in order, their shell and magic lines
  (``!pip``, ``%matplotlib``) left out."""
  cells = json.loads(path.read_text(encoding='utf-8'))['cells']
  return '\n'.join(line for cell in cells if cell['cell_type'] == 'code'
                   for line in ''.join(cell['source']).splitlines()
                   if not line.lstrip().startswith(('!', '%')))
