"""rlax_llm/sharding.py: mesh sizing (``mesh_shape``) shared by ``make_mesh`` and the recipes."""

import jax
import pytest

from rlax_llm.sharding import make_mesh, mesh_shape


@pytest.mark.parametrize('axes', [
    {'data': -1}, {'data': 2, 'fsdp': -1}, {'fsdp': 4, 'tensor': 2}, {'tensor': -1, 'data': 2},
    {'data': 1}, {'data': 16}, {'fsdp': 3, 'data': -1}, {'data': -1, 'fsdp': -1},
    {'data': 0}, {'sequence': 2},
])
def test_mesh_shape_sizes_meshes_like_make_mesh(axes):
  """The recipes size meshes without devices; make_mesh on 8 devices agrees on every case,
  errors included (the same message)."""
  assert jax.device_count() == 8  # tests/conftest.py
  try:
    expected = dict(make_mesh(axes).shape)
  except ValueError as e:
    with pytest.raises(ValueError) as raised:
      mesh_shape(axes, 8)
    assert str(raised.value) == str(e)
    return
  assert mesh_shape(axes, 8) == expected


@pytest.mark.parametrize('axes, devices, expected', [
    ({'data': -1}, 32, {'data': 32, 'fsdp': 1, 'tensor': 1}),
    ({'fsdp': 4, 'tensor': -1}, 16, {'data': 1, 'fsdp': 4, 'tensor': 4}),
    ({'data': 2}, 8, {'data': 2, 'fsdp': 1, 'tensor': 1}),  # the first 2 of 8 devices
    ({'tensor': 2, 'data': -1, 'fsdp': 2}, 64, {'data': 16, 'fsdp': 2, 'tensor': 2}),
])
def test_mesh_shape_gives_the_remaining_devices_to_the_minus_one_axis(axes, devices, expected):
  shape = mesh_shape(axes, devices)
  assert shape == expected and list(shape) == ['data', 'fsdp', 'tensor']


@pytest.mark.parametrize('axes, devices, message', [
    ({'fsdp': 3, 'data': -1}, 16, "16 devices do not divide by the fixed mesh axes {'data': -1, "
     "'fsdp': 3, 'tensor': 1}."),
    ({'tensor': 16}, 8, "Mesh {'data': 1, 'fsdp': 1, 'tensor': 16} needs 16 devices; 8 are "
     'available.'),
    ({'model': 2}, 8, "Unknown mesh axes ['model']; valid axes are ('data', 'fsdp', 'tensor')."),
])
def test_mesh_shape_says_why_a_mesh_does_not_fit(axes, devices, message):
  with pytest.raises(ValueError) as raised:
    mesh_shape(axes, devices)
  assert str(raised.value) == message
