"""The tiny GPT-2-like model and the synthetic data shared by the framework examples
(hf_trainer_scape.py, accelerate_scape.py, plain_loop_scape.py). Built in code: nothing is
downloaded (run with HF_HUB_OFFLINE=1).

The data are token sequences from a small deterministic "language": each sequence repeats a
random motif of 3 to 6 tokens with a little noise, so a 2-layer model learns it in a few
hundred steps on a CPU and the loss has room to fall.
"""
from __future__ import annotations

import hashlib
from typing import Dict, List

import torch

VOCAB = 64
SEQ = 32


def tiny_gpt2(seed: int = 0, n_layer: int = 2, n_embd: int = 64):
    """A GPT-2 with 2 layers, 2 heads, width 64, vocabulary 64, context 32 (about 110k
    parameters), no dropout (so that runs are deterministic)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=n_embd, n_layer=n_layer,
                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


class MotifDataset(torch.utils.data.Dataset):
    """`n` sequences of SEQ tokens: a motif repeated, 5% of tokens replaced by noise."""

    def __init__(self, n: int = 2048, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        rows: List[torch.Tensor] = []
        for _ in range(n):
            k = int(torch.randint(3, 7, (1,), generator=g))
            motif = torch.randint(1, VOCAB, (k,), generator=g)
            row = motif.repeat(SEQ // k + 1)[:SEQ].clone()
            noise = torch.rand(SEQ, generator=g) < 0.05
            row[noise] = torch.randint(1, VOCAB, (int(noise.sum()),), generator=g)
            rows.append(row)
        self.rows = torch.stack(rows)

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        r = self.rows[i]
        return {"input_ids": r, "labels": r}


def param_hash(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters (compare across ranks and runs)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def all_equal_over(comm, text: str) -> bool:
    """Whether `text` (a hex digest) is the same on every rank, over the SCAPE communicator."""
    mine = torch.tensor([int(text[i:i + 6], 16) for i in range(0, 60, 6)], dtype=torch.int32)
    every = torch.zeros(comm.size * mine.numel(), dtype=torch.int32)
    comm.all_gather(mine, every)
    return bool((every.view(comm.size, -1) == mine).all())
