"""launch/recipes/compile.py and program_report.py: a run's programs compiled for TPU slices on
this CPU machine, and what the compiler says of them.

The TPU compiler comes with libtpu (``jax[tpu]``, in the test extra); these tests compile a
one-layer SmolLM2-135M (the smoke recipe's batch, slots and lengths) for a one-host v5e-4
(2x2), with its tied table on data 4 and on fsdp 4, and with an untied one for a four-host
v5e-16 (4x4), and check the report's refusal and its HLO reading. At one layer the
49152 x 576 table is nine tenths of the params, so the plan's XLA:TPU terms for it
(``presets.tpu_trainer_terms``: the table's update in the lookup's layout, FSDP's gathered
table) decide whether the plan holds (benchmarks/RESULTS.md, "Compiled for TPU at real
depth").
"""

import dataclasses

import pytest

pytest.importorskip('libtpu', reason='the TPU compiler (libtpu) is not installed: '
                    "pip install -e '.[test]' brings it")

from launch.recipes import checks, cli  # noqa: E402
from launch.recipes import compile as compile_lib  # noqa: E402
from launch.recipes import program_report  # noqa: E402
from launch.recipes.slices import SLICES, SliceError, get_slice  # noqa: E402
from rlax_llm.cli import load_config  # noqa: E402

SMOKE = 'configs/smollm2.py:smoke'
PROGRAMS = ('trainer_step', 'decode')


def _compile(tpu_type: str, *overrides: str, tied: bool = True, programs=PROGRAMS):
  config = load_config([f'--config={SMOKE}', *overrides])
  slice_ = get_slice(tpu_type)
  plan = checks.check_local(config, slice_, 'multihost' if slice_.multi_host else 'tpu-vm')
  model = dataclasses.replace(checks.run_model(config, num_layers=1), tie_embeddings=tied)
  reports = compile_lib.compile_run(config, plan, slice_, slice_, shared=True,
                                    programs=programs, model=model)
  return plan, reports


@pytest.mark.parametrize('tpu_type, overrides, tied', [
    ('v5e-4', (), True),
    # 16 chips, 4 hosts: 16 rows (one per chip); each host's worker on its own 4 chips.
    ('v5e-16', ('--config.rl.prompts_per_step=4',), False),
])
def test_trainer_step_and_decode_compile_fit_and_match_the_plan(tpu_type, overrides, tied):
  plan, reports = _compile(tpu_type, *overrides, tied=tied)
  reports = {r.program: r for r in reports}
  assert set(reports) == set(PROGRAMS)
  step, decode = reports['trainer_step'], reports['decode']
  assert step.mesh == {'data': get_slice(tpu_type).chips, 'fsdp': 1, 'tensor': 1}
  assert decode.mesh == plan.inference_mesh
  for report in (step, decode):
    assert report.fits and 0 < report.need < report.hbm == 16 * 2**30
    assert report.flops > 0 and report.bytes_accessed > 0 and report.step_s > 0
  # The roles share the chips: each program counts the other role's arrays beside it.
  assert step.beside == decode.arguments and decode.beside > 0
  # Params and optimizer state are donated: the step writes them in place.
  assert step.aliased > 0.9 * step.outputs
  assert abs(step.plan_ratio - 1) <= 0.15, step.line()


def test_the_fsdp_trainer_step_matches_the_plan_with_the_gathered_table():
  plan, (step,) = _compile('v5e-4', '--config.mesh.trainer.data=1',
                           '--config.mesh.trainer.fsdp=4', programs=('trainer_step',))
  assert plan.trainer_mesh == step.mesh == {'data': 1, 'fsdp': 4, 'tensor': 1}
  assert step.fits and step.aliased > 0.9 * step.outputs
  # Without the table's update and the gathered table the plan was 0.21 GiB against the
  # compiled 0.49 (+137%).
  assert abs(step.plan_ratio - 1) <= 0.15, step.line()


def test_a_program_that_does_not_fit_is_refused_with_its_numbers():
  report = program_report.ProgramReport(
      program='decode', slice='v5e-8', mesh={'data': 8, 'fsdp': 1, 'tensor': 1},
      arguments=12 * 2**30, temporaries=3 * 2**30, outputs=0.0, aliased=0.0, code=0.0,
      beside=2 * 2**30, hbm=16 * 2**30, plan=None, lower_s=0.0, compile_s=0.0, flops=1.0,
      bytes_accessed=1.0, step_s=1.0, bound='memory', tokens_per_s_per_chip=None, mfu=None)
  assert not report.fits
  with pytest.raises(SliceError, match=r'decode needs 17.00 GiB per chip on v5e-8 \(15.00 '
                     r'GiB its own \+ 2.00 GiB held beside it\) but a chip has 16 GiB'):
    program_report.refuse_unless_fits([report])


def test_cli_refuses_an_impossible_run_before_compiling():
  with pytest.raises(SliceError, match='compile takes --tpu-type=SLICE'):
    cli.run(['compile', f'--config={SMOKE}', '--tpu-type=v5e-8',
             '--trainer-tpu-type=v5p-16'])


def test_every_slice_of_the_table_has_a_compile_topology():
  for slice_ in SLICES.values():
    if slice_.generation == 'v4':  # one device per TensorCore there, not per chip: refused
      with pytest.raises(SliceError, match=f'{slice_.name}: .* has {2 * slice_.chips} devices, '
                         'one per TensorCore'):
        compile_lib.tpu_devices(slice_)
      continue
    devices = compile_lib.tpu_devices(slice_)
    assert len(devices) == slice_.chips
    # libtpu describes a 2x4 slice as two hosts of 4 chips; the single-host 8-chip VMs
    # (v5e-8, v6e-8) hold the same chips and links, and the programs are the same.
    hosts = 2 if slice_.gke_topology == '2x4' else slice_.hosts
    assert len({d.process_index for d in devices}) == hosts, slice_.name
    assert slice_.peak_tflops > 0 and slice_.hbm_gbps > 0


def test_s8_dot_lines_finds_products_with_int8_operands_only():
  # From the v5e decode step with int8 weights: the weight reaches the convolution through a
  # layout fusion, named; its type is that fusion's.
  hlo = '''
  %param_0.351 = s8[576,192]{0,1:T(32,128)(4,1)S(1)} parameter(0)
  %fusion.137 = s8[576,192]{0,1:T(8,128)(4,1)} fusion(%param_0.351), kind=kLoop
  %fusion.84 = bf16[128,576]{1,0:T(8,128)(2,1)} fusion(%param_1.414), kind=kLoop
  %convolution.43 = f32[128,192]{0,1} convolution(%fusion.84, %fusion.137), dim_labels=bf_io->bf
  %convolution.44 = f32[128,192]{0,1} convolution(%fusion.84, %fusion.84), dim_labels=bf_io->bf
  %dot.1 = f32[8,8]{1,0} dot(f32[8,4]{1,0} %x, s8[4,8]{1,0} %y)
  %convert.2 = bf16[576,192]{1,0} convert(%param_0.351)'''
  lines = hlo.strip().splitlines()
  assert program_report.s8_dot_lines(hlo) == [lines[3].strip(), lines[5].strip()]
