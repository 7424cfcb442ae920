"""tune_recipes.training.losses.kd: the distillation loss mix and its checks."""

import pytest
import torch
from torchtune.modules.loss import ForwardKLLoss

from tune_recipes.config import ConfigError
from tune_recipes.models.tiny import tiny_llama3
from tune_recipes.training.losses.kd import DistillationLoss

pytestmark = pytest.mark.unit


def _models():
    torch.manual_seed(0)
    student = tiny_llama3()
    torch.manual_seed(1)
    return student, tiny_llama3()


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 272, (2, 7), generator=g)
    return {"tokens": tokens, "labels": tokens.clone()}


def test_mix_is_the_ratio_of_ce_and_kd_and_the_teacher_is_frozen():
    student, teacher = _models()
    kd = DistillationLoss(student, teacher, torch.nn.CrossEntropyLoss(), ForwardKLLoss(), 0.25)
    loss, parts = kd(_batch())
    assert loss.item() == pytest.approx(0.75 * parts["class_loss"].item() + 0.25 * parts["kd_loss"].item())
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    loss.backward()
    assert all(p.grad is not None for p in student.parameters())
    assert all(p.grad is None for p in teacher.parameters())


def test_bad_ratio_and_mismatched_chunks_are_config_errors():
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    student, teacher = _models()
    with pytest.raises(ConfigError, match="kd_ratio"):
        DistillationLoss(student, teacher, torch.nn.CrossEntropyLoss(), ForwardKLLoss(), 1.5)
    with pytest.raises(ConfigError, match="chunk the logits alike"):
        DistillationLoss(student, teacher, CEWithChunkedOutputLoss(), ForwardKLLoss(), 0.5)


def test_a_teacher_of_another_vocabulary_is_one_line_before_the_first_step():
    from torchtune.models.llama3 import llama3

    from tune_recipes.models.tiny import TINY_LLAMA3_ARGS

    student = tiny_llama3()
    teacher = llama3(**{**TINY_LLAMA3_ARGS, "vocab_size": 300})
    with pytest.raises(ConfigError, match=r"^teacher_model has a vocabulary of 300 tokens and "
                                          r"model of 272"):
        DistillationLoss(student, teacher, torch.nn.CrossEntropyLoss(), ForwardKLLoss(), 0.5)
