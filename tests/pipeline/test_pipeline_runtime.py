"""The pipeline runtime: every schedule gives the single-process loss and gradients, on toy and HF stages.

Each rank builds the same model from one seed and keeps only its stages; the test process builds the
reference, runs it on the whole batch, and compares every gradient by name. Gradients are pre-filled
and two `run_schedule` calls are made, so accumulation (never zeroing, never rescaling) is checked
on every case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from meshkit.activation_checkpoint import CheckpointedBlock
from meshkit.models.stage import CausalLMStage
from meshkit.pipeline.runtime import TensorMeta, run_schedule
from meshkit.pipeline.schedules import build_schedule
from meshkit.pipeline.weight_grad import PendingWeightGrads, collecting, deferrable_linears
from meshkit.step import loss as loss_lib
from meshkit.testing import RankFailure
from meshkit.testing.reference import ModelSpec

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]
CALLS = 2  # run_schedule calls per case: gradients must accumulate across them
ATOL, RTOL = 1e-5, 1e-4  # fp32; does not depend on pp


def _split(n: int, parts: int) -> list[range]:
    """`n` layers over `parts` stages, sizes differing by at most one, larger stages last."""
    base, extra = divmod(n, parts)
    sizes = [base + (i >= parts - extra) for i in range(parts)]
    starts = [sum(sizes[:i]) for i in range(parts)]
    return [range(a, a + size) for a, size in zip(starts, sizes)]


def _prefill(named: dict[str, nn.Parameter]) -> None:
    """A gradient already present before the step, so a runtime that zeroes or rescales is caught."""
    for i, (_, p) in enumerate(sorted(named.items())):
        p.grad = torch.full_like(p, 0.01 * (i % 7 - 3))


def _grads(named) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in named if p.grad is not None}


def _assert_matches(results: list[tuple[list[float], dict]], ref_losses: list[float], ref_grads: dict) -> None:
    losses = [r[0] for r in results if r[0]]
    assert len(losses) == 1, "exactly one rank holds the last stage"
    assert losses[0] == pytest.approx(ref_losses, rel=RTOL, abs=ATOL)
    merged: dict[str, torch.Tensor] = {}
    for _, grads in results:
        assert not set(grads) & set(merged), "each parameter lives on one rank"
        merged.update(grads)
    assert sorted(merged) == sorted(ref_grads)
    for name, grad in merged.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------------------------------- toy stages


class _ToyStage(nn.Module):
    """Linear+tanh layers (global names kept), plus a per-microbatch `shift` to exercise stage_kwargs."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layer for i, layer in layers.items()})

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x + shift


def _toy_model(num_layers: int, dim: int) -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({str(i): nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for i in range(num_layers)})


def _toy_data(call: int, m: int, rows: int, dim: int):
    gen = torch.Generator().manual_seed(100 + call)
    xs = [torch.randn(rows, 3, dim, generator=gen) for _ in range(m)]
    targets = [torch.randn(rows, 3, dim, generator=gen) for _ in range(m)]
    shifts = [{"shift": torch.randn(dim, generator=gen)} for _ in range(m)]
    return xs, targets, shifts


def _toy_loss(out: torch.Tensor, target: torch.Tensor, denominator: float) -> torch.Tensor:
    return (out - target).square().sum() / denominator


TOY = {"layers": 8, "dim": 6, "rows": 2}


def _toy_worker(name: str, v: int, m: int) -> tuple[list[float], dict]:
    pp, rank = dist.get_world_size(), dist.get_rank()
    schedule = build_schedule(name, pp, m, v)
    model = _toy_model(TOY["layers"], TOY["dim"])
    _prefill(dict(model.named_parameters()))
    owner = schedule.stage_to_rank()
    stages = {s: _ToyStage({i: model[str(i)] for i in layers})
              for s, layers in enumerate(_split(TOY["layers"], schedule.num_stages)) if owner[s] == rank}
    denominator = float(m * TOY["rows"] * 3 * TOY["dim"])
    losses = []
    for call in range(CALLS):
        xs, targets, shifts = _toy_data(call, m, TOY["rows"], TOY["dim"])
        out = run_schedule(schedule, stages, pp_group=dist.group.WORLD, microbatch_inputs=xs,
                           loss_fn=lambda y, mb, t=targets: _toy_loss(y, t[mb], denominator),
                           shapes=TensorMeta((TOY["rows"], 3, TOY["dim"]), torch.float32), stage_kwargs=shifts)
        if out:
            assert len(out) == m and all(not t.requires_grad for t in out)
            losses.append(sum(t.item() for t in out))
    mine = {p for s in stages.values() for p in s.parameters()}
    return losses, _grads((n, p) for n, p in model.named_parameters() if p in mine)


def _toy_reference(num_stages: int, m: int) -> tuple[list[float], dict]:
    """The same stages chained in one process (each stage adds the shift, as in the pipeline)."""
    model = _toy_model(TOY["layers"], TOY["dim"])
    _prefill(dict(model.named_parameters()))
    stages = [_ToyStage({i: model[str(i)] for i in layers}) for layers in _split(TOY["layers"], num_stages)]

    def chain(x, **kwargs):
        for stage in stages:
            x = stage(x, **kwargs)
        return x

    denominator = float(m * TOY["rows"] * 3 * TOY["dim"])
    losses = []
    for call in range(CALLS):
        xs, targets, shifts = _toy_data(call, m, TOY["rows"], TOY["dim"])
        loss = sum(_toy_loss(chain(x, **kw), t, denominator) for x, t, kw in zip(xs, targets, shifts))
        loss.backward()
        losses.append(loss.item())
    return losses, _grads(model.named_parameters())


@pytest.mark.parametrize("pp", [1, 2, 4])  # pp=1: consecutive stages hand over on one rank
@pytest.mark.parametrize(("name", "v"), SCHEDULES)
def test_toy_stages_match_single_process(dist, pp, name, v):
    m = pp + 1  # not a multiple of pp: interleaved takes the remainder in its first group
    results = dist(pp).run(_toy_worker, name, v, m)
    _assert_matches(results, *_toy_reference(pp * v, m))


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", ["zb_h2", "zb_v", "dualpipe_v"])
def test_zero_bubble_schedules_match_single_process(dist, pp, name):
    """ZB-H2 and the V schedules (two stages per rank, the last one on rank 0, B/W and BW mixed)."""
    m = 2 * pp + 1
    results = dist(pp).run(_toy_worker, name, 1, m)
    _assert_matches(results, *_toy_reference(build_schedule(name, pp, m).num_stages, m))


@given(pp=st.sampled_from([2, 4]), schedule=st.sampled_from(SCHEDULES), m=st.integers(1, 9))
def test_toy_stages_match_for_any_microbatch_count(dist, pp, schedule, m):
    name, v = schedule
    if name == "interleaved_1f1b":
        m = max(m, pp)  # needs a full first group
    results = dist(pp).run(_toy_worker, name, v, m)
    _assert_matches(results, *_toy_reference(pp * v, m))


# -------------------------------------------------------------------------------------------- HF stages

LLAMA = ModelSpec(layers=4, heads=4, kv_heads=2, head_dim=8, intermediate=48, vocab=64)
SEQ, ROWS = 8, 2  # per microbatch


def _llama_batch(call: int, m: int, vocab: int):
    gen = torch.Generator().manual_seed(7 + call)
    ids = torch.randint(0, vocab, (m * ROWS, SEQ), generator=gen)
    labels = ids.clone()
    labels[torch.rand(labels.shape, generator=gen) < 0.25] = loss_lib.IGNORE_INDEX
    labels[0, 1] = ids[0, 1]
    return ids, labels


def _llama_stages(model, schedule, rank: int, checkpointing: str) -> dict[int, nn.Module]:
    inner, last = model.model, schedule.num_stages - 1
    owner = schedule.stage_to_rank()
    stages = {}
    for s, layers in enumerate(_split(len(inner.layers), schedule.num_stages)):
        if owner[s] != rank:
            continue
        blocks = {i: inner.layers[i] if checkpointing == "none" else CheckpointedBlock(inner.layers[i], checkpointing)
                  for i in layers}
        stages[s] = CausalLMStage(blocks, inner.rotary_emb, embed=inner.embed_tokens if s == 0 else None,
                                  norm=inner.norm if s == last else None,
                                  lm_head=model.lm_head if s == last else None)
    return stages


def _llama_worker(spec: ModelSpec, name: str, v: int, m: int, checkpointing: str) -> tuple[list[float], dict]:
    pp, rank = dist.get_world_size(), dist.get_rank()
    schedule = build_schedule(name, pp, m, v)
    model = spec.build()
    _prefill(dict(model.named_parameters()))
    stages = _llama_stages(model, schedule, rank, checkpointing)
    pos = torch.arange(SEQ).unsqueeze(0)
    losses = []
    for call in range(CALLS):
        ids, labels = _llama_batch(call, m, spec.vocab)
        shifted = loss_lib.shift_labels(labels)
        denominator = float(loss_lib.local_valid_tokens(shifted))
        rows = [slice(mb * ROWS, (mb + 1) * ROWS) for mb in range(m)]

        def loss_fn(logits, mb, shifted=shifted, denominator=denominator, rows=rows):
            return loss_lib.summed_cross_entropy(logits, shifted[rows[mb]]) / denominator

        out = run_schedule(schedule, stages, pp_group=dist.group.WORLD, microbatch_inputs=[ids[r] for r in rows],
                           loss_fn=loss_fn, stage_kwargs=[{"position_ids": pos}] * m,
                           shapes=TensorMeta((ROWS, SEQ, spec.heads * spec.head_dim), torch.float32))
        if out:
            losses.append(sum(t.item() for t in out))
    mine = {p for s in stages.values() for p in s.parameters()}
    return losses, _grads((n, p) for n, p in model.named_parameters() if p in mine)


def _llama_reference(spec: ModelSpec, m: int) -> tuple[list[float], dict]:
    model = spec.build()
    _prefill(dict(model.named_parameters()))
    losses = []
    for call in range(CALLS):
        ids, labels = _llama_batch(call, m, spec.vocab)
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
    return losses, _grads(model.named_parameters())


# Selective checkpointing runs at one pipeline depth only: its interaction with the B/W split does
# not depend on pp.
@pytest.mark.parametrize(("pp", "name", "v", "checkpointing"),
                         [(pp, n, v, "none") for pp in (2, 4) for n, v in SCHEDULES]
                         + [(2, "zb_h1", 1, "full"), (4, "zb_h1", 1, "full"), (2, "zb_h1", 1, "selective")]
                         + [(2, "zb_h2", 1, "none"), (4, "zb_v", 1, "none"), (2, "zb_v", 1, "full"),
                            (2, "dualpipe_v", 1, "selective")])
def test_llama_stages_match_hf(dist, pp, name, v, checkpointing):
    stages = build_schedule(name, pp, 2 * pp, v).num_stages
    m = 2 * pp if name == "dualpipe_v" else pp
    spec = ModelSpec(**{**LLAMA.__dict__, "layers": max(LLAMA.layers, stages)})
    results = dist(pp).run(_llama_worker, spec, name, v, m, checkpointing)
    _assert_matches(results, *_llama_reference(spec, m))


# ------------------------------------------------------------------------------------------- failures


def _failing_worker() -> None:
    rank = dist.get_rank()
    schedule = build_schedule("1f1b", 4, 4)
    model = _toy_model(4, 3)

    class Exploding(_ToyStage):
        def forward(self, x, shift):
            if rank == 2 and torch.equal(shift, torch.ones(3)):
                raise RuntimeError("stage exploded")
            return super().forward(x, shift)

    stages = {rank: Exploding({rank: model[str(rank)]})}
    kwargs = [{"shift": torch.full((3,), float(mb))} for mb in range(4)]
    run_schedule(schedule, stages, pp_group=dist.group.WORLD, microbatch_inputs=[torch.randn(2, 3)] * 4,
                 loss_fn=lambda y, mb: y.sum(), shapes=TensorMeta((2, 3), torch.float32), stage_kwargs=kwargs)


def test_stage_exception_surfaces_as_rank_failure(dist):
    with pytest.raises(RankFailure) as info:
        dist(4).run(_failing_worker, timeout=60)
    assert info.value.ranks[0] == 2
    assert "stage exploded" in str(info.value) and "failed in F2.1" in str(info.value)


def _wrong_shape_worker() -> None:
    schedule = build_schedule("gpipe", 2, 2)
    model = _toy_model(2, 3)
    stages = {dist.get_rank(): _ToyStage({dist.get_rank(): model[str(dist.get_rank())]})}
    run_schedule(schedule, stages, pp_group=dist.group.WORLD, microbatch_inputs=[torch.randn(2, 3)] * 2,
                 loss_fn=lambda y, mb: y.sum(), shapes=TensorMeta((2, 4), torch.float32),
                 stage_kwargs=[{"shift": torch.zeros(3)}] * 2)


def test_wrong_declared_shape_fails_on_the_sender(dist):
    with pytest.raises(RankFailure) as info:
        dist(2).run(_wrong_shape_worker, timeout=60)
    assert info.value.ranks[0] == 0
    assert "stage 0 output for microbatch 0 is (2, 3) torch.float32, but shapes declares (2, 4)" in str(info.value)


# --------------------------------------------------------------------------------- the B/W split itself


def test_weight_grads_wait_for_w_and_reach_grad_once():
    torch.manual_seed(0)
    blocks = nn.Sequential(*[CheckpointedBlock(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.LayerNorm(4)), "full")
                             for _ in range(3)])
    recomputes, hooks = [], []
    for block in blocks:
        block.block.register_forward_pre_hook(lambda *_: recomputes.append(1))
    blocks[0].block[0].weight.register_post_accumulate_grad_hook(lambda p: hooks.append(p.grad.clone()))
    x = torch.randn(2, 5, 4)
    with deferrable_linears([blocks]) as patched:
        assert len(patched) == 3
        out = blocks(x)  # x needs no grad: the first linear must still build a graph
        recomputes.clear()
        pending = PendingWeightGrads()
        with collecting(pending):
            out.square().sum().backward()
        assert len(recomputes) == 3 and len(pending) == 3
        assert all(b.block[0].weight.grad is None for b in blocks) and not hooks
        assert all(b.block[2].weight.grad is not None for b in blocks)  # non-linear params: in B
        pending.run()
        assert len(recomputes) == 3 and len(hooks) == 1  # W recomputes nothing; each hook fires once
    assert all("forward" not in m.__dict__ for m in blocks.modules())
    expected = blocks(x)
    for p in blocks.parameters():
        p.grad = None
    expected.square().sum().backward()
    torch.testing.assert_close(hooks[0], blocks[0].block[0].weight.grad)


def test_compiled_blocks_keep_their_weight_grads_in_b():
    blocks = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    blocks[1].compile()  # lazily: nothing is compiled until called
    with deferrable_linears([blocks]) as patched:
        assert patched == [blocks[0]]


# ------------------------------------------------------------------------------------------ with FSDP2


def _fsdp_worker(name: str, m: int, param_dtype: torch.dtype, checkpointing: str) -> tuple[list[float], dict]:
    """pp=2 x dp_shard=2: each data rank pipelines half of every microbatch; FSDP sums the halves."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from meshkit._compat.fsdp import fsdp_sum_gradients

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    schedule = build_schedule(name, 2, m)
    model = _toy_model(TOY["layers"], TOY["dim"])
    (layers,) = [r for s, r in enumerate(_split(TOY["layers"], 2)) if s == pp_rank]
    stage = _ToyStage({i: model[str(i)] if checkpointing == "none" else CheckpointedBlock(model[str(i)], checkpointing)
                       for i in layers})
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for module in [*stage.layers.values(), stage]:
        fully_shard(module, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
        fsdp_sum_gradients(module)
    _prefill(dict(model.named_parameters()))  # after fully_shard, which replaced the parameters
    denominator = float(m * TOY["rows"] * 3 * TOY["dim"])
    half = slice(dp_rank * TOY["rows"] // 2, (dp_rank + 1) * TOY["rows"] // 2)
    losses = []
    for call in range(CALLS):
        xs, targets, shifts = _toy_data(call, m, TOY["rows"], TOY["dim"])
        out = run_schedule(schedule, {pp_rank: stage}, pp_group=mesh.get_group("pp"),
                           microbatch_inputs=[x[half].to(param_dtype) for x in xs],
                           loss_fn=lambda y, mb, t=targets: _toy_loss(y.float(), t[mb][half], denominator),
                           shapes=TensorMeta((TOY["rows"] // 2, 3, TOY["dim"]), param_dtype), stage_kwargs=shifts)
        if out:
            total = torch.stack(out).sum()
            dist.all_reduce(total, group=mesh.get_group("dp"))
            losses.append(total.item())
    mine = set(stage.parameters())
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p in mine}
    assert all(isinstance(p.grad, DTensor) for p in mine)
    return (losses, grads) if dp_rank == 0 else ([], {})


@pytest.mark.parametrize(("name", "param_dtype", "checkpointing"), [
    ("1f1b", torch.float32, "none"), ("zb_h1", torch.float32, "none"), ("zb_h1", torch.bfloat16, "none"),
    ("zb_h1", torch.float32, "full")])
def test_fsdp2_reduces_once_after_the_last_w(dist, name, param_dtype, checkpointing):
    m = 3
    results = dist(4).run(_fsdp_worker, name, m, param_dtype, checkpointing)
    ref_losses, ref_grads = _toy_reference(2, m)
    if param_dtype == torch.float32:
        _assert_matches(results, ref_losses, ref_grads)
        return
    merged = {n: g for _, grads in results for n, g in grads.items()}
    assert sorted(merged) == sorted(ref_grads)
    for name_, grad in merged.items():  # bf16 compute, fp32 reduction: a lost microbatch is ~1/m off
        torch.testing.assert_close(grad, ref_grads[name_], atol=3e-3, rtol=3e-2, msg=lambda s, n=name_: f"{n}: {s}")


# ---------------------------------------------------------------------------- with tensor parallelism


class _MLPStage(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x + shift)))


def _mlp_model(dim: int) -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({str(s): _MLPStage(dim) for s in range(2)})


def _tp_worker(m: int) -> tuple[list[float], dict]:
    """pp=2 x tp=2, ZB-H1: DTensor weights in the B/W split, and a DTensor stage output on the wire."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp_rank, tp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    model = _mlp_model(TOY["dim"])
    stage = parallelize_module(model[str(pp_rank)], mesh["tp"], {
        "up": ColwiseParallel(), "down": RowwiseParallel(output_layouts=Replicate(), use_local_output=False)})
    _prefill(dict(model.named_parameters()))
    denominator = float(m * TOY["rows"] * 3 * TOY["dim"])
    losses = []
    for call in range(CALLS):
        xs, targets, shifts = _toy_data(call, m, TOY["rows"], TOY["dim"])
        out = run_schedule(build_schedule("zb_h1", 2, m), {pp_rank: stage}, pp_group=mesh.get_group("pp"),
                           microbatch_inputs=xs, stage_kwargs=shifts,
                           loss_fn=lambda y, mb, t=targets: _toy_loss(y.to_local(), t[mb], denominator),
                           shapes=TensorMeta((TOY["rows"], 3, TOY["dim"]), torch.float32))
        if out:
            losses.append(sum(t.item() for t in out))
    mine = set(stage.parameters())
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p in mine}
    return (losses, grads) if tp_rank == 0 else ([], {})


def test_tensor_parallel_stages_under_zb_h1(dist):
    m = 3
    results = dist(4).run(_tp_worker, m)
    model = _mlp_model(TOY["dim"])
    _prefill(dict(model.named_parameters()))
    denominator = float(m * TOY["rows"] * 3 * TOY["dim"])
    losses = []
    for call in range(CALLS):
        xs, targets, shifts = _toy_data(call, m, TOY["rows"], TOY["dim"])
        loss = sum(_toy_loss(model["1"](model["0"](x, **kw), **kw), t, denominator)
                   for x, t, kw in zip(xs, targets, shifts))
        loss.backward()
        losses.append(loss.item())
    _assert_matches(results, losses, _grads(model.named_parameters()))
