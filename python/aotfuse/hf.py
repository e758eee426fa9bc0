"""Hugging Face Trainer integration: `--fusion aot` trains the model through aotfuse.

Drop-in replacements for transformers' TrainingArguments and Trainer:

    >>> from transformers import HfArgumentParser
    >>> from aotfuse.hf import Trainer, TrainingArguments
    >>> (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
    ...     ["--output_dir", "out", "--fusion", "aot"])
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds)
    >>> trainer.train()

How it hooks in: transformers' Trainer keeps `self.model` as the plain PreTrainedModel and lets accelerate
prepare the module it runs (device placement, mixed-precision autocast, torch.compile through the dynamo
plugin) as `self.model_wrapped`. aotfuse.hf.Trainer leaves both alone and overrides `compute_loss` (the
documented override point that train and evaluate both go through): the prepared module is compiled once
with `aotfuse.memory_efficient_fusion` and the loss is computed through the compiled view. That view shares
the module's parameters, buffers and train/eval mode, so the optimizer, gradient clipping and
`save_model`/checkpoints see the same tensors under the same state_dict keys as without fusion.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import transformers

__all__ = ["TrainingArguments", "Trainer", "FUSION_CHOICES"]

FUSION_CHOICES = ("none", "aot")
FALLBACK_CHOICES = ("dynamo", "eager", "error")


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers.TrainingArguments plus `fusion` ("none" or "aot") and `fusion_fallback`
    ("dynamo", "eager" or "error")."""

    fusion: str = dataclasses.field(
        default="none",
        metadata={"help": "Compile the training step with aotfuse: 'aot' wraps the model with "
                          "aotfuse.memory_efficient_fusion, 'none' trains it as it is.",
                  "choices": list(FUSION_CHOICES)},
    )
    # A model aotfuse cannot capture as one graph (LayerDrop's `torch.rand([]) < p` with 0 < p < 1:
    # BART, OPT, Whisper, Wav2Vec2 in training; at p = 0, their default, they are one graph) still
    # trains: by default through Dynamo, which splits the graph there and gives aotfuse the pieces
    # (memory_efficient_fusion's own default is "error").
    fusion_fallback: str = dataclasses.field(
        default="dynamo",
        metadata={"help": "With --fusion aot, for a model that cannot be captured as one graph: 'dynamo' "
                          "compiles its pieces under torch.compile(backend='aotfuse'), 'eager' trains it "
                          "uncompiled, 'error' raises aotfuse.CaptureError (each of the first two warns once).",
                  "choices": list(FALLBACK_CHOICES)},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fusion not in FUSION_CHOICES:
            raise ValueError(f"fusion must be one of {', '.join(FUSION_CHOICES)}, got {self.fusion!r}")
        if self.fusion_fallback not in FALLBACK_CHOICES:
            raise ValueError(f"fusion_fallback must be one of {', '.join(FALLBACK_CHOICES)}, "
                             f"got {self.fusion_fallback!r}")
        if self.fusion == "aot" and self.torch_compile:
            raise ValueError("--fusion aot and --torch_compile are alternatives; pick one "
                             "(for aotfuse under torch.compile, pass torch.compile(model, backend='aotfuse') as the "
                             "model: accelerate's --torch_compile_backend takes only the backends it lists)")


class Trainer(transformers.Trainer):
    """transformers.Trainer that trains through aotfuse when `args.fusion == "aot"`.

    `fusion_kwargs` (a class or instance attribute) is passed to memory_efficient_fusion, after
    `fallback=args.fusion_fallback` ("dynamo" unless --fusion_fallback says otherwise), which it may
    override.
    """

    fusion_kwargs: dict[str, Any] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # (model object, its compiled view): the model's own and, under torchrun, its DDP wrapper's,
        # which shares the model's compiled programs (evaluation calls the model, training the wrapper)
        self._fusion_views: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        if self.fusion == "aot" and (self.args.n_gpu > 1 or self.is_deepspeed_enabled or self.is_fsdp_enabled):
            raise ValueError("--fusion aot trains on one device per process: one process, or several under "
                             "torchrun / accelerate launch (DistributedDataParallel); not DataParallel over "
                             "several GPUs in one process, DeepSpeed or FSDP")

    @property
    def fusion(self) -> str:
        return getattr(self.args, "fusion", "none")

    def fused_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The aotfuse view of `model` (compiled once per model object); `model` itself when fusion is off.

        Under torchrun `model` may be accelerate's DistributedDataParallel: its view runs DDP's forward
        (the reducer's bookkeeping for the gradients' all-reduce) around the model's own compiled view.
        """
        if self.fusion != "aot":
            return model
        from .compile import AOTDataParallel, AOTModule, memory_efficient_fusion

        if isinstance(model, AOTModule):
            return model
        for seen, view in self._fusion_views:
            if seen is model:
                return view
        unwrapped = self.accelerator.unwrap_model(model)
        if unwrapped is not model:
            if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or model.module is not unwrapped:
                raise ValueError(f"--fusion aot cannot compile a {type(model).__name__}-wrapped model; it trains "
                                 "a model on its own or inside DistributedDataParallel")
            fused: torch.nn.Module = AOTDataParallel(model, self.fused_model(unwrapped))
        else:
            self._fusion_views = []  # a new model (model_init, hyperparameter search): forget the old ones
            kwargs = {"fallback": getattr(self.args, "fusion_fallback", "dynamo"), **self.fusion_kwargs}
            fused = memory_efficient_fusion(model, **kwargs)
        # Trainer.compute_loss picks label smoothing's label shift (causal LMs) by the class name of the
        # module it is given: let the compiled view answer with the model's own name.
        fused._get_name = unwrapped._get_name
        self._fusion_views.append((model, fused))
        return fused

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        return super().compute_loss(self.fused_model(model), inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)
