"""``python -m launch.recipes``: see ``launch/recipes/__init__.py`` and launch/README.md."""

from launch.recipes import cli

if __name__ == '__main__':
  cli.main()
