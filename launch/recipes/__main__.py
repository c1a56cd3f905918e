"""``python -m launch.recipes``: see ``launch/recipes/__init__.py`` and launch/README.md.
``serve-tpu-vm`` runs ``serve_tpu_vm`` (which imports ``cli``: it is dispatched here, not in
``cli``)."""

import sys

from launch.recipes import cli, serve_tpu_vm

if __name__ == '__main__':
  if sys.argv[1:2] == ['serve-tpu-vm']:
    cli.main(sys.argv[2:], command=serve_tpu_vm.run)
  else:
    cli.main()
