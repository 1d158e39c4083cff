"""The store each torchrun attempt forms its process group on: a namespace no other attempt wrote to.

torchrun's agent keeps one TCPStore for the whole job and lets the workers use it
(`TORCHELASTIC_USE_AGENT_STORE=True`: the static rendezvous always, c10d unless
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`). torch then forms the default group under fixed keys
(`default_pg/...`), so after a restart the store still holds the killed attempt's gloo/NCCL addresses,
its barrier counters and its subgroups' keys: a restarted rank that reads them before its new peer
overwrites them connects to a dead address or waits on a counter that never moves (pytorch#135712;
seen here as a pre-flight all-reduce hung for 600 s, and as "Connection refused" in gloo's
connectFullMesh).

meshkit gives each attempt a namespace of its own on that store, named by a token rank 0 draws.
Why not the restart count: each node's agent counts its own restarts (a node restarted for another
node's failure does not count one), so nodes can disagree on it. The token needs no count: rank 0
publishes it, every other rank says hello under the token it read with a nonce of its own, and rank
0 answers each hello by echoing the nonce. A rank accepts a token only when its own nonce comes back,
so a token left by a dead attempt (whose rank 0 answers nobody) is never accepted; the rank re-reads
the token until the new rank 0 has published its own. Everything the group then writes lives under
`meshkit/attempt/<token>/`, which no other attempt reads.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

__all__ = ["agree_on_token", "for_this_attempt", "uses_agent_store"]

TOKEN_KEY = "meshkit/attempt/token"
NAMESPACE = "meshkit/attempt/{token}/"
POLL_S = (0.02, 0.5)  # first and longest pause between a rank's looks at the token and its answer


def uses_agent_store(env: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun told this worker to form its group on the agent's (shared, long-lived) store."""
    env = os.environ if env is None else env
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in env and "MASTER_PORT" in env


def for_this_attempt(timeout: timedelta, env: Mapping[str, str] | None = None) -> dist.Store | None:
    """This attempt's namespace on torchrun's agent store, or None when torchrun shares no store.

    Collective over the job's ranks (they all agree on one token); `timeout` bounds the wait for
    the slowest rank, as forming the group does.
    """
    env = os.environ if env is None else env
    if not uses_agent_store(env):
        return None
    world = int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    token = agree_on_token(store, int(env["RANK"]), world, timeout)
    return dist.PrefixStore(NAMESPACE.format(token=token), store)


def agree_on_token(store: dist.Store, rank: int, world: int, timeout: timedelta) -> str:
    """The token of this attempt, the same on every rank, never one a dead attempt published.

    Rank 0 draws and publishes it, then echoes every other rank's hello nonce back once all have
    said hello. Raises RuntimeError when the ranks do not all meet within `timeout`.
    """
    if rank == 0:
        token = uuid.uuid4().hex
        store.set(TOKEN_KEY, token)
        hellos = [_key(token, "hello", r) for r in range(1, world)]
        if hellos:
            try:
                store.wait(hellos, timeout)
            except RuntimeError as err:  # DistStoreError: some rank never arrived
                missing = [r for r in range(1, world) if not store.check([_key(token, "hello", r)])]
                raise RuntimeError(f"meshkit: rank(s) {_brief(missing)} did not join this attempt's process group "
                                   f"within {timeout.total_seconds():.0f} s") from err
            store.multi_set([_key(token, "answer", r) for r in range(1, world)], store.multi_get(hellos))
        return token
    nonce = uuid.uuid4().hex
    deadline = time.monotonic() + timeout.total_seconds()
    greeted, pause = None, POLL_S[0]
    while True:
        token = store.get(TOKEN_KEY).decode()  # blocks until some attempt's rank 0 has published one
        answer = _key(token, "answer", rank)
        if token != greeted:
            store.delete_key(answer)  # a dead attempt's answer to a dead hello must not be read as ours
            store.set(_key(token, "hello", rank), nonce)
            greeted = token
        # Polled, not store.wait(timeout): a timed-out wait prints two C++ warnings per rank each time.
        if store.check([answer]) and store.get(answer).decode() == nonce:
            return token
        if time.monotonic() > deadline:
            raise RuntimeError(f"meshkit: rank {rank}: rank 0 of this attempt did not answer within "
                               f"{timeout.total_seconds():.0f} s (last token read: {token})")
        time.sleep(pause)  # rank 0 is still starting, or the token is a dead attempt's
        pause = min(pause * 2, POLL_S[1])


def _key(token: str, kind: str, rank: int) -> str:
    return f"meshkit/attempt/{token}/{kind}/{rank}"


def _brief(ranks: list[int], n: int = 8) -> str:
    return ", ".join(map(str, ranks[:n])) + (f" and {len(ranks) - n} more" if len(ranks) > n else "")
