"""Test set-up: 8 simulated CPU devices and float64 available, set before jax initialises."""

import os
import pathlib

# The suite is compile-bound: LLVM's -O0 for the CPU backend compiles about a quarter faster and
# changes no floating-point semantics (XLA's HLO passes, fusion included, still run).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                   "--xla_backend_optimization_level=0")

# The suite runs on CPU devices; naming the platform also lets an installed CUDA plugin register
# without a GPU, for the ahead-of-time compiles of tests/test_aot.py.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)  # library code always passes explicit dtypes
jax.devices()  # the 8 devices start now: a test's CLI call cannot shrink them for later tests


def require_devices(count: int) -> None:
    """Skip (not fail) when the machine has fewer devices than a mesh needs."""
    if jax.device_count() < count:
        pytest.skip(f"needs {count} devices, have {jax.device_count()}")


@pytest.fixture
def mesh_of():
    """``mesh_of(4)`` -> a ``model=4`` mesh on the first 4 devices; ``mesh_of("data=2,model=4")``
    -> that mesh on the first 8. Skips when the machine has too few devices."""
    from jphantom.mesh import MeshConfig, first_devices

    def build(shape, axis: str = "model"):
        config = MeshConfig.parse(shape) if isinstance(shape, str) else MeshConfig.of({axis: shape})
        require_devices(config.device_count)
        return config.build(first_devices(config.device_count))

    return build


# The longest files first: `make test` sends whole files to its two workers (pytest-xdist's
# loadfile, so that a file's tests share their compiled steps) in collection order, and a long
# file taken last leaves the other worker idle at the end. Seconds per file on 2 cores, measured
# with `pytest -m "not slow" -n 2 --dist loadfile --durations=0` (refresh when they change much).
LONGEST_FIRST = ("test_docs.py", "test_llama.py", "test_token_mean.py", "test_hf_families.py",
                 "test_pipeline.py", "test_transformer.py", "test_user_models.py", "test_pmm3d.py",
                 "test_expert.py", "test_checkpoint.py", "test_families.py", "test_phantom.py",
                 "test_run.py", "test_attention_kernels.py", "test_zero_bubble_run.py",
                 "test_verify.py", "test_models.py", "test_zero.py", "test_chunked_loss.py",
                 "test_tensor.py", "test_hlo.py", "test_singleton_axes.py", "test_remat.py",
                 "test_data_parallel.py", "test_gpt2_nnx.py", "test_resilience.py",
                 "test_context.py", "test_byo_model.py", "test_distributed.py",
                 "test_master_weights.py")


# `make test`'s 10-minute budget: these long tests repeat what faster tests of the same file check
# (another mesh, schedule or precision of the same path) and run in `make test-all` (marked slow
# here, by node id, so the list is in one place).
BUDGET_SLOW = {
    # the fast suite's budget after packing and the AMD targets: each repeats a faster test of
    # its file (the FNUZ recipe test, the token reader's resume unit test, the ragged-mask token
    # mean cells, the other families' tensor cells)
    "test_fp8.py::test_an_fp8_step_under_a_layout_equals_the_one_device_fp8_step[tensor-fnuz]",
    "test_tokens.py::test_a_resumed_token_run_trains_on_the_batches_of_an_uninterrupted_one",
    "test_token_mean.py::test_a_mean_of_rank_means_is_not_the_token_mean",
    "test_families.py::test_every_family_under_its_strategies_equals_its_one_device_run"
    "[mistral-tensor-data=2,model=2]",
    "test_composition.py::test_cell[pipeline+experts]",
    "test_byo_model.py::test_stacked_user_model_pipelined_equals_one_device[1f1b-tensor]",
    "test_byo_model.py::test_non_elementwise_optax_updates_equal_one_device[1]",
    "test_loss_scaling.py::test_float16_gpt2_trains_as_float32",
    "test_transformer.py::test_phantom_transformer_equals_its_dense_equivalent[phantom-data=4,model=2]",
    "test_moe_transformer.py::test_moe_transformer_equals_the_single_device_model"
    "[tensor-data=2,expert=2,model=2-True-kw5]",
    "test_checkpoint.py::test_a_resumed_run_continues_the_loss_curve_exactly[gspmd]",
    "test_compare.py::test_compare_uses_a_power_meter_when_given",
    "test_train.py::test_training_reaches_the_target_and_stops[phantom-extra0]",
    "test_transformer.py::test_transformer_equals_dense_in_float64[tensor-model=4-True]",
    "test_llama.py::test_llama_pipeline_with_remat_equals_one_device[dots_saveable]",
    "test_llama.py::test_mixtral_expert_parallel_equals_one_device[data2-expert2-model2]",
    "test_moe_transformer.py::test_moe_step_moves_two_all_to_alls_each_way_per_moe_layer[True]",
    "test_transformer.py::test_tensor_transformer_equals_dense[model=2-False]",
    "test_transformer.py::test_tensor_transformer_equals_dense[data=2,model=4-True]",
    "test_pmm3d.py::test_pmm3d_moe_equals_one_device_and_gathers_its_tokens_over_y"
    "[expert=2,x=2,y=2]",
    "test_zero.py::test_zero_trains_like_one_device[phantom-data=2,model=4-3]",
    "test_plan.py::test_plan_work_is_bounded_in_the_depth",
    "test_run.py::test_inspect_labels_cpu_bytes_of_16_bit_collectives_and_an_empty_breakdown",
    # covered by the zero-bubble executor's tests of the same checks (tests/pipeline/test_zero_bubble_run.py)
    "test_pipeline.py::test_ffn_pipeline_with_data_and_model_parallelism[tensor-gpipe-1]",
    "test_pipeline.py::test_ffn_pipeline_with_data_and_model_parallelism[tensor-1f1b-1]",
    "test_pipeline.py::test_stage_body_runs_as_often_as_the_schedule_says[interleaved-1f1b-4-2]",
    "test_pipeline.py::test_pipelined_step_moves_what_the_schedule_needs[phantom-gpipe-4-1]",
    "test_pipeline.py::test_ffn_pipeline_equals_unpipelined[1-gpipe-1-4]",
    # CLI end-to-end runs whose paths faster tests of the same files cover
    "test_moe_cli.py::test_train_ted_with_dtd_and_cac_reports_dropped_tokens",
    "test_checkpoint.py::test_a_tensor_checkpoint_restores_on_other_meshes",
    "test_gpt2_nnx.py::test_train_gpt2_module_from_and_to_a_hf_directory",
    "test_zero_cli.py::test_train_zero3_with_accumulation_and_clipping_matches_zero0",
    "test_train.py::test_same_seed_gives_the_same_loss_curve",
    "test_zero_bubble_run.py::test_zero_bubble_equals_unpipelined[zb-h1-4-2]",
    "test_gpt2_nnx.py::test_gpt2_module_under_megatron_sp_equals_one_device",
    "test_train.py::test_training_reaches_the_target_and_stops[tensor-t1-extra1]",
    "test_train.py::test_training_reaches_the_target_and_stops[dense-extra2]",
    "test_moe_cli.py::test_inspect_lists_the_all_to_alls_over_expert",
    # siblings of a faster cell of the same idea that stays in the fast suite (issue 44: one
    # exactness cell per idea in `make test`, the others in `make test-all`)
    "test_context.py::test_context_parallel_step_equals_one_device"
    "[llama-tensor-context=2-options0-step_options0]",
    "test_context.py::test_context_parallel_step_equals_one_device"
    "[llama-tensor-context=4-options1-step_options1]",
    "test_context.py::test_context_parallel_step_equals_one_device"
    "[llama-tensor-context=4,model=2-options7-step_options7]",
    "test_context.py::test_ring_moves_c_minus_1_kv_chunks_each_way[context=4-True]",
    "test_token_mean.py::test_ragged_masks_equal_the_one_device_token_mean[tensor-sp]",
    "test_token_mean.py::test_ragged_masks_equal_the_one_device_token_mean[context2]",
    "test_singleton_axes.py::test_no_collective_runs_over_a_size_one_axis[argv1-allowed1]",
    "test_user_models.py::test_named_user_norms_and_meta_names_are_exact[tensor-sp]",
    "test_user_models.py::test_flax_multi_head_attention_is_tensor_parallel_and_exact[tensor-sp]",
    "test_user_models.py::test_flax_multi_head_attention_is_tensor_parallel_and_exact[zero3]",
    "test_user_models.py::test_einsum_layers_are_tensor_parallel_and_exact[tensor-sp]",
    "test_user_models.py::test_einsum_layers_are_tensor_parallel_and_exact[zero3]",
    "test_verify.py::test_exact_layouts_report_within_1e_5_and_leave_the_model_as_it_was[zero3]",
    "test_verify.py::test_exact_layouts_report_within_1e_5_and_leave_the_model_as_it_was"
    "[pipeline-remat]",
    "test_attention_kernels.py::test_ring_on_flash_blocks_equals_the_unsplit_attention[2-False]",
    "test_chunked_loss.py::test_chunked_loss_equals_the_whole_loss_on_one_device[300-True]",
    "test_chunked_loss.py::test_chunked_loss_equals_the_whole_loss_on_one_device[50-False]",
    "test_collective_matmul.py::test_collective_matmul_equals_one_device[gpt2-8]",
    "test_hf_families.py::test_logits_loss_and_gradients_equal_transformers[qwen2]",
    "test_llama.py::test_fewer_key_value_heads_than_tensor_ranks_equals_one_device"
    "[2-model=8-False]",
    "test_pipeline.py::test_ffn_pipeline_with_data_and_model_parallelism[phantom-1f1b-1]",
    "test_families.py::test_every_family_under_its_strategies_equals_its_one_device_run"
    "[qwen3_moe-tensor-expert=2,model=2]",
    "test_families.py::test_every_family_under_its_strategies_equals_its_one_device_run"
    "[gemma3-gspmd-data=2,model=2]",
    "test_context.py::test_context_parallel_step_equals_one_device"
    "[llama-tensor-context=8-options2-step_options2]",
    "test_context.py::test_context_parallel_step_equals_one_device"
    "[mixtral-tensor-expert=2,context=2,model=2-options5-step_options5]",
    "test_hf_families.py::test_families_under_the_strategies_equal_one_device[gemma3-sp]",
    "test_token_mean.py::test_ragged_masks_equal_the_one_device_token_mean[1f1b]",
    "test_collective_matmul.py::test_collective_matmul_equals_one_device[llama-4]",
    "test_chunked_loss.py::test_chunked_loss_under_strategies_equals_one_device[llama-data-context]",
    "test_byo_model.py::test_user_model_equals_one_device[tensor-zero3]",
    "test_user_models.py::test_named_user_norms_and_meta_names_are_exact[sp-pipeline]",
    "test_singleton_axes.py::test_no_collective_runs_over_a_size_one_axis[argv3-allowed3]",
    "test_singleton_axes.py::test_no_collective_runs_over_a_size_one_axis[argv5-allowed5]",
    "test_remat.py::test_every_policy_gives_the_same_gradients[dots_saveable]",
    "test_remat.py::test_every_policy_gives_the_same_gradients[dots_collectives_saveable]",
    "test_pipeline.py::test_ffn_pipeline_equals_unpipelined[1-interleaved-1f1b-2-4]",
    "test_pipeline.py::test_ffn_pipeline_equals_unpipelined[1-gpipe-1-2]",
    "test_phantom.py::test_phantom_matches_dense_equivalent[p2-k1-L3-float64]",
    "test_phantom.py::test_phantom_matches_dense_equivalent[p1-k8-L3-float64]",
    # the docs' pages whose commands other files' tests run (examples, checkpoints, launches)
    "test_docs.py::test_page_runs[docs/bring-your-own-model.md]",
    "test_docs.py::test_page_runs[docs/multi-host-and-checkpoints.md]",
    # siblings moved with the probe's tests (each idea keeps a fast cell: fp8[expert] and
    # [pmm3d], the pad row under vocabulary sharding and SP, phantom and tensor FFN models, ...)
    "test_fp8.py::test_an_fp8_step_under_a_layout_equals_the_one_device_fp8_step[tensor]",
    "test_hf_families.py::test_the_pad_rows_lookups_give_it_no_gradient[data=1-False]",
    "test_hf_families.py::test_the_pad_rows_lookups_give_it_no_gradient[model=2-False]",
    "test_models.py::test_ffn_model_matches_its_dense_equivalent[phantom-unfused]",
    "test_models.py::test_ffn_model_matches_its_dense_equivalent[tensor-t1]",
    "test_zero.py::test_zero_trains_like_one_device[tensor-data=4,model=2-3]",
    "test_data_parallel.py::test_loss_and_gradients_equal_the_dense_model"
    "[phantom-data=4,model=2-L3-float64]",
    "test_data_parallel.py::test_loss_and_gradients_equal_the_dense_model"
    "[phantom-data=2,model=4-L2-float64]",
    "test_hlo.py::test_phantom_step_moves_only_k_wide_messages[8-3-phantom-unfused]",
    "test_hlo.py::test_phantom_step_moves_only_k_wide_messages[2-3-phantom-unfused]",
    "test_hlo.py::test_phantom_step_moves_only_k_wide_messages[8-3-phantom]",
    "test_tensor.py::test_tensor_parallel_matches_dense[tensor-t1-p4-L4-float64]",
    "test_tensor.py::test_tensor_parallel_matches_dense[tensor-p4-L4-float64]",
    "test_tensor.py::test_tensor_parallel_matches_dense[tensor-t1-p1-L3-float64]",
    "test_pmm3d.py::test_pmm3d_ffn_step_moves_exactly_eqs_5_1_to_5_5[data=2,z=1,y=4,x=1]",
    "test_pmm3d.py::test_pmm3d_ffn_step_moves_exactly_eqs_5_1_to_5_5[data=1,z=4,y=1,x=2]",
    "test_pmm3d.py::test_pmm3d_ffn_step_moves_exactly_eqs_5_1_to_5_5[data=1,z=2,y=1,x=4]",
    "test_pmm3d.py::test_pmm3d_ffn_step_moves_exactly_eqs_5_1_to_5_5[data=4,z=1,y=1,x=2]",
    "test_pmm3d.py::test_pmm3d_ffn_step_moves_exactly_eqs_5_1_to_5_5[data=2,z=4,y=1,x=1]",
    "test_pmm3d.py::test_pmm3d_ffn_step_moves_exactly_eqs_5_1_to_5_5[data=4,z=2,y=1,x=1]",
    # more siblings, each idea keeping a fast cell (the fresh-clone 3.11 run was 488 s)
    "test_data_parallel.py::test_loss_and_gradients_equal_the_dense_model"
    "[tensor-data=2,model=4-L3-float32]",
    "test_data_parallel.py::test_loss_and_gradients_equal_the_dense_model"
    "[phantom-unfused-data=2,model=4-L2-float64]",
    "test_tensor.py::test_tensor_parallel_matches_dense[tensor-t1-p2-L3-float32]",
    "test_tensor.py::test_tensor_parallel_matches_dense[tensor-t1-p8-L2-float32]",
    "test_tensor.py::test_tensor_parallel_matches_dense[tensor-p2-L1-float64]",
    "test_tensor.py::test_tensor_parallel_matches_dense[tensor-p2-L2-float64]",
    "test_tensor.py::test_tensor_parallel_matches_dense[tensor-t1-p2-L2-float64]",
    "test_tensor.py::test_tensor_parallel_matches_dense[tensor-t1-p2-L3-float64]",
    "test_llama.py::test_llama_under_megatron_equals_one_device[llama-tensor]",
    "test_byo_model.py::test_user_model_equals_one_device[tensor]",
    "test_llama.py::test_fewer_key_value_heads_than_tensor_ranks_equals_one_device"
    "[2-data=2,model=4-True]",
    "test_remat.py::test_every_policy_gives_the_same_gradients[nothing_saveable]",
    "test_zero.py::test_clipped_gradients_equal_single_device_clipped_gradients"
    "[phantom-data=2,model=4-0]",
    "test_expert.py::test_expert_parallel_moe_equals_the_dense_moe[2]",
    "test_chunked_loss.py::test_chunked_loss_equals_the_whole_loss_on_one_device[300-False]",
    "test_expert.py::test_dropless_path_equals_the_fixed_capacity_path_that_drops_nothing[1]",
    "test_pipeline.py::test_ffn_pipeline_equals_unpipelined[1-1f1b-1-4]",
    "test_pmm3d.py::test_pmm3d_ffn_equals_the_dense_ffn_on_every_grid[data=8,z=1,y=1,x=1]",
    "test_pmm3d.py::test_pmm3d_ffn_equals_the_dense_ffn_on_every_grid[data=1,z=1,y=8,x=1]",
    "test_pmm3d.py::test_pmm3d_ffn_equals_the_dense_ffn_on_every_grid[data=1,z=1,y=2,x=4]",
    "test_pmm3d.py::test_pmm3d_ffn_equals_the_dense_ffn_on_every_grid[data=2,z=2,y=2,x=1]",
    "test_hierarchical_collectives.py::test_hierarchical_equals_flat_in_value_and_gradient"
    "[2-4-0-all-gather]",
    "test_hierarchical_collectives.py::test_hierarchical_equals_flat_in_value_and_gradient"
    "[2-4-1-all-gather]",
    "test_hierarchical_collectives.py::test_hierarchical_equals_flat_in_value_and_gradient"
    "[2-4-1-reduce-scatter]",
    "test_step_model.py::test_flops_collectives_and_arguments_match_compiled_step"
    "[phantom-unfused-8-3]",
    "test_step_model.py::test_flops_collectives_and_arguments_match_compiled_step[tensor-t1-8-3]",
    "test_attention_kernels.py::test_flash_blocks_equal_the_einsum_blocks[False-32]",
    # the budget after the peers' recompute policies, the sharded master weights and verify's
    # per-rank FP8 references: each repeats a faster test of its file (the policies' GPT-2 cells
    # and one Llama cell, the sharded step's exactness cells, the FP8 mixed-precision verify)
    "test_remat.py::test_peer_policies_are_exact_on_llama"
    "[all_but_attention_core_saveable-all-gather-context]",
    "test_remat.py::test_peer_policies_are_exact_on_llama[dots_attention_saveable-sp-zero3]",
    "test_remat.py::test_peer_policies_are_exact_on_llama[qkv_saveable-sp-zero3]",
    "test_master_weights.py::test_train_master_weights_sharded_end_to_end_matches_replicated",
    "test_verify.py::test_verify_compares_mixed_precision_with_the_one_device_step_at_that"
    "_precision[bf16-0.125]",
}


def pytest_collection_modifyitems(config, items):
    seen = set()
    for item in items:
        node = f"{item.path.name}::{item.name}"
        seen.add(node)
        if node in BUDGET_SLOW:
            item.add_marker(pytest.mark.slow)
    check_budget_slow(seen, {item.path.name for item in items})
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), order[id(item)]))


def check_budget_slow(seen: set[str], files: set[str]) -> None:
    """Every node id of :data:`BUDGET_SLOW` names a test that exists (checked when every test
    file was collected): a renamed test would otherwise silently leave the slow list and join the
    fast suite's budget."""
    every_file = {p.name for p in pathlib.Path(__file__).parent.rglob("test_*.py")}
    if not every_file <= files:
        return
    missing = sorted(BUDGET_SLOW - seen)
    if missing:
        raise pytest.UsageError("tests/conftest.py BUDGET_SLOW names tests that do not exist: "
                                + ", ".join(missing))
