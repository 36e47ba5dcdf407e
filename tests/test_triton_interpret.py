"""The Triton KV-store and paged-attention kernels on CPU, under TRITON_INTERPRET=1.

The interpreter must be switched on before triton is first imported, so the checks run
this file as a script in a fresh subprocess (tests/interpret.py). Reference: dense float64
attention over the per-row keys/values the test generated (never read back from the cache).
"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest

from tests.interpret import assert_check_passed, run_checks, run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


CHECKS = ["store_kv", "backend", "launches", "split_merge", "split_counters_reused",
          "split_matches_unsplit", "counter_picks_merger", "split_len", "non_causal"]


@pytest.fixture(scope="module", params=[4, 16], ids=lambda bs: f"block_size={bs}")
def interpreter_run(request: pytest.FixtureRequest) -> str:
    """One interpreter subprocess per block size runs every check."""
    return run_interpreted(__file__, str(request.param))


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_check_interpreted(interpreter_run: str, check: str) -> None:
    assert_check_passed(interpreter_run, check)


def test_launch_variants_cover_every_choice() -> None:
    """The engine compiles launch_variants at start-up; a launch choose_launch returns outside
    that list would compile in the middle of serving. Sweep batch shapes of every kind."""
    import torch

    from models.kernels.paged_attention import MAX_SPLITS, choose_launch, launch_variants

    for num_q_per_kv, num_kv_heads in ((1, 8), (2, 8), (4, 8), (8, 2), (16, 1)):
        for dtype in (torch.bfloat16, torch.float32):
            variants = set(launch_variants(num_q_per_kv, dtype))
            seen = set()
            for num_seqs in (1, 2, 3, 5, 8, 13, 32, 100, 256):
                for query_len in (1, 3, 17, 64, 500):
                    for max_seq_len in (1, 600, 1024, 5000):
                        for num_sms in (8, 132):
                            launch = choose_launch(
                                num_tokens=num_seqs * query_len, num_seqs=num_seqs,
                                num_kv_heads=num_kv_heads, num_q_per_kv=num_q_per_kv,
                                dtype=dtype, max_query_len=query_len,
                                max_seq_len=max(max_seq_len, query_len),
                                decode_only=query_len == 1, num_sms=num_sms)
                            assert launch in variants, (launch, num_seqs, query_len)
                            seen.add(launch)
            assert len(seen) > 2  # the sweep reached split and unsplit, decode and prefill
            # The small-decode tiles are the most-split decode launches alone.
            assert any(v.small_decode for v in seen)
            assert all(v.num_splits == MAX_SPLITS for v in seen if v.small_decode)


# --------------------------------------------------------------------------- subprocess side


def _main(block_size: int) -> None:
    from dataclasses import replace

    import torch

    from models.attention_metadata import make_attention_metadata
    from models.backends.triton_backend import TritonAttentionBackend
    from models.kernels.paged_attention import (
        AttentionLaunch,
        _merge_rows,
        paged_attention,
        split_counters,
        split_workspace,
    )

    torch.manual_seed(1234 + block_size)
    nan = float("nan")

    def reference(q, k, v, cached, scale):  # q [L, H, D], k/v [S, Hkv, D] -> [L, H, D] f64
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, 1)
        v = v.double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
        pos = cached + torch.arange(q.shape[0])
        s = s.masked_fill(torch.arange(k.shape[0])[None, :] > pos[:, None], float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

    def make_batch(rows, heads, kv_heads, dim):
        """rows: (cached_len, q_len). Cache holds the cached part; the rest is NaN."""
        need = [-(-(c + q) // block_size) for c, q in rows]
        num_blocks = sum(need) + 2
        perm = torch.randperm(num_blocks).tolist()
        tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(rows))]
        kv_cache = torch.full((2, num_blocks, block_size, kv_heads, dim), nan)
        flat = kv_cache.view(2, -1, kv_heads, dim)
        qs, ks, vs, refs, new_k, new_v = [], [], [], [], [], []
        for (cached, q_len), table in zip(rows, tables, strict=True):
            k = torch.randn(cached + q_len, kv_heads, dim)
            v = torch.randn(cached + q_len, kv_heads, dim)
            q = torch.randn(q_len, heads, dim)
            for pos in range(cached):
                slot = table[pos // block_size] * block_size + pos % block_size
                flat[0, slot], flat[1, slot] = k[pos], v[pos]
            refs.append(reference(q, k, v, cached, dim**-0.5))
            qs.append(q)
            ks.append(k)
            vs.append(v)
            new_k.append(k[cached:])
            new_v.append(v[cached:])
        meta = make_attention_metadata([q for _, q in rows], [c + q for c, q in rows], tables,
                                       block_size)
        return (torch.cat(qs), torch.cat(new_k), torch.cat(new_v), kv_cache, meta,
                torch.cat(refs), ks, vs, tables)

    def rel_err(out, ref, meta):
        cu = meta.cu_seqlens_q_cpu
        assert not out.isnan().any(), "output not fully written (NaN poison left)"
        return max(((out[a:b].double() - ref[a:b]).norm() / ref[a:b].norm()).item()
                   for a, b in zip(cu[:-1], cu[1:], strict=True))

    layouts = [(4, 2, 32), (4, 1, 16), (2, 2, 64)]
    mixed = [(0, 7), (2 * block_size, 5), (37, 1), (0, 1), (13, 9), (block_size, 1), (70, 3)]
    def check_store_kv():
        heads, kv_heads, dim = 4, 2, 32
        q, key, value, kv_cache, meta, _, ks, vs, tables = make_batch(mixed, heads, kv_heads, dim)
        slots = meta.slot_mapping.clone()
        slots[::3] = -1  # these tokens must not be written
        before = kv_cache.clone()
        TritonAttentionBackend().store_kv(key, value, kv_cache, slots)
        flat, flat_before = kv_cache.view(2, -1, kv_heads, dim), before.view(2, -1, kv_heads, dim)
        written = slots[slots >= 0]
        assert torch.equal(flat[0, written], key[slots >= 0])
        assert torch.equal(flat[1, written], value[slots >= 0])
        untouched = torch.ones(flat.shape[1], dtype=torch.bool)
        untouched[written] = False
        assert torch.equal(flat[:, untouched].isnan(), flat_before[:, untouched].isnan())
        assert torch.equal(flat[:, untouched].nan_to_num(), flat_before[:, untouched].nan_to_num())
    def check_backend():
        for heads, kv_heads, dim in layouts:
            # mixed (shuffled), decode-only (split-KV), decode rows first (two launches),
            # pure prefill
            leading_decode = [(37, 1), (5, 1), (0, 1), (0, 7), (13, 9), (2 * block_size, 3)]
            for rows in (mixed, [(37, 1), (3, 1), (90, 1)], leading_decode, [(0, 12), (0, 3)]):
                q, key, value, kv_cache, meta, ref, *_ = make_batch(rows, heads, kv_heads, dim)
                backend = TritonAttentionBackend(num_sms=8)  # few SMs: decode takes split-KV
                backend.store_kv(key, value, kv_cache, meta.slot_mapping)
                out = torch.full_like(q, nan)
                result = backend.forward(q, kv_cache, meta, dim**-0.5, out=out)
                assert result.data_ptr() == out.data_ptr()
                err = rel_err(out, ref, meta)
                assert err < 1e-4, (heads, kv_heads, dim, rows, err)
                if all(c == 0 for c, _ in rows):  # a pure prefill: the no-cache path too
                    err = rel_err(backend.forward_no_cache(q, key, value, meta, dim**-0.5),
                                  ref, meta)
                    assert err < 1e-4, ("no_cache", heads, kv_heads, dim, rows, err)
    def check_launches():
        heads, kv_heads, dim = 4, 2, 32
        q, key, value, kv_cache, meta, ref, *_ = make_batch(mixed, heads, kv_heads, dim)
        TritonAttentionBackend().store_kv(key, value, kv_cache, meta.slot_mapping)
        for block_q, block_n, splits in [(8, 16, 1), (16, 32, 1), (8, 16, 4), (32, 16, 2)]:
            launch = AttentionLaunch(block_q=block_q, block_n=block_n, num_splits=splits)
            out = torch.full_like(q, nan)
            workspace = None
            if splits > 1:  # poison the partials too: every one must be written
                workspace = tuple(torch.full_like(w, nan) for w in split_workspace(
                    q.shape[0], heads, splits, dim, q.device))
            paged_attention(q, kv_cache[0], kv_cache[1], meta.cu_seqlens_q, meta.seq_lens,
                            meta.block_tables, dim**-0.5, launch, out=out, workspace=workspace)
            err = rel_err(out, ref, meta)
            assert err < 1e-4, (block_q, block_n, splits, err)

    def split_run(q, kv_cache, meta, dim, launch, counters, workspace=None):
        """paged_attention with NaN-poisoned out and partials (every one must be written)."""
        out = torch.full_like(q, nan)
        if workspace is None:
            workspace = tuple(torch.full_like(w, nan) for w in split_workspace(
                q.shape[0], q.shape[1], launch.num_splits, dim, q.device))
        paged_attention(q, kv_cache[0], kv_cache[1], meta.cu_seqlens_q, meta.seq_lens,
                        meta.block_tables, dim**-0.5, launch, out=out, workspace=workspace,
                        counters=counters)
        return out

    def padded_decode_batch(cached_lens, heads, kv_heads, dim):
        """Decode rows plus a last padding row of seq_len 0 (as CUDA-graph batches pad)."""
        q, key, value, kv_cache, meta, ref, *_ = make_batch(
            [(c, 1) for c in cached_lens] + [(0, 1)], heads, kv_heads, dim)
        TritonAttentionBackend().store_kv(key, value, kv_cache, meta.slot_mapping)
        meta.seq_lens[-1] = 0
        meta.cu_seqlens_q_cpu = meta.cu_seqlens_q_cpu[:-1]  # rel_err: the real rows only
        return q, kv_cache, meta, ref

    # Shorter than the split count and than one key tile: most partitions are empty.
    short_and_long = [0, 1, 2, 4, 37, 70, 150]
    def check_split_merge():
        chunked = whole = False
        cases = [((4, 2, 32), (2, 4, 8)), ((4, 1, 16), (4,)), ((2, 2, 64), (8,)),
                 ((8, 1, 128), (16,))]
        for (heads, kv_heads, dim), split_counts in cases:
            group_pad = 1 << (heads // kv_heads - 1).bit_length()
            q, kv_cache, meta, ref = padded_decode_batch(short_and_long, heads, kv_heads, dim)
            # The largest split count also as the small-decode launch, which merges a
            # whole group at once.
            launches = [AttentionLaunch(block_q=max(1, 16 // group_pad), block_n=16,
                                        num_splits=splits) for splits in split_counts]
            launches.append(replace(launches[-1], small_decode=True, num_warps=8))
            for launch in launches:
                splits = launch.num_splits
                # a decode tile has group_pad rows: fewer per merge step = several steps
                chunked |= _merge_rows(16, dim, launch) < group_pad
                whole |= _merge_rows(16, dim, launch) >= group_pad
                counters = split_counters(64, q.device)
                out = split_run(q, kv_cache, meta, dim, launch, counters)
                err = rel_err(out[:-1], ref, meta)
                assert err < 1e-4, (heads, kv_heads, dim, splits, err)
                assert torch.equal(out[-1], torch.zeros_like(out[-1])), "seq_len 0 row"
                assert torch.count_nonzero(counters) == 0, "counters not left zeroed"
        assert chunked, "no case merged a decode tile in several row chunks"
        assert whole, "no case merged a decode tile in one row chunk"
    def check_split_counters_reused():
        heads, kv_heads, dim = 4, 2, 32
        counters = split_counters(64, "cpu")  # one buffer, launches of different shapes
        batches = [padded_decode_batch(short_and_long, heads, kv_heads, dim),
                   padded_decode_batch([90, 3, 0, 41], heads, kv_heads, dim)]
        for (q, kv_cache, meta, ref), splits in zip(batches, (4, 8), strict=True):
            launch = AttentionLaunch(block_q=8, block_n=16, num_splits=splits)
            for _ in range(2):  # and the same launch twice
                out = split_run(q, kv_cache, meta, dim, launch, counters)
                assert rel_err(out[:-1], ref, meta) < 1e-4, splits
                assert torch.count_nonzero(counters) == 0, "counters not left zeroed"
        q, kv_cache, meta, _ = batches[0]
        try:  # 8 rows // block_q 8 + 8 seqs = 9 tiles x 2 kv heads = 18 counters needed
            split_run(q, kv_cache, meta, dim, launch, split_counters(17, "cpu"))
        except AssertionError as exc:
            assert "split counters" in str(exc), exc
        else:
            raise AssertionError("a too-small counter buffer was accepted")
    def check_split_matches_unsplit():
        heads, kv_heads, dim = 4, 2, 64
        rows = mixed + [(20, 40)]  # a full 32-token tile: 64 rows
        q, key, value, kv_cache, meta, ref, *_ = make_batch(rows, heads, kv_heads, dim)
        TritonAttentionBackend().store_kv(key, value, kv_cache, meta.slot_mapping)
        unsplit = split_run(q, kv_cache, meta, dim,
                            AttentionLaunch(block_q=32, block_n=16, num_splits=1), None)
        assert rel_err(unsplit, ref, meta) < 1e-4
        assert _merge_rows(64, dim, AttentionLaunch(block_q=32, block_n=16, num_splits=8)) < 64, (
            "no case merges a prefill tile in chunks")
        for splits in (2, 4, 8):
            launch = AttentionLaunch(block_q=32, block_n=16, num_splits=splits)
            out = split_run(q, kv_cache, meta, dim, launch, split_counters(64, "cpu"))
            diff = (out - unsplit).abs().max().item()
            assert diff < 1e-5 * unsplit.abs().max().item(), (splits, diff)
    def check_counter_picks_merger():
        # The interpreter runs a tile's partitions in order, so partition S-1 always arrives
        # last. Counters left at 1 make partition S-2 see S-1 arrivals: if the counter (not
        # the partition index) picks the merger, it merges before partition S-1 has written
        # its (NaN-poisoned) partials, so every row comes out NaN, and each counter ends at
        # 1 (the merger's 0 plus partition S-1's arrival).
        # The padding row (seq_len 0) takes one partition, so it writes zeros without
        # touching its counter.
        heads, kv_heads, dim = 4, 2, 32
        q, kv_cache, meta, ref = padded_decode_batch([150, 40], heads, kv_heads, dim)
        launch = AttentionLaunch(block_q=8, block_n=16, num_splits=2)
        counters = torch.ones(64, dtype=torch.int32)
        out = split_run(q, kv_cache, meta, dim, launch, counters)
        assert out[:-1].isnan().all(), "a partition merged before every partial was written"
        assert torch.equal(out[-1], torch.zeros_like(out[-1])), "seq_len 0 row"
        used = (q.shape[0] // launch.block_q + meta.seq_lens.shape[0]) * kv_heads
        assert torch.equal(counters[:used], torch.ones(used, dtype=torch.int32)), counters
        counters.zero_()  # the same poisoned launch with zeroed counters is right
        assert rel_err(split_run(q, kv_cache, meta, dim, launch, counters)[:-1], ref,
                       meta) < 1e-4

    def check_split_len():
        # Rows shorter than num_splits * min_split_len take fewer partitions; the others'
        # programs exit without writing, so their (NaN-poisoned) partials stay NaN. A row
        # of one partition writes its output directly: no partials at all.
        heads, kv_heads, dim = 4, 2, 32
        cached = [0, 5, 15, 16, 40, 100, 250]
        q, kv_cache, meta, ref = padded_decode_batch(cached, heads, kv_heads, dim)
        for min_len in (16, 32, 64):
            launch = AttentionLaunch(block_q=8, block_n=16, num_splits=8,
                                     min_split_len=min_len)
            counters = split_counters(64, q.device)
            workspace = tuple(torch.full_like(w, nan) for w in split_workspace(
                q.shape[0], heads, 8, dim, q.device))
            out = split_run(q, kv_cache, meta, dim, launch, counters, workspace)
            assert rel_err(out[:-1], ref, meta) < 1e-4, min_len
            assert torch.count_nonzero(counters) == 0, "counters not left zeroed"
            row_max = workspace[1]  # [T, H, S]
            for row, ctx in enumerate(cached):
                part = max(math.ceil(math.ceil((ctx + 1) / 8) / 16) * 16, min_len)
                num_parts = math.ceil((ctx + 1) / part)
                written = ~row_max[row].isnan().any(dim=0)  # [S]
                assert written.tolist() == [1 < num_parts > s for s in range(8)], (
                    min_len, ctx, written)

    def full_reference(q, k, v, scale):  # every query over every key: [L, H, D] f64
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, 1)
        v = v.double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

    def non_causal_batch(rows, heads, kv_heads, dim):
        """rows: (context length, first query position, query length). The cache holds the
        whole context's K/V (a diffusion step's block may sit in its middle); the metadata
        is the usual one, which takes the queries for the context's last tokens."""
        need = [-(-n // block_size) for n, _, _ in rows]
        num_blocks = sum(need) + 2
        perm = torch.randperm(num_blocks).tolist()
        tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(rows))]
        kv_cache = torch.full((2, num_blocks, block_size, kv_heads, dim), nan)
        flat = kv_cache.view(2, -1, kv_heads, dim)
        qs, refs = [], []
        for (seq_len, start, q_len), table in zip(rows, tables, strict=True):
            assert start >= 0 and start + q_len <= seq_len
            k, v = torch.randn(seq_len, kv_heads, dim), torch.randn(seq_len, kv_heads, dim)
            slots = [table[pos // block_size] * block_size + pos % block_size
                     for pos in range(seq_len)]
            flat[0, slots], flat[1, slots] = k, v
            q = torch.randn(q_len, heads, dim)
            qs.append(q)
            refs.append(full_reference(q, k, v, dim**-0.5))
        meta = make_attention_metadata([q for _, _, q in rows], [n for n, _, _ in rows], tables,
                                       block_size)
        return torch.cat(qs), kv_cache, meta, torch.cat(refs)

    def check_non_causal():
        # Decode rows first (their own launch, split-KV with few SMs), then blocks in the
        # middle, at the start, at the end and across block edges of their contexts.
        rows = [(37, 20, 1), (70, 0, 1), (20, 5, 6), (1, 0, 1), (9, 0, 9),
                (2 * block_size + 3, block_size, 3), (40, 33, 7)]
        decode = [(37, 20, 1), (150, 3, 1), (5, 4, 1), (1, 0, 1)]
        for (heads, kv_heads, dim), batch in [*((layout, rows) for layout in layouts),
                                              (layouts[0], decode)]:
            q, kv_cache, meta, ref = non_causal_batch(batch, heads, kv_heads, dim)
            out = torch.full_like(q, nan)
            TritonAttentionBackend(num_sms=8).forward(q, kv_cache, meta, dim**-0.5, out=out,
                                                      causal=False)
            err = rel_err(out, ref, meta)
            assert err < 1e-4, (heads, kv_heads, dim, batch, err)
        heads, kv_heads, dim = layouts[0]
        scale = dim**-0.5
        q, kv_cache, meta, ref = non_causal_batch(rows, heads, kv_heads, dim)
        causal = TritonAttentionBackend().forward(q, kv_cache, meta, scale)
        assert rel_err(causal, ref, meta) > 1e-2, "causal=False changed nothing"
        for block_q, splits in ((16, 4), (32, 2)):  # prefill tiles, split-KV
            launch = AttentionLaunch(block_q=block_q, block_n=16, num_splits=splits)
            out = torch.full_like(q, nan)
            workspace = tuple(torch.full_like(w, nan) for w in split_workspace(
                q.shape[0], heads, splits, dim, q.device))  # every partial must be written
            paged_attention(q, kv_cache[0], kv_cache[1], meta.cu_seqlens_q, meta.seq_lens,
                            meta.block_tables, scale, launch, out=out, workspace=workspace,
                            counters=split_counters(64, "cpu"), causal=False)
            err = rel_err(out, ref, meta)
            assert err < 1e-4, (block_q, splits, err)
        # No cache yet: each row's queries are all of its tokens.
        q, kv_cache, meta, ref = non_causal_batch([(n, 0, n) for n in (7, 1, 13)], heads,
                                                  kv_heads, dim)
        flat = kv_cache.view(2, -1, kv_heads, dim)
        key, value = flat[0, meta.slot_mapping], flat[1, meta.slot_mapping]
        out = TritonAttentionBackend().forward_no_cache(q, key, value, meta, scale, causal=False)
        assert rel_err(out, ref, meta) < 1e-4, "no_cache"

    run_checks(list(zip(CHECKS, [check_store_kv, check_backend, check_launches,
                                 check_split_merge, check_split_counters_reused,
                                 check_split_matches_unsplit, check_counter_picks_merger,
                                 check_split_len, check_non_causal],
                        strict=True)))


if __name__ == "__main__":
    _main(int(sys.argv[1]))
