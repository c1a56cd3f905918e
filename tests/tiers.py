"""The extended tier: heavier variants of guarantees the default test run checks more cheaply.

``bash scripts/test.sh`` runs every test marked neither ``slow`` nor ``extended`` (pyproject's
``addopts``); ``--extended`` adds this tier, ``--all`` the slow tests too. tests/conftest.py
marks each test named here ``extended`` at collection, so a test's file stays as it is.

Each entry: a test (its node id; without ``[...]`` every parametrisation of the function) ->
``(the default-run test that still checks its guarantee, what this variant adds)``. A test
joins this tier only where its counterpart runs by default and checks the same guarantee on
the same code path (another loss, shape, architecture or sampling setting of one program, a
second process launch where one suffices). tests/test_tiers.py checks that both tests of an
entry exist; tests/conftest.py stops a run that collects a stale entry or a counterpart that
is not in the default run.
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
    # tests/test_async.py
    'tests/test_async.py::test_two_workers_on_disjoint_devices_match_one': (
        'tests/test_async.py::test_a_lost_worker_is_replaced_and_the_run_completes[die]',
        'two workers on disjoint device sets (the counterpart: two workers on shared devices, '
        'one lost mid-run, draw the reference tokens)'),
    'tests/test_async.py::test_rollouts_are_trained_filtered_or_recycled': (
        'tests/test_controller.py::test_dynamic_sampling_pads_short_batches_to_one_shape',
        'the group accounting under random timings at (2, 3), stale drops included (the '
        'counterpart: with oversampling, every group trained, padded, filtered, dropped or '
        'recycled is counted once)'),
    'tests/test_async.py::test_partial_rollouts_on_policy_restart_what_saw_an_update': (
        'tests/rollout/test_engine.py::'
        'test_continued_samples_keep_old_versions_and_discard_restarts_them',
        "k=1 through a whole run: every carried group that saw an update restarted (the "
        "counterpart: the engine's 'discard' restarts a sample that saw a swap)"),
    'tests/test_async.py::test_short_batches_wait_trains_only_full_informative_batches': (
        'tests/test_schedule.py::test_short_batch_wait_keeps_the_informative_groups',
        "short_batches='wait' through a whole run (the counterpart: the batch rule itself)"),
    'tests/test_async.py::test_step_times_count_the_generation[False]': (
        'tests/test_async.py::test_step_times_count_the_generation[True]',
        'the inline (not concurrent) controller'),
    'tests/test_async.py::test_free_running_keeps_the_bound_at_larger_j_and_k': (
        'tests/rollout/test_worker.py::test_free_running_pulls_between_decode_steps',
        'the free-running schedule at (j, k) = (2, 4) under random timings'),
    # tests/trainer/test_shared_prefix.py
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[cispo]': (
        _SHARED_LOSS,
        _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[dapo]': (
        _SHARED_LOSS,
        _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[drgrpo]': (
        _SHARED_LOSS,
        _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[gspo]': (
        _SHARED_LOSS,
        _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[m2po]': (
        _SHARED_LOSS,
        _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[ppo]': (
        _SHARED_LOSS,
        _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[reinforce]': (
        _SHARED_LOSS,
        _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::'
    'test_every_loss_gives_the_unshared_update[reinforce_pp]': (
        _SHARED_LOSS,
        _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::test_every_loss_gives_the_unshared_update[rloo]': (
        _SHARED_LOSS,
        _SHARED_LOSS_WHY),
    'tests/trainer/test_shared_prefix.py::'
    'test_window_log_probs_equal_the_full_sequence_ones[1-0-spec0]': (
        _WINDOW,
        _WINDOW_WHY),
    'tests/trainer/test_shared_prefix.py::'
    'test_window_log_probs_equal_the_full_sequence_ones[1-0-spec1]': (
        _WINDOW,
        _WINDOW_WHY),
    'tests/trainer/test_shared_prefix.py::'
    'test_window_log_probs_equal_the_full_sequence_ones[4-0-spec1]': (
        _WINDOW,
        _WINDOW_WHY),
    'tests/trainer/test_shared_prefix.py::'
    'test_window_log_probs_equal_the_full_sequence_ones[4-4-spec0]': (
        _WINDOW,
        _WINDOW_WHY),
    'tests/trainer/test_shared_prefix.py::'
    'test_window_log_probs_equal_the_full_sequence_ones[4-4-spec1]': (
        _WINDOW,
        _WINDOW_WHY),
    'tests/trainer/test_shared_prefix.py::'
    'test_window_log_probs_equal_the_full_sequence_ones[2-5-spec0]': (
        _WINDOW,
        _WINDOW_WHY),
    # tests/rollout/test_engine_smollm2.py
    'tests/rollout/test_engine_smollm2.py::test_greedy_equals_transformers_up_to_float_ties': (
        'tests/models/test_smollm2.py::test_logits_match_transformers_on_the_same_gguf',
        "greedy generation over 8 chat prompts on the real weights (the counterparts: the same "
        "model's logits equal transformers', and tests/models/test_hf_parity.py's cached decoding "
        "for every family)"),
    'tests/rollout/test_engine_smollm2.py::test_behaviour_logprobs_equal_the_trainer_recompute': (
        'tests/rollout/test_engine.py::'
        'test_behaviour_logprobs_equal_the_trainer_recompute[spec1-blocks of 8]',
        "the same check at SmolLM2's size"),
    'tests/rollout/test_engine_smollm2.py::'
    'test_batch_invariant_behaviour_logprobs_equal_the_trainer_bitwise': (
        'tests/rollout/test_engine.py::'
        'test_batch_invariant_logprobs_equal_the_trainer_bitwise[attend buckets]',
        "the same check at SmolLM2's size ('floor' rows)"),
    'tests/rollout/test_engine_smollm2.py::test_a_seed_reproduces_sampled_output': (
        'tests/rollout/test_engine.py::test_same_keys_same_samples_other_keys_other_samples',
        "the same check at SmolLM2's size"),
    # tests/rollout/test_engine.py
    'tests/rollout/test_engine.py::test_randomized_submit_finish_swap': (
        'tests/rollout/test_engine.py::test_samples_do_not_depend_on_slots_or_batching',
        'random interleavings of submits, finishes and swaps (the counterparts: slots and '
        'batching, test_weights_swap_between_steps_without_recompiling)'),
    'tests/rollout/test_engine.py::'
    'test_greedy_decode_step_reads_the_flipped_heads_logits_in_place': (
        'tests/models/test_decoder.py::test_vocab_major_argmax_reads_the_flipped_head_in_place',
        "the same in-place read through the engine's decode step"),
    'tests/rollout/test_engine.py::test_partial_rollouts_continue_as_if_uninterrupted[spec1]': (
        'tests/rollout/test_engine.py::test_partial_rollouts_continue_as_if_uninterrupted[spec0]',
        'truncated sampling (top-k, top-p)'),
    'tests/rollout/test_engine.py::'
    'test_batch_invariant_logprobs_equal_the_trainer_bitwise[whole cache]': (
        'tests/rollout/test_engine.py::'
        'test_batch_invariant_logprobs_equal_the_trainer_bitwise[attend buckets]',
        'steps attending to the whole cache'),
    'tests/rollout/test_engine.py::'
    'test_batch_invariant_logprobs_equal_the_trainer_bitwise[attend buckets, floor]': (
        'tests/rollout/test_engine.py::'
        'test_batch_invariant_logprobs_equal_the_trainer_bitwise[attend buckets]',
        "invariant_rows='floor' (the counterpart: the default 'chunks')"),
    'tests/rollout/test_engine.py::'
    'test_behaviour_logprobs_equal_the_trainer_recompute[spec0-one block]': (
        'tests/rollout/test_engine.py::'
        'test_behaviour_logprobs_equal_the_trainer_recompute[spec1-blocks of 8]',
        'another sampling setting or cache layout'),
    'tests/rollout/test_engine.py::'
    'test_behaviour_logprobs_equal_the_trainer_recompute[spec0-blocks of 8]': (
        'tests/rollout/test_engine.py::'
        'test_behaviour_logprobs_equal_the_trainer_recompute[spec1-blocks of 8]',
        'another sampling setting or cache layout'),
    'tests/rollout/test_engine.py::'
    'test_behaviour_logprobs_equal_the_trainer_recompute[spec0-blocks of 10]': (
        'tests/rollout/test_engine.py::'
        'test_behaviour_logprobs_equal_the_trainer_recompute[spec1-blocks of 8]',
        'another sampling setting or cache layout'),
    'tests/rollout/test_engine.py::'
    'test_behaviour_logprobs_equal_the_trainer_recompute[spec1-one block]': (
        'tests/rollout/test_engine.py::'
        'test_behaviour_logprobs_equal_the_trainer_recompute[spec1-blocks of 8]',
        'another sampling setting or cache layout'),
    'tests/rollout/test_engine.py::'
    'test_behaviour_logprobs_equal_the_trainer_recompute[spec1-blocks of 10]': (
        'tests/rollout/test_engine.py::'
        'test_behaviour_logprobs_equal_the_trainer_recompute[spec1-blocks of 8]',
        'another sampling setting or cache layout'),
    'tests/rollout/test_engine.py::'
    'test_behaviour_logprobs_equal_the_trainer_recompute[spec2-one block]': (
        'tests/rollout/test_engine.py::'
        'test_behaviour_logprobs_equal_the_trainer_recompute[spec2-blocks of 10]',
        'another sampling setting or cache layout'),
    'tests/rollout/test_engine.py::'
    'test_behaviour_logprobs_equal_the_trainer_recompute[spec2-blocks of 8]': (
        'tests/rollout/test_engine.py::'
        'test_behaviour_logprobs_equal_the_trainer_recompute[spec2-blocks of 10]',
        'another sampling setting or cache layout'),
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
    'tests/models/test_batch_invariant.py::'
    'test_the_default_numerics_differ_on_the_same_comparisons': (
        'tests/test_controller.py::test_batch_invariant_run_trains_exactly_on_policy[False-chunks]',
        'the control on the logits comparisons (the counterpart: the run-level control, a gap in '
        '(0, 1e-5) with the default numerics)'),
    'tests/models/test_batch_invariant.py::'
    'test_behaviour_logprobs_equal_the_trainer_bitwise_on_smollm2_shapes': (
        'tests/rollout/test_engine.py::'
        'test_batch_invariant_logprobs_equal_the_trainer_bitwise[attend buckets]',
        "SmolLM2's layer shapes"),
    # tests/test_controller.py
    'tests/test_controller.py::test_batch_invariant_run_trains_exactly_on_policy[True-floor]': (
        'tests/test_controller.py::test_batch_invariant_run_trains_exactly_on_policy[True-chunks]',
        "invariant_rows='floor' (the counterpart: the default 'chunks')"),
    'tests/test_controller.py::test_shared_prefix_scoring_trains_like_full_scoring': (
        _SHARED_LOSS,
        'shared-prefix scoring through a whole run (the counterpart: the trainer update)'),
    # tests/test_resume.py
    'tests/test_resume.py::test_signal_then_relaunch_resumes[15]': (
        'tests/test_storage.py::test_sigterm_then_relaunch_on_gcs_resumes',
        'SIGTERM on a local workdir (the counterparts: SIGTERM on gs://, SIGKILL here: [9])'),
    'tests/test_resume.py::test_three_preemptions_resume_exactly[1-1-0]': (
        'tests/test_resume.py::test_three_preemptions_resume_exactly[4-8-1]',
        'the synchronous schedule (the counterpart: (4, 8), batches in flight)'),
    # tests/test_agent_run.py
    'tests/test_agent_run.py::test_two_smoke_runs_are_equal_bit_for_bit': (
        'tests/test_controller.py::test_same_seed_same_run',
        'a second launch of the agent smoke variant, compared bit for bit (the counterpart: two '
        'runs of one seed are equal; its episodes run the same loop)'),
    'tests/test_agent_run.py::test_a_resumed_multi_turn_run_equals_the_uninterrupted_one': (
        'tests/test_resume.py::test_three_preemptions_resume_exactly[4-8-1]',
        'the resume of a multi-turn episodes run, two launches (the counterpart: exact resume of '
        'the same loop, three preemptions with batches in flight)'),
    # tests/test_benchmark_compile_time.py
    'tests/test_benchmark_compile_time.py::test_each_program_is_measured_in_a_fresh_process': (
        'tests/test_benchmark_compile_time.py::test_compare_gives_scanned_over_unrolled',
        'the benchmark end to end: two fresh processes per program and tree'),
    # tests/test_benchmark_train_step.py
    'tests/test_benchmark_train_step.py::test_both_sides_run_equal_work[1-0]': (
        'tests/test_benchmark_train_step.py::test_both_sides_run_equal_work[2-4]',
        'one pass without chunks (the counterpart: micro-batches and chunked log-probs on both '
        'sides)'),
    # tests/test_benchmark_lora.py
    'tests/test_benchmark_lora.py::test_shared_prefix_batch': (
        _SHARED_LOSS,
        'benchmarks/lora.py again with --shared_prefix (the counterpart: the shared-prefix '
        'update equals the unshared one)'),
    'tests/test_benchmark_lora.py::test_bfloat16_base': (
        'tests/models/test_hf_parity.py::test_bf16_compute_with_fp32_master_weights',
        'benchmarks/lora.py again on a bfloat16 base (the counterpart: bfloat16 compute over '
        'float32 master weights)'),
    # tests/models/test_gguf.py
    'tests/models/test_gguf.py::test_smollm2_config_matches_transformers': (
        'tests/models/test_gguf.py::test_tiny_qwen_matches_transformers',
        "the real SmolLM2 file through transformers' GGUF loader (dequantising 135M parameters; "
        "the counterpart: tiny files of every architecture against the same loader)"),
    'tests/models/test_gguf.py::test_smollm2_state_dict_matches_transformers': (
        'tests/models/test_gguf.py::test_tiny_qwen_matches_transformers',
        "the real SmolLM2 file through transformers' GGUF loader (dequantising 135M parameters; "
        "the counterpart: tiny files of every architecture against the same loader)"),
    # tests/tasks/test_plugins.py
    'tests/tasks/test_plugins.py::test_the_docs_example_runs_through_launch': (
        'tests/tasks/test_plugins.py::'
        'test_the_docs_example_validates_from_the_command_line_and_its_config',
        'a training launch of the docs example task (the counterpart: its command and config, '
        'validated)'),
    # tests/models/test_lora.py
    'tests/models/test_lora.py::test_forward_and_gradient_equal_the_merged_models[targets0]': (
        'tests/models/test_lora.py::test_forward_and_gradient_equal_the_merged_models[targets1]',
        'all seven targets at once (the counterpart: an attention and an MLP target)'),
    'tests/models/test_lora.py::'
    'test_a_local_run_with_lora_trains_the_adapters_and_pushes_them[bfloat16]': (
        'tests/test_lora_resume.py::'
        'test_a_lora_run_sigtermed_and_relaunched_equals_the_uninterrupted_one',
        'the bfloat16 adapter wire (its rounding: '
        'test_the_int8_wire_rounds_each_rank_component_within_half_a_step)'),
    'tests/models/test_lora.py::'
    'test_a_local_run_with_lora_trains_the_adapters_and_pushes_them[int8]': (
        'tests/test_lora_resume.py::'
        'test_a_lora_run_sigtermed_and_relaunched_equals_the_uninterrupted_one',
        'the int8 adapter wire (its rounding: '
        'test_the_int8_wire_rounds_each_rank_component_within_half_a_step)'),
    # tests/models/test_qlora.py
    'tests/models/test_qlora.py::'
    'test_a_tiny_run_trains_samples_the_trainers_policy_and_round_trips': (
        'tests/models/test_qlora.py::'
        'test_the_trainer_holds_an_int8_base_and_trains_only_the_adapters',
        'a whole QLoRA run (the counterpart: the trainer step on the int8 base)'),
    # tests/models/test_quant.py
    'tests/models/test_quant.py::test_a_run_samples_int8_and_trains_the_float32_master': (
        'tests/models/test_quant.py::test_the_int8_engine_records_the_quantised_policys_logprobs',
        'a whole run sampling int8 (the counterpart: the int8 engine and its log-probs)'),
    # tests/backends/test_tpu_env.py
    'tests/backends/test_tpu_env.py::test_two_actors_on_one_v5e_8_host_see_their_own_chips': (
        'tests/backends/test_tpu_env.py::test_v5e_8_two_workers_of_four_chips',
        'two real Ray actors reading the split (the counterpart: the split itself)'),
    # tests/models/test_cpu_attention.py
    'tests/models/test_cpu_attention.py::'
    'test_engine_with_the_kernel_matches_xla_and_the_trainer[spec0]': (
        'tests/models/test_cpu_attention.py::'
        'test_engine_with_the_kernel_matches_xla_and_the_trainer[spec1]',
        'another sampling setting'),
    'tests/models/test_cpu_attention.py::'
    'test_engine_with_the_kernel_matches_xla_and_the_trainer[spec2]': (
        'tests/models/test_cpu_attention.py::'
        'test_engine_with_the_kernel_matches_xla_and_the_trainer[spec1]',
        'another sampling setting'),
    'tests/models/test_cpu_attention.py::'
    'test_the_build_is_cached_by_key_and_an_unwritable_cache_is_reported': (
        'tests/models/test_cpu_attention.py::'
        'test_engine_with_the_kernel_matches_xla_and_the_trainer[spec1]',
        'two fresh builds of the kernel (a C++ compile each; the counterpart builds it or reads '
        'the cache, then runs it)'),
    # tests/rollout/test_engine_layer_loop.py
    'tests/rollout/test_engine_layer_loop.py::test_unrolled_and_scan_sample_the_same_tokens[one '
    'block]': (
        'tests/rollout/test_engine_layer_loop.py::'
        'test_unrolled_and_scan_sample_the_same_tokens[blocks of 8]',
        'a cache of one block'),
    'tests/rollout/test_engine_layer_loop.py::'
    'test_unrolled_and_scan_sample_the_same_tokens[int8 weights]': (
        'tests/rollout/test_engine_layer_loop.py::'
        'test_unrolled_and_scan_sample_the_same_tokens[int8 cache, blocks of 8]',
        'int8 weights (the counterpart: the int8 cache)'),
    # tests/test_colabs.py
    'tests/test_colabs.py::test_agent_notebook_shows_the_tool_an_episodes_masks_and_trains': (
        'tests/test_colabs.py::test_quickstart_runs_and_plots_the_curves',
        "another notebook executed whole (the counterpart executes one; tests/test_docs.py's "
        "test_notebooks_use_only_code_and_config_keys_that_exist checks every notebook's names and "
        "keys)"),
    'tests/test_colabs.py::'
    'test_lora_notebook_plans_a_model_only_lora_fits_on_a_v5e_chip_and_trains': (
        'tests/test_colabs.py::test_quickstart_runs_and_plots_the_curves',
        "another notebook executed whole (the counterpart executes one; tests/test_docs.py's "
        "test_notebooks_use_only_code_and_config_keys_that_exist checks every notebook's names and "
        "keys)"),
    'tests/test_colabs.py::test_staleness_notebook_runs_an_async_run_and_plots_its_histogram': (
        'tests/test_colabs.py::test_quickstart_runs_and_plots_the_curves',
        "another notebook executed whole (the counterpart executes one; tests/test_docs.py's "
        "test_notebooks_use_only_code_and_config_keys_that_exist checks every notebook's names and "
        "keys)"),
    'tests/test_colabs.py::test_distill_notebook_plans_the_teacher_and_lowers_the_kl': (
        'tests/test_distill_resume.py::'
        'test_distillation_preempted_after_step_one_resumes_exactly',
        'the notebook executed whole (the counterpart runs a distillation through the launch, '
        "resumed; tests/test_docs.py's test_notebooks_use_only_code_and_config_keys_that_exist "
        "checks the notebook's names and keys)"),
    'tests/test_colabs.py::test_losses_notebook_plots_what_each_loss_keeps': (
        'tests/test_colabs.py::test_quickstart_runs_and_plots_the_curves',
        "another notebook executed whole (the counterpart executes one; tests/test_docs.py's "
        "test_notebooks_use_only_code_and_config_keys_that_exist checks every notebook's names and "
        "keys)"),
    # tests/test_launch_recipes.py
    'tests/test_launch_recipes.py::'
    'test_the_8b_and_32b_recipes_fit_their_trainer_and_inference_slices[Qwen3-32B]': (
        'tests/test_launch_recipes.py::'
        'test_the_8b_and_32b_recipes_fit_their_trainer_and_inference_slices[Qwen3-8B]',
        'the 32B recipe'),
    # tests/test_launch.py
    'tests/test_launch.py::test_a_second_launch_on_a_busy_workdir_is_refused': (
        'tests/test_multihost.py::test_a_second_job_on_a_busy_workdir_fails_in_every_process',
        'a second one-process launch beside a running one (the counterparts: a held workdir '
        'refused to a job, and tests/test_storage.py on gs://)'),
    'tests/test_launch.py::test_diverging_run_exits_non_zero_naming_the_step': (
        'tests/test_controller.py::test_a_diverging_rl_run_stops_naming_the_step',
        'the exit status of a launched diverging run'),
    'tests/test_launch.py::'
    'test_a_corrupt_model_file_fails_with_one_line_not_a_traceback[_corrupt_hf_dir]': (
        'tests/test_launch.py::'
        'test_a_corrupt_model_file_fails_with_one_line_not_a_traceback[_corrupt_gguf]',
        'a corrupt HF directory (tests/models/test_corrupt_files.py refuses each corruption '
        'in-process)'),
    # tests/trainer/test_efficiency.py
    'tests/trainer/test_efficiency.py::test_chunked_log_probs_equal_full_logits[True-spec0-4]': (
        'tests/trainer/test_efficiency.py::test_chunked_log_probs_equal_full_logits[False-spec1-7]',
        'another sampling setting, chunk or head tying ([True-spec2-64] stays too)'),
    'tests/trainer/test_efficiency.py::test_chunked_log_probs_equal_full_logits[True-spec1-7]': (
        'tests/trainer/test_efficiency.py::test_chunked_log_probs_equal_full_logits[False-spec1-7]',
        'another sampling setting, chunk or head tying ([True-spec2-64] stays too)'),
    'tests/trainer/test_efficiency.py::test_chunked_log_probs_equal_full_logits[False-spec0-4]': (
        'tests/trainer/test_efficiency.py::test_chunked_log_probs_equal_full_logits[False-spec1-7]',
        'another sampling setting, chunk or head tying ([True-spec2-64] stays too)'),
    'tests/trainer/test_efficiency.py::test_chunked_log_probs_equal_full_logits[False-spec2-64]': (
        'tests/trainer/test_efficiency.py::test_chunked_log_probs_equal_full_logits[False-spec1-7]',
        'another sampling setting, chunk or head tying ([True-spec2-64] stays too)'),
    'tests/trainer/test_efficiency.py::'
    'test_micro_batches_give_the_whole_batch_update[loss_config1]': (
        'tests/trainer/test_efficiency.py::'
        'test_micro_batches_give_the_whole_batch_update[loss_config0]',
        'another loss'),
    'tests/trainer/test_efficiency.py::'
    'test_micro_batches_give_the_whole_batch_update[loss_config2]': (
        'tests/trainer/test_efficiency.py::'
        'test_micro_batches_give_the_whole_batch_update[loss_config0]',
        'another loss'),
    # tests/trainer/test_trainer.py
    'tests/trainer/test_trainer.py::test_sharded_step_matches_single_device[mesh_shape1]': (
        'tests/trainer/test_trainer.py::test_sharded_step_matches_single_device[mesh_shape0]',
        'another mesh shape'),
    'tests/trainer/test_trainer.py::test_sharded_step_matches_single_device[mesh_shape2]': (
        'tests/trainer/test_trainer.py::test_sharded_step_matches_single_device[mesh_shape0]',
        'another mesh shape'),
    'tests/trainer/test_trainer.py::'
    'test_lr_decay_steps_config_key_scales_the_second_update[0-1.0]': (
        'tests/trainer/test_trainer.py::'
        'test_lr_decay_steps_config_key_scales_the_second_update[1-0.1]',
        'no decay (the counterpart decays)'),
    # tests/rollout/test_worker.py
    'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[0.7-0-0.9]': (
        'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[0.7-20-0.9]',
        'another temperature/top-k/top-p ([1.3-0-1.0] stays too)'),
    'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[0.7-0-1.0]': (
        'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[0.7-20-0.9]',
        'another temperature/top-k/top-p ([1.3-0-1.0] stays too)'),
    'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[0.7-20-1.0]': (
        'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[0.7-20-0.9]',
        'another temperature/top-k/top-p ([1.3-0-1.0] stays too)'),
    'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[1.0-0-0.9]': (
        'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[0.7-20-0.9]',
        'another temperature/top-k/top-p ([1.3-0-1.0] stays too)'),
    'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[1.0-0-1.0]': (
        'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[0.7-20-0.9]',
        'another temperature/top-k/top-p ([1.3-0-1.0] stays too)'),
    'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[1.0-20-0.9]': (
        'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[0.7-20-0.9]',
        'another temperature/top-k/top-p ([1.3-0-1.0] stays too)'),
    'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[1.0-20-1.0]': (
        'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[0.7-20-0.9]',
        'another temperature/top-k/top-p ([1.3-0-1.0] stays too)'),
    'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[1.3-0-0.9]': (
        'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[0.7-20-0.9]',
        'another temperature/top-k/top-p ([1.3-0-1.0] stays too)'),
    'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[1.3-20-0.9]': (
        'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[0.7-20-0.9]',
        'another temperature/top-k/top-p ([1.3-0-1.0] stays too)'),
    'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[1.3-20-1.0]': (
        'tests/rollout/test_worker.py::test_trainer_recomputes_the_behaviour_log_probs[0.7-20-0.9]',
        'another temperature/top-k/top-p ([1.3-0-1.0] stays too)'),
    # tests/models/test_decoder.py
    'tests/models/test_decoder.py::'
    'test_remat_gives_same_gradients_through_a_prefilled_cache[full]': (
        'tests/models/test_decoder.py::'
        'test_remat_gives_same_gradients_through_a_prefilled_cache[dots]',
        "remat 'full'"),
    'tests/models/test_decoder.py::test_remat_gives_same_loss_and_gradients[full-float32]': (
        'tests/models/test_decoder.py::test_remat_gives_same_loss_and_gradients[full-bfloat16]',
        'another policy and dtype ([dots-float32] stays too)'),
    'tests/models/test_decoder.py::test_remat_gives_same_loss_and_gradients[dots-bfloat16]': (
        'tests/models/test_decoder.py::test_remat_gives_same_loss_and_gradients[full-bfloat16]',
        'another policy and dtype ([dots-float32] stays too)'),
    'tests/models/test_decoder.py::test_cache_in_blocks_equals_full_forward[3-3]': (
        'tests/models/test_decoder.py::test_cache_in_blocks_equals_full_forward[14-3]',
        'another block length and batch ([3-1] stays too)'),
    'tests/models/test_decoder.py::test_cache_in_blocks_equals_full_forward[4-3]': (
        'tests/models/test_decoder.py::test_cache_in_blocks_equals_full_forward[14-3]',
        'another block length and batch ([3-1] stays too)'),
    'tests/models/test_decoder.py::test_cache_in_blocks_equals_full_forward[4-1]': (
        'tests/models/test_decoder.py::test_cache_in_blocks_equals_full_forward[14-3]',
        'another block length and batch ([3-1] stays too)'),
    'tests/models/test_decoder.py::test_unrolled_layers_are_the_scanned_model[in_out]': (
        'tests/models/test_decoder.py::test_unrolled_layers_are_the_scanned_model[out_in]',
        "the 'in_out' layout (the counterpart: the CPU engine's 'out_in')"),
    # tests/test_policy_sampling.py
    'tests/test_policy_sampling.py::test_a_rows_draw_does_not_depend_on_the_batch[spec1]': (
        'tests/test_policy_sampling.py::test_a_rows_draw_does_not_depend_on_the_batch[spec0]',
        'another sampling setting'),
    'tests/test_policy_sampling.py::test_a_rows_draw_does_not_depend_on_the_batch[spec2]': (
        'tests/test_policy_sampling.py::test_a_rows_draw_does_not_depend_on_the_batch[spec0]',
        'another sampling setting'),
    'tests/test_policy_sampling.py::'
    'test_tiny_temperatures_give_no_positive_log_probs[spec_kwargs0]': (
        'tests/test_policy_sampling.py::'
        'test_tiny_temperatures_give_no_positive_log_probs[spec_kwargs2]',
        'no top-p (the counterpart truncates by top-p)'),
    'tests/test_policy_sampling.py::'
    'test_tiny_temperatures_give_no_positive_log_probs[spec_kwargs1]': (
        'tests/test_policy_sampling.py::'
        'test_tiny_temperatures_give_no_positive_log_probs[spec_kwargs2]',
        'no top-p (the counterpart truncates by top-p)'),
    # tests/backends/test_ray.py
    'tests/backends/test_ray.py::test_a_dead_worker_process_is_replaced': (
        'tests/test_async.py::test_a_lost_worker_is_replaced_and_the_run_completes[die]',
        'a Ray worker actor killed (the counterpart: a lost worker replaced in the local '
        'backend; tests/backends/test_ray.py::test_ray_and_local_give_the_same_run keeps Ray)'),
    # tests/backends/test_ray_resume.py
    'tests/backends/test_ray_resume.py::'
    'test_ray_preempted_and_resumed_equals_an_uninterrupted_run': (
        'tests/test_resume.py::test_three_preemptions_resume_exactly[4-8-1]',
        'preemption and resume on the Ray backend (the counterparts: exact resume locally; Ray '
        'and local give the same run)'),
    'tests/backends/test_ray_resume.py::'
    'test_a_lost_trainer_actor_stops_the_run_naming_the_checkpoint': (
        'tests/backends/test_ray.py::test_ray_and_local_give_the_same_run',
        'a killed trainer actor'),
    # tests/backends/test_ray_gang.py
    'tests/backends/test_ray_gang.py::test_each_trainer_process_pushes_only_its_own_shards': (
        'tests/test_multihost.py::'
        'test_two_processes_train_two_steps_as_one_process_with_four_devices',
        'the Ray gang of trainer processes pushing its shards (the counterpart: 2 '
        'jax.distributed processes = 1; the per-shard push: tests/paramserver/test_shards.py)'),
    'tests/backends/test_ray_gang.py::test_two_trainer_processes_train_as_one_with_four_devices': (
        'tests/test_multihost.py::'
        'test_two_processes_train_two_steps_as_one_process_with_four_devices',
        'the same guarantee on the Ray backend'),
    # tests/test_imports.py
    'tests/test_imports.py::test_every_module_imports_first_in_a_fresh_package': (
        'tests/test_imports.py::test_the_package_has_no_import_cycle',
        'each module imported first in a fresh process (the counterpart: the import graph has no '
        'cycle, function-level imports included; every module is imported by the suite)'),
    # tests/test_async.py
    'tests/test_async.py::test_lockstep_on_threads_reproduces_the_synchronous_run': (
        'tests/test_async.py::test_async_run_is_deterministic_under_random_timings',
        '(1, 1) on threads against the inline reference (the counterpart compares (4, 8) on '
        'threads, under random timings, with the inline run)'),
    'tests/test_async.py::test_weight_update_accounting': (
        'tests/paramserver/test_publisher.py::'
        'test_each_version_is_pushed_once_in_the_workers_dtype',
        'the push accounting counted through a whole run (the counterpart: each version pushed '
        'once; tests/paramserver/test_receiver.py: pulled whole once, then deltas)'),
    # tests/test_controller.py
    'tests/test_controller.py::test_state_restores_the_run_exactly[0.5]': (
        'tests/test_resume.py::test_three_preemptions_resume_exactly[4-8-1]',
        'the controller state restored in-process, with replay (the counterpart: three '
        'preemptions of a launched run resume exactly)'),
    # tests/backends/test_ray.py
    'tests/backends/test_ray.py::'
    'test_the_server_actor_keeps_the_object_stores_arrays_and_they_never_change': (
        'tests/backends/test_ray.py::test_ray_and_local_give_the_same_run',
        "the server actor's object-store arrays, checked one by one (the counterpart: a Ray run "
        "equals the local run)"),
    'tests/backends/test_ray.py::'
    'test_on_one_machine_versions_move_through_the_servers_shared_memory': (
        'tests/backends/test_ray.py::test_ray_and_local_give_the_same_run',
        'the shared-memory transport on one machine (tests/paramserver/test_shm.py: the '
        'transport itself)'),
    # tests/test_tpu_compile.py
    'tests/test_tpu_compile.py::'
    'test_the_untied_trainer_step_on_four_hosts_fits_and_matches_the_plan': (
        'tests/test_tpu_compile.py::'
        'test_the_tied_trainer_step_on_one_host_fits_and_matches_the_plan',
        'an XLA:TPU compile of the untied model on a four-host v5e-16 (the counterpart: the tied '
        'model on one host, held to the same tolerance)'),
    'tests/test_tpu_compile.py::test_the_decode_step_on_four_hosts_fits': (
        'tests/test_tpu_compile.py::test_the_decode_step_on_one_host_fits_beside_the_trainer',
        'an XLA:TPU compile of the decode step on four hosts'),
    # tests/test_async.py
    'tests/test_async.py::test_partial_rollouts_are_continued_deterministically': (
        'tests/test_resume.py::test_partial_rollouts_resume_exactly',
        'APRIL through a (2, 3) run under random timings (the counterpart: an APRIL run, '
        'continued groups and all, preempted and resumed exactly; '
        'tests/rollout/test_engine.py::test_partial_rollouts_continue_as_if_uninterrupted[spec0]: '
        'a continued sample)'),
    'tests/test_async.py::test_free_running_swaps_weights_mid_generation_within_the_bound': (
        'tests/rollout/test_worker.py::test_free_running_pulls_between_decode_steps',
        "the free-running schedule through a whole run (the counterpart: the worker pulls "
        "between decode steps and records each token's version)"),
    # tests/test_benchmark_lora.py
    'tests/test_benchmark_lora.py::test_train_step_figures': (
        'tests/models/test_lora.py::test_peft_export_loads_in_peft_and_transformers',
        "benchmarks/lora.py end to end against peft (the counterpart: our adapters, exported, "
        "give peft's logits)"),
    'tests/test_benchmark_lora.py::test_memory_figures': (
        'tests/models/test_lora.py::test_only_the_adapters_train',
        "the benchmark's memory accounting (the counterpart: optimizer state for the adapters "
        "only)"),
    'tests/test_benchmark_lora.py::test_sync_figures': (
        'tests/paramserver/test_publisher.py::'
        'test_adapter_sync_pushes_the_base_once_then_the_adapters',
        "the benchmark's sync byte counts (the counterpart: the publisher pushes the base once, "
        "then the adapters)"),
    # tests/models/test_kv_int8.py
    'tests/models/test_kv_int8.py::test_a_run_samples_with_an_int8_cache_and_trains': (
        'tests/models/test_kv_int8.py::test_the_engine_attends_to_the_dequantised_cache[spec0]',
        'a whole run sampling from an int8 KV cache (the counterpart: the engine on the int8 '
        'cache against the dequantised one)'),
    'tests/models/test_kv_int8.py::test_the_engine_attends_to_the_dequantised_cache[spec1]': (
        'tests/models/test_kv_int8.py::test_the_engine_attends_to_the_dequantised_cache[spec0]',
        'sampled instead of greedy'),
    # tests/models/test_qlora.py
    'tests/models/test_qlora.py::test_remat_gives_the_same_adapter_gradients[full]': (
        'tests/models/test_qlora.py::test_remat_gives_the_same_adapter_gradients[dots]',
        "remat 'full'"),
    # tests/models/test_lora.py
    'tests/models/test_lora.py::'
    'test_a_local_run_with_lora_trains_the_adapters_and_pushes_them[float32]': (
        'tests/test_lora_resume.py::'
        'test_a_lora_run_sigtermed_and_relaunched_equals_the_uninterrupted_one',
        'a LoRA run in this process (the counterparts: a launched LoRA run, SIGTERMed and '
        'resumed exactly; tests/paramserver/test_publisher.py: the base once, then the adapters)'),
    # tests/rollout/test_engine_extend.py
    'tests/rollout/test_engine_extend.py::'
    'test_turn_two_after_extend_equals_a_prefill_from_scratch[spec1-one block]': (
        'tests/rollout/test_engine_extend.py::'
        'test_turn_two_after_extend_equals_a_prefill_from_scratch[spec1-blocks of 8]',
        'another cache layout'),
    'tests/rollout/test_engine_extend.py::'
    'test_turn_two_after_extend_equals_a_prefill_from_scratch[spec1-blocks of 10]': (
        'tests/rollout/test_engine_extend.py::'
        'test_turn_two_after_extend_equals_a_prefill_from_scratch[spec1-blocks of 8]',
        'another cache layout'),
    'tests/rollout/test_engine_extend.py::'
    'test_turn_two_after_extend_equals_a_prefill_from_scratch[spec0-blocks of 8]': (
        'tests/rollout/test_engine_extend.py::'
        'test_turn_two_after_extend_equals_a_prefill_from_scratch[spec0-one block]',
        'another cache layout'),
    'tests/rollout/test_engine_extend.py::'
    'test_turn_two_after_extend_equals_a_prefill_from_scratch[spec0-blocks of 10]': (
        'tests/rollout/test_engine_extend.py::'
        'test_turn_two_after_extend_equals_a_prefill_from_scratch[spec0-one block]',
        'another cache layout'),
    # tests/models/test_presets.py
    'tests/models/test_presets.py::test_parameter_counts_match_published[qwq-32b]': (
        'tests/models/test_presets.py::test_parameter_counts_match_published[qwen3-8b]',
        "a 32B preset's count (the counterpart counts the same architecture at 8B; each count "
        "traces the model's init)"),
    'tests/models/test_presets.py::test_parameter_counts_match_published[qwen3-32b]': (
        'tests/models/test_presets.py::test_parameter_counts_match_published[qwen3-8b]',
        "a 32B preset's count (the counterpart counts the same architecture at 8B; each count "
        "traces the model's init)"),
}
