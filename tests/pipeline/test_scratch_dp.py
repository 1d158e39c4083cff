import dataclasses
import pytest
from tests_support import assert_matches_reference
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training
import meshkit


def _cmp(plan, model, batch):
    return dataclasses.asdict(compare_training(plan, model, batch))


@pytest.mark.parametrize("plan,world,model", [
    ("pp=2,pp_schedule=dualpipe,pp_microbatches=4", 2, ModelSpec(layers=4)),
    ("pp=4,pp_schedule=dualpipe,pp_microbatches=6", 4, ModelSpec(layers=6, tied=True)),
    ("pp=2,pp_schedule=zb_auto,pp_microbatches=4", 2, ModelSpec(layers=4)),
])
def test_dp(dist, plan, world, model):
    degrees = meshkit.Plan.from_string(plan)
    batch = BatchSpec(batch=degrees.microbatches, seq=8, ignore=0.2, documents=2)
    res = dist(world).run(_cmp, plan, model, batch)
    print(res)
    assert_matches_reference(res, plan)


def _infer(plan):
    import torch
    spec = ModelSpec(layers=4, vocab=96)
    ref = spec.build()
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        r = ref(input_ids=ids, use_cache=False).logits
    return (pm.forward(ids, gather=True) - r).abs().max().item()


@pytest.mark.parametrize("plan", ["pp=2,pp_schedule=zb_v,pp_microbatches=2", "pp=2,pp_schedule=dualpipe,pp_microbatches=2"])
def test_infer(dist, plan):
    print(dist(2).run(_infer, plan))
