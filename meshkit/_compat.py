"""Every private or version-gated torch API meshkit touches, in one place.

meshkit runs on torch 2.11 (the GPU machines) and 2.13 (CPU development). When torch moves one of
these, only this file changes.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import checkpoint as torch_checkpoint

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """Flatten a (sub)mesh into one named axis that later `root_mesh[name]` lookups resolve.

    `DeviceMesh._flatten` is private in 2.11-2.13 but is the only way to derive a flattened group that
    stays attached to the root mesh (so `mesh["dp_replicate", "dp_shard_cp"]` keeps working).
    """
    return mesh._flatten(name)


def fsdp_sum_gradients(module) -> None:
    """Make an FSDP2 unit sum gradients across data ranks instead of averaging them.

    meshkit's loss already carries the global valid-token denominator, so FSDP's own division by the
    data-parallel size would scale gradients twice (torchtitan #757/#2972 are this bug).
    """
    module.set_gradient_divide_factor(1.0)
    # A factor of 1 otherwise becomes NCCL's PREMUL_SUM(1), which gloo lacks; plain SUM is the same sum.
    if hasattr(module, "set_force_sum_reduction_for_comms"):
        module.set_force_sum_reduction_for_comms(True)


def submesh(mesh: DeviceMesh, names: str | tuple[str, ...]) -> DeviceMesh:
    """`mesh[names]`, where names may include axes created by `flatten_mesh`.

    Slicing a flattened axis from the root warns of deprecation since 2.11 yet works through 2.13 and
    is the only way to get the 2D HSDP mesh (dp_replicate, dp_shard_cp) without new process groups.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[names]


def sdpa_op(name: str):
    """A private aten attention op by name (`_scaled_dot_product_flash_attention_for_cpu`, its
    `_backward`, and the CUDA flash / efficient / cuDNN variants with theirs).

    Context-parallel attention needs each block's log-sum-exp and a backward that takes the final
    output and LSE; only these private ops expose both.
    """
    import torch

    return getattr(torch.ops.aten, name).default


def all_to_all_autograd(x: torch.Tensor, group) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 whose backward is the same all-to-all (functional collectives)."""
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def split_axis(mesh: DeviceMesh, axis: str, sizes: tuple[int, int], names: tuple[str, str]):
    """Split one axis of the root mesh into (outer, inner) parts; return (inner, outer) as 1D meshes or groups.

    `DeviceMesh._unflatten` (2.10+) derives them from the mesh. Without it, the same groups are built
    with `new_subgroups_by_enumeration`, enumerating every copy of the axis across the whole mesh, since
    every rank must take part in creating every group.
    """
    import torch.distributed as dist

    sub = submesh(mesh, axis)  # dp_shard_cp is a flattened axis: sliced without torch's deprecation warning
    if hasattr(sub, "_unflatten"):
        split = sub._unflatten(0, sizes, names)
        return split[names[1]], split[names[0]]
    outer, inner = sizes
    dim = mesh.mesh_dim_names.index(axis)
    copies = mesh.mesh.movedim(dim, -1).reshape(-1, outer * inner).tolist()
    inner_groups = [ranks[o * inner:(o + 1) * inner] for ranks in copies for o in range(outer)]
    outer_groups = [ranks[i::inner] for ranks in copies for i in range(inner)]
    mine_inner, _ = dist.new_subgroups_by_enumeration(inner_groups)
    mine_outer, _ = dist.new_subgroups_by_enumeration(outer_groups)
    return mine_inner, mine_outer


def dispatch_mode_base() -> type:
    """torch's TorchDispatchMode (a private module through 2.13).

    A dispatch mode sees the c10d ops that `torch.distributed.*` calls (FSDP2) and the functional
    collectives DTensor issues, from C++ as well as Python, which no public hook does; meshkit's
    communication counter and activation-memory measurement are built on it.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def outside_dispatch_modes():
    """A context in which no active TorchDispatchMode sees the ops that run (torch's private
    `_disable_current_modes`).

    For work that is not part of the model's computation but may first run inside it, such as a
    one-off kernel probe: selective activation checkpointing caches op outputs by call order, so an
    op the forward runs and its recompute does not would hand every later output of that op to the
    wrong call; FLOP and communication counters would count it too.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


_sac_hidden = threading.local()  # depth of `hidden_from_selective_checkpoint` regions on this thread


@contextlib.contextmanager
def hidden_from_selective_checkpoint() -> Iterator[None]:
    """A region whose ops selective activation checkpointing neither caches nor counts: they simply
    run, in the forward and in the recompute alike. Every other dispatch mode (communication and FLOP
    counters) still sees them.

    For work a recompute legitimately does differently from its forward: FSDP's hooks of a unit
    nested in the checkpointed block (the forward all-gathers, the recompute may find the weights
    prefetched and becomes FSDP's iteration root), or an MoE layer's routing, which the recompute
    replays instead of re-running. torch (through 2.13) counts every op under selective
    checkpointing and fails the recompute when one op runs more often than in the forward; ops that
    run less often shift nothing only while none of them is saved. Both sides of that hazard vanish
    for ops that are not counted at all (the idea of torch PR #185178, unmerged).
    """
    enter_hidden_from_selective_checkpoint()
    try:
        yield
    finally:
        exit_hidden_from_selective_checkpoint()


def enter_hidden_from_selective_checkpoint() -> None:
    """Open a `hidden_from_selective_checkpoint` region where no `with` fits (a pair of module hooks);
    regions nest, and each must be closed by `exit_hidden_from_selective_checkpoint` on this thread."""
    _sac_hidden.depth = getattr(_sac_hidden, "depth", 0) + 1


def exit_hidden_from_selective_checkpoint() -> None:
    """Close the innermost region opened by `enter_hidden_from_selective_checkpoint` on this thread."""
    _sac_hidden.depth = max(getattr(_sac_hidden, "depth", 0) - 1, 0)


def _profiler_ops() -> frozenset:
    """The record_function enter/exit ops: annotations, not computation, whose labels FSDP varies."""
    ops = set()
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(torch.ops.profiler, name, None)
        if packet is not None:
            ops.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(ops)


@functools.cache
def _sac_mode_letting_through(base: type) -> type:
    """A subclass of one of torch's two private SAC dispatch modes that runs profiler ops and ops of
    `hidden_from_selective_checkpoint` regions untracked, and everything else as `base` does."""
    through = _profiler_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(_sac_hidden, "depth", 0) or func in through:
            return func(*args, **(kwargs or {}))
        return base.__torch_dispatch__(self, func, types, args, kwargs)

    # Higher-order ops find their handlers by the mode's exact type, registered for `base`; this
    # routes them through __torch_dispatch__ as those handlers do.
    return type(f"Untracking{base.__name__}", (base,), {"__torch_dispatch__": __torch_dispatch__,
                                                       "supports_higher_order_operators": True})


def selective_checkpoint_contexts(policy_fn: Callable) -> tuple:
    """torch's `create_selective_checkpoint_contexts(policy_fn)`, whose two dispatch modes let
    profiler annotations and `hidden_from_selective_checkpoint` regions through untracked.

    The modes are torch's own objects with their class swapped for a subclass (built once per torch
    class), so their constructors, storage and replay stay torch's, whatever the version.
    """
    forward_mode, recompute_mode = torch_checkpoint.create_selective_checkpoint_contexts(policy_fn)
    for mode in (forward_mode, recompute_mode):
        mode.__class__ = _sac_mode_letting_through(type(mode))
    return forward_mode, recompute_mode


def grouped_mm_op():
    """`torch._grouped_mm`, or None where this torch lacks it: the only fused grouped GEMM torch ships."""
    import torch

    return getattr(torch, "_grouped_mm", None)


def in_backward() -> bool:
    """True while the autograd engine runs on this thread: a forward now is a checkpoint recompute.

    `torch._C._current_graph_task_id` is the only signal shared by reentrant, non-reentrant and
    selective checkpointing.
    """
    import torch

    return torch._C._current_graph_task_id() != -1


def is_compiled(module) -> bool:
    """Whether `module` runs as one compiled graph (`module.compile()` or a `torch.compile` wrapper)."""
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")


def fsdp_post_backward(root) -> None:
    """Run FSDP2's post-backward (reduce-scatter of the accumulated unsharded gradients) by hand.

    Pipeline schedules split a microbatch's backward into B and W, so FSDP's own post-backward hook
    would fire before the weight gradients exist; the runtime turns it off and calls this once after
    the last W, as torch's own pipelining does, through FSDP2's private state.
    """
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(root)
    for each in state._state_ctx.all_states:
        # Newer torch holds a list of parameter groups per state; older releases held one (or None).
        groups = getattr(each, "_fsdp_param_groups", None)
        if groups is None:
            groups = [each._fsdp_param_group] if each._fsdp_param_group is not None else []
        for group in groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose axes are those of `meshes` (all derived from the same root), e.g. the HSDP mesh
    (dp_replicate, dp_shard_mod_ep) that FSDP shards expert weights over; `DeviceMesh._concatenate`."""
    return DeviceMesh._concatenate(meshes)


def torch_context_parallel():
    """torch's experimental CP, benchmarked against meshkit's: (`context_parallel`, `set_rotate_method`);
    the latter lives only under the private `_attention` module in 2.11-2.13."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    return context_parallel, set_rotate_method


def op_schema_arguments(op):
    """An op overload's schema arguments (`OpOverload._schema`): to read flags passed either way."""
    return op._schema.arguments


def dtensor_chunks(tensor):
    """The (offsets, sizes) chunks of the global tensor this rank's DTensor shard covers.

    `DTensor.__create_chunk_list__` is the protocol DCP itself uses; it handles every placement,
    _StridedShard (FSDP over TP) included, which a hand-written offset computation would not.
    """
    return tensor.__create_chunk_list__()


def fake_tensor_mode():
    """`FakeTensorMode` (private in 2.11-2.13): shapes and dtypes, no memory, for activation estimates.

    Non-fake inputs are allowed so that a module built on the meta device can be `to_empty`-ed into
    fake CPU tensors (fake CPU, not meta, so SDPA dispatches to the flash kernel it really uses
    instead of the math fallback that would save the s x s scores).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def storage_key(tensor) -> int:
    """Identity of a tensor's storage (`UntypedStorage._cdata`): views and autograd's saved copies
    share it, so counting storages counts memory once. A DTensor's memory is its local shard."""
    local = getattr(tensor, "_local_tensor", None)
    return (local if local is not None else tensor).untyped_storage()._cdata


def storage_nbytes(tensor) -> int:
    """Bytes of a tensor's storage (a DTensor's local shard's)."""
    local = getattr(tensor, "_local_tensor", None)
    return (local if local is not None else tensor).untyped_storage().nbytes()


def p2p_send(group, tensor: torch.Tensor, group_peer: int, tag: int):
    """Start a point-to-point send on `group` to its rank `group_peer`; returns the Work.

    `dist.isend` is this call behind per-call Python checks (group lookup, global-to-group rank
    translation, tensor checks) that the pipeline runtime, which checked its peers and tensors once
    per schedule, pays on the critical path for every message. `ProcessGroup.send` is the bound c10d
    method `dist.isend` ends in, in 2.11 through 2.13.
    """
    return group.send([tensor], group_peer, tag)


def p2p_recv(group, tensor: torch.Tensor, group_peer: int, tag: int):
    """Start a point-to-point receive into `tensor` from `group`'s rank `group_peer` (see `p2p_send`)."""
    return group.recv([tensor], group_peer, tag)


def torch_pipeline_order(schedule):
    """The per-rank action lists a `torch.distributed.pipelining` schedule derived (`pipeline_order`,
    entries are private `_Action`s), or None; the pipeline benchmark replays them in meshkit's simulator."""
    order = getattr(schedule, "pipeline_order", None)
    return order if isinstance(order, dict) else None


def dcp_async_save(state, checkpoint_id: str, planner, group):
    """`torch.distributed.checkpoint.async_save` (marked experimental) as a plain Future of the upload.

    torch returns a Future, or an `AsyncSaveResponse` whose `upload_completion` is that Future when
    its stager stages asynchronously; callers only wait for the files.
    """
    result = dcp.async_save(state, checkpoint_id=checkpoint_id, planner=planner, process_group=group)
    return getattr(result, "upload_completion", result)


def default_store():
    """The store the default process group rendezvoused with (the heartbeat's channel), or None."""
    try:
        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """All-gather into one tensor (ranks' inputs concatenated on dim 0): torch 2.13 renamed
    `all_gather_into_tensor` to `all_gather_single` and deprecates the old name; 2.11 has only that.
    Returns the work handle when `async_op`."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """Summing reduce-scatter of one tensor (dim 0 split over ranks), under either torch's name."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, op=dist.ReduceOp.SUM, group=group)


def collective_timeout_s() -> float | None:
    """The default process group's collective timeout in seconds as its CPU backend holds it, or None.

    Read back (not taken from the config) so a log line shows the timeout really in force.
    """
    try:
        backend = distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _group_timeout(group) -> timedelta | None:
    """A process group's collective timeout as its first backend holds it, or None."""
    for device in getattr(group, "_device_types", ()):
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def set_default_group_timeout(timeout: timedelta) -> None:
    """Set the default process group's collective timeout after it was formed (`_set_pg_timeout` is
    private in 2.11-2.13), so forming it may wait longer than a collective may (see mesh.ensure_process_group)."""
    distributed_c10d._set_pg_timeout(timeout, distributed_c10d._get_default_group())


def align_group_timeouts() -> None:
    """Give every process group made without a timeout the default group's (`[train] timeout_s`).

    torch gives a group made by `new_group(timeout=None)`, as `init_device_mesh` and
    `DeviceMesh._flatten` make the mesh's axes, its backend's stock timeout (30 min for gloo, 10 for
    NCCL), not the default group's: a collective hung on a mesh axis (FSDP, TP, the gradient norm)
    ignored `init_process_group(timeout=...)`. Groups whose timeout someone set (not the stock one)
    are left alone. `_set_pg_timeout` and the world's group map are private (2.11-2.13).
    """
    if not dist.is_initialized():
        return
    default = distributed_c10d._get_default_group()
    target = _group_timeout(default)
    stock = {getattr(distributed_c10d, name, None) for name in ("default_pg_timeout", "default_pg_nccl_timeout")}
    if target is None or target in stock:
        return
    for group in list(distributed_c10d._world.pg_map):
        if group is default or _group_timeout(group) not in stock:
            continue
        try:
            distributed_c10d._set_pg_timeout(target, group)
        except (AssertionError, RuntimeError, ValueError):  # a group without a backend on this rank
            continue


def fsdp_unsharded_tensors(root) -> tuple[list, list]:
    """(gathered parameter tensors, unreduced full gradients) FSDP2 holds right now under `root`, as
    local tensors, through its private per-parameter state: the memory estimator's tests and the
    memory benchmark count them, since neither is reachable once a unit is resharded."""
    from torch.distributed.fsdp import fully_shard

    def local(t):
        return getattr(t, "_local_tensor", t)

    gathered, grads = [], []
    for each in fully_shard.state(root)._state_ctx.all_states:
        groups = getattr(each, "_fsdp_param_groups", None)
        if groups is None:
            groups = [each._fsdp_param_group] if each._fsdp_param_group is not None else []
        for group in groups:
            for param in group.fsdp_params:
                if not hasattr(param, "_unsharded_param"):
                    continue
                unsharded = param._unsharded_param
                if local(unsharded).untyped_storage().size() > 0:
                    gathered.append(local(unsharded))
                grad = param.unsharded_accumulated_grad
                grad = unsharded.grad if grad is None else grad
                if grad is not None:
                    grads.append(local(grad))
    return gathered, grads


def fsdp_after_unit_reduce(module, callback) -> None:
    """Call `callback(sharded_params)` each time the FSDP2 unit `module` has reduced its gradients
    (after its post-backward issued the reduce-scatter, once the result may be read on the current
    stream), by wrapping the unit's private parameter-group `post_backward`: FSDP2 assigns the sharded
    gradients directly, so no tensor hook fires for them. The fused optimizer steps there."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    for group in groups:
        original = group.post_backward

        def post_backward(*args, _group=group, _original=original):
            reduced = _group.reduce_grads
            out = _original(*args)
            if reduced:
                event = getattr(_group, "_post_reduce_event", None)
                if event is not None:
                    _group.device_handle.current_stream().wait_event(event)
                callback([p.sharded_param for p in _group.fsdp_params])
            return out

        group.post_backward = post_backward


def functional_reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum-reduce-scatter `x` over `group` along dim 0 as the functional collective DTensor issues.

    Selective activation checkpointing recognises that op (`_c10d_functional.reduce_scatter_tensor`)
    and keeps its output, so a recomputed block does not communicate again; a c10d call would be
    re-issued. The op namespace is private in torch 2.11-2.13.
    """
    ops = torch.ops._c10d_functional
    out = ops.reduce_scatter_tensor(x, "sum", dist.get_world_size(group), group.group_name)
    return ops.wait_tensor(out)
