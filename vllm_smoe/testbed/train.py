"""Tokenizer training and deterministic multi-domain MoE training on 2 CPU cores.

Determinism: fixed seeds, fixed step count, fixed thread count, batches drawn from a seeded
generator in a domain round-robin. (Bit-identical results across different CPUs are not
promised; the trained checkpoint is committed so tests never retrain.)
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from .corpus import DOMAINS, Split

SPECIAL = ("<|endoftext|>", "<|bos|>", "<|pad|>")


def train_tokenizer(split: Split, out_dir: str, vocab_size: int = 4096) -> str:
    """Byte-level BPE over equal shares of every domain's training text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [split.train[d][:1_000_000] for d in DOMAINS]
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIAL[0], bos_token=SPECIAL[1], pad_token=SPECIAL[2],
        model_max_length=1024,
    )
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir


def encode_domains(tokenizer_dir: str, texts: dict[str, str]) -> dict[str, np.ndarray]:
    """domain -> token ids, int32 [n]."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    return {d: np.asarray(tok(texts[d])["input_ids"], dtype=np.int32) for d in DOMAINS}


def _router_hooks(model):
    """Forward hooks on every MoE router that returns ``(logits, weights, indices)`` (DeepSeek's
    ``mlp.gate``), in layer order. Returns (routers, outputs): each output slot holds
    ``[logits [N, E] float32, indices [N, K] int64]`` of its router's latest forward."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    outputs: list[list] = [[None, None] for _ in routers]
    for module, slot in zip(routers, outputs):
        def hook(mod, args, out, slot=slot):
            slot[0], slot[1] = out[0], out[2]

        module.register_forward_hook(hook)
    return routers, outputs


def _switch_loss(logits, indices, num_experts: int):
    """Switch-style load-balancing loss of one layer: E * sum_e share_of_assignments_e * mean_prob_e."""
    import torch

    probs = torch.softmax(logits.float(), dim=-1)
    share = torch.bincount(indices.reshape(-1), minlength=num_experts).float() / indices.numel()
    return num_experts * (share * probs.mean(dim=0)).sum()


def _bias_update(routers, outputs, num_experts: int, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: each router's ``e_score_correction_bias``
    moves by ``rate`` towards the experts that received fewer than the mean assignments."""
    import torch

    with torch.no_grad():
        for gate, (_, idx) in zip(routers, outputs):
            load = torch.bincount(idx.reshape(-1), minlength=num_experts).float()
            gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


def train_model(split: Split, tokenizer_dir: str, out_dir: str, steps: int = 1200, batch: int = 16,
                seq_len: int = 128, lr: float = 3e-3, seed: int = 0, threads: int = 2,
                log_every: int = 50, arch: str = "qwen3_moe", aux_loss_coef: float = 0.01,
                bias_rate: float = 0.005, num_experts: int | None = None,
                top_k: int | None = None) -> dict[str, float]:
    """Train a tiny MoE of ``arch`` on the four domains with its router's balancing; save to ``out_dir``.

    Sizes are ``models.TINY``'s (those of the shipped fixtures); ``num_experts`` and ``top_k``
    replace its routed experts and experts per token where given.

    Balancing: Qwen3-MoE adds transformers' own load-balancing loss (``output_router_logits``);
    DeepSeek-V2 the same Switch-style loss computed from its routers' outputs (transformers'
    DeepSeek-V2 computes none); DeepSeek-V3 moves the routers' ``e_score_correction_bias`` after
    every step (its auxiliary-loss-free method; no loss term).
    """
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from .models import TINY, make_config

    sizes = {k: v for k, v in TINY.items() if k != "vocab_size"}
    sizes.update({k: v for k, v in (("num_experts", num_experts), ("top_k", top_k)) if v is not None})
    if not 1 <= sizes["top_k"] <= sizes["num_experts"]:
        raise ValueError(f"top-k {sizes['top_k']} must be between 1 and the {sizes['num_experts']} experts")
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    ids = encode_domains(tokenizer_dir, split.train)
    cfg = make_config(arch, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, **sizes)
    if arch == "qwen3_moe":
        cfg.output_router_logits = True  # adds router_aux_loss_coef * load-balancing loss to .loss
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    routers, outputs = _router_hooks(model) if arch.startswith("deepseek") else ([], [])
    E = sizes["num_experts"]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    rng = np.random.default_rng(seed)
    model.train()
    t0 = time.time()
    last: dict[str, float] = {}
    from tqdm import tqdm

    bar = tqdm(range(steps), desc=f"train {arch}", unit="step", mininterval=5)
    for step in bar:
        rows = []
        for b in range(batch):
            arr = ids[DOMAINS[(step * batch + b) % len(DOMAINS)]]
            s = int(rng.integers(0, len(arr) - seq_len - 1))
            rows.append(arr[s: s + seq_len])
        x = torch.from_numpy(np.stack(rows).astype(np.int64))
        out = model(input_ids=x, labels=x)
        loss = out.loss
        if arch == "qwen3_moe":
            aux = out.aux_loss
        elif arch == "deepseek_v2":
            aux = torch.stack([_switch_loss(lg, ix, E) for lg, ix in outputs]).mean()
            loss = loss + aux_loss_coef * aux
        else:  # the switch loss is only reported: V3 balances by its bias
            with torch.no_grad():
                aux = torch.stack([_switch_loss(lg, ix, E) for lg, ix in outputs]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if arch == "deepseek_v3":
            _bias_update(routers, outputs, E, bias_rate)
        if step % log_every == 0 or step == steps - 1:
            last = {"step": step, "loss": float(out.loss.detach()), "aux_loss": float(aux.detach()), "seconds": time.time() - t0}
            bar.set_postfix(loss=f"{last['loss']:.3f}", aux=f"{last['aux_loss']:.3f}")
    model.config.output_router_logits = False
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return last
