"""Which integration `attach_trainer` gives a trainer (record/trainer_attach.py). What each reads off its trainer:
test_hf_trainer.py, test_lightning_trainer.py."""

from types import SimpleNamespace

import lightning
import pytest
import torch

from ttrace_core.record.hf_trainer import HFTrainerTracing
from ttrace_core.record.lightning_trainer import LightningTracing
from ttrace_core.record.trainer_attach import attach_trainer
from ttrace_core.integrations.torch_native import lightning_package


def test_a_lightning_trainer_gets_a_lightning_callback_and_anything_else_a_clear_error():
    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    assert lightning_package(trainer, "Trainer") == "lightning.pytorch"
    tracing = attach_trainer(trainer)
    assert isinstance(tracing, LightningTracing)
    assert isinstance(trainer.callbacks[-1], lightning.Callback)
    with pytest.raises(TypeError, match="neither a Hugging Face Trainer nor a Lightning Trainer"):
        attach_trainer(object())
    with pytest.raises(TypeError, match="model"):
        attach_trainer(trainer, model=torch.nn.Linear(1, 1))


def test_a_trainer_with_add_callback_is_taken_for_a_hugging_face_trainer():
    added = []
    tracing = attach_trainer(SimpleNamespace(add_callback=added.append))
    assert isinstance(tracing, HFTrainerTracing) and len(added) == 1
    assert lightning_package(SimpleNamespace(add_callback=added.append), "Trainer") is None
