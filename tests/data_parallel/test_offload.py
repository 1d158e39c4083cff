"""Host offload: on this GPU-less machine a warning (it saves nothing here) and the numerics of the offload
code path against the single-device model; the option that contradicts ZeRO-1/2."""

from __future__ import annotations

import warnings

import pytest

import meshkit
from meshkit.testing.reference import ModelSpec
from tests.data_parallel.windows import assert_windows_match, train_windows


def offload_run(plan: str) -> tuple[list[str], dict, str]:
    """The warnings parallelize gives, the window comparison, and where the optimizer's tensors live."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train_windows(plan, ModelSpec())
    spec = ModelSpec()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    devices = {p.to_local().device.type for p in pm.parameters()}
    return [str(w.message) for w in caught], result, ",".join(sorted(devices))


@pytest.mark.parametrize("plan", ["dp_shard=2,zero=2,offload=optimizer,grad_sync=last_microbatch",
                                  "dp_shard=2,zero=3,offload=params"])
def test_offload_warns_without_accelerator_and_matches_single_device(dist, plan):
    results = dist(2).run(offload_run, plan)
    assert_windows_match([r[1] for r in results], plan)
    for messages, _, devices in results:
        assert any("no accelerator" in m for m in messages), messages
        assert devices == "cpu"


@pytest.mark.parametrize("zero", [1, 2])
def test_params_offload_contradicts_replicated_parameters(zero):
    with pytest.raises(ValueError, match="offload='optimizer'"):
        meshkit.Plan(zero=zero, offload="params")
