/*
 * fluxion.h -- native CPU sparse attention over a host-memory KV cache.
 *
 * The contract of the C library: the memory layout it reads and writes, and the calls.  The library owns no KV
 * memory; the caller (fluxion_lite/host_kv.py, or anyone with raw arrays) allocates pages and hands over pointers.
 *
 * ---------------------------------------------------------------------------------------------------------------
 * HOST KV LAYOUT (one layer)
 *
 *   Tokens of one sequence live in pages of P tokens (P a multiple of 128, so a block of g <= 128 tokens never
 *   straddles a page).  A page holds P tokens of ONE layer for ALL KV heads of one sequence, as one allocation:
 *
 *     K  [Hkv][P][D]  16-bit (fp16 or bf16)          -- per KV head, tokens contiguous, D elements per token
 *     V  [Hkv][P][D]  16-bit
 *     S_g[Hkv][P/g][2][D] 16-bit, the same dtype as K, for each kept granularity g in ascending order (g in
 *                     {16,32,64,128}): S_g[h][b][0][:] = per-dimension min of the keys of block b, S_g[h][b][1][:] =
 *                     max, over the block's VALID tokens only (a partly filled last block summarises what it has).
 *                     Min and max of 16-bit values are 16-bit values: the summaries are exact, and top-k widens
 *                     them to fp32 (the bound is computed in fp32, as with fp32 summaries, bit for bit).
 *
 *     VS [Hkv][P/128][D] fp32, only when gran_mask has FX_KEEP_VALUE_SUMS: VS[h][b][:] = the sum of the values of
 *                     128-token block b's valid tokens (fp32, added token by token in order as they are appended;
 *                     a rebuild sums the block again from its first token).  Read by fx_background.
 *
 *   Byte offsets inside a page: K at 0, V at Hkv*P*D*2, S_g after V, each S_g Hkv*(P/g)*2*D*2 bytes, then VS
 *   (Hkv*(P/128)*D*4 bytes).  fx_page_bytes() computes the size.  Pages should be 64-byte aligned (torch and cudaHostAlloc are).
 *
 *   A layer's page table is `pages[n_slots][max_pages]` of page base pointers (NULL where not allocated) and
 *   `n_tokens[n_slots]` valid token counts.  Token t of slot s is row (t % P) of page pages[s][t / P].
 *   Growing a sequence means allocating one more page and writing its pointer: nothing already stored moves.
 *   Block b (granularity g) of a slot covers tokens [b*g, min((b+1)*g, n_tokens)); n_blocks = ceil(n_tokens/g).
 *
 * QUERIES:  q [q_rows][Hq][D] fp32, Hq = r * Hkv.  KV head h serves query heads h*r .. h*r+r-1 (its GQA group).
 *
 * TASKS:    int32 [n_tasks][FX_TASK_FIELDS], one row per (sequence, KV group):
 *             slot, q_row, kv_head, g, k, ex0_lo, ex0_hi, ex1_lo, ex1_hi
 *           k and the excluded token ranges [ex_lo, ex_hi) are used by fx_group_topk only (an empty range has
 *           lo >= hi).  A block is excluded when it intersects an excluded range; give block-aligned ranges (sink,
 *           recent window) so the sparse part and the caller's streaming part cover disjoint tokens.
 *
 * SELECTIONS: ids int32 [n_tasks][k_cap], counts int32 [n_tasks]; task i uses ids[i][0 .. counts[i]).
 *
 * All calls are one per layer for all tasks; they run on the library's own pthread pool (never OpenMP) and make
 * no heap allocation.  Calls return FX_OK or an FX_E* code; on error *err_index names the offending task (or -1).
 * With checks on (the default) every slot, head, block id, page pointer and output bound is validated before any
 * memory is touched, so the C code never reads or writes out of bounds on bad input.
 * Concurrent calls from several threads are safe: a call that finds the pool busy runs on its caller's thread.
 * ---------------------------------------------------------------------------------------------------------------
 */
#ifndef FLUXION_H
#define FLUXION_H

#include <stdint.h>

#define FX_TASK_FIELDS 9
#define FX_MAX_GROUP 16   /* query heads per KV head */
#define FX_MAX_DIM 256    /* head_dim, a multiple of 16 */
#define FX_MAX_BLOCK 128  /* largest granularity */
#define FX_KEEP_VALUE_SUMS 16 /* gran_mask bit: the pages hold per-128-token value sums (VS, HOST KV LAYOUT) */

enum { FX_F16 = 0, FX_BF16 = 1 };
/* SIMD paths.  FX_SIMD_AVX512_BF16 is FX_SIMD_AVX512 plus q.k by AVX512-BF16 dot products (vdpbf16ps) for bf16 KV
 * when every element of a task's q is exactly a bf16 value and not a denormal (then each product is exact and
 * only the fp32 summation order differs; any other q, and fp16 KV, run FX_SIMD_AVX512's kernels, bit for bit).
 * FX_SIMD_AUTO picks it where the CPU has AVX512-BF16 and the OS saves ZMM state; FX_SIMD_AVX512 turns it off. */
enum { FX_SIMD_AUTO = -1, FX_SIMD_PORTABLE = 0, FX_SIMD_AVX2 = 1, FX_SIMD_AVX512 = 2, FX_SIMD_AVX512_BF16 = 3 };
enum {
    FX_OK = 0,
    FX_E_VIEW = 1,      /* bad view: sizes, dtype, page size, granularity mask */
    FX_E_SLOT = 2,      /* task slot out of range */
    FX_E_QROW = 3,      /* task q_row out of range */
    FX_E_HEAD = 4,      /* task kv_head out of range */
    FX_E_GRAN = 5,      /* granularity not one of the view's kept ones */
    FX_E_K = 6,         /* k or count negative or above k_cap */
    FX_E_BLOCK = 7,     /* selected block id outside the slot's blocks */
    FX_E_PAGE = 8,      /* a needed page pointer is NULL */
    FX_E_OUTPUT = 9,    /* output buffer too small (gather capacity, workspace) */
    FX_E_GROUP = 10,    /* Hq not a multiple of Hkv, or group larger than FX_MAX_GROUP */
    FX_E_SIMD = 11,     /* requested SIMD path not supported by this CPU */
    FX_E_APPEND = 12,   /* append past page-table capacity */
    FX_E_SCORING = 13,  /* unknown block-scoring mode */
    FX_E_PIN = 14,      /* bad pinned blocks (see PINNED BLOCKS below) */
    FX_E_QTYPE = 15,    /* unknown weight type (QUANTIZED WEIGHTS below) */
    FX_E_QSHAPE = 16,   /* bad matrix arguments: k not a positive multiple of the type's block, a negative size or row,
                           a NULL array the sizes need, n outside [0, FX_QMM_MAX_MANY], byte counts past int64 */
    FX_E_SPAN = 17,     /* a task's two token ranges overlap (fx_attend_spans) */
};
/* Block scoring of fx_group_topk_scoring. */
enum { FX_SCORE_GROUP = 0, FX_SCORE_PER_HEAD = 1, FX_SCORE_MIDRANGE = 2 };

typedef struct fx_kv_view {
    int32_t n_slots;        /* rows of the page table */
    int32_t max_pages;      /* columns of the page table */
    int32_t n_kv_heads;     /* Hkv */
    int32_t head_dim;       /* D, multiple of 16, <= FX_MAX_DIM */
    int32_t page_tokens;    /* P, multiple of 128 */
    int32_t dtype;          /* FX_F16 or FX_BF16 */
    int32_t gran_mask;      /* bit i < 4 set: granularity 16<<i summaries are kept in the pages; FX_KEEP_VALUE_SUMS:
                               so are the value sums */
    int64_t *n_tokens;      /* [n_slots] */
    uint8_t **pages;        /* [n_slots * max_pages] page base pointers */
} fx_kv_view;

/* ---- settings ---- */
int fx_version(void);
int fx_set_threads(int n);          /* size of the pool, >= 1 (the caller thread counts as one) */
int fx_get_threads(void);
/* Idle workers spin this long (ns) before sleeping on a condition variable (< 0: the default, 200 us; at most 1 s);
 * returns the value in effect.  Waking a sleeping worker costs tens to hundreds of us, so a caller that calls once
 * per GPU layer raises it while it decodes.  fx_wake_threads makes sleeping workers spin again now (a no-op while a
 * call runs): give it a few us ahead of a call that follows an idle gap.  Both are safe from any thread. */
int64_t fx_set_spin_ns(int64_t ns);
void fx_wake_threads(void);
int fx_set_simd(int path);          /* FX_SIMD_*; returns the path now used, or -FX_E_SIMD if unsupported */
int fx_get_simd(void);
int fx_simd_supported(int path);    /* 1 if this CPU (and build) can run the path */
void fx_set_checks(int on);         /* index validation (default on) */
void fx_set_stream_stores(int on);  /* gather: non-temporal stores into staging (default on) */
int64_t fx_page_bytes(int32_t n_kv_heads, int32_t head_dim, int32_t page_tokens, int32_t gran_mask);

/* ---- append + summaries ----
 * Copy new tokens into the pages and update the block summaries incrementally.
 * src_k, src_v: [n_rows][Hkv][D] 16-bit (the layout of a k/v projection).  Slot slots[i] receives rows
 * row_start[i] .. row_start[i]+row_count[i]-1, appended after its n_tokens, which then grows by row_count[i].
 * Pages for the new tokens must already be in the page table.  Slots must be distinct. */
int fx_append(const fx_kv_view *kv, const int32_t *slots, const int64_t *row_start, const int64_t *row_count,
              int64_t n_items, const void *src_k, const void *src_v, int64_t n_rows, int64_t *err_index);

/* Rebuild the summaries (and value sums, if kept) of tokens [from_token[i], n_tokens) of slots[i] from the stored
 * keys and values (all heads, all kept g).  fx_append already does this; use it when K was written into the pages by other means. */
int fx_summaries_update(const fx_kv_view *kv, const int32_t *slots, const int64_t *from_token, int64_t n_items,
                        int64_t *err_index);

/* ---- group top-k ----
 * Per task, the k best eligible blocks (all of them when fewer): ids ascending by block id, scores alongside,
 * counts[i] how many.  Ties: the lower block id wins.  out_ids/out_scores: [n_tasks][k_cap].  Three scorings, with
 * bound_j(b) = sum over dims d of max(q_jd*min_bd, q_jd*max_bd) the Quest bound of query head j of the group:
 *   FX_SCORE_GROUP     score(b) = sum_j bound_j(b)  (the bound of the summed query heads)
 *   FX_SCORE_PER_HEAD  score(b) = max_j (bound_j(b) - max_b' bound_j(b')), b' over the task's eligible blocks:
 *                      the gap to each head's own best block, so a block that one head ranks near its top is kept
 *                      whatever the other heads do.  Scores are <= 0, the best block of some head scores 0.
 *   FX_SCORE_MIDRANGE  score(b) = sum_j q_j . (min_b + max_b) / 2: the query against the block's midrange key, an
 *                      estimate rather than a bound (from the same summaries; on models whose bound is loose it
 *                      ranks the blocks the heads attend to higher, docs/history.md).  Computed as the group
 *                      bound with both sign parts of the query set to half the summed query heads.
 * workspace: >= fx_topk_scoring_workspace_floats(n_tasks, largest n_blocks among the tasks, r, scoring) floats
 * (r = n_q_heads / n_kv_heads); per-head scoring keeps every head's bounds there, r floats per block.
 * fx_group_topk is fx_group_topk_scoring with FX_SCORE_GROUP, and fx_topk_workspace_floats its workspace size. */
int64_t fx_topk_workspace_floats(int64_t n_tasks, int64_t max_blocks);
int64_t fx_topk_scoring_workspace_floats(int64_t n_tasks, int64_t max_blocks, int32_t group, int32_t scoring);
int fx_group_topk(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads, const int32_t *tasks,
                  int64_t n_tasks, int32_t k_cap, int32_t *out_ids, float *out_scores, int32_t *out_counts,
                  float *workspace, int64_t workspace_floats, int64_t *err_index);
int fx_group_topk_scoring(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads,
                          const int32_t *tasks, int64_t n_tasks, int32_t k_cap, int32_t scoring, int32_t *out_ids,
                          float *out_scores, int32_t *out_counts, float *workspace, int64_t workspace_floats,
                          int64_t *err_index);

/* ---- pinned blocks ----
 * Some blocks of a task can be pinned: read at every step whatever their score (blocks chosen once, e.g. at the end
 * of prefill, by attention the summaries cannot see).  They take part of the task's k: the selection is task i's
 * P = pin_counts[i] pinned blocks plus the k - P best-scoring eligible blocks that are NOT pinned (ties: the lower
 * block id, as without pins), ids ascending, counts[i] = P + min(k - P, eligible blocks not pinned).  That is
 * exactly what top-k of all k blocks, then dropping its pinned picks and keeping the k - P best of the rest, gives.
 * Scores are computed as without pins (per-head scoring: each head's best over all eligible blocks, pinned ones
 * included); a pinned block's out_scores entry is its own score.
 *   pins        int32 [n_tasks][pin_stride]: task i's pinned ids in pins[i*pin_stride .. i*pin_stride + P), the rest
 *               of the row is never read
 *   pin_counts  int32 [n_tasks]; NULL: no pins at all (pins is then ignored), the plain calls' behaviour
 * Checked on every call (O(total pins)), else FX_E_PIN with *err_index = the task (-1: pin_stride < 0):
 * 0 <= P <= min(k, pin_stride), pins not NULL when P > 0; ids strictly ascending, each a block of the slot
 * (0 <= id < n_blocks) that intersects no excluded range of the task (the sparse part and the caller's streaming
 * part must stay disjoint, so a pin never reads a token twice).  P > k is an error, not a clamp: the caller sized
 * k to the budget, and more blocks than k would overrun it (and out_ids' k_cap columns).
 * Workspace: as without pins.  No allocation. */
int fx_group_topk_pinned(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads,
                         const int32_t *tasks, int64_t n_tasks, int32_t k_cap, int32_t scoring, const int32_t *pins,
                         const int32_t *pin_counts, int32_t pin_stride, int32_t *out_ids, float *out_scores,
                         int32_t *out_counts, float *workspace, int64_t workspace_floats, int64_t *err_index);

/* ---- sparse attention ----
 * For each task, each of its r query heads attends over the selected blocks' valid tokens:
 * out[i][j][:] = softmax(scale * q.K^T) V, lse[i][j] = natural-log sum of exp(scale * q.k).
 * Empty selection: out = 0, lse = -inf.  workspace: >= fx_attention_workspace_floats(n_tasks, r, D) floats. */
int64_t fx_attention_workspace_floats(int64_t n_tasks, int32_t group, int32_t head_dim);
int fx_sparse_attention(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads,
                        const int32_t *tasks, int64_t n_tasks, const int32_t *ids, const int32_t *counts,
                        int32_t k_cap, float scale, float *out, float *lse, float *workspace,
                        int64_t workspace_floats, int64_t *err_index);

/* ---- one decode layer's CPU part: top-k, then attention, results in place ----
 * fx_group_topk, then fx_sparse_attention over the selections just made (one call instead of two on the decode
 * hot path), with the results written straight into per-row buffers: task i's out goes to row rows[i] of
 * out [n_rows][r][D] and its lse to row rows[i] of lse [n_rows][r]; rows must be strictly ascending in
 * [0, n_rows) (else FX_E_OUTPUT with *err_index = i). Rows without a task get lse = -inf and keep their out.
 * out_ids/out_scores/out_counts as in fx_group_topk. *selected_tokens = sum of counts[i] * g[i];
 * seconds[0], seconds[1]: time spent selecting and attending.
 * workspace: >= both fx_topk_workspace_floats(n_tasks, largest n_blocks) and
 * fx_attention_workspace_floats(n_tasks, r, D) floats (FX_E_OUTPUT, *err_index = -1, before any work if short). */
int fx_select_attend(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads, const int32_t *tasks,
                     int64_t n_tasks, int32_t k_cap, int32_t *out_ids, float *out_scores, int32_t *out_counts,
                     float scale, const int64_t *rows, int64_t n_rows, float *out, float *lse, float *workspace,
                     int64_t workspace_floats, int64_t *selected_tokens, double *seconds, int64_t *err_index);
/* fx_select_attend with a block scoring (FX_SCORE_*) and optional pins (pins, pin_counts, pin_stride as for
 * fx_group_topk_pinned; pin_counts NULL: none): the selection is fx_group_topk_pinned's.  workspace: >= both
 * fx_topk_scoring_workspace_floats(n_tasks, largest n_blocks, r, scoring) and fx_attention_workspace_floats. */
int fx_select_attend_pinned(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads,
                            const int32_t *tasks, int64_t n_tasks, int32_t k_cap, int32_t scoring,
                            const int32_t *pins, const int32_t *pin_counts, int32_t pin_stride, int32_t *out_ids,
                            float *out_scores, int32_t *out_counts, float scale, const int64_t *rows, int64_t n_rows,
                            float *out, float *lse, float *workspace, int64_t workspace_floats,
                            int64_t *selected_tokens, double *seconds, int64_t *err_index);

/* ---- unread background ----
 * One more softmax term per task standing for the tokens its selection leaves unread, computed from summaries alone
 * (no K or V row is read).  Task fields as for top-k (g, the excluded ranges; k is not used) with ids/counts its
 * selection at g (ids[i][0 .. counts[i]) strictly ascending, as top-k returns them; counts[i] = 0 for a task that
 * reads nothing beyond its excluded ranges, e.g. a streaming group's sink + window).  Task i's background: every
 * 16-token block inside an eligible g-block (one that intersects no excluded range) that is not inside a selected
 * g-block.  For 128-token block B and query head j of the group:
 *   m_j(B)  = log of the sum over B's background 16-token blocks b of  n_b exp(scale q_j . (min_b + max_b) / 2)
 *             (n_b: b's valid tokens; min_b, max_b: its g = 16 summary) -- each block's midrange key stands for its
 *             tokens' scores, an estimate of their softmax mass (docs/history.md)
 *   vbar(B) = VS[B] / B's valid tokens: the mean value of ALL of B's tokens, read ones included
 *   out[i][j][:] = sum_B exp(m_j(B) - lse[i][j]) vbar(B),   lse[i][j] = log sum_B exp(m_j(B))
 * so merging (out, lse) with the read part's attention by log-sum-exp adds one term per block to its softmax.  No
 * background block: out = 0, lse = -inf.  out [n_tasks][r][D], lse [n_tasks][r] fp32.
 * Needs the g = 16 summaries and FX_KEEP_VALUE_SUMS in the view (else FX_E_GRAN); a selection that is not strictly
 * ascending or holds a block outside the slot's is FX_E_BLOCK (checked on every call: O(counts)).
 * workspace: >= fx_background_workspace_floats(n_tasks, r, D) floats (FX_E_OUTPUT, *err_index = -1, before any
 * work if short; the size depends on the pool's thread count).  No allocation; runs on the pool, each task's
 * 128-token blocks split into work items. */
int64_t fx_background_workspace_floats(int64_t n_tasks, int32_t group, int32_t head_dim);
int fx_background(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads, const int32_t *tasks,
                  int64_t n_tasks, const int32_t *ids, const int32_t *counts, int32_t k_cap, float scale, float *out,
                  float *lse, float *workspace, int64_t workspace_floats, int64_t *err_index);

/* ---- the streaming spans of a decode layer ----
 * For each task, its r query heads attend over the task's two token ranges [ex0_lo, ex0_hi) and [ex1_lo, ex1_hi)
 * (clipped to the slot's tokens; an empty range has lo >= hi), the same fields through which fx_group_topk
 * excludes a streaming part (sink, recent window) from its selection.  The result is merged by log-sum-exp into
 * what row rows[i] of out [n_rows][r][D] / lse [n_rows][r] already holds (lse -inf: nothing yet, out is then
 * ignored), so after fx_select_attend_pinned over the same tasks the row holds the group's whole attention: its
 * selected blocks and its streaming part in one softmax.  A task whose ranges are both empty leaves its row as it
 * is.  Only the task's slot, q_row, kv_head and ranges are read (g must still be a granularity: 16, 32, 64, 128;
 * k is ignored).  rows strictly ascending in [0, n_rows) (else FX_E_OUTPUT, *err_index = i); non-empty ranges
 * that overlap: FX_E_SPAN.  *span_tokens = the tokens attended.  workspace: >= fx_spans_workspace_floats(n_tasks,
 * r, D) floats (FX_E_OUTPUT, *err_index = -1, before any work if short; the size depends on the pool's thread
 * count).  No allocation; runs on the pool, each task's tokens split into work items. */
int64_t fx_spans_workspace_floats(int64_t n_tasks, int32_t group, int32_t head_dim);
int fx_attend_spans(const fx_kv_view *kv, const float *q, int64_t q_rows, int32_t n_q_heads, const int32_t *tasks,
                    int64_t n_tasks, float scale, const int64_t *rows, int64_t n_rows, float *out, float *lse,
                    float *workspace, int64_t workspace_floats, int64_t *span_tokens, int64_t *err_index);

/* ---- gather ----
 * Copy each task's selected blocks (valid tokens only, in the order given) into staging buffers
 * k_out/v_out [cap_tokens][D] 16-bit, starting at row out_offset[i]; out_tokens[i] = rows written. */
int fx_gather(const fx_kv_view *kv, const int32_t *tasks, int64_t n_tasks, const int32_t *ids,
              const int32_t *counts, int32_t k_cap, const int64_t *out_offset, int64_t cap_tokens, void *k_out,
              void *v_out, int32_t *out_tokens, int64_t *err_index);

/* ---- bandwidth probe (for bench/kernels.py): sum of n bytes read by the pool, returns a checksum ---- */
double fx_read_bandwidth_probe(const void *buf, int64_t n_bytes, int32_t repeats);

/* ---- block read probe (for bench/kernels.py): the memory side of fx_sparse_attention alone ----
 * Reads the K and V of the selected blocks' valid tokens exactly as fx_sparse_attention does (same work items on
 * the pool, same order, same next-block prefetch) without computing anything: the rate one call reaches is the
 * ceiling of that access pattern (scattered runs of g * D * 2 bytes) on this machine.  *checksum = the wrapping
 * sum of all the 64-bit words read.  Tasks, ids and counts as for fx_sparse_attention, validated the same way. */
int fx_read_blocks_probe(const fx_kv_view *kv, const int32_t *tasks, int64_t n_tasks, const int32_t *ids,
                         const int32_t *counts, int32_t k_cap, uint64_t *checksum, int64_t *err_index);

/* ---------------------------------------------------------------------------------------------------------------
 * QUANTIZED WEIGHTS (fx_qmatmul, fx_qmatmul_many, fx_dequantize, fx_dequantize_bf16)
 *
 *   A weight matrix W [n_out][k] is stored row-major as in a GGUF file: row r is k / B blocks of the type's block size
 *   B back to back, row_bytes = (k / B) * block_bytes, row r at byte offset r * row_bytes (k a multiple of B).  The
 *   types are the GGUF/ggml type ids.  Multi-byte fields are little-endian and unaligned; f16 is IEEE binary16, bf16
 *   the upper half of an fp32.  In block b of a row, element e (0 <= e < B) is W[r][b*B + e]; qs[i], qh[i], ... name
 *   byte i of that block's array.
 *
 *   type (id)  B    bytes  fields at byte offsets                        element e
 *   F32  (0)   1    4      0 fp32                                         the value
 *   F16  (1)   1    2      0 f16                                          the value
 *   BF16 (30)  1    2      0 bf16                                         the value
 *   Q4_0 (2)   32   18     0 f16 d, 2 qs[16]                              d * (n(e) - 8)
 *   Q4_1 (3)   32   20     0 f16 d, 2 f16 m, 4 qs[16]                     d * n(e) + m
 *   Q5_0 (6)   32   22     0 f16 d, 2 qh[4], 6 qs[16]                     d * (n(e) + 16 h(e) - 16)
 *   Q5_1 (7)   32   24     0 f16 d, 2 f16 m, 4 qh[4], 8 qs[16]            d * (n(e) + 16 h(e)) + m
 *   Q8_0 (8)   32   34     0 f16 d, 2 int8 qs[32]                         d * qs[e]
 *       n(e) = qs[e] & 15 for e < 16, qs[e - 16] >> 4 for e >= 16 (low nibbles: the block's first 16 elements);
 *       h(e) = bit e of qh read as a uint32: bit e % 8 of qh[e / 8].
 *   Q4_K (12)  256  144    0 f16 d, 2 f16 dmin, 4 scales[12], 16 qs[128]
 *       8 sub-blocks of 32; element e of sub-block j = e / 32:          d * sc[j] * n(e) - dmin * mn[j]
 *       n(e) = (qs[32 * (e / 64) + e % 32] >> (4 * (j % 2))) & 15: each 64 elements share 32 bytes, low nibbles
 *       first.  sc[j], mn[j]: unsigned 6-bit, packed in scales: for j < 4, sc[j] = scales[j] & 63 and
 *       mn[j] = scales[j + 4] & 63; for j >= 4, sc[j] = (scales[j + 4] & 15) | (scales[j - 4] >> 6) << 4 and
 *       mn[j] = (scales[j + 4] >> 4) | (scales[j] >> 6) << 4.
 *   Q5_K (13)  256  176    0 f16 d, 2 f16 dmin, 4 scales[12], 16 qh[32], 48 qs[128]
 *       as Q4_K with n(e) + 16 * ((qh[e % 32] >> j) & 1) in place of n(e) (j = e / 32).
 *   Q6_K (14)  256  210    0 ql[128], 128 qh[64], 192 int8 scales[16], 208 f16 d
 *       element e:                                                       d * scales[e / 16] * (q(e) - 32)
 *       with h = e / 128, t = e % 128: q(e) = ((ql[64 h + t % 64] >> (4 * (t / 64))) & 15)
 *                                            | ((qh[32 h + t % 32] >> (2 * (t / 32))) & 3) << 4.
 *   The value in fp32: every product in these formulas is exact in fp32 (d * sc, then * n; dmin * mn), so each
 *   element is its exact value rounded once to fp32 (Q4_1/Q5_1/Q4_K/Q5_K: the final sum or difference rounds) --
 *   what ggml and gguf-py compute.
 *
 *   Activations.  fx_qmatmul quantizes x per block to 8 bits in the caller's workspace, per row i of x:
 *     32-block types (Q4_0 .. Q8_0): each 32 elements of the row; K types: each 256 elements, plus the sums of qx
 *     over every 16 elements.  With amax = max |x| over the block: dx = amax / 127 (fp32), qx = the fp32 product
 *     x * (127 / amax) rounded half to even (|qx| <= 127); amax = 0: dx = 0, qx = 0.  A block holding a NaN or an
 *     infinity gets dx = NaN (the outputs of that x row are NaN).  So x = dx * qx to within dx / 2 per element.
 *   The products are integer dot products (exact, int32) of the weights' integer parts with qx, scaled and summed in
 *   fp32.  Per block, with d, m, dmin, sc, mn, scales the weight block's fields, dx, qx the activation block's, and
 *   n' = n (Q4_0, Q4_1, Q4_K), n + 16 h (Q5_0, Q5_1, Q5_K) the unsigned integer part:
 *     Q8_0            (d dx) * sum(qs qx)
 *     Q4_0 / Q5_0     (d dx) * sum(n' qx) - (o d) * (dx sum(qx)),  o = 8 / 16   (= (d dx) sum((n' - o) qx); the
 *                     portable path sums n' - o in the integer dot product instead)
 *     Q4_1 / Q5_1     (d dx) * sum(n' qx) + m * (dx sum(qx))
 *     Q4_K / Q5_K     (d dx) * sum_j sc[j] sum(n' qx) - (dmin dx) * sum_j mn[j] sum(qx)   (sums over sub-block j)
 *     Q6_K            (d dx) * sum_g scales[g] (sum(q qx) - 32 sum(qx))                  (integer; sums over 16)
 *   with dx sum(qx) an fp32 product per block; y[i][r] is the fp32 sum of its row's block terms: W @ (the quantized
 *   x) up to the fp32 rounding of these terms.  The summation order differs between SIMD paths (they agree to
 *   rounding, not bit for bit).  F32/F16/BF16 weights: fp32 dot products with x as given (no quantization, no
 *   workspace).
 *   SIMD: the library's path (fx_set_simd).  FX_SIMD_AVX2: 256-bit, vpmaddubsw + vpmaddwd.  FX_SIMD_AVX512 and
 *   FX_SIMD_AVX512_BF16: the 32-block types on 256-bit vectors (a block fills one; measured faster than two blocks
 *   per 512-bit vector, on a Sapphire Rapids Xeon), the K and float types on 512-bit;
 *   integer dot products by AVX512-VNNI (vpdpbusd, vpdpwssd) where the CPU has it, else AVX-512BW (vpmaddubsw +
 *   vpmaddwd) -- the same int32 sums, so the two give the same results bit for bit (fx_set_vnni).
 *   FX_SIMD_PORTABLE: C.
 *   Threads: output rows are split in chunks over the library pool; each chunk reads each of its weight rows once
 *   for 16 rows of x at a time (m <= 16: once in all), prefetching its weight stream 8 KB ahead (into L2).  The
 *   activations are quantized first (m >= 4: on the pool, by rows; else on the calling thread).  No call allocates
 *   memory.
 * ---------------------------------------------------------------------------------------------------------------
 */
enum {
    FX_QT_ANY = -1, /* fx_qmatmul_workspace only: enough for any mix of types */
    FX_QT_F32 = 0, FX_QT_F16 = 1, FX_QT_Q4_0 = 2, FX_QT_Q4_1 = 3, FX_QT_Q5_0 = 6, FX_QT_Q5_1 = 7, FX_QT_Q8_0 = 8,
    FX_QT_Q4_K = 12, FX_QT_Q5_K = 13, FX_QT_Q6_K = 14, FX_QT_BF16 = 30,
};
#define FX_QMM_MAX_MANY 16 /* weights in one fx_qmatmul_many */

/* Elements per block of a weight type (1 for F32/F16/BF16), 0 if the type is unknown. */
int32_t fx_qblock_size(int32_t wtype);
/* Bytes of one row of k elements (k a positive multiple of the block size); -FX_E_QTYPE or -FX_E_QSHAPE. */
int64_t fx_qrow_bytes(int32_t wtype, int64_t k);

/* Bytes of workspace fx_qmatmul needs for m rows of x of k elements (the quantized x, 64-byte aligned inside;
 * 0 for F32/F16/BF16).  wtype FX_QT_ANY: enough for any weight type, and for any mix in fx_qmatmul_many (if k is not
 * a multiple of 256, of the types k allows).  Negative: -FX_E_QTYPE, -FX_E_QSHAPE (k not a positive multiple of the
 * block, m < 0). */
int64_t fx_qmatmul_workspace(int32_t wtype, int64_t m, int64_t k);

/* y [m][n_out] fp32 = x [m][k] fp32 @ W^T, W [n_out][k] of type wtype at w (QUANTIZED WEIGHTS above).
 * work: work_bytes >= fx_qmatmul_workspace(wtype, m, k) bytes, any alignment (NULL when that is 0).  y must not
 * overlap x, w or work.  m = 0 or n_out = 0: nothing to do.  Returns FX_OK, FX_E_QTYPE, FX_E_QSHAPE (k, negative m
 * or n_out, NULL w / x / y / work where the sizes need them) or FX_E_OUTPUT (workspace too small), all before any
 * memory is read or written. */
int fx_qmatmul(int32_t wtype, const void *w, int64_t n_out, int64_t k, const float *x, int64_t m, float *y, void *work,
               int64_t work_bytes);

/* n weights sharing one input (q/k/v; gate/up), in ONE pool dispatch, x quantized once per format:
 * ys[j] [m][n_outs[j]] = x [m][k] @ W_j^T for j < n (0 <= n <= FX_QMM_MAX_MANY), W_j of type wtypes[j] at ws[j].
 * work: >= fx_qmatmul_workspace(t, m, k) for every type t of the call when they all quantize x the same way (all
 * 32-block types, or all K types); a call mixing 32-block and K types needs the two sizes' sum;
 * fx_qmatmul_workspace(FX_QT_ANY, m, k) covers every mix.  Errors as fx_qmatmul, checked for every weight before
 * any work. */
int fx_qmatmul_many(int32_t n, const int32_t *wtypes, const void *const *ws, const int64_t *n_outs, int64_t k,
                    const float *x, int64_t m, float *const *ys, void *work, int64_t work_bytes);

/* out [n_rows][k] fp32 = rows row0 .. row0 + n_rows - 1 of W (type wtype at w; row r at w + r * row_bytes), each
 * element the fp32 value of QUANTIZED WEIGHTS' formulas (bit for bit on every SIMD path).  Rows are split over the
 * pool.  FX_OK, FX_E_QTYPE, FX_E_QSHAPE (k, row0 < 0, n_rows < 0, NULL w / out when n_rows > 0). */
int fx_dequantize(int32_t wtype, const void *w, int64_t row0, int64_t n_rows, int64_t k, float *out);

/* out [n_rows][k] bf16 = fx_dequantize's fp32 values rounded to bf16, to nearest with ties to even (NaN -> 0x7fc0),
 * one pass over the rows with no fp32 copy of the matrix: the weights of a bf16 prefill GEMM.  Same errors. */
int fx_dequantize_bf16(int32_t wtype, const void *w, int64_t row0, int64_t n_rows, int64_t k, uint16_t *out);

/* ---------------------------------------------------------------------------------------------------------------
 * DECODER LAYER (fx_layer_qkv, fx_layer_out_mlp)
 *
 *   The work of a llama / qwen2 decoder layer around its attention, for the few rows of a decode step, with the
 *   weights in QUANTIZED WEIGHTS' formats: two calls per layer where the torch forward makes about twenty
 *   operations (each a dispatcher call of several microseconds, which at 4-8 bit weights is as much as the products).
 *   x [m][d], o [m][Hq D] and qkv [m][(Hq + 2 Hkv) D] are row-major fp32; D = head_dim, F = ffn.
 *
 *   fx_layer_qkv:  h = rms_norm(x) * attn_norm;  qkv = h @ [Wq; Wk; Wv]^T (+ qkv_bias);  then RoPE on the q and k
 *                  heads of each row (the v heads are left as they are).
 *   fx_layer_out_mlp:  x += o @ Wo^T;  h = rms_norm(x) * ffn_norm;  x += (silu(h @ Wgate^T) * (h @ Wup^T)) @ Wdown^T,
 *                  silu(g) = g / (1 + exp(-g)), x updated in place.
 *   rms_norm(x) = x / sqrt(mean(x^2) + eps) per row (the sum of squares in double).  Each product quantizes its
 *   input as QUANTIZED WEIGHTS says (fx_qmatmul_many: one pool dispatch for q/k/v, one for gate/up); the norms,
 *   bias, RoPE, silu and residual adds run on the calling thread (O(d + F) per row).
 *   RoPE: rope points at row 0's table row: cos [rope_dim] then sin_signed [rope_dim], row i at rope + i *
 *   rope_stride; for i < rope_dim of each head, x'[i] = x[i] cos[i] + x[pair(i)] sin_signed[i] with pair(i) = i ^ 1
 *   (rope_neox = 0: interleaved pairs) or (i + rope_dim / 2) % rope_dim (rope_neox = 1: half-split pairs); the
 *   elements from rope_dim on are left as they are (the sign of each pair's first member lives in sin_signed).
 *   Errors, all before any memory is written: FX_E_QSHAPE (a size not positive, rope_dim odd or above head_dim or
 *   above FX_LAYER_MAX_HEAD_DIM, n_heads not a multiple of n_kv_heads, a weight's n_out not its role's size, a NULL
 *   pointer the call needs, m < 0 or above FX_LAYER_MAX_ROWS), FX_E_QTYPE, FX_E_OUTPUT (workspace smaller than
 *   fx_layer_workspace(L, m)).  m = 0: nothing to do.  No call allocates memory.
 * ---------------------------------------------------------------------------------------------------------------
 */
#define FX_LAYER_MAX_ROWS 64       /* rows per call (decode batches; prefill chunks take the GEMM path) */
#define FX_LAYER_MAX_HEAD_DIM 1024

typedef struct fx_qweight {
    int32_t wtype;    /* FX_QT_* */
    const void *w;    /* n_out rows of the product's input width, QUANTIZED WEIGHTS' layout */
    int64_t n_out;
} fx_qweight;

typedef struct fx_qlayer {
    int32_t d, n_heads, n_kv_heads, head_dim, rope_dim, rope_neox, ffn;
    float eps;
    const float *attn_norm;   /* [d] */
    const float *ffn_norm;    /* [d] */
    const float *qkv_bias;    /* [(Hq + 2 Hkv) D], or NULL */
    fx_qweight q, k, v;       /* n_out Hq D, Hkv D, Hkv D; input width d */
    fx_qweight o;             /* n_out d; input width Hq D */
    fx_qweight gate, up;      /* n_out F; input width d */
    fx_qweight down;          /* n_out d; input width F */
} fx_qlayer;

/* Bytes of workspace the two calls need for m rows (any alignment); negative: -FX_E_QSHAPE / -FX_E_QTYPE. */
int64_t fx_layer_workspace(const fx_qlayer *L, int64_t m);
int fx_layer_qkv(const fx_qlayer *L, const float *x, int64_t m, const float *rope, int64_t rope_stride, float *qkv,
                 void *work, int64_t work_bytes);
int fx_layer_out_mlp(const fx_qlayer *L, float *x, const float *o, int64_t m, void *work, int64_t work_bytes);

/* ---------------------------------------------------------------------------------------------------------------
 * DENSE DECODE ATTENTION (fx_decode_attention)
 *
 *   One query token over all len keys of one sequence, fp32 K and V (the dense CPU KV cache): for query head j,
 *   KV head h = j / (n_heads / n_kv_heads), out[j] = softmax_t(scale * q[j] . K_h[t]) @ V_h, with K_h[t] at
 *   k + h * head_stride + t * head_dim (V likewise).  q, out: [n_heads][head_dim].  The keys are split in chunks of
 *   at most FX_DECODE_CHUNK per KV head (shorter, down to FX_DECODE_MIN_CHUNK, when that leaves fewer than two
 *   items per pool thread: a short context's K/V come from DRAM, and a few items would read them on a few cores),
 *   the items spread over the pool, each an online softmax whose partial results are merged by log-sum-exp (the
 *   sparse attention's arithmetic; fx_kernels' qk32 / pv32 per SIMD path).
 *   work: fx_decode_attention_workspace(...) floats, for the pool's size at that call (a resize in between makes
 *   the call fail with FX_E_OUTPUT, never write past work).  k_new, v_new: the newest token's key and value
 *   [n_kv_heads][head_dim], or NULL: when given, written at token len - 1 of each head (the decode step's append)
 *   before the attention reads it, so a step appends and attends in one call.  Errors before any write: FX_E_GROUP
 *   (n_heads not a multiple of n_kv_heads or a group above FX_MAX_GROUP), FX_E_QSHAPE (a size not positive, head_stride < len * head_dim, a
 *   NULL pointer), FX_E_OUTPUT (workspace too small).
 * ---------------------------------------------------------------------------------------------------------------
 */
#define FX_DECODE_CHUNK 256
#define FX_DECODE_MIN_CHUNK 32

int64_t fx_decode_attention_workspace(int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int64_t len);
int fx_decode_attention(const float *q, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, float *k, float *v,
                        int64_t head_stride, int64_t len, const float *k_new, const float *v_new, float scale,
                        float *out, float *work, int64_t work_floats);

/* ---------------------------------------------------------------------------------------------------------------
 * DENSE DECODE STEP (fx_decode_layers)
 *
 *   One token of one sequence through n_layers decoder layers over its dense fp32 KV cache, in one call: for each
 *   layer l in turn, qkv = fx_layer_qkv(layers[l], x, rope), then fx_decode_attention of its q over layer l's cache
 *   with its k and v appended at token pos (over pos + 1 tokens), then fx_layer_out_mlp(layers[l], x, that output).
 *   The same arithmetic as those calls made one by one, bit for bit: what it saves is a decode step's round trips
 *   between Python and C (three a layer).  x [d] is updated in place.  rope: the token's table row, cos [rope_dim]
 *   then sin_signed [rope_dim] (unused when rope_dim is 0).  The cache: layer l's head h at
 *   k + l * layer_stride + h * head_stride, token t at + t * head_dim (v likewise).  Every layer must have the
 *   first's d, n_heads, n_kv_heads and head_dim.  work: fx_decode_layers_workspace(layers, n_layers, pos) bytes,
 *   any alignment, for the pool's size at the call.  Errors before any write: those of the three calls for any
 *   layer, FX_E_QSHAPE (n_layers < 1, pos < 0, head_stride < (pos + 1) * head_dim, layer_stride < n_kv_heads *
 *   head_stride, layers of different shapes, a NULL pointer), FX_E_OUTPUT (workspace too small).
 * ---------------------------------------------------------------------------------------------------------------
 */
int64_t fx_decode_layers_workspace(const fx_qlayer *const *layers, int32_t n_layers, int64_t pos);
int fx_decode_layers(const fx_qlayer *const *layers, int32_t n_layers, float *x, const float *rope, float *k,
                     float *v, int64_t layer_stride, int64_t head_stride, int64_t pos, float scale, void *work,
                     int64_t work_bytes);

/* ---------------------------------------------------------------------------------------------------------------
 * SPARSE DECODE STEP (fx_sparse_decode_layers)
 *
 *   One token for each of m sequences (rows) through n_layers decoder layers over the host KV store, in one call:
 *   for each layer l in turn,
 *     1. qkv = fx_layer_qkv(layers[l], x, m, rope, rope_stride);
 *     2. each row's k and v rounded to the view's 16-bit dtype (to nearest even) and appended to slot slots[i] of
 *        views[l] (fx_append: the page for the token must be in the page table already);
 *     3. fx_select_attend_pinned over layer l's tasks, tasks[task_ends[l] .. task_ends[l + 1]) (their q_row is
 *        the row i, their rows[] the output row i * n_kv_heads + kv_head, strictly ascending), then
 *        fx_attend_spans over the same tasks: each (row, KV group)'s selected blocks and streaming part in one
 *        softmax, out [m][n_heads][head_dim];
 *     4. fx_layer_out_mlp(layers[l], x, out, m).
 *   The same arithmetic as those calls made one by one from the caller, bit for bit: what it saves is a layer's
 *   five round trips from Python.  x [m][d] is updated in place.  ids / scores / counts: [T][k_cap] / [T][k_cap] /
 *   [T] over all layers' tasks (T = task_ends[n_layers]), written as the calls write them.  pins / pin_counts:
 *   [T][pin_stride] / [T] as for fx_group_topk_pinned (pin_counts NULL: no pins in any layer; a task with count 0
 *   has none).  select_ws: fx_sparse_decode_select_floats(layers, n_layers, m, step) floats (what the selection,
 *   attention and spans of the largest layer need over the longest slot after the append; it grows with the
 *   context); work: fx_sparse_decode_workspace(layers, n_layers, m) bytes, any alignment.  read_tokens[0] / [1]: tokens selected / attended in streaming spans, summed over layers;
 *   seconds[0] / [1]: time selecting / attending.  Checks before any write: FX_E_QSHAPE (layers of different
 *   shapes, m outside [1, FX_LAYER_MAX_ROWS], views of another shape or dtype than the first, task_ends not
 *   starting at 0 or decreasing, a NULL pointer the call needs), FX_E_VIEW (a bad view), FX_E_SLOT (a slot out of
 *   range or twice), FX_E_SCORING, FX_E_OUTPUT (work or select_ws too small).  A layer's own calls check its tasks, so an error there (returned as that call returns it, with
 *   *err_layer = l and *err_index as the call set it) leaves x and the earlier layers' appends written: the step
 *   is then to be discarded with its sequences.
 * ---------------------------------------------------------------------------------------------------------------
 */
typedef struct fx_sparse_step {
    const fx_kv_view *const *views;  /* [n_layers]: each layer's view of one store (same slots, heads and dtype) */
    const int32_t *slots;            /* [m] the rows' store slots, distinct */
    const int32_t *tasks;            /* [T][FX_TASK_FIELDS], layer-major */
    const int64_t *task_ends;        /* [n_layers + 1], task_ends[0] = 0, non-decreasing */
    const int64_t *rows;             /* [T] each task's output row */
    int32_t k_cap, scoring;          /* as for fx_group_topk_pinned */
    const int32_t *pins, *pin_counts;
    int32_t pin_stride;
    int32_t *ids;
    float *scores;
    int32_t *counts;
    float scale;
} fx_sparse_step;

int64_t fx_sparse_decode_workspace(const fx_qlayer *const *layers, int32_t n_layers, int64_t m);
int64_t fx_sparse_decode_select_floats(const fx_qlayer *const *layers, int32_t n_layers, int64_t m,
                                       const fx_sparse_step *step);
int fx_sparse_decode_layers(const fx_qlayer *const *layers, int32_t n_layers, float *x, int64_t m, const float *rope,
                            int64_t rope_stride, const fx_sparse_step *step, float *select_ws,
                            int64_t select_ws_floats, void *work, int64_t work_bytes, int64_t *read_tokens,
                            double *seconds, int32_t *err_layer, int64_t *err_index);

/* The AVX-512 paths' integer dot products: on (the default), AVX512-VNNI where the CPU has it; off, AVX-512BW.
 * Returns 1 when VNNI is used from now on (on, and the CPU has AVX512-VNNI), else 0. */
int fx_set_vnni(int on);

#endif
