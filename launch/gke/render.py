#!/usr/bin/env python3
"""Renders the GKE JobSet of a config (``python -m launch.recipes gke``).

    python launch/gke/render.py --tpu-type=v5p-32 --image=IMAGE --workdir=gs://BUCKET/run \
        --config=configs/smollm2.py --dry-run          # print the manifest
    python launch/gke/render.py ... --output=jobset.yaml # write it and kubectl apply it

Options: launch/gke/README.md, or --help.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from launch.recipes import cli  # pylint: disable=wrong-import-position

if __name__ == '__main__':
  cli.main(['gke', *sys.argv[1:]])
