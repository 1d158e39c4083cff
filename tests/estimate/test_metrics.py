"""The FLOP convention against torch's own counter, and the small measurement helpers.

FlopCounterMode counts matmul FLOPs (mm, bmm, addmm's product, SDPA kernels it has formulas for).
The convention's `6 * N_nonembedding` also credits norm weights and biases, which feed no matmul,
so the counter must equal the formula minus exactly `6 * tokens * (norm + bias parameters)`; that
difference is below 2% even for these toy shapes with biases (~0.01% for Llama-3-8B). HF's eager
attention is used because the counter has no formula for the CPU flash-attention kernel SDPA
dispatches to (it would report zero attention FLOPs).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from meshkit import comm_counter, metrics
from meshkit.activation_checkpoint import apply_activation_checkpointing
from meshkit.models import roles

CONFIGS = {
    "gqa": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256),
    "mha_tied": dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=6,
                     num_key_value_heads=6, vocab_size=130, tie_word_embeddings=True),
    "head_dim_bias": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=1, head_dim=24, vocab_size=200, attention_bias=True,
                          mlp_bias=True),
}


def _config(name: str) -> LlamaConfig:
    # use_cache=False: a KV cache filled again during recompute would double the keys.
    return LlamaConfig(max_position_embeddings=256, attn_implementation="eager", use_cache=False, **CONFIGS[name])


def _non_matmul_params(config: LlamaConfig) -> int:
    """Norm weights and biases: in N_nonembedding, invisible to a matmul counter."""
    heads, kv, d = roles.attention_dims(config)
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_layer = 2 * h
    if config.attention_bias:
        per_layer += heads * d + 2 * kv * d + h
    if config.mlp_bias:
        per_layer += 2 * inter + h
    return layers * per_layer + h


def _counted_flops(model: torch.nn.Module, batch: int, seq: int) -> int:
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_param_formula_matches_model(name: str) -> None:
    config = _config(name)
    model = LlamaForCausalLM(config)
    assert metrics.nonembedding_params(config) == metrics.count_nonembedding_params(model)
    with torch.device("meta"):
        meta_model = LlamaForCausalLM(config)
    assert metrics.count_nonembedding_params(meta_model) == metrics.nonembedding_params(config)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seq", [16, 37])
def test_flops_match_flop_counter(name: str, seq: int) -> None:
    config = _config(name)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    batch = 2
    tokens = batch * seq
    counted = _counted_flops(model, batch, seq)
    predicted = metrics.flops_per_token(config, seq).model * tokens
    assert counted == predicted - 6 * tokens * _non_matmul_params(config)
    assert abs(predicted - counted) / counted < 0.02


def test_attention_term_counts_the_full_square() -> None:
    """The counter charges eager attention's full QK^T/AV despite the causal mask; so does the convention."""
    config = _config("gqa")
    seq = 32
    per_token = metrics.flops_per_token(config, seq)
    heads, _, d = roles.attention_dims(config)
    assert per_token.attention == 12 * config.num_hidden_layers * heads * d * seq
    assert per_token.dense == 6 * metrics.nonembedding_params(config)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_flops_match_flop_counter(mode: str) -> None:
    """meshkit's own checkpoint wrappers: full re-runs each block but its last matmul, selective no matmul."""
    config = _config("gqa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.model.layers = torch.nn.ModuleList(apply_activation_checkpointing(list(model.model.layers), mode))
    batch, seq = 2, 24
    tokens = batch * seq
    counted = _counted_flops(model, batch, seq)
    per_token = metrics.flops_per_token(config, seq, activation_checkpointing=mode)
    recomputed_norms = 2 * config.hidden_size * config.num_hidden_layers if mode == "full" else 0
    expected = per_token.hardware * tokens - 6 * tokens * _non_matmul_params(config) - 2 * tokens * recomputed_norms
    assert counted == expected
    assert per_token.model == metrics.flops_per_token(config, seq).model
    assert (per_token.recompute == 0) == (mode == "selective")


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_moe_flops_match_flop_counter(mode: str) -> None:
    """MoE blocks: the router and top_k experts per token (routing-independent in total), and under full
    AC the whole MoE block re-run (its experts' outputs are saved by the combine's weighting)."""
    from meshkit.models.moe import convert_moe_blocks

    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=64, num_local_experts=4, num_experts_per_tok=2,
                           attn_implementation="eager", use_cache=False, sliding_window=None)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    convert_moe_blocks(model, expert_backend="loop")  # FlopCounterMode has no formula for _grouped_mm
    model.model.layers = torch.nn.ModuleList(apply_activation_checkpointing(list(model.model.layers), mode))
    batch, seq = 2, 24
    tokens = batch * seq
    counted = _counted_flops(model, batch, seq)
    per_token = metrics.flops_per_token(config, seq, activation_checkpointing=mode)
    norms = 2 * config.hidden_size * config.num_hidden_layers + config.hidden_size
    recomputed_norms = 2 * config.hidden_size * config.num_hidden_layers if mode == "full" else 0
    assert counted == per_token.hardware * tokens - 6 * tokens * norms - 2 * tokens * recomputed_norms


def test_unknown_ac_mode() -> None:
    with pytest.raises(ValueError, match="activation_checkpointing"):
        metrics.flops_per_token(_config("gqa"), 64, activation_checkpointing="some")


def test_llama3_8b_flops_per_token() -> None:
    """A sanity anchor: Llama-3-8B at 8192 tokens is ~4.5e10 dense + ~1.3e10 attention FLOPs per token."""
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    n = metrics.nonembedding_params(config)
    assert 7.4e9 < n < 7.6e9  # 8.03B total minus the 0.525B input embedding
    fpt = metrics.flops_per_token(config, 8192)
    assert fpt.attention == 12 * 32 * 4096 * 8192
    assert 5.7e10 < fpt.model < 5.9e10


def test_peak_flops_and_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert metrics.peak_flops("h100", "bfloat16") == 989.4e12
    assert metrics.peak_flops("h200", "bfloat16") == 989.4e12
    assert metrics.peak_flops("unknown-gpu") is None
    assert metrics.peak_flops("h100", override=1e12) == 1e12
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = metrics.peak_flops("cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert metrics.peak_flops("cpu") == pytest.approx(one / 4)
    assert metrics.mfu(1e9, 100.0, 1e12) == pytest.approx(0.1)
    assert metrics.mfu(1e9, 100.0, None) is None
    assert metrics.tokens_per_s_per_device(8000, 2.0, 4) == 1000.0


def test_step_line_and_memory() -> None:
    line = metrics.format_step_line(3, 40, {"loss": 2.5, "mfu": 0.123, "hfu": None, "peak_rss_gib": 1.5})
    assert line == "step  3/40 | loss 2.5000 | mfu 12.30% | peak_rss 1.50 GiB"
    nbytes, label = metrics.peak_memory()
    assert nbytes > 0 and label in ("cpu_peak_rss", "cuda_max_allocated")


def test_tensorboard_logger_writes_on_rank0_only(tmp_path) -> None:
    with metrics.TensorBoardLogger(str(tmp_path / "r0"), rank=0) as tb:
        tb.log(1, {"loss": 1.0, "mfu": None})
    with metrics.TensorBoardLogger(str(tmp_path / "r1"), rank=1) as tb:
        tb.log(1, {"loss": 1.0})
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "r0").iterdir())
    assert not (tmp_path / "r1").exists()


@pytest.fixture
def one_rank_group():
    """A private one-process gloo group, torn down so later tests see an uninitialised torch.distributed."""
    assert not dist.is_initialized(), "a test left a process group in the pytest process (use the dist pools)"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_comm_counter_counts_c10d_collectives(one_rank_group) -> None:
    counter = comm_counter.CommCounter()
    x = torch.ones(10)
    out = torch.empty(10)
    with counter:
        dist.all_reduce(x)
        dist.all_gather_into_tensor(out, x)
        dist.reduce_scatter_tensor(out, x)
        dist.broadcast(x, 0)
    kinds = {kind: stat for (kind, _), stat in counter.stats.items()}
    assert {k: (s.count, s.bytes) for k, s in kinds.items()} == {
        "all_reduce": (1, 40), "all_gather": (1, 40), "reduce_scatter": (1, 40), "broadcast": (1, 40)
    }
    assert counter.total_bytes() == 160



def _count_dtensor_and_fsdp_collectives() -> dict[str, list[int]]:
    """On each of 2 ranks: DTensor redistributes, a vocab-parallel loss and an FSDP2 step, counted."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)])
    logits = distribute_tensor(torch.randn(5, 16), mesh, [Shard(1)]).requires_grad_()
    linear = fully_shard(torch.nn.Linear(4, 6, bias=False), mesh=mesh)
    counter = comm_counter.CommCounter(mesh)
    with counter:
        x.redistribute(mesh, [Replicate()])  # all-gather: 8*6*4 B
        DTensor.from_local(torch.randn(8, 6), mesh, [Partial()]).redistribute(mesh, [Shard(0)])  # reduce-scatter
        with loss_parallel():  # collectives issued inside DTensor's own dispatch
            F.cross_entropy(logits, torch.arange(5), reduction="sum").backward()
        linear(torch.randn(3, 4)).sum().backward()  # FSDP2: c10d all-gather + reduce-scatter of 4*6*4 B
    return {f"{kind}/{axis}": [s.count, s.bytes] for (kind, axis), s in counter.stats.items()}


def test_comm_counter_sees_dtensor_and_fsdp_collectives(dist) -> None:
    results = dist(2).run(_count_dtensor_and_fsdp_collectives)
    assert results[0] == results[1]
    stats = results[0]
    assert stats["all_gather/tp"] == [2, 8 * 6 * 4 + 4 * 6 * 4]
    assert stats["reduce_scatter/tp"] == [2, 8 * 6 * 4 + 4 * 6 * 4]
    count, nbytes = stats["all_reduce/tp"]  # max, sum-exp and target logit per row, fp32
    assert count == 3 and nbytes == 3 * 5 * 4


# ------------------------------------------------------------------ the recipe's pieces (no processes)

ROOT = Path(__file__).resolve().parents[2]


def _load_recipe():
    """recipes/train_llama.py as a module, as `python recipes/train_llama.py` sees it: its folder on
    sys.path (it imports its sibling train_config.py)."""
    if str(ROOT / "recipes") not in sys.path:
        sys.path.insert(0, str(ROOT / "recipes"))
    spec = importlib.util.spec_from_file_location("train_llama", ROOT / "recipes" / "train_llama.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_llama"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recipe():
    return _load_recipe()


@pytest.mark.parametrize("preset,world", [("debug_cpu", 8), ("llama3_8b", 8), ("llama3_70b", 32), ("llama3_405b", 512),
                                          ("mixtral_8x7b", 64), ("moe_debug_cpu", 4), ("demo_5d_cpu", 16)])
def test_presets_load_and_validate(recipe, preset: str, world: int) -> None:
    run = recipe.load_config(str(ROOT / "recipes" / "configs" / f"{preset}.toml"))
    config, path, pretrained = recipe.build_model_config(run.model)
    assert path is None and not pretrained
    plan = run.plan.validate(config, world, run.train.seq_len)
    assert plan.world_size == world


def test_cli_overrides_preset(recipe) -> None:
    args = recipe.build_parser().parse_args([
        "--config", str(ROOT / "recipes" / "configs" / "debug_cpu.toml"), "--steps", "3", "--lr", "0.5",
        "--tp", "1", "--profile", "--model-set", "num_hidden_layers=3", "--branching", "5",
    ])
    run = recipe.apply_cli(recipe.load_config(args.config), args)
    assert (run.train.steps, run.train.lr, run.train.profile) == (3, 0.5, True)
    assert run.train.seq_len == 64  # untouched preset value
    assert (run.plan.tp, run.plan.dp_shard, run.plan.dp_replicate) == (1, 2, 2)
    assert run.model["num_hidden_layers"] == 3 and run.data.branching == 5


def test_unknown_preset_keys_are_errors(recipe, tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nstep = 3\n")
    with pytest.raises(ValueError, match="unknown key"):
        recipe.load_config(str(bad))
    bad.write_text("[trian]\nsteps = 3\n")
    with pytest.raises(ValueError, match="unknown table"):
        recipe.load_config(str(bad))


def test_markov_data_is_deterministic_per_dp_rank(recipe) -> None:
    cfg = recipe.data_setup.DataConfig(branching=2)
    a = recipe.MarkovTokens(64, 16, 3, dp_rank=0, config=cfg, dp_size=2)
    b = recipe.MarkovTokens(64, 16, 3, dp_rank=0, config=cfg, dp_size=2)
    c = recipe.MarkovTokens(64, 16, 3, dp_rank=1, config=cfg, dp_size=2)
    ids, labels = a.batch_at(5, 1)
    assert torch.equal(ids, b.batch_at(5, 1)[0]) and torch.equal(ids, labels)
    assert not torch.equal(ids, c.batch_at(5, 1)[0]) and not torch.equal(ids, a.batch_at(6, 1)[0])
    # the data ranks' rows are the rows of one global batch, whatever the dp size
    whole = recipe.MarkovTokens(64, 16, 6, dp_rank=0, config=cfg, dp_size=1).batch_at(5, 1)[0]
    assert torch.equal(whole, torch.cat([ids, c.batch_at(5, 1)[0]]))
    # every transition is one of the token's two successors
    allowed = a.successors[ids[:, :-1]]
    assert (allowed == ids[:, 1:, None]).any(-1).all()


def test_lr_schedule_warms_up_then_decays(recipe) -> None:
    cfg = recipe.TrainConfig(steps=20, warmup_steps=4, lr=1.0, min_lr_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = recipe.lr_schedule(opt, cfg)
    lrs = []
    for _ in range(cfg.steps):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(x >= y for x, y in zip(lrs[3:], lrs[4:]))
    assert lrs[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 15 / 16)))


def test_resumed_run_follows_its_own_schedule(recipe) -> None:
    """A run resumed with the same [train] keeps its learning rate; one extended to more steps takes
    its first step at the new schedule's rate (the restored scheduler alone would use the old one)."""

    def run(steps: int, state=None, taken: int = 0):
        cfg = recipe.TrainConfig(steps=steps, warmup_steps=4, lr=1.0, min_lr_ratio=0.1)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        sched = recipe.lr_schedule(opt, cfg)
        if state is not None:
            sched.load_state_dict(state)
        for _ in range(taken):
            opt.step()
            sched.step()
        return opt, sched

    _, first = run(20, taken=12)
    saved = first.state_dict()
    same_opt, same = run(20, saved)
    assert recipe.follow_schedule_after_resume(same) == pytest.approx((first.get_last_lr()[0],) * 2)
    assert same_opt.param_groups[0]["lr"] == pytest.approx(first.get_last_lr()[0])
    longer_opt, longer = run(40, saved)
    restored, now = recipe.follow_schedule_after_resume(longer)
    assert restored == pytest.approx(first.get_last_lr()[0])
    assert now == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 8 / 36))) != pytest.approx(restored)
    assert longer_opt.param_groups[0]["lr"] == pytest.approx(now) and longer.last_epoch == 12


def test_moe_flops_count_active_experts_only():
    """With top_k == num_experts every expert is active: the count equals the model's parameters."""

    from meshkit.metrics import count_nonembedding_params, nonembedding_params

    def config(k):
        return MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=64, num_local_experts=4, num_experts_per_tok=k)

    with torch.device("meta"):
        model = MixtralForCausalLM(config(4))
    assert nonembedding_params(config(4)) == count_nonembedding_params(model)
    per_expert = 3 * 32 * 48
    assert nonembedding_params(config(4)) - nonembedding_params(config(1)) == 2 * 3 * per_expert


@pytest.mark.parametrize("preset,world", [("debug_cpu", 8), ("moe_debug_cpu", 4)])
def test_recipe_predicts_peak_memory(recipe, preset: str, world: int) -> None:
    """The recipe prints this beside the measured peak, for dense and MoE models; a stack mixing dense
    and MoE blocks is not estimated (None, not a crash)."""
    run = recipe.load_config(str(ROOT / "recipes" / "configs" / f"{preset}.toml"))
    config, _, _ = recipe.build_model_config(run.model)
    predicted = recipe.preflight.predicted_peak_bytes(config, run.plan, world, run.train)
    assert isinstance(predicted, int) and predicted > 0
    if preset == "moe_debug_cpu":
        mixed = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256,
                            meshkit_moe={"num_experts": 4, "top_k": 2, "layers": [0]})
        assert recipe.preflight.predicted_peak_bytes(mixed, run.plan, world, run.train) is None


def _recipe_run(plan: str, log_dir: str) -> dict:
    """The recipe's training loop on this pool rank: 2 steps of the debug preset, evaluated each step."""
    module = _load_recipe()
    run = module.load_config(str(ROOT / "recipes" / "configs" / "debug_cpu.toml"))
    run.plan = __import__("meshkit").Plan.from_string(plan)
    run.model["num_hidden_layers"] = 4
    run.train = dataclasses.replace(run.train, steps=2, seq_len=16, local_batch=2, grad_accum=1, threads=1,
                                    eval_every=1, eval_batches=2, log_dir=log_dir, name=plan.replace(",", "_"))
    return module.train(run)


def test_recipe_held_out_loss_is_the_same_with_and_without_a_pipeline(dist, tmp_path) -> None:
    """Same init (plan-independent), same global batches: evaluation through the pipeline's
    forward-only schedule and through one stage give the same held-out loss; TensorBoard gets it."""
    piped = dist(4).run(_recipe_run, "pp=2,dp_shard=2", str(tmp_path))
    flat = dist(4).run(_recipe_run, "dp_shard=2,tp=2", str(tmp_path))
    for runs in (piped, flat):
        assert all(r["eval_losses"] == runs[0]["eval_losses"] for r in runs), "ranks disagree"
    assert sorted(piped[0]["eval_losses"]) == [1, 2]
    for step, loss in piped[0]["eval_losses"].items():
        assert loss == pytest.approx(flat[0]["eval_losses"][step], abs=1e-5)
        assert 0 < loss < math.log(256) + 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "pp=2_dp_shard=2")).Reload()
    assert [e.step for e in events.Scalars("eval/loss")] == [1, 2]
