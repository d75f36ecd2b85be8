"""Helpers to build paged copies of contiguous caches and read paged caches back (host-side indexing)."""
from __future__ import annotations

import torch


def random_block_table(n_req: int, capacity: int, page_size: int) -> tuple[torch.Tensor, int]:
    pages_per_req = -(-capacity // page_size)
    num_pages = n_req * pages_per_req + 3
    table = torch.randperm(num_pages)[: n_req * pages_per_req].view(n_req, pages_per_req)
    return table.to(torch.int32), num_pages


def paged_view(paged: torch.Tensor, table: torch.Tensor, capacity: int) -> torch.Tensor:
    """[..., num_pages, page_size, kvH, D] + table [N, P] -> [..., N, capacity, kvH, D] (a copy)."""
    page_size = paged.shape[-3]
    t = torch.arange(capacity)
    pages = table.to(torch.int64)[:, t // page_size]              # [N, capacity]
    return paged[..., pages, t % page_size, :, :]


def to_paged(contig: torch.Tensor, table: torch.Tensor, num_pages: int, page_size: int) -> torch.Tensor:
    """[N, capacity, kvH, D] -> [num_pages, page_size, kvH, D] holding the same rows; unused slots NaN."""
    n, cap, kvh, d = contig.shape
    out = torch.full((num_pages, page_size, kvh, d), float("nan"), dtype=contig.dtype)
    t = torch.arange(cap)
    pages = table.to(torch.int64)[:, t // page_size]
    out[pages, t % page_size] = contig
    return out
