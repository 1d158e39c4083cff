"""What `make test` (hypothesis's ci profile) leaves to `make test-all`, and why that is safe.

CI has 2 cores and `make test` must stay under 15 minutes, so each parametrized family of multi-rank
tests runs a subset in CI: every axis, schedule and CP kind still runs there through a sibling case
(named after each entry). The whole matrix runs under `make test-all` (or MESHKIT_SLOW=1). conftest.py
marks these node ids `slow`; a full collection that no longer finds one fails, so a renamed case
cannot silently return to CI or leave it.
"""

from __future__ import annotations

SLOW_CASES: dict[str, str] = {
    # DualPipe and zb_auto (issue #35): CI keeps pp=2 dualpipe with dp_shard and tied embeddings, pp=4 dualpipe
    # with full AC, and zb_auto's profiling run under dp_shard; the schedules as data are tested exhaustively.
    "tests/pipeline/test_pipeline_dualpipe.py::test_runtime_copies_sum_to_the_single_process_gradient[4-6]":
        "[2-4] (the same runtime path) and the pp=4 case of test_dualpipe_matches_one_device",
    "tests/pipeline/test_pipeline_dualpipe.py::test_dualpipe_matches_one_device"
    "[pp=2,tp=2,pp_schedule=dualpipe,pp_microbatches=4-4-model2]":
        "DualPipe's only TP-specific piece is the W split, which test_zero_bubble_schedules_through_parallelize "
        "covers with dualpipe_v,tp=2; the mirror sum in [pp=2,dp_shard=2...]",
    "tests/pipeline/test_pipeline_dualpipe.py::test_dualpipe_matches_one_device"
    "[pp=2,cp=2,pp_schedule=dualpipe,pp_microbatches=2,activation_checkpointing=selective-4-model3]":
        "dualpipe_v with cp=2 and selective AC in test_zero_bubble_schedules_through_parallelize",
    "tests/pipeline/test_pipeline_dualpipe.py::test_dualpipe_matches_one_device"
    "[pp=2,dp_shard=2,ep=2,pp_schedule=dualpipe,pp_microbatches=4-4-model4]":
        "test_the_two_copies_stay_identical_and_checkpoints_hold_one (MoE with router-bias counts summed over the "
        "pair) and zb_v with dp_shard=2,ep=2",
    "tests/pipeline/test_pipeline_dualpipe.py::test_dualpipe_matches_one_device"
    "[pp=2,dp_shard=2,tp=2,pp_schedule=dualpipe,pp_microbatches=4-8-model5]":
        "[pp=2,dp_shard=2...] and test_pp_dp_tp_on_eight_ranks",
    "tests/pipeline/test_pipeline_zb_auto.py::test_zb_auto_matches_one_device"
    "[pp=4,pp_schedule=zb_auto,pp_microbatches=8,pp_costs=1/2/1/0.1-4-model1]":
        "[pp=2,dp_shard=2,...,pp_memory_limit=3] (a zb_auto order through the same runtime) and the data tests",
    "tests/pipeline/test_pipeline_zb_auto.py::test_zb_auto_matches_one_device"
    "[pp=2,tp=2,pp_schedule=zb_auto,pp_microbatches=4,activation_checkpointing=full-4-model2]":
        "zb_h1 under tp and full AC in test_composition / test_pipeline_runtime (zb_auto runs the same B/W path)",
    # test id: the case that still covers its path in CI
    "tests/parallel/test_inference.py::test_logits_and_greedy_tokens_match_the_single_device_model"
    "[cp=2,dp_shard=2,cp_attention=zigzag-spec1]": "cp=2,tp=2 ulysses; zigzag forward in test_evaluate",
    "tests/parallel/test_inference.py::test_logits_and_greedy_tokens_match_the_single_device_model"
    "[pp=2,dp_shard=2-spec3]": "pp=2,tp=2 interleaved",
    "tests/parallel/test_inference.py::test_logits_and_greedy_tokens_match_the_single_device_model"
    "[pp=2,dp_shard=2,ep=2-spec6]": "dp_shard=2,tp=2,ep=2 and pp=2 interleaved",
    "tests/state/test_checkpoint.py::test_resume_same_plan_is_bit_identical[tp2dp2]": "tied-pp2tp2",
    "tests/state/test_checkpoint.py::test_resume_same_plan_is_bit_identical[pp2dp2]": "tied-pp2tp2",
    "tests/state/test_checkpoint.py::test_resume_under_another_plan[pp2dp2-to-tp2hsdp2]":
        "tp2dp2-to-pp2cp2 and tied-tp2dp2-to-pp2dp2",
    "tests/state/test_checkpoint.py::test_resume_under_another_plan[tied-pp2dp2-to-dp2]": "tied-tp2dp2-to-pp2dp2",
    "tests/data_parallel/test_zero.py::test_zero_stage_and_grad_sync_match_single_device"
    "[zero=1,grad_sync=every_microbatch,tp=2,dp_shard=2]": "zero=1 under cp, pp and ep; zero=3 under tp",
    "tests/data_parallel/test_zero.py::test_zero_stage_and_grad_sync_match_single_device"
    "[zero=2,grad_sync=last_microbatch,tp=2,dp_shard=2]": "zero=2 under cp, pp and HSDP; zero=3 under tp",
    "tests/expert_parallel/test_expert_parallel.py::test_expert_parallel_plans_match_single_device"
    "[dp_shard=2,tp=2,ep=2,activation_checkpointing=selective-4]":
        "test_moe_selective_ac (this plan: selective vs no AC vs HF) and dp_shard=4 selective",
    "tests/expert_parallel/test_expert_parallel.py::test_expert_parallel_plans_match_single_device"
    "[dp_shard=4,ep=2,activation_checkpointing=full-4]": "dp_shard=4 selective",
    "tests/expert_parallel/test_expert_parallel.py::test_hf_moe_models_match_the_unconverted_hf_model"
    "[dp_shard=2,tp=2,ep=2-mixtral]": "the same plan on qwen3_moe",
    "tests/expert_parallel/test_expert_parallel.py::test_hf_moe_models_match_the_unconverted_hf_model"
    "[dp_shard=2,cp=2,ep=4,cp_attention=ulysses-mixtral]": "the same plan on qwen3_moe",
    "tests/context_parallel/test_context_parallel.py::test_each_kind_alone_and_composed[tp-allgather_usp]":
        "tp-usp, dp_shard-allgather_usp",
    "tests/context_parallel/test_context_parallel.py::test_each_kind_alone_and_composed[dp_shard-usp]":
        "tp-usp, alone-usp",
    "tests/parallel/test_evaluate.py::test_evaluating_between_backward_and_step_leaves_training_unchanged"
    "[dp_shard=2,tp=2,param_dtype=bfloat16]": "dp_shard=4 and pp=2,dp_shard=2; bf16 evaluate in test_evaluate",
    "tests/pipeline/test_pipeline_parallel.py::test_zero_bubble_schedules_through_parallelize"
    "[pp=2,pp_schedule=zb_h2,pp_virtual_stages=1,pp_microbatches=4,dp_shard=2,tp=2-8-model5]":
        "zb_h2 in test_pipeline_runtime and test_composition's schedules",
    "tests/parallel/test_parallelize.py::test_eight_rank_plans[tp=2,dp_shard=2,dp_replicate=2]":
        "the same plan without SP, and test_random_full_plans_on_eight_ranks",
    "tests/state/test_hf_io.py::test_save_hf_checkpoint_round_trips_through_from_pretrained[llama-tied-tp2dp2]":
        "llama-tied-pp2tp2",
    "tests/state/test_checkpoint.py::test_resume_same_plan_is_bit_identical[pp2dp2-zero1]":
        "pp2dp2-zero2-materialised-first (zero < 3 under pp, optimizer built on meta: pp2-on-2-ranks)",
    "tests/data_parallel/test_offload_axes.py::test_offload_matches_the_same_plan_without_it_and_one_device[CP]":
        "TP and HSDP: the same offload policy on the dp_shard_cp units, which cp only widens",
    "tests/data_parallel/test_offload_axes.py::test_offload_matches_the_same_plan_without_it_and_one_device[EP]":
        "TP and HSDP for the dense units; expert units get the same policy (data_parallel.apply_fsdp_to_stages)",
    "tests/parallel/test_inference.py::test_logits_and_greedy_tokens_match_the_single_device_model"
    "[tp=2,dp_shard=2,ep=2-spec8]": "gpt_oss-tp in test_families; windows with the KV cache: gemma2 tp=2 (spec7)",
    "tests/expert_parallel/test_gpt_oss_experts.py::test_hf_aux_loss_with_the_biased_router_under_ep":
        "test_moe_models mixtral aux ep=4 (HF's pooled loss under ep), the biased router in "
        "test_converted_mlp_equals_hf",
    "tests/models/test_attention_sinks.py::test_sinks_under_tp_and_ring[pp2-tp2]":
        "test_families gpt_oss-pp (pp x fsdp) and tp2-zigzag2 (sinks over tp)",
    "tests/models/test_attention_sinks.py::test_sinks_under_tp_and_ring[tp2-ulysses2]":
        "test_families gpt_oss-ulysses (sinks follow the heads) and gpt_oss-tp (sinks split over tp)",
    "tests/models/test_attention_sinks.py::test_sinks_under_tp_and_ring[allgather4]":
        "usp2x2 (hf.py's merging-kind path) and test_ring_sinks[allgather-zigzag-False-4] (the all-gather op)",
    "tests/models/test_attention_sinks.py::test_sinks_under_tp_and_ring[tp4-mqa]":
        "tp2-zigzag2 (sinks split over tp), test_families gpt_oss-tp, test_kv_replication tp=4 MQA",
    "tests/parallel/test_parallelize.py::test_eight_rank_plans[tp=8,dp_shard=1]":
        "tp=4 in test_kv_replication (TP wider than the K/V heads) and the 8-rank siblings with tp=2",
    "tests/parallel/test_inference.py::test_logits_and_greedy_tokens_match_the_single_device_model"
    "[tp=2,dp_shard=2-spec0]": "the same plan on Gemma-2 (spec7) and, with ep, on Llama-MoE (spec5)",
    "tests/models/test_kv_replication.py::test_kv_heads_fewer_than_tp[tp=4,sequence_parallel=false-model1]":
        "tp=4 (four ranks per K/V head) and tp=2,dp_shard=2 (MQA); TP without SP in test_tp_no_sp",
    # The HF stack (#30): one exact Trainer run, one SFT and one DPO run, the resume, the README program in CI.
    "tests/parallel/test_hf_forward.py::test_model_forward_backpropagates_to_the_single_device_gradients"
    "[tp=2,dp_shard=2-False-False]": "zero=1 x tp x dp_shard (a user loss on the logits) and cp x tp (HF's loss)",
    "tests/parallel/test_hf_forward.py::test_model_forward_backpropagates_to_the_single_device_gradients"
    "[cp=2,dp_shard=2,cp_attention=ulysses-False-True]": "cp=2,tp=2 zigzag; Ulysses SFT packing in test_trl (slow)",
    "tests/parallel/test_hf_forward.py::test_model_forward_backpropagates_to_the_single_device_gradients"
    "[dp_replicate=2,tp=2-False-True]": "dp_shard=2,tp=2,zero=1 (data ranks, tp)",
    "tests/parallel/test_hf_forward.py::test_a_graph_on_a_plan_finished_after_backward_needs_the_scope"
    "[dp_shard=2,zero=1]": "the tp=2 case (the same check)",
    "tests/integrations/test_trainer.py::test_trainer_matches_hf_trainer_on_the_global_batch[dp_shard=2,zero=2]":
        "tp=2,dp_shard=2 (FSDP, accumulation); zero stages in tests/data_parallel",
    "tests/integrations/test_trainer.py::test_trainer_matches_hf_trainer_on_the_global_batch"
    "[cp=2,dp_shard=2,cp_attention=zigzag]": "test_trl SFT ring packed (cp through the Trainer)",
    "tests/integrations/test_trainer.py::test_trainer_matches_hf_trainer_on_the_global_batch"
    "[pp=2,dp_shard=2,pp_microbatches=2]": "tp=2,dp_shard=2 (the same forward_backward step); pp in tests/pipeline",
    "tests/integrations/test_trainer.py::test_trainer_matches_hf_trainer_on_the_global_batch[dp_shard=2,ep=2]":
        "tp=2,dp_shard=2 (the same step); ep in tests/expert_parallel",
    "tests/integrations/test_trainer.py::test_trainer_matches_hf_trainer_on_the_global_batch"
    "[dp_replicate=2,dp_shard=2]": "tp=2,dp_shard=2 (data ranks, accumulation); model_init: none in CI",
    "tests/integrations/test_trainer.py::test_trainer_matches_hf_trainer_on_the_global_batch[tp=2]":
        "tp=2,dp_shard=2; a meta-device model: none in CI",
    "tests/integrations/test_trainer.py::test_a_loss_of_ones_own_runs_through_the_models_forward"
    "[cp=2,tp=2,cp_attention=zigzag]": "test_trl's SFT and DPO CI cases (TRL's compute_loss, model's forward)",
    "tests/integrations/test_trainer.py::test_a_loss_of_ones_own_runs_through_the_models_forward"
    "[dp_shard=2,zero=1]": "test_trl's CI cases; zero=1 graphs in test_hf_forward",
    "tests/integrations/test_trainer.py::test_a_loss_of_ones_own_runs_through_the_models_forward[tp=2]":
        "test_trl's CI cases; tp without FSDP in test_hf_forward's scope test",
    "tests/integrations/test_trainer.py::test_samplers_epochs_and_uneven_batches_follow_hf_ddp":
        "tp=2,dp_shard=2 (accelerate's seedable random sampler over the data ranks)",
    "tests/integrations/test_trainer.py::test_tensorboard_logging_writes_from_rank_0":
        "the CI Trainer runs log through the same callbacks (TensorBoard is one of HF's)",
    "tests/integrations/test_trl.py::test_sft_matches_trl_on_the_global_batch[tp=2,dp_shard=2-completion]":
        "cp=2,dp_shard=2 ring chat packed (the same SFT path)",
    "tests/integrations/test_trl.py::test_sft_matches_trl_on_the_global_batch[cp=2,tp=2,cp_attention=zigzag-chat]":
        "cp=2,dp_shard=2 ring chat packed (assistant-only loss)",
    "tests/integrations/test_trl.py::test_sft_matches_trl_on_the_global_batch"
    "[cp=2,dp_shard=2,cp_attention=ulysses-completion-packed]": "ring packed (documents under cp)",
    "tests/integrations/test_trl.py::test_dpo_with_a_reference_model_under_the_same_plan_matches_trl"
    "[cp=2,dp_shard=2,cp_attention=zigzag]": "tp=2,dp_shard=2 (the same DPO path)",
    # PEFT LoRA through the HF stack: CI keeps the Trainer under tp x fsdp with accumulation and the DPO refusal.
    "tests/integrations/test_trainer_lora.py::test_trainer_trains_a_peft_model_as_hf_trainer_does"
    "[pp=2,dp_shard=2,pp_microbatches=2]": "[tp=2,dp_shard=2] (the same Trainer step); LoRA under pp in test_lora",
    "tests/integrations/test_trainer_lora.py::test_sft_trains_a_peft_model_as_trl_does[tp=2,dp_shard=2-model]":
        "test_trl's SFT CI case (TRL's loss on the model's forward) and test_trainer_lora's Trainer CI case",
    "tests/integrations/test_trainer_lora.py::test_sft_trains_a_peft_model_as_trl_does"
    "[cp=2,tp=2,cp_attention=zigzag-peft_config-packed]": "test_trl's ring packed SFT CI case; LoRA under cp in test_lora",
    "tests/integrations/test_trainer_lora.py::test_a_lora_trainer_checkpoint_resumes_under_another_plan":
        "test_trainer_state's resume (the same Trainer checkpoint path) and test_lora_checkpoint's LoRA resume",
    "tests/integrations/test_trainer_lora.py::test_dpo_trains_a_peft_model_against_its_disabled_adapter_as_trl_does":
        "test_trl's DPO CI case (the same DPO path); PEFT's adapter switch is PEFT's own forward",
    'tests/data_parallel/test_activation_offload.py::test_activation_offload_is_exact_and_moves_every_saved_byte[CP-allgather]':
        "CP (zigzag with tp) and the memory property test's CP kinds; the all-gather kind saves through the same hooks",
    'tests/data_parallel/test_activation_offload.py::test_activation_offload_is_exact_and_moves_every_saved_byte[CP-keep-kv]':
        'CP (zigzag): the kept K/V are more saved tensors of the same Function',
    'tests/data_parallel/test_activation_offload.py::test_activation_offload_is_exact_and_moves_every_saved_byte[CP-ring-full]':
        "PP (full AC: the checkpoint's saved block inputs) and CP (ring attention's saved tensors)",
    'tests/data_parallel/test_activation_offload.py::test_activation_offload_is_exact_and_moves_every_saved_byte[CP-ulysses]':
        "CP and TP (selective AC); Ulysses' all-to-alls save nothing of their own",
    'tests/data_parallel/test_activation_offload.py::test_activation_offload_is_exact_and_moves_every_saved_byte[CP-usp]':
        'CP (zigzag) and PP (full AC)',
    'tests/data_parallel/test_activation_offload.py::test_activation_offload_is_exact_and_moves_every_saved_byte[EP-selective]':
        "EP (the MoE layer's saved tensors) and TP (selective)",
    'tests/data_parallel/test_activation_offload.py::test_activation_offload_is_exact_and_moves_every_saved_byte[HSDP]':
        "PP (full AC under FSDP): the replicas' all-reduce runs outside the hooks",
    'tests/data_parallel/test_activation_offload.py::test_activation_offload_is_exact_and_moves_every_saved_byte[PP-interleaved]':
        "PP (1f1b): each stage's blocks link their own chain",
    'tests/data_parallel/test_activation_offload.py::test_activation_offload_is_exact_and_moves_every_saved_byte[bf16]':
        'TP (fp32); a bf16 storage is copied as bytes like any other',
    'tests/data_parallel/test_activation_offload.py::test_estimator_counts_the_bytes_activation_offload_moves[selective]':
        '[none] and [full]: selective moves what full does (the block inputs)',
    'tests/data_parallel/test_nvme.py::test_nvme_equals_host_offload_and_streams_the_state[ep]':
        'tp-zero2-window: expert units are FSDP units like any other in the store',
    'tests/data_parallel/test_nvme.py::test_nvme_equals_host_offload_and_streams_the_state[pp]':
        'tp-zero2-window and test_checkpoint_saves_nvme_state_and_resumes_under_other_plans',
    'tests/data_parallel/test_nvme.py::test_nvme_equals_host_offload_and_streams_the_state[bf16]':
        'tp-zero2-window (fp32): the master shards stay fp32 under bf16 compute',
    'tests/data_parallel/test_nvme.py::test_nvme_equals_host_offload_and_streams_the_state[fsdp]':
        'tp-zero2-window and the checkpoint test (dp_shard=2 with nvme)',
    'tests/float8/test_float8.py::test_float8_matches_torchao_on_each_data_ranks_rows[fsdp-tensorwise]':
        'tp-sp-fsdp (FSDP float8 all-gather with TP) and test_fsdp_all_gathers_tensorwise_weights_in_float8',
    'tests/float8/test_float8.py::test_float8_matches_torchao_on_each_data_ranks_rows[tp-no-sp]':
        'tp-sp-fsdp (the same float8 styles path with SP)',
    'tests/float8/test_float8.py::test_float8_matches_torchao_on_each_data_ranks_rows[hsdp-zero2-selective]':
        'tp-sp-fsdp and the random float8 plans (HSDP, zero=2, selective AC drawn there)',
    'tests/float8/test_float8.py::test_float8_matches_torchao_on_each_data_ranks_rows[tp-activation-offload]':
        'TP-styles in test_activation_offload (DTensor styles: DTensors copied through their shards) and tp-sp-fsdp',
    "tests/integrations/test_lora.py::test_lora_plans[tp2-no-sp]": "tp2-sp-local (the same local path with SP's collectives) and the property test's tp=2 plans",
    "tests/integrations/test_lora.py::test_lora_plans[hsdp]": "the property test's dp_replicate=2 plans; FSDP over the adapters in tp2-sp-local",
    "tests/integrations/test_lora.py::test_lora_plans[cp2-tp2-ulysses]": "the property test's cp=2 plans (ring, zigzag, ulysses, allgather drawn)",
    "tests/integrations/test_lora.py::test_lora_plans[cp2-ring]": "the property test's cp=2 plans",
    "tests/integrations/test_lora.py::test_lora_plans[cp2-allgather]": "the property test's cp=2 plans",
    "tests/integrations/test_lora.py::test_lora_plans[cp4-usp]": "the property test's cp=2 plans (the adapter never sees attention: the kinds differ only there)",
    "tests/integrations/test_lora.py::test_lora_plans[tp2-sac]": "the property test's selective/full AC draws",
    "tests/integrations/test_lora.py::test_lora_plans[pp2-full-ac]": "the property test's selective/full AC draws",
    "tests/integrations/test_lora.py::test_lora_plans[zero1]": "the property test's zero=1/2/3 draws",
    "tests/integrations/test_lora.py::test_lora_plans[zero2]": "the property test's zero=1/2/3 draws",
    "tests/integrations/test_lora.py::test_lora_plans[offload-params]": "dp_shard in tp2-sp-local; offload moves whole FSDP units, frozen or not",
    "tests/integrations/test_lora.py::test_lora_plans[pp2-interleaved]": "pp2-tp2-zbh1 and the property test's schedules",
    "tests/integrations/test_lora.py::test_lora_plans[pp2-gpipe-tied]": "pp2-tp2-zbh1 and the property test's tied draws",
    "tests/integrations/test_lora.py::test_lora_plans[pp2-zbv]": "pp2-tp2-zbh1 (the B/W split of the adapters) and the property test's zb_v draws",
    "tests/integrations/test_lora.py::test_lora_plans[pp2-dualpipev]": "pp2-tp2-zbh1 (the B/W split of the adapters)",
    "tests/integrations/test_lora.py::test_lora_plans[pp2-zbh2]": "pp2-tp2-zbh1 (the B/W split of the adapters)",
    "tests/integrations/test_lora.py::test_lora_plans[mixtral-ep2-tp2]": "test_lora_refusals (adapters inside MoE blocks) and tp2-sp-local for attention adapters",
    "tests/integrations/test_lora.py::test_lora_plans[qwen2moe-dense-mlp-ep2]": "test_lora_refusals (adapters inside MoE blocks) and tp2-sp-local",
    "tests/integrations/test_lora.py::test_lora_plans[pp2-dualpipe-tied]":
        "pp2-tp2-zbh1 (the adapters' B/W split); the mirror pair sums only gradients that exist",
    "tests/integrations/test_lora.py::test_lora_plans[pp2-zb-auto]": "pp2-tp2-zbh1 (the adapters' B/W split)",
    "tests/integrations/test_lora.py::test_lora_plans[compiled-fsdp]":
        "tp2-sp-local (the adapters' FSDP path); compile without adapters in test_training_semantics",
    "tests/integrations/test_lora.py::test_lora_plans[qwen2-biases]": "tp2-sp-local (colwise biases shard with the base, as without LoRA)",
}
