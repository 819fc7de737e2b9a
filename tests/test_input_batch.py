"""``InputBatch``, the rows kept across steps (``loraserve/input_batch.py``): block tables and
tokens written incrementally, rows given and released, adapters numbered per row. The engine-level
checks that the rows hold every live sequence's tokens are in ``test_step_path.py``."""

from __future__ import annotations

import pytest
import torch

from loraserve import SamplingParams


def test_input_batch_rows_follow_block_tables_incrementally() -> None:
    import numpy as np

    from loraserve.input_batch import InputBatch
    from loraserve.sequence import Sequence

    rows = InputBatch(max_num_seqs=2, max_blocks_per_seq=4, max_model_len=8, vocab_size=10, device=torch.device("cpu"))
    a, b = Sequence("a", [1, 2], SamplingParams()), Sequence("b", [3], SamplingParams())
    a.block_ids = [7]
    assert rows.row(a) == 0 and rows.block_tables[0].tolist() == [7, 0, 0, 0]
    assert rows.token_ids[0, :3].tolist() == [1, 2, 0]  # the prompt, written when it joins
    rows.append_sampled(np.array([0]), np.array([2]), [5])  # the runner's sampled token
    a.append_token(5)
    assert rows.token_ids[0, :3].tolist() == [1, 2, 5] and rows.tokens_match(a)
    a.append_token(6)  # a token the runner did not write (as a fork's first): synced at the next row()
    assert not rows.tokens_match(a) or rows.token_ids[0, 3] != 6
    assert rows.row(a) == 0 and rows.token_ids[0, :4].tolist() == [1, 2, 5, 6]
    a.block_ids.append(9)  # appended: only the new entry is written
    rows.block_tables[0, 0] = -1  # (a marker: an incremental update leaves entry 0 alone)
    assert rows.row(a) == 0 and rows.block_tables[0].tolist() == [-1, 9, 0, 0]
    a.block_ids, a.block_table_epoch = [5, 6, 8], a.block_table_epoch + 1  # a new table: rewritten
    assert rows.row(a) == 0 and rows.block_tables[0, :3].tolist() == [5, 6, 8]
    b.block_ids = [2]
    assert rows.row(b) == 1 and rows.num_rows == 2
    with pytest.raises(RuntimeError, match="no free input-batch row"):
        rows.row(Sequence("c", [1], SamplingParams()))
    rows.release([a.seq_id, 12345])  # unknown ids are ignored
    c = Sequence("c", [1], SamplingParams())
    c.block_ids = [4]
    assert rows.row(c) == 0 and rows.block_tables[0, :1].tolist() == [4]  # a's row, rewritten for c
    # Many at once: only the rows that differ are written (b gets a block, c a token, both in one pass).
    b.block_ids.append(6)
    c.append_token(8)
    c.num_computed_tokens = 1
    assert rows.sync([c, b]).tolist() == [[1, 2, 0], [0, 1, 1]]  # computed tokens, tokens, row
    assert rows.block_tables[1, :2].tolist() == [2, 6] and rows.tokens_match(c) and rows.tokens_match(b)
    ints, floats = rows.upload([np.arange(3), np.array([0.5, 2.0])])
    assert ints.tolist() == [0, 1, 2] and floats.dtype == torch.float64 and floats.tolist() == [0.5, 2.0]


def test_input_batch_numbers_adapters_and_renumbers_the_live_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows carry a number per adapter (the base model 0) by which a step groups its sequences;
    past the bound on numbers given, the live rows' adapters are numbered again from 1."""
    from loraserve import input_batch
    from loraserve.sequence import Sequence

    monkeypatch.setattr(input_batch, "_MAX_CODES", 2)
    rows = input_batch.InputBatch(4, max_blocks_per_seq=2, max_model_len=8, vocab_size=10, device=torch.device("cpu"))
    seqs = [Sequence(str(i), [1], SamplingParams(), adapter_id=name) for i, name in enumerate(["x", None, "y", "x"])]

    def codes(batch: list[Sequence]) -> list[int]:
        return [int(c) for c in rows.adapter_codes[rows.sync(batch)[:, 2]]]

    assert codes(seqs) == [1, 0, 2, 1]
    rows.release([seqs[0].seq_id, seqs[3].seq_id])  # "x" no longer used
    z = Sequence("z", [1], SamplingParams(), adapter_id="z")
    assert codes([seqs[1], seqs[2], z]) == [0, 1, 2]  # a third adapter: "y" and "z" renumbered
    again = Sequence("x2", [1], SamplingParams(), adapter_id="y")
    assert codes([again]) == [1]  # the same adapter, the same number
