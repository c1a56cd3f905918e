"""``python -m launch.recipes``: see ``launch/recipes/__init__.py`` and launch/README.md.
``serve-tpu-vm`` (a run's checkpoint served on a TPU VM) is ``serve_tpu_vm``'s."""

import sys

from launch.recipes import cli, serve_tpu_vm

if __name__ == '__main__':
  if sys.argv[1:2] == ['serve-tpu-vm']:
    serve_tpu_vm.main(sys.argv[2:])
  else:
    cli.main()
