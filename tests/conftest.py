"""Shared test settings: deterministic, quiet, and sized for a 2-core CPU machine."""

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*does not have many workers.*")

# One torch thread per test process, with or without xdist (CI's `-n 2` runs one process per core):
# the test models are tiny and gain nothing from a second thread, and on a busy 2-core machine the
# threads wait on each other (a LoRA test took 3 s with one thread and 21-43 s with two).
torch.set_num_threads(1)


# The `slow` tests: over about 2 s each on a busy 2-core CPU (one torch thread; with the set-up of
# the model they share), from pytest --durations, seconds in the comments; and every test that starts
# processes (marked `distributed` where it is written) but the two of CI_DISTRIBUTED. CI, and the
# README's test command, run `-m "not slow"`: about 5 minutes on 2 cores, with the invariants
# harness (issue 29), the first-step tests, one DDP and one FSDP2 run; `pytest -m slow` runs the
# rest (about 15 minutes), and a plain `pytest` everything. "*": every test of the module. A name is
# a test function (all its parameters) or one parametrized test ("name[param]").
CI_DISTRIBUTED = {
    "test_callback.py": "test_ddp_ranks_apply_the_plan_of_rank_zero",  # DDP, 2 gloo ranks, as a script: 19 s
    "test_sharded.py": "test_prediction_matches_a_real_two_process_fully_shard_run",  # FSDP2, 2 ranks: 24 s
}
SLOW = {
    "test_residual_parts.py": ("test_a_bottleneck_through_its_parts_lowers_the_least_peak_holds_and_gives_equal_gradients",),  # 5 s (two profiles)
    "test_callback.py": ("test_hugging_face_checkpointing_is_taken_over_with_one_warning",  # 7 s loaded (two runs)
                         # two resumed fits, one planning again: 14 s loaded
                         "test_resume_with_the_cost_named_does_not_profile_and_another_cost_plans_again"),
    "test_models.py": "*",  # one GPT-2 profiled (module fixture): 4.0 s set-up at load 2, 6.4 s at load 6; 1-3 s of tests
    "test_accumulation.py": "*",  # Accelerate 24 s, Lightning 11 s
    # Lightning 11-12 s, Accelerate 3-14 s, the Trainer with LoRA and padding 54 s (a loaded 2-core machine; 33 s CPU)
    "test_first_step_integrations.py": ("test_the_trainer_with_lora_accumulation_and_padding_holds_the_budget_from_the_first_step",),
    # Two or three fake-H100 profiles of a 1-layer Llama each (shared through a cache when run together)
    "test_fake_attention.py": ("test_sdpa_attention_planned_for_an_h100_is_linear_in_the_sequence",  # 8 s
                               "test_eager_attention_is_priced_quadratic_and_the_plan_names_the_layer",  # 5 s
                               "test_a_mask_of_ones_plans_as_no_mask_and_padding_keeps_its_quadratic_bias"),  # 6-12 s
    "test_fake_moe.py": ("test_moe_is_planned_on_fake_tensors_for_an_h100_in_every_precision[bf16-mixed]",  # 10 s
                         "test_moe_is_planned_on_fake_tensors_for_an_h100_in_every_precision[bf16-true]"),  # 9 s
    "test_roofline.py": ("test_two_processes_price_the_same_profile_alike_and_choose_the_same_plan",),  # 12 s, 2 processes
    "test_padding_plans.py": "*",  # fake profiles of a tiny Llama and a plain run: 4.5-7 s (26-31 s loaded)
    "test_frozen.py": "*",  # LoRA/PEFT models trained for real: 2-5 s each
    # two real profiles of a tiny Llama, then three measured steps (6-9 s loaded); a fake profile with tiling and
    # offload (6 s, 19 s loaded)
    "test_tiled_mlp.py": ("test_a_budget_only_a_tiled_plan_meets_is_met_as_predicted",
                          "test_fake_planning_tiles_a_meta_model",
                          "test_a_refusal_names_tile_mlp_where_a_stage_with_an_mlp_binds"),  # 2 real profiles: 17 s loaded
    # TRL's SFTTrainer, two runs each; each new shape is planned on fake tensors through TRL's fused head
    # (its tiled loop: ~5 s a profile on a loaded 2-core machine): 13-37 s each, loaded; GRPO, RLOO (generation in
    # the step) 12-22 s (23-49 s loaded), RewardTrainer 7 s (25 s loaded), the DistillationTrainer's refusal 0.6-1.7 s, GKD 29 s loaded
    "test_trl.py": "*",
    # two fake profiles of a 2-block MLP with offload options (1 and 2 GPUs): 4.4 s on a loaded 2-core machine
    "test_sharded_stored.py": "*",
    "test_repeated.py": ("test_sharded_extrapolated_profile_equals_full_profile",  # 57 s
                         "test_extrapolated_profile_equals_full_profile",  # 13-34 s each
                         "test_layers_that_differ_are_profiled_whole"),  # 13 s
    "test_profile.py": ("test_profiling_leaves_parameters_gradients_buffers_rng_and_optimizer_as_found",  # 2.3 s (load 7)
                        "test_identical_layers_share_their_measured_seconds_and_the_rest_stays_measured"),  # 4 s
    "test_segments.py": ("test_a_cnn_stem_is_a_stage_and_recomputing_it_cuts_the_least_peak_with_equal_gradients",  # 4.3 s (load 7)
                         "test_predicted_peak_of_plans_with_segments_within_5_percent"),  # 10 s, 6 s
    "test_compile.py": ("test_plan_then_compile_with_inductor_keeps_losses_and_batchnorm_statistics",  # 25 s
                        "test_autoremat_plans_a_module_compiled_in_init_configure_model_or_for_fit",  # 9-13 s each
                        "test_compile_then_plan_wraps_the_original_modules_and_the_compiled_step_uses_less_memory"),  # 5 s
    "test_sac.py": ("test_save_projections_is_offered_where_attention_runs_as_batched_matmuls",  # 24 s
                    "test_a_policy_runs_under_torch_compile",  # 7 s
                    "test_gradients_bit_equal_on_gpt2_with_dropout_under_a_mixed_plan",  # 5 s
                    "test_gradients_and_batchnorm_statistics_bit_equal_under_every_policy",  # 5 s each
                    # the three on the module's profiled model (8 s set-up)
                    "test_profile_offers_policies_and_prices_them",
                    "test_predicted_peak_within_5_percent_of_measured_for_plans_with_policies",
                    "test_roofline_plan_uses_policies_where_they_are_cheapest"),
    "test_compile_policies.py": ("test_policies_under_inductor_give_the_gradients_of_eager_training",  # 6-8 s
                                 "test_a_step_compiled_in_place_or_by_lightning_is_priced_as_compiled"),  # 4.5 s
    # a real profile of a tiny Gemma-2 and two measured windows: 4 s loaded, 7 s more loaded
    "test_hf_cache.py": ("test_gemma2_with_its_cache_on_is_recomputed_with_its_own_gradients_within_the_budget",
                         # a chunk_loss profile (11 head runs) and two measured windows: 13-33 s loaded
                         "test_a_fused_head_planned_with_the_cache_on_is_measured_as_predicted"),
    "test_accelerate.py": ("test_training_loop_stays_under_budget_with_same_losses",  # 12 s
                           "test_budget_min_holds_with_the_outputs_the_loop_keeps"),  # 7 s
    "test_batch_size.py": ("test_offload_batch_fit_scales_host_bytes_and_the_search_stays_within_host_memory",  # 10 s
                           "test_binsearch_transcription_matches_lightning[13]",  # 2.3 s
                           # the three on the GPT-2 search (2.5 s set-up)
                           "test_chosen_batch_fits_the_budget_when_measured",
                           "test_at_least_twice_the_batch_without_recomputation",
                           "test_costs_no_more_real_steps_than_lightning_binsearch"),
    "test_fake.py": ("test_fake_profile_equals_the_real_one_and_plans_the_same",  # 3.7-6.2 s each at load 4
                     "test_fake_planning_models_the_precision_and_says_which",  # 4 s
                     "test_a_gpu_target_runs_attention_dropout_in_the_fused_kernel_the_gpu_uses",  # 3 s
                     "test_a_7b_llama_is_planned_for_an_80gb_gpu_without_allocating_it"),  # 4 s, a subprocess
    "test_chunked_loss.py": ("test_a_budget_only_chunking_reaches_is_met_with_chunk_loss_and_refused_without",  # 10-20 s
                             "test_fake_planning_chunks_the_head_of_a_model_on_the_meta_device",  # 10-35 s
                             "test_the_hf_trainer_chunks_the_loss_with_the_same_losses_under_accumulation",  # 40 s
                             "test_the_head_stage_of_a_deep_fake_profile_is_extrapolated_exactly"),  # 40-60 s
    "test_fused_loss.py": ("test_a_fused_plan_is_measured_in_the_profile_and_predicted_within_one_percent",  # 8 s
                           "test_a_loss_neither_kind_computes_is_not_offered_and_the_profile_says_why",  # 5 s
                           # inductor compiles a 2-layer Llama with a fused head: 33 s CPU, 222 s wall loaded
                           "test_a_fused_plan_under_inductor_gives_the_models_own_loss_and_gradients"),
    "test_fingerprint.py": ("test_batches_that_grow_mid_run_are_planned_again_and_the_budget_holds",  # 3 s
                            "test_a_resumed_run_with_larger_batches_plans_again"),  # 2.5 s
    "test_gpu_check.py": "*",  # the GPU check's smoke run on the CPU (an MLP; a Llama with every feature): ~60 s
    "test_fsdp_batch_size.py": ("test_a_trial_that_fails_on_any_rank_fails_on_all",),  # 7 s
    # find_remat_seq_len: each search profiles four or five lengths (at load 3-7 on 2 cores): a 2-block MLP's
    # 3-4 s, the 4-block MLP's 6 s (set-up of the next two), a 2-block transformer's 9 s, on fake tensors 12 s,
    # the command line 8 s, advice (fake sharded re-profiles) 7 s, the example (a tiny Llama) 18 s
    "test_seq_len.py": ("test_a_short_search_holds_the_budget_for_real_and_the_next_length_does_not_fit",
                        "test_a_tiled_mlp_is_predicted_at_lengths_whose_chunk_counts_differ",  # 4 tiled profiles: 10-17 s CPU
                        "test_the_longest_length_runs_for_real_within_the_budget",
                        "test_the_first_length_past_it_is_over_the_budget_and_what_binds_is_named",
                        "test_a_transformer_at_its_longest_length_holds_the_budget_for_real",
                        "test_a_fake_search_for_a_gpu_profiles_the_answer_and_runs_nothing",
                        "test_the_command_line_prints_the_answer_and_the_lengths_it_profiled",
                        "test_advice_names_the_knobs_at_the_first_length_that_does_not_fit",
                        "test_the_example_finds_a_longer_sequence_and_confirms_it",
                        # the 4-block MLP's full search (the module fixture) and one of three profiles: 8-11 s
                        "test_three_profiles_predict_the_answer_the_full_search_profiles_and_it_holds_for_real",
                        # two real profiles of a tiny Llama with tiled MLPs: 3.6 s
                        "test_a_first_length_whose_tiled_mlps_run_in_two_chunks_is_noted"),
    "test_cli.py": ("test_installed_script_prints_tables",),  # 6 s, a subprocess
    # the integration pages' blocks that run on the CPU (fake profiles of every new shape), at load 1
    "test_doc_blocks.py": ("test_block_runs[shapes.md-1]",  # 23 s (5 fake profiles)
                           "test_block_runs[accelerate.md-5]",  # TRL's SFTTrainer: 20 s (a fake profile through its head)
                           "test_block_runs[accelerate.md-6]",  # TRL's GRPOTrainer: 7 s (generation, two shapes)
                           "test_block_runs[fabric.md-0]",  # 13 s (4 fake profiles); 55 s at load 9-11
                           "test_block_runs[README.md-0]",  # 7.5 s, transformers' import included
                           # the tutorial's chain: breakdown 2.5 s, + plan 4.4 s, + train and measure 4.9 s
                           "test_block_runs[tutorial.md-1]", "test_block_runs[tutorial.md-2]",
                           "test_block_runs[tutorial.md-3]",
                           "test_block_runs[selective_checkpointing.md-0]"),  # 12 s (66 s at load 3): GPT-2 under every policy
    "test_faults.py": ("test_an_exception_at_every_forward_call_of_planning_surfaces_as_itself",),  # 2-6 s each
    "test_docs_figures.py": ("test_the_batch_size_example_records_what_it_prints",),  # 7 s, a subprocess
    "test_display.py": ("test_the_7b_example_in_bf16_mixed_ends_in_one_clean_line_with_advice_that_applies",),  # 10 s, a subprocess
    # Real trackers (a loaded 2-core machine): the Trainer to three trackers 23-25 s, its resume 13-29 s (two
    # runs), Lightning's TensorBoardLogger 5-11 s
    "test_trackers.py": "*",
    "test_sharded.py": ("test_budget_below_the_sharded_peak_names_the_world_size_that_fits",  # 6 s
                        "test_sharded_static_terms_are_the_unsharded_ones_over_the_world_size",  # 3 s
                        "test_the_command_line_plans_one_gpu_of_n"),  # 3.5 s
    "test_offload.py": ("test_fake_planning_with_offload_beats_recompute_only_at_a_tight_budget",  # 5 s
                        "test_offloaded_stages_do_not_count_the_hidden_state_their_caller_released",  # 5 s
                        "test_fake_memory_with_prefetch_matches_the_model",  # 3 s
                        "test_checkpoint_input_offload_is_planned_held_and_predicted"),  # 8 s
    # fake Llama plans under three optimizer settings (a module fixture), then the knobs' re-profiles
    # fake sharded (FSDP2) profiles of a tiny Llama, on a loaded 2-core machine
    "test_more_gpus.py": ("test_no_sharded_reprofile_where_even_infinitely_many_gpus_cannot_fit",  # 7 s
                          "test_the_next_world_size_from_a_sharded_profile_fits_as_predicted"),  # 16 s
    # fake profiles of a 2-block MLP, sharded over 2 and not, with and without offload (loaded)
    "test_sharded_offload.py": ("test_sharded_offload_profile_holds_no_more_outside_the_stages_than_without",  # 6 s
                                "test_refused_offload_plan_names_the_world_size_whose_sharded_offload_plan_fits"),  # 8 s
    "test_binding.py": ("test_budget_too_small_names_each_knob_with_the_peak_planning_with_it_gives",  # 10 s
                        "test_the_optimizer_step_binds_and_its_advice_equals_planning_with_each_setting"),  # 8 s
    "test_report.py": ("test_breakdown_without_optimizer_has_no_state",  # 5 s
                       "test_pareto_sweep_and_plot"),  # 5 s
    "test_arguments.py": ("test_the_command_line_plans_through_the_planning_service",),  # 3 s
    # the budget fixture: 3 s (a fake profile); each run's own fake profiles
    "test_installed.py": ("test_shape_plans_keeps_the_plan_installed_when_a_new_shape_gets_the_same_plan",  # 5 s
                          "test_autoremat_runs_every_step_under_its_plan_as_planned",  # 12 s
                          "test_the_accelerate_session_runs_every_planned_step_under_its_plan_as_planned"),  # 6 s
    "test_hf_trainer.py": ("test_trainer_holds_the_budget_from_the_environment_with_the_same_losses",  # 2-3 s each
                           "test_the_trainer_s_own_gradient_checkpointing_is_taken_over",  # 17 s loaded (two runs)
                           "test_trainer_follows_the_batch_shape_under_dynamic_padding",  # 13-18 s (two runs)
                           "test_the_least_peak_holds_under_accumulation_with_what_the_trainer_carries_between_micro_batches"),  # 3 s
    "test_manual_optimization.py": ("test_autoremat_plans_manual_optimization_with_two_optimizers",  # 5 s
                                    "test_plan_remat_counts_every_optimizer_in_a_list_or_tuple",  # 2.5 s
                                    "test_autoremat_plans_manual_optimization_on_fake_tensors"),  # 2-5 s
    # the three on the module's runs with and without plans (15 s set-up: fake profiles of new shapes)
    # planning runs inside torch.profiler's windows (fake profiles of each new layout): 4.6-7.7 s each at a load of 12
    "test_shape_layouts.py": ("test_autoremat_plans_images_that_grow_and_a_resumed_run_finds_their_plans",
                              "test_shape_plans_plan_images_that_grow_in_height_and_width",
                              "test_a_dict_batch_where_a_key_appears_is_planned_again",
                              "test_accelerate_plans_a_dict_batch_where_a_key_appears_again"),
    "test_shape_plans.py": ("test_plain_loop_holds_the_budget_every_step_with_no_real_profile",
                            "test_plain_loop_trains_exactly_as_without_the_package",
                            "test_each_plan_is_the_optimal_plan_of_its_shape",  # 2 s
                            "test_step_peak_agrees_with_memtracker_on_a_plain_step",  # 2 s
                            "test_lightning_autoremat_follows_the_batch_shape",  # 15 s
                            "test_accelerate_session_follows_the_batch_shape",  # 10 s
                            "test_plan_for_largest_changes_the_plan_only_when_the_largest_shape_grows"),  # 2.5 s
    # the trunk run twice: its profile (2 s set-up), real and fake (2.4 s), 5 plans measured and 2 trained (1.3 s)
    "test_calls.py": ("test_each_run_of_the_trunk_is_a_place_and_costs_its_recompute",
                      "test_every_plan_predicted_to_the_byte_and_solved_plans_within_the_budget"),
    "test_restricted.py": "*",  # four fake profiles of a tiny Llama with every long-context option: 59 s CPU (5 min loaded)
    "test_user_hooks.py": ("test_hooks_fire_as_without_the_package_under_autoremat",  # 3.5 s
                           "test_hooks_fire_as_without_the_package_under_shape_plans_and_one_that_reads_values_plans"),  # 4 s
}


def _is_slow(item) -> bool:
    if item.get_closest_marker("distributed") is not None:
        return CI_DISTRIBUTED.get(item.path.name) != getattr(item, "originalname", item.name)
    names = SLOW.get(item.path.name)
    return names == "*" or (names is not None and (item.name in names or getattr(item, "originalname", None) in names))


# Tests of the CI tier that took 0.5 s or more (tests/record_durations.py writes the file): not in the
# `quick` selection, `pytest -m quick`, under a minute on 2 cores while working.
_NOT_QUICK = set(json.loads((Path(__file__).parent / "durations.json").read_text()))


def _module_fixtures(item) -> set[tuple[str, str]]:
    """(module, name) of the module-scoped fixtures of its own module that a test uses."""
    module = item.nodeid.split("::")[0]
    info = getattr(item, "_fixtureinfo", None)
    return set() if info is None else {(module, name) for name, defs in info.name2fixturedefs.items()
                                       if defs[-1].scope == "module" and defs[-1].baseid == module}


def pytest_collection_modifyitems(items):
    for item in items:
        # Tests that share a profiled model (a module-scoped fixture per model) run on one worker, so
        # each model is profiled once under `pytest -n 2 --dist loadgroup`.
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "profiled" in callspec.params:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}-{callspec.params['profiled']}"))
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
    # A module fixture is set up by the first test that runs with it: the recorded durations charge it
    # to a test outside `quick`, but under `-m quick` a quick test sharing it paid it (test_callback.py's
    # two fits: 21 s of a 273 s quick run). Such tests are not quick.
    slow_fixtures = set().union(*(_module_fixtures(item) for item in items if item.get_closest_marker("slow")
                                  or item.nodeid in _NOT_QUICK))
    for item in items:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("distributed") is None \
                and item.nodeid not in _NOT_QUICK and not _module_fixtures(item) & slow_fixtures:
            item.add_marker(pytest.mark.quick)
    # A renamed test must not drop out of the list unnoticed.
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        names = SLOW.get(Path(module.__file__).name)
        if isinstance(names, tuple):
            gone = [n for n in names if not hasattr(module, n.split("[")[0])]
            if gone:
                raise pytest.UsageError(f"tests/conftest.py SLOW names tests {Path(module.__file__).name} no longer "
                                        f"has: {gone}")


def pytest_sessionfinish(session):
    import sys

    ranks = sys.modules.get("tests.gloo_ranks")
    if ranks is not None:  # the two-rank processes the session started (tests/gloo_ranks.py)
        ranks.stop_ranks()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    on a busy 2-core machine two threads spin against each other and make every step several times slower;
    these tests measure memory, not speed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
