"""The GPT language model of :mod:`~lightning_gradcomp.tasks.language`, written for ``ModelParallelStrategy``.

Its ``configure_model`` shards every transformer block, then the rest (the embeddings, tied to the output layer, and
the final norm), with FSDP2's ``fully_shard`` over ``self.device_mesh["data_parallel"]``: the layout torchtitan and
INTELLECT-1 (arXiv 2412.01152) use, one FSDP2 unit per block so that one block's parameters are gathered at a time.
Under :class:`~lightning_gradcomp.ShardedDiLoCo` that mesh is the replica group's own (DiLoCo, arXiv 2311.08105,
across the groups); under any other strategy the model is left unsharded.
"""

from __future__ import annotations

from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_gradcomp.tasks.language import GPTLanguageModel

__all__ = ["ShardedGPTLanguageModel"]


class ShardedGPTLanguageModel(GPTLanguageModel):
    """:class:`~lightning_gradcomp.tasks.GPTLanguageModel` with FSDP2 applied per block in ``configure_model``.

    Takes :class:`~lightning_gradcomp.tasks.GPTLanguageModel`'s arguments.
    """

    def configure_model(self) -> None:
        """Shard each block, then the root (embeddings, tied head, final norm), over the data-parallel mesh."""
        if self._trainer is None or not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return
        if any(isinstance(p, DTensor) for p in self.model.parameters()):  # again for validate/test after fit
            return
        assert self.device_mesh is not None
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
