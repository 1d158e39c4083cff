"""ZeRO-1/2 group small FSDP units into buckets (`data_parallel.fsdp.units_in_buckets`), and the
estimator counts the same units (`estimate.comm.fsdp_units`): one collective per bucket, not per block."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from meshkit.data_parallel.fsdp import BUCKET_BYTES, units_in_buckets
from meshkit.estimate.comm import fsdp_units
from meshkit.estimate.memory import model_state
from meshkit.plan import Plan

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             vocab_size=1024, max_position_embeddings=64, tie_word_embeddings=False)
# blocks of 7 MB in bf16: three share a 25 MB bucket
MID = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=7, num_attention_heads=9, num_key_value_heads=3,
           head_dim=64, vocab_size=49152, max_position_embeddings=64, tie_word_embeddings=False)


def _code_units(config: LlamaConfig, dtype_bytes: int) -> list[int]:
    """Elements of each unit the code makes of the model's embedding, blocks and [norm, lm_head]."""
    import torch

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    units = [model.model.embed_tokens, *model.model.layers, [model.model.norm, model.lm_head]]
    groups = units_in_buckets(units, dtype_bytes, BUCKET_BYTES)
    return [sum(p.numel() for m in g for p in m.parameters()) for g in groups]


@pytest.mark.parametrize("shape,dtype", [(SMALL, "float32"), (MID, "bfloat16")])
def test_estimator_counts_the_buckets_the_code_makes(shape, dtype) -> None:
    config = LlamaConfig(**shape)
    code = _code_units(config, 4 if dtype == "float32" else 2)
    plan = Plan.from_string(f"dp_shard=2,zero=2,param_dtype={dtype}").resolve(2)
    units = fsdp_units(config, plan, model_state(config, plan))
    estimated = sorted(u.elements for u in units for _ in range(u.count))
    assert estimated == sorted(code), (estimated, code)
    assert len(code) < config.num_hidden_layers + 2  # grouped: fewer collectives than units


def test_zero3_keeps_one_unit_per_block() -> None:
    """ZeRO-3 frees each unit after its forward: its units are what bounds the gathered memory, never grouped."""
    config = LlamaConfig(**SMALL)
    plan = Plan.from_string("dp_shard=2,zero=3").resolve(2)
    units = fsdp_units(config, plan, model_state(config, plan))
    assert sum(u.count for u in units if u.name.endswith("block")) == config.num_hidden_layers
    assert units_in_buckets([1, 2, 3], 4, 0) == [[1], [2], [3]]  # no limit: as given


def test_buckets_only_where_units_bound_nothing() -> None:
    """Pipelining and the NVMe store (which streams one unit's optimizer state at a time) keep their units."""
    from meshkit.data_parallel.fsdp import buckets_units

    assert buckets_units(Plan.from_string("dp_shard=2,zero=2").resolve(2))
    assert buckets_units(Plan.from_string("dp_shard=2,zero=1").resolve(2))
    assert not buckets_units(Plan.from_string("dp_shard=2,zero=3").resolve(2))
    assert not buckets_units(Plan.from_string("pp=2,dp_shard=2,zero=2").resolve(4))
    assert not buckets_units(Plan.from_string("dp_shard=2,zero=2,offload=nvme,offload_dir=/tmp").resolve(2))
