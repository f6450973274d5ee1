"""pytorch/torchtitan ``torchtitan/models/moe/moe.py``: token-choice top-k routing, the
(token, expert) pairs sorted by expert with ``argsort``, counted with ``histc``, run per expert
on ``split`` pieces and added back with ``scatter_add``; in the llama3 model of tests/zoo_repos/llama.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo_repos.llama import TitanArgs, TitanAttention, TitanLlama3


def _run_experts_for_loop(w1, w2, w3, x, num_tokens_per_expert):
    # NOTE: this would incur a synchronization between device and host
    num_tokens_per_expert = num_tokens_per_expert.tolist()
    # side-effect code due to the usage of generate_permute_indices
    num_padding = x.shape[0] - sum(num_tokens_per_expert)
    # a tuple of tensors indexed by experts, each with shape (tokens_per_expert(varying), dim)
    x = torch.split(x[: sum(num_tokens_per_expert)], split_size_or_sections=num_tokens_per_expert, dim=0)
    out_experts_splits = []
    for expert_idx, x_expert in enumerate(x):
        h = F.silu(torch.matmul(x_expert, w1[expert_idx].transpose(-2, -1)))
        h = h * torch.matmul(x_expert, w3[expert_idx].transpose(-2, -1))
        h = torch.matmul(h, w2[expert_idx].transpose(-2, -1))
        out_experts_splits.append(h)
    out = torch.cat(out_experts_splits, dim=0)
    # side-effect code due to the usage of generate_permute_indices
    return torch.vstack((out, out.new_zeros((num_padding, out.shape[-1]))))


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) * 0.1)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) * 0.1)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) * 0.1)

    def forward(self, x, num_tokens_per_expert):
        return _run_experts_for_loop(self.w1, self.w2, self.w3, x, num_tokens_per_expert)


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, route_norm: bool = True, route_scale: float = 1.0):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.route_norm, self.route_scale = route_norm, route_scale

    def forward(self, x, expert_bias=None):
        scores = F.softmax(self.gate(x), dim=1)  # torchtitan: in float32
        if expert_bias is not None:
            _, selected_experts_indices = torch.topk(scores + expert_bias, k=self.top_k, dim=1)
            top_scores = scores.gather(dim=1, index=selected_experts_indices)
        else:
            top_scores, selected_experts_indices = torch.topk(scores, k=self.top_k, dim=1)
        if self.route_norm:
            denominator = top_scores.sum(dim=-1, keepdim=True) + 1e-20
            top_scores = top_scores / denominator
        top_scores = top_scores * self.route_scale
        num_tokens_per_expert = torch.histc(selected_experts_indices.view(-1).float(), bins=self.num_experts, min=0,
                                            max=self.num_experts)
        return top_scores, selected_experts_indices, num_tokens_per_expert


class TokenReorderer(nn.Module):
    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, top_scores, selected_experts_indices):
        num_tokens_per_expert = torch.histc(selected_experts_indices.view(-1).float(), bins=self.num_experts, min=0,
                                            max=self.num_experts).to(torch.int64)
        token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        token_indices_experts_sorted = token_indices_experts_sorted // self.top_k
        return top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert


class TitanMoE(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int = 4, top_k: int = 2, count_tokens: bool = True,
                 score_before_experts: bool = False):
        super().__init__()
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k)
        self.reorderer = TokenReorderer(num_experts, top_k)
        self.shared_experts = nn.Sequential(nn.Linear(dim, hidden_dim, bias=False), nn.SiLU(),
                                            nn.Linear(hidden_dim, dim, bias=False))
        self.score_before_experts = score_before_experts
        self.count_tokens = count_tokens
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)

    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(x, self.expert_bias)
        if self.count_tokens:
            with torch.no_grad():
                self.tokens_per_expert.add_(num_tokens_per_expert)
        top_scores_experts_sorted, token_indices_experts_sorted, num_tokens_per_expert = self.reorderer(
            top_scores, selected_experts_indices)
        token_indices_experts_sorted = token_indices_experts_sorted.reshape(-1, 1).expand(-1, dim)
        routed_input = torch.gather(x, dim=0, index=token_indices_experts_sorted)
        if self.score_before_experts:
            routed_input = routed_input * top_scores_experts_sorted.reshape(-1, 1)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        out = self.shared_experts(x)
        if not self.score_before_experts:
            routed_output = routed_output * top_scores_experts_sorted.reshape(-1, 1)
        out = out.scatter_add(dim=0, index=token_indices_experts_sorted, src=routed_output)
        return out.reshape(bs, slen, dim)


class TitanMoEBlock(nn.Module):
    def __init__(self, model_args: TitanArgs, **moe):
        super().__init__()
        self.attention = TitanAttention(model_args)
        self.moe = TitanMoE(model_args.dim, 2 * model_args.dim, **moe)
        self.attention_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.moe(self.ffn_norm(h))


class TitanMoELM(TitanLlama3):
    """torchtitan's MoE (``moe.py`` at commit 003edbe5, 2025) in its llama3 decoder: the router's
    ``histc`` count added to the ``tokens_per_expert`` buffer in every forward (auxiliary-loss-free
    load balancing), ``TokenReorderer``'s ``argsort(stable=True)`` of the flattened expert indices,
    ``gather`` of the token rows, ``GroupedExperts`` on its for-loop path (``num_tokens_per_expert.tolist()``
    ``split`` sizes, ``cat``, ``vstack`` of zero padding), a shared expert and ``scatter_add``.
    ``histc`` of int64 runs on CUDA only: its input is cast to float here, and the reorderer's count to
    int64 for ``split`` (as torchtitan wrote it until 2025). Left out: ``grouped_mm`` and expert parallelism, the float32 casts of the router and the scores
    (a float64 model compares in float64), ``init_weights``. ``count_tokens=False`` leaves out the
    ``tokens_per_expert`` update (not an option of torchtitan's)."""

    def __init__(self, count_tokens: bool = True, score_before_experts: bool = False):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): TitanMoEBlock(self.model_args, count_tokens=count_tokens,
                                                           score_before_experts=score_before_experts)
                                     for i in range(self.model_args.n_layers)})
