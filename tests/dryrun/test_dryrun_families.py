"""What the plan families' dry run (benchmarks/dryrun_families.py) found, each pinned by a small case."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig

from meshkit.activation_checkpoint import _selective_context
from meshkit.context_parallel.kernels import ATTENTION_BLOCK_OP, attention_block
from meshkit.dryrun import dry_run
from meshkit.estimate.inflight import StageBytes, replay
from meshkit.estimate.peak import rank_memory
from meshkit.estimate.spec import Workload
from meshkit.plan import Plan

TIED = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=8, vocab_size=256, max_position_embeddings=512, tie_word_embeddings=True)


class _Calls(TorchDispatchMode):
    """Counts calls of one op, forward and recompute alike."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))


def test_selective_checkpoint_keeps_meshkits_attention_output() -> None:
    """Selective AC keeps attention outputs; meshkit's own attention op (Ulysses' local kernel, packed
    documents without CP) was not on its list, so backward re-ran the whole attention (and under
    Ulysses its all-to-alls' inputs) and held its output for none of the blocks: the dry run measured
    Ulysses at Llama 3.2 3B, 16384 tokens over cp=4, 0.67 GiB under the estimate. One call now."""
    q, k, v = (torch.randn(1, 4, 32, 8, requires_grad=True) for _ in range(3))

    def block(q, k, v):
        out, _ = attention_block(q * 2, k * 2, v * 2, causal_kind="causal")
        return out.sin()

    counter = _Calls(ATTENTION_BLOCK_OP)
    with counter:
        out = torch.utils.checkpoint.checkpoint(block, q, k, v, use_reentrant=False, context_fn=_selective_context)
        out.sum().backward()
    assert counter.calls == 1, f"meshkit::attention_block ran {counter.calls} times (recomputed in backward)"
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_tied_embedding_sum_is_named_by_its_two_ranks() -> None:
    """A tied embedding under pp = 4: the first and last stage sum their copies' gradients over a group of
    those two ranks, not the pp axis; the estimator named it `pp` and the dry run by its ranks, so the
    collectives differed at pp > 2 (Llama 3.2 3B, pp=4). Both now say `pp_ends`, byte for byte."""
    plan = Plan.from_string("pp=4,pp_microbatches=4,param_dtype=bfloat16").resolve(4)
    result = dry_run(LlamaConfig(**TIED), plan, 4, Workload(seq=32, mbs=1, microbatches=4), ranks=[0, 3], jobs=2)
    for r in result.ranks:
        assert "pp_ends" in r.estimate.collectives and r.run.measured.collectives().get("pp_ends"), r.run.rank
        assert not r.collective_differences, (r.run.rank, r.collective_differences)


DENSE = dict(TIED, tie_word_embeddings=False)


def test_ring_ranks_keep_the_outputs_of_the_steps_they_compute() -> None:
    """Under selective AC a ring keeps each step's (out, lse); the estimate kept cp of them on every rank,
    the last rank's count. The zig-zag rank 0 of 4 computes its diagonal whole and half an output from
    each later rank (2.5), rank 3 four whole ones: the dry run measured Llama 3.2 3B's rank 0 1 GiB
    under the estimate. Rank 3's activations exceed rank 0's by what the estimate now says, exactly."""
    plan = Plan.from_string("cp=4,cp_attention=zigzag,cp_keep_kv=false,activation_checkpointing=selective,"
                            "param_dtype=bfloat16").resolve(4)
    result = dry_run(LlamaConfig(**DENSE), plan, 4, Workload(seq=512, mbs=1), ranks=[0, 3], jobs=2)
    first, last = result.ranks
    measured = last.run.measured.peak.parts["activations"] - first.run.measured.peak.parts["activations"]
    estimated = last.estimate.parts["activations"] - first.estimate.parts["activations"]
    assert measured > 0 and estimated == measured, (measured, estimated, first.run.measured.peak.parts, first.estimate.parts, last.run.measured.peak.parts, last.estimate.parts)


def test_zero1_reduces_each_call_so_nothing_is_carried() -> None:
    """ZeRO-1 syncing every call reduce-scatters after each call's backward: a step's second call starts
    with the first's gradient shards, not its unreduced gradients, which the estimate carried (Llama
    3.2 3B, two calls: 42% over). Its own unreduced gradients peak as its backward ends, a moment the
    estimate now has. Within 3% on a small model (6.5% over before)."""
    plan = Plan.from_string("dp_shard=2,zero=1,param_dtype=bfloat16,activation_checkpointing=selective").resolve(2)
    config = LlamaConfig(**dict(DENSE, intermediate_size=256, max_position_embeddings=1024))
    (rank,) = dry_run(config, plan, 2, Workload(seq=512, mbs=1, microbatches=2), ranks=[0], jobs=1).ranks
    measured, estimated = rank.run.measured.peak.bytes, rank.estimate.peak_bytes
    assert abs(estimated - measured) / measured < 0.03, (measured, estimated)


def test_zero_bubble_weight_grads_wait_for_the_next_b() -> None:
    """Under a B/W split with FSDP, W leaves each weight's gradient in `.grad` in the compute dtype after
    FSDP's post-backward ran in B, so they live until the next B folds them in: a stage's weights once
    over (1.3 GiB on a Llama 3.2 3B stage of 7 blocks; the estimate was 7% low there). A wide, short
    model makes them count: its last stage's peak within 5% (13% low without them)."""
    wide = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=128)
    plan = Plan.from_string("pp=2,dp_shard=2,pp_schedule=zb_h1,pp_microbatches=4,param_dtype=bfloat16,"
                            "activation_checkpointing=selective").resolve(4)
    (rank,) = dry_run(LlamaConfig(**wide), plan, 4, Workload(seq=128, mbs=1, microbatches=4), ranks=[2], jobs=1).ranks
    measured, estimated = rank.run.measured.peak.bytes, rank.estimate.peak_bytes
    assert abs(estimated - measured) / measured < 0.05, (measured, estimated)


def test_gpipe_peaks_as_its_first_backward_ends() -> None:
    """A pipeline call's unreduced gradients appear with the rank's first backward: under GPipe every
    forward comes first, so the peak is that backward's end, one microbatch's activations freed and the
    gradients made; the estimate added them to every microbatch held (Llama 3.2 3B, 8 microbatches:
    9% over). The last stage of two microbatches within 2% (7% over before)."""
    config = LlamaConfig(**dict(DENSE, intermediate_size=256, max_position_embeddings=1024))
    plan = Plan.from_string("pp=2,dp_shard=2,pp_schedule=gpipe,pp_microbatches=2,param_dtype=bfloat16,"
                            "activation_checkpointing=selective").resolve(4)
    (rank,) = dry_run(config, plan, 4, Workload(seq=512, mbs=1, microbatches=2), ranks=[2], jobs=1).ranks
    measured, estimated = rank.run.measured.peak.bytes, rank.estimate.peak_bytes
    assert abs(estimated - measured) / measured < 0.02, (measured, estimated)


FLOAT8 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=256, max_position_embeddings=64)


def test_float8_weights_are_measured_and_their_scales_counted() -> None:
    """float8 wraps each projection weight's shard in a tensor subclass whose own storage holds nothing:
    the dry run missed the shards (Llama 3.2 3B: 1.3 GiB of parameters, the estimate 8% over), now read
    through the wrapper. Before each forward the weights' amaxes are all-reduced (fp32, one per weight)
    over the axes they are sharded on, which the estimate lacked (784 bytes at 3B)."""
    for text, world in (("dp_shard=2", 2), ("tp=2,dp_shard=2", 4)):
        plan = Plan.from_string(f"{text},float8=tensorwise,param_dtype=bfloat16").resolve(world)
        (r,) = dry_run(LlamaConfig(**FLOAT8), plan, world, Workload(seq=64, mbs=1), ranks=[0], jobs=1).ranks
        measured, estimated = r.run.measured.peak.parts["parameters"], r.estimate.parts["parameters"]
        assert abs(measured - estimated) <= 64, (text, measured, estimated)  # the rotary frequencies
        assert not r.collective_differences, (text, r.collective_differences)


def test_ddp_dry_run_bookkeeping_is_not_a_difference() -> None:
    """A plan that only replicates runs DDP; in a fake world DDP looks for unused parameters, all-reducing
    an int32 per parameter tensor, which a real run does not: the comparison adds it on the estimate's
    side, so the DDP plan's collectives are equal byte for byte (they differed by 1016 bytes at 3B)."""
    plan = Plan.from_string("dp_replicate=2").resolve(2)
    (r,) = dry_run(LlamaConfig(**FLOAT8), plan, 2, Workload(seq=64, mbs=1), ranks=[0], jobs=1).ranks
    assert r.run.measured.collectives()["dp_replicate"]["all_reduce"] > 0
    assert not r.collective_differences, r.collective_differences


def test_replay_counts_deferred_gradients_once_folded() -> None:
    """Under a B/W split a linear's gradient reaches FSDP's reduce-dtype accumulation only at the B after
    its W (W fills `.grad`, the next B's post-backward folds it): the ZB-H2 last stage of Llama 3.2 3B
    peaks at a loss backward before that, the estimate 10% over when every carried gradient counted from
    the first B (1.009 now, benchmarks/results/dryrun_families.md). On the last stage of pp=2 ZB-H2 with
    a loss moment dominating, the replay's peak leaves the deferred part out; GPipe's has it all."""
    zb = Plan.from_string("pp=2,pp_schedule=zb_h2,pp_microbatches=4").resolve(2)
    stages = {s: StageBytes(10, 2, 2, 1000 if s else 1, s == 1, 1, 30, accumulated=100, accumulated_w=60)
              for s in (0, 1)}
    assert replay(zb, 1, stages).carried == 40
    gpipe = Plan.from_string("pp=2,pp_schedule=gpipe,pp_microbatches=4").resolve(2)
    assert replay(gpipe, 1, stages).carried == 100


def test_replay_accumulates_per_stage_and_folds_at_the_next_backward() -> None:
    """A rank of two stages (DualPipe) makes each stage's accumulation at that stage's own backward, and
    under a B/W split a BW's deferred products sit in `.grad` (compute dtype) until the stage's next
    backward folds them into its reduce-dtype accumulation: DualPipe's pp rank 2 of Llama 3.2 3B peaks
    in its sixth backward holding both stages' `.grad`s and accumulations (measured 27.19 GiB; the
    replay adding every accumulation at the rank's first backward gave 25.68, 0.944; 0.992 now). Here:
    no moment holds an accumulation before its stage's backward, and the deferred part is made only
    once a `.grad` was held; the `.grad`s are counted while held."""
    plan = Plan.from_string("pp=4,pp_schedule=dualpipe,pp_microbatches=8").resolve(4)
    stages = {2: StageBytes(0, 0, 0, accumulated=100, accumulated_w=60, weight_grads=30),
              5: StageBytes(0, 0, 0, accumulated=1000, accumulated_w=600, weight_grads=300)}
    held = replay(plan, 2, stages)
    assert held.carried == 1100 and held.deferred_grads == 330, held  # both folded, both `.grad`s held again
    # a stage's share appears with its first backward: stage 2's BW comes first, so a moment right after
    # it holds stage 2's non-deferred part and `.grad`s only; with stage 5 weightless the peak says so
    light = {2: stages[2], 5: StageBytes(0, 0, 0)}
    assert replay(plan, 2, light).carried == 100 and replay(plan, 2, light).deferred_grads == 30


def test_activation_offload_is_measured_in_the_fake_world() -> None:
    """Activation offload keyed its host copies by data pointer (0 for every fake tensor: one copy per
    block), counted them as device memory, and viewed storages through `Tensor.set_`, which the fake
    mode's dispatch cache keys by the storage object, keeping every copied storage alive into the next
    step (Llama 3.2 1B: measured 30.9 GiB against an 8.6 GiB estimate). Now each storage has its copy,
    copies are host memory, backward reads a device copy as on an accelerator, and the peak (a loss
    backward, no block restored yet, as at real vocabulary sizes) equals the estimate. With a tiny
    vocabulary the peak is the second block's backward instead (two blocks restored, every later unit's
    gradient shard made), a moment the estimate now has: its gradients equal, its total 5% under (a
    restored block is freed whole as its backward ends, not node by node; not modelled)."""
    plan = Plan.from_string("dp_shard=2,activation_offload=true,param_dtype=bfloat16").resolve(2)
    for vocab, within in ((8192, 0.001), (256, 0.06)):
        (r,) = dry_run(LlamaConfig(**dict(DENSE, vocab_size=vocab)), plan, 2, Workload(seq=128, mbs=1), ranks=[0],
                       jobs=1).ranks
        assert not r.collective_differences, r.collective_differences
        measured, estimated = r.run.measured.peak.bytes, r.estimate.peak_bytes
        assert abs(estimated - measured) / measured < within, (vocab, measured, estimated)
        if vocab == 256:
            assert r.estimate.parts["gradients"] == r.run.measured.peak.parts["gradients"] > 0


def test_a_view_of_a_fake_storage_lets_it_go() -> None:
    """`view_of_storage` under fake tensors leaves no reference to the storage behind (the fake mode's
    dispatch cache holds the storage of every `Tensor.set_` it caches)."""
    import gc
    import weakref

    from meshkit._compat.dispatch import fake_tensor_mode
    from meshkit._compat.fake import view_of_storage

    with fake_tensor_mode():
        x = torch.empty(1000)
        storage = x.untyped_storage()
        alive = weakref.ref(storage)
        view = view_of_storage(storage, torch.uint8, x.device, like=x, view=(0, (16,), (1,)))
        assert view.untyped_storage()._cdata == storage._cdata
        del x, storage, view
        gc.collect()
        assert alive() is None


def test_nvme_offload_runs_in_the_fake_world(tmp_path) -> None:
    """`offload="nvme"` paged the optimizer state through the tensors' data pointers, which fake tensors do
    not have (OSError: Bad address), and reserved the real file's size: no dry run. In a fake world the
    store now resizes the state's storages as it would and moves no bytes; the peak equals the estimate
    and nothing is reserved on disk."""
    plan = Plan.from_string(f"dp_shard=2,offload=nvme,offload_dir={tmp_path},param_dtype=bfloat16").resolve(2)
    result = dry_run(LlamaConfig(**TIED), plan, 2, Workload(seq=32, mbs=1, microbatches=1), ranks=[0], jobs=1)
    (r,) = result.ranks
    assert not r.collective_differences, r.collective_differences
    assert abs(r.estimate.peak_bytes / r.run.measured.peak.bytes - 1) < 0.05, (r.estimate.peak_bytes,
                                                                               r.run.measured.peak.bytes)
    assert all(f.stat().st_size == 0 for f in tmp_path.iterdir()), [f.stat().st_size for f in tmp_path.iterdir()]


def test_dualpipe_mirror_ranks_both_hold_the_loss() -> None:
    """DualPipe runs the last chunk on pp rank pp-1 (one direction) and on rank 0 (the other): both end in
    the head and the loss, and the pair's schedules mirror each other, so their peaks are equal (the dry
    run measured 39.50 GiB on both at Llama 3.2 3B, pp=4). The estimator gave the loss to the last stage
    id only (rank 0's), and estimated rank pp-1 11% low."""
    config = LlamaConfig(**TIED)
    plan = Plan.from_string("pp=4,pp_schedule=dualpipe,pp_microbatches=8,param_dtype=bfloat16").resolve(4)
    workload = Workload(seq=64, mbs=1, microbatches=8)
    first, last = rank_memory(config, plan, workload, 0), rank_memory(config, plan, workload, 3)
    assert first.head and last.head
    assert first.peak == last.peak, (first.peak, last.peak)
