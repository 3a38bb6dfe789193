"""Batched sampling of one next token per row, with the log-prob under the distribution sampled from.

Per row: temperature 0 is greedy (log-prob = log-softmax of the raw logits); otherwise the logits are
divided by the temperature, masked by top-k then top-p (on the renormalised top-k distribution, as
vLLM does), and one token is drawn by the exponential race argmax(p / E), E ~ Exp(1); its log-prob is
the log-softmax of the masked, scaled logits (a run keeps top-k and top-p off, so its behaviour log-probs
are log softmax(logits / T), what the trainer recomputes). Rows with their own generator (a request
seed) draw their noise from it, so a seeded request samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollart_hpc.contracts.generation import SamplingParams


def _top_k_top_p_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Scaled logits with tokens outside each row's top-k / top-p set at -inf."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)[None, :]
    keep = ranks < torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    keep = keep & (before < top_p[:, None])
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)


def _exponential_noise(
    shape: tuple[int, int], generators: Sequence[torch.Generator | None], default: torch.Generator
) -> torch.Tensor:
    noise = torch.empty(shape).exponential_(generator=default)
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return noise


def _sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    scaled = logits / temps[:, None]
    top_k = torch.tensor([p.top_k for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        scaled = _top_k_top_p_mask(scaled, top_k, top_p)
    logp = scaled.log_softmax(dim=-1)
    noise = _exponential_noise((logits.shape[0], logits.shape[1]), generators, default)
    tokens = (logp.exp() / noise).argmax(dim=-1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default: torch.Generator,
) -> tuple[list[int], list[float]]:
    """One token and its log-prob per row of float32 `logits` [B, V]."""
    tokens = torch.empty(logits.shape[0], dtype=torch.long)
    logprobs = torch.empty(logits.shape[0], dtype=logits.dtype)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    sampled = [i for i, p in enumerate(params) if p.temperature != 0]
    if greedy:
        rows = logits[greedy]
        tok = rows.argmax(dim=-1)
        tokens[greedy] = tok
        logprobs[greedy] = rows.log_softmax(dim=-1).gather(1, tok[:, None]).squeeze(1)
    if sampled:
        tok, lp = _sample_rows(
            logits[sampled], [params[i] for i in sampled], [generators[i] for i in sampled], default
        )
        tokens[sampled] = tok
        logprobs[sampled] = lp
    return tokens.tolist(), logprobs.tolist()
