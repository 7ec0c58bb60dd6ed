"""Fine-tune with the Hugging Face Trainer, the playbook's kernels on: for users whose code already uses it.

    $ python finetune_trainer.py --model meta-llama/Llama-3.1-8B --dataset examples/chat.jsonl --steps 200
    $ python finetune_trainer.py --dataset examples/chat.jsonl --steps 30 --lr 1e-3     # CPU: llama-tiny
    $ python finetune_trainer.py --kernels none ...                                    # the Trainer alone

The whole integration is one call before the Trainer is built, the same preparation every script
of the playbook makes (kernels, FP8, gradient checkpointing, LoRA, compile; see models.prepare_model):

    model, name, desc, report = prepare_model(cfg, shard=False)   # the Trainer runs the processes

The Trainer passes `labels` (and, under gradient accumulation, `num_items_in_batch`) to the model,
so its loss goes through the fused linear cross-entropy: the [tokens, vocab] logits are never built.
The same works for TRL's SFTTrainer, which calls the model the same way. Multi-GPU: launch this
script with `accelerate launch` or `torchrun`; the Trainer sets up the processes.
"""

from __future__ import annotations

import torch

from playbook import kernel_utils  # noqa: F401  (before anything imports triton: the interpreter switch on CPUs)

from playbook.registry import DEFAULT_KERNELS
from playbook.common import log
from playbook.config import make_parser, parse_config


class RowsDataset(torch.utils.data.Dataset):
    """Encoded examples, one per row, padded to the run's sequence length (labels -100 on padding)."""

    def __init__(self, rows: dict):
        self.rows = rows

    def __len__(self):
        return self.rows["input_ids"].shape[0]

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.rows.items()}


def build_datasets(cfg, tokenizer):
    from playbook.data import encode_rows, load_rows, pad_examples

    rows = load_rows(cfg.dataset)
    examples, report = encode_rows(rows, tokenizer, cfg.seq_len, cfg.train_on_prompt, source=cfg.dataset)
    if len(examples) < 2:
        log(f"Data: {report}")
        raise SystemExit(f"error: {cfg.dataset}: {len(examples)} usable example(s); the Trainer needs at least 2")
    g = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(len(examples), generator=g).tolist()
    n_eval = max(1, int(cfg.eval_fraction * len(examples))) if cfg.eval_fraction else 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pick = lambda idx: RowsDataset(pad_examples([examples[i] for i in idx], cfg.seq_len, pad))  # noqa: E731
    report.train_examples, report.eval_examples = len(order) - n_eval, n_eval
    log(f"Data: {report}")  # rows kept and dropped, by reason, and the split
    log(f"Split: {len(order) - n_eval} training and {n_eval} held-out examples, one per row of {cfg.seq_len} tokens")
    return pick(order[n_eval:]), (pick(order[:n_eval]) if n_eval else None)


def main(argv=None):
    from transformers import Trainer, TrainingArguments

    from playbook.models import prepare_model
    from playbook.training import run_tokenizer

    parser = make_parser(__doc__.splitlines()[0], kernels_default=DEFAULT_KERNELS)
    cfg = parse_config(parser, "finetune_trainer", argv)
    if cfg.dataset is None:
        raise SystemExit("error: finetune_trainer.py needs --dataset (a .jsonl / .json / .parquet file or a hub id)")
    model, name, desc, report = prepare_model(cfg, shard=False)  # the Trainer sets up and wraps the processes
    tokenizer = run_tokenizer(cfg, name)
    train_set, eval_set = build_datasets(cfg, tokenizer)
    out = cfg.output_dir or "out/trainer"  # the Trainer needs a folder; out/ is not committed
    args = TrainingArguments(
        output_dir=str(out), max_steps=cfg.steps or -1, num_train_epochs=cfg.epochs or 1,
        per_device_train_batch_size=cfg.batch_size, per_device_eval_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum, learning_rate=cfg.lr, weight_decay=cfg.weight_decay,
        lr_scheduler_type=cfg.lr_schedule if cfg.lr_schedule != "constant" else "constant_with_warmup",
        warmup_steps=cfg.lr_warmup_steps, max_grad_norm=cfg.max_grad_norm or 0.0, logging_steps=cfg.log_every,
        save_strategy="steps" if cfg.save_every else "no", save_steps=cfg.save_every or 500,
        eval_strategy="steps" if eval_set is not None and cfg.eval_every else "no", eval_steps=cfg.eval_every or None,
        bf16=cfg.on_gpu, use_cpu=not cfg.on_gpu, report_to=[] if cfg.report_to == "none" else [cfg.report_to],
        # every trainable parameter gets a gradient in every step (frozen LoRA bases need none), so
        # DDP's search for unused parameters (the Trainer's default) would only add a graph walk
        ddp_find_unused_parameters=False,
        seed=cfg.seed, disable_tqdm=True, optim="adamw_torch_fused" if cfg.optimizer == "adamw-fused" else "adamw_torch",
    )
    if cfg.warmup_ratio:
        args.warmup_steps = int(cfg.warmup_ratio * (cfg.steps or 0))
    trainer = Trainer(model=model, args=args, train_dataset=train_set, eval_dataset=eval_set)
    log(f"Trainer: {desc}, kernels {report.describe()}, {len(train_set)} training rows, "
        f"{args.world_size} process{'es' if args.world_size > 1 else ''}")
    result = trainer.train(resume_from_checkpoint=str(cfg.resume) if cfg.resume else None)
    metrics = dict(result.metrics)
    if eval_set is not None:
        metrics.update(trainer.evaluate())
    log("Trainer metrics: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in metrics.items()))
    if cfg.output_dir is not None:
        trainer.save_model(str(cfg.output_dir / "final"))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(cfg.output_dir / "final"))
        log(f"Saved {cfg.output_dir / 'final'} (safetensors; AutoModelForCausalLM.from_pretrained loads it)")
    return trainer, metrics


if __name__ == "__main__":
    from playbook.setup_check import check_or_exit

    check_or_exit()
    main()
