"""Sharded-vs-single-device comparison, run on every rank of a worker pool.

Each rank builds the same tiny random model twice from one seed: a plain HF copy that sees the whole
global batch (the reference), and a copy that `parallelize` shards by the plan and that sees only its
data rank's slice. Both train for a few AdamW steps; the rank returns the worst differences in loss,
in every gathered gradient and in every parameter afterwards. Nothing is communicated for the
reference, so it is independent of the code under test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers
from torch.distributed.tensor import DTensor

import meshkit
from meshkit.expert_parallel import MoE

MODEL_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
    "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM),
    "helium": (transformers.HeliumConfig, transformers.HeliumForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
}
HF_MOE_KINDS = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")
# Families whose default special-token ids lie outside a tiny vocabulary: set them inside it.
_SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_ORIGINAL_KINDS = ("llama", "qwen3", "qwen2", "mistral", "mixtral", "qwen3_moe")


LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """A PEFT LoRA adapter on a ModelSpec's model. `b_nonzero` draws B like A (PEFT's
    `init_lora_weights=False`): with B = 0 (PEFT's default) A's first gradient is zero, so a wrong A
    gradient would pass unseen."""

    r: int = 4
    alpha: int = 8
    targets: tuple[str, ...] | str = LLAMA_LINEARS  # module names, or one regular expression (PEFT's forms)
    rslora: bool = False
    b_nonzero: bool = True

    def config(self):
        """The peft.LoraConfig."""
        from peft import LoraConfig

        targets = self.targets if isinstance(self.targets, str) else list(self.targets)
        return LoraConfig(r=self.r, lora_alpha=self.alpha, target_modules=targets, lora_dropout=0.0,
                          use_rslora=self.rslora, init_lora_weights=not self.b_nonzero)


@dataclass
class ModelSpec:
    """A tiny Llama-family model; every field is small enough for a 2-core machine."""

    kind: str = "llama"
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    intermediate: int = 48
    vocab: int = 64
    tied: bool = False
    seed: int = 0
    experts: int = 0        # > 0: every MLP replaced by a meshkit MoE (a "Llama-MoE"); HF MoE kinds: their experts
    top_k: int = 2
    shared_expert: int = 0  # intermediate size of the MoE's shared expert (0: none)
    bias_update_rate: float = 0.0  # > 0: DeepSeek-V3 router-bias balancing
    extra: tuple = ()       # (config field, value) pairs: the family's math-changing fields
    lora: LoraSpec | None = None  # a PEFT LoRA adapter: build() returns the PeftModel

    def config(self):
        """The HF config of this tiny model."""
        cfg_cls, _ = MODEL_CLASSES[self.kind]
        extra = {} if self.kind in _ORIGINAL_KINDS else dict(_SPECIAL_TOKENS)
        if self.kind == "mixtral":
            extra = dict(num_local_experts=self.experts, num_experts_per_tok=self.top_k)
        elif self.kind == "qwen3_moe":
            extra = dict(num_experts=self.experts, num_experts_per_tok=self.top_k, norm_topk_prob=True,
                         moe_intermediate_size=self.intermediate, decoder_sparse_step=1, mlp_only_layers=[])
        elif self.kind == "qwen2_moe":  # the family's fields (shared expert, dense layers) come in `extra`
            extra = dict(extra, num_experts=self.experts, num_experts_per_tok=self.top_k,
                         moe_intermediate_size=self.intermediate)
        elif self.kind == "olmoe":
            extra = dict(extra, num_experts=self.experts, num_experts_per_tok=self.top_k)
        elif self.kind == "gpt_oss":
            extra = dict(extra, num_local_experts=self.experts, num_experts_per_tok=self.top_k)
        elif self.kind == "deepseek_v3":
            extra = dict(extra, n_routed_experts=self.experts, num_experts_per_tok=self.top_k,
                         moe_intermediate_size=self.intermediate)
        config = cfg_cls(
            hidden_size=self.heads * self.head_dim, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, vocab_size=self.vocab, max_position_embeddings=256,
            tie_word_embeddings=self.tied, attention_dropout=0.0, **extra, **dict(self.extra),
        )
        if self.kind == "deepseek_v3":  # its rope covers the qk_rope_head_dim part only (its own default)
            config.head_dim = config.qk_rope_head_dim
        return config

    def build(self, device: str = "cpu"):
        """Build the model from `seed` on `device` (same weights every call)."""
        _, model_cls = MODEL_CLASSES[self.kind]
        torch.manual_seed(self.seed)
        with torch.device(device):
            model = model_cls(self.config())
            if self.experts and self.kind not in HF_MOE_KINDS:
                for block in model.model.layers:
                    block.mlp = MoE(self.heads * self.head_dim, self.intermediate, self.experts, self.top_k,
                                    shared_intermediate_size=self.shared_expert,
                                    bias_update_rate=self.bias_update_rate)
        # A selection bias far from zero (HF initialises it to zeros), so routing depends on it.
        gen = torch.Generator().manual_seed(self.seed)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None and not bias.is_meta:
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)
            # Expert biases far from zero too (gpt-oss; HF initialises them to zeros), so they matter.
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                bias = getattr(module, name, None)
                if bias is not None and not bias.is_meta:
                    with torch.no_grad():
                        bias.copy_(torch.randn(bias.shape, generator=gen) * 0.05)
        # HF's eager attention where its SDPA path would drop a quirk (Gemma-2's soft-capping).
        model.config._attn_implementation = "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"
        if self.lora is not None:
            from peft import get_peft_model

            torch.manual_seed(self.seed + 1)  # the adapter's draws, the same every call
            model = get_peft_model(model, self.lora.config())
        return model


@dataclass
class BatchSpec:
    """Global batch of `batch` sequences of `seq` tokens; `ignore` is the fraction of labels set to -100."""

    batch: int = 4
    seq: int = 8
    ignore: float = 0.2
    seed: int = 1
    documents: int = 1  # > 1: packed rows, position ids restarting at random document boundaries

    def make(self, vocab: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and labels of the global batch for `step` (deterministic)."""
        gen = torch.Generator().manual_seed(self.seed * 1000 + step)
        ids = torch.randint(0, vocab, (self.batch, self.seq), generator=gen)
        labels = ids.clone()
        labels[torch.rand(labels.shape, generator=gen) < self.ignore] = -100
        # HF's mean over zero targets is NaN; keep one target so the reference is defined.
        labels[0, 1] = ids[0, 1]
        return ids, labels

    def positions(self, step: int = 0) -> torch.Tensor | None:
        """Packed-sequence position ids [B, S] (None for one document per row)."""
        if self.documents <= 1:
            return None
        gen = torch.Generator().manual_seed(self.seed * 7919 + step)
        rows = []
        for _ in range(self.batch):
            cuts = torch.randperm(self.seq - 1, generator=gen)[: self.documents - 1].add(1).sort().values.tolist()
            bounds = [0, *cuts, self.seq]
            rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
        return torch.stack(rows)


ADAM_EPS = 1e-5
LORA_ADAM_EPS = 1e-3


@dataclass
class Comparison:
    """Worst absolute differences, sharded vs reference, and the reference scale they compare to."""

    loss: list[float] = field(default_factory=list)
    ref_loss: list[float] = field(default_factory=list)
    grad: float = 0.0
    grad_scale: float = 0.0
    grad_norm: float = 0.0
    param: float = 0.0
    missing_grads: list[str] = field(default_factory=list)
    frozen_mismatch: list[str] = field(default_factory=list)  # trainable here but frozen there, or a frozen grad


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()


def compare_training(plan: meshkit.Plan | str, model: ModelSpec, batch: BatchSpec, steps: int = 2,
                     lr: float = 1e-3, clip: float | None = 1.0, meta_init: bool = False) -> Comparison:
    """Train reference and sharded copies side by side; return the worst differences (run on every rank)."""
    plan = meshkit.Plan.from_string(plan) if isinstance(plan, str) else plan
    ref = model.build()
    if meta_init:
        sharded_model = model.build(device="meta")
    else:
        sharded_model = model.build()
    pm = meshkit.parallelize(sharded_model, plan)
    if meta_init:
        pm.load_full_state_dict(ref.state_dict())
    # Adam's update g / (|g| + eps) has slope 1/eps at g = 0: with the default eps = 1e-8, fp32 noise
    # of 1e-9 on a near-zero gradient component flips that component's update by up to lr. eps = 1e-5
    # still normalises real gradients (~1e-2) but keeps noise-level components linear, so parameters
    # compare at ~1e-7 while a real error (a missing reduction) still shows at the scale of lr.
    # A LoRA model's few adapter weights each take a whole normalised Adam step: eps 1e-3 (notes.md)
    # keeps fp32 noise on their small gradients from moving them by up to lr.
    eps = LORA_ADAM_EPS if model.lora is not None else ADAM_EPS
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=lr, eps=eps)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=lr, eps=eps)
    out = Comparison()
    ref_params = dict(ref.named_parameters())
    out.frozen_mismatch = [n for n, p in pm.named_parameters() if p.requires_grad != ref_params[n].requires_grad]
    for step in range(steps):
        ids, labels = batch.make(model.vocab, step)
        pos = batch.positions(step)
        # use_cache=False: with a cache HF skips the packed-sequence (document) masks.
        ref_loss = ref(input_ids=ids, labels=labels, position_ids=pos, use_cache=False).loss
        ref_loss.backward()
        per_rank = batch.batch // pm.dp_size
        mine = slice(pm.dp_rank * per_rank, (pm.dp_rank + 1) * per_rank)
        loss = pm.forward_backward(ids[mine], labels[mine], position_ids=None if pos is None else pos[mine])
        out.loss.append(abs(loss.item() - ref_loss.item()))
        out.ref_loss.append(ref_loss.item())
        if step == 0:
            for name, p in pm.named_parameters():
                if not (p.requires_grad and ref_params[name].requires_grad):  # frozen (a LoRA base): no gradient
                    out.frozen_mismatch += [f"{name} has a gradient"] if p.grad is not None else []
                    continue
                if p.grad is None:
                    out.missing_grads.append(name)
                    continue
                ref_grad = ref_params[name].grad
                out.grad = max(out.grad, (_full(p.grad) - ref_grad).abs().max().item())
                out.grad_scale = max(out.grad_scale, ref_grad.abs().max().item())
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            norm = pm.clip_grad_norm_(clip)
            out.grad_norm = max(out.grad_norm, abs(norm.item() - ref_norm.item()))
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    state = pm.full_state_dict()
    for name, p in ref.state_dict().items():
        if p.numel() == 0 and name not in state:  # HF's zero-width modules, which conversion leaves out
            continue
        out.param = max(out.param, (state[name].float() - p).abs().max().item())
    return out
