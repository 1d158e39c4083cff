"""`MoE`: a token-choice top-k mixture-of-experts layer with expert parallelism and load balancing.

The layer is written once for one rank or many: `apply_expert_parallel` (placement.py) keeps a
contiguous block of E/ep experts per rank and sets the groups; forward is unchanged (dispatch.py does
the travelling). What a model's MoE layers do together (bias steps, aux losses) is in layers.py.

Three decisions shape this file:

- **Routing is decided once per forward and replayed on recompute.** Activation-checkpoint recompute
  runs forward again inside backward; re-running top-k there can pick other experts (a bias update in
  between, non-deterministic kernels, near ties) and silently corrupt gradients. Each forward that
  builds a graph stores its decision (top-k ids, capacity mask, dispatch plan, global load counts) in
  a record owned by the graph (replay.py); recompute pops the oldest live record instead of routing.
  Records retire when backward passes the router (or when the graph is freed), so nothing accumulates.
  Backward must visit a layer's forwards in forward order, as a plain loop, gradient accumulation and
  every pipeline schedule do.
- **Auxiliary losses train the router through the layer's output**, not through the model's loss: a
  `AttachLoss` identity (balancing.py) adds d(aux)/d(.) = `aux_loss_scale` in backward, so they work on any pipeline
  stage. The detached value is kept in `aux_loss` for logging; `pop_router_stats` +
  `hf_load_balancing_loss` reproduce HF's pooled-over-layers convention instead.
- **Balancing statistics are global.** Counts are all-reduced over `load_group` (the ranks that split
  the batch: data x context ranks), so the aux loss is the global batch's and the bias update is the
  same on every rank. Each rank's aux loss is its share: summed over `load_group` it is the global one.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from meshkit._compat.checkpointing import hidden_from_selective_checkpoint, in_backward
from meshkit.expert_parallel.balancing import AttachLoss, RouterStats, router_z_loss, switch_aux_loss
from meshkit.expert_parallel.dispatch import (
    DispatchPlan,
    capacity_mask,
    combine,
    count_per_expert,
    dispatch,
    plan_dispatch,
)
from meshkit.expert_parallel.expert_variants import ROW_LAYOUT, Activation, ExpertLayout, silu_glu
from meshkit.expert_parallel.grouped_gemm import Backend, GroupedExperts, SwiGLU
from meshkit.expert_parallel.replay import KeepAlive, Routing, pop_oldest, remember
from meshkit.local_tensor import local_tensor


class MoE(nn.Module):
    """Token-choice top-k MoE with SwiGLU experts, an fp32 router and an optional shared expert.

    Submodules carry HF's names, so an HF sparse block's state dict loads as is: `gate` (the router,
    [E, H], fp32), `experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
    `experts.down_proj` [E, H, I] (per rank its own E/ep block), `shared_expert.{gate,up,down}_proj`.
    Dropless unless `capacity_factor` is set; then each expert keeps at most ceil(cf·T·K/E) of this
    rank's assignments (highest router score first) and the dropped ones are counted
    (`dropped_last`, `dropped_total`, out of `routed_total`).

    Balancing: `aux_loss_coef` (Switch, Megatron scale), `z_loss_coef`, and `bias_update_rate` > 0
    for DeepSeek-V3's loss-free balancing (an fp32 `expert_bias` added to the scores for selection
    only, moved by `update_expert_biases` once per step; with `bias_in_gate` the bias is HF's
    `gate.e_score_correction_bias`, loaded from and saved to HF checkpoints). DeepSeek-V3 routing:
    `score_func="sigmoid"`, `n_group`/`topk_group` (group-limited top-k), `route_scale` (its
    `routed_scaling_factor`); its shared expert lives under `shared_expert_name="shared_experts"`.

    gpt-oss: the router is `router_name="router"` with a bias (`router_bias`; top-k of the logits,
    then softmax over the chosen ones, which is softmax, top-k and renormalisation here); the experts
    keep HF's transposed, interleaved layout (`expert_layout`), have biases (`expert_biases`) and the
    clamped SwiGLU (`expert_activation`): the `expert_variants` adapters.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: Literal["softmax", "sigmoid"] = "softmax",
        normalize_topk: bool = True,
        route_scale: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        shared_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
        shared_expert_name: str = "shared_expert",
        bias_in_gate: bool = False,
        router_bias: bool = False,
        router_name: str = "gate",
        expert_layout: ExpertLayout = ROW_LAYOUT,
        expert_biases: bool = False,
        expert_activation: Activation = silu_glu,
        capacity_factor: float | None = None,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        bias_update_rate: float = 0.0,
        expert_backend: Backend = "auto",
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func={score_func!r}: use 'softmax' or 'sigmoid'")
        if n_group > 1 and (num_experts % n_group or num_experts // n_group < 2 or not 1 <= topk_group <= n_group
                            or top_k > topk_group * (num_experts // n_group)):
            raise ValueError(f"n_group={n_group}, topk_group={topk_group}: group-limited routing needs n_group to divide "
                             f"num_experts={num_experts} into groups of at least 2, 1 <= topk_group <= n_group, and "
                             f"top_k={top_k} experts within topk_group groups")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be positive, or None for dropless")
        factory = {"device": device, "dtype": dtype}
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.normalize_topk, self.route_scale = score_func, normalize_topk, route_scale
        self.n_group, self.topk_group = n_group, topk_group
        self.capacity_factor = capacity_factor
        self.aux_loss_coef, self.z_loss_coef, self.bias_update_rate = aux_loss_coef, z_loss_coef, bias_update_rate
        self.init_std = init_std
        self.aux_loss_scale = 1.0  # gradient multiplier of the attached aux losses (e.g. 1/microbatches)
        self.keep_router_stats = False  # store `router_stats` for `pop_router_stats` (HF's convention)
        self.measure_balance = False  # compute the balancing statistics without a graph too (evaluation)
        self.ep_group: ProcessGroup | None = None
        self.load_group: ProcessGroup | None = None

        # The router goes by its HF name (gpt-oss: `router`); not add_module: `gate` is a property.
        self._router_name = router_name
        self._modules[router_name] = nn.Linear(hidden_size, num_experts, bias=router_bias, device=device,
                                               dtype=torch.float32)
        self.experts = GroupedExperts(num_experts, hidden_size, intermediate_size, expert_backend,
                                      layout=expert_layout, bias=expert_biases, activation=expert_activation,
                                      **factory)
        # The shared expert goes by the HF name of the model it came from (DeepSeek: `shared_experts`).
        self._shared_name = shared_expert_name
        if shared_intermediate_size:
            # Not add_module: it refuses the name `shared_expert`, which the class has as a property.
            self._modules[shared_expert_name] = SwiGLU(hidden_size, shared_intermediate_size, **factory)
        if shared_expert_gate and not shared_intermediate_size:
            raise ValueError("shared_expert_gate=True needs a shared expert; fix: set shared_intermediate_size")
        # Qwen2-MoE: the shared expert's output is scaled per token by sigmoid(x . w), w one [1, H] row.
        self.shared_expert_gate = (
            nn.Linear(hidden_size, 1, bias=False, **factory) if shared_expert_gate else None
        )
        # The selection bias: meshkit's `expert_bias`, or (`bias_in_gate`) HF DeepSeek-V3's persistent
        # `gate.e_score_correction_bias`, which a checkpoint carries and HF routes with.
        if bias_update_rate > 0 and not bias_in_gate:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.expert_bias = None
        if bias_in_gate:
            self.gate.register_buffer("e_score_correction_bias",
                                      torch.zeros(num_experts, dtype=torch.float32, device=device))
        if bias_update_rate > 0:
            self.register_buffer("load_counts_E", torch.zeros(num_experts, dtype=torch.int64, device=device),
                                 persistent=False)
        else:
            self.load_counts_E = None

        # Reported, never silent.
        self.dropped_last = 0
        self.dropped_total = 0
        self.routed_total = 0
        self.replays = 0  # recomputes that reused the forward's routing
        self.reroutes = 0  # recomputes that found no record and routed again (reentrant AC under no_grad)
        self.aux_loss: Tensor | None = None
        self.aux_loss_total: Tensor | None = None  # sum of aux_loss * aux_loss_scale until reset: as trained
        self.router_stats: RouterStats | None = None
        self._records: deque[weakref.ref[Routing]] = deque()
        if device is None or torch.device(device).type != "meta":
            self.reset_parameters()

    @property
    def gate(self) -> nn.Linear:
        """The router ([E, H] fp32 weight, optional [E] bias), whatever HF name it is registered under."""
        return self._modules[self._router_name]

    @property
    def shared_expert(self) -> nn.Module | None:
        """The shared expert (every token, unrouted), whatever HF name it is registered under."""
        return self._modules.get(self._shared_name)

    @property
    def selection_bias(self) -> Tensor | None:
        """The fp32 [E] bias added to the scores for choosing experts (never for weighting them)."""
        return self.expert_bias if self.expert_bias is not None else getattr(self.gate, "e_score_correction_bias", None)

    @property
    def num_local_experts(self) -> int:
        """Experts this rank holds (num_experts / ep)."""
        return self.experts.num_local_experts

    def _apply(self, fn, recurse: bool = True):
        """Keep the selection bias fp32 through `.to(bf16)` / `.half()`: updates of ~1e-3 vanish in bf16."""
        owner, name = (self, "expert_bias") if self.expert_bias is not None else (self.gate, "e_score_correction_bias")
        bias = self.selection_bias
        super()._apply(fn, recurse)
        now = getattr(owner, name, None)
        if bias is not None and now.dtype != torch.float32:
            setattr(owner, name, bias.to(device=now.device, dtype=torch.float32))
        return self

    def reset_parameters(self) -> None:
        """Initialise router, experts and shared expert weights as normal(0, init_std), expert biases
        as zeros and a router bias as normal (as HF initialises gpt-oss's)."""
        for p in (self.gate.weight, self.gate.bias, self.experts.gate_up_proj, self.experts.down_proj):
            if p is not None:
                nn.init.normal_(p, std=self.init_std)
        for p in (self.experts.gate_up_proj_bias, self.experts.down_proj_bias):
            if p is not None:
                nn.init.zeros_(p)
        if self.shared_expert is not None:
            for lin in (self.shared_expert.gate_proj, self.shared_expert.up_proj, self.shared_expert.down_proj):
                nn.init.normal_(lin.weight, std=self.init_std)
        if self.shared_expert_gate is not None:
            nn.init.normal_(self.shared_expert_gate.weight, std=self.init_std)

    # -- routing ------------------------------------------------------------------------------------

    def _probs(self, logits_TE: Tensor) -> Tensor:
        if self.score_func == "softmax":
            return logits_TE.softmax(dim=-1)
        return logits_TE.sigmoid()

    def _route(self, scores_TE: Tensor, routing: Routing, stats_needed: bool) -> Tensor:
        """Decide top-k (and capacity), plan the dispatch and sum counts over the load group; no graph.

        Returns this rank's routed assignments per expert (before capacity drops) for the bias counts.
        """
        with torch.no_grad():
            bias_E = self.selection_bias
            select_TE = scores_TE if bias_E is None else scores_TE + bias_E
            if self.n_group > 1:
                select_TE = self._limit_groups(select_TE)
            expert_TK = select_TE.topk(self.top_k, dim=-1).indices
            keep_TK = None
            if self.capacity_factor is not None:
                keep_TK = capacity_mask(expert_TK, scores_TE.gather(1, expert_TK), self.num_experts,
                                        self.capacity_factor)
            routing.num_tokens = expert_TK.shape[0]
            routing.expert_TK = expert_TK
            routing.plan = plan_dispatch(expert_TK, self.num_experts, self.ep_group, keep_TK)
            routed_E = routing.plan.counts_E if keep_TK is None else count_per_expert(
                expert_TK.reshape(-1), self.num_experts)
            if stats_needed:
                tokens_1 = torch.full((1,), routing.num_tokens, dtype=torch.float32, device=routed_E.device)
                counts_E1 = torch.cat([routed_E.float(), tokens_1])  # a fill, not a host copy
                if self.load_group is not None:
                    dist.all_reduce(counts_E1, group=self.load_group)
                routing.counts_E, routing.num_tokens_global = counts_E1[:-1], counts_E1[-1]
            return routed_E

    def _limit_groups(self, select_TE: Tensor) -> Tensor:
        """DeepSeek-V3's group-limited routing: experts form `n_group` groups, a group scores the sum of
        its two best experts, and only experts of the `topk_group` best groups stay selectable."""
        T, E = select_TE.shape
        group_TG = select_TE.view(T, self.n_group, E // self.n_group).topk(2, dim=-1).values.sum(-1)
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
        keep_TG.scatter_(1, group_TG.topk(self.topk_group, dim=-1).indices, True)
        keep_TE = keep_TG.repeat_interleave(E // self.n_group, dim=1)
        return select_TE.masked_fill(~keep_TE, float("-inf"))

    # -- forward ------------------------------------------------------------------------------------

    def forward(self, x: Tensor) -> Tensor:
        """Route each token to its top-k experts (across ranks under EP) and combine; shape preserved."""
        x_TH = x.reshape(-1, self.hidden_size)
        bias_E = None if self.gate.bias is None else local_tensor(self.gate.bias).float()
        logits_TE = F.linear(x_TH.float(), local_tensor(self.gate.weight).float(), bias_E)
        recompute = in_backward()
        stats_needed = (self.training and torch.is_grad_enabled() or self.measure_balance) and (
            self.aux_loss_coef > 0 or self.z_loss_coef > 0 or self.keep_router_stats)
        routing = pop_oldest(self._records, x_TH.shape[0]) if recompute else None
        replayed = routing is not None
        if routing is None:
            routing = Routing()
            if not recompute and logits_TE.requires_grad:
                logits_TE = KeepAlive.apply(logits_TE, routing)
                self._records = remember(self._records, routing)
        scores_TE = self._probs(logits_TE)
        if replayed:
            self.replays += 1
        else:
            # What a replaying recompute skips (top-k, dispatch planning and its collectives, the
            # bookkeeping) is hidden from selective checkpointing, so its op counts match the forward's.
            with hidden_from_selective_checkpoint():
                routed_E = self._route(scores_TE, routing, stats_needed)
                if recompute:
                    self.reroutes += 1
                else:
                    self._count(routing.plan, routed_E)

        weights_TK = scores_TE.gather(1, routing.expert_TK)
        if self.normalize_topk:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            weights_TK = weights_TK * self.route_scale
        rows_GH = dispatch(x_TH, routing.plan)
        y_GH = self.experts(rows_GH, routing.plan.tokens_per_local_expert, routing.plan.local_counts_E)
        out_TH = combine(y_GH, routing.plan, weights_TK).to(x.dtype)
        if self.shared_expert is not None:
            shared_TH = self.shared_expert(x_TH)
            if self.shared_expert_gate is not None:
                shared_TH = torch.sigmoid(self.shared_expert_gate(x_TH)) * shared_TH
            out_TH = out_TH + shared_TH

        if stats_needed:
            out_TH = self._balance(out_TH, logits_TE, scores_TE, routing, recompute)
        return out_TH.view(x.shape)

    def _count(self, plan: DispatchPlan, routed_E: Tensor) -> None:
        """Drop and load bookkeeping: once per real forward, never on recompute."""
        self.dropped_last = plan.dropped
        self.dropped_total += plan.dropped
        self.routed_total += plan.num_tokens * self.top_k
        if self.load_counts_E is not None and self.training:
            self.load_counts_E += routed_E

    def _balance(self, out_TH: Tensor, logits_TE: Tensor, scores_TE: Tensor, routing: Routing,
                 recompute: bool) -> Tensor:
        probs_TE = scores_TE if self.score_func == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True)
        stats = RouterStats(
            prob_sum_E=probs_TE.sum(0),
            lse_sq_sum=torch.logsumexp(logits_TE, dim=-1).square().sum(),
            counts_E=routing.counts_E,
            num_tokens=routing.num_tokens_global,
            top_k=self.top_k,
        )
        aux = None
        if self.aux_loss_coef > 0:
            aux = self.aux_loss_coef * switch_aux_loss(stats)
        if self.z_loss_coef > 0:
            z = self.z_loss_coef * router_z_loss(stats)
            aux = z if aux is None else aux + z
        if not recompute:
            self.router_stats = stats if self.keep_router_stats else None
            self.aux_loss = None if aux is None else aux.detach()
            if aux is not None:
                with hidden_from_selective_checkpoint():  # forward-only bookkeeping, like the routing's
                    weighted = self.aux_loss * self.aux_loss_scale
                    self.aux_loss_total = weighted if self.aux_loss_total is None else self.aux_loss_total + weighted
        if aux is not None:
            out_TH = AttachLoss.apply(out_TH, aux, self.aux_loss_scale)
        return out_TH

    @torch.no_grad()
    def update_bias(self, loads_E: Tensor | None = None) -> None:
        """DeepSeek-V3: b += rate * sign(mean load - load) in fp32, from loads summed over `load_group`.

        Call once per optimizer step on every rank of the load group (`update_expert_biases` batches
        all layers into one all-reduce); the counts then restart from zero.
        """
        bias_E = self.selection_bias
        if bias_E is None or self.load_counts_E is None:
            return
        if loads_E is None:
            loads_E = self.load_counts_E.clone()
            if self.load_group is not None:
                dist.all_reduce(loads_E, group=self.load_group)
        loads_E = loads_E.float()
        bias_E += self.bias_update_rate * torch.sign(loads_E.mean() - loads_E)
        self.load_counts_E.zero_()
