"""Masked language modeling with the Hugging Face Trainer, trained through aotfuse with `--fusion aot`.

Everything is local: a small BertForMaskedLM built from a config (random weights), a word-level tokenizer
built from the training file, and the text file under examples/data/. Runs in seconds on a CPU:

    python examples/run_mlm.py --output_dir /tmp/mlm --fusion aot
    python examples/run_mlm.py --output_dir /tmp/mlm --fusion none      # the same run without aotfuse
    torchrun --nproc_per_node 2 examples/run_mlm.py --output_dir /tmp/mlm --fusion aot   # DDP, 2 processes

Any transformers TrainingArguments flag works (--max_steps, --learning_rate, --per_device_train_batch_size...).
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import time

import torch
from transformers import BertConfig, BertForMaskedLM, HfArgumentParser

from aotfuse.hf import Trainer, TrainingArguments

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@dataclasses.dataclass
class ModelArguments:
    train_file: str = dataclasses.field(default=os.path.join(HERE, "data", "tiny_corpus.txt"),
                                        metadata={"help": "a plain text file, one or more sentences a line"})
    block_size: int = dataclasses.field(default=32, metadata={"help": "tokens per training example"})
    mlm_probability: float = dataclasses.field(default=0.15, metadata={"help": "share of tokens to predict"})
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    dropout: float = dataclasses.field(default=0.1, metadata={"help": "hidden and attention dropout"})
    validation_split: float = dataclasses.field(default=0.1, metadata={"help": "share of blocks held out"})


class WordTokenizer:
    """Lower-cased words and punctuation; the vocabulary is every token of the training text."""

    def __init__(self, text: str) -> None:
        words = sorted(set(self.split(text)))
        self.vocab = {tok: i for i, tok in enumerate(SPECIAL + words)}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = range(len(SPECIAL))

    @staticmethod
    def split(text: str) -> list[str]:
        return re.findall(r"[a-z0-9]+|[^\sa-z0-9]", text.lower())

    def encode(self, line: str) -> list[int]:
        return [self.cls_id] + [self.vocab.get(w, self.unk_id) for w in self.split(line)] + [self.sep_id]

    def __len__(self) -> int:
        return len(self.vocab)


def make_blocks(path: str, tokenizer: WordTokenizer, block_size: int) -> list[torch.Tensor]:
    """Encodes every line, concatenates and cuts into equal blocks (the last partial block is dropped),
    as transformers' run_mlm.py does with group_texts: one shape for every batch, no padding."""
    with open(path, encoding="utf-8") as f:
        ids = [i for line in f if line.strip() for i in tokenizer.encode(line)]
    n = len(ids) // block_size
    return [torch.tensor(ids[k * block_size:(k + 1) * block_size]) for k in range(n)]


class MaskingCollator:
    """BERT masking: mlm_probability of the tokens are predicted; of those 80% become [MASK], 10% a random
    token, 10% stay. Labels are -100 elsewhere. Uses torch's global RNG (seeded by the Trainer)."""

    def __init__(self, tokenizer: WordTokenizer, mlm_probability: float) -> None:
        self.tok = tokenizer
        self.p = mlm_probability

    def __call__(self, blocks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        input_ids = torch.stack([b["input_ids"] for b in blocks])
        labels = input_ids.clone()
        special = input_ids < len(SPECIAL)
        chosen = torch.bernoulli(torch.full(input_ids.shape, self.p)).bool() & ~special
        labels[~chosen] = -100
        masked = torch.bernoulli(torch.full(input_ids.shape, 0.8)).bool() & chosen
        input_ids = input_ids.masked_fill(masked, self.tok.mask_id)
        randomized = torch.bernoulli(torch.full(input_ids.shape, 0.5)).bool() & chosen & ~masked
        random_ids = torch.randint(len(SPECIAL), len(self.tok), input_ids.shape)
        input_ids = torch.where(randomized, random_ids, input_ids)
        return {"input_ids": input_ids, "labels": labels}


class BlockDataset(torch.utils.data.Dataset):
    def __init__(self, blocks: list[torch.Tensor]) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i]}


def build(margs: ModelArguments, targs: TrainingArguments) -> Trainer:
    """The tokenizer, data, model and Trainer for these arguments."""
    with open(margs.train_file, encoding="utf-8") as f:
        tokenizer = WordTokenizer(f.read())
    blocks = make_blocks(margs.train_file, tokenizer, margs.block_size)
    n_eval = max(1, int(len(blocks) * margs.validation_split))
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=margs.hidden_size,
                        num_hidden_layers=margs.num_hidden_layers, num_attention_heads=margs.num_attention_heads,
                        intermediate_size=4 * margs.hidden_size, max_position_embeddings=margs.block_size,
                        hidden_dropout_prob=margs.dropout, attention_probs_dropout_prob=margs.dropout,
                        pad_token_id=tokenizer.pad_id)
    torch.manual_seed(targs.seed)
    model = BertForMaskedLM(config)
    return Trainer(model=model, args=targs, train_dataset=BlockDataset(blocks[n_eval:]),
                   eval_dataset=BlockDataset(blocks[:n_eval]),
                   data_collator=MaskingCollator(tokenizer, margs.mlm_probability))


def main(argv: list[str] | None = None) -> Trainer:
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    defaults = ["--max_steps", "60", "--per_device_train_batch_size", "8", "--learning_rate", "1e-3",
                "--logging_steps", "10", "--save_strategy", "no", "--report_to", "none",
                "--use_cpu", "true"]
    margs, targs = parser.parse_args_into_dataclasses(defaults + list(sys.argv[1:] if argv is None else argv))
    trainer = build(margs, targs)
    start = time.perf_counter()
    result = trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()
    compiled = ""
    if targs.fusion == "aot":
        view = trainer.fused_model(trainer.model)  # under torchrun its DDP's view shares its programs
        compiled = f", {view._aotfuse_compiled.compile_count} signatures compiled by aotfuse"
    print(f"fusion={targs.fusion}: {result.global_step} steps in {time.perf_counter() - start:.1f} s, "
          f"train loss {result.training_loss:.4f}, eval loss {metrics['eval_loss']:.4f}{compiled}; "
          f"model saved to {targs.output_dir}")
    return trainer


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # under torchrun: every rank done, then a clean teardown
        dist.barrier()  # (a rank leaving while another still saves aborted at exit, now and then, in gloo)
        dist.destroy_process_group()
