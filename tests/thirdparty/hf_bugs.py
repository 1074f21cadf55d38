"""Test-only faults for hf_tp_train.py: a wrong collective in one module, built on transformers' own
parallel style (never a re-implementation of it). Not part of what a user writes."""

import types

from torch.distributed.tensor import DTensor


def _reinstall(module, mesh, style) -> None:
    """Put `style` on `module` in place of the style transformers installed (its class forward first)."""
    module.forward = types.MethodType(type(module).forward, module)
    style.install_forward(module, mesh)


def skip_reduction(model, fqn: str) -> None:
    """Rowwise module `fqn` keeps TP rank 1's partial sum instead of the all-reduced output: both ranks
    still run the all-reduce (no hang), rank 1 drops its result."""
    from transformers.distributed.tensor_parallel import RowwiseParallel

    class SkippedReduction(RowwiseParallel):
        def transform_output_post_forward(self, module, output, mesh):
            partial = output.to_local() if isinstance(output, DTensor) else output.clone()
            reduced = super().transform_output_post_forward(module, output, mesh)
            return partial + 0 * reduced if mesh.get_local_rank() == 1 else reduced

    _reinstall(model.get_submodule(fqn), model._mesh_manager.get_mesh("tp"), SkippedReduction())


def scale_reduction(model, fqn: str, factor: float = 1.01) -> None:
    """Rowwise module `fqn` scales its all-reduced output by `factor` on TP rank 1 only."""
    from transformers.distributed.tensor_parallel import RowwiseParallel

    class ScaledReduction(RowwiseParallel):
        def transform_output_post_forward(self, module, output, mesh):
            reduced = super().transform_output_post_forward(module, output, mesh)
            return reduced * factor if mesh.get_local_rank() == 1 else reduced

    _reinstall(model.get_submodule(fqn), model._mesh_manager.get_mesh("tp"), ScaledReduction())


BUGS = {"skip-reduction": skip_reduction, "scale-reduction": scale_reduction}


def inject(model, spec: str) -> None:
    """`spec` is NAME:MODULE, e.g. skip-reduction:model.layers.1.mlp.down_proj."""
    name, _, fqn = spec.partition(":")
    BUGS[name](model, fqn)
