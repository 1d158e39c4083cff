"""Expert parallelism at the op level: dispatch, the MoE layer, grouped GEMM, balancing, recompute.

Every expert-parallel run is compared with the same MoE on one process with every expert local
(each rank's own tokens), and the single-process layer with HF's Mixtral / Qwen3-MoE blocks and a
dense fp64 loop. Ranks rebuild weights and inputs from the case's seed, so only small results travel.
Routings are forced through `expert_bias` (selection only) to reach the crash cases of the notes:
every token to one expert, experts nobody picks, ranks that receive no tokens.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as tdist
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from meshkit.activation_checkpoint import CheckpointedBlock
from meshkit.expert_parallel import (
    MoE,
    apply_expert_parallel,
    from_hf_layout,
    hf_load_balancing_loss,
    pop_router_stats,
    switch_aux_loss,
    to_hf_layout,
    update_expert_biases,
)
from meshkit.expert_parallel.dispatch import combine, dispatch, plan_dispatch
from meshkit.expert_parallel.grouped_gemm import grouped_mm_usable, swiglu_experts

ATOL, RTOL = 1e-5, 1e-4  # fp32, the same for every ep
ROUTINGS = ("random", "one_expert", "first_rank", "some_empty")


def _close(got, want, what: str, atol: float = ATOL, rtol: float = RTOL) -> None:
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# -- shared builders ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    world: int
    ep: int
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: tuple[int, ...]  # per rank
    score_func: str = "softmax"
    normalize: bool = True
    shared: int = 0
    backend: str = "auto"
    routing: str = "random"
    mesh: bool = False
    capacity: float | None = None
    aux: float = 0.0
    z: float = 0.0
    seed: int = 0


def _bias(case: Case) -> torch.Tensor:
    """Selection bias that forces the case's routing pattern (scores stay the router's)."""
    E, local = case.experts, case.experts // case.ep
    bias = torch.zeros(E)
    if case.routing == "one_expert":
        bias[0] = 100.0  # expert 0 in every top-k: with K = 1 every token goes to one expert
    elif case.routing == "first_rank":
        bias[:local] = 100.0  # experts of ep rank 0 first: other ranks receive nothing when K <= E/ep
    elif case.routing == "some_empty":
        g = torch.Generator().manual_seed(case.seed + 7)
        bias[torch.randperm(E, generator=g)[: E - case.top_k]] = -100.0
    return bias


def _build(case: Case, **overrides) -> MoE:
    torch.manual_seed(case.seed)
    kw = dict(score_func=case.score_func, normalize_topk=case.normalize, shared_intermediate_size=case.shared,
              expert_backend=case.backend, capacity_factor=case.capacity, aux_loss_coef=case.aux,
              z_loss_coef=case.z, bias_update_rate=1e-3, init_std=0.4)
    kw.update(overrides)
    moe = MoE(case.hidden, case.inter, case.experts, case.top_k, **kw)
    if moe.expert_bias is not None:
        moe.expert_bias.copy_(_bias(case))
    return moe


def _tokens(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed * 1000 + rank)
    x = torch.randn(case.tokens[rank], case.hidden, generator=g)
    dy = torch.randn(case.tokens[rank], case.hidden, generator=g)
    return x, dy


def _ep_groups(case: Case):
    """(ep group or mesh, replica group of the same experts) for this rank."""
    if case.mesh:
        mesh = init_device_mesh("cpu", (case.world // case.ep, case.ep), mesh_dim_names=("rep", "ep"))
        return mesh["ep"], mesh["rep"].get_group()
    if case.ep == case.world:
        return tdist.group.WORLD, None
    ep_group, _ = tdist.new_subgroups(group_size=case.ep)
    rep = [[r for r in range(case.world) if r % case.ep == j] for j in range(case.ep)]
    rep_group, _ = tdist.new_subgroups_by_enumeration(rep)
    return ep_group, rep_group


def _grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    return (g.to_local() if isinstance(g, DTensor) else g).detach().clone()


def _summed(t: torch.Tensor, group=None) -> torch.Tensor:
    t = t.clone()
    tdist.all_reduce(t, group=group)
    return t


# -- dispatch round trip ------------------------------------------------------------------------------


def _routing(case: Case, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ids, capacity mask and weights of `rank`'s tokens, regenerated from the seed anywhere."""
    g = torch.Generator().manual_seed(case.seed * 1000 + 500 + rank)
    T, K, E = case.tokens[rank], case.top_k, case.experts
    if case.routing == "one_expert":
        expert = torch.zeros(T, K, dtype=torch.long)
    elif case.routing == "first_rank":
        expert = torch.randint(0, E // case.ep, (T, K), generator=g)
    elif case.routing == "some_empty":
        expert = torch.randint(0, max(1, E // 3), (T, K), generator=g) * 3 % E
    else:
        expert = torch.randint(0, E, (T, K), generator=g)
    keep = torch.rand(T, K, generator=g) > 0.3
    weights = torch.rand(T, K, generator=g)
    return expert, keep, weights


def _round_trip_worker(case: Case, drop: bool):
    rank = tdist.get_rank()
    x, dy = _tokens(case, rank)
    x.requires_grad_()
    expert, keep, weights = _routing(case, rank)
    plan = plan_dispatch(expert, case.experts, tdist.group.WORLD, keep if drop else None)
    rows = dispatch(x, plan)  # identity experts
    out = combine(rows, plan, weights)
    out.backward(dy)
    return rows.detach(), plan.tokens_per_local_expert, plan.dropped, out.detach(), x.grad


def _check_round_trip(dist, case: Case, drop: bool) -> None:
    world, local = case.world, case.experts // case.ep
    results = dist(world).run(_round_trip_worker, case, drop)
    routings = [_routing(case, r) for r in range(world)]
    inputs = [_tokens(case, r) for r in range(world)]
    for rank, (rows, per_expert, dropped, out, xg) in enumerate(results):
        expected_rows, expected_counts = [], []
        for e in range(rank * local, (rank + 1) * local):  # expert-major, then source rank, then token order
            block = []
            for src, (expert, keep, _) in enumerate(routings):
                hit = (expert == e) & (keep if drop else torch.ones_like(keep))
                block += [inputs[src][0][t] for t, k in hit.nonzero().tolist()]
            expected_counts.append(len(block))
            expected_rows += block
        assert per_expert == expected_counts
        want = torch.stack(expected_rows) if expected_rows else torch.empty(0, case.hidden)
        assert torch.equal(rows, want)
        expert, keep, weights = routings[rank]
        kept_w = weights * keep if drop else weights
        assert dropped == (int((~keep).sum()) if drop else 0)
        _close(out, inputs[rank][0] * kept_w.sum(1, keepdim=True), "round-trip output")
        _close(xg, inputs[rank][1] * kept_w.sum(1, keepdim=True), "round-trip input gradient")


@pytest.mark.parametrize("world", [2, 4])
@given(data=st.data())
def test_dispatch_round_trip(dist, world, data):
    local = data.draw(st.integers(1, 3), label="experts per rank")
    case = Case(world=world, ep=world, experts=world * local, top_k=data.draw(st.integers(1, 3)), hidden=4,
                inter=4, tokens=tuple(data.draw(st.lists(st.integers(0, 7), min_size=world, max_size=world))),
                routing=data.draw(st.sampled_from(ROUTINGS)), seed=data.draw(st.integers(0, 2**16)))
    drop = data.draw(st.booleans(), label="drop")
    _check_round_trip(dist, case, drop)


@pytest.mark.parametrize("case", [
    Case(world=4, ep=4, experts=4, top_k=1, hidden=4, inter=4, tokens=(5, 0, 3, 2), routing="one_expert"),
    Case(world=2, ep=2, experts=4, top_k=2, hidden=4, inter=4, tokens=(4, 6), routing="first_rank", seed=3),
    Case(world=2, ep=2, experts=2, top_k=1, hidden=4, inter=4, tokens=(0, 0)),
], ids=["all-to-one", "one-rank-receives-all", "no-tokens"])
def test_dispatch_round_trip_crash_cases(dist, case):
    _check_round_trip(dist, case, drop=False)


# -- the layer vs single device -------------------------------------------------------------------------


def _ep_vs_single_worker(case: Case):
    rank = tdist.get_rank()
    moe = _build(case)
    ref = copy.deepcopy(moe)
    ep, rep_group = _ep_groups(case)
    apply_expert_parallel(moe, ep, load_group=tdist.group.WORLD)
    x, dy = _tokens(case, rank)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    out = moe(x)
    (out * dy).sum().backward()
    out_ref = ref(x_ref)
    (out_ref * dy).sum().backward()
    replicated = {n: _summed(_grad(p)) for n, p in moe.named_parameters() if not n.startswith("experts.")}
    ref_full = {n: _summed(p.grad) for n, p in ref.named_parameters()}
    experts = {n: _grad(p) for n, p in moe.named_parameters() if n.startswith("experts.")}
    if rep_group is not None:
        experts = {n: _summed(g, rep_group) for n, g in experts.items()}
    ep_rank = tdist.get_rank(ep.get_group() if case.mesh else ep)
    return dict(out=out.detach(), out_ref=out_ref.detach(), xg=x.grad, xg_ref=x_ref.grad, replicated=replicated,
                experts=experts, ref=ref_full, ep_rank=ep_rank, dropped=moe.dropped_last,
                dropped_ref=ref.dropped_last)


@st.composite
def layer_cases(draw, world: int, ep: int) -> Case:
    local = draw(st.integers(1, 3), label="experts per rank")
    E = ep * local
    return Case(
        world=world, ep=ep, experts=E, top_k=draw(st.integers(1, min(E, 3))),
        hidden=draw(st.sampled_from([8, 12, 6])), inter=draw(st.sampled_from([4, 8, 5])),
        tokens=tuple(draw(st.lists(st.integers(0, 9), min_size=world, max_size=world))),
        score_func=draw(st.sampled_from(["softmax", "sigmoid"])), normalize=draw(st.booleans()),
        shared=draw(st.sampled_from([0, 4])), backend=draw(st.sampled_from(["auto", "loop"])),
        routing=draw(st.sampled_from(ROUTINGS)), mesh=draw(st.booleans()),
        capacity=draw(st.sampled_from([None, None, 1.0])), seed=draw(st.integers(0, 2**16)),
    )


def _check_layer(dist, case: Case) -> None:
    results = dist(case.world).run(_ep_vs_single_worker, case)
    local = case.experts // case.ep
    for rank, r in enumerate(results):
        _close(r["out"], r["out_ref"], f"rank {rank} output")
        _close(r["xg"], r["xg_ref"], f"rank {rank} input gradient")
        assert r["dropped"] == r["dropped_ref"]
        for name, g in r["replicated"].items():  # summed over ranks: identical everywhere, = single device
            assert torch.equal(g, results[0]["replicated"][name]), f"{name} differs between ranks"
            _close(g, r["ref"][name], f"rank {rank} {name} gradient")
        block = slice(r["ep_rank"] * local, (r["ep_rank"] + 1) * local)
        for name, g in r["experts"].items():
            _close(g, r["ref"][name][block], f"rank {rank} {name} gradient (owned experts)")


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2)])
@given(data=st.data())
def test_layer_matches_single_device(dist, world, ep, data):
    _check_layer(dist, data.draw(layer_cases(world, ep)))


CRASH_CASES = [  # the notes' crash cases, pinned so every run has them whatever hypothesis draws
    Case(world=2, ep=2, experts=2, top_k=1, hidden=8, inter=4, tokens=(6, 5), routing="one_expert", seed=1),
    Case(world=4, ep=4, experts=8, top_k=2, hidden=8, inter=8, tokens=(3, 7, 0, 5), routing="first_rank",
         shared=4, seed=2),
    Case(world=4, ep=2, experts=4, top_k=1, hidden=8, inter=4, tokens=(0, 0, 4, 0), routing="one_expert",
         mesh=True, seed=3),
    Case(world=2, ep=2, experts=4, top_k=2, hidden=8, inter=4, tokens=(0, 0), seed=4),
    Case(world=4, ep=4, experts=4, top_k=1, hidden=8, inter=4, tokens=(9, 2, 5, 1), routing="one_expert",
         capacity=1.0, score_func="sigmoid", seed=5),
    Case(world=2, ep=2, experts=6, top_k=2, hidden=8, inter=4, tokens=(8, 3), routing="some_empty",
         backend="loop", seed=6),
]


@pytest.mark.parametrize("case", CRASH_CASES, ids=lambda c: f"ep{c.ep}of{c.world}-{c.routing}-T{c.tokens}")
def test_layer_crash_cases(dist, case):
    _check_layer(dist, case)


# -- the single-process layer vs independent references -------------------------------------------------


def _dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """fp64 per-token loop: a different algorithm from dispatch + grouped GEMM."""
    w = {n: p.detach().double() for n, p in moe.named_parameters()}
    logits = x.double() @ w["gate.weight"].T
    scores = logits.softmax(-1) if moe.score_func == "softmax" else logits.sigmoid()
    select = scores + moe.expert_bias.double() if moe.expert_bias is not None else scores
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        idx = select[t].topk(moe.top_k).indices
        wt = scores[t, idx]
        if moe.normalize_topk:
            wt = wt / wt.sum()
        for e, we in zip(idx.tolist(), wt * moe.route_scale):
            gate, up = (w["experts.gate_up_proj"][e] @ x[t].double()).chunk(2)
            out[t] += we * (w["experts.down_proj"][e] @ (torch.nn.functional.silu(gate) * up))
    if moe.shared_expert is not None:
        out += moe.shared_expert.double()(x.double())
    return out


@given(data=st.data())
def test_layer_matches_dense_fp64_loop(data):
    case = Case(world=1, ep=1, experts=data.draw(st.integers(1, 6)), top_k=1, hidden=8, inter=4,
                tokens=(data.draw(st.integers(0, 12)),), score_func=data.draw(st.sampled_from(["softmax", "sigmoid"])),
                normalize=data.draw(st.booleans()), shared=data.draw(st.sampled_from([0, 4])),
                seed=data.draw(st.integers(0, 2**16)))
    case = replace(case, top_k=data.draw(st.integers(1, case.experts)))
    moe = _build(case, route_scale=data.draw(st.sampled_from([1.0, 2.5])))
    x, _ = _tokens(case, 0)
    _close(moe(x).double(), _dense_reference(moe, x), "output vs fp64 loop", atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("model", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_layer_equals_hf_sparse_blocks(model):
    """HF's state dict loads as is and gives the outputs of HF's blocks, to the bit in fp32
    (Qwen2-MoE: with its shared expert scaled by sigmoid(shared_expert_gate))."""
    options = {}
    if model == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config, normalize = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=6,
                                          num_experts_per_tok=2), True
    elif model == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        config, normalize = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6,
                                           num_experts_per_tok=2, norm_topk_prob=False), False
    else:
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block

        config, normalize = Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6,
                                           num_experts_per_tok=2, norm_topk_prob=False,
                                           shared_expert_intermediate_size=12), False
        options = dict(shared_intermediate_size=12, shared_expert_gate=True)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    hf = Block(config)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.4)
    moe = MoE(16, 8, 6, 2, normalize_topk=normalize, **options)
    moe.load_state_dict(hf.state_dict())  # same names, same layout: strict loading, no conversion
    x = torch.randn(3, 5, 16)
    assert torch.equal(moe(x), hf(x))


def test_transposed_hf_layout_maps_losslessly():
    """Llama4/Aria store experts as [E, H, 2I] / [E, I, H] and multiply x @ W; the mapping is a view."""
    g = torch.Generator().manual_seed(0)
    E, H, inter, counts = 3, 8, 4, [2, 0, 3]
    x = torch.randn(sum(counts), H, generator=g)
    gate_up_hf, down_hf = torch.randn(E, H, 2 * inter, generator=g), torch.randn(E, inter, H, generator=g)
    want = []
    for e, block in enumerate(torch.split(x, counts)):
        gate, up = (block @ gate_up_hf[e]).chunk(2, dim=-1)
        want.append((torch.nn.functional.silu(gate) * up) @ down_hf[e])
    gate_up, down = from_hf_layout(gate_up_hf, down_hf, transposed=True)
    _close(swiglu_experts(x, gate_up, down, counts), torch.cat(want), "transposed layout")
    assert all(torch.equal(a, b) for a, b in zip(to_hf_layout(gate_up, down, transposed=True), (gate_up_hf, down_hf)))


def test_bf16_layer_keeps_fp32_router_state():
    """bf16 experts (grouped GEMM), fp32 routing and combine; the bias stays fp32 through `.to`."""
    case = Case(world=1, ep=1, experts=4, top_k=2, hidden=16, inter=8, tokens=(12,), shared=8, seed=2)
    moe = _build(case)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([1e-3, -2e-3, 0.0, 3e-4]))
    bias = moe.expert_bias.clone()
    moe.to(torch.bfloat16)
    assert moe.expert_bias.dtype == torch.float32 and torch.equal(moe.expert_bias, bias)
    ref = copy.deepcopy(moe).float()  # the same bf16-rounded weights, computed in fp32
    x = _tokens(case, 0)[0].bfloat16()
    got, want = moe(x), ref(x.float()).detach()
    assert got.dtype == torch.bfloat16
    _close(got.float(), want, "bf16 vs fp32 layer", atol=1e-2 * want.abs().max().item(), rtol=2e-2)


# -- grouped GEMM vs loop --------------------------------------------------------------------------------


@given(
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    hidden=st.sampled_from([8, 16]),
    inter=st.sampled_from([8, 24]),
    seed=st.integers(0, 2**16),
)
def test_grouped_gemm_matches_loop(counts, dtype, hidden, inter, seed):
    g = torch.Generator().manual_seed(seed)
    E = len(counts)
    x = torch.randn(sum(counts), hidden, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * inter, hidden, generator=g) * 0.3).to(dtype)
    down = (torch.randn(E, hidden, inter, generator=g) * 0.3).to(dtype)
    dy = torch.randn(sum(counts), hidden, generator=g).to(dtype)
    assert grouped_mm_usable(x, gate_up, down)
    results = []
    for backend in ("grouped_mm", "loop"):
        leaves = [t.clone().requires_grad_() for t in (x, gate_up, down)]
        y = swiglu_experts(*leaves, counts, backend=backend)
        y.backward(dy)
        results.append([y.detach()] + [t.grad for t in leaves])
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, a, b in zip(("y", "dx", "dgate_up", "ddown"), *results):
        _close(a.float(), b.float(), f"grouped vs loop {name}", **tol)
    for e in (e for e, c in enumerate(counts) if c == 0):  # unused experts get exactly zero, not garbage
        assert not results[0][2][e].any() and not results[0][3][e].any()


def test_grouped_gemm_refuses_unaligned_and_auto_falls_back():
    x, gate_up, down = torch.randn(5, 6), torch.randn(2, 8, 6), torch.randn(2, 6, 4)
    assert not grouped_mm_usable(x, gate_up, down)
    with pytest.raises(ValueError, match="16-byte aligned"):
        swiglu_experts(x, gate_up, down, [2, 3], backend="grouped_mm")
    _close(swiglu_experts(x, gate_up, down, [2, 3]), swiglu_experts(x, gate_up, down, [2, 3], backend="loop"),
           "auto fallback")
    assert not grouped_mm_usable(x.double(), gate_up.double(), down.double())


# -- capacity ---------------------------------------------------------------------------------------------


@given(data=st.data())
def test_capacity_drops_are_counted(data):
    case = Case(world=1, ep=1, experts=data.draw(st.integers(2, 6)), top_k=1, hidden=8, inter=4,
                tokens=(data.draw(st.integers(1, 16)),), capacity=data.draw(st.sampled_from([0.5, 1.0, 1.5])),
                routing=data.draw(st.sampled_from(ROUTINGS)), seed=data.draw(st.integers(0, 2**16)))
    case = replace(case, top_k=data.draw(st.integers(1, case.experts)))
    moe = _build(case)
    x, _ = _tokens(case, 0)
    out = moe(x)
    # By hand: each expert keeps its `capacity` highest-scoring assignments.
    T, K, E = x.shape[0], case.top_k, case.experts
    capacity = math.ceil(case.capacity * T * K / E)
    scores = (x @ moe.gate.weight.detach().T).softmax(-1)
    chosen = (scores + moe.expert_bias).topk(K).indices
    dropped, keep = 0, torch.zeros(T, K, dtype=torch.bool)
    for e in range(E):
        hits = (chosen == e).nonzero().tolist()
        hits.sort(key=lambda tk: -scores[tk[0], e].item())
        dropped += max(0, len(hits) - capacity)
        for t, k in hits[:capacity]:
            keep[t, k] = True
    assert moe.dropped_last == dropped == int((~keep).sum())
    assert moe.dropped_total == dropped and moe.routed_total == T * K
    # Dropped assignments contribute nothing; kept ones keep their (normalised-over-all-K) weights.
    expected = torch.zeros_like(out)
    w = scores.gather(1, chosen)
    w = w / w.sum(1, keepdim=True)
    for t in range(T):
        for k in range(K):
            if keep[t, k]:
                e = chosen[t, k]
                gate, up = (moe.experts.gate_up_proj[e] @ x[t]).chunk(2)
                expected[t] += w[t, k] * (moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    _close(out, expected.detach(), "output with drops")


# -- balancing losses --------------------------------------------------------------------------------------


def _hand_losses(moe: MoE, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """α·E/(K T²)·Σ_e count_e·Σ_t p_te + β·mean_t lse_t², from the definitions."""
    T, E, K = x.shape[0], moe.num_experts, moe.top_k
    logits = x @ weight.T
    scores = logits.softmax(-1) if moe.score_func == "softmax" else logits.sigmoid()
    probs = scores if moe.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    chosen = (scores.detach() + moe.expert_bias).topk(K).indices
    counts = torch.bincount(chosen.flatten(), minlength=E).float()
    aux = moe.aux_loss_coef * E / (K * T * T) * (counts * probs.sum(0)).sum()
    return aux + moe.z_loss_coef * torch.logsumexp(logits, -1).square().mean()


@given(data=st.data())
def test_aux_and_z_loss_values_and_gradients(data):
    case = Case(world=1, ep=1, experts=data.draw(st.integers(2, 6)), top_k=1, hidden=8, inter=4,
                tokens=(data.draw(st.integers(1, 12)),), score_func=data.draw(st.sampled_from(["softmax", "sigmoid"])),
                aux=0.3, z=0.01, seed=data.draw(st.integers(0, 2**16)))
    case = replace(case, top_k=data.draw(st.integers(1, case.experts)))
    moe, plain = _build(case), _build(case, aux_loss_coef=0.0, z_loss_coef=0.0)
    x, dy = _tokens(case, 0)
    (moe(x) * dy).sum().backward()
    (plain(x) * dy).sum().backward()
    weight = moe.gate.weight.detach().clone().requires_grad_()
    hand = _hand_losses(moe, x, weight)
    hand.backward()
    _close(moe.aux_loss, hand.detach(), "aux + z loss value")
    # The attached losses reach the router exactly as if added to the model's loss.
    _close(moe.gate.weight.grad, plain.gate.weight.grad + weight.grad, "router gradient with aux losses")
    _close(moe.experts.gate_up_proj.grad, plain.experts.gate_up_proj.grad, "expert gradient is untouched by aux losses")


def test_aux_loss_scales():
    """Megatron's scale is 1 on a perfectly balanced router, HF's one-layer value is K times it."""
    E, K, T = 4, 2, 8
    moe = MoE(8, 4, E, K, aux_loss_coef=1.0)
    with torch.no_grad():
        moe.gate.weight.zero_()  # uniform probabilities; ties route tokens to experts 0 and 1 ...
    moe.keep_router_stats = True
    moe(torch.randn(T, 8))
    (stats,) = pop_router_stats(moe)
    stats.counts_E = torch.full((E,), T * K / E)  # ... so balance the counts by hand
    assert switch_aux_loss(stats).item() == pytest.approx(1.0)
    assert hf_load_balancing_loss([stats]).item() == pytest.approx(K)


def test_hf_pooled_aux_loss_matches_transformers():
    """`hf_load_balancing_loss` over two layers equals transformers' own function on their logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(3)
    E, K = 5, 2
    layers = [MoE(8, 4, E, K, init_std=0.5) for _ in range(2)]
    xs = [torch.randn(7, 8), torch.randn(7, 8)]
    for moe, x in zip(layers, xs):
        moe.keep_router_stats = True
        moe(x)
    stats = pop_router_stats(torch.nn.ModuleList(layers))
    logits = tuple(x @ m.gate.weight.detach().T for m, x in zip(layers, xs))
    want = load_balancing_loss_func(logits, E, K)
    _close(hf_load_balancing_loss(stats).detach(), want, "pooled HF aux loss")
    _close(hf_load_balancing_loss(stats[:1]).detach(), load_balancing_loss_func(logits[:1], E, K), "one layer")
    assert all(m.router_stats is None for m in layers)  # popped: no graph kept alive


def _global_aux_worker(case: Case):
    """Each rank's aux share vs the single-process layer on the concatenation of every rank's tokens."""
    rank = tdist.get_rank()
    moe = _build(case)
    ref = copy.deepcopy(moe)
    ep, _ = _ep_groups(case)
    apply_expert_parallel(moe, ep, load_group=tdist.group.WORLD)
    x, dy = _tokens(case, rank)
    (moe(x) * dy).sum().backward()
    everything = [_tokens(case, r) for r in range(case.world)]
    x_all, dy_all = (torch.cat([t[i] for t in everything]) for i in (0, 1))
    (ref(x_all) * dy_all).sum().backward()
    local = case.experts // case.ep
    block = slice(rank * local, (rank + 1) * local)
    return (_summed(moe.aux_loss), ref.aux_loss, _summed(moe.gate.weight.grad), ref.gate.weight.grad,
            moe.experts.gate_up_proj.grad, ref.experts.gate_up_proj.grad[block])


def test_aux_loss_is_the_global_batch_loss(dist):
    case = Case(world=2, ep=2, experts=4, top_k=2, hidden=8, inter=4, tokens=(5, 9), aux=0.5, z=0.02,
                score_func="sigmoid", seed=11)
    for aux, aux_ref, router, router_ref, experts, experts_ref in dist(2).run(_global_aux_worker, case):
        _close(aux, aux_ref, "sum of aux-loss shares vs the global batch's")
        _close(router, router_ref, "summed router gradient")
        _close(experts, experts_ref, "expert gradient")


# -- DeepSeek-V3 bias updates ------------------------------------------------------------------------------


def _bias_worker(case: Case, mode: str):
    rank = tdist.get_rank()
    moe = _build(case, bias_update_rate=0.01)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.randn(case.experts, generator=torch.Generator().manual_seed(case.seed)) * 0.05)
    start = moe.expert_bias.clone()
    ep, _ = _ep_groups(case)
    apply_expert_parallel(moe, ep, load_group=tdist.group.WORLD)
    x, dy = _tokens(case, rank)
    logits = x @ moe.gate.weight.detach().T
    scores = logits.softmax(-1) if case.score_func == "softmax" else logits.sigmoid()
    chosen = (scores + start).topk(case.top_k).indices
    once = torch.bincount(chosen.flatten(), minlength=case.experts)
    (moe(x) * dy).sum().backward()  # counted
    wrapped = CheckpointedBlock(moe, mode)
    (wrapped(x) * dy).sum().backward()  # counted once: the recompute is not
    moe.eval()
    moe(x)  # eval: not counted
    with torch.no_grad():
        moe(x)
    moe.train()
    counted = moe.load_counts_E.clone()
    loads = _summed(2 * once).float()
    update_expert_biases(moe)
    expected = start + 0.01 * torch.sign(loads.mean() - loads)
    return moe.expert_bias.clone(), expected, counted, 2 * once, int(moe.load_counts_E.sum())


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_bias_update_is_global_and_skips_recompute_and_eval(dist, mode):
    case = Case(world=4, ep=2, experts=4, top_k=2, hidden=8, inter=4, tokens=(6, 0, 9, 3), seed=5)
    results = dist(4).run(_bias_worker, case, mode)
    for bias, expected, counted, two_forwards, pending in results:
        assert torch.equal(counted, two_forwards), "loads must count each training forward once"
        assert torch.equal(bias, results[0][0]), "expert_bias differs between ranks"
        _close(bias, expected, "bias after one update")
        assert pending == 0


# -- activation checkpointing --------------------------------------------------------------------------------


def _recompute_worker(case: Case, mode: str):
    """Two microbatches forward, a bias change that would re-route, then both backwards (1F1B-like)."""
    rank = tdist.get_rank()
    results = {}
    for ac in (False, True):
        moe = _build(case)
        ep, _ = _ep_groups(case)
        apply_expert_parallel(moe, ep, load_group=tdist.group.WORLD)
        layer = CheckpointedBlock(moe, mode) if ac else moe
        x, dy = _tokens(case, rank)
        half = x.shape[0] // 2
        leaves = [x[:half].clone().requires_grad_(), x[half:].clone().requires_grad_()]
        outs = [layer(leaf) for leaf in leaves]
        before = (x @ moe.gate.weight.detach().T).softmax(-1).add(moe.expert_bias).topk(case.top_k).indices
        with torch.no_grad():
            moe.expert_bias.copy_(torch.linspace(-100, 100, case.experts))
        after = (x @ moe.gate.weight.detach().T).softmax(-1).add(moe.expert_bias).topk(case.top_k).indices
        for out, part in zip(outs, (dy[:half], dy[half:])):
            (out * part).sum().backward()
        live = [r for r in (ref() for ref in moe._records) if r is not None and not r.retired]
        results[ac] = dict(xg=torch.cat([leaf.grad for leaf in leaves]),
                           params={n: _grad(p) for n, p in moe.named_parameters()},
                           replays=moe.replays, reroutes=moe.reroutes, live=len(live),
                           rerouting=not torch.equal(before, after))
    return results


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpoint_replays_routing(dist, mode):
    case = Case(world=2, ep=2, experts=4, top_k=1, hidden=8, inter=4, tokens=(10, 7), aux=0.2, z=0.01,
                shared=4, seed=9)
    for r in dist(2).run(_recompute_worker, case, mode):
        plain, ac = r[False], r[True]
        assert ac["rerouting"], "the bias change must be one that re-routing would notice"
        assert ac["replays"] == 2 and ac["reroutes"] == 0 and plain["replays"] == 0
        assert ac["live"] == 0 and plain["live"] == 0, "routing records outlived their graphs"
        _close(ac["xg"], plain["xg"], "input gradient under recompute", atol=0, rtol=0)
        for name, g in ac["params"].items():
            _close(g, plain["params"][name], f"{name} gradient under recompute", atol=0, rtol=0)


# -- host syncs ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _counting_host_reads(calls: list[str]):
    """Records every Python-level read of tensor data to the host while active."""
    names = ("tolist", "item", "__bool__", "__int__", "__float__")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def _host_sync_worker(case: Case) -> list[int]:
    """Host reads per forward: plain, and with capacity, aux and z losses (each a possible extra sync)."""
    counts = []
    for overrides in ({}, dict(capacity_factor=1.0, aux_loss_coef=0.1, z_loss_coef=0.1)):
        moe = _build(case, **overrides)
        apply_expert_parallel(moe, tdist.group.WORLD, load_group=tdist.group.WORLD)
        x, dy = _tokens(case, tdist.get_rank())
        calls: list[str] = []
        with _counting_host_reads(calls):
            out = moe(x)
        (out * dy).sum().backward()
        counts.append(len(calls))
    return counts


def test_one_host_sync_per_layer(dist):
    case = Case(world=2, ep=2, experts=4, top_k=2, hidden=8, inter=4, tokens=(7, 4), shared=4, seed=8)
    for counts in dist(2).run(_host_sync_worker, case):
        assert counts == [1, 1]
