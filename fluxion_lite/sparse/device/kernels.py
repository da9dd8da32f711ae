"""Fused Triton kernels for the device-selection decode step (device_graph.py): a few kernels per layer, not ~100.

Why: on the H200 host the graphed step spent ~10 of its ~22 ms (llama3.1-8b shape, 32K, batch 1) in ~130 small
torch kernels per layer (index arithmetic, masks, segment softmax, LSE merge), each costing a few microseconds even
inside a CUDA graph. The same work in five kernels:

  append_token      the new K/V into the device sink/ring slab and the host store's staging rows, the new key
                    into the bf16 min/max block summaries (min rounded down, max up: the bound holds)
                                                                              (was ~17 torch kernels)
  stream_attention  sink + window of every group, online softmax, in one-tile splits merged by combine (was ~12)
  block_scores      Quest bound (or midrange) of every block, pins, eligible range (was ~20)
  block_attention   one program per (row, selected block): its g tokens read straight from the pinned host store
                    through the zero-copy alias (or from the pin pool / reuse cache in device memory), the
                    group's r query heads -> partial (o, max, sum)   (was ~60, together with the combine)
                    One block per program on purpose: runs of 4 blocks per program (1/4 of the programs and
                    partials) measured no faster (H200, 8B shape, 32K b1: 7.46 / 7.39 vs 7.42 / 7.08 ms; the
                    kernel 33.8 us per layer against combine's saving of ~4 us; 8 blocks: 14.3 ms), as the reads
                    over PCIe want many programs in flight. The products are broadcast sums in registers for
                    groups of <= 8 query heads (tl.dot padded to 16 rows above). Stages 1 / 2 split it into a
                    fetch into the reuse cache and the attention (device_graph.py's early block choice)
  combine           per (row, group, head) and 32 output columns: the partials and the streaming part merged by
                    LSE -> output in the model dtype

device_topk.select_top chooses the blocks between block_scores and block_attention. Layouts are device_graph's and device_select's:
  q           [B, Hkv, r, D] (any strides)               summaries [slots, Hkv, blocks, 2, D] bf16 (min, max)
  span        [chunks, CHUNK_TOKENS * D] store dtype: a page is Hkv * cph chunks of K then Hkv * cph chunks of V
  tables      [slots, pages] int64: the span row of each page's first chunk
  flat list   entry i = rank flat_j[i] of group flat_h[i]; a group's entries are contiguous (starts/caps)

Used on CUDA when Triton imports (the setting FLUXION_TRITON=0 turns it off; =1 forces it on any device, which with
TRITON_INTERPRET=1 runs the kernels on the CPU: that is how the tests check them against the torch path). The A/B
knobs of block_attention and combine (FLUXION_BA_*, FLUXION_PDL) are arguments, which the device step passes from
its settings (fluxion_lite.settings.ExperimentalSettings; the defaults here are the settings' defaults).
"""
from __future__ import annotations

import functools
import warnings

import torch

from fluxion_lite.sparse.device.summaries import PINNED_SCORE
from fluxion_lite.hostkv.store import CHUNK_TOKENS
from fluxion_lite.settings import ExperimentalSettings, Settings

try:  # Triton ships with CUDA builds of torch; the CPU wheel has none (then device_graph keeps its torch path)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None  # type: ignore[assignment]


_probed: dict[str, bool] = {}
COMBINE_COLUMNS = 32  # combine: output columns per program
COMBINE_TILE_MAX = 256  # combine: the most retrieval entries a program merges per round
# block_attention multiplies in registers (broadcast and sum) up to this many query heads per group (padded to a
# power of two), with tl.dot above; always_dot (FLUXION_BA_DOT=1) takes tl.dot always, padded to 16 rows (A/B knob)
BROADCAST_MAX_R = 8


def enabled(device: torch.device, settings: Settings | None = None) -> bool:
    """Whether device_graph should use these kernels on `device`: on CUDA once a probe kernel compiled and ran there
    (a Triton that imports but cannot build for this GPU or driver leaves the torch path in place, with a warning);
    the setting FLUXION_TRITON (settings.triton; None: Settings.load()) turns them off (0) or on anywhere (1)."""
    flag = (settings if settings is not None else Settings.load()).triton
    if triton is None or flag is False:
        return False
    if flag is True or device.type != "cuda":
        return flag is True
    key = str(device)
    if key not in _probed:
        try:
            out = torch.zeros(4, device=device)
            _probe_kernel[(1,)](out, N=4)
            torch.cuda.synchronize(device)
            _probed[key] = bool((out == 1.0).all())
        except Exception as e:  # noqa: BLE001 - any failure to build or launch: keep the torch ops path
            warnings.warn(f"Triton kernels unusable on {device} ({type(e).__name__}: {e}); the device decode step "
                          "runs on torch ops (FLUXION_TRITON=0 silences this)", RuntimeWarning, stacklevel=2)
            _probed[key] = False
    return _probed[key]


def pdl_enabled(device: torch.device, requested: bool = ExperimentalSettings.pdl) -> bool:
    """Whether gemv_kernels' one-row kernels and dense_kernels' RMS norm launch as programmatic dependent launches
    (requested: the setting FLUXION_PDL=1, which those kernels take as their `pdl` argument; sm_90 and a Triton with
    gdc_wait): a kernel's programs may then be scheduled while the previous kernel on the stream finishes, request
    their first weight tile, and wait (griddepcontrol.wait) before reading what that kernel wrote; combine and the
    norm let the next kernel be scheduled from their start. Off by default until measured (docs/hybrid.md)."""
    return _pdl_supported(device.index if device.index is not None else torch.cuda.current_device()) \
        if requested and device.type == "cuda" else False


@functools.cache
def _pdl_supported(index: int) -> bool:
    import triton.language.extra.cuda as cuda_extra

    return (torch.cuda.get_device_capability(index) >= (9, 0) and hasattr(cuda_extra, "gdc_wait")
            and hasattr(cuda_extra, "gdc_launch_dependents"))


def launch_args(pdl: bool) -> dict:
    """launch_pdl only when wanted, so that a Triton without the option is never passed it."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two >= n (and >= floor): Triton block sizes."""
    return max(floor, 1 << max(0, (n - 1).bit_length()))


if triton is not None:
    @triton.jit
    def _probe_kernel(out_ptr, N: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, N), tl.full((N,), 1.0, tl.float32))

    @triton.jit
    def _group_queries(q_ptr, b, h, R, q_b, q_h, q_r, D: tl.constexpr, R_PAD: tl.constexpr):
        """Row b's queries of group h as fp32 [R_PAD, D]; the padding rows beyond R are 0."""
        rr, dd = tl.arange(0, R_PAD), tl.arange(0, D)
        return tl.load(q_ptr + b * q_b + h * q_h + rr[:, None] * q_r + dd[None, :], mask=rr[:, None] < R,
                       other=0.0).to(tl.float32)

    @triton.jit
    def _bf16_directed(x, UP: tl.constexpr):
        """fp32 x -> the bf16 value nearest x toward +inf (UP) or -inf, returned as fp32 (exact in bf16). Triton's
        casts round to nearest or toward zero only: cutting the low 16 bits rounds toward zero, which is the wanted
        direction for x < 0 rounding up and x >= 0 rounding down; otherwise an inexact x steps one bf16 unit away
        from zero (+1 on the kept bits, sign-magnitude). Same as device_select.round_up_bf16 / round_down_bf16."""
        bits = x.to(tl.int32, bitcast=True)
        cut = bits & -65536  # 0xFFFF0000
        if UP:
            away = bits >= 0
        else:
            away = bits < 0
        step = tl.where(((bits & 65535) != 0) & away, 65536, 0)
        return tl.where(x == x, (cut + step).to(tl.float32, bitcast=True), x)  # a NaN stays NaN

    @triton.jit
    def _append_token_kernel(k_ptr, v_ptr, near_ptr, stage_ptr, s_ptr, slots_ptr, pos_ptr, ring_ptr, HKV,
                             k_row, k_head, v_row, v_head, n_slot, n_part, n_head, n_tok, st_row, st_part, st_head,
                             s_slot, s_head, s_blk, G: tl.constexpr, D: tl.constexpr, DIRECTED: tl.constexpr):
        pid = tl.program_id(0)  # = b * HKV + h
        b, h = pid // HKV, pid % HKV
        dd = tl.arange(0, D)
        slot = tl.load(slots_ptr + b)
        pos = tl.load(pos_ptr + b)
        ring = tl.load(ring_ptr + b)
        key = tl.load(k_ptr + b * k_row + h * k_head + dd)  # [D] model dtype
        val = tl.load(v_ptr + b * v_row + h * v_head + dd)
        slab = near_ptr + slot * n_slot + h * n_head + ring * n_tok + dd  # the device sink/ring slab
        tl.store(slab, key.to(near_ptr.dtype.element_ty))
        tl.store(slab + n_part, val.to(near_ptr.dtype.element_ty))
        staged = stage_ptr + b * st_row + h * st_head + dd  # the step's rows for the host store
        tl.store(staged, key.to(stage_ptr.dtype.element_ty))
        tl.store(staged + st_part, val.to(stage_ptr.dtype.element_ty))
        kf = key.to(tl.float32)
        base = s_ptr + slot * s_slot + h * s_head + (pos // G) * s_blk + dd
        first = (pos % G) == 0  # a new block: its old contents are stale
        lo = tl.where(first, kf, tl.minimum(tl.load(base).to(tl.float32), kf))
        hi = tl.where(first, kf, tl.maximum(tl.load(base + D).to(tl.float32), kf))
        if DIRECTED:  # bf16 summaries: the stored bounds are bf16 values, so min(stored, k) rounded down is the
            lo = _bf16_directed(lo, False)  # block's exact min rounded down, however its tokens arrived
            hi = _bf16_directed(hi, True)
        tl.store(base, lo.to(s_ptr.dtype.element_ty))
        tl.store(base + D, hi.to(s_ptr.dtype.element_ty))

    @triton.jit
    def _stream_attention_kernel(q_ptr, near_ptr, bias_ptr, gidx_ptr, slots_ptr, o_ptr, m_ptr, l_ptr, B, HKV, R,
                                 LTOT, SPAN, scale, q_b, q_h, q_r, n_slot, n_part, n_head, n_tok,
                                 D: tl.constexpr, R_PAD: tl.constexpr, TILE: tl.constexpr):
        pid, split = tl.program_id(0), tl.program_id(1)  # pid = b * HKV + h; split: slots [split * SPAN, + SPAN)
        b, h = pid // HKV, pid % HKV
        rr, dd, tt0 = tl.arange(0, R_PAD), tl.arange(0, D), tl.arange(0, TILE)
        slot = tl.load(slots_ptr + b)
        bias_row = bias_ptr + (tl.load(gidx_ptr + h) * B + b) * LTOT  # the group's block size sets its bounds
        q = _group_queries(q_ptr, b, h, R, q_b, q_h, q_r, D, R_PAD)  # [R_PAD, D]
        m = tl.full((R_PAD,), float("-inf"), tl.float32)
        l_sum = tl.zeros((R_PAD,), tl.float32)
        acc = tl.zeros((R_PAD, D), tl.float32)
        slab = near_ptr + slot * n_slot + h * n_head
        lo = split * SPAN
        hi = tl.minimum(lo + SPAN, LTOT)
        for t0 in range(lo, hi, TILE):
            tt = t0 + tt0
            bias = tl.load(bias_row + tt, mask=tt < hi, other=float("-inf"))  # [TILE]: 0 attended, -inf not
            live = bias > float("-inf")
            # slots not attended may hold any bits (0 x NaN = NaN): they are never loaded
            k = tl.load(slab + tt[:, None] * n_tok + dd[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            v = tl.load(slab + n_part + tt[:, None] * n_tok + dd[None, :], mask=live[:, None],
                        other=0.0).to(tl.float32)
            logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale + bias[None, :]  # [R_PAD, TILE]
            new_m = tl.maximum(m, tl.max(logits, axis=1))
            safe = tl.where(new_m == float("-inf"), 0.0, new_m)  # a tile before any attended slot
            alpha = tl.exp(m - safe)
            p = tl.exp(logits - safe[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = new_m
        # a partial like block_attention's: o not yet divided by l; a split without attended slots has m = -inf,
        # l = 0, o = 0, which combine weighs 0
        row = (pid * tl.num_programs(1) + split) * R + rr  # [B, Hkv, S, R]
        tl.store(o_ptr + row[:, None] * D + dd[None, :], acc, mask=rr[:, None] < R)
        tl.store(m_ptr + row, m, mask=rr < R)
        tl.store(l_ptr + row, l_sum, mask=rr < R)

    @triton.jit
    def _block_scores_kernel(q_ptr, s_ptr, slots_ptr, bounds_ptr, pin_ptr, out_ptr, B, HKV, R, NB,
                             q_b, q_h, q_r, s_slot, s_head, s_blk, pin_b, pin_h,
                             D: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PINS: tl.constexpr,
                             PINNED: tl.constexpr, MIDRANGE: tl.constexpr):
        pid = tl.program_id(0)  # = b * HKV + h
        b, h = pid // HKV, pid % HKV
        dd = tl.arange(0, D)
        q = _group_queries(q_ptr, b, h, R, q_b, q_h, q_r, D, R_PAD)  # [R_PAD, D]
        if MIDRANGE:  # max . q/2 + min . q/2 = q . (min + max) / 2
            q_pos = tl.sum(q, axis=0) * 0.5  # [D]
            q_neg = q_pos
        else:
            q_pos = tl.sum(tl.maximum(q, 0.0), axis=0)  # [D]: the bound summed over the group's heads
            q_neg = tl.sum(tl.minimum(q, 0.0), axis=0)
        nn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = nn < NB
        slot = tl.load(slots_ptr + b)
        base = s_ptr + slot * s_slot + h * s_head + nn[:, None] * s_blk + dd[None, :]
        mins = tl.load(base, mask=inside[:, None], other=0.0).to(tl.float32)  # [BLOCK_N, D]
        maxs = tl.load(base + D, mask=inside[:, None], other=0.0).to(tl.float32)
        score = tl.sum(maxs * q_pos[None, :] + mins * q_neg[None, :], axis=1)  # [BLOCK_N]
        if HAS_PINS:
            pinned = tl.load(pin_ptr + b * pin_b + h * pin_h + nn, mask=inside, other=0)
            score = tl.where(pinned != 0, PINNED, score)
        lo = tl.load(bounds_ptr + b)
        hi = tl.load(bounds_ptr + B + b)
        score = tl.where((nn >= lo) & (nn < hi), score, float("-inf"))
        tl.store(out_ptr + pid * NB + nn, score, mask=inside)

    @triton.jit
    def _block_attention_kernel(q_ptr, ids_ptr, vals_ptr, flat_h_ptr, flat_j_ptr, krow_ptr, slots_ptr, tab_ptr,
                                span_ptr, pslot_ptr, pkv_ptr, entry_ptr, hit_ptr, rkv_ptr, o_ptr, m_ptr, l_ptr, N,
                                HKV, R, WIDTH, PAGES, PAGE_TOKENS, CPH, NBS, RC, scale, q_b, q_h, q_r, tab_slot,
                                N_FLAT, D: tl.constexpr, G: tl.constexpr, R_PAD: tl.constexpr, CHUNK: tl.constexpr,
                                HAS_CACHE: tl.constexpr, HAS_REUSE: tl.constexpr, STAGE: tl.constexpr,
                                DOT: tl.constexpr, ENTRIES: tl.constexpr):
        b = tl.program_id(1)  # batch row b; flat entries ENTRIES * program_id(0) + e
        for e in tl.static_range(ENTRIES):
            i = tl.program_id(0) * ENTRIES + e
            if i < N_FLAT:
                _block_entry(q_ptr, ids_ptr, vals_ptr, flat_h_ptr, flat_j_ptr, krow_ptr, slots_ptr, tab_ptr,
                             span_ptr, pslot_ptr, pkv_ptr, entry_ptr, hit_ptr, rkv_ptr, o_ptr, m_ptr, l_ptr, N, HKV,
                             R, WIDTH, PAGES, PAGE_TOKENS, CPH, NBS, RC, scale, q_b, q_h, q_r, tab_slot, i, b, D, G,
                             R_PAD, CHUNK, HAS_CACHE, HAS_REUSE, STAGE, DOT)

    @triton.jit
    def _block_entry(q_ptr, ids_ptr, vals_ptr, flat_h_ptr, flat_j_ptr, krow_ptr, slots_ptr, tab_ptr, span_ptr,
                     pslot_ptr, pkv_ptr, entry_ptr, hit_ptr, rkv_ptr, o_ptr, m_ptr, l_ptr, N, HKV, R, WIDTH, PAGES,
                     PAGE_TOKENS, CPH, NBS, RC, scale, q_b, q_h, q_r, tab_slot, i, b, D: tl.constexpr,
                     G: tl.constexpr, R_PAD: tl.constexpr, CHUNK: tl.constexpr, HAS_CACHE: tl.constexpr,
                     HAS_REUSE: tl.constexpr, STAGE: tl.constexpr, DOT: tl.constexpr):
        """Flat entry i of batch row b: its block's rows from wherever they are, then attention or (STAGE 1) the
        fetch into the reuse cache."""
        h = tl.load(flat_h_ptr + i)
        j = tl.load(flat_j_ptr + i)
        at = (b * HKV + h) * WIDTH + j
        blk = tl.load(ids_ptr + at)
        valid = (tl.load(vals_ptr + at) > float("-inf")) & (j < tl.load(krow_ptr + b * HKV + h))
        dd, tt = tl.arange(0, D), tl.arange(0, G)
        tok = blk * G + tt  # [G] absolute positions
        page = tl.minimum(tok // PAGE_TOKENS, PAGES - 1)
        slot = tl.load(slots_ptr + b)
        live = (tt * 0 + valid.to(tl.int32)) > 0  # [G]: a masked entry reads nothing
        # Each token row is read from exactly one place: the host store over PCIe, the pin pool or the reuse
        # cache. The three row addresses are looked up side by side and one pointer per row is chosen, so the
        # K and V tiles are loaded once (three masked loads of each kept ~3x the registers live, and the host
        # address waited for the cache lookups)
        first = tl.load(tab_ptr + slot * tab_slot + page, mask=live, other=0)  # [G]
        k_ptr = span_ptr + ((first + h * CPH + (tok % PAGE_TOKENS) // CHUNK) * CHUNK + tok % CHUNK) * D  # [G]
        v_ptr = k_ptr + HKV * CPH * CHUNK * D  # V chunks follow the page's K chunks
        on_host = live
        entry, reuse_k = b * 0 - 1, tt * 0  # no reuse entry (HAS_REUSE replaces them)
        if HAS_CACHE:  # a pinned block held in device memory (the pin pool [P, 2, G, D]) is read from there
            cached_slot = tl.load(pslot_ptr + (b * HKV + h) * NBS + blk, mask=valid, other=-1).to(tl.int64)
            on_dev = live & ((tt * 0 + cached_slot) >= 0)  # [G]
            dev_k = ((cached_slot * 2) * G + tt) * D  # [G] K row starts in the pool; V follows at + G * D
            k_ptr = tl.where(on_dev, pkv_ptr + dev_k, k_ptr)
            v_ptr = tl.where(on_dev, pkv_ptr + dev_k + G * D, v_ptr)
            on_host = on_host & ~on_dev
        if HAS_REUSE:  # a block chosen at an earlier step may still be in the reuse cache [B, Hkv, RC, 2, G, D]
            entry = tl.load(entry_ptr + at, mask=valid, other=-1).to(tl.int64)
            if STAGE == 2:  # a fetch (STAGE 1) put every kept miss in its entry: all blocks with one are there
                reused = (tt * 0 + entry) >= 0  # [G]
            else:
                reused = (tt * 0 + tl.load(hit_ptr + at, mask=valid, other=0).to(tl.int32)) > 0  # [G]
            on_reuse = on_host & reused
            on_host = on_host & ~reused
            reuse_k = (((b * HKV + h) * RC + entry) * 2 * G + tt) * D  # [G]; V follows at + G * D
            k_ptr = tl.where(on_reuse, rkv_ptr + reuse_k, k_ptr)
            v_ptr = tl.where(on_reuse, rkv_ptr + reuse_k + G * D, v_ptr)
        if STAGE == 1:  # fetch only: the kept misses over PCIe into their entries, no attention
            keep = on_host & ((tt * 0 + entry) >= 0)  # [G]
            k = tl.load(k_ptr[:, None] + dd[None, :], mask=keep[:, None], other=0.0)
            v = tl.load(v_ptr[:, None] + dd[None, :], mask=keep[:, None], other=0.0)
            tl.store(rkv_ptr + reuse_k[:, None] + dd[None, :], k, mask=keep[:, None])
            tl.store(rkv_ptr + (reuse_k + G * D)[:, None] + dd[None, :], v, mask=keep[:, None])
        else:
            _attend_block(q_ptr, k_ptr, v_ptr, live, valid, on_host, entry, reuse_k, rkv_ptr, o_ptr, m_ptr, l_ptr,
                          b, h, i, N, R, scale, q_b, q_h, q_r, D, G, R_PAD, HAS_REUSE and STAGE == 0, DOT)

    @triton.jit
    def _attend_block(q_ptr, k_ptr, v_ptr, live, valid, on_host, entry, reuse_k, rkv_ptr, o_ptr, m_ptr, l_ptr, b, h,
                      i, N, R, scale, q_b, q_h, q_r, D: tl.constexpr, G: tl.constexpr, R_PAD: tl.constexpr,
                      KEEP: tl.constexpr, DOT: tl.constexpr):
        """One block's partial attention from the chosen row pointers k_ptr, v_ptr [G]; KEEP: the misses with a
        reuse entry are written there for the next steps."""
        rr, dd, tt = tl.arange(0, R_PAD), tl.arange(0, D), tl.arange(0, G)
        # [G, D]: a PCIe read for the rows on the host, a device read for the others, nothing for a masked entry
        k = tl.load(k_ptr[:, None] + dd[None, :], mask=live[:, None], other=0.0)
        v = tl.load(v_ptr[:, None] + dd[None, :], mask=live[:, None], other=0.0)
        if KEEP:
            keep = on_host & ((tt * 0 + entry) >= 0)  # [G]: a miss with an entry, kept for the next steps
            tl.store(rkv_ptr + reuse_k[:, None] + dd[None, :], k, mask=keep[:, None])
            tl.store(rkv_ptr + (reuse_k + G * D)[:, None] + dd[None, :], v, mask=keep[:, None])
        q = _group_queries(q_ptr, b, h, R, q_b, q_h, q_r, D, R_PAD)  # [R_PAD, D]
        # fp32 products (the dots are [R_PAD, D] x [D, G]: tiny next to the reads, so no tensor-core formats)
        if DOT:  # tl.dot wants R_PAD >= 16
            logits = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale  # [R_PAD, G]
        else:  # few heads: broadcast products in registers, no padding to 16 rows and no shared-memory operands
            logits = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale  # [R_PAD, G]
        m = tl.max(logits, axis=1)  # [R_PAD]
        p = tl.exp(logits - m[:, None])
        l_sum = tl.sum(p, axis=1)
        if DOT:
            o = tl.dot(p, v.to(tl.float32), input_precision="ieee")  # [R_PAD, D], not yet divided by l_sum
        else:
            o = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)  # [R_PAD, D]
        m = tl.where(valid, m, float("-inf"))
        l_sum = tl.where(valid, l_sum, 0.0)
        o = tl.where(valid, o, 0.0)
        row = (b * N + i) * R + rr  # partials: [B, N, R(, D)]
        tl.store(m_ptr + row, m, mask=rr < R)
        tl.store(l_ptr + row, l_sum, mask=rr < R)
        tl.store(o_ptr + row[:, None] * D + dd[None, :], o, mask=rr[:, None] < R)

    @triton.jit
    def _combine_kernel(o_ptr, m_ptr, l_ptr, starts_ptr, caps_ptr, so_ptr, sm_ptr, sl_ptr, out_ptr, N, HKV, R, S,
                        D: tl.constexpr, DC: tl.constexpr, TILE: tl.constexpr, S_PAD: tl.constexpr,
                        LAUNCH_NEXT: tl.constexpr):
        if LAUNCH_NEXT:  # (pdl_enabled) the o-projection after it may be scheduled and start on its weights
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)  # = (b * HKV + h) * R + r
        r = pid % R
        bh = pid // R
        b, h = bh // HKV, bh % HKV
        # this program's DC of the D output columns (the weights are recomputed per slice: a few loads of m and l)
        dd, ee = tl.program_id(1) * DC + tl.arange(0, DC), tl.arange(0, TILE)
        # the streaming splits first, all in one load (a loop over them was a chain of S dependent load rounds);
        # at least one split holds the sink, so run_m is finite after them
        ss = tl.arange(0, S_PAD)
        srow = (bh * S + ss) * R + r  # [S_PAD]
        s_in = ss < S
        sm = tl.load(sm_ptr + srow, mask=s_in, other=float("-inf"))
        run_m = tl.max(sm, axis=0)
        ws = tl.exp(sm - tl.where(run_m == float("-inf"), 0.0, run_m))  # 0 for an empty split
        run_l = tl.sum(ws * tl.load(sl_ptr + srow, mask=s_in, other=0.0), axis=0)
        so = tl.load(so_ptr + srow[:, None] * D + dd[None, :], mask=s_in[:, None], other=0.0)  # [S_PAD, D]
        acc = tl.sum(ws[:, None] * so, axis=0)
        # then the group's retrieval partials: entries starts[h] .. starts[h] + caps[h] - 1
        start = tl.load(starts_ptr + h)
        cap = tl.load(caps_ptr + h)
        for e0 in range(0, cap, TILE):
            e = start + e0 + ee  # [TILE]
            inside = (e0 + ee) < cap
            row = (b * N + e) * R + r
            m = tl.load(m_ptr + row, mask=inside, other=float("-inf"))
            new_m = tl.maximum(run_m, tl.max(m, axis=0))
            w = tl.exp(m - new_m)  # [TILE], 0 for -inf (invalid or outside)
            old = tl.exp(run_m - new_m)
            run_l = run_l * old + tl.sum(w * tl.load(l_ptr + row, mask=inside, other=0.0), axis=0)
            o = tl.load(o_ptr + row[:, None] * D + dd[None, :], mask=inside[:, None], other=0.0)  # [TILE, D]
            acc = acc * old + tl.sum(w[:, None] * o, axis=0)
            run_m = new_m
        tl.store(out_ptr + pid * D + dd, (acc / run_l).to(out_ptr.dtype.element_ty))


def append_token(k: torch.Tensor, v: torch.Tensor, near: torch.Tensor, stage: torch.Tensor, s: torch.Tensor,
                 slots: torch.Tensor, pos: torch.Tensor, ring: torch.Tensor, g: int) -> None:
    """A decode step's new K/V, in one kernel: into the device sink/ring slab (near [slots, 2, Hkv, Ltot, D], slot
    ring[b] of row slots[b]), into the host store's staging rows (stage [B, 2, Hkv, D]) and into the block
    summaries s [slots, Hkv, blocks, 2, D] (room reserved; a block's first token resets it): bf16 (DeviceSummaries)
    with the min rounded toward -inf and the max toward +inf, or fp32 kept exact. k, v [B, Hkv, D]; slots, pos,
    ring [B] int64."""
    B, hkv, d = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and near.stride(4) == 1 and stage.stride(3) == 1
    assert s.stride(4) == 1 and s.stride(3) == d
    if s.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"append_token: summaries must be bfloat16 or float32, got {s.dtype}")
    _append_token_kernel[(B * hkv,)](k, v, near, stage, s, slots, pos, ring, hkv, k.stride(0), k.stride(1),
                                     v.stride(0), v.stride(1),
                                     near.stride(0), near.stride(1), near.stride(2), near.stride(3),
                                     stage.stride(0), stage.stride(1), stage.stride(2),
                                     s.stride(0), s.stride(1), s.stride(2), G=g, D=d,
                                     DIRECTED=s.dtype == torch.bfloat16)


STREAM_TILE = 32  # slab slots per step of the streaming kernel's loop


def stream_splits(ltot: int, tiles_per_split: int = 1) -> int:
    """How many programs share one group's sink + window: one tile each by default. Why: a program per (row, group)
    is only B * Hkv programs walking Ltot / TILE tiles in a row, which left the GPU nearly idle (H200, 8B shape,
    b1: 85 us per layer for 208 slots, 2.7 ms of a 14 ms step); split, the tiles run side by side and combine
    merges the splits like any other partial."""
    return max(1, -(-ltot // (STREAM_TILE * tiles_per_split)))


def stream_attention(q: torch.Tensor, near: torch.Tensor, bias: torch.Tensor, gidx: torch.Tensor,
                     slots: torch.Tensor, out_o: torch.Tensor, out_m: torch.Tensor, out_l: torch.Tensor,
                     scale: float, num_warps: int = 4) -> None:
    """The streaming part (sink + window) of every (row, group) as S partials: q [B, Hkv, r, D]; near [slots, 2, Hkv,
    Ltot, D]; bias fp32 [n_g, B, Ltot] (0 attended, -inf not; at least one 0 per row), group h
    uses bias[gidx[h]]. Split s covers slab slots [s * ceil(Ltot / S), ...). Writes out_o [B, Hkv, S, r, D] fp32
    (not divided by l), out_m, out_l [B, Hkv, S, r] (running max and sum), which combine merges."""
    B, hkv, r, d = q.shape
    ltot, splits = near.shape[3], out_o.shape[2]
    assert q.stride(3) == 1 and near.stride(4) == 1 and bias.is_contiguous() and bias.shape[2] == ltot
    assert out_o.is_contiguous() and out_m.is_contiguous() and out_l.is_contiguous() and gidx.is_contiguous()
    assert out_m.shape == (B, hkv, splits, r) and out_l.shape == out_m.shape
    span = -(-ltot // splits)
    _stream_attention_kernel[(B * hkv, splits)](q, near, bias, gidx, slots, out_o, out_m, out_l, B, hkv, r, ltot,
                                                span, scale, q.stride(0), q.stride(1), q.stride(2), near.stride(0),
                                                near.stride(1), near.stride(2), near.stride(3), D=d,
                                                R_PAD=pow2(r, 16), TILE=STREAM_TILE, num_warps=num_warps)


def block_scores(q: torch.Tensor, s: torch.Tensor, slots: torch.Tensor, bounds: torch.Tensor, n_blocks: int,
                 pinned: torch.Tensor | None, out: torch.Tensor, midrange: bool = False) -> torch.Tensor:
    """device_select.DeviceSummaries.scores in one kernel: q [B, Hkv, r, D]; s the layer's summaries (bf16 or fp32,
    read as fp32; the bound, or with midrange q . (min + max) / 2, accumulates in fp32); bounds [2, B]
    int64 eligible blocks [lo, hi); pinned bool [B, Hkv, >= n_blocks] or None; out fp32 [B, Hkv, n_blocks]."""
    B, hkv, r, d = q.shape
    assert q.stride(3) == 1 and s.stride(4) == 1 and bounds.is_contiguous() and out.is_contiguous()
    pins = pinned.view(torch.uint8) if pinned is not None else out  # any pointer when there are no pins
    block_n = 32
    _block_scores_kernel[(B * hkv, triton.cdiv(n_blocks, block_n))](
        q, s, slots, bounds, pins, out, B, hkv, r, n_blocks, q.stride(0), q.stride(1), q.stride(2),
        s.stride(0), s.stride(1), s.stride(2), pins.stride(0) if pinned is not None else 0,
        pins.stride(1) if pinned is not None else 0,
        D=d, R_PAD=pow2(r), BLOCK_N=block_n, HAS_PINS=pinned is not None, PINNED=PINNED_SCORE,
        MIDRANGE=midrange)
    return out


def block_attention(q: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor, flat_h: torch.Tensor,
                    flat_j: torch.Tensor, k_row: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                    span: torch.Tensor, page_tokens: int, g: int, scale: float,
                    part_o: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor,
                    pin_slot: torch.Tensor | None = None, pin_kv: torch.Tensor | None = None,
                    reuse_entry: torch.Tensor | None = None, reuse_hit: torch.Tensor | None = None,
                    reuse_kv: torch.Tensor | None = None, stage: int = 0,
                    warps: int = ExperimentalSettings.ba_warps, entries: int = ExperimentalSettings.ba_entries,
                    always_dot: bool = ExperimentalSettings.ba_dot) -> None:
    """Partial attention of each (row, flat entry): q [B, Hkv, r, D]; ids, vals [B, Hkv, width] (top-k of the
    scores); flat_h, flat_j [N] int64; k_row [B, Hkv] int64 (entries with rank >= k are masked); tables [slots,
    pages]; span [chunks, CHUNK_TOKENS * D] in the store dtype. Writes part_o [B, >= N, r, D], part_m, part_l
    [B, >= N, r] fp32, entries 0..N-1 (m = -inf, l = 0, o = 0 for a masked entry).
    Optional pin cache: pin_slot int32 [B, Hkv, NB] (a block's entry in the pool, -1 when not cached) and the pool
    pin_kv [P, 2, g, D] in the store dtype, shared by all rows and groups (and layers: the caller's choice); a cached
    block is read from device memory instead of over PCIe.
    Optional reuse cache (reuse_cache.py): reuse_entry int32 / reuse_hit int8 [B, Hkv, width] from
    device_topk.select_top, reuse_kv [B, Hkv, RC, 2, g, D] in the store dtype: a hit is read from its entry, a miss
    with an entry is read over PCIe and written there for the next steps.
    stage (reuse cache only) splits that in two, so the PCIe reads can run ahead of the query (device_graph.py's
    early choice): 1 fetches the kept misses into their entries and attends nothing (q and the partials are not
    touched); 2 then attends, reading every block with an entry from the cache.
    A/B knobs (the settings FLUXION_BA_WARPS / _ENTRIES / _DOT): warps per program; flat entries per program, one
    after another (unrolled: fewer programs for the wide layers, whose ~2000 one-block programs wait on chains of
    dependent loads); always_dot: tl.dot for any query-head count (else up to BROADCAST_MAX_R heads in registers)."""
    B, hkv, r, d = q.shape
    n, width = flat_h.shape[0], ids.shape[2]
    assert ids.is_contiguous() and vals.is_contiguous() and k_row.is_contiguous() and tables.stride(1) == 1
    assert span.is_contiguous() and span.shape[1] == CHUNK_TOKENS * d and g % CHUNK_TOKENS == 0
    cph = page_tokens // CHUNK_TOKENS
    assert part_m.shape[1] >= n and part_o.is_contiguous() and part_m.is_contiguous() and part_l.is_contiguous()
    has_cache = pin_slot is not None and pin_kv is not None
    if has_cache:
        assert pin_slot.dtype == torch.int32 and pin_slot.is_contiguous() and pin_slot.shape[:2] == (B, hkv)
        assert pin_kv.is_contiguous() and pin_kv.shape[1:] == (2, g, d) and pin_kv.dtype == span.dtype
    nbs = pin_slot.shape[2] if has_cache else 0
    has_reuse = reuse_entry is not None and reuse_hit is not None and reuse_kv is not None
    if has_reuse:
        assert reuse_entry.shape == ids.shape and reuse_hit.shape == ids.shape and reuse_entry.dtype == torch.int32
        assert reuse_kv.is_contiguous() and reuse_kv.shape[:2] == (B, hkv) and reuse_kv.shape[3:] == (2, g, d)
        assert reuse_kv.dtype == span.dtype
    assert stage == 0 or (stage in (1, 2) and has_reuse), "stages 1 and 2 work on the reuse cache"
    dot = always_dot or pow2(r) > BROADCAST_MAX_R  # always_dot (FLUXION_BA_DOT=1): tl.dot for any r (A/B)
    entries = max(1, entries)
    _block_attention_kernel[(triton.cdiv(n, entries), B)](  # the partials' row stride is their capacity, not n
        q, ids, vals, flat_h, flat_j, k_row, slots, tables, span, pin_slot if has_cache else k_row,
        pin_kv if has_cache else span, reuse_entry if has_reuse else k_row, reuse_hit if has_reuse else k_row,
        reuse_kv if has_reuse else span, part_o, part_m, part_l, part_m.shape[1], hkv, r, width,
        tables.shape[1], page_tokens, cph, nbs, reuse_kv.shape[2] if has_reuse else 0, scale, q.stride(0),
        q.stride(1), q.stride(2), tables.stride(0), n, D=d, G=g, R_PAD=pow2(r, 16) if dot else pow2(r),
        CHUNK=CHUNK_TOKENS, HAS_CACHE=has_cache, HAS_REUSE=has_reuse, STAGE=stage, DOT=dot, ENTRIES=entries,
        num_warps=warps)


def combine(part_o: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor, starts: torch.Tensor,
            caps: torch.Tensor, stream_o: torch.Tensor, stream_m: torch.Tensor, stream_l: torch.Tensor,
            out: torch.Tensor, max_entries: int = COMBINE_TILE_MAX, pdl: bool = ExperimentalSettings.pdl
            ) -> torch.Tensor:
    """LSE merge of the streaming partials (stream_attention's [B, Hkv, S, r(, D)]) with each group's retrieval
    partials (its entries are starts[h] .. starts[h] + caps[h] - 1 of the flat list) -> out [B, Hkv, r, D].
    max_entries: the most entries a group has (any larger caps still merge, in more rounds). pdl: the setting
    FLUXION_PDL (pdl_enabled).

    One program per (row, group, head) and COMBINE_COLUMNS output columns, taking up to COMBINE_TILE_MAX entries per
    round: at batch 1 the 8B shape has 32 (row, group, head)s, and one program each, walking a wide layer's ~250
    entries 64 at a time, made combine a chain of 4 dependent load rounds on 32 SMs (8.4 us per layer, H200)."""
    B, hkv, splits, r, d = stream_o.shape
    assert stream_o.is_contiguous() and stream_m.is_contiguous() and stream_l.is_contiguous() and out.is_contiguous()
    dc = COMBINE_COLUMNS if d % COMBINE_COLUMNS == 0 else d
    tile = min(COMBINE_TILE_MAX, pow2(max(max_entries, 1), 16))
    _combine_kernel[(B * hkv * r, d // dc)](part_o, part_m, part_l, starts, caps, stream_o, stream_m, stream_l, out,
                                            part_m.shape[1], hkv, r, splits, D=d, DC=dc, TILE=tile,
                                            S_PAD=pow2(splits, 2), LAUNCH_NEXT=pdl_enabled(out.device, pdl))
    return out
