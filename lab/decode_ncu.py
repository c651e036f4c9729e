"""Nsight Compute probe of decode on the GPU: flashc on a contiguous cache, flashc on a paged copy (pages of 16,
shuffled), and torch SDPA's cuDNN backend, one call each inside an NVTX range "go", at issue 17's shape (B 16,
Nk 32768, H 32 / Hkv 8, D 128, bf16; `python3 lab/decode_ncu.py B NK` for another B x Nk). Used for the L2-promotion measurement in lab/LOG.md:

    M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,\
lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sector_op_read_hit_rate.pct
    FLASHC_LIBRARY=<build>/libflashc.so ncu --clock-control none --nvtx --nvtx-include "go/" --metrics $M \
        python3 lab/decode_ncu.py
"""
import sys, torch
sys.path.insert(0, "python")
import flashc
from torch.nn.attention import SDPBackend, sdpa_kernel
B, N = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (16, 32768)
H, Hkv, D, ps, dt = 32, 8, 128, 16, torch.bfloat16
q = torch.randn(B, 1, H, D, device="cuda", dtype=dt)
kc, vc = (torch.randn(B, N, Hkv, D, device="cuda", dtype=dt) for _ in range(2))
lens = torch.full((B,), N, device="cuda", dtype=torch.int32)
pages = N // ps
table = torch.randperm(B * pages, generator=torch.Generator().manual_seed(1)).to("cuda", torch.int32).view(B, pages)
kp, vp = (torch.empty(B * pages, ps, Hkv, D, device="cuda", dtype=dt) for _ in range(2))
kp[table.flatten().long()] = kc.view(B * pages, ps, Hkv, D)
vp[table.flatten().long()] = vc.view(B * pages, ps, Hkv, D)
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("go")
a = flashc.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
b = flashc.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, causal=True, block_table=table)
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    c = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), enable_gqa=True)
torch.cuda.synchronize()
print("paged == contiguous:", torch.equal(a, b))
