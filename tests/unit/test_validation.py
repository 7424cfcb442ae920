"""Validation before any work (tune_recipes/validation.py): malformed configs and overrides of
every recipe family end in one line naming the key and value, exit code 2, no traceback."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tune_recipes._cli import registry
from tune_recipes._cli.main import main
from tune_recipes.config import ConfigError, load_config
from tune_recipes.validation import SCHEMA, TORCHTUNE_KEYS, check_config, check_top_level_keys

REPO = Path(__file__).resolve().parents[2]
NO_CUDA = not torch.cuda.is_available()

TP_PLAN = "tensor_parallel_plan._component_"
LLAMA_PLAN = "torchtune.models.llama3.base_llama_tp_plan"

# (config, overrides, the fragment the one error line holds). "{file}" is an existing file,
# "{tmp}" an empty directory; "--portable" skips the machine checks (tiny/quantize reads a QAT
# run's output, which does not exist here).
CASES = [
    # full fine-tune: types, ranges, enums, cross-key rules, paths
    ("tiny/full_single_device", ["batch_size=abc"], "batch_size=abc: expected an integer >= 1"),
    ("tiny/full_single_device", ["batch_size=0"], "batch_size=0: expected an integer >= 1"),
    ("tiny/full_single_device", ["batch_size=True"], "batch_size=True"),
    ("tiny/full_single_device", ["optimizer.lr=x"], "optimizer.lr=x: expected a number > 0"),
    ("tiny/full_single_device", ["optimizer.lr=-1e-3"], "optimizer.lr=-0.001"),
    ("tiny/full_single_device", ["optimizer.weight_decay=-0.1"], "optimizer.weight_decay=-0.1"),
    ("tiny/full_single_device", ["gradient_accumulation_steps=2.5"], "gradient_accumulation_steps=2.5"),
    ("tiny/full_single_device", ["clip_grad_norm=-1"], "clip_grad_norm=-1: expected a number > 0"),
    ("tiny/full_single_device", ["clip_grad_norm=big"], "clip_grad_norm=big"),
    ("tiny/full_single_device", ["epochs=0"], "epochs=0: expected an integer >= 1"),
    ("tiny/full_single_device", ["max_steps_per_epoch=0"], "max_steps_per_epoch=0"),
    ("tiny/full_single_device", ["log_every_n_steps=0"], "log_every_n_steps=0"),
    ("tiny/full_single_device", ["save_every_n_steps=0"],
     "save_every_n_steps=0: expected an integer >= 1"),
    ("tiny/qat_distributed", ["save_every_n_steps=2.5"], "save_every_n_steps=2.5"),
    ("tiny/kd_single_device", ["save_every_n_steps=often"], "save_every_n_steps=often"),
    ("tiny/lora_single_device", ["keep_last_n_checkpoints=0"],
     "keep_last_n_checkpoints=0: expected an integer >= 1"),
    ("tiny/lora_distributed", ["keep_last_n_checkpoints=-3"], "keep_last_n_checkpoints=-3"),
    ("tiny/full_distributed", ["keep_last_n_checkpoints=True"], "keep_last_n_checkpoints=True"),
    ("tiny/full_single_device", ["seed=-1"], "seed=-1: expected an integer >= 0"),
    ("tiny/full_single_device", ["shuffle=maybe"], "shuffle=maybe: expected True or False"),
    ("tiny/full_single_device", ["enable_activation_checkpointing=1"], "enable_activation_checkpointing=1"),
    ("tiny/full_single_device", ["dtype=fp16"], "dtype=fp16: expected one of bf16, fp32"),
    ("tiny/full_single_device", ["dtype=float8"], "dtype=float8"),
    ("tiny/full_single_device", ["device=tpu"], "device=tpu: expected cpu, cuda or cuda:<index>"),
    pytest.param("tiny/full_single_device", ["device=cuda"], "device=cuda: CUDA is not available",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="CUDA is available")),
    ("tiny/full_single_device", ["compile={mode: max-autotune}"], "compile={'mode': 'max-autotune'}: torchtune's per-part compile dict is not implemented"),
    ("tiny/full_single_device", ["optimizer_in_bwd=True", "gradient_accumulation_steps=2", "clip_grad_norm=null"],
     "optimizer_in_bwd=True with gradient_accumulation_steps=2"),
    ("tiny/full_single_device", ["optimizer_in_bwd=True", "clip_grad_norm=1.0"],
     "optimizer_in_bwd=True with clip_grad_norm=1.0"),
    ("tiny/full_distributed", ["optimizer_in_bwd=True", "clip_grad_norm=null", "on_nonfinite=skip"],
     "optimizer_in_bwd=True with on_nonfinite=skip"),
    ("tiny/full_single_device", ["optimizer_in_bwd=on_step"], "optimizer_in_bwd=on_step: expected True or False"),
    ("tiny/full_single_device", ["compile_optimizer_step=often"], "compile_optimizer_step=often: expected True or False"),
    ("tiny/full_distributed", ["fp8_fast_accum_backward=always"], "fp8_fast_accum_backward=always: expected True or False"),
    ("tiny/full_single_device", ["fp8_mlp_activations=True", "fp8_mlp_layers=0"],
     "fp8_mlp_layers=0: expected an integer >= 1"),
    ("tiny/lora_single_device", ["compile=True", "activation_memory_budget=1.5"],
     "activation_memory_budget=1.5: expected a number >= 0 and <= 1"),
    ("tiny/full_single_device", ["compile=True", "activation_memory_budget=-0.1"],
     "activation_memory_budget=-0.1: expected a number >= 0 and <= 1"),
    ("tiny/full_single_device", ["compile_optimizer_step=True", "optimizer_in_bwd=True", "clip_grad_norm=null"],
     "compile_optimizer_step=True with optimizer_in_bwd=True"),
    ("tiny/full_single_device", ["compile_optimizer_step=True", "optimizer._component_=torch.optim.SGD"],
     "compile_optimizer_step=True with optimizer._component_=torch.optim.SGD: only torch.optim.Adam"),
    # torchao's own compiles one call a parameter; ours compiles the step in one graph
    ("tiny/full_single_device", ["compile_optimizer_step=True", "optimizer._component_=torchao.optim.AdamW8bit"],
     "optimizer._component_=torchao.optim.AdamW8bit: only torch.optim.Adam, torch.optim.AdamW and "
     "tune_recipes.optim.AdamW8bit are supported"),
    ("tiny/full_single_device", ["lr_scheduler.num_warmup_steps=-5"], "lr_scheduler.num_warmup_steps=-5"),
    ("tiny/full_single_device", ["tokenizer.max_seq_len=0"], "tokenizer.max_seq_len=0"),
    ("tiny/full_single_device", ["checkpointer.checkpoint_dir=/no/such/dir"],
     "checkpointer.checkpoint_dir=/no/such/dir: no such directory"),
    ("tiny/full_single_device", ["checkpointer.checkpoint_files=[nope.safetensors]"],
     "checkpointer.checkpoint_files: "),
    ("tiny/full_single_device", ["output_dir={file}/run"], "output_dir="),
    ("tiny/full_single_device", ["~model"], "missing required key(s) model"),
    ("tiny/full_single_device", ["bach_size=4"], "'bach_size' (did you mean 'batch_size'?)"),
    ("tiny/full_single_device", ["enable_fp8_training=2"], "enable_fp8_training=2: expected True or False"),
    ("tiny/full_single_device", ["enable_fp8_training=True", "fp8_recipe_name=blockwise"],
     "fp8_recipe_name=blockwise: expected one of tensorwise, rowwise, rowwise_with_gw_hp"),
    ("tiny/full_single_device", ["enable_fp8_training=True", "device=cpu"],
     "enable_fp8_training=True with device=cpu: FP8 matmuls need a CUDA GPU"),
    # LoRA, QLoRA, DoRA
    ("tiny/lora_single_device", ["model.lora_rank=0"], "model.lora_rank=0: expected an integer >= 1"),
    ("tiny/lora_single_device", ["model.lora_attn_modules=[q_proj,foo]"],
     "model.lora_attn_modules=['q_proj', 'foo']: item 'foo': expected one of q_proj, k_proj, v_proj, output_proj"),
    ("tiny/lora_single_device", ["model.lora_attn_modules=[]"], "model.lora_attn_modules=[]: expected a non-empty list"),
    ("tiny/lora_single_device", ["model.lora_alpha=-1"], "model.lora_alpha=-1"),
    ("tiny/lora_single_device", ["model.lora_dropout=1.5"], "model.lora_dropout=1.5"),
    ("tiny/lora_single_device", ["save_adapter_weights_only=2"], "save_adapter_weights_only=2"),
    ("tiny/lora_single_device", ["model.apply_lora_to_mlp=2"], "model.apply_lora_to_mlp=2"),
    ("tiny/lora_single_device", ["model.quantize_base=nf4"], "model.quantize_base=nf4"),  # QLoRA
    ("tiny/lora_single_device", ["model.quantize_base=True", "model.lora_rank=-2"], "model.lora_rank=-2"),
    ("tiny/lora_single_device", ["model.use_dora=sometimes"], "model.use_dora=sometimes"),  # DoRA
    ("tiny/lora_single_device", ["model.use_dora=True", "model.lora_attn_modules=[w1]"], "item 'w1'"),
    ("tiny/lora_single_device", ["optimizer_in_bwd=True"],
     "optimizer_in_bwd=True: the optimizer step inside backward is not implemented by lora_finetune_single_device"),
    # FP8 LoRA: CUDA only, no QLoRA, no DoRA, tensorwise only ("--portable": device=cuda is
    # accepted on this CPU machine, so the LoRA rule is reached)
    ("tiny/lora_single_device", ["enable_fp8_training=True"],
     "enable_fp8_training=True with device=cpu: FP8 matmuls need a CUDA GPU"),
    ("tiny/lora_single_device", ["--portable", "device=cuda", "enable_fp8_training=True",
                                 "model.quantize_base=True"],
     "enable_fp8_training=True with model.quantize_base=True"),
    ("tiny/lora_single_device", ["--portable", "device=cuda", "enable_fp8_training=True",
                                 "model._component_=torchtune.models.llama3_2.qlora_llama3_2_1b"],
     "enable_fp8_training=True with model._component_=torchtune.models.llama3_2.qlora_llama3_2_1b"),
    ("tiny/lora_single_device", ["--portable", "device=cuda", "enable_fp8_training=True",
                                 "model.use_dora=True"],
     "enable_fp8_training=True with model.use_dora=True"),
    ("tiny/lora_single_device", ["--portable", "device=cuda", "enable_fp8_training=True",
                                 "fp8_recipe_name=rowwise"],
     "fp8_recipe_name=rowwise with a LoRA model"),
    # QAT
    ("tiny/qat_single_device", ["quantizer.groupsize=0"], "quantizer.groupsize=0: expected an integer >= 1"),
    ("tiny/qat_single_device", ["quantizer.groupsize=32.5"], "quantizer.groupsize=32.5"),
    ("tiny/qat_single_device", ["fake_quant_after_n_steps=-1"], "fake_quant_after_n_steps=-1"),
    ("tiny/qat_single_device", ["~quantizer"], "fake_quant_after_n_steps=5 without a quantizer"),
    ("tiny/qat_single_device", ["optimizer_in_bwd=True", "gradient_accumulation_steps=4", "clip_grad_norm=null"],
     "optimizer_in_bwd=True with gradient_accumulation_steps=4"),
    ("tiny/qat_distributed", ["quantizer.groupsize=-32"], "quantizer.groupsize=-32"),
    ("tiny/qat_distributed", ["fake_quant_after_n_steps=2.5"], "fake_quant_after_n_steps=2.5"),
    # QAT + LoRA
    ("tiny/qat_lora_distributed", ["quantizer.groupsize=abc"], "quantizer.groupsize=abc"),
    ("tiny/qat_lora_distributed", ["model.lora_rank=0"], "model.lora_rank=0"),
    ("tiny/qat_lora_distributed", ["fsdp_reshard_after_forward=sometimes"], "fsdp_reshard_after_forward=sometimes"),
    # knowledge distillation
    ("tiny/kd_single_device", ["kd_ratio=1.5"], "kd_ratio=1.5: expected a number >= 0 and <= 1"),
    ("tiny/kd_single_device", ["kd_ratio=abc"], "kd_ratio=abc"),
    ("tiny/kd_single_device", ["teacher_checkpointer.checkpoint_dir=/no/teacher"],
     "teacher_checkpointer.checkpoint_dir=/no/teacher: no such directory"),
    ("tiny/kd_single_device", ["~teacher_model"], "missing required key(s) teacher_model"),
    # both losses read the student's logits, in the same chunks (else only the recipe's setup,
    # after both models are built, said so)
    ("tiny/kd_single_device", ["kd_loss.num_output_chunks=4"],
     "loss and kd_loss must chunk the logits alike (loss.num_output_chunks=2, kd_loss.num_output_chunks=4)"),
    ("tiny/kd_distributed", ["loss._component_=tune_recipes.modules.loss.FusedLinearCrossEntropyLoss",
                             "~loss.num_output_chunks"],
     "loss: distillation needs the student's logits, which a fused linear loss never makes"),
    ("tiny/kd_distributed", ["custom_sharded_layers=tok_embeddings"],
     "custom_sharded_layers=tok_embeddings: expected a list"),
    # quantize
    ("tiny/quantize", ["--portable", "quantizer.groupsize=null"], "quantizer.groupsize=None"),
    ("tiny/quantize", ["--portable", "dtype=fp8"], "dtype=fp8"),
    ("tiny/quantize", ["--portable", "device=tpu"], "device=tpu"),
    ("tiny/quantize", ["--portable", "~checkpointer"], "missing required key(s) checkpointer"),
    ("tiny/quantize", [], "checkpointer.checkpoint_dir=outputs/tiny_qat_single_device/epoch_0: no such directory"),
    # distributed
    ("tiny/full_distributed", ["gradient_accumulation_steps=0"], "gradient_accumulation_steps=0"),
    ("tiny/full_distributed", ["batch_size=-3"], "batch_size=-3"),
    ("tiny/full_distributed", ["enable_fp8_training=True", "device=cpu"], "enable_fp8_training=True with device=cpu"),
    ("tiny/lora_distributed", ["model.lora_attn_modules=[q_proj,foo]"], "item 'foo'"),
    # the same projection twice (adapter_config.json listed it twice)
    ("tiny/lora_single_device", ["model.lora_attn_modules=[q_proj,v_proj,q_proj]"],
     "model.lora_attn_modules=['q_proj', 'v_proj', 'q_proj']: q_proj named more than once"),
    ("tiny/lora_distributed", ["epochs=abc"], "epochs=abc"),
    # tensor parallelism (full_finetune_distributed)
    ("tiny/full_distributed", ["tensor_parallel_dim=0"], "tensor_parallel_dim=0: expected an integer >= 1"),
    ("tiny/full_distributed", ["tensor_parallel_dim=two"], "tensor_parallel_dim=two: expected an integer >= 1"),
    ("tiny/full_distributed", ["tensor_parallel_dim=2.0"], "tensor_parallel_dim=2.0: expected an integer >= 1"),
    ("tiny/full_distributed", ["tensor_parallel_dim=2", "~tensor_parallel_plan"],
     "tensor_parallel_dim=2 needs tensor_parallel_plan._component_"),
    ("tiny/full_distributed", ["tensor_parallel_dim=2", "tensor_parallel_plan=llama3"],
     "tensor_parallel_plan=llama3: expected a mapping with a _component_"),
    ("tiny/full_distributed", ["tensor_parallel_dim=2", f"{TP_PLAN}=torchtune.models.llama3.no_such_plan"],
     "tensor_parallel_plan._component_: 'torchtune.models.llama3.no_such_plan' does not resolve"),
    ("tiny/full_distributed", ["tensor_parallel_dim=4", f"{TP_PLAN}={LLAMA_PLAN}"],
     "tensor_parallel_dim=4: the model's num_kv_heads=2 (layers.0.attn) is not divisible by it"),
    ("tiny/full_distributed", ["tensor_parallel_dim=3", f"{TP_PLAN}={LLAMA_PLAN}"],
     "tensor_parallel_dim=3: the model's num_heads=8 (layers.0.attn) is not divisible by it"),
    ("tiny/full_distributed", ["tensor_parallel_dim=2", f"{TP_PLAN}={LLAMA_PLAN}",
                               "model._component_=tune_recipes.models.tiny_llama3_2"],
     "tensor_parallel_dim=2: this model ties its output projection to tok_embeddings"),
    ("tiny/full_distributed", ["tensor_parallel_dim=2", f"{TP_PLAN}={LLAMA_PLAN}", "optimizer.fused=True"],
     "tensor_parallel_dim=2 with optimizer.fused=True"),
    ("tiny/full_distributed", ["tensor_parallel_dim=2", f"{TP_PLAN}={LLAMA_PLAN}",
                               "optimizer_in_bwd=True", "clip_grad_norm=null"],
     "tensor_parallel_dim=2 with optimizer_in_bwd=True"),
    ("tiny/full_distributed", ["tensor_parallel_dim=2", f"{TP_PLAN}={LLAMA_PLAN}",
                               "loss._component_=tune_recipes.modules.loss.FusedLinearCrossEntropyLoss"],
     "tensor_parallel_dim=2 with loss._component_=tune_recipes.modules.loss.FusedLinearCrossEntropyLoss"),
    ("tiny/full_distributed", ["tensor_parallel_dim=2", f"{TP_PLAN}={LLAMA_PLAN}", "save_every_n_steps=5"],
     "tensor_parallel_dim=2 with save_every_n_steps"),
    ("tiny/full_distributed", ["tensor_parallel_dim=2", f"{TP_PLAN}={LLAMA_PLAN}",
                               "enable_fp8_training=True"],
     "tensor_parallel_dim=2 with enable_fp8_training=True"),
    # low_cpu_ram (lora_finetune_single_device)
    ("tiny/lora_single_device", ["low_cpu_ram=maybe"], "low_cpu_ram=maybe: expected True or False"),
    ("tiny/lora_single_device", ["low_cpu_ram=1"], "low_cpu_ram=1: expected True or False"),
    # where it is not implemented, the error names what the key does in torchtune
    ("tiny/full_single_device", ["low_cpu_ram=True"],
     "low_cpu_ram=True: building the merged model at save time with little CPU memory is not "
     "implemented by full_finetune_single_device"),
    # the offload flags are bools (1 and "yes" are not)
    ("tiny/full_single_device", ["enable_activation_offloading=1"],
     "enable_activation_offloading=1: expected True or False"),
    ("tiny/lora_distributed", ['enable_activation_offloading="yes"'],
     "enable_activation_offloading='yes': expected True or False (a string; write True without quotes)"),
    ("tiny/full_distributed", ["fsdp_cpu_offload=1"], "fsdp_cpu_offload=1: expected True or False"),
    ("tiny/qat_lora_distributed", ['fsdp_cpu_offload="yes"'],
     "fsdp_cpu_offload='yes': expected True or False (a string; write True without quotes)"),
    # offloading without checkpointing: refused by validate, as the recipe refuses it at start
    ("tiny/full_single_device", ["enable_activation_offloading=True"],
     "enable_activation_offloading=True needs enable_activation_checkpointing=True"),
    ("tiny/kd_distributed", ["enable_activation_offloading=True", "enable_activation_checkpointing=False"],
     "enable_activation_offloading=True needs enable_activation_checkpointing=True"),
    # the fsdp section, in every distributed recipe (each one reads it)
    ("tiny/full_distributed", ["fsdp.foo=1"], "fsdp.foo: unknown key(s); the fsdp section takes only cpu_offload"),
    ("tiny/kd_distributed", ["fsdp.foo=1", "fsdp.bar=2"], "fsdp.bar, fsdp.foo: unknown key(s)"),
    ("tiny/qat_distributed", ["fsdp=3"], "fsdp=3: expected a mapping with cpu_offload"),
    ("tiny/qat_lora_distributed", ["fsdp.cpu_offload=1"], "fsdp.cpu_offload=1: expected True or False"),
    ("tiny/lora_distributed", ["fsdp.cpu_offload=False", "fsdp_cpu_offload=True"],
     "fsdp_cpu_offload=True contradicts fsdp.cpu_offload=False"),
    # torch.set_deterministic_debug_mode's values only
    ("tiny/full_single_device", ["cudnn_deterministic_mode=strict"],
     "cudnn_deterministic_mode=strict: expected null, default, warn, error, 0, 1 or 2"),
    ("tiny/kd_distributed", ["cudnn_deterministic_mode=3"],
     "cudnn_deterministic_mode=3: expected null, default, warn, error, 0, 1 or 2"),
    # selective activation checkpointing (ac_mode/ac_option, every training recipe)
    ("tiny/qat_distributed", ["ac_mode=False"], "ac_mode=False: expected one of none, full, selective"),
    ("tiny/full_single_device", ["ac_mode=Selective"], "ac_mode=Selective: expected one of none, full, selective"),
    ("tiny/lora_single_device", ["ac_mode=selective", "ac_option=op"],
     "ac_option=op: selective op checkpointing is not implemented"),
    ("tiny/kd_single_device", ["ac_mode=selective", "ac_option=-1"],
     "ac_option=-1: expected an integer >= 0"),
    ("tiny/full_distributed", ["ac_mode=selective", "ac_option=2.5"], "ac_option=2.5: expected an integer"),
    # str.isdigit() alone accepts these (int("²") then fails in the model setup)
    ("tiny/full_single_device", ["ac_mode=selective", "ac_option=²"], "ac_option=²: expected an integer"),
    ("tiny/full_distributed", ["ac_mode=selective"],
     "ac_mode=selective needs ac_option: an integer k checkpoints every k-th transformer layer"),
    ("tiny/qat_single_device", ["enable_activation_checkpointing=True", "ac_mode=selective", "ac_option=2"],
     "enable_activation_checkpointing=True with ac_mode=selective: torchtune 0.6.1 would silently "
     "checkpoint no layer at all with both set; set one"),
    ("tiny/lora_distributed", ["enable_activation_checkpointing=True", "ac_mode=none"],
     "enable_activation_checkpointing=True with ac_mode=none"),
    # a misspelt torchtune key gets a did-you-mean too
    ("tiny/full_single_device", ["cudnn_determinstic_mode=null"],
     "'cudnn_determinstic_mode' (did you mean 'cudnn_deterministic_mode'?)"),
    # the optimizer's own argument checks (torch's, run on a one-element parameter), named
    ("tiny/lora_single_device", ["optimizer.betas=[0.9]"],
     "optimizer.betas=[0.9]: torch.optim.AdamW refuses it: IndexError: list index out of range "
     "(its default: betas=(0.9, 0.999))"),
    ("tiny/full_single_device", ["optimizer.betas=[0.9,2.0]"],
     "optimizer.betas=[0.9, 2.0]: torch.optim.AdamW refuses it: Invalid beta parameter at index 1"),
    ("tiny/lora_distributed", ["optimizer.eps=-1"], "optimizer.eps=-1: torch.optim.AdamW refuses it"),
    ("tiny/qat_single_device", ["optimizer._component_=torch.optim.SGD", "optimizer.momentum=-0.5"],
     "optimizer.momentum=-0.5: torch.optim.SGD refuses it: Invalid momentum value: -0.5"),
    # torchtune's checkpointers look model_type up in their ModelType enum
    ("tiny/lora_single_device", ["checkpointer.model_type=LLAMA4"],
     "checkpointer.model_type=LLAMA4: not a model type torchtune's checkpointers know (did you "
     "mean LLAMA3?"),
    ("tiny/kd_single_device", ["teacher_checkpointer.model_type=llama3"],
     "teacher_checkpointer.model_type=llama3"),
    # a LoRA recipe given a full fine-tune's model
    ("tiny/lora_single_device", ["model._component_=tune_recipes.models.tiny_llama3",
                                 "~model.lora_attn_modules", "~model.apply_lora_to_mlp",
                                 "~model.apply_lora_to_output", "~model.lora_rank",
                                 "~model.lora_alpha", "~model.lora_dropout", "~model.use_dora"],
     "model._component_=tune_recipes.models.tiny_llama3: this model has no LoRA adapters"),
    # what the recipe passes a component, and what it needs of the loss and the schedule
    ("tiny/lora_single_device", ["tokenizer._component_=torchtune.models.llama3.llama3_tokenizer"],
     "tokenizer: torchtune.models.llama3.llama3_tokenizer needs path (not set in the config"),
    ("tiny/full_single_device", ["lr_scheduler._component_=torch.optim.lr_scheduler.StepLR",
                                 "lr_scheduler.step_size=2",
                                 "~lr_scheduler.num_warmup_steps"],
     "lr_scheduler._component_=torch.optim.lr_scheduler.StepLR: the recipes build the schedule"),
    ("tiny/lora_distributed", ["loss._component_=torch.nn.MSELoss", "~loss.ignore_index"],
     "loss._component_=torch.nn.MSELoss: the recipes need a token-level loss"),
    ("tiny/kd_single_device", ["loss.ignore_index=0"],
     "loss.ignore_index=0: the datasets mark the tokens without a loss (prompt, padding) with -100"),
    ("tiny/full_single_device", ["tokenizer._component_=torchtune.models.llama3.llama3_tokenizer",
                                 "tokenizer.path={file}"],
     "tokenizer: torchtune.models.llama3.llama3_tokenizer cannot be built from tokenizer.path="),
    # a local data file that is not there, in a dataset or a part of a list of them
    ("tiny/lora_single_device", ["dataset._component_=torchtune.datasets.instruct_dataset",
                                 "dataset.source=json", "dataset.data_files=no_such_data.json"],
     "dataset.data_files=no_such_data.json: no such file"),
    ("tiny/full_single_device", ["dataset=[{_component_: torchtune.datasets.instruct_dataset, "
                                 "source: json, data_files: [{file}, gone_data.json]}]"],
     "dataset[0].data_files=gone_data.json: no such file"),
    ("tiny/lora_single_device", ["model.lora_dropout=1.0"],
     "model.lora_dropout=1.0: expected a number >= 0 and < 1"),
    ("tiny/lora_single_device", ["metric_logger=null"], "metric_logger=None: expected a mapping"),
    ("tiny/lora_single_device", ["model=5"], "model=5: expected a mapping with a _component_"),
    ("tiny/full_single_device", ["dataset=alpaca"], "dataset=alpaca: expected a mapping"),
    ("tiny/full_single_device", ["dataset=[]"], "dataset=[]: expected a mapping with a _component_, or"),
    ("tiny/lora_single_device", ["checkpointer.checkpoint_files=model.safetensors"],
     "checkpointer.checkpoint_files=model.safetensors: expected a list of file names"),
    ("tiny/full_distributed", ["~metric_logger"], "missing required key(s) metric_logger"),
    ("tiny/lora_single_device", ["log_level=LOUD"], "log_level=LOUD: expected one of DEBUG"),
    ("tiny/qat_single_device", ["on_nonfinite=ignore"], "on_nonfinite=ignore: expected one of raise, skip"),
    ("tiny/lora_single_device", ["collate_fn=nope.fn"], "collate_fn=nope.fn: does not resolve"),
    ("tiny/full_single_device", ["batch_size_val=0"], "batch_size_val=0: expected an integer >= 1"),
    ("tiny/full_single_device", ["run_val_every_n_steps=0"], "run_val_every_n_steps=0"),
    ("tiny/lora_single_device", ["profiler.enabled=yes_please"], "profiler.enabled=yes_please"),
    ("tiny/full_single_device", ["profiler.wait_steps=-1"], "profiler.wait_steps=-1: expected an integer >= 0"),
    ("tiny/full_single_device", ["profiler.active_steps=0"], "profiler.active_steps=0"),
    ("tiny/lora_single_device", ["checkpointer.checkpoint_dir={file}"],
     ": a file, not a directory"),
    # a checkpoint file that is not readable safetensors (here: an empty one)
    ("tiny/full_single_device", ["checkpointer.checkpoint_dir={tmp}",
                                 "checkpointer.checkpoint_files=[a_file.safetensors]"],
     "a_file.safetensors: not a readable safetensors file"),
    # a mapping where the config holds a list: a key of a list item is named as such
    ("tiny/full_single_device", ["checkpointer.checkpoint_files.filename_format=a"],
     "checkpointer.checkpoint_files is a list here"),
    # a list replacing a mapping (torchtune's {filename_format, max_filename}) is applied, then
    # validated like any other value
    ("tiny/full_single_device", ["checkpointer.checkpoint_files={filename_format: x, max_filename: '1'}",
                                 "checkpointer.checkpoint_files=[nothere.safetensors]"],
     "checkpointer.checkpoint_files: "),
]


def _one_error_line(err: str, prefix: str = "tune: error:") -> str:
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    assert "Traceback" not in err
    return lines[0]


def _fill(items, tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_file.safetensors").write_text("")
    return [i.replace("{file}", str(tmp_path / "a_file")).replace("{tmp}", str(tmp_path)) for i in items]


@pytest.mark.unit
def test_enough_malformed_cases_across_every_family():
    configs = {(c.values[0] if hasattr(c, "values") else c[0]) for c in CASES}
    assert len(CASES) >= 45, len(CASES)
    assert {registry.recipe_for_config(c) for c in configs} == set(registry.list_recipes())


@pytest.mark.unit
@pytest.mark.parametrize("config,overrides,fragment", CASES)
def test_malformed_config_is_one_line_exit_2(config, overrides, fragment, tmp_path, capsys):
    rc = main(["validate", config, *_fill(overrides, tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2, err
    line = _one_error_line(err)
    assert fragment in line, line


@pytest.mark.unit
def test_empty_yaml_names_the_missing_keys(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    rc = main(["validate", str(empty), "--recipe", "full_finetune_single_device"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "missing required key(s) output_dir, model, checkpointer" in line
    assert "(the config is empty)" in line


@pytest.mark.unit
@pytest.mark.parametrize("argv,fragment", [
    (["--nproc_per_node", "0", "full_finetune_distributed", "--config", "tiny/full_distributed"],
     "--nproc_per_node 0: expected an integer >= 1"),
    (["--nproc_per_node", "2", "lora_finetune_single_device", "--config", "tiny/lora_single_device"],
     "--nproc_per_node 2: lora_finetune_single_device runs on one device"),
    (["--nnodes", "2", "--node_rank", "0", "--nproc_per_node", "1", "--rdzv_endpoint",
      "localhost:29500", "lora_finetune_single_device", "--config", "tiny/lora_single_device"],
     "--nnodes 2: lora_finetune_single_device runs on one device"),
    (["--nproc_per_node", "2", "qat_distributed", "--config", "tiny/qat_distributed",
      "quantizer.groupsize=-3"], "quantizer.groupsize=-3"),
    (["--nproc_per_node", "3", "full_finetune_distributed", "--config", "tiny/full_distributed",
      "tensor_parallel_dim=2", f"{TP_PLAN}={LLAMA_PLAN}"],
     "tensor_parallel_dim=2 with --nproc_per_node 3: the number of processes must be a multiple"),
])
def test_launcher_and_values_fail_before_torchrun(argv, fragment, capsys, monkeypatch):
    import torch.distributed.run as torchrun

    started = []
    monkeypatch.setattr(torchrun, "main", lambda *a, **k: started.append(a))
    rc = main(["run", *argv])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and not started and fragment in line, line


def _tiny(name):
    return load_config(registry.resolve_config(name).path)


def _keys(recipe):
    return registry.recipe_config_keys(registry.recipes_dir() / f"{recipe}.py")


@pytest.mark.unit
@pytest.mark.parametrize("key,on,off", [
    ("profiler", {"enabled": True, "output_dir": "/tmp/p"}, {"enabled": False}),
    ("enable_activation_offloading", True, False),
    ("fsdp_cpu_offload", True, False),
    ("low_cpu_ram", True, False),
    ("tensor_parallel_dim", 2, 1),
    ("optimizer_in_bwd", True, False),
    ("fsdp", {"cpu_offload": True}, {"cpu_offload": False}),
    ("enable_async_checkpointing", True, False),
])
def test_unimplemented_torchtune_key_is_an_error_only_when_it_asks(key, on, off, capsys):
    # The recipe's keys without ``key``: as long as a recipe does not implement the feature.
    keys = _keys("full_finetune_distributed") - {key}
    cfg = _tiny("tiny/full_distributed")
    cfg[key] = on
    with pytest.raises(ConfigError, match=rf"^{key}(\.enabled|\.cpu_offload)?=\S+: .* is not implemented by some_recipe"):
        check_top_level_keys(cfg, keys, "some_recipe")
    cfg[key] = off
    check_top_level_keys(cfg, keys, "some_recipe")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: some_recipe ignores {key}")
    # Implemented (declared in CONFIG_KEYS): the table steps aside, whatever the value.
    cfg[key] = on
    check_top_level_keys(cfg, keys | {key}, "some_recipe")
    assert capsys.readouterr().err == ""


@pytest.mark.unit
def test_declared_keys_are_never_treated_as_stock_keys():
    # What each recipe declares is out of the stock table's reach (one place decides).
    for recipe in registry.list_recipes():
        cfg = OmegaConf.create({k: True for k in _keys(recipe) & set(TORCHTUNE_KEYS)})
        check_top_level_keys(cfg, _keys(recipe), recipe)


@pytest.mark.unit
def test_typo_without_a_close_match_lists_the_keys():
    cfg = _tiny("tiny/quantize")
    cfg.zzz = 1
    with pytest.raises(ConfigError, match=r"does not use config key\(s\) 'zzz'; its keys are: checkpointer"):
        check_config(cfg, "quantize", _keys("quantize"), env=False)


@pytest.mark.unit
def test_a_list_of_datasets_mixing_packed_and_unpacked_is_named_before_any_work():
    """torchtune's ConcatDataset refuses the mix only once every dataset is built, after the
    model has loaded; the config check names it first."""
    recipe = "lora_finetune_single_device"
    cfg = _tiny("tiny/lora_single_device")
    entry = OmegaConf.to_container(cfg.dataset)
    for packed, refused in (([True, False], True), ([True, True], False), ([False, None], False)):
        cfg.dataset = [dict(entry, **({"packed": p} if p is not None else {})) for p in packed]
        cfg.padding_free = False
        if refused:
            with pytest.raises(ConfigError, match=r"dataset\[0\].packed=True but dataset\[1\] is "
                                                  "not packed: a list of datasets is all packed or none"):
                check_config(cfg, recipe, _keys(recipe), env=False)
        else:
            check_config(cfg, recipe, _keys(recipe), env=False)


@pytest.mark.unit
def test_a_packed_dataset_without_a_pack_length_is_named_before_any_work():
    """torchtune's configs ship tokenizer.max_seq_len: null; dataset.packed=True on top fails
    in torchtune's PackedDataset once the model has loaded. The config check names it."""
    recipe = "full_finetune_single_device"
    cfg = _tiny("tiny/full_single_device")
    cfg.dataset.packed = True
    check_config(cfg, recipe, _keys(recipe), env=False)  # the tiny tokenizer sets a length
    cfg.tokenizer.max_seq_len = None
    with pytest.raises(ConfigError, match=r"^dataset.packed=True needs tokenizer.max_seq_len"):
        check_config(cfg, recipe, _keys(recipe), env=False)
    entry = OmegaConf.to_container(cfg.dataset)
    cfg.dataset = [dict(entry), dict(entry)]  # a list names its entry
    with pytest.raises(ConfigError, match=r"^dataset\[0\].packed=True needs tokenizer.max_seq_len"):
        check_config(cfg, recipe, _keys(recipe), env=False)
    cfg.dataset = [dict(entry, packed=False)] * 2
    check_config(cfg, recipe, _keys(recipe), env=False)  # unpacked rows need no length


@pytest.mark.unit
def test_dataset_arguments_the_loader_would_misread_are_named_by_validate(tmp_path):
    """What passed validate and failed in the run with Hugging Face's words: a misspelt
    argument that torchtune's builder passes on to load_dataset, a chat style it does not know,
    a file given as source (HF: "Couldn't find any data file" at a file that exists), a folder
    as data_files (HF: "Unable to find" a folder that exists)."""
    recipe = "full_finetune_single_device"
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input": "a", "output": "b"}\n')

    def check(**dataset):
        cfg = _tiny("tiny/full_single_device")
        cfg.dataset = {"_component_": "torchtune.datasets.instruct_dataset", "source": "json",
                       "data_files": str(rows), "split": "train", **dataset}
        check_config(cfg, recipe, _keys(recipe), env=True)

    check()
    check(field=None, encoding="latin-1")  # the json loader's own arguments pass
    check(source="csv", data_files=str(rows), names=["a"], delimiter=",")  # and csv's
    # Another loader's argument fails in the run ("JsonConfig got an unexpected keyword").
    with pytest.raises(ConfigError, match=r"^dataset.names: an argument of the csv loader\(s\), not "
                                          r"of source=json's \(its arguments: .*encoding"):
        check(names=["a"])
    with pytest.raises(ConfigError, match=r"^dataset.zzz_option: neither torchtune.datasets.instruct_dataset "
                                          r"nor datasets.load_dataset with source=json takes it"):
        check(zzz_option=1)
    # A hub dataset's own arguments are unknown here: only a near miss of a known name fails.
    cfg = _tiny("tiny/full_single_device")
    cfg.dataset = {"_component_": "torchtune.datasets.instruct_dataset", "source": "someone/data",
                   "split": "train", "zzz_option": 1}
    check_config(cfg, recipe, _keys(recipe), env=False)
    # A local loading script is a source datasets runs, not a data file.
    script = tmp_path / "loader.py"
    script.write_text("")
    check(source=str(script))
    with pytest.raises(ConfigError, match=r"^dataset._component_=torchtune.datasets.preference_dataset: "
                                          r"its examples are preference pairs"):
        check(_component_="torchtune.datasets.preference_dataset")
    with pytest.raises(ConfigError, match=r"^dataset.data_file: did you mean dataset.data_files\?"):
        check(data_file=str(rows))
    with pytest.raises(ConfigError, match=r"^dataset.conversation_style=sharegtp: expected one of "
                                          r"sharegpt, openai"):
        check(_component_="torchtune.datasets.chat_dataset", conversation_column="messages",
              conversation_style="sharegtp")
    with pytest.raises(ConfigError, match=rf"^dataset.source={rows}: a file; source names the loader "
                                          rf"and data_files the file: dataset.source=json "
                                          rf"dataset.data_files={rows}"):
        check(source=str(rows))
    with pytest.raises(ConfigError, match=rf"^dataset.data_files={tmp_path}: a folder; name its "
                                          rf"files, e.g. dataset.data_files={tmp_path}/\*.jsonl"):
        check(data_files=str(tmp_path))
    # A format's name as source: Hugging Face takes it for a Hub dataset and retries the
    # network for it before it fails.
    with pytest.raises(ConfigError, match=r"^dataset.source=jsonl: not one of Hugging Face's file "
                                          r"loaders \(arrow, csv, json, parquet, text\); JSON Lines "
                                          r"are read by json: dataset.source=json$"):
        check(source="jsonl")
    # wrong on every machine: the portable checks (no paths, no devices) refuse it too
    cfg = _tiny("tiny/full_single_device")
    cfg.dataset = {"_component_": "torchtune.datasets.instruct_dataset", "source": "ndjson",
                   "data_files": "/elsewhere/rows.jsonl", "split": "train"}
    with pytest.raises(ConfigError, match=r"^dataset.source=ndjson: not one of"):
        check_config(cfg, recipe, _keys(recipe), env=False)


@pytest.mark.unit
def test_a_log_dir_that_cannot_be_made_is_named_by_validate(tmp_path):
    """A metric_logger.log_dir under a file (what no one can make, root included) passed
    validate; the run stopped at its metrics file."""
    recipe = "lora_finetune_single_device"
    cfg = _tiny("tiny/lora_single_device")
    cfg.output_dir = str(tmp_path / "out")
    (tmp_path / "file").write_text("")
    cfg.metric_logger.log_dir = str(tmp_path / "file" / "logs")
    with pytest.raises(ConfigError, match=rf"^metric_logger.log_dir=.*: {tmp_path / 'file'} exists "
                                          r"and is not a directory"):
        check_config(cfg, recipe, _keys(recipe), env=True)
    cfg.metric_logger.log_dir = str(tmp_path / "logs")
    check_config(cfg, recipe, _keys(recipe), env=True)


@pytest.mark.unit
def test_quantize_with_an_int4_weight_only_quantizer_outside_bf16_is_named_by_validate():
    """The quantize recipe converts to int4 weight-only kernels (bf16 only); the QAT recipes,
    which share the quantizer and dtype keys, fake-quantize in any dtype."""
    int4 = "torchtune.training.quantization.Int4WeightOnly"
    for recipe, config in (("quantize", "tiny/quantize"), ("qat_single_device", "tiny/qat_single_device")):
        for component in (f"{int4}QATQuantizer", f"{int4}Quantizer", f"{int4}QATQuantizerModuleSwap"):
            cfg = _tiny(config)
            cfg.quantizer = {"_component_": component, "groupsize": 32}
            cfg.dtype = "fp32"
            if recipe == "quantize":
                with pytest.raises(ConfigError, match=rf"^dtype=fp32: quantizer._component_={component} "
                                                      "converts the linears to int4 weight-only kernels"):
                    check_config(cfg, recipe, _keys(recipe), env=False)
            else:
                check_config(cfg, recipe, _keys(recipe), env=False)
            cfg.dtype = "bf16"
            check_config(cfg, recipe, _keys(recipe), env=False)
    cfg = _tiny("tiny/quantize")
    cfg.dtype = "fp32"  # int8 dynamic activations with int4 weights run in fp32
    check_config(cfg, "quantize", _keys("quantize"), env=False)


@pytest.mark.unit
def test_a_group_size_that_does_not_divide_a_layer_is_named_by_validate():
    """The QAT and quantize recipes refuse it once the model is built; validate builds the
    model on the meta device and names the layer first. A LoRA model's QAT is left out."""
    for recipe, config in (("quantize", "tiny/quantize"), ("qat_single_device", "tiny/qat_single_device"),
                           ("qat_distributed", "tiny/qat_distributed")):
        cfg = _tiny(config)
        cfg.quantizer.groupsize = 48
        with pytest.raises(ConfigError, match=r"^quantizer.groupsize=48 does not divide layer "
                                              r"'layers.0.attn.q_proj' \(in_features=256"):
            check_config(cfg, recipe, _keys(recipe), env=False)
        cfg.quantizer.groupsize = 64
        check_config(cfg, recipe, _keys(recipe), env=False)
    cfg = _tiny("tiny/qat_single_device")
    del cfg.quantizer.groupsize  # the quantizer's own default, 256, divides the tiny layers
    check_config(cfg, "qat_single_device", _keys("qat_single_device"), env=False)


@pytest.mark.unit
def test_every_tiny_config_passes_and_schema_keys_are_recipe_keys():
    every_key = set().union(*(_keys(r) for r in registry.list_recipes()))
    assert {rule.owner for rule in SCHEMA} <= every_key
    for name in registry.list_configs():
        if name.startswith("tiny/"):
            check_config(_tiny(name), registry.recipe_for_config(name),
                         _keys(registry.recipe_for_config(name)), env=name != "tiny/quantize")


# A few as real processes: the parent's checks (tune run), and the recipe's own (@parse hook).
@pytest.mark.integration
@pytest.mark.parametrize("argv,fragment,prefix", [
    (["-m", "tune_recipes", "run", "lora_finetune_single_device", "--config",
      "tiny/lora_single_device", "model.lora_attn_modules=[q_proj,foo]"], "item 'foo'", "tune: error:"),
    (["-m", "tune_recipes", "run", "--nproc_per_node", "2", "full_finetune_distributed",
      "--config", "tiny/full_distributed", "batch_size=abc"], "batch_size=abc", "tune: error:"),
    # The recipe's own check, as each torchrun child starts it (the launcher installs the
    # third-party noise filters first).
    (["-m", "tune_recipes._cli.launch", str(REPO / "recipes" / "full_finetune_single_device.py"), "--config",
      str(REPO / "configs" / "tiny" / "full_single_device.yaml"), "epochs=0"], "epochs=0",
     "tune: error:"),
])
def test_real_processes_fail_in_one_line(argv, fragment, prefix, tmp_path):
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=tmp_path,
                       env={**__import__("os").environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert p.returncode == 2, p.stderr
    line = _one_error_line(p.stderr, prefix)
    assert fragment in line
    assert not (tmp_path / "outputs").exists()


@pytest.mark.unit
def test_portable_skips_components_of_packages_not_installed_here(tmp_path, capsys):
    # Stock configs use bitsandbytes optimizers and torchvision models: a machine property.
    cfg = load_config(registry.resolve_config("tiny/full_single_device").path,
                      ["optimizer._component_=no_such_pkg_xyz.optim.PagedAdamW8bit"])
    path = tmp_path / "c.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    assert main(["validate", str(path), "--recipe", "full_finetune_single_device"]) == 2
    assert "optimizer._component_: 'no_such_pkg_xyz.optim.PagedAdamW8bit'" in capsys.readouterr().err
    assert main(["validate", str(path), "--recipe", "full_finetune_single_device", "--portable"]) == 0
    assert "not checked here: optimizer (no_such_pkg_xyz not installed)" in capsys.readouterr().out
    # A typo in an installed package is still an error.
    cfg.optimizer._component_ = "torch.optim.AdamWW"
    path.write_text(OmegaConf.to_yaml(cfg))
    assert main(["validate", str(path), "--recipe", "full_finetune_single_device", "--portable"]) == 2


@pytest.mark.unit
def test_torchrun_processes_do_not_repeat_the_parents_warnings(capsys, monkeypatch):
    import os

    import torch.distributed.run as torchrun

    seen = []
    monkeypatch.delenv("TUNE_RECIPES_CONFIG_WARNED", raising=False)
    monkeypatch.setattr(torchrun, "main", lambda argv: seen.append(os.environ.get("TUNE_RECIPES_CONFIG_WARNED")))
    rc = main(["run", "--nproc_per_node", "2", "full_finetune_distributed", "--config",
               "tiny/full_distributed", "enable_activation_offloading=False"])
    err = capsys.readouterr().err
    assert rc == 0 and seen == ["1"]
    assert err.count("ignores enable_activation_offloading=False") <= 1
    assert "TUNE_RECIPES_CONFIG_WARNED" not in os.environ  # this process warns again later


@pytest.mark.unit
def test_a_renamed_copy_of_a_distributed_recipe_may_use_several_processes(tmp_path, capsys, monkeypatch):
    import shutil

    import torch.distributed.run as torchrun

    started = []
    monkeypatch.setattr(torchrun, "main", lambda argv: started.append(argv))
    mine = tmp_path / "my_fsdp.py"
    shutil.copyfile(registry.recipes_dir() / "full_finetune_distributed.py", mine)
    assert main(["run", "--nproc_per_node", "2", str(mine), "--config", "tiny/full_distributed"]) == 0
    assert len(started) == 1
    mine_single = tmp_path / "my_lora.py"
    shutil.copyfile(registry.recipes_dir() / "lora_finetune_single_device.py", mine_single)
    assert main(["run", "--nproc_per_node", "2", str(mine_single), "--config", "tiny/lora_single_device"]) == 2
    assert "my_lora runs on one device" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize("config, overrides, warning, on", [
    ("tiny/lora_single_device", ["keep_last_n_checkpoints=3"],
     "keep_last_n_checkpoints=3 has no effect without save_every_n_steps", "save_every_n_steps=10"),
    ("tiny/full_single_device", ["fp8_recipe_name=rowwise"],
     "fp8_recipe_name=rowwise has no effect without enable_fp8_training", None),
    ("tiny/full_single_device", ["activation_memory_budget=0.9"],
     "activation_memory_budget=0.9 has no effect without compile", "compile=True"),
    ("tiny/full_single_device", ["fp8_fast_accum_backward=True"],
     "fp8_fast_accum_backward=True has no effect without enable_fp8_training", None),
    ("tiny/lora_single_device", ["fp8_mlp_layers=1"],
     "fp8_mlp_layers=1 has no effect without fp8_mlp_activations", "fp8_mlp_activations=True"),
    ("tiny/qat_single_device", ["ac_option=2"],
     "ac_option=2 has no effect without ac_mode=selective", "ac_mode=selective"),
    # torchtune ignores ac_option for ac_mode full (and none) too
    ("tiny/full_distributed", ["ac_mode=full", "ac_option=3"],
     "ac_option=3 has no effect without ac_mode=selective", "ac_mode=selective"),
])
def test_a_modifier_of_a_feature_that_is_off_is_a_warning(config, overrides, warning, on, capsys,
                                                          monkeypatch):
    from tune_recipes import validation

    monkeypatch.delenv("TUNE_RECIPES_CONFIG_WARNED", raising=False)
    monkeypatch.setattr(validation, "_WARNED", set())  # each line prints once per process
    assert main(["validate", config, *overrides]) == 0
    assert f"warning: {warning}" in capsys.readouterr().err
    if on:  # with the feature on, no warning
        monkeypatch.setattr(validation, "_WARNED", set())
        assert main(["validate", config, *overrides, on]) == 0
        assert warning not in capsys.readouterr().err


@pytest.mark.unit
def test_an_explicit_false_modifier_is_not_a_no_effect_warning(capsys, monkeypatch):
    from tune_recipes import validation

    monkeypatch.delenv("TUNE_RECIPES_CONFIG_WARNED", raising=False)
    monkeypatch.setattr(validation, "_WARNED", set())
    assert main(["validate", "tiny/full_single_device", "fp8_fast_accum_backward=False"]) == 0
    assert "has no effect" not in capsys.readouterr().err


@pytest.mark.unit
def test_fp8_mlp_activations_with_fp8_training_needs_tensorwise_in_a_full_fine_tune():
    from omegaconf import OmegaConf

    from tune_recipes.validation import fp8_mlp_problem

    full = {"model": {"_component_": "torchtune.models.llama3_2.llama3_2_1b"},
            "enable_fp8_training": True, "fp8_mlp_activations": True}
    assert "fp8_mlp_activations=True with fp8_recipe_name=rowwise: the MLP's down product" in \
        fp8_mlp_problem(OmegaConf.create({**full, "fp8_recipe_name": "rowwise"}))
    for ok in ({**full, "fp8_recipe_name": "tensorwise"}, full, {**full, "enable_fp8_training": False},
               {**full, "fp8_recipe_name": "rowwise", "fp8_mlp_activations": False}):
        assert fp8_mlp_problem(OmegaConf.create(ok)) is None, ok


DISTRIBUTED_CONFIGS = {
    "full_finetune_distributed": "tiny/full_distributed",
    "lora_finetune_distributed": "tiny/lora_distributed",
    "knowledge_distillation_distributed": "tiny/kd_distributed",
    "qat_distributed": "tiny/qat_distributed",
    "qat_lora_finetune_distributed": "tiny/qat_lora_distributed",
}


@pytest.mark.unit
@pytest.mark.parametrize("recipe", sorted(DISTRIBUTED_CONFIGS))
@pytest.mark.parametrize("overrides,offload", [
    # the stock QLoRA configs' section, and the section as the only spelling, on and off
    (["fsdp.cpu_offload=False"], False),
    (["fsdp_cpu_offload=null", "fsdp.cpu_offload=True"], True),
    (["~fsdp_cpu_offload", "fsdp.cpu_offload=True"], True),
    (["fsdp_cpu_offload=True", "fsdp.cpu_offload=True"], True),
    (["fsdp=null"], False),
    # the two spellings of CPU offload disagree: refused, as the run refuses them
    (["fsdp.cpu_offload=False", "fsdp_cpu_offload=True"], None),
    (["fsdp.foo=1"], None),
    (["fsdp=3"], None),
])
def test_validate_and_the_run_agree_on_the_fsdp_section(recipe, overrides, offload, capsys,
                                                        monkeypatch):
    from tune_recipes.training.setup.distributed import fsdp_cpu_offload_requested

    from tune_recipes import validation

    config = DISTRIBUTED_CONFIGS[recipe]
    monkeypatch.setattr(validation, "_WARNED", set())  # an "ignores fsdp" warning would show
    monkeypatch.delenv("TUNE_RECIPES_CONFIG_WARNED", raising=False)
    rc = main(["validate", config, *overrides])
    err = capsys.readouterr().err
    # What the recipe does with the same config when it shards the model.
    cfg = load_config(registry.resolve_config(config).path, overrides)
    if offload is None:
        with pytest.raises(ConfigError) as run_error:
            fsdp_cpu_offload_requested(cfg)
        assert rc == 2 and _one_error_line(err) == f"tune: error: {run_error.value}"
        assert "fsdp" in str(run_error.value)  # the message names the key
    else:
        assert rc == 0, err
        assert fsdp_cpu_offload_requested(cfg) is offload
        assert "fsdp" not in err  # no "ignores fsdp..." warning: the section is read


@pytest.mark.unit
def test_every_recipe_that_reads_the_fsdp_section_declares_it():
    # The recipes read it through fsdp_options / fsdp_cpu_offload_requested; a recipe that calls
    # them without declaring ``fsdp`` lets validate treat the section as an ignored stock key.
    for recipe in registry.list_recipes():
        source = (registry.recipes_dir() / f"{recipe}.py").read_text()
        reads = "fsdp_options(" in source or "fsdp_cpu_offload_requested(" in source
        assert reads == (recipe in DISTRIBUTED_CONFIGS), recipe
        assert ("fsdp" in _keys(recipe)) == reads, recipe


@pytest.mark.unit
@pytest.mark.parametrize("config", ["tiny/full_single_device", "tiny/lora_distributed",
                                    "tiny/kd_single_device", "tiny/qat_lora_distributed"])
def test_validate_refuses_offloading_without_checkpointing_as_the_recipe_does(config, capsys):
    from tune_recipes.training.setup.offloading import activation_offloading_wanted

    overrides = ["enable_activation_offloading=True", "enable_activation_checkpointing=False"]
    rc = main(["validate", config, *overrides])
    line = _one_error_line(capsys.readouterr().err)
    cfg = load_config(registry.resolve_config(config).path, overrides)
    with pytest.raises(ConfigError) as run_error:
        activation_offloading_wanted(cfg, torch.device("cpu"))
    assert rc == 2 and line == f"tune: error: {run_error.value}"
    # with checkpointing on, both accept it (on CPU the recipe then runs as with it off)
    overrides[1] = "enable_activation_checkpointing=True"
    assert main(["validate", config, *overrides]) == 0
    activation_offloading_wanted(load_config(registry.resolve_config(config).path, overrides),
                                 torch.device("cpu"))


@pytest.mark.unit
@pytest.mark.parametrize("config,overrides", [
    ("tiny/full_single_device", ["enable_activation_checkpointing=True", "ac_mode=full"]),
    ("tiny/qat_lora_distributed", ["ac_mode=selective"]),
    ("tiny/kd_distributed", ["ac_mode=selective", "ac_option=op"]),
])
def test_validate_and_the_recipe_refuse_activation_checkpointing_alike(config, overrides, capsys):
    from tune_recipes.training.setup.activations import ac_interval

    rc = main(["validate", config, *overrides])
    line = _one_error_line(capsys.readouterr().err)
    cfg = load_config(registry.resolve_config(config).path, overrides)
    with pytest.raises(ConfigError) as run_error:
        ac_interval(cfg)
    assert rc == 2 and line == f"tune: error: {run_error.value}"


@pytest.mark.unit
def test_every_recipe_with_activation_checkpointing_reads_ac_mode():
    # The single-device recipes pass ac_interval(cfg) to the model setup, the distributed ones
    # fsdp_options(cfg), which holds it; a recipe that declared the keys and passed neither
    # would accept ac_mode and silently ignore it.
    with_ac = [r for r in registry.list_recipes() if "enable_activation_checkpointing" in _keys(r)]
    assert len(with_ac) == 9
    for recipe in with_ac:
        source = (registry.recipes_dir() / f"{recipe}.py").read_text()
        assert {"ac_mode", "ac_option"} <= _keys(recipe), recipe
        assert "ac_interval=ac_interval(cfg)" in source or "**fsdp_options(cfg)" in source, recipe
        assert 'get("enable_activation_checkpointing"' not in source, recipe
    for config in ("tiny/full_single_device", "tiny/lora_distributed"):  # and validate accepts them
        assert main(["validate", config, "ac_mode=selective", "ac_option=2"]) == 0
        assert main(["validate", config, "ac_mode=selective", 'ac_option="3"']) == 0
        assert main(["validate", config, "ac_mode=full", "enable_activation_checkpointing=False"]) == 0


@pytest.mark.unit
@pytest.mark.parametrize("key,on,fix,off", [
    ("profiler", {"enabled": True}, "set profiler.enabled=False or remove profiler",
     {"enabled": False}),
    ("low_cpu_ram", True, "set low_cpu_ram=False or remove low_cpu_ram", False),
    ("tensor_parallel_dim", 2, "set tensor_parallel_dim=1 or remove tensor_parallel_dim", 1),
    ("fsdp", {"cpu_offload": True}, "set fsdp.cpu_offload=False or remove fsdp",
     {"cpu_offload": False}),
])
def test_the_error_names_the_value_that_is_accepted(key, on, fix, off, capsys, monkeypatch):
    from tune_recipes import validation

    # Warnings print once per process; start this case with none printed.
    monkeypatch.setattr(validation, "_WARNED", set())
    monkeypatch.delenv("TUNE_RECIPES_CONFIG_WARNED", raising=False)
    keys = _keys("full_finetune_single_device") - {key}
    cfg = _tiny("tiny/full_single_device")
    cfg[key] = on
    with pytest.raises(ConfigError, match="is not implemented by") as e:
        check_top_level_keys(cfg, keys, "some_recipe")
    assert fix in str(e.value) and "turn it off" not in str(e.value)
    # ... and the value it names is accepted, with the one-line warning.
    cfg[key] = off
    check_top_level_keys(cfg, keys, "some_recipe")
    assert capsys.readouterr().err.startswith(f"warning: some_recipe ignores {key}")


@pytest.mark.unit
@pytest.mark.parametrize("value,mode,benchmark", [(None, 0, False), ("error", 2, False), ("warn", 1, False),
                                                  (False, 0, True), (2, 2, False)])
def test_cudnn_deterministic_mode_sets_torchs_mode_as_torchtune_does(value, mode, benchmark):
    # Every training recipe seeds through RecipeState.from_config: torchtune's recipes hand any
    # value but null to torch.set_deterministic_debug_mode; False is its mode 0, which also
    # turns cuDNN benchmark on; null leaves torch's settings alone.
    from omegaconf import OmegaConf

    from tune_recipes.training.checkpointing.state import RecipeState

    before = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
              torch.get_deterministic_debug_mode())
    try:
        torch.backends.cudnn.benchmark = False
        torch.set_deterministic_debug_mode(0)
        cfg = OmegaConf.create({"seed": 7, "epochs": 1, "cudnn_deterministic_mode": value,
                                "optimizer": {"_component_": "torch.optim.AdamW"}})
        assert RecipeState.from_config(cfg).seed == 7
        assert torch.get_deterministic_debug_mode() == mode
        assert torch.backends.cudnn.benchmark is benchmark
        assert torch.are_deterministic_algorithms_enabled() is (mode > 0)
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[:2]
        torch.set_deterministic_debug_mode(before[2])


@pytest.mark.unit
def test_an_ignored_section_without_the_deciding_field_is_shown_whole(capsys, monkeypatch):
    # A single-device recipe ignores `fsdp`; its warning shows the section as written, not a
    # made-up "fsdp.cpu_offload=None" for a section that has no cpu_offload at all.
    from tune_recipes import validation

    monkeypatch.setattr(validation, "_WARNED", set())
    monkeypatch.delenv("TUNE_RECIPES_CONFIG_WARNED", raising=False)
    assert main(["validate", "tiny/full_single_device", "fsdp.foo=1"]) == 0
    err = capsys.readouterr().err
    assert "warning: full_finetune_single_device ignores fsdp={'foo': 1}" in err
    assert "cpu_offload=None" not in err


@pytest.mark.unit
@pytest.mark.parametrize("config,resume,folders,fragment", [
    ("tiny/full_single_device", True, [], "holds no checkpoint to resume (an epoch_<n>/ or step_<n>/ folder with its recipe_state.pt)"),
    ("tiny/lora_single_device", True, ["epoch_0"], "final checkpoint of a finished run"),
    ("tiny/lora_single_device", False, ["step_3"], "holds mid-epoch checkpoints of an earlier run"),
    ("tiny/kd_distributed", False, ["epoch_0", "step_3"], "not written by this recipe's checkpoint"),
])
def test_validate_checks_output_dir_for_the_resume_as_the_recipe_does(config, resume, folders,
                                                                       fragment, tmp_path, capsys):
    """`tune validate` refuses a resume with nothing to resume (or a fresh run beside an
    earlier run's step_<n>/) with the recipe's own error, as `tune run` would."""
    from tune_recipes.training.setup.recipe import load_checkpoint

    for name in folders:
        (tmp_path / name).mkdir()
    overrides = [f"output_dir={tmp_path}", f"resume_from_checkpoint={resume}"]
    rc = main(["validate", config, *overrides])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and fragment in line and str(tmp_path) in line
    cfg = load_config(registry.resolve_config(config).path, overrides)
    with pytest.raises(ConfigError) as run_error:
        load_checkpoint(cfg, adapter="lora" in config or "kd" in config)
    assert line == f"tune: error: {run_error.value}"
    # --portable leaves this machine's files alone, as for every other path
    assert main(["validate", config, *overrides, "--portable"]) == 0


@pytest.mark.unit
def test_output_dir_checks_name_a_live_run_first_and_spare_quantize(tmp_path, capsys):
    """A second run in a live run's output_dir is told of that run, not told to resume or
    remove its step_<n>/; quantize (no resume) may write beside a training run's checkpoints."""
    import json
    import os
    import socket

    (tmp_path / "step_3").mkdir()
    (tmp_path / "epoch_0").mkdir()
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(tmp_path / "epoch_0" / "model-00001-of-00001.safetensors"))
    assert main(["validate", "tiny/quantize", f"output_dir={tmp_path}",
                 f"checkpointer.checkpoint_dir={tmp_path / 'epoch_0'}"]) == 0
    live = {"host": socket.gethostname(), "pid": os.getppid()}  # alive, not this process
    (tmp_path / ".lock").write_text(json.dumps(live))
    assert main(["validate", "tiny/lora_single_device", f"output_dir={tmp_path}"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"is in use by another run (pid {live['pid']}" in line


@pytest.mark.unit
def test_a_fresh_run_reading_from_an_earlier_runs_step_folder_is_refused_by_validate(tmp_path, capsys):
    """Found before anything starts (tune validate, tune run), as the recipe's ranks find it."""
    from safetensors.torch import save_file

    (tmp_path / "epoch_0").mkdir()
    step = tmp_path / "step_3"
    step.mkdir()
    save_file({"w": torch.zeros(1)}, str(step / "model.safetensors"))
    torch.save({"epochs_run": 0, "global_step": 3, "rank_states": [{}]}, step / "recipe_state.pt")
    assert main(["validate", "tiny/full_single_device", f"output_dir={tmp_path}",
                 f"checkpointer.checkpoint_dir={step}"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"checkpointer.checkpoint_dir={step} reads from step_3/, a mid-epoch checkpoint" in line


@pytest.mark.unit
def test_a_lora_recipe_given_a_full_fine_tune_config_is_refused_by_validate(capsys):
    # The recipe refuses it after building the model; validate builds it on the meta device.
    rc = main(["validate", "tiny/full_single_device", "--recipe", "lora_finetune_single_device"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "tune_recipes.models.tiny_llama3: this model has no LoRA adapters" in line


@pytest.mark.unit
@pytest.mark.parametrize("override,fragment", [
    ("optimizer.betas=[0.9]", "optimizer.betas=[0.9]"),
    ("optimizer.eps=-1", "optimizer.eps=-1"),
    ("checkpointer.model_type=LLAMA4", "checkpointer.model_type=LLAMA4"),
])
def test_tune_run_refuses_what_validate_refuses_before_the_recipe_starts(override, fragment,
                                                                         capsys, monkeypatch):
    import tune_recipes._cli.main as cli

    started = []
    monkeypatch.setattr(cli, "run_script", lambda *a, **k: started.append(a))
    rc = main(["run", "lora_finetune_single_device", "--config", "tiny/lora_single_device",
               override])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and not started and fragment in line, line


@pytest.mark.unit
def test_the_recipes_own_check_refuses_the_optimizer_arguments_too(tmp_path, capsys):
    # @parse (every recipe process, tune run or not) runs the same check_config.
    from tune_recipes.config import parse

    namespace = {"__file__": str(tmp_path / "my_recipe.py"), "parse": parse,
                 "CONFIG_KEYS": {"output_dir", "optimizer"}}
    exec("@parse\ndef recipe_main(cfg):\n    raise AssertionError('ran')\n", namespace)
    p = tmp_path / "c.yaml"
    p.write_text(f"output_dir: {tmp_path}\noptimizer:\n  _component_: torch.optim.SGD\n"
                 "  lr: 0.1\n  momentum: -1\n")
    with pytest.raises(SystemExit) as e:
        namespace["recipe_main"](["--config", str(p)])
    line = _one_error_line(capsys.readouterr().err)
    assert e.value.code == 2 and "optimizer.momentum=-1: torch.optim.SGD refuses it" in line


@pytest.mark.unit
def test_an_optimizer_that_cannot_be_built_on_cpu_is_said_to_be_unchecked(capsys, monkeypatch):
    import tune_recipes.validation as v

    def cuda_only(params, **kwargs):
        raise RuntimeError("needs CUDA tensors")

    monkeypatch.setattr(v, "_resolves_to", lambda dotted: cuda_only)
    cfg = OmegaConf.create({"optimizer": {"_component_": "my.CudaOptimizer", "lr": 1e-3}})
    assert v.optimizer_problem(cfg) is None
    assert "optimizer: my.CudaOptimizer's arguments were not checked" in capsys.readouterr().err


@pytest.mark.unit
def test_warmup_longer_than_the_run_is_a_warning_naming_both(capsys, monkeypatch):
    import tune_recipes.validation as v

    monkeypatch.setattr(v, "_WARNED", set())
    assert main(["validate", "tiny/full_single_device", "lr_scheduler.num_warmup_steps=100",
                 "epochs=2", "max_steps_per_epoch=3"]) == 0
    err = capsys.readouterr().err
    assert ("warning: lr_scheduler.num_warmup_steps=100 is as long as the whole run or longer (6 optimizer "
            "steps at most: epochs=2 x max_steps_per_epoch=3)") in err, err
    assert main(["validate", "tiny/full_single_device", "lr_scheduler.num_warmup_steps=5",
                 "epochs=2", "max_steps_per_epoch=3"]) == 0
    assert "num_warmup_steps" not in capsys.readouterr().err
    # as long as the run: its last step is still warming up (lr x 3/4 at most for 4 steps)
    assert v.warmup_problem(5, 4) and v.warmup_problem(4, 4) and v.warmup_problem(3, 4) is None
    # A config an error stops prints that error alone, not the warning before it.
    monkeypatch.setattr(v, "_WARNED", set())  # the warning above printed once already
    assert main(["validate", "tiny/full_single_device", "lr_scheduler.num_warmup_steps=100", "epochs=2",
                 "max_steps_per_epoch=3", "enable_fp8_training=True", "device=cpu"]) != 0
    err = capsys.readouterr().err
    assert "enable_fp8_training" in err and "num_warmup_steps" not in err, err
    # ... whichever check comes last: the launch, and tune validate's retry without this
    # machine's paths and devices (which passes, and must not print its warnings either)
    long_warmup = ["lr_scheduler.num_warmup_steps=100", "max_steps_per_epoch=2"]
    for argv in (["run", "--nproc_per_node", "3", "full_finetune_distributed", "--config",
                  "tiny/full_distributed", "tensor_parallel_dim=2", *long_warmup],
                 ["validate", "tiny/full_single_device", "device=cuda:7", *long_warmup]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("tune: error: ") and "num_warmup_steps" not in err, err


@pytest.mark.unit
@pytest.mark.parametrize("env,mode,refused", [
    ({}, None, True),
    ({"WANDB_MODE": "offline"}, None, False),
    ({}, "disabled", False),
    ({"WANDB_API_KEY": "x" * 40}, None, False),
    ({"NETRC": "{netrc}"}, None, False),
])
def test_the_wandb_logger_without_credentials_is_one_line(env, mode, refused, tmp_path, capsys,
                                                         monkeypatch):
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")
    for k in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL",
              "WANDB_DISABLED", "NETRC"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc
    for k, val in env.items():
        monkeypatch.setenv(k, val.replace("{netrc}", str(tmp_path / "netrc")))
    overrides = ["metric_logger._component_=tune_recipes.loggers.WandBLogger"]
    if mode:
        overrides.append(f"metric_logger.mode={mode}")
    rc = main(["validate", "tiny/lora_single_device", *overrides])
    err = capsys.readouterr().err
    if refused:
        line = _one_error_line(err)
        assert rc == 2 and "W&B has no API key on this machine" in line and "wandb login" in line
    else:
        assert rc == 0, err


@pytest.mark.unit
def test_a_tokenizer_error_quoting_a_whole_file_is_cut(tmp_path, capsys):
    """A parser's error quoting a minified tokenizer.json (megabytes on one line) is cut."""
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": ' + '"x",' * 100_000)  # one long line, not valid JSON
    rc = main(["validate", "tiny/full_single_device",
               "tokenizer._component_=torchtune.models.llama3.llama3_tokenizer", f"tokenizer.path={bad}"])
    err = capsys.readouterr().err
    assert rc == 2 and len(_one_error_line(err)) < 1000, err[:2000]


@pytest.mark.unit
def test_data_files_are_checked_only_where_they_are_local_paths(tmp_path):
    """With a packaged loader (json, csv ...) as source a relative data_files is a local path,
    from data_dir when given; with a hub id or a local folder as source it is relative to that
    repository or folder, which only loading the data can check."""
    from tune_recipes.validation import data_files_problem

    (tmp_path / "train.json").write_text("[]")

    def problem(**dataset):
        return data_files_problem(OmegaConf.create({"dataset": dataset}))

    assert problem(source="json", data_files=str(tmp_path / "train.json")) is None
    assert problem(source="json", data_dir=str(tmp_path), data_files="train.json") is None
    assert problem(source="json", data_dir=str(tmp_path), data_files="nope.json") == \
        "dataset.data_files=nope.json: no such file"
    assert problem(source="csv", data_files={"train": [str(tmp_path / "gone.csv")]}) == \
        f"dataset.data_files={tmp_path / 'gone.csv'}: no such file"
    # Relative to where tune runs, not to the config's folder: the line says from where.
    assert problem(source="json", data_files="nope.json") == \
        f"dataset.data_files=nope.json: no such file (a relative path is read from the folder tune runs in, {Path.cwd()})"
    assert problem(source="allenai/c4", data_files="en/c4-train.00000-of-01024.json.gz") is None
    assert problem(source=str(tmp_path), data_files="train.json") is None
    assert problem(source="json", data_files="https://example.com/x.json") is None
    assert problem(source="json", data_files=str(tmp_path / "*.json")) is None


def test_the_compiled_step_takes_our_adamw8bit(capsys):
    """compile_optimizer_step with tune_recipes.optim.AdamW8bit (its one-graph step) passes
    validate, as torch's Adam and AdamW do."""
    for optimizer in ("tune_recipes.optim.AdamW8bit", "torch.optim.Adam"):
        assert main(["validate", "tiny/full_single_device", "compile_optimizer_step=True",
                     f"optimizer._component_={optimizer}"]) in (0, None), capsys.readouterr().err
        assert "config is valid" in capsys.readouterr().out


# A top-level helper key that another value reads through interpolation (torchtune ignores keys
# its recipe does not read; ours refuse typos, and such a key is none).
HELPER_KEYS = [
    # (what the config adds, accepted)
    ({"base_dir": "/tmp/x", "output_dir": "${base_dir}/run"}, True),
    ({"paths": {"ckpt": "/tmp/c"}, "checkpointer": {"checkpoint_dir": "${paths.ckpt}"}}, True),
    # one level down, relative; inside a list; from a resolver's argument; oc.select's key
    ({"base_dir": "/tmp/x", "checkpointer": {"output_dir": "${..base_dir}/ckpt"}}, True),
    ({"mods": "q_proj", "model": {"lora_attn_modules": ["${mods}", "v_proj"]}}, True),
    ({"base_dir": "/tmp/x", "output_dir": "${oc.env:NO_SUCH_VAR_VALFIX,${base_dir}}/run"}, True),
    ({"base_dir": "/tmp/x", "output_dir": "${oc.select:base_dir,/tmp}/run"}, True),
    # a chain of helpers
    ({"root": "/tmp", "base_dir": "${root}/x", "output_dir": "${base_dir}/run"}, True),
    # read by nothing; a resolver's argument spelt like it; escaped; read only from inside itself
    ({"base_dir": "/tmp/x"}, False),
    ({"base_dir": "/tmp/x", "output_dir": "${oc.env:base_dir,/tmp}/run"}, False),
    ({"base_dir": "/tmp/x", "output_dir": "\\${base_dir}/run"}, False),
    ({"base_dir": {"a": "/tmp", "b": "${base_dir.a}/x"}}, False),
    ({"base_dir": {"a": "/tmp", "b": "${.a}/x"}}, False),
    # read only by a key the recipe does not read: both are typos
    ({"base_dir": "/tmp/x", "old_output_dir": "${base_dir}/run"}, False),
]


@pytest.mark.unit
@pytest.mark.parametrize("added,accepted", HELPER_KEYS)
def test_a_helper_key_read_through_interpolation_is_not_a_typo(added, accepted, capsys):
    recipe = "lora_finetune_single_device"
    cfg = OmegaConf.merge(_tiny("tiny/lora_single_device"), OmegaConf.create(added))
    if accepted:
        check_top_level_keys(cfg, _keys(recipe), recipe)
        assert capsys.readouterr().err == ""
    else:
        with pytest.raises(ConfigError, match=rf"^{recipe} does not use config key\(s\) 'base_dir'"):
            check_top_level_keys(cfg, _keys(recipe), recipe)
    # A typo beside a helper is still one, and so is a typo only another typo reads.
    cfg.bach_size = 4
    with pytest.raises(ConfigError, match=r"'bach_size' \(did you mean 'batch_size'\?\)$"):
        check_top_level_keys(cfg, _keys(recipe), recipe)
    cfg.micro_bach = "${bach_size}"
    with pytest.raises(ConfigError, match=r"'bach_size' \(did you mean 'batch_size'\?\)"):
        check_top_level_keys(cfg, _keys(recipe), recipe)


@pytest.mark.unit
def test_tune_validate_and_tune_run_accept_a_copied_config_with_a_helper_key(tmp_path, capsys,
                                                                              monkeypatch):
    """`tune cp` a config, add ``base_dir`` and ``output_dir: ${base_dir}/run``: validate (the
    recipe named by the copy's header) and run check the keys alike and pass; a key that nothing
    reads fails both, with the same line."""
    import tune_recipes._cli.main as cli

    started = []
    monkeypatch.setattr(cli, "run_script", lambda *a, **k: started.append(a))
    copy = tmp_path / "helper.yaml"
    assert main(["cp", "tiny/lora_single_device", str(copy)]) == 0
    text = copy.read_text()
    assert "\noutput_dir: " in text
    copy.write_text(text.replace("\noutput_dir: ", f"\nbase_dir: {tmp_path}/x\noutput_dir: ${{base_dir}}/run\n"
                                                   "old_output_dir: ", 1))
    capsys.readouterr()
    # old_output_dir is read by nothing
    assert main(["validate", str(copy)]) == 2
    validate_line = _one_error_line(capsys.readouterr().err)
    assert main(["run", "lora_finetune_single_device", "--config", str(copy)]) == 2
    assert _one_error_line(capsys.readouterr().err) == validate_line
    assert "does not use config key(s) 'old_output_dir'" in validate_line
    assert "base_dir" not in validate_line.split(";")[0] and not started
    copy.write_text(copy.read_text().replace("\nold_output_dir: ", "\n# old_output_dir: ", 1))
    assert main(["validate", str(copy)]) == 0
    assert "config is valid" in capsys.readouterr().out
    assert main(["run", "lora_finetune_single_device", "--config", str(copy)]) == 0
    assert len(started) == 1


# A value written in quotes where the key takes a number, a bool or null: the message shows the
# quotes and says what to write; an ordinary string is shown as written.
QUOTED = [
    ('batch_size: "4"', "batch_size='4': expected an integer >= 1 (a string; write 4 without quotes)"),
    ('optimizer: {lr: "3e-2"}', "optimizer.lr='3e-2': expected a number > 0 (a string; write 3e-2 without quotes)"),
    ("resume_from_checkpoint: 'True'",
     "resume_from_checkpoint='True': expected True, False or auto (a string; write True without quotes)"),
    ('shuffle: "yes"', "shuffle='yes': expected True or False (a string; write True without quotes)"),
    ("seed: None", "seed='None': expected an integer >= 0 (YAML reads None as a string; write null)"),
    ('cudnn_deterministic_mode: "2"', "cudnn_deterministic_mode='2': expected null, default, warn, "
     "error, 0, 1 or 2 (torch.set_deterministic_debug_mode) (a string; write 2 without quotes)"),
    ('model: {lora_attn_modules: "[q_proj, v_proj]"}', "model.lora_attn_modules='[q_proj, v_proj]': "
     "expected a non-empty list (a string; write [q_proj, v_proj] without quotes)"),
    ('optimizer: {eps: "1e-8"}', "optimizer.eps='1e-8': torch.optim.AdamW refuses it: TypeError: "),
    # unquoted it is refused too: the quotes alone say it is a string
    ('batch_size: "0"', "batch_size='0': expected an integer >= 1"),
    # ordinary strings as written
    ("batch_size: four", "batch_size=four: expected an integer >= 1"),
    ("dtype: fp16", "dtype=fp16: expected one of bf16, fp32"),
]


@pytest.mark.unit
@pytest.mark.parametrize("line,message", QUOTED)
def test_a_quoted_value_is_shown_as_a_string(line, message, tmp_path):
    path = tmp_path / "quoted.yaml"
    path.write_text(line + "\n")
    cfg = OmegaConf.merge(_tiny("tiny/lora_single_device"), OmegaConf.load(path))
    with pytest.raises(ConfigError) as e:
        check_config(cfg, "lora_finetune_single_device", _keys("lora_finetune_single_device"),
                     env=False)
    assert str(e.value).startswith(message), str(e.value)
    if message.endswith("expected an integer >= 1"):
        assert str(e.value) == message


@pytest.mark.unit
def test_a_quoted_value_from_the_command_line_is_shown_as_a_string(capsys):
    rc = main(["validate", "tiny/qat_lora_distributed", "fsdp.cpu_offload='True'"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and line.endswith(
        "fsdp.cpu_offload='True': expected True or False (a string; write True without quotes)"), line
