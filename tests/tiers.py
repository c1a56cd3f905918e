"""The extended tier: heavier variants of guarantees the default test run checks more cheaply.

``bash scripts/test.sh`` runs every test marked neither ``slow`` nor ``extended`` (pyproject's
``addopts``); ``--extended`` adds this tier, ``--all`` the slow tests too. tests/conftest.py
marks each test named here ``extended`` at collection, so a test's file stays as it is.

Each entry: a test (its node id; without ``[...]`` every parametrisation of the function) ->
``(the default-run test that still checks its guarantee, what this variant adds)``. A test
joins this tier only where its counterpart runs by default and checks the same guarantee on
the same code path (another loss, shape, architecture or sampling setting of one program, a
second process launch where one suffices); tests/test_tiers.py holds the table to that.
"""

_SHARED_LOSS = ('tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update'
                '[grpo]')
_SHARED_LOSS_WHY = ('another loss: the window scoring feeds every loss the same log-probs (grpo, '
                    'with the KL term, also scores the reference through the window)')
_WINDOW = ('tests/trainer/test_shared_prefix.py::test_window_log_probs_equal_the_full_sequence_ones'
           '[2-5-spec1]')
_WINDOW_WHY = ('another share/chunk/sampling combination (the counterpart shares blocks of 2, '
               'chunks by 5 and truncates the sampling at once; [4-0-spec0] stays too)')

EXTENDED: dict[str, tuple[str, str]] = {
    # tests/test_async.py: each test builds and runs its own smoke runs in-process.
    'tests/test_async.py::test_two_workers_on_disjoint_devices_match_one': (
        'tests/test_async.py::test_a_lost_worker_is_replaced_and_the_run_completes[die]',
        'two workers on disjoint device sets (the counterpart: two workers on shared devices, '
        'one lost mid-run, draw the reference tokens)'),
    'tests/test_async.py::test_rollouts_are_trained_filtered_or_recycled': (
        'tests/test_async.py::test_partial_rollouts_are_continued_deterministically',
        'the group accounting with oversampling and stale drops, without partial rollouts'),
    'tests/test_async.py::test_partial_rollouts_on_policy_restart_what_saw_an_update': (
        'tests/test_async.py::test_partial_rollouts_are_continued_deterministically',
        'k=1: every carried group restarted (the counterpart counts restarts and continuations)'),
    'tests/test_async.py::test_short_batches_wait_trains_only_full_informative_batches': (
        'tests/test_schedule.py::test_short_batch_wait_keeps_the_informative_groups',
        "short_batches='wait' through a whole run (the counterpart: the batch rule itself)"),
    'tests/test_async.py::test_step_times_count_the_generation[False]': (
        'tests/test_async.py::test_step_times_count_the_generation[True]',
        'the inline (not concurrent) controller'),
    'tests/test_async.py::test_free_running_keeps_the_bound_at_larger_j_and_k': (
        'tests/test_async.py::test_free_running_swaps_weights_mid_generation_within_the_bound',
        '(j, k) = (2, 4) under random timings'),
    # tests/trainer/test_shared_prefix.py: each case compiles two trainer steps.
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[cispo]': (
        _SHARED_LOSS, _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[dapo]': (
        _SHARED_LOSS, _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[drgrpo]': (
        _SHARED_LOSS, _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[gspo]': (
        _SHARED_LOSS, _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[m2po]': (
        _SHARED_LOSS, _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[ppo]': (
        _SHARED_LOSS, _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[reinforce]': (
        _SHARED_LOSS, _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[reinforce_pp]': (
        _SHARED_LOSS, _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[rloo]': (
        _SHARED_LOSS, _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_window_log_probs_equal_the_full_sequence_ones'
    '[1-0-spec0]': (_WINDOW, _WINDOW_WHY),
    'tests/trainer/test_shared_prefix.py::test_window_log_probs_equal_the_full_sequence_ones'
    '[1-0-spec1]': (_WINDOW, _WINDOW_WHY),
    'tests/trainer/test_shared_prefix.py::test_window_log_probs_equal_the_full_sequence_ones'
    '[4-0-spec1]': (_WINDOW, _WINDOW_WHY),
    'tests/trainer/test_shared_prefix.py::test_window_log_probs_equal_the_full_sequence_ones'
    '[4-4-spec0]': (_WINDOW, _WINDOW_WHY),
    'tests/trainer/test_shared_prefix.py::test_window_log_probs_equal_the_full_sequence_ones'
    '[4-4-spec1]': (_WINDOW, _WINDOW_WHY),
    'tests/trainer/test_shared_prefix.py::test_window_log_probs_equal_the_full_sequence_ones'
    '[2-5-spec0]': (_WINDOW, _WINDOW_WHY),
    # tests/rollout/test_engine_smollm2.py: the real 135M model, 30 layers, on CPU.
    'tests/rollout/test_engine_smollm2.py::test_greedy_equals_transformers_up_to_float_ties': (
        'tests/models/test_smollm2.py::test_logits_match_transformers_on_the_same_gguf',
        'greedy generation over 8 chat prompts on the real weights (the counterparts: the same '
        "model's logits equal transformers', and tests/models/test_hf_parity.py's cached "
        'decoding for every family)'),
    'tests/rollout/test_engine_smollm2.py::test_behaviour_logprobs_equal_the_trainer_recompute': (
        'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute'
        '[spec1-blocks of 8]',
        "the same check at SmolLM2's size"),
    'tests/rollout/test_engine_smollm2.py::'
    'test_batch_invariant_behaviour_logprobs_equal_the_trainer_bitwise': (
        'tests/rollout/test_engine.py::test_batch_invariant_logprobs_equal_the_trainer_bitwise'
        '[attend buckets]',
        "the same check at SmolLM2's size ('floor' rows)"),
    'tests/rollout/test_engine_smollm2.py::test_a_seed_reproduces_sampled_output': (
        'tests/rollout/test_engine.py::test_same_keys_same_samples_other_keys_other_samples',
        "the same check at SmolLM2's size"),
    # tests/rollout/test_engine.py
    'tests/rollout/test_engine.py::test_randomized_submit_finish_swap': (
        'tests/rollout/test_engine.py::test_samples_do_not_depend_on_slots_or_batching',
        'random interleavings of submits, finishes and swaps (the counterparts: slots and '
        'batching, test_weights_swap_between_steps_without_recompiling)'),
    'tests/rollout/test_engine.py::test_greedy_decode_step_reads_the_flipped_heads_logits_in_place':
    ('tests/models/test_decoder.py::test_vocab_major_argmax_reads_the_flipped_head_in_place',
     "the same in-place read through the engine's decode step"),
    'tests/rollout/test_engine.py::test_partial_rollouts_continue_as_if_uninterrupted[spec1]': (
        'tests/rollout/test_engine.py::test_partial_rollouts_continue_as_if_uninterrupted[spec0]',
        'truncated sampling (top-k, top-p)'),
    'tests/rollout/test_engine.py::test_batch_invariant_logprobs_equal_the_trainer_bitwise'
    '[whole cache]': (
        'tests/rollout/test_engine.py::test_batch_invariant_logprobs_equal_the_trainer_bitwise'
        '[attend buckets]', 'steps attending to the whole cache'),
    'tests/rollout/test_engine.py::test_batch_invariant_logprobs_equal_the_trainer_bitwise'
    '[attend buckets, floor]': (
        'tests/rollout/test_engine.py::test_batch_invariant_logprobs_equal_the_trainer_bitwise'
        "[attend buckets]", "invariant_rows='floor' (the counterpart: the default 'chunks')"),
    'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute[spec0-one block]': (
        'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute'
        '[spec1-blocks of 8]', 'another sampling setting or cache layout'),
    'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute[spec0-blocks of 8]': (
        'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute'
        '[spec1-blocks of 8]', 'another sampling setting or cache layout'),
    'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute[spec0-blocks of 10]': (
        'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute'
        '[spec1-blocks of 8]', 'another sampling setting or cache layout'),
    'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute[spec1-one block]': (
        'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute'
        '[spec1-blocks of 8]', 'another sampling setting or cache layout'),
    'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute[spec1-blocks of 10]': (
        'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute'
        '[spec1-blocks of 8]', 'another sampling setting or cache layout'),
    'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute[spec2-one block]': (
        'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute'
        '[spec2-blocks of 10]', 'another sampling setting or cache layout'),
    'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute[spec2-blocks of 8]': (
        'tests/rollout/test_engine.py::test_behaviour_logprobs_equal_the_trainer_recompute'
        '[spec2-blocks of 10]', 'another sampling setting or cache layout'),
    # tests/models/test_batch_invariant.py
    'tests/models/test_batch_invariant.py::'
    'test_logits_are_bitwise_equal_across_batches_padding_and_caches[mha_qk_norm_untied]': (
        'tests/models/test_batch_invariant.py::'
        'test_logits_are_bitwise_equal_across_batches_padding_and_caches[gqa]',
        'multi-head attention with QK-norm and an untied head'),
    'tests/models/test_batch_invariant.py::'
    'test_logits_are_bitwise_equal_across_batches_padding_and_caches[bias]': (
        'tests/models/test_batch_invariant.py::'
        'test_logits_are_bitwise_equal_across_batches_padding_and_caches[gqa]',
        'attention biases'),
    'tests/models/test_batch_invariant.py::'
    'test_logits_are_bitwise_equal_across_batches_padding_and_caches[gqa_floor]': (
        'tests/models/test_batch_invariant.py::'
        'test_logits_are_bitwise_equal_across_batches_padding_and_caches[gqa]',
        "invariant_rows='floor' (the counterpart: the default 'chunks')"),
    'tests/models/test_batch_invariant.py::'
    'test_logits_are_bitwise_equal_across_batches_padding_and_caches[mha_floor]': (
        'tests/models/test_batch_invariant.py::'
        'test_logits_are_bitwise_equal_across_batches_padding_and_caches[gqa]',
        "multi-head attention, invariant_rows='floor'"),
    'tests/models/test_batch_invariant.py::test_the_default_numerics_differ_on_the_same_comparisons':
    ('tests/test_controller.py::test_batch_invariant_run_trains_exactly_on_policy[False-chunks]',
     'the control on the logits comparisons (the counterpart: the run-level control, a gap in '
     '(0, 1e-5) with the default numerics)'),
    'tests/models/test_batch_invariant.py::'
    'test_behaviour_logprobs_equal_the_trainer_bitwise_on_smollm2_shapes': (
        'tests/rollout/test_engine.py::test_batch_invariant_logprobs_equal_the_trainer_bitwise'
        '[attend buckets]', "SmolLM2's layer shapes"),
    # tests/test_controller.py
    'tests/test_controller.py::test_batch_invariant_run_trains_exactly_on_policy[True-floor]': (
        'tests/test_controller.py::test_batch_invariant_run_trains_exactly_on_policy'
        '[True-chunks]', "invariant_rows='floor' (the counterpart: the default 'chunks')"),
    'tests/test_controller.py::test_shared_prefix_scoring_trains_like_full_scoring': (
        'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[grpo]',
        'shared-prefix scoring through a whole run (the counterpart: the trainer update)'),
    # tests/test_resume.py: each case launches processes.
    'tests/test_resume.py::test_signal_then_relaunch_resumes[15]': (
        'tests/test_storage.py::test_sigterm_then_relaunch_on_gcs_resumes',
        'SIGTERM on a local workdir (the counterparts: SIGTERM on gs://, SIGKILL here: [9])'),
    'tests/test_resume.py::test_three_preemptions_resume_exactly[1-1-0]': (
        'tests/test_resume.py::test_three_preemptions_resume_exactly[4-8-1]',
        'the synchronous schedule (the counterpart: (4, 8), batches in flight)'),
}
