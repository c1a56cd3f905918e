"""Test-session setup: 8 fake CPU devices, so sharding code runs as on a small TPU slice.

XLA reads the flag when the backend initialises, so it must be set before jax is imported.
"""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
