"""aotfuse.hf: the Trainer with --fusion aot matches the plain Trainer; checkpoints keep their keys."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
from safetensors.torch import load_file  # noqa: E402
from transformers import BertConfig, BertForMaskedLM, HfArgumentParser  # noqa: E402

from aotfuse import AOTModule  # noqa: E402
from aotfuse.hf import Trainer, TrainingArguments  # noqa: E402

from helpers import ATOL, RTOL  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, SEQ = 64, 16


class _Random(torch.utils.data.Dataset):
    """Fixed random MLM examples: a fifth of the positions carry labels."""

    def __init__(self, n: int, seed: int, attention_mask: bool = False) -> None:
        self.attention_mask = attention_mask
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, VOCAB, (n, SEQ), generator=g)
        self.labels = torch.where(torch.rand(n, SEQ, generator=g) < 0.2, self.ids, torch.full_like(self.ids, -100))
        self.labels[:, 0] = self.ids[:, 0]  # at least one label per example

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        item = {"input_ids": self.ids[i], "labels": self.labels[i]}
        if self.attention_mask:  # what a tokenizer adds
            item["attention_mask"] = torch.ones_like(self.ids[i])
        return item


def _parse(out_dir, *extra: str) -> TrainingArguments:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(out_dir), "--max_steps", "3", "--per_device_train_batch_size", "4",
         "--per_device_eval_batch_size", "4", "--learning_rate", "1e-3", "--logging_steps", "1",
         "--save_strategy", "steps", "--save_steps", "3", "--report_to", "none", "--use_cpu", "true",
         "--seed", "0", *extra])
    return args


def _model() -> BertForMaskedLM:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config)


def _train(out_dir, fusion: str):
    args = _parse(out_dir, "--fusion", fusion)
    assert args.fusion == fusion
    model = _model()
    trainer = Trainer(model=model, args=args, train_dataset=_Random(12, 1), eval_dataset=_Random(8, 2))
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, model, losses, metrics


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {f: _train(tmp_path_factory.mktemp(f), f) for f in ("none", "aot")}


def test_aot_logs_the_same_losses_as_plain(runs):
    _, _, plain, plain_metrics = runs["none"]
    trainer, _, fused, fused_metrics = runs["aot"]
    assert len(plain) == len(fused) == 3
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fused_metrics["eval_loss"], plain_metrics["eval_loss"], atol=ATOL, rtol=RTOL)
    # the training step really ran through aotfuse: the compiled view is cached and has compiled programs
    fused_view = trainer.fused_model(trainer.model_wrapped)
    assert isinstance(fused_view, AOTModule)
    assert fused_view._aotfuse_compiled.compile_count >= 1
    # Trainer chooses label smoothing's label shift by this name: the compiled view answers the model's
    assert trainer.accelerator.unwrap_model(fused_view)._get_name() == "BertForMaskedLM"


def test_aot_trained_weights_match_plain(runs):
    _, plain_model, _, _ = runs["none"]
    _, fused_model, _, _ = runs["aot"]
    fused = dict(fused_model.named_parameters())
    for name, p in plain_model.named_parameters():
        torch.testing.assert_close(fused[name], p, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


def test_checkpoint_keys_are_the_plain_models(runs):
    plain_trainer, plain_model, _, _ = runs["none"]
    fused_trainer, _, _, _ = runs["aot"]
    assert not isinstance(fused_trainer.model, AOTModule)  # Trainer.model stays the PreTrainedModel
    for sub in ("", "checkpoint-3"):
        plain_keys = set(load_file(os.path.join(plain_trainer.args.output_dir, sub, "model.safetensors")))
        fused_keys = set(load_file(os.path.join(fused_trainer.args.output_dir, sub, "model.safetensors")))
        assert fused_keys == plain_keys, sub
        assert fused_keys <= set(plain_model.state_dict())
    # the checkpoint loads back into a plain model
    reloaded = BertForMaskedLM.from_pretrained(fused_trainer.args.output_dir)
    torch.testing.assert_close(reloaded.state_dict()["bert.embeddings.word_embeddings.weight"],
                               fused_trainer.model.state_dict()["bert.embeddings.word_embeddings.weight"])


def test_aot_with_an_attention_mask(tmp_path):
    """Tokenizers add an attention_mask (transformers' mask code branches on its values unless a
    compiler is tracing): the batches of a real Trainer run are captured, and match plain training."""
    losses = {}
    for fusion in ("none", "aot"):
        trainer = Trainer(model=_model(), args=_parse(tmp_path / fusion, "--fusion", fusion, "--max_steps", "2",
                                                      "--save_strategy", "no"),
                          train_dataset=_Random(8, 1, attention_mask=True))
        trainer.train()
        losses[fusion] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer.fused_model(trainer.model_wrapped)._aotfuse_compiled.compile_count >= 1
    torch.testing.assert_close(torch.tensor(losses["aot"]), torch.tensor(losses["none"]), atol=ATOL, rtol=RTOL)


def test_aot_with_bf16_mixed_precision(tmp_path):
    """--bf16 trains under CPU autocast: the fused run is captured under it and matches plain
    training within bfloat16's tolerance."""
    losses = {}
    for fusion in ("none", "aot"):
        args = _parse(tmp_path / fusion, "--fusion", fusion, "--max_steps", "2", "--save_strategy", "no", "--bf16")
        assert args.bf16
        trainer = Trainer(model=_model(), args=args, train_dataset=_Random(8, 1))
        trainer.train()
        losses[fusion] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    compiled = trainer.fused_model(trainer.model_wrapped)._aotfuse_compiled
    assert compiled.compile_count >= 1
    assert len(losses["aot"]) == len(losses["none"]) == 2
    torch.testing.assert_close(torch.tensor(losses["aot"]), torch.tensor(losses["none"]), atol=1e-2, rtol=1e-1)


def test_aot_with_gradient_checkpointing(tmp_path):
    """--gradient_checkpointing: the fused run recomputes each layer's linears in its backward (before,
    the regions were traced through and nothing of them recomputed) and trains like plain training."""
    losses = {}
    for fusion in ("none", "aot"):
        args = _parse(tmp_path / fusion, "--fusion", fusion, "--max_steps", "2", "--save_strategy", "no",
                      "--gradient_checkpointing")
        trainer = Trainer(model=_model(), args=args, train_dataset=_Random(8, 1))
        trainer.train()
        losses[fusion] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    compiled = trainer.fused_model(trainer.model_wrapped)._aotfuse_compiled
    assert compiled.last_entry is not None and compiled.last_entry.fallback is None
    recomputed = [n for r in compiled.records for n in r.recomputed if n.startswith(("mm", "addmm"))]
    assert len(recomputed) >= 12, [r.recomputed for r in compiled.records]  # 2 layers x 6 linears
    assert len(losses["aot"]) == len(losses["none"]) == 2
    torch.testing.assert_close(torch.tensor(losses["aot"]), torch.tensor(losses["none"]), atol=ATOL, rtol=RTOL)


def test_fusion_choices_are_enforced(tmp_path):
    with pytest.raises(SystemExit):
        _parse(tmp_path, "--fusion", "bogus")
    assert _parse(tmp_path).fusion == "none"
    with pytest.raises(ValueError, match="fusion"):
        TrainingArguments(output_dir=str(tmp_path), fusion="bogus", report_to="none")
    with pytest.raises(ValueError, match="alternatives"):
        TrainingArguments(output_dir=str(tmp_path), fusion="aot", torch_compile=True, report_to="none")
    assert _parse(tmp_path).fusion_fallback == "dynamo"
    assert _parse(tmp_path, "--fusion_fallback", "error").fusion_fallback == "error"
    with pytest.raises(SystemExit):
        _parse(tmp_path, "--fusion_fallback", "bogus")
    with pytest.raises(ValueError, match="fusion_fallback"):
        TrainingArguments(output_dir=str(tmp_path), fusion_fallback="bogus", report_to="none")


class _LayerDrop(torch.nn.Module):
    """A masked-LM-shaped toy with LayerDrop as BART, OPT and Whisper have it in training: each layer
    is skipped when `torch.rand([]) < layerdrop`, a branch on a tensor's value (no single graph where
    0 < layerdrop < 1; at 0, the configs' default, the capture answers the test: aotfuse/draws.py)."""

    def __init__(self, layerdrop: float = 0.0) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, VOCAB)
        self.layerdrop = layerdrop

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        h = self.emb(input_ids)
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            h = h + torch.tanh(layer(h))
        logits = self.head(h)
        return {"loss": torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1)), "logits": logits}


@pytest.mark.parametrize("layerdrop", [0.5, 0.0])
def test_a_model_with_layerdrop_trains_through_dynamo_by_default(tmp_path, layerdrop):
    """--fusion aot on a model that cannot be captured as one graph (LayerDrop that may skip layers)
    trains through torch.compile(backend="aotfuse") with one warning (--fusion_fallback dynamo, the
    default), and matches plain training, the same layers skipped; --fusion_fallback error raises
    CaptureError, naming the cause. At layerdrop 0 the model is one graph: no warning, no Dynamo."""
    import aotfuse

    losses = {}
    for fusion in ("none", "aot"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        trainer = Trainer(model=_LayerDrop(layerdrop), args=_parse(tmp_path / fusion, "--fusion", fusion, "--max_steps",
                                                                   "3", "--save_strategy", "no"),
                          train_dataset=_Random(12, 1))
        if fusion == "aot" and layerdrop:
            with pytest.warns(UserWarning, match=r"could not capture .*through torch.compile"):
                trainer.train()
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*could not capture")
                trainer.train()
        losses[fusion] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    compiled = trainer.fused_model(trainer.model_wrapped)._aotfuse_compiled
    assert (compiled._dynamo_fn is not None) == bool(layerdrop)  # the steps ran through the Dynamo fallback
    assert len(losses["aot"]) == len(losses["none"]) == 3
    torch.testing.assert_close(torch.tensor(losses["aot"]), torch.tensor(losses["none"]), atol=ATOL, rtol=RTOL)
    torch._dynamo.reset()
    if not layerdrop:
        return
    torch.manual_seed(0)
    trainer = Trainer(model=_LayerDrop(layerdrop), args=_parse(tmp_path / "error", "--fusion", "aot", "--fusion_fallback",
                                                               "error", "--max_steps", "1", "--save_strategy", "no"),
                      train_dataset=_Random(4, 1))
    with pytest.raises(aotfuse.CaptureError, match="_local_scalar_dense"):
        trainer.train()


def test_run_mlm_example(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("run_mlm", os.path.join(ROOT, "examples", "run_mlm.py"))
    run_mlm = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "run_mlm", run_mlm)  # its dataclasses look their module up
    spec.loader.exec_module(run_mlm)
    trainer = run_mlm.main(["--output_dir", str(tmp_path), "--fusion", "aot", "--max_steps", "6",
                            "--logging_steps", "3"])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert os.path.exists(tmp_path / "model.safetensors")
    assert isinstance(trainer.fused_model(trainer.model_wrapped), AOTModule)


class _Ragged(torch.utils.data.Dataset):
    """MLM examples of 4 to 16 tokens; the collator pads each batch to its longest."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(4, SEQ + 1, (n,), generator=g).tolist()
        self.items = [torch.randint(5, VOCAB, (n_tok,), generator=g) for n_tok in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.items[i]}


@pytest.mark.parametrize("way", ["torch.compile", "fusion aot"])
def test_dynamic_padding_trains_like_plain_training(tmp_path, way):
    """The Trainer on batches padded to their longest example, either way aotfuse runs under it:
    torch.compile(model, backend="aotfuse") as the model (a new sequence length makes Dynamo
    recompile with symbolic shapes, which aotfuse compiles per shape; it raised
    BackendCompilerFailed at the second length before), or `--fusion aot` (a signature per
    length). The losses match plain training. (accelerate's `--torch_compile_backend` takes only
    the backends it lists, not aotfuse.)"""
    shapes: set = set()

    def pad(batch: list) -> dict:
        n = max(len(b["input_ids"]) for b in batch)
        ids = torch.zeros(len(batch), n, dtype=torch.long)
        mask = torch.zeros(len(batch), n, dtype=torch.long)
        for i, b in enumerate(batch):
            ids[i, :len(b["input_ids"])] = b["input_ids"]
            mask[i, :len(b["input_ids"])] = 1
        labels = torch.where(mask.bool() & (torch.arange(n) % 3 == 0), ids, torch.full_like(ids, -100))
        shapes.add(n)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    losses = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        fusion = ("--fusion", "aot") if compiled and way == "fusion aot" else ()
        args = _parse(tmp_path / str(compiled), "--max_steps", "4", "--save_strategy", "no", "--remove_unused_columns", "false",
                      "--per_device_train_batch_size", "2", *fusion)
        model = torch.compile(_model(), backend="aotfuse") if compiled and way == "torch.compile" else _model()
        trainer = Trainer(model=model, args=args, train_dataset=_Ragged(16, 3), data_collator=pad)
        shapes.clear()
        trainer.train()
        losses[compiled] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if compiled and way == "fusion aot":  # none left to eager
            fused = trainer.fused_model(trainer.model_wrapped)._aotfuse_compiled
            # the first length traced on its own, the second made a shape family, the rest joined it
            members = sum(e.member for e in fused._cache.values())
            assert fused.compile_count == 2 and members == len(shapes) - 2, (fused.compile_count, members, shapes)
            # later lengths call the C kernel bodies earlier lengths compiled (kernel templates)
            later = [low.program for r in fused.records[1:] for low in r.programs.values()]
            assert sum(p.bodies_reused for p in later) > 0, [(p.bodies_reused, p.bodies_lifted) for p in later]
    torch._dynamo.reset()
    assert len(shapes) >= 3, shapes  # several padded lengths (under torch.compile, Dynamo goes dynamic)
    assert len(losses[True]) == len(losses[False]) == 4
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), atol=ATOL, rtol=RTOL)


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="this torch has no gloo process groups")
def test_aot_under_torchrun_trains_like_plain_ddp(tmp_path):
    """examples/run_mlm.py in two processes (torchrun, DistributedDataParallel over gloo), with and
    without --fusion aot, accumulating two micro-batches a step (accelerate's no_sync) and evaluating
    every two steps (the bare model's view, sharing the DDP view's programs): the same losses and the
    same saved weights, which a lost gradient all-reduce would change (each rank trains on its own half
    of every batch)."""
    runs = {}
    for fusion in ("none", "aot"):
        out = tmp_path / fusion
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             os.path.join(ROOT, "examples", "run_mlm.py"), "--output_dir", str(out), "--fusion", fusion,
             "--dropout", "0", "--max_steps", "4", "--logging_steps", "2", "--per_device_train_batch_size", "4",
             "--gradient_accumulation_steps", "2", "--eval_strategy", "steps", "--eval_steps", "2"],
            capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"--fusion {fusion} under torchrun failed:\n{proc.stderr[-6000:]}"
        summary = [line for line in proc.stdout.splitlines() if line.startswith(f"fusion={fusion}:")]
        assert len(summary) == 2, proc.stdout[-3000:]  # one line from each rank
        runs[fusion] = (summary[0], load_file(os.path.join(out, "model.safetensors")))
    assert "signatures compiled by aotfuse" in runs["aot"][0] and ", 0 signatures" not in runs["aot"][0]
    loss = {f: [float(x) for x in re.findall(r"loss (\d+\.\d+)", line)] for f, (line, _) in runs.items()}
    torch.testing.assert_close(torch.tensor(loss["aot"]), torch.tensor(loss["none"]), atol=ATOL, rtol=RTOL)
    plain, fused = runs["none"][1], runs["aot"][1]
    assert set(fused) == set(plain)
    for name, w in plain.items():
        torch.testing.assert_close(fused[name], w, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")
