"""Knowledge distillation loss: (1 - kd_ratio) * CE(student) + kd_ratio * KL(teacher || student).

Both terms are means over the same unmasked tokens, so their mix is one too and the exact token
normalization (StepLossNormalizer) applies to it unchanged.
"""

from typing import Dict, Tuple

import torch
from torch import nn

from tune_recipes.config import ConfigError
from tune_recipes.validation import distillation_losses_problem
from tune_recipes.training.step.batch import shift_labels


class DistillationLoss:
    def __init__(self, student: nn.Module, teacher: nn.Module, ce_loss: nn.Module,
                 kd_loss: nn.Module, kd_ratio: float) -> None:
        if not 0.0 <= float(kd_ratio) <= 1.0:
            raise ConfigError(f"kd_ratio must be in [0, 1], got {kd_ratio}")
        problem = distillation_losses_problem(ce_loss, kd_loss)
        if problem:
            raise ConfigError(problem)
        ce_chunks = getattr(ce_loss, "num_output_chunks", None)
        vocabularies = [getattr(getattr(m, "tok_embeddings", None), "num_embeddings", None)
                        for m in (teacher, student)]
        if None not in vocabularies and vocabularies[0] != vocabularies[1]:
            # Else the first step fails inside kd_loss on the logits' last dimension.
            raise ConfigError(
                f"teacher_model has a vocabulary of {vocabularies[0]} tokens and model of "
                f"{vocabularies[1]}: distillation compares their next-token distributions token "
                "by token; use a teacher and student of one tokenizer")
        self.student, self.teacher = student, teacher
        self.ce_loss, self.kd_loss = ce_loss, kd_loss
        self.kd_ratio = float(kd_ratio)
        self.ignore_index = ce_loss.ignore_index
        if ce_chunks:
            student.set_num_output_chunks(ce_chunks)
            teacher.set_num_output_chunks(ce_chunks)
        teacher.eval()
        for p in teacher.parameters():
            p.requires_grad_(False)

    def __call__(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Returns the mixed mean loss and its two parts (for logging)."""
        labels = shift_labels(batch.pop("labels"), self.ignore_index)
        with torch.no_grad():
            teacher_logits = self.teacher(**batch)
        logits = self.student(**batch)
        if isinstance(logits, list):
            ce = self.ce_loss(logits, labels)
            kd = self.kd_loss(logits, teacher_logits, labels)
        else:
            flat = labels.reshape(-1)
            s = logits.reshape(-1, logits.size(-1))
            ce = self.ce_loss(s, flat)
            kd = self.kd_loss(s, teacher_logits.reshape(-1, teacher_logits.size(-1)), flat)
        loss = (1.0 - self.kd_ratio) * ce + self.kd_ratio * kd
        return loss, {"class_loss": ce, "kd_loss": kd}

    def validation_loss(self, batch: Dict[str, torch.Tensor], num_tokens: int) -> torch.Tensor:
        """The student's cross-entropy alone: the validation loss of a distilled model is its
        own language-modelling loss, comparable with any other fine-tune's."""
        labels = shift_labels(batch.pop("labels"), self.ignore_index)
        logits = self.student(**batch)
        if isinstance(logits, list):
            return self.ce_loss(logits, labels)
        return self.ce_loss(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
