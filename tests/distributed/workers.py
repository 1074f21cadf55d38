"""Functions the distributed tests run on every spawned gloo rank. A failed assertion fails the rank."""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from ttrace_core.canonicalize.shards import RecordedShard, canonicalize, shard
from ttrace_core.integrations.dtensor import layout_from_dtensor, local_value


def _cases(world_size: int):
    """(name, mesh shape, placements, global shape); Partial cases are built from random local values."""
    if world_size == 2:
        return [
            ("shard0-even", (2,), [Shard(0)], (4, 3)),
            ("shard1-uneven", (2,), [Shard(1)], (3, 5)),
            ("shard0-zero-size", (2,), [Shard(0)], (1, 4)),
            ("replicate", (2,), [Replicate()], (2, 3)),
            ("partial", (2,), [Partial()], (2, 3)),
        ]
    return [
        ("2d-shard-shard", (2, 2), [Shard(0), Shard(1)], (4, 6)),
        ("2d-nested-uneven", (2, 2), [Shard(0), Shard(0)], (7, 2)),
        ("2d-zero-size", (2, 2), [Shard(0), Shard(0)], (3, 2)),
        ("2d-replicate-shard", (2, 2), [Replicate(), Shard(1)], (3, 5)),
        ("2d-shard-partial", (2, 2), [Shard(0), Partial()], (4, 3)),
    ]


def _dtensor(mesh, placements, shape) -> DTensor:
    full = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    if any(p.is_partial() for p in placements):
        replicated = [Replicate() if p.is_partial() else p for p in placements]
        local = distribute_tensor(full, mesh, replicated).to_local()
        noise = torch.randn(local.shape, generator=torch.Generator().manual_seed(dist.get_rank()))
        return DTensor.from_local(local + noise, mesh, placements, run_check=False)
    return distribute_tensor(full, mesh, placements)


def check_dtensor_canonicalize(config: dict) -> None:
    dist.init_process_group("gloo")
    try:
        world_size = dist.get_world_size()
        for name, mesh_shape, placements, shape in _cases(world_size):
            mesh = init_device_mesh("cpu", mesh_shape)
            value = _dtensor(mesh, placements, shape)
            layout, local = layout_from_dtensor(value), local_value(value)
            expected = value.full_tensor()
            gathered: list = [None] * world_size
            dist.all_gather_object(gathered, (dist.get_rank(), layout, local))
            result = canonicalize([RecordedShard(rank=r, layout=l, value=v) for r, l, v in gathered])
            assert torch.allclose(result.full, expected, rtol=0, atol=1e-6), f"{name}: canonicalize != full_tensor()"
            assert result.replica_drift is None, f"{name}: unexpected drift {result.replica_drift}"
            if not any(p.is_partial() for p in placements):
                assert torch.equal(result.full, expected), f"{name}: not bit-exact"
                assert torch.equal(shard(expected, layout), local), f"{name}: shard() differs from the local tensor"
            else:
                reduced = DTensor.from_local(shard(expected, layout), mesh, placements, run_check=False).full_tensor()
                assert torch.allclose(reduced, expected, atol=1e-6), f"{name}: shard() of a partial does not reduce back"
    finally:
        dist.destroy_process_group()


def _full_tensor_hooks(model, captured: dict, state: dict) -> None:
    """Hooks (registered after the tracer's) that keep DTensor.full_tensor() of every DTensor the tracer sees."""

    def keep(phase: str, fqn: str, slot: str, value) -> None:
        if isinstance(value, DTensor):
            captured[f"{phase}|{state['mb']}|{fqn}|{slot}"] = value.full_tensor().detach().numpy().copy()

    def hooks_for(fqn: str):
        def pre_hook(module, args) -> None:
            for index, value in enumerate(args):
                keep("forward", fqn, f"input.{index}", value)

        def forward_hook(module, args, output) -> None:
            keep("forward", fqn, "output.0", output)

        def backward_hook(module, grad_input, grad_output) -> None:
            for index, value in enumerate(grad_output):
                keep("backward", fqn, f"grad_output.{index}", value)
            for index, value in enumerate(grad_input):
                keep("backward", fqn, f"grad_input.{index}", value)

        return pre_hook, forward_hook, backward_hook

    for fqn, module in model.named_modules():
        if fqn:
            pre_hook, forward_hook, backward_hook = hooks_for(fqn)
            module.register_forward_pre_hook(pre_hook)
            module.register_forward_hook(forward_hook)
            module.register_full_backward_hook(backward_hook)


def record_with_full_tensors(config: dict) -> None:
    """Record the example GPT with the Tracer and keep full_tensor() of every DTensor it records."""
    import numpy as np

    from ttrace_examples.torch_gpt.model import GPT, GPTConfig, loss_fn
    from ttrace_examples.torch_gpt.parallelize import apply_fsdp, apply_tensor_parallel
    from ttrace_examples.torch_gpt.train import TorchGPTRunConfig, init_weights, micro_batch
    from ttrace_core.integrations.dtensor import declare_parallelize_plan
    from ttrace_core.record.tracer import Tracer, TracerConfig

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2,))
        run = TorchGPTRunConfig(model=GPTConfig(num_layers=2))
        model = GPT(run.model)
        plan = apply_tensor_parallel(model, mesh, sequence_parallel=True, bug=None) if config["layout"] == "tp-sp" else {}
        if config["layout"] == "fsdp":
            apply_fsdp(model, mesh)
        init_weights(model, run.seed, torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        fsdp = config["layout"] == "fsdp"
        num_local = 2 if fsdp else 4
        tracer = Tracer(config["out"], model, role="candidate", optimizer=optimizer,
                        config=TracerConfig(exclude=("",), loss_scale=1 / num_local,
                                            data_parallel_rank=dist.get_rank() if fsdp else 0, data_parallel_size=2 if fsdp else 1))
        declare_parallelize_plan(tracer, plan, mesh)
        captured: dict = {}
        state = {"mb": 0}
        _full_tensor_hooks(model, captured, state)
        with tracer.step(0):
            for local_index in range(num_local):
                state["mb"] = local_index * 2 + dist.get_rank() if fsdp else local_index
                inputs, targets = micro_batch(run, state["mb"])
                (loss_fn(model(inputs), targets) / num_local).backward()
            state["mb"] = -1
            for fqn, param in model.named_parameters():
                captured[f"grad|-1|{fqn}|grad"] = param.grad.full_tensor().numpy().copy()
            optimizer.step()
            for fqn, param in model.named_parameters():
                captured[f"param|-1|{fqn}|value"] = param.detach().full_tensor().numpy().copy()
        tracer.close()
        np.savez(f"{config['out']}/full_tensors.rank{dist.get_rank()}.npz", **captured)
    finally:
        dist.destroy_process_group()


def fail_on_rank_0(config: dict) -> None:
    """Rank 0 fails while rank 1 waits in a collective that will never complete."""
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 fails on purpose")
    dist.barrier()


def fail_on_rank_0_while_rank_1_sleeps(config: dict) -> None:
    """Rank 0 fails; rank 1 is busy in Python (no collective) and would go on for minutes."""
    if int(os.environ["RANK"]) == 0:
        time.sleep(1)
        raise RuntimeError("rank 0 fails on purpose")
    time.sleep(600)


def sigkill_rank_1(config: dict) -> None:
    """Rank 1 is killed from outside (as by the OOM killer); rank 0 would go on for minutes."""
    import signal

    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


def hang_on_rank_1(config: dict) -> None:
    """Rank 1 sleeps far past any timeout; rank 0 returns."""
    if int(os.environ["RANK"]) == 1:
        time.sleep(600)


def record_dtensor_activations_over_dp(config: dict) -> None:
    """A model whose activations are DTensors sharded over a data-parallel mesh axis (torchtitan's
    full_dtensor mode): each rank's local batch is its micro-batch, rank r's local micro-batch k the
    reference's k * 2 + r. With one rank (the reference) the same model runs all micro-batches as plain tensors."""
    from torch.distributed.tensor import distribute_module

    from ttrace_core.record.tracer import Tracer, TracerConfig

    dist.init_process_group("gloo")
    try:
        world_size, rank = dist.get_world_size(), dist.get_rank()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",)) if world_size > 1 else None
        if mesh is not None:  # weights replicated, gradients all-reduced over dp by DTensor's Partial -> Replicate
            distribute_module(model, mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        num_micro_batches = 4
        num_local = num_micro_batches // world_size
        tracer = Tracer(config["out"], model, role="reference" if world_size == 1 else "candidate", optimizer=optimizer,
                        config=TracerConfig(loss_scale=1 / num_micro_batches, data_parallel_rank=rank,
                                            data_parallel_size=world_size))
        with tracer.step(0):
            for local_index in range(num_local):
                inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(local_index * world_size + rank))
                if mesh is not None:
                    inputs = DTensor.from_local(inputs, mesh, [Shard(0)])
                output = model(inputs)
                loss = output.square().sum() / 3 / num_micro_batches
                loss.backward()  # a DTensor loss, partial over dp: each rank's part is its micro-batch's
            optimizer.step()
        tracer.close()
    finally:
        dist.destroy_process_group()


def port_taken_on_the_first_attempt(config: dict) -> None:
    """The first launch finds the rendezvous port taken (rank 0 holds it with a socket of its own before
    torch listens, as another process would); the second joins and passes a barrier."""
    import socket
    from pathlib import Path

    marker = Path(config["marker"])
    first = int(os.environ["RANK"]) == 0 and not marker.exists()
    holder = None
    if first:
        marker.write_text("taken once")
        holder = socket.socket()
        holder.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        holder.listen()
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        dist.barrier()
        dist.destroy_process_group()
    finally:
        if holder is not None:
            holder.close()


RANK_IMPORTS = ("colorsys",)
"""What this module's ranks import, as the launcher reads it (a module nothing else here imports)."""


def say_where_it_runs(config: dict) -> None:
    """Prints what the launcher's environment says now, whether the launcher (or its fork server) had imported
    torch's compiler front end (every optimizer's constructor imports it) and this module's RANK_IMPORTS before
    the rank started, and which process forked the rank."""
    print(f"rank {os.environ['RANK']}: {config['name']}={os.environ.get(config['name'])}; torch._dynamo preloaded: "
          f"{'torch._dynamo' in sys.modules}; rank imports preloaded: {'colorsys' in sys.modules}; "
          f"parent {os.getppid()}", flush=True)
