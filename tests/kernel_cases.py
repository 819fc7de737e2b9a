"""Kernel test cases shared by the CPU and Triton kernel tests.

Paged KV with shuffled page ids, and adapters of mixed ranks laid out in pool pages as
``lora/layout.py`` does (stacked A rows, then B^T per module, modules absent in some
adapters), on consecutive pages or scattered ones, under Punica's adapter popularity patterns.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from loraserve.kernels.lora import lora_reference

from loraserve.lora.layout import aligned

# (x, outputs, storage [L, P, E], layer, group, bounds, page_tables, meta [L, G, S, 14], scales [L, G, S, 3])
SegmentsKernel = Callable[..., None]


def make_paged(
    lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages with random K/V and block tables on shuffled page ids, padded with page 0."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_pages = sum(blocks) + 5
    kv = torch.randn(num_pages, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_pages, generator=gen).tolist()
    tables, used = [], 0
    for count in blocks:
        tables.append(ids[used : used + count] + [0] * (max(blocks) - count))
        used += count
    return kv, torch.tensor(tables, dtype=torch.long)


# (num_heads, num_kv_heads, head_dim, block_size) per decode-attention case, and their ids
ATTENTION_CASES = [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 16, 4), (6, 2, 24, 16)]
ATTENTION_IDS = ["gqa3", "mha", "mqa", "head-dim-24"]


def decode_case(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``(query, kv, block_tables, context_lens, scale)``: contexts of 1 token, exact multiples of
    the block size and not, on shuffled pages with padded block tables."""
    lens = [1, block_size, block_size + 1, 3 * block_size, 77, 2]
    kv, tables = make_paged(lens, num_kv_heads, head_dim, block_size, torch.float32, seed=num_heads)
    query = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    return query, kv, tables, torch.tensor(lens), head_dim**-0.5


HIDDEN, OUTS = 48, (48, 16, 16)  # a q/k/v-like group: three outputs of one input
NUM_ADAPTERS, BS, PAGE_ELEMS, NUM_LAYERS = 12, 29, 256, 2


def random_adapters(
    seed: int, hidden: int = HIDDEN, outs: tuple[int, ...] = OUTS
) -> list[list[tuple[torch.Tensor, torch.Tensor, float] | None]]:
    """Per adapter, per module: (A [r, in], B [out, r], scale) or None (module not adapted)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    adapters = []
    for i in range(NUM_ADAPTERS):
        modules: list[tuple[torch.Tensor, torch.Tensor, float] | None] = []
        for m, out in enumerate(outs):
            if i % 4 == 3 and m == 1:
                modules.append(None)  # some adapters do not target every module
                continue
            rank = rng.choice([1, 4, 8, 16, 33, 64])
            a = torch.randn(rank, hidden, generator=gen) / math.sqrt(hidden)
            b = torch.randn(out, rank, generator=gen) / math.sqrt(rank)
            modules.append((a, b, rng.uniform(0.25, 2.0)))
        adapters.append(modules)
    return adapters


def pack(
    adapters: list, scattered: bool, seed: int, outs: tuple[int, ...] = OUTS
) -> tuple[torch.Tensor, list[list[int]], torch.Tensor]:
    """Lay adapters out in storage ``[L, P, E]`` as lora/layout.py does (layer l holds weights * (l + 1);
    the padding before an aligned B^T is NaN, so a kernel that reads it fails the check).

    Each adapter gets consecutive pages, or (``scattered``) pages in shuffled order across the
    pool. Returns the storage, each adapter's page ids and ``meta [L, 1, NUM_ADAPTERS, 14]``.
    """
    flats, metas = [], []
    for modules in adapters:
        a_rows = [mod[0] for mod in modules if mod is not None]
        flat, meta, column = [torch.cat(a_rows).reshape(-1)], [0, sum(a.shape[0] for a in a_rows)], 0
        offset = flat[0].numel()
        for mod, out in zip(modules, outs, strict=True):
            if mod is None:
                meta += [0, 0, 0, 0]
                continue
            rank = mod[0].shape[0]
            start = aligned(offset, out)  # B^T placed as lora/layout.py places it
            meta += [column, rank, start, out]
            flat += [torch.full((start - offset,), float("nan")), mod[1].T.reshape(-1)]
            column, offset = column + rank, start + rank * out
        flats.append(torch.cat(flat))
        metas.append(meta)
    counts = [-(-flat.numel() // PAGE_ELEMS) for flat in flats]
    num_pages = sum(counts) + 1  # page 0 stays unused
    ids = list(range(1, num_pages))
    if scattered:
        random.Random(seed).shuffle(ids)
    page_ids, used = [], 0
    for count in counts:
        page_ids.append(ids[used : used + count])
        used += count
    storage = torch.full((NUM_LAYERS, num_pages, PAGE_ELEMS), float("nan"))
    for layer in range(NUM_LAYERS):
        for flat, pages in zip(flats, page_ids, strict=True):
            padded = torch.full((len(pages) * PAGE_ELEMS,), float("nan"))
            padded[: flat.numel()] = flat * (layer + 1)
            storage[layer, pages] = padded.view(len(pages), PAGE_ELEMS)
    meta = torch.tensor(metas, dtype=torch.long)[None, None].expand(NUM_LAYERS, 1, -1, -1).contiguous()
    return storage, page_ids, meta


def run_segments(
    kernel: SegmentsKernel,
    indices: list[int],
    seed: int,
    scattered: bool,
    layer: int,
    hidden: int = HIDDEN,
    outs: tuple[int, ...] = OUTS,
    atol: float = 1e-5,
    dtype: torch.dtype = torch.float32,
    v_dtype: torch.dtype = torch.float32,
) -> None:
    """Run ``kernel`` on one batch of adapter ``indices`` (-1: base model) and check every output
    against ``lora_reference``; base-model rows must come back bit for bit. x, the weights and the
    base outputs are representable in ``dtype``, the kernel's working dtype: the reference (float32)
    then differs from an exact kernel only by the order of additions and the outputs' rounding
    (and, for a kernel that rounds v to ``v_dtype`` before the expand, by that rounding: the reference
    rounds it too)."""
    adapters = [
        [None if m is None else (m[0].to(dtype).float(), m[1].to(dtype).float(), m[2]) for m in modules]
        for modules in random_adapters(seed, hidden, outs)
    ]
    storage, page_ids, meta_all = pack(adapters, scattered, seed, outs)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(len(indices), hidden, generator=gen).to(dtype).float()
    bases = [torch.randn(len(indices), out, generator=gen).to(dtype).float() for out in outs]
    runs = []  # (start, end, adapter) per run of one adapter, base-model runs dropped
    start = 0
    for t in range(1, len(indices) + 1):
        if t == len(indices) or indices[t] != indices[start]:
            if indices[start] >= 0:
                runs.append((start, t, indices[start]))
            start = t
    if scattered:
        bounds = torch.tensor([(s, e, 1, 0) for s, e, _ in runs], dtype=torch.long)
    else:
        bounds = torch.tensor([(s, e, 0, page_ids[i][0] * PAGE_ELEMS) for s, e, i in runs], dtype=torch.long)
    width = max(len(pages) for pages in page_ids)
    tables = torch.tensor([page_ids[i] + [0] * (width - len(page_ids[i])) for _, _, i in runs], dtype=torch.long)
    tables = tables.view(len(runs), width)
    meta = meta_all[:, :, [i for _, _, i in runs]].contiguous()
    scales = torch.tensor([[0.0 if m is None else m[2] for m in adapters[i]] for _, _, i in runs])
    scales = scales[None, None].expand(NUM_LAYERS, 1, -1, -1).contiguous()
    outputs = tuple(base.clone() for base in bases)
    if runs:
        kernel(x, outputs, storage, layer, 0, bounds, tables, meta, scales)
    for m, (base, out) in enumerate(zip(bases, outputs, strict=True)):
        has = [adapter[m] is not None for adapter in adapters]
        per_module = torch.tensor([i if i >= 0 and has[i] else -1 for i in indices])
        dummy = (torch.zeros(1, hidden), torch.zeros(outs[m], 1), 0.0)
        a, b, s = zip(*[adapter[m] or dummy for adapter in adapters], strict=True)
        factor = layer + 1  # both A and B of layer l were stored times (l + 1)
        expected = base + lora_reference(
            x, per_module, [t * factor for t in a], [t * factor for t in b], list(s), v_dtype=v_dtype
        )
        torch.testing.assert_close(out, expected, rtol=atol, atol=atol)
        assert torch.equal(out[per_module < 0], base[per_module < 0])  # base tokens bit for bit


POPULARITY = {
    "distinct": lambda rng: rng.sample(range(NUM_ADAPTERS), NUM_ADAPTERS),
    "uniform": lambda rng: rng.choices(range(NUM_ADAPTERS), k=BS),
    "skewed": lambda rng: rng.choices(range(NUM_ADAPTERS), [1 / (k + 1) ** 1.5 for k in range(NUM_ADAPTERS)], k=BS),
    "identical": lambda rng: [rng.randrange(NUM_ADAPTERS)] * BS,
    "with-base": lambda rng: rng.choices([-1, *range(NUM_ADAPTERS)], k=BS),
}
