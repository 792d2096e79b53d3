"""Context parallelism in one process: the shard layouts, the pieces of packed sequences, the
differentiable join against the fp64 loop, and argument checks (on a one-rank gloo group)."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import DEVICE
from helpers import rel_err
from flash_dma.distributed import (build_cp_context, cp_chunk_gated_delta_rule, cp_flash_dma_func,
                                   cp_flash_dma_varlen_func)
from flash_dma.distributed.context import plan_pieces, shard, shard_ranges
from flash_dma.distributed.ring_attention import ring_schedules
from flash_dma.ops.gated_delta_rule.segments import join_segments_reference
from flash_dma.ops.gated_delta_rule.segments import join_segments_reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cp_cases  # noqa: E402


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shards_cover_the_sequence_once_and_assemble_back(world, layout):
    total = 24 * world
    owners = torch.full((total,), -1)
    for r in range(world):
        ranges = shard_ranges(total, world, r, layout)
        assert sum(e - s for s, e in ranges) == total // world
        assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))  # ascending, merged
        for s, e in ranges:
            assert (owners[s:e] == -1).all()
            owners[s:e] = r
    assert (owners >= 0).all()
    if layout == "zigzag":  # causal work (sum of key counts over the rank's queries) is equal
        work = [sum(sum(range(s + 1, e + 1)) for s, e in shard_ranges(total, world, r, layout))
                for r in range(world)]
        assert len(set(work)) == 1
    x = torch.randn(2, total, 3)
    case = cp_cases.Case("t", "attn", layout, shards={"x": 1})
    parts = [shard(x, 1, world, r, layout) for r in range(world)]
    assert torch.equal(cp_cases.assemble(case, "x", parts), x.double())


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("split_columns", [True, False])
def test_ring_schedule_covers_every_visible_pair_once(world, layout, causal, split_columns):
    """The ring's pieces over all ranks and steps: each (query, key) pair the global mask leaves
    visible exactly once, nothing else; with split_columns each piece's keys are contiguous
    globally; every send has its receive on the peer at the same step; a block's gradients end
    at its owner."""
    total = 4 * world
    schedules = ring_schedules(total, world, layout, causal, split_columns)
    seen = torch.zeros(total, total, dtype=torch.int64)
    for r, steps in enumerate(schedules):
        rows = [i for s, e in shard_ranges(total, world, r, layout) for i in range(s, e)]
        for s, step in enumerate(steps):
            assert step.block == (r - s) % world
            keys = [j for a, b in shard_ranges(total, world, step.block, layout) for j in range(a, b)]
            for p in step.pieces:
                cols = keys[p.key_start:p.key_start + p.keys]
                if split_columns:
                    assert cols == list(range(p.column, p.column + p.keys))
                for i in range(p.rows):
                    for j in range(p.keys):
                        if not p.causal or j <= i + p.keys - p.rows:  # bottom-right aligned
                            seen[rows[p.row_start + i], cols[j]] += 1
            # matching transfers: a block sent at step s is received by its peer at step s
            if step.send_block_to is not None:
                assert schedules[step.send_block_to][s].recv_block_from == r
            if step.recv_block_from is not None:
                assert schedules[step.recv_block_from][s].send_block_to == r
                assert schedules[r][s + 1].pieces or schedules[r][s + 1].send_block_to is not None
            if step.send_grad_to is not None:
                peer = schedules[step.send_grad_to][s]
                assert r in (peer.recv_grad_from, peer.recv_own_grad_from)
                if peer.recv_own_grad_from == r:
                    assert step.block == step.send_grad_to
        own = [s for s, step in enumerate(steps) if step.recv_own_grad_from is not None]
        assert len(own) <= 1 and (own or steps[0].send_grad_to is None)
    want = torch.ones(total, total, dtype=torch.int64)
    assert torch.equal(seen, torch.tril(want) if causal else want)


def test_uneven_split_is_refused():
    with pytest.raises(ValueError, match="equal parts"):
        shard_ranges(30, 4, 0, "zigzag")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_pieces_tile_every_rank_and_every_sequence(world, layout):
    cu = cp_cases.PACKED
    ranks = plan_pieces(cu, world, layout)
    covered = torch.zeros(cu[-1], dtype=torch.int64)
    for r, pieces in enumerate(ranks):
        local = 0
        for p in pieces:
            assert p.rank == r and p.local_start == local and p.length > 0
            assert cu[p.seq] == p.seq_start <= p.global_start < p.global_end <= p.seq_end == cu[p.seq + 1]
            covered[p.global_start:p.global_end] += 1
            local += p.length
        assert local == cu[-1] // world
    assert (covered == 1).all()
    # a sequence's pieces in global order: the first starts it, the last ends it
    by_seq = {}
    for pieces in ranks:
        for p in pieces:
            by_seq.setdefault(p.seq, []).append(p)
    for seq, pieces in by_seq.items():
        pieces.sort(key=lambda p: p.global_start)
        assert pieces[0].starts_sequence and pieces[-1].ends_sequence
        assert all(a.global_end == b.global_start for a, b in zip(pieces, pieces[1:]))
    # the long sequence runs through a rank's middle with three ranks or zigzag (M exchanged)
    middle = [p for pieces in ranks for p in pieces if not p.starts_sequence and not p.ends_sequence]
    assert bool(middle) == (world == 3 or layout == "zigzag")


@pytest.mark.parametrize("world, layout", [(3, "contiguous"), (2, "zigzag"), (4, "zigzag")])
def test_exchange_plans_bring_each_piece_the_sequential_composition(world, layout):
    """The delta rule's exchange, simulated on the host in fp64 with random per-piece maps
    (S_end = M S_start + N): every rank sends its rows, the gathered rows are joined (forward
    left to right, backward right to left), and each piece must receive exactly what the pieces
    before it (forward) or after it (backward) compose to."""
    from flash_dma.distributed.context import CPContext
    from flash_dma.distributed.gated_delta_rule import _plan
    cu = [0, 20, 100, 101, 120] if world == 3 else [0, 5, 90, 96] if world == 2 else [0, 70, 71, 160]
    pieces = plan_pieces(cu, world, layout)
    K, V = 3, 2
    maps = {p: (torch.randn(K, K, dtype=torch.float64) * 0.5, torch.randn(K, V, dtype=torch.float64))
            for rank_pieces in pieces for p in rank_pieces}
    plans = [_plan(CPContext(None, world, r, layout, tuple(cu), pieces, torch.device("cpu"))) for r in range(world)]
    by_seq = {}
    for rank_pieces in pieces:
        for p in rank_pieces:
            by_seq.setdefault(p.seq, []).append(p)
    for direction, reverse in (("forward", False), ("backward", True)):
        def rows_of(r):
            plan = plans[r]
            d = getattr(plan, direction)
            rows = [torch.cat([maps[plan.pieces[i]][1], maps[plan.pieces[i]][0]], -1) for i in d.send_rows.tolist()]
            rows += [torch.zeros(K, V + K, dtype=torch.float64)] * (d.slots_per_rank - len(rows))
            return torch.stack(rows)[:, None] if rows else torch.zeros(0, 1, K, V + K, dtype=torch.float64)
        gathered = torch.cat([rows_of(r) for r in range(world)], 0)
        for r in range(world):
            d = getattr(plans[r], direction)
            slots = gathered.index_select(0, d.join_index)
            starts, finals = join_segments_reference(slots[..., V:], slots[..., :V], d.layout, None, reverse=reverse)
            got = torch.cat([starts, finals]).index_select(0, d.receive_index)
            for i, p in enumerate(plans[r].pieces):
                seq = sorted(by_seq[p.seq], key=lambda x: x.global_start)
                pos = seq.index(p)
                state = torch.zeros(K, V, dtype=torch.float64)
                others = seq[:pos] if not reverse else seq[pos + 1:][::-1]
                for o in others:
                    state = maps[o][0] @ state + maps[o][1]
                assert bool(d.receives[i]) == bool(others), (direction, r, p)
                if others:
                    assert torch.allclose(got[i, 0], state, atol=1e-12), (direction, r, p)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_context_needs_an_initialised_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(RuntimeError, match="init_process_group"):
        build_cp_context(torch.tensor([0, 8], dtype=torch.int32))


def test_bad_arguments_name_themselves(one_rank_group):
    cu = torch.tensor([0, 10, 32], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="layout"):
        build_cp_context(cu, layout="ring")
    with pytest.raises(ValueError, match="cu_seqlens"):
        build_cp_context(torch.tensor([0, 10, 5], dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="cu_seqlens"):
        build_cp_context(cu.float())
    with pytest.raises(ValueError, match="equal parts"):
        build_cp_context(torch.tensor([0, 7], dtype=torch.int32, device=DEVICE), layout="zigzag")
    ctx = build_cp_context(cu)
    q = torch.randn(1, 32, 1, 16, device=DEVICE)
    beta = torch.rand(1, 32, 1, device=DEVICE)
    with pytest.raises(ValueError, match="q: expected this rank's 32 tokens"):
        cp_chunk_gated_delta_rule(q[:, :16], q[:, :16], q[:, :16], None, beta[:, :16], cp_context=ctx)
    with pytest.raises(ValueError, match="initial_state"):
        cp_chunk_gated_delta_rule(q, q, q, None, beta, initial_state=torch.zeros(3, 1, 16, 16, device=DEVICE),
                                  cp_context=ctx)
    with pytest.raises(TypeError, match="cp_context"):
        cp_chunk_gated_delta_rule(q, q, q, None, beta, cp_context=cu)
    qa = torch.randn(1, 32, 2, 16, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="attn_bias: a key-wise"):
        cp_flash_dma_func(qa, qa, qa, attn_bias=torch.zeros(1, 2, 1, 16, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match="attn_mask: dim 2"):
        cp_flash_dma_func(qa, qa, qa, attn_mask=torch.ones(1, 2, 8, 32, device=DEVICE, dtype=torch.bool))
    with pytest.raises(ValueError, match="k: expected this rank's 32 tokens"):
        cp_flash_dma_varlen_func(qa[0], qa[0, :8], qa[0, :8], ctx)
    with pytest.raises(ValueError, match="form: expected one of"):
        cp_flash_dma_func(qa, qa, qa, form="ring-attention")


def test_one_rank_equals_the_plain_call(one_rank_group):
    """A group of one: no exchange, the same calls as without context parallelism."""
    case = cp_cases._gdr("one-rank", "contiguous", T=48, H=1, HV=1, K=16, V=16, gate="g", states=True)
    x, w = cp_cases.make_inputs(case, 0, DEVICE, torch.float32)
    ref = cp_cases.run_single(case, x, DEVICE)
    got = cp_cases.run_cp(case, x, DEVICE)
    for name in ("o", "final_state"):
        assert rel_err(got[name].detach(), ref[name].detach()) < 1e-6, name


@pytest.mark.parametrize("form", ["ring", "all_gather"])
def test_one_rank_attention_equals_the_plain_call(one_rank_group, form):
    """A group of one, both forms: the output, lse and every gradient of flash_dma_func."""
    case = cp_cases._attn("one-rank-attn", "zigzag", worlds=(1,), B=1, S=32, H=2, Hk=1, D=16, causal=True,
                          mask="key", bias="key", form=form)
    x, w = cp_cases.make_inputs(case, 0, DEVICE, torch.float16)
    ref = cp_cases.run_single(case, x, DEVICE)
    cp_cases.loss_of(ref, w).backward()
    want = {n: t.grad.clone() for n, t in x.items() if t.grad is not None}
    for t in x.values():
        t.grad = None
    got = cp_cases.run_cp(case, x, DEVICE)
    cp_cases.loss_of(got, w).backward()
    assert torch.equal(torch.isinf(got["lse"]), torch.isinf(ref["lse"]))
    finite = torch.isfinite(ref["lse"])
    assert rel_err(got["lse"][finite], ref["lse"][finite]) < 1e-5
    assert rel_err(got["o"].detach(), ref["o"].detach()) < 5e-3
    assert set(want) == {"q", "k", "v", "bias"}
    for name, g in want.items():
        assert rel_err(x[name].grad, g) < 5e-3, name
