"""Probe for issue 11 (not a benchmark of record): the logit-chunk GEMMs in the standard
[rows, V] layout against the transposed [V, rows] one, whose bias epilogue can subtract a
per-row shift for free. Variants interleaved over rounds; medians of CUDA-event timings.

    python3 scripts/probe_logits_gemm.py  (writes $OUT/probe_gemm.json)
"""
import json, os, statistics, torch
V, D = 128256, 4096
torch.manual_seed(0)
w = (torch.randn(V, D, device="cuda") / D**0.5).bfloat16()
res = {}
for rows in (640, 656, 704):
    h = (torch.randn(rows, D, device="cuda") * 2.5).bfloat16()
    s = (torch.randn(rows, device="cuda") * 10).bfloat16()
    out32 = torch.empty(rows, V, device="cuda")
    g16 = torch.randn(rows, V, device="cuda").bfloat16()
    gT = g16.t().contiguous()
    outT = torch.empty(V, rows, device="cuda", dtype=torch.bfloat16)
    gh = torch.empty(rows, D, device="cuda"); ghT = torch.empty(D, rows, device="cuda")
    gw = torch.zeros(V, D, device="cuda", dtype=torch.bfloat16)
    variants = {
        "a logits fp32 [rows,V]": lambda: torch.mm(h, w.t(), out_dtype=torch.float32, out=out32),
        "d logits bf16 [V,rows] bias": lambda: torch.addmm(s, w, h.t(), out=outT),
        "f hidden G@W (G [rows,V])": lambda: torch.mm(g16, w, out_dtype=torch.float32, out=gh),
        "f1 hidden GT.t()@W": lambda: torch.mm(gT.t(), w, out_dtype=torch.float32, out=gh),
        "f2 hidden W.t()@GT -> [D,rows]": lambda: torch.mm(w.t(), gT, out_dtype=torch.float32, out=ghT),
        "g weight += G.t()@h": lambda: gw.addmm_(g16.t(), h),
        "g1 weight += GT@h": lambda: gw.addmm_(gT, h),
    }
    times = {k: [] for k in variants}
    st, en = torch.cuda.Event(True), torch.cuda.Event(True)
    for k, fn in variants.items():
        for _ in range(3): fn()
    for rnd in range(6):
        for k, fn in variants.items():
            torch.cuda.synchronize(); st.record()
            for _ in range(15): fn()
            en.record(); torch.cuda.synchronize()
            times[k].append(st.elapsed_time(en) / 15)
    for k, v in times.items():
        res[f"{rows} {k}"] = statistics.median(v)
        print(f"{rows} {k:34s} {statistics.median(v):.4f} ms (min {min(v):.4f} max {max(v):.4f})", flush=True)
    std = res[f"{rows} a logits fp32 [rows,V]"] + res[f"{rows} f hidden G@W (G [rows,V])"] + res[f"{rows} g weight += G.t()@h"]
    tr = res[f"{rows} d logits bf16 [V,rows] bias"] + min(res[f"{rows} f1 hidden GT.t()@W"], res[f"{rows} f2 hidden W.t()@GT -> [D,rows]"]) + res[f"{rows} g1 weight += GT@h"]
    print(f"{rows} three GEMMs: standard {std:.4f} ms, transposed {tr:.4f} ms", flush=True)
    del out32, g16, gT, outT, gw
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_gemm.json"), "w"), indent=1)
