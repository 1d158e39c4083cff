"""HF MoE models (Mixtral, Qwen3-MoE) converted to meshkit MoE layers, and meshkit's Llama-MoE.

The reference is always the unconverted HF model with HF's own eager expert loop: the converted copy
must give the same logits, loss (with and without `output_router_logits`) and every gradient in fp32,
keep HF's state-dict keys, shapes and dtypes, survive a save_pretrained/from_pretrained round trip,
convert on the meta device, and, with its experts sharded over an expert-parallel group (each rank
feeding its own batch slice), still give the single-process loss and gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from meshkit.expert_parallel import MoE, apply_expert_parallel
from meshkit.models.hf_moe import hf_aux_loss, init_moe_buffers, to_hf_state_dict
from meshkit.models.moe import convert_moe_blocks, is_moe_model, llama_moe, moe_layers, moe_spec

ATOL, RTOL = 1e-6, 1e-5  # fp32; the same for every ep
VOCAB, BATCH, SEQ = 64, 4, 8
KINDS = ("mixtral", "qwen3_moe", "qwen3_moe_norm")


def _config(kind: str, aux: bool):
    """Tiny GQA configs, 4 experts, top-2; Qwen3-MoE keeps one dense layer (`mlp_only_layers`)."""
    common = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
                  max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=aux,
                  router_aux_loss_coef=0.25, initializer_range=0.1, tie_word_embeddings=False)
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=16, num_hidden_layers=2, num_local_experts=4, **common)
    else:
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=16, intermediate_size=24, num_hidden_layers=3,
                                             num_experts=4, mlp_only_layers=[1], norm_topk_prob=kind.endswith("norm"),
                                             **common)
    config._experts_implementation = "eager"  # HF's own loop: a reference independent of meshkit's kernels
    return config


def _build(kind: str, aux: bool = False, device: str = "cpu"):
    config = _config(kind, aux)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.config._attn_implementation = "sdpa"
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(labels.shape, generator=g) < 0.25] = -100
    labels[0, 1] = ids[0, 1]
    return ids, labels


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _meshkit_loss(model, ids, labels, denominator: float) -> torch.Tensor:
    """The loss the way meshkit's training path forms it: summed CE / global count + HF's aux share."""
    logits = model(ids, output_router_logits=False).logits
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="sum")
    aux = hf_aux_loss(model)
    return ce / denominator + (0.0 if aux is None else aux)


# -- single process ----------------------------------------------------------------------------------


@pytest.mark.parametrize("aux", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_converted_model_equals_hf(kind, aux):
    """Logits, loss and every gradient, through HF's forward and through meshkit's loss path."""
    hf = _build(kind, aux)
    model = copy.deepcopy(hf)
    layers = convert_moe_blocks(model)
    assert len(layers) == len(moe_spec(model.config).layers) and all(isinstance(m, MoE) for m in layers)
    ids, labels = _batch()

    want = hf(ids, labels=labels)
    want.loss.backward()
    ref = _grads(hf)
    got = model(ids, labels=labels)  # HF's own forward: router logits reach its aux loss through the hook
    _close(got.logits, want.logits, "logits")
    _close(got.loss, want.loss, "HF-forward loss")
    assert (got.aux_loss is None) == (not aux)
    got.loss.backward()
    for name, g in _grads(model).items():
        _close(g, ref[name], f"grad {name} (HF forward)")

    model.zero_grad()
    denominator = (labels[:, 1:] != -100).sum().item()
    loss = _meshkit_loss(model, ids, labels, denominator)
    _close(loss, want.loss, "meshkit-path loss")
    loss.backward()
    for name, g in _grads(model).items():
        _close(g, ref[name], f"grad {name} (meshkit path)")


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_conversion_keeps_hf_parameters_and_state_dict(kind):
    hf = _build(kind)
    before = {n: p for n, p in hf.named_parameters()}
    shapes = {k: (v.shape, v.dtype) for k, v in hf.state_dict().items()}
    layers = convert_moe_blocks(hf)
    assert {n: p for n, p in hf.named_parameters()} == before, "conversion must reuse HF's Parameter objects"
    assert {k: (v.shape, v.dtype) for k, v in hf.state_dict().items()} == shapes
    assert convert_moe_blocks(hf) == layers and moe_layers(hf) == layers, "conversion is idempotent"
    assert is_moe_model(hf) and to_hf_state_dict(hf.state_dict(), hf.config).keys() == shapes.keys()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_save_pretrained_round_trip(kind, tmp_path):
    """HF saves a converted model in its own checkpoint format; reloading and converting gives the same model."""
    model = _build(kind)
    convert_moe_blocks(model)
    model.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    again.config._attn_implementation = "sdpa"
    convert_moe_blocks(again)
    ids, _ = _batch()
    assert torch.equal(again(ids).logits, model(ids).logits)
    assert sorted(again.state_dict()) == sorted(model.state_dict())


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_meta_device_conversion(kind):
    """Conversion allocates nothing: a meta model converts on meta, then loads HF's state dict strictly."""
    hf = _build(kind)
    meta = _build(kind, device="meta")
    layers = convert_moe_blocks(meta)
    assert all(p.is_meta for p in meta.parameters()) and layers
    assert {k: v.shape for k, v in meta.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}
    meta.to_empty(device="cpu")
    meta.load_state_dict(hf.state_dict(), strict=True)
    for module in (meta.model.rotary_emb,):  # buffers come back empty from meta; HF recomputes them
        fresh = type(module)(config=meta.config)
        module.inv_freq.copy_(fresh.inv_freq)
    ids, _ = _batch()
    _close(meta(ids).logits, hf(ids).logits, "logits after meta conversion + load")


def test_bias_balancing_state_is_meshkit_only():
    """DeepSeek-V3 bias balancing adds `expert_bias`; the HF view of the state dict drops it."""
    model = _build("mixtral", device="meta")
    layers = convert_moe_blocks(model, bias_update_rate=1e-3)
    assert all(m.expert_bias.is_meta for m in layers)
    model.to_empty(device="cpu")
    init_moe_buffers(model)
    assert all(torch.equal(m.expert_bias, torch.zeros(4)) and m.load_counts_E.dtype == torch.int64 for m in layers)
    keys = set(model.state_dict())
    hf_keys = set(to_hf_state_dict(model.state_dict(), model.config))
    assert keys - hf_keys == {f"model.layers.{i}.mlp.expert_bias" for i in range(2)}
    assert hf_keys == set(_build("mixtral", device="meta").state_dict())


def test_unsupported_hf_settings_raise():
    model = _build("mixtral")
    model.config.router_jitter_noise = 0.1
    with pytest.raises(ValueError, match="router_jitter_noise"):
        convert_moe_blocks(model)
    with pytest.raises(ValueError, match="unknown option"):
        convert_moe_blocks(_build("mixtral"), shared_intermediate_size=8)
    with pytest.raises(ValueError, match="unknown keys"):
        convert_moe_blocks(_llama(device="meta", meshkit_moe={"num_experts": 4, "top_k": 2, "num_expert": 4}))


def test_aux_loss_only_when_config_asks():
    model = _build("mixtral", aux=False)
    convert_moe_blocks(model)
    model(_batch()[0], output_router_logits=False)
    assert hf_aux_loss(model) is None and not any(m.keep_router_stats for m in moe_layers(model))


# -- Llama-MoE ---------------------------------------------------------------------------------------


def _llama(device: str = "cpu", **extra):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
                                      **extra)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


def test_llama_moe_upcycled_equals_dense():
    """Every expert a copy of the dense MLP and normalised top-k weights: the dense model's function."""
    dense = _llama()
    model = copy.deepcopy(dense)
    layers = llama_moe(model, num_experts=4, top_k=2, upcycle=True)
    assert len(layers) == 2 and is_moe_model(model)
    ids, _ = _batch()
    _close(model(ids).logits, dense(ids).logits, "upcycled logits")
    assert moe_spec(model.config).num_experts == 4 and moe_spec(model.config).layers == (0, 1)


def test_llama_moe_from_config_on_meta():
    """A Llama config carrying `meshkit_moe` converts through `convert_moe_blocks`, on meta, reproducibly."""
    model = _llama(device="meta", meshkit_moe={"num_experts": 4, "top_k": 2, "layers": [1],
                                               "bias_update_rate": 1e-3})
    layers = convert_moe_blocks(model)
    assert len(layers) == 1 and model.model.layers[1].mlp is layers[0] and layers[0].gate.weight.is_meta
    assert not isinstance(model.model.layers[0].mlp, MoE)
    assert convert_moe_blocks(model) == layers
    keys = set(model.state_dict())
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj",
            "model.layers.1.mlp.expert_bias"} <= keys


# -- expert parallel over gloo ----------------------------------------------------------------------


def _ep_worker(kind: str, aux: bool, ep: int) -> dict[str, float]:
    """Single-process HF model on the global batch vs a converted copy with experts sharded over `ep`.

    ep == world: one ep group. ep < world: a (world/ep, ep) mesh; the experts' gradients are summed over
    the replica axis, as FSDP over the data ranks left after ep would. The load group is every data
    rank, so the aux loss and its gradients are the global batch's.
    """
    rank, world = tdist.get_rank(), tdist.get_world_size()
    hf = _build(kind, aux)
    model = copy.deepcopy(hf)
    layers = convert_moe_blocks(model)
    if ep == world:
        ep_axis, replicas = tdist.group.WORLD, None
    else:
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("rep", "ep"))
        ep_axis, replicas = mesh["ep"], mesh["rep"].get_group()
    for moe in layers:
        apply_expert_parallel(moe, ep_axis, load_group=tdist.group.WORLD)

    ids, labels = _batch()
    want = hf(ids, labels=labels)
    want.loss.backward()
    denominator = (labels[:, 1:] != -100).sum().item()
    per_rank = BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    loss = _meshkit_loss(model, ids[mine], labels[mine], denominator)
    loss.backward()

    total = loss.detach().clone()
    tdist.all_reduce(total)
    out = {"loss": (total - want.loss).abs().item(), "grad": 0.0, "scale": 0.0}
    ref = dict(hf.named_parameters())
    ep_rank = rank % ep
    for name, p in model.named_parameters():
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad.detach().clone()
        want_grad = ref[name].grad
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            if replicas is not None:
                tdist.all_reduce(grad, group=replicas)
            local = want_grad.shape[0] // ep
            want_grad = want_grad[ep_rank * local:(ep_rank + 1) * local]
        else:
            tdist.all_reduce(grad)
        out["grad"] = max(out["grad"], ((grad - want_grad).abs() - RTOL * want_grad.abs()).max().item())
        out["scale"] = max(out["scale"], want_grad.abs().max().item())
    return out


@pytest.mark.parametrize(("kind", "aux", "ep"), [("mixtral", True, 4), ("mixtral", False, 2),
                                                 ("qwen3_moe", True, 2), ("qwen3_moe_norm", False, 4)])
def test_expert_parallel_converted_model_matches_hf(dist, kind, aux, ep):
    for rank, r in enumerate(dist(4).run(_ep_worker, kind, aux, ep)):
        assert r["loss"] <= 1e-5, f"rank {rank}: loss differs by {r['loss']:.3g}"
        assert r["grad"] <= ATOL, f"rank {rank}: a gradient differs by {r['grad']:.3g} (scale {r['scale']:.3g})"
