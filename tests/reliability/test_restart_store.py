"""torchrun restarts on its shared rendezvous store (pytorch/pytorch#135712), through meshkit.

torchrun's agent keeps one TCPStore for the whole job and, under the static rendezvous (always) and
c10d (unless `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`), workers form their group on it under fixed
keys, so a restart found the killed attempt's addresses there: it hung or failed to connect.
`meshkit.mesh.ensure_process_group` forms each attempt's group in a namespace of its own
(`meshkit.attempt_store`). The probe makes the race likely (the restarted rank 0 starts 3 s late) and
checks the cause directly: a key attempt 0 wrote into its group's store must be invisible to attempt
1, whichever rendezvous torchrun uses and whether the variable is set. The static case, the default
rendezvous and the one the variable does not affect, runs in CI; the others are slow.
"""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from meshkit import attempt_store
from tests.reliability.recipe_run import finish, rendezvous_flags, start_torchrun, torchrun_env

PROBE = Path(__file__).resolve().parent / "restart_probe.py"


@pytest.mark.parametrize(("rendezvous", "variable"), [
    ("static", False),
    pytest.param("c10d", False, marks=pytest.mark.slow),
    pytest.param("static", True, marks=pytest.mark.slow),
    pytest.param("c10d", True, marks=pytest.mark.slow),
], ids=["static", "c10d", "static-variable", "c10d-variable"])
def test_a_restarted_attempt_never_sees_the_killed_attempts_store(tmp_path, rendezvous, variable):
    env = torchrun_env(**({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if variable else {}))
    launcher = start_torchrun(["--nproc-per-node", "2", "--max-restarts", "1", *rendezvous_flags(rendezvous),
                               "--monitor-interval", "0.2", str(PROBE)], env, tmp_path)
    code, output = finish(launcher, timeout=180)  # a restart on the killed attempt's keys hangs (300 s forming)
    assert code == 0, output[-4000:]
    # Both ranks write to one pipe, so their lines may arrive spliced: match the lines, not the split.
    lines = re.findall(r"attempt \d+ rank \d+: all-reduce \d+, attempt 0's key visible: (?:True|False)", output)
    assert sorted(lines) == [f"attempt 1 rank {r}: all-reduce 2, attempt 0's key visible: False" for r in (0, 1)], \
        output[-4000:]


def test_ranks_agree_on_a_fresh_token_over_a_dead_attempts_keys():
    """The agreement itself, on one store with four ranks as threads: a dead attempt left its token and
    answers to every hello (it died after its rank 0 answered), and this attempt's rank 0 starts late,
    so ranks 1-3 first read the dead token. They must all settle on rank 0's new token."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))

    def client() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))

    dead = client()
    dead.set(attempt_store.TOKEN_KEY, "dead")
    for r in (1, 2, 3):
        dead.set(f"meshkit/attempt/dead/hello/{r}", "old nonce")
        dead.set(f"meshkit/attempt/dead/answer/{r}", "old nonce")
    tokens: dict[int, str] = {}

    def rank(r: int) -> None:
        if r == 0:
            time.sleep(1.0)
        tokens[r] = attempt_store.agree_on_token(client(), r, 4, timedelta(seconds=20))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(tokens) == [0, 1, 2, 3] and len(set(tokens.values())) == 1 and tokens[0] != "dead", tokens
    assert dead.get(attempt_store.TOKEN_KEY).decode() == tokens[0]


def test_only_a_shared_agent_store_gets_a_namespace():
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert attempt_store.uses_agent_store(shared)
    assert not attempt_store.uses_agent_store({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert not attempt_store.uses_agent_store({})  # plain python, or a launcher of the user's own
    assert attempt_store.for_this_attempt(timedelta(seconds=1), {}) is None
