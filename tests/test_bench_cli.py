"""The benchmark report: formatting, geometric means, JSON, missing peers, and the no-GPU path."""
import itertools
import json
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from flash_dma.benchmarks import attention, gdn
from flash_dma.benchmarks.common import Row, Section, format_report, geometric_mean, write_json, write_plot
from flash_dma.cli import build_parser

ENV = {"device": "Test GPU", "sm_count": 132, "capability": "9.0", "torch": "2.x", "triton": "3.x",
       "cuda": "13.0", "date": "2026-11-21 12:00 UTC"}


def synthetic_sections():
    s = Section("plain")
    s.rows = [Row("S1024 fwd", "flex", 2.0, 1.0, 1e-3, 2e-3, flops=1e12, seqlen=1024, direction="fwd"),
              Row("S2048 fwd", "flex", 8.0, 1.0, 1e-3, 2e-3, flops=4e12, seqlen=2048, direction="fwd"),
              Row("S1024 fwd", "sdpa-cudnn", 1.0, 2.0, flops=1e12, seqlen=1024, direction="fwd"),
              Row("S4096 fwd", "flash-dmattn", None, 3.0, note="refused: ValueError: head dim")]
    return [s]


def test_geometric_mean():
    assert geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    assert geometric_mean([0.5, 2.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        geometric_mean([])


def test_report_rows_rates_and_geomeans():
    text = format_report("t", ENV, synthetic_sections())
    assert "Test GPU (132 SMs" in text and "triton 3.x" in text and "2026-11-21" in text
    assert "Config" in text and "max_abs" in text and "Speedup" in text
    lines = text.splitlines()
    s2048 = next(line for line in lines if line.startswith("S2048 fwd"))
    assert "8.00x" in s2048 and "500 TF/s" in s2048 and "4000 TF/s" in s2048  # 4e12 FLOP in 8 / 1 ms
    geo_flex = next(line for line in lines if "geometric mean vs flex" in line)
    assert "4.00x" in geo_flex  # sqrt(2 * 8)
    assert "0.50x" in next(line for line in lines if "geometric mean vs sdpa-cudnn" in line)
    refused = next(line for line in lines if line.startswith("S4096 fwd"))
    assert "n/a" in refused and "refused: ValueError" in refused


def test_json_schema(tmp_path):
    path = tmp_path / "r.json"
    write_json(str(path), "t", ENV, synthetic_sections(), ["flash-dmattn not installed"])
    data = json.loads(path.read_text())
    assert set(data) == {"title", "environment", "notes", "sections"}
    assert data["environment"]["device"] == "Test GPU" and data["notes"] == ["flash-dmattn not installed"]
    section = data["sections"][0]
    assert section["geomean_speedup"]["flex"] == pytest.approx(4.0)
    row = section["rows"][0]
    for key in ("config", "peer", "peer_ms", "ours_ms", "speedup", "max_abs", "max_rel", "flops",
                "bytes", "note", "seqlen", "direction"):
        assert key in row
    assert row["speedup"] == pytest.approx(2.0)
    assert section["rows"][3]["speedup"] is None


def test_plot_or_clear_refusal(tmp_path):
    path = tmp_path / "p.png"
    made = write_plot(str(path), "t", ENV, synthetic_sections())
    try:
        import matplotlib  # noqa: F401
        assert made and path.read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert made is False


def test_missing_peer_is_a_note_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_dmattn_triton", None)  # import fails as if absent
    monkeypatch.setitem(sys.modules, "flash_sparse_attn.deprecated.flash_dmattn_triton", None)
    reason = attention.peer_available("flash-dmattn")
    assert reason is not None and "flash-dmattn" in reason
    import importlib.abc
    import importlib.util

    class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):  # installed, but raises on import
        def find_spec(self, name, path=None, target=None):
            return importlib.util.spec_from_loader(name, self) if name == "flash_sparse_attn" else None

        def exec_module(self, module):
            raise RuntimeError("no kernels for this GPU")
    monkeypatch.delitem(sys.modules, "flash_sparse_attn", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken()] + sys.meta_path)
    reason = attention.peer_available("flash-sparse-attn")
    assert reason is not None and "failed to import" in reason and "RuntimeError" in reason
    assert attention.peer_available("sdpa-cudnn") is None


def test_cli_arguments():
    args = build_parser().parse_args(["bench", "attention", "--quick", "--json", "x.json"])
    assert args.op == "attention" and args.quick and args.json == "x.json"
    assert build_parser().parse_args(["bench"]).op == "all"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "nonsense"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_no_gpu_path_checks_in_the_interpreter_and_exits_0():
    proc = subprocess.run([sys.executable, "-m", "flash_dma.cli", "bench", "--quick"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU" in proc.stdout
    assert "attention: relative error" in proc.stdout and "(ok)" in proc.stdout


def test_json_round_trip(tmp_path):
    from flash_dma.benchmarks.common import load_json
    path = tmp_path / "r.json"
    write_json(str(path), "t", ENV, synthetic_sections(), ["n"])
    title, env, sections, notes = load_json(str(path))
    assert title == "t" and env == ENV and notes == ["n"]
    assert sections[0].rows == synthetic_sections()[0].rows


# ---- the gated delta rule benchmarks (flash_dma.benchmarks.gdn): plans, bytes, inputs, reports ----


def fake_timer(fn):
    fn()
    return 1.0


def test_dhu_plan_covers_the_issue():
    plan = gdn.dhu_plan(quick=False)
    regular = [(s, m) for s, m in plan if s.seqlens is None]
    assert {(s.B, s.T, s.H) for s, _ in regular} == {(b, t, h) for b in (1, 2, 4)
                                                     for t in (2048, 4096, 8192, 16384) for h in (16, 32)}
    assert all(m == ("A", "B", "C", "D", "E") and (s.K, s.V) == (128, 128) for s, m in plan)
    varlen = [s for s, _ in plan if s.seqlens is not None]
    assert [(s.T, s.H, s.B) for s in varlen] == [(8192, 64, 1), (32768, 64, 1)]
    for s in varlen:
        assert 20 <= len(s.seqlens) <= 25 and sum(s.seqlens) == s.T and min(s.seqlens) >= 1
    quick = gdn.dhu_plan(quick=True)
    assert 4 <= sum(len(m) for _, m in quick) <= 12


def test_varlen_lengths_are_fixed_by_the_seed():
    a, b = gdn.varlen_lengths(8192, 5), gdn.varlen_lengths(8192, 5)
    assert a == b and sum(a) == 8192 and 20 <= len(a) <= 25
    assert gdn.varlen_lengths(8192, 6) != a


def test_dhu_bytes_match_the_anchor_floor():
    # anchors.md: B1 T8192 H16 mode A moves about 270 MB (q, k, w, do, dv in; dh, dv2 out)
    s = gdn.DhuShape(1, 8192, 16)
    tok = 8192 * 16 * 128 * 2
    assert gdn.dhu_bytes(s, "A") == 6 * tok + 128 * 16 * 128 * 128 * 2
    assert 260e6 < gdn.dhu_bytes(s, "A") < 275e6
    state = 16 * 128 * 128 * 4
    assert gdn.dhu_bytes(s, "B") - gdn.dhu_bytes(s, "A") == 2 * state  # dht read, dh0 written
    assert gdn.dhu_bytes(s, "C") - gdn.dhu_bytes(s, "A") == 8192 * 16 * 4
    assert gdn.dhu_bytes(s, "D") - gdn.dhu_bytes(s, "A") == 8192 * 16 * 128 * 4
    assert gdn.dhu_bytes(s, "E") == gdn.dhu_bytes(s, "C") + gdn.dhu_bytes(s, "D") - gdn.dhu_bytes(s, "A")
    packed = gdn.DhuShape(1, 130, 2, seqlens=(64, 1, 65))  # chunks: 1 + 1 + 2
    assert packed.n_chunks() == 4 and packed.n_seqs == 3
    assert gdn.dhu_bytes(packed, "B") - gdn.dhu_bytes(packed, "A") == 2 * 3 * 2 * 128 * 128 * 4


def test_op_plan_covers_the_issue():
    shapes = {(c.B, c.T, c.H, c.K, c.V) for c in gdn.op_plan(quick=False)
              if not c.states and not c.per_key_gate}
    assert shapes == {(4, 4096, 16, 128, 128), (1, 8192, 16, 128, 128), (1, 32768, 16, 128, 128),
                      (8, 4096, 32, 128, 128), (2, 8192, 8, 256, 256)}
    assert len(gdn.op_plan(quick=True)) >= 1
    packed = [c for c in gdn.op_plan(quick=False) if c.seqlens is not None]
    assert len(packed) == 1 and packed[0].label.startswith("varlen N")
    assert 20 <= len(packed[0].seqlens) <= 25 and sum(packed[0].seqlens) == packed[0].T == 32768
    with pytest.raises(ValueError, match="B == 1"):
        gdn.OpCase(2, 20, 2, seqlens=(10, 10))
    with pytest.raises(ValueError, match="summing to T"):
        gdn.OpCase(1, 20, 2, seqlens=(10, 9))
    with pytest.raises(ValueError, match="strong_decay"):
        gdn.OpCase(2, 64, 2, strong_decay=True)
    with pytest.raises(ValueError, match="strong_decay"):
        gdn.OpCase(2, 64, 2, per_key_gate=True, strong_decay=True, slow_decay=True)
    with pytest.raises(ValueError, match="keep_states"):
        gdn.OpCase(2, 64, 2, keep_states=True)
    kept = [c for c in gdn.op_plan(quick=False) if c.keep_states]
    assert [c.label for c in kept] == ["B2 T4096 H16 KDA no-recompute"]


def test_strong_decay_case_takes_the_blockwise_gated_pairs():
    """The KDA strong-decay case's gate leaves most chunks with a key whose log decay spans more
    than the whole-chunk form's 120; the plain KDA case none."""
    def flagged(case):
        g = gdn.make_op_inputs(case, device="cpu")["g"]
        cum = g.view(case.B, case.T // 64, 64, case.H, case.K).cumsum(2)
        return ((cum.amax(2) - cum.amin(2)) > 120).any(-1).float().mean().item()
    assert flagged(gdn.OpCase(1, 1024, 4, per_key_gate=True, strong_decay=True)) > 0.5
    assert flagged(gdn.OpCase(1, 1024, 4, per_key_gate=True)) == 0.0


def test_op_plan_cases_by_label():
    picked = gdn.op_plan(quick=False, cases=["B8 T4096 H32", "B2 T8192 H8 K256 V256"])
    assert [(c.B, c.T, c.H, c.K) for c in picked] == [(8, 4096, 32, 128), (2, 8192, 8, 256)]
    assert [c.label for c in gdn.op_plan(False, ["B2 T4096 H16 KDA"])] == ["B2 T4096 H16 KDA"]
    with pytest.raises(ValueError, match="not in the op plan"):
        gdn.op_plan(quick=False, cases=["B3 T5 H7"])
    from flash_dma.cli import parse_cases
    assert parse_cases(" B8 T4096 H32 , B1 T8192 H16 h0+ht") == ["B8 T4096 H32", "B1 T8192 H16 h0+ht"]
    assert parse_cases("") is None and parse_cases(None) is None
    assert parse_cases("B2 H16 S4096 D128 bias[B,H,S,S], B4 H16 S4096 D64,B1 H16 S16384 D128 top-1024 "
                       "keys bias[B,H,1,S]") == ["B2 H16 S4096 D128 bias[B,H,S,S]", "B4 H16 S4096 D64",
                                                 "B1 H16 S16384 D128 top-1024 keys bias[B,H,1,S]"]
    for unbalanced in ("a],b", "B2 H16 S4096 D128 bias[B,H,S,S,b", "a,b]"):
        with pytest.raises(ValueError, match="--cases"):
            parse_cases(unbalanced)
    args = build_parser().parse_args(["bench", "gdn", "--cases", "B8 T4096 H32"])
    assert args.cases == "B8 T4096 H32"


def test_chunk_local_cumsum_restarts_at_chunks_and_sequences():
    seqlens = (5, 1, 10)
    x = torch.randn(1, 16, 3)
    got = gdn.chunk_local_cumsum(x, 4, seqlens)
    want = torch.empty_like(x)
    start = 0
    for n in seqlens:
        for c in range(start, start + n, 4):
            end = min(c + 4, start + n)
            want[:, c:end] = x[:, c:end].cumsum(1)
        start += n
    assert torch.allclose(got, want, atol=1e-6)
    last = gdn.at_chunk_last(torch.arange(16.0).view(1, 16), 4, seqlens)
    assert last.view(-1).tolist() == [3, 3, 3, 3, 4, 5, 9, 9, 9, 9, 13, 13, 13, 13, 15, 15]
    plain = gdn.chunk_local_cumsum(x, 8)
    assert torch.allclose(plain[:, 8:], x[:, 8:].cumsum(1), atol=1e-6)


def _chunk_state_forward(q, k, w, u, g, gk, h0, scale, seqs, chunk):
    """The chunk form's state pass (spec), fp64 and differentiable: the loss whose gradient
    bwd_dhu computes. Returns (o, v_new, final states, the state entering every chunk)."""
    o, v_new = torch.zeros_like(u), torch.zeros_like(u)
    finals, entering = [], []
    for b, s, e, S in seqs:
        S = S.clone()
        for lo in range(s, e, chunk):
            hi = min(lo + chunk, e)
            S.retain_grad()
            entering.append((b, S))
            qc = q[b, lo:hi]
            if g is not None:
                qc = qc * g[b, lo:hi].exp()[..., None]
            o[b, lo:hi] = scale * torch.einsum("thk,hkv->thv", qc, S)
            v_new[b, lo:hi] = u[b, lo:hi] - torch.einsum("thk,hkv->thv", w[b, lo:hi], S)
            vn = v_new[b, lo:hi]
            decay = torch.ones(S.shape[0], S.shape[1], 1, dtype=S.dtype)
            if g is not None:
                vn = vn * (g[b, hi - 1] - g[b, lo:hi]).exp()[..., None]
                decay = decay * g[b, hi - 1].exp()[:, None, None]
            if gk is not None:
                decay = decay * gk[b, hi - 1].exp()[:, :, None]
            S = decay * S + torch.einsum("thk,thv->hkv", k[b, lo:hi], vn)
        finals.append(S)
    return o, v_new, finals, entering


@pytest.mark.parametrize("seqlens", [None, (70, 1, 79)])
@pytest.mark.parametrize("flags", [(), ("dht", "h0"), ("g",), ("gk",), ("g", "gk", "dht", "h0")])
def test_dhu_reference_is_the_gradient_of_the_state_pass(flags, seqlens):
    shape = gdn.DhuShape(2 if seqlens is None else 1, 150, 2, 8, 8, seqlens=seqlens)
    base = gdn.make_dhu_base(shape, "cpu", seed=3, dtype=torch.float64)
    args = gdn.dhu_mode_inputs(base, shape, "A", flags=flags)
    dh, dh0, dv2 = gdn.dhu_reference(**args)
    chunk = args["chunk_size"]
    if seqlens is None:
        bounds = [(b, 0, shape.T) for b in range(shape.B)]
    else:
        cu = [0, *torch.tensor(seqlens).cumsum(0).tolist()]
        bounds = [(0, a, b) for a, b in itertools.pairwise(cu)]
    # a leaf initial state always (zero when the mode has none), so every state's gradient exists
    h0 = (torch.randn if "h0" in flags else torch.zeros)(len(bounds), 2, 8, 8, dtype=torch.float64)
    h0.requires_grad_()
    u = torch.randn(*args["dv"].shape, dtype=torch.float64, requires_grad=True)
    seqs = [(b, s, e, h0[n]) for n, (b, s, e) in enumerate(bounds)]
    o, v_new, finals, entering = _chunk_state_forward(args["q"], args["k"], args["w"], u, args["g"],
                                                      args["gk"], None, args["scale"], seqs, chunk)
    loss = (o * args["do"]).sum() + (v_new * args["dv"]).sum()
    if "dht" in flags:
        loss = loss + sum((f * args["dht"][n]).sum() for n, f in enumerate(finals))
    loss.backward()
    assert torch.allclose(dv2, u.grad, atol=1e-6, rtol=1e-5)  # dv2 = dL/dv_new = dL/du
    if "h0" in flags:
        assert torch.allclose(dh0.double(), h0.grad, rtol=1e-5, atol=1e-6)
    else:
        assert dh0 is None
    if "dht" not in flags and "h0" not in flags:
        assert torch.allclose(h0.grad, h0.grad)  # (h0 is zero here; its gradient is still defined)
    # dh[c] = gradient of the state leaving chunk c = of the state entering the next chunk
    flat = dh.reshape(-1, *dh.shape[2:]) if seqlens is not None else None
    i = 0
    for n, (b, s, e) in enumerate(bounds):
        nt = -(-(e - s) // chunk)
        for c in range(nt):
            got = flat[i + c] if flat is not None else dh[b, c]
            if c + 1 < nt:
                want = entering[i + c + 1][1].grad
            else:
                want = args["dht"][n].double() if "dht" in flags else torch.zeros_like(got)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        i += nt


def _fake_fla(reference_units_log2=True):
    """An FLA stand-in: bwd_dhu as the reference but taking log2 gate units, like FLA's kernel."""
    def dhu(**kw):
        kw = {k: v for k, v in kw.items() if k not in ("chunk_indices", "chunk_offsets")}
        return gdn.dhu_reference(**gdn.scale_gates(kw, 1 / gdn.RCP_LN2 if reference_units_log2 else 1.0))

    def op(q, k, v, g, beta, initial_state=None, output_final_state=False, gk=None, **_):
        return gdn.recurrence_reference(q, k, v, g, beta, initial_state=initial_state,
                                        output_final_state=output_final_state, gk=gk)

    def kda(q, k, v, g, beta, **kwargs):  # FLA's chunk_kda: the gate argument is per key
        return op(q, k, v, None, beta, gk=g, **kwargs)
    return SimpleNamespace(op=op, kda=kda, dhu=dhu, chunk_indices=lambda cu, c: None,
                           chunk_offsets=lambda cu, c: None, version="fake")


def test_gate_units_probe_finds_either_convention():
    fla = _fake_fla()
    factor, text = gdn.probe_gate_units(gdn.dhu_reference, fla, "cpu")
    assert factor == 1.0 and "natural-log" in text and "NEITHER" not in text
    log2_ours = _fake_fla().dhu  # takes log2 units, as FLA does
    factor, text = gdn.probe_gate_units(log2_ours, fla, "cpu")
    assert factor == pytest.approx(gdn.RCP_LN2) and "log2" in text


def _tiny_dhu_plan(quick):
    return [(gdn.DhuShape(1, 130, 2, 8, 8), ("A", "E")),
            (gdn.DhuShape(1, 130, 2, 8, 8, seqlens=(64, 1, 65)), ("B",))]


def test_dhu_sections_without_fla(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # import fails as if absent
    monkeypatch.setattr(gdn, "_FLA", None)
    monkeypatch.setattr(gdn, "dhu_plan", _tiny_dhu_plan)
    monkeypatch.setattr(gdn, "load_ours", lambda name, notes: gdn.dhu_reference)
    sections, notes = gdn.run_dhu(device="cpu", timer=fake_timer)
    assert any("flash-linear-attention (FLA) not installed" in n for n in notes)
    assert [s.title.split(" (")[0] for s in sections] == ["bwd_dhu mode A", "bwd_dhu mode E",
                                                          "bwd_dhu, packed varlen batches"]
    rows = [r for s in sections for r in s.rows]
    assert all(r.peer == "-" and r.peer_ms is None and r.ours_ms == 1.0 and r.bytes for r in rows)
    text = format_report("t", ENV, sections)
    assert "varlen N3 T130 H2 B" in text and "geometric mean" not in text


def test_dhu_sections_with_a_peer_format_and_round_trip(monkeypatch, tmp_path):
    from flash_dma.benchmarks.common import load_json
    monkeypatch.setattr(gdn, "_FLA", _fake_fla())
    monkeypatch.setattr(gdn, "dhu_plan", _tiny_dhu_plan)
    monkeypatch.setattr(gdn, "load_ours", lambda name, notes: gdn.dhu_reference)
    sections, notes = gdn.run_dhu(device="cpu", timer=fake_timer)
    assert any("ours took them in natural-log units" in n for n in notes)
    assert any("geometric mean speedup vs FLA over all 3 rows 1.00x" in n for n in notes)
    rows = [r for s in sections for r in s.rows]
    assert all(r.peer == "FLA" and r.speedup == 1.0 and r.max_rel < 1e-2 for r in rows)
    # bandwidth: the rate columns show GB/s, the note the share of the ceiling
    row = gdn.Row("B1 T8192 H16", "FLA", 0.2, 0.1, 1e-3, 1e-3, bytes=268e6,
                  note=gdn.bandwidth_note(268e6, 0.1, 0.2, 4.3e12))
    text = format_report("t", ENV, [Section("bwd_dhu mode A", [row])] + sections)
    line = next(ln for ln in text.splitlines() if ln.startswith("B1 T8192 H16 "))
    assert "1340 GB/s" in line and "2680 GB/s" in line and "ours 62% FLA 31% of copy ceiling" in line
    assert "geometric mean vs FLA" in text
    path = tmp_path / "gdn.json"
    write_json(str(path), "t", ENV, sections, notes)
    _, _, back, back_notes = load_json(str(path))
    assert [s.rows for s in back] == [s.rows for s in sections] and back_notes == notes
    assert json.loads(path.read_text())["sections"][0]["geomean_speedup"]["FLA"] == pytest.approx(1.0)


def test_op_section_with_and_without_a_peer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_qla", None)  # FLA's rows alone, whether or not FlashQLA is installed
    monkeypatch.setattr(gdn, "op_plan", lambda quick, cases=None: [gdn.OpCase(1, 20, 2, 8, 8),
                                                       gdn.OpCase(1, 20, 2, 8, 8, states=True),
                                                       gdn.OpCase(1, 20, 2, 8, 8, per_key_gate=True)])
    ours = _fake_fla().op
    monkeypatch.setattr(gdn, "load_ours", lambda name, notes: ours)
    monkeypatch.setattr(gdn, "_FLA", _fake_fla())
    (sec,), notes = gdn.run_op(device="cpu", timer=fake_timer)
    assert [r.config for r in sec.rows[:3]] == ["B1 T20 H2 K8 V8 fwd", "B1 T20 H2 K8 V8 bwd",
                                                "B1 T20 H2 K8 V8 fwd+bwd"]
    assert sec.rows[3].config.endswith("h0+ht fwd")
    assert sec.rows[6].config == "B1 T20 H2 K8 V8 KDA fwd"
    assert all(r.speedup == 1.0 and r.max_abs == 0.0 for r in sec.rows)
    assert any(n.startswith("op bwd: geometric mean") for n in notes)
    assert any(n.startswith("op first calls") for n in notes)

    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.setattr(gdn, "_FLA", None)
    (sec,), notes = gdn.run_op(device="cpu", timer=fake_timer)
    assert any("FLA) not installed" in n for n in notes)
    assert all(r.peer_ms is None and r.ours_ms == 1.0 for r in sec.rows)
    assert "n/a" in format_report("t", ENV, [sec])


def test_op_case_packed_sequences_reach_both_sides_as_cu_seqlens():
    seen = []

    def recording(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
        seen.append((cu_seqlens.tolist(), None if initial_state is None else tuple(initial_state.shape)))
        o, _ = gdn.recurrence_reference(q, k, v, g, beta)  # (the sequences' boundaries aside)
        return o, initial_state * 2 if output_final_state else None

    fla = SimpleNamespace(op=recording, kda=None)
    case = gdn.OpCase(1, 20, 2, 8, 8, states=True, seqlens=(7, 1, 12))
    rows = gdn.run_op_case(case, recording, fla, [], device="cpu", timer=fake_timer)
    assert rows[0].config == "varlen N3 B1 T20 H2 K8 V8 h0+ht fwd"
    assert seen and all(s == ([0, 7, 8, 20], (3, 2, 8, 8)) for s in seen)
    assert all(r.speedup == 1.0 for r in rows)


def _fake_flash_qla(calls: list[int]):
    """A flash_qla stand-in: the recurrence, its output 0.1% larger (so the error columns show it
    is compared), counting its forward and backward calls (so a timer can tell it ran)."""
    class CountBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            calls[0] += 1
            return grad

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        assert q.shape[-1] == v.shape[-1] == 128 and g.dim() == 3  # as the real one: K = V = 128, g per head
        calls[0] += 1
        o, ht = gdn.recurrence_reference(q, k, CountBackward.apply(v), g, beta, initial_state=initial_state,
                                         output_final_state=output_final_state)
        return o * 1.001, ht

    module = types.ModuleType("flash_qla")
    module.__version__ = "0.1.3-fake"
    module.chunk_gated_delta_rule = chunk_gated_delta_rule
    return module


def test_op_section_beside_flash_qla(monkeypatch):
    calls = [0]
    monkeypatch.setitem(sys.modules, "flash_qla", _fake_flash_qla(calls))
    monkeypatch.setattr(gdn, "op_plan", lambda quick, cases=None: [
        gdn.OpCase(1, 20, 2), gdn.OpCase(1, 20, 2, states=True), gdn.OpCase(1, 20, 2, 64, 64),
        gdn.OpCase(1, 20, 2, per_key_gate=True)])
    monkeypatch.setattr(gdn, "load_ours", lambda name, notes: _fake_fla().op)
    monkeypatch.setattr(gdn, "_FLA", _fake_fla())

    def timer(fn):  # FlashQLA "takes" 2 ms, the others 1 ms
        before = calls[0]
        fn()
        return 2.0 if calls[0] > before else 1.0
    (sec,), notes = gdn.run_op(device="cpu", timer=timer)
    assert [(r.config, r.peer) for r in sec.rows[:4]] == [
        ("B1 T20 H2 fwd", "FLA"), ("B1 T20 H2 fwd", "FlashQLA"), ("B1 T20 H2 bwd", "FLA"),
        ("B1 T20 H2 bwd", "FlashQLA")]
    assert len(sec.rows) == 4 * 3 * 2
    fla_rows = [r for r in sec.rows if r.peer == "FLA"]
    assert all(r.speedup == 1.0 and r.max_abs == 0.0 for r in fla_rows)
    qla_rows = [r for r in sec.rows if r.peer == "FlashQLA"]
    timed, no_path = qla_rows[:6], qla_rows[6:]
    assert all(r.speedup == 2.0 and r.ours_ms == 1.0 and 5e-4 < r.max_rel < 1e-2 and not r.note for r in timed)
    assert all(r.peer_ms is None and r.speedup is None and r.max_abs is None for r in no_path)
    assert {r.note for r in no_path if "K64" in r.config} == {"FlashQLA: no path (head dims K128 V128 only)"}
    assert {r.note for r in no_path if "KDA" in r.config} == {"FlashQLA: no path (no per-key gate, KDA)"}
    assert any(n.startswith("peer: FlashQLA 0.1.3-fake") for n in notes)
    assert "op fwd: geometric mean speedup vs FlashQLA over all 2 rows 2.00x" in notes
    assert "op fwd: geometric mean speedup vs FLA over all 4 rows 1.00x" in notes
    first = next(n for n in notes if n.startswith("op first calls"))
    assert sorted(p.split(":")[0] for p in first.split(": ", 1)[1].split("; ") if p.startswith("FlashQLA")) == [
        "FlashQLA B1 T20 H2", "FlashQLA B1 T20 H2 h0+ht"]  # its no-path cases never ran
    text = format_report("t", ENV, [sec])
    assert "geometric mean vs FlashQLA" in text and "FlashQLA: no path" in text


def test_flash_qla_missing_or_broken_is_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_qla", None)  # import fails as if absent
    notes = []
    assert gdn.load_flash_qla(notes) is None
    assert len(notes) == 1 and notes[0].startswith("FlashQLA not available") and "\n" not in notes[0]
    monkeypatch.setitem(sys.modules, "flash_qla", types.ModuleType("flash_qla"))  # no chunk_gated_delta_rule
    notes = []
    assert gdn.load_flash_qla(notes) is None
    assert len(notes) == 1 and notes[0].startswith("FlashQLA import failed: AttributeError")
    # the op report goes on without FlashQLA rows
    monkeypatch.setattr(gdn, "op_plan", lambda quick, cases=None: [gdn.OpCase(1, 20, 2, 8, 8)])
    monkeypatch.setattr(gdn, "load_ours", lambda name, notes: _fake_fla().op)
    monkeypatch.setattr(gdn, "_FLA", _fake_fla())
    (sec,), notes = gdn.run_op(device="cpu", timer=fake_timer)
    assert [r.peer for r in sec.rows] == ["FLA"] * 3
    assert any("no FlashQLA peer" in n for n in notes)


def test_fla_missing_is_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)
    reason = gdn.fla_available()
    assert reason is not None and "flash-linear-attention" in reason


def test_copy_ceiling_table():
    assert gdn.copy_ceiling("NVIDIA H200", measure=False)[0] == 4.3e12
    value, source = gdn.copy_ceiling("Some GPU", measure=False)
    assert value is None and "unknown" in source
    assert gdn.bandwidth_note(1e9, 1.0, None, None) == ""


def test_cli_knows_the_gdn_ops():
    from flash_dma.cli import OPS
    assert build_parser().parse_args(["bench", "gdn"]).op == "gdn"
    assert build_parser().parse_args(["bench", "dhu", "--quick"]).op == "dhu"
    assert OPS == ("attention", "gdn", "dhu", "decode")


def test_slow_decay_case_keeps_states_across_chunks():
    """The slow-decay op case's gates leave a 64-token chunk most of its state (log decay about
    -0.06), the default ones almost none (about -12)."""
    from flash_dma.benchmarks.gdn import OpCase, make_op_inputs, op_plan
    slow = make_op_inputs(OpCase(1, 4096, 2, 16, 16, slow_decay=True), device="cpu")["g"]
    strong = make_op_inputs(OpCase(1, 4096, 2, 16, 16), device="cpu")["g"]
    assert -0.2 < slow.mean().item() * 64 < 0 and strong.mean().item() * 64 < -5
    assert "B1 T32768 H16 slow-decay" in [c.label for c in op_plan(False)]


def test_attention_cases_by_label_and_plain_peers(monkeypatch):
    """`--cases` picks attention cases by label as it does gdn's; the plain rows carry FA4 and
    flash-sparse-attn's dense kernel beside SDPA."""
    from flash_dma.benchmarks import attention
    seen = []
    monkeypatch.setattr(attention, "run_case", lambda case, notes, progress=None: seen.append(case.label) or [])
    attention.run(False, None, cases=["B4 H16 S4096 D128 causal", "B4 H16 S4096 D128"])
    assert seen == ["B4 H16 S4096 D128", "B4 H16 S4096 D128 causal"]  # in the report's order
    with pytest.raises(ValueError, match="not attention cases"):
        attention.run(False, None, cases=["B3 H5 S7 D9"])
    plain = [c for _, group in attention.sections(False) for c in group if c.label == "B4 H16 S4096 D128"][0]
    assert {"sdpa-cudnn", "fa4", "flash-sparse-attn"} <= set(plain.peers)
    args = build_parser().parse_args(["bench", "attention", "--cases", "B4 H16 S4096 D128"])
    assert args.cases == "B4 H16 S4096 D128"


def test_gdn_peak_memory_note():
    """Each side's peak allocation of one fwd+bwd is reported per case (a note line, in the JSON
    too); sides without a measurement (no CUDA, or the peer did not run) are left out."""
    def result(peak):
        return gdn.OpResult(1.0, 2.0, 3.0, [], [], 0.1, peak_mib=peak)
    line = gdn.peak_memory_note("B1 T32768 H16", {"ours": result(812.4), "FLA": result(1024.0), "FlashQLA": None})
    assert line == "peak memory of one fwd+bwd above the live set, MiB, B1 T32768 H16: ours 812, FLA 1024"
    assert gdn.peak_memory_note("x", {"ours": result(None)}) is None
    assert gdn._peak_mib(lambda: None, "cpu") is None


def test_gdn_host_time_note():
    """Each side's host time of one fwd+bwd call is reported beside its timed fwd+bwd, so that a
    row bound by the machine's host shows as such; sides without a measurement are left out."""
    def result(host):
        return gdn.OpResult(1.0, 2.0, 3.25, [], [], 0.1, host_ms=host)
    line = gdn.host_time_note("B2 T4096 H16 KDA", {"ours": result(1.5624), "FLA": result(None), "FlashQLA": None})
    assert line.startswith("host ms of one fwd+bwd call / its timed ms, B2 T4096 H16 KDA: ours 1.562 / 3.250 (")
    assert gdn.host_time_note("x", {"ours": result(None)}) is None
    assert gdn._host_ms(lambda: None, "cpu") is None


def test_attention_walk_peer_runs_ours_without_compaction(monkeypatch):
    """The top-k row's "ours-walk" peer: our call with attention_keywise_compaction off, beside
    ours compacted ("on" here, as "auto" is where CuTe runs)."""
    from flash_dma import topk_mask_from_bias
    from flash_dma.benchmarks import attention
    from flash_dma.ops.dynamic_mask_attention import compaction
    from flash_dma.runtime import config
    calls = []
    real = compaction.compact
    monkeypatch.setattr(compaction, "compact", lambda *a: calls.append(a[-1].shape[-1]) or real(*a))
    case = attention.AttnCase("tiny top-8", 1, 2, 40, 16, bias="key", mask="topk-8")
    q, k, v, dout = (torch.randn(1, 40, 2, 16, dtype=torch.float16) for _ in range(4))
    bias = torch.randn(1, 2, 1, 40, dtype=torch.float16)
    x = attention.Inputs(q, k, v, bias, topk_mask_from_bias(bias, 8), None, dout)
    with config.overrides(attention_keywise_compaction="on"):
        fwd, leaves, _, _ = attention.PEERS["ours-walk"](case, x)
        fwd()
        assert calls == []
        attention.ours(case, x)[0]()
        assert calls == [8]


def test_write_lines_names_the_report_by_device_and_date(tmp_path):
    """A bench script's text report: <stem>-<device>-<date>.txt in the folder, the lines as given."""
    import datetime
    from flash_dma.benchmarks.common import write_lines
    path = write_lines(str(tmp_path / "out"), "gdn-kernels", ["a", "b"])
    name = path.rsplit("/", 1)[-1]
    assert name.startswith("gdn-kernels-") and name.endswith(f"-{datetime.date.today():%Y%m%d}.txt")
    assert " " not in name and open(path).read() == "a\nb\n"


def test_op_sides_are_timed_in_alternating_rounds():
    """_time_in_rounds: each round times every side in turn (the backward on a graph built for
    it), medians the rounds, derives a backward that cannot run twice and drops a failing side."""
    order = []

    def timer(fn):
        return fn()

    def side(name, fwd_ms, bwd=None, fwd_error=None):
        def fwd():
            order.append((name, "fwd"))
            if fwd_error is not None:
                raise fwd_error
            return fwd_ms

        def make_bwd():
            order.append((name, "graph"))
            return bwd or (lambda: 1.0)
        return {"fwd": fwd, "fwd+bwd": lambda: fwd_ms + 2.0, "bwd": make_bwd}

    def result():
        return gdn.OpResult(float("nan"), float("nan"), float("nan"), [], [], 0.0)

    def frees():
        raise RuntimeError("Trying to backward through the graph a second time")
    sides = {"ours": side("ours", 1.0), "FLA": side("FLA", 3.0, bwd=frees),
             "FlashQLA": side("FlashQLA", 2.0, fwd_error=ValueError("no path"))}
    results = {who: result() for who in sides}
    failed = gdn._time_in_rounds(sides, results, timer, 2)
    assert list(failed) == ["FlashQLA"] and isinstance(failed["FlashQLA"], ValueError)
    assert [who for who, step in order if step == "fwd"] == ["ours", "FLA", "FlashQLA", "ours", "FLA"]
    assert (results["ours"].fwd_ms, results["ours"].bwd_ms, results["ours"].fwdbwd_ms) == (1.0, 1.0, 3.0)
    assert results["FLA"].bwd_ms == 2.0 and results["FLA"].note == "bwd = (fwd+bwd) - fwd"
    with pytest.raises(ValueError, match="rounds"):
        gdn._time_in_rounds(sides, results, timer, 0)


def test_keep_states_case_reaches_both_sides_as_disable_recompute():
    seen = []

    def recording(who):
        def op(q, k, v, g, beta, initial_state=None, output_final_state=False, gk=None, disable_recompute=None, **_):
            seen.append((who, disable_recompute, gk is not None))
            return gdn.recurrence_reference(q, k, v, g, beta, gk=gk)
        return op

    fla = SimpleNamespace(op=None, kda=recording("fla"))
    case = gdn.OpCase(1, 20, 2, 8, 8, per_key_gate=True, keep_states=True)
    rows = gdn.run_op_case(case, recording("ours"), fla, [], device="cpu", timer=fake_timer)
    assert rows[0].config == "B1 T20 H2 K8 V8 KDA no-recompute fwd"
    assert {w for w, *_ in seen} == {"ours", "fla"} and all(flag is True for _, flag, _ in seen)
    assert all(gated for who, _, gated in seen if who == "ours")  # ours takes the per-key gate as gk
