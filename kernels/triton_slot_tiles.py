"""How a program of the slot kernels (``triton_lora_slots.py``) finds its tokens: tile ``i`` of the
grid's first axis is the ``j``-th ``SLOT_TILE``-token tile of the first slot whose cumulative tile
count exceeds ``i``, in the grouping ``kernels/lora.py: sort_by_slot`` made on the device."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def find_slot(tile_ends_ptr, num_slots, tile):
    """The first slot ``s`` with ``tile_ends[s] > tile`` (binary search); ``num_slots`` if none."""
    low = 0
    high = num_slots
    # Most programs of a padded decode step have no tile (the grid is sized for every slot): they
    # learn it from the last cumulative count, one load, instead of the whole search.
    if tl.load(tile_ends_ptr + num_slots - 1) <= tile:
        low = num_slots
    while low < high:
        mid = (low + high) // 2
        if tl.load(tile_ends_ptr + mid) <= tile:
            low = mid + 1
        else:
            high = mid
    return low


@triton.jit
def slot_tokens(order_ptr, starts_ptr, tile_ends_ptr, slot, BLOCK_T: tl.constexpr):
    """The tokens ``[BLOCK_T]`` of this program's tile of ``slot`` and their mask."""
    first_tile = tl.load(tile_ends_ptr + slot - 1, mask=slot > 0, other=0)  # tiles of the slots before
    slot_end = tl.load(starts_ptr + slot + 1)
    positions = tl.load(starts_ptr + slot) + (tl.program_id(0) - first_tile) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = positions < slot_end  # [BLOCK_T]
    tokens = tl.load(order_ptr + positions, mask=token_mask, other=0)  # [BLOCK_T]
    return tokens, token_mask
